/* test_checksum.c - CRC-32C: the standard check value, hardware against software on random
 * buffers at every alignment and length, and continuation (a checksum in pieces). */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "io/checksum.h"

void test_checksum_known_values(void) {
  CHECK_EQ(zp_crc32c(0, "123456789", 9), 0xE3069283u);
  CHECK_EQ(zp_crc32c_portable(0, "123456789", 9), 0xE3069283u);
  CHECK_EQ(zp_crc32c(0, "", 0), 0u);
  unsigned char zeros[32] = {0};
  CHECK_EQ(zp_crc32c(0, zeros, 32), 0x8A9136AAu); /* RFC 3720, B.4: 32 bytes of zeros */
  CHECK(strcmp(zp_crc32c_impl(), "sse4.2") == 0 || strcmp(zp_crc32c_impl(), "portable") == 0);
}

void test_checksum_paths_agree(void) {
  enum { N = 4096 + 64 };
  unsigned char *buf = malloc(N);
  if (!CHECK(buf != NULL))
    return;
  zt_rng rng = zt_rng_seed(7);
  for (int i = 0; i < N; i++)
    buf[i] = (unsigned char)(zt_next(&rng) >> 33);
  for (int off = 0; off < 16; off++)
    for (int len = 0; len < 300; len += 1 + len / 7) {
      uint32_t hw = zp_crc32c(0, buf + off, (size_t)len);
      CHECK_MSG(hw == zp_crc32c_portable(0, buf + off, (size_t)len), "off %d len %d", off, len);
    }
  uint32_t whole = zp_crc32c(0, buf, N);
  CHECK_EQ(whole, zp_crc32c_portable(0, buf, N));
  for (int cut = 0; cut <= N; cut += 509)
    CHECK_EQ(zp_crc32c(zp_crc32c(0, buf, (size_t)cut), buf + cut, (size_t)(N - cut)), whole);
  buf[1234] ^= 0x10; /* one flipped bit changes it */
  CHECK(zp_crc32c(0, buf, N) != whole);
  free(buf);
}

/* Lengths around the hardware path's block sizes (three chains of 8192, then of 256 bytes,
 * then one), at every alignment, against the software path; and continuation across them. */
void test_checksum_three_chains(void) {
  enum { N = 4 * 3 * 8192 + 3 * 256 + 64 };
  unsigned char *buf = malloc(N);
  if (!CHECK(buf != NULL))
    return;
  zt_rng rng = zt_rng_seed(11);
  for (int i = 0; i < N; i++)
    buf[i] = (unsigned char)(zt_next(&rng) >> 33);
  const size_t lens[] = {767, 768, 769, 3 * 256 + 8, 2 * 768 + 7, 24575, 24576, 24577,
                         24576 + 768, 24576 + 767, 2 * 24576 + 3 * 256 + 15, N - 16};
  for (int off = 0; off < 16; off += 3)
    for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++) {
      uint32_t hw = zp_crc32c(0x1234567u, buf + off, lens[k]);
      CHECK_MSG(hw == zp_crc32c_portable(0x1234567u, buf + off, lens[k]), "off %d len %zu", off,
                lens[k]);
    }
  uint32_t whole = zp_crc32c_portable(0, buf, N);
  CHECK_EQ(zp_crc32c(0, buf, N), whole);
  for (size_t cut = 0; cut <= N; cut += 8191)
    CHECK_EQ(zp_crc32c(zp_crc32c(0, buf, cut), buf + cut, N - cut), whole);
  buf[3 * 8192 + 5] ^= 0x01; /* a bit of the second chain's block */
  CHECK(zp_crc32c(0, buf, N) != whole);
  free(buf);
}
