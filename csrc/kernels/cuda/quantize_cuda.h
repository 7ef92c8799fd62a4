/* quantize_cuda.h - block quantization of communication buffers on CUDA: the format, rounding
 * and checks of kernels/cpu/quantize.h (int8 or int4 values, one fp32 scale per block; a
 * block holding an inf or a NaN gets scale NaN), so that a buffer quantized on one device
 * dequantizes to the same bits on the other.
 *
 * Each function enqueues one kernel on `stream` and returns without waiting (no workspace: the
 * arguments travel by value). The *_emulate functions run the kernels' own code, block by block
 * and thread by thread, on host memory: the CPU tests compare them with the C kernels bit for
 * bit, and the GPU tests compare the device with both. */
#ifndef ZP_QUANTIZE_CUDA_H
#define ZP_QUANTIZE_CUDA_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* x: n values of x_dtype (0 fp32, 1 bf16); bits 8 or 4; q: n bytes (int8) or (n + 1) / 2
 * (int4, element 2j in the low nibble); scales: ceil(n / block) floats. Device addresses.
 * noise: NULL (round to nearest even) or {seed, stream} (host memory): quantize.h's
 * stochastic rounding, the bits of zp_quantize_sr. */
zp_status zp_quantize_cuda(const void *x, int32_t x_dtype, int64_t n, int64_t block, int bits,
                           int8_t *q, float *scales, const uint64_t *noise, cudaStream_t stream);

/* out: n values of out_dtype (0 fp32, 1 bf16); accumulate (fp32 only): out += q * scale. */
zp_status zp_dequantize_cuda(const int8_t *q, const float *scales, int64_t n, int64_t block,
                             int bits, void *out, int32_t out_dtype, int32_t accumulate,
                             cudaStream_t stream);

zp_status zp_quantize_emulate(const void *x, int32_t x_dtype, int64_t n, int64_t block, int bits,
                              int8_t *q, float *scales, const uint64_t *noise);

zp_status zp_dequantize_emulate(const int8_t *q, const float *scales, int64_t n, int64_t block,
                                int bits, void *out, int32_t out_dtype, int32_t accumulate);

#ifdef __cplusplus
}
#endif

#endif /* ZP_QUANTIZE_CUDA_H */
