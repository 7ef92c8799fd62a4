/* checksum.c - CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), hardware and software.
 *
 * The hardware path feeds the crc32 instruction 8 bytes at a time (its latency, 3 cycles,
 * bounds it near 8 bytes per 3 cycles: several GB/s, faster than the disk it checks); the
 * software path is slicing-by-8 over tables built once. Both give identical results
 * (tests/c/test_checksum.c checks them against each other and against the standard check
 * value, CRC-32C("123456789") = 0xE3069283). */
#include "io/checksum.h"

#include <pthread.h>
#include <string.h>

#define ZP_CRC32C_POLY 0x82F63B78u

static uint32_t zp_crc_table[8][256];
static pthread_once_t zp_crc_once = PTHREAD_ONCE_INIT;
static int zp_crc_hw; /* the CPU has SSE4.2 (set once, with the tables) */

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
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  zp_crc_hw = __builtin_cpu_supports("sse4.2");
#endif
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
__attribute__((target("sse4.2"))) static uint32_t zp_crc_hw_run(uint32_t c, const unsigned char *p,
                                                                size_t n) {
  uint64_t c64 = c;
  while (n && ((uintptr_t)p & 7)) {
    c64 = __builtin_ia32_crc32qi((uint32_t)c64, *p++);
    n--;
  }
  while (n >= 32) { /* unrolled: the loop overhead is not on the crc's dependency chain */
    uint64_t w[4];
    memcpy(w, p, 32);
    c64 = __builtin_ia32_crc32di(c64, w[0]);
    c64 = __builtin_ia32_crc32di(c64, w[1]);
    c64 = __builtin_ia32_crc32di(c64, w[2]);
    c64 = __builtin_ia32_crc32di(c64, w[3]);
    p += 32;
    n -= 32;
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
