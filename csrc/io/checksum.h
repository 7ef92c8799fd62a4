/* checksum.h - CRC-32C (Castagnoli) of byte buffers: the checksum of every checkpoint file.
 *
 * The SSE4.2 crc32 instruction where the CPU has it (chosen once, at the first call), else a
 * table-driven software path with the same result. Pure computation: no I/O, no allocation. */
#ifndef ZP_CHECKSUM_H
#define ZP_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>

/* CRC-32C of `n` bytes at `data`, continuing from `crc` (0 for a fresh checksum): so
 * zp_crc32c(zp_crc32c(0, a, na), b, nb) is the checksum of a followed by b. */
uint32_t zp_crc32c(uint32_t crc, const void *data, size_t n);

/* The software path alone (tests compare the two). */
uint32_t zp_crc32c_portable(uint32_t crc, const void *data, size_t n);

/* "sse4.2" or "portable": what zp_crc32c uses on this CPU. */
const char *zp_crc32c_impl(void);

#endif /* ZP_CHECKSUM_H */
