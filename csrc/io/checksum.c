/* checksum.c - CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), hardware and software.
 *
 * The hardware path feeds the crc32 instruction 8 bytes at a time. One chain of them is bound
 * by the instruction's latency (3 cycles for 8 bytes); the instruction issues once a cycle, so
 * the path runs three chains over three adjacent blocks at once and joins their crcs: the crc
 * of a block that follows another is linear in the register, reg(r, b) = shift(r, |b|) ^
 * reg(0, b), where shift(r, n) is the register after n zero bytes, a 32x32 GF(2) matrix that
 * tables of 4 x 256 entries apply (one per block size, built once). About three times the speed
 * of one chain (checkpoint loads check every byte they read on the same cores). The software
 * path is slicing-by-8 over tables built once. Both give identical results
 * (tests/c/test_checksum.c checks them against each other, at lengths that take every path,
 * and against the standard check value, CRC-32C("123456789") = 0xE3069283). */
#include "io/checksum.h"

#include <pthread.h>
#include <string.h>

#define ZP_CRC32C_POLY 0x82F63B78u

/* The hardware path's blocks: three of ZP_CRC_LONG bytes while they fit, then three of
 * ZP_CRC_SHORT, then one chain. Multiples of 8 bytes. */
#define ZP_CRC_LONG 8192
#define ZP_CRC_SHORT 256

static uint32_t zp_crc_table[8][256];
static uint32_t zp_crc_shift_long[4][256];  /* shift(r, ZP_CRC_LONG), a byte of r at a time */
static uint32_t zp_crc_shift_short[4][256]; /* shift(r, ZP_CRC_SHORT) */
static pthread_once_t zp_crc_once = PTHREAD_ONCE_INIT;
static int zp_crc_hw; /* the CPU has SSE4.2 (set once, with the tables) */

static uint32_t zp_crc_soft(uint32_t c, const unsigned char *p, size_t n);

/* The register after `n` zero bytes from register `c` (the slow way: the tables' build). */
static uint32_t zp_crc_zeros(uint32_t c, size_t n) {
  static const unsigned char zeros[256];
  for (; n > sizeof zeros; n -= sizeof zeros)
    c = zp_crc_soft(c, zeros, sizeof zeros);
  return zp_crc_soft(c, zeros, n);
}

/* t[k][j] = shift(j << 8k, n): shift is linear, so each entry is the xor of the shifts of
 * its bits (32 of them, computed the slow way). */
static void zp_crc_shift_tables(uint32_t t[4][256], size_t n) {
  uint32_t bit[32];
  for (int b = 0; b < 32; b++)
    bit[b] = zp_crc_zeros(1u << b, n);
  for (int k = 0; k < 4; k++)
    for (uint32_t j = 0; j < 256; j++) {
      uint32_t v = 0;
      for (int b = 0; b < 8; b++)
        if (j & (1u << b))
          v ^= bit[8 * k + b];
      t[k][j] = v;
    }
}

static void zp_crc_init(void) {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++)
      c = (c >> 1) ^ (ZP_CRC32C_POLY & (0u - (c & 1u)));
    zp_crc_table[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; i++)
    for (int t = 1; t < 8; t++)
      zp_crc_table[t][i] =
          (zp_crc_table[t - 1][i] >> 8) ^ zp_crc_table[0][zp_crc_table[t - 1][i] & 0xFF];
  zp_crc_shift_tables(zp_crc_shift_long, ZP_CRC_LONG);
  zp_crc_shift_tables(zp_crc_shift_short, ZP_CRC_SHORT);
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  zp_crc_hw = __builtin_cpu_supports("sse4.2");
#endif
}

static inline uint32_t zp_crc_shift(const uint32_t t[4][256], uint32_t c) {
  return t[0][c & 0xFF] ^ t[1][(c >> 8) & 0xFF] ^ t[2][(c >> 16) & 0xFF] ^ t[3][c >> 24];
}

static uint32_t zp_crc_soft(uint32_t c, const unsigned char *p, size_t n) {
  while (n && ((uintptr_t)p & 7)) {
    c = (c >> 8) ^ zp_crc_table[0][(c ^ *p++) & 0xFF];
    n--;
  }
  while (n >= 8) {
    uint64_t w;
    memcpy(&w, p, 8);
    w ^= c; /* little-endian: the low four bytes take the running crc */
    c = zp_crc_table[7][w & 0xFF] ^ zp_crc_table[6][(w >> 8) & 0xFF] ^
        zp_crc_table[5][(w >> 16) & 0xFF] ^ zp_crc_table[4][(w >> 24) & 0xFF] ^
        zp_crc_table[3][(w >> 32) & 0xFF] ^ zp_crc_table[2][(w >> 40) & 0xFF] ^
        zp_crc_table[1][(w >> 48) & 0xFF] ^ zp_crc_table[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--)
    c = (c >> 8) ^ zp_crc_table[0][(c ^ *p++) & 0xFF];
  return c;
}

#if defined(__x86_64__) && defined(__GNUC__)
/* Three chains over the three adjacent blocks of `block` bytes at p, joined: the register
 * after all three from register c. */
#define ZP_CRC_THREE(c, p, block, table)                                                        \
  do {                                                                                         \
    uint64_t c0 = (c), c1 = 0, c2 = 0;                                                         \
    for (size_t i = 0; i < (block); i += 8) {                                                  \
      uint64_t w0, w1, w2;                                                                     \
      memcpy(&w0, (p) + i, 8);                                                                 \
      memcpy(&w1, (p) + (block) + i, 8);                                                       \
      memcpy(&w2, (p) + 2 * (block) + i, 8);                                                   \
      c0 = __builtin_ia32_crc32di(c0, w0);                                                     \
      c1 = __builtin_ia32_crc32di(c1, w1);                                                     \
      c2 = __builtin_ia32_crc32di(c2, w2);                                                     \
    }                                                                                          \
    (c) = zp_crc_shift(table, zp_crc_shift(table, (uint32_t)c0) ^ (uint32_t)c1) ^ (uint32_t)c2; \
  } while (0)

__attribute__((target("sse4.2"))) static uint32_t zp_crc_hw_run(uint32_t c, const unsigned char *p,
                                                                size_t n) {
  uint64_t c64 = c;
  while (n && ((uintptr_t)p & 7)) {
    c64 = __builtin_ia32_crc32qi((uint32_t)c64, *p++);
    n--;
  }
  while (n >= 3 * ZP_CRC_LONG) {
    ZP_CRC_THREE(c64, p, ZP_CRC_LONG, zp_crc_shift_long);
    p += 3 * ZP_CRC_LONG;
    n -= 3 * ZP_CRC_LONG;
  }
  while (n >= 3 * ZP_CRC_SHORT) {
    ZP_CRC_THREE(c64, p, ZP_CRC_SHORT, zp_crc_shift_short);
    p += 3 * ZP_CRC_SHORT;
    n -= 3 * ZP_CRC_SHORT;
  }
  while (n >= 8) {
    uint64_t w;
    memcpy(&w, p, 8);
    c64 = __builtin_ia32_crc32di(c64, w);
    p += 8;
    n -= 8;
  }
  while (n--)
    c64 = __builtin_ia32_crc32qi((uint32_t)c64, *p++);
  return (uint32_t)c64;
}
#endif

uint32_t zp_crc32c_portable(uint32_t crc, const void *data, size_t n) {
  pthread_once(&zp_crc_once, zp_crc_init);
  return ~zp_crc_soft(~crc, (const unsigned char *)data, n);
}

uint32_t zp_crc32c(uint32_t crc, const void *data, size_t n) {
  pthread_once(&zp_crc_once, zp_crc_init);
#if defined(__x86_64__) && defined(__GNUC__)
  if (zp_crc_hw)
    return ~zp_crc_hw_run(~crc, (const unsigned char *)data, n);
#endif
  return ~zp_crc_soft(~crc, (const unsigned char *)data, n);
}

const char *zp_crc32c_impl(void) {
  pthread_once(&zp_crc_once, zp_crc_init);
  return zp_crc_hw ? "sse4.2" : "portable";
}
