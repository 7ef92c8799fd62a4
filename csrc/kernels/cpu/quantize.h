/* quantize.h - block quantization of communication buffers (ZeRO++'s int8 weights and int8/
 * int4 gradients): fp32 or bf16 values in blocks, each with one fp32 scale.
 *
 * Definition (the slow reference in tests/test_quantize.py is this, in torch ops):
 *   for each block of `block` elements (the last may be shorter), absmax = max |x|;
 *   Q = 127 (int8) or 7 (int4); inv = Q / absmax (fp32); q = rint(x * inv) clamped to [-Q, Q]
 *   (round half to even); scale = absmax / Q (fp32). A block of zeros has scale 0 and q 0. A
 *   block holding an inf or a NaN gets scale NaN (so it dequantizes to NaN everywhere: an
 *   overflow stays visible to loss scaling) and q 0.
 *   Stochastic rounding (zp_quantize_sr, ZeRO++ gradients): y = x * inv, f = floorf(y),
 *   q = f + 1 where (y - f) * 65536 > r, else f, clamped, where r = zp_sr_bits(zp_sr_key(seed,
 *   stream, i >> 32), i) (convert.h: 16 bits of noise per element index i of the call), so
 *   E[q] = y to 2^-16 of a step, and the bits depend on (seed, stream, i) only.
 *   dequantized x' = q * scale (fp32), written as fp32 or bf16 (round to nearest even), or
 *   added to an fp32 output (accumulate: the fp32 sum of a quantized reduction).
 *   int4 packs two values per byte, element 2j in the low nibble, 2j + 1 in the high one (4-bit
 *   two's complement); `block` must be even so that a block starts on a byte.
 * Every instruction set gives the same bits as the scalar path; results do not depend on the
 * thread count. */
#ifndef ZP_QUANTIZE_H
#define ZP_QUANTIZE_H

#include <stdint.h>

#include "common/status.h"
#include "kernels/contract.h" /* zp_dtype */

/* bits: 8 or 4. x: n values of x_dtype (ZP_F32 or ZP_BF16). q: n bytes (int8) or (n + 1) / 2
 * (int4); scales: ceil(n / block) floats. */
zp_status zp_quantize(const void *x, zp_dtype x_dtype, int64_t n, int64_t block, int bits,
                      int8_t *q, float *scales, int32_t n_threads);

/* zp_quantize with stochastic rounding (see above): the noise of element i is a function of
 * (seed, stream, i), whatever the thread count or instruction set. */
zp_status zp_quantize_sr(const void *x, zp_dtype x_dtype, int64_t n, int64_t block, int bits,
                         int8_t *q, float *scales, uint64_t seed, uint64_t stream,
                         int32_t n_threads);

/* out: n values of out_dtype (ZP_F32 or ZP_BF16); accumulate (fp32 only): out += x'. */
zp_status zp_dequantize(const int8_t *q, const float *scales, int64_t n, int64_t block, int bits,
                        void *out, zp_dtype out_dtype, int accumulate, int32_t n_threads);

#endif /* ZP_QUANTIZE_H */
