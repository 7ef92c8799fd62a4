/* quantize.cu - block quantization on CUDA (quantize_cuda.h), the bits of kernels/cpu/
 * quantize.c.
 *
 * Quantize: one thread block per quantization block. Each of its ZP_CU_THREADS threads takes
 * the block's elements tid, tid + 256, ...: their max |x| and whether all are finite, combined
 * over the threads through shared memory (a max is exact in any order, so the scale is the C
 * kernel's), then the same threads round their elements (int4: their bytes, two elements
 * each). Dequantize: one thread per element. Every float operation is the C kernel's: x * inv
 * rounded by rintf (to nearest even), or stochastically with convert.h's noise, clamped; q * scale; the bf16 rounding of convert.h. */
#include <math.h>

#include "kernels/cuda/elementwise.cuh"
#include "kernels/cuda/optim_cuda.h"
#include "kernels/cuda/quantize_cuda.h"

#define ZP_CUQ_MAX_BLOCK (1 << 24) /* quantize.c's ZP_Q_MAX_BLOCK */
#define ZP_CUQ_FLT_MAX 3.4028234663852886e38f

typedef struct {
  const void *x;
  int64_t n, block;
  int32_t dtype; /* of x (quantize) or out (dequantize) */
  int32_t bits;
  int8_t *q;
  float *scales;
  void *out;
  int32_t accumulate;
  int32_t stochastic; /* quantize with noise (seed, stream): quantize.c's zp_quantize_sr */
  uint64_t seed, stream;
} zp_cuq_args;

ZP_HD float zp_cuq_load(const zp_cuq_args *a, int64_t i) {
  return a->dtype == ZP_CU_F32 ? ((const float *)a->x)[i]
                               : zp_cu_from_bf16(((const uint16_t *)a->x)[i]);
}

ZP_HD int32_t zp_cuq_one(float x, float inv, float qmax) {
  float v = rintf(x * inv);
  v = v > qmax ? qmax : (v < -qmax ? -qmax : v);
  return (int32_t)v;
}

/* quantize.c's zp_q_one_sr (no contraction: --fmad=false, see elementwise.cuh). */
ZP_HD int32_t zp_cuq_one_sr(float x, float inv, float qmax, uint32_t r) {
  const float y = x * inv;
  float v = floorf(y);
  v += (y - v) * 65536.0f > (float)r ? 1.0f : 0.0f;
  v = v > qmax ? qmax : (v < -qmax ? -qmax : v);
  return (int32_t)v;
}

/* Element i of a block rounded to nearest or, stochastic, with the noise of its index (the
 * block's keys: `key` for the high bits hi32 of its first element, `key_next` past them). */
ZP_HD int32_t zp_cuq_round(const zp_cuq_args *a, int64_t i, float inv, float qmax,
                           uint64_t hi32, uint32_t key, uint32_t key_next) {
  const float x = zp_cuq_load(a, i);
  if (!a->stochastic)
    return zp_cuq_one(x, inv, qmax);
  const uint32_t k = ((uint64_t)i >> 32) == hi32 ? key : key_next;
  return zp_cuq_one_sr(x, inv, qmax, zp_cu_sr_bits(k, (uint32_t)i));
}

/* Thread tid's part of block b: the max |x| of its elements and whether they are finite. */
ZP_HD void zp_cuq_partial(const zp_cuq_args *a, int64_t b, int32_t tid, float *absmax,
                          int32_t *finite) {
  const int64_t lo = b * a->block, hi = lo + a->block < a->n ? lo + a->block : a->n;
  float m = 0.0f;
  int32_t fin = 1;
  for (int64_t i = lo + tid; i < hi; i += ZP_CU_THREADS) {
    const float v = fabsf(zp_cuq_load(a, i));
    fin &= v <= ZP_CUQ_FLT_MAX; /* false for inf and NaN */
    m = v > m ? v : m;
  }
  *absmax = m;
  *finite = fin;
}

/* Thread tid's writes for block b, given the block's max |x| and finiteness. */
ZP_HD void zp_cuq_write(const zp_cuq_args *a, int64_t b, int32_t tid, float absmax,
                        int32_t finite) {
  const float qmax = a->bits == 8 ? 127.0f : 7.0f;
  const int64_t lo = b * a->block, hi = lo + a->block < a->n ? lo + a->block : a->n;
  const int32_t zero = !finite || absmax == 0.0f;
  const float inv = zero ? 0.0f : qmax / absmax;
  if (tid == 0)
    a->scales[b] = !finite ? zp_cu_float(0x7FC00000u) : (zero ? 0.0f : absmax / qmax);
  const uint64_t hi32 = (uint64_t)lo >> 32;
  const uint32_t key = a->stochastic ? zp_cu_sr_key(a->seed, a->stream, hi32) : 0u;
  const uint32_t key_next = a->stochastic ? zp_cu_sr_key(a->seed, a->stream, hi32 + 1) : 0u;
  if (a->bits == 8) {
    for (int64_t i = lo + tid; i < hi; i += ZP_CU_THREADS)
      a->q[i] = zero ? (int8_t)0 : (int8_t)zp_cuq_round(a, i, inv, qmax, hi32, key, key_next);
    return;
  }
  uint8_t *out = (uint8_t *)a->q;
  for (int64_t i = lo + 2 * (int64_t)tid; i < hi; i += 2 * ZP_CU_THREADS) {
    int32_t v0 = 0, v1 = 0;
    if (!zero) {
      v0 = zp_cuq_round(a, i, inv, qmax, hi32, key, key_next);
      v1 = i + 1 < hi ? zp_cuq_round(a, i + 1, inv, qmax, hi32, key, key_next) : 0;
    }
    out[i / 2] = (uint8_t)((v0 & 0xF) | ((v1 & 0xF) << 4));
  }
}

__global__ void __launch_bounds__(ZP_CU_THREADS) zp_cuq_quantize_kernel(zp_cuq_args a) {
  __shared__ float m[ZP_CU_THREADS];
  __shared__ int32_t f[ZP_CU_THREADS];
  const int32_t tid = (int32_t)threadIdx.x;
  const int64_t b = (int64_t)blockIdx.x;
  zp_cuq_partial(&a, b, tid, &m[tid], &f[tid]);
  __syncthreads();
  for (int w = ZP_CU_THREADS / 2; w > 0; w >>= 1) {
    if (tid < w) {
      m[tid] = m[tid + w] > m[tid] ? m[tid + w] : m[tid];
      f[tid] &= f[tid + w];
    }
    __syncthreads();
  }
  zp_cuq_write(&a, b, tid, m[0], f[0]);
}

ZP_HD void zp_cuq_dequantize_one(const zp_cuq_args *a, int64_t i) {
  int32_t v;
  if (a->bits == 8) {
    v = a->q[i];
  } else {
    const uint8_t byte = ((const uint8_t *)a->q)[i / 2];
    v = (i & 1) ? (byte >> 4) : (byte & 0xF);
    v = v >= 8 ? v - 16 : v;
  }
  const float x = (float)v * a->scales[i / a->block];
  if (a->dtype == ZP_CU_F32) {
    float *o = (float *)a->out;
    o[i] = a->accumulate ? o[i] + x : x;
  } else {
    ((uint16_t *)a->out)[i] = zp_cu_to_bf16(x);
  }
}

__global__ void __launch_bounds__(ZP_CU_THREADS) zp_cuq_dequantize_kernel(zp_cuq_args a) {
  const int64_t i = (int64_t)blockIdx.x * ZP_CU_THREADS + threadIdx.x;
  if (i < a.n)
    zp_cuq_dequantize_one(&a, i);
}

/* quantize.c's checks, with its messages, plus the grid's limit. */
static zp_status zp_cuq_check(const char *fn, int32_t dtype, int64_t n, int64_t block, int bits,
                              const void *p0, const void *p1, const void *p2) {
  if (bits != 8 && bits != 4)
    return zp_fail(ZP_ERR_INVALID, "%s: bits must be 8 or 4, got %d", fn, bits);
  if (dtype != ZP_CU_F32 && dtype != ZP_CU_BF16)
    return zp_fail(ZP_ERR_INVALID, "%s: values must be float32 or bfloat16 (dtype code %d)", fn,
                   (int)dtype);
  if (n < 0)
    return zp_fail(ZP_ERR_INVALID, "%s: n must be >= 0, got %lld", fn, (long long)n);
  if (block < 1 || block > ZP_CUQ_MAX_BLOCK || (bits == 4 && block % 2))
    return zp_fail(ZP_ERR_INVALID, "%s: block must be in [1, 2**24]%s, got %lld", fn,
                   bits == 4 ? " and even (int4 packs two values per byte)" : "",
                   (long long)block);
  if (n > 0 && (p0 == NULL || p1 == NULL || p2 == NULL))
    return zp_fail(ZP_ERR_INVALID, "%s: a buffer is NULL", fn);
  if ((n + ZP_CU_THREADS - 1) / ZP_CU_THREADS > INT32_MAX)
    return zp_fail(ZP_ERR_RANGE, "%s: %lld values exceed one launch; split the buffer", fn,
                   (long long)n);
  return ZP_OK;
}

static zp_cuq_args zp_cuq_make(const void *x, int32_t dtype, int64_t n, int64_t block, int bits,
                               const int8_t *q, const float *scales, void *out,
                               int32_t accumulate) {
  zp_cuq_args a;
  a.x = x, a.n = n, a.block = block, a.dtype = dtype, a.bits = bits;
  a.q = (int8_t *)q, a.scales = (float *)scales, a.out = out, a.accumulate = accumulate;
  a.stochastic = 0, a.seed = 0, a.stream = 0;
  return a;
}

/* The quantize arguments, with noise = {seed, stream} (stochastic rounding) or NULL. */
static zp_cuq_args zp_cuq_make_q(const void *x, int32_t dtype, int64_t n, int64_t block,
                                 int bits, int8_t *q, float *scales, const uint64_t *noise) {
  zp_cuq_args a = zp_cuq_make(x, dtype, n, block, bits, q, scales, NULL, 0);
  if (noise != NULL)
    a.stochastic = 1, a.seed = noise[0], a.stream = noise[1];
  return a;
}

extern "C" zp_status zp_quantize_cuda(const void *x, int32_t x_dtype, int64_t n, int64_t block,
                                      int bits, int8_t *q, float *scales, const uint64_t *noise,
                                      cudaStream_t stream) {
  ZP_TRY(zp_cuq_check("quantize", x_dtype, n, block, bits, x, q, scales));
  if (n == 0)
    return ZP_OK;
  const zp_cuq_args a = zp_cuq_make_q(x, x_dtype, n, block, bits, q, scales, noise);
  zp_cuq_quantize_kernel<<<(unsigned)((n - 1) / block + 1), ZP_CU_THREADS, 0, stream>>>(a);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? ZP_OK : zp_cuda_fail("quantize: launch", e);
}

extern "C" zp_status zp_dequantize_cuda(const int8_t *q, const float *scales, int64_t n,
                                        int64_t block, int bits, void *out, int32_t out_dtype,
                                        int32_t accumulate, cudaStream_t stream) {
  ZP_TRY(zp_cuq_check("dequantize", out_dtype, n, block, bits, q, scales, out));
  if (accumulate && out_dtype != ZP_CU_F32)
    return zp_fail(ZP_ERR_INVALID, "dequantize: accumulate needs a float32 output");
  if (n == 0)
    return ZP_OK;
  const zp_cuq_args a = zp_cuq_make(NULL, out_dtype, n, block, bits, q, scales, out, accumulate);
  zp_cuq_dequantize_kernel<<<(unsigned)((n - 1) / ZP_CU_THREADS + 1), ZP_CU_THREADS, 0,
                             stream>>>(a);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? ZP_OK : zp_cuda_fail("dequantize: launch", e);
}

extern "C" zp_status zp_quantize_emulate(const void *x, int32_t x_dtype, int64_t n,
                                         int64_t block, int bits, int8_t *q, float *scales,
                                         const uint64_t *noise) {
  ZP_TRY(zp_cuq_check("quantize", x_dtype, n, block, bits, x, q, scales));
  const zp_cuq_args a = zp_cuq_make_q(x, x_dtype, n, block, bits, q, scales, noise);
  const int64_t n_blocks = n == 0 ? 0 : (n - 1) / block + 1;
  for (int64_t b = 0; b < n_blocks; b++) {
    float m[ZP_CU_THREADS];
    int32_t f[ZP_CU_THREADS];
    for (int32_t tid = 0; tid < ZP_CU_THREADS; tid++)
      zp_cuq_partial(&a, b, tid, &m[tid], &f[tid]);
    for (int w = ZP_CU_THREADS / 2; w > 0; w >>= 1)
      for (int32_t tid = 0; tid < w; tid++) {
        m[tid] = m[tid + w] > m[tid] ? m[tid + w] : m[tid];
        f[tid] &= f[tid + w];
      }
    for (int32_t tid = 0; tid < ZP_CU_THREADS; tid++)
      zp_cuq_write(&a, b, tid, m[0], f[0]);
  }
  return ZP_OK;
}

extern "C" zp_status zp_dequantize_emulate(const int8_t *q, const float *scales, int64_t n,
                                           int64_t block, int bits, void *out, int32_t out_dtype,
                                           int32_t accumulate) {
  ZP_TRY(zp_cuq_check("dequantize", out_dtype, n, block, bits, q, scales, out));
  if (accumulate && out_dtype != ZP_CU_F32)
    return zp_fail(ZP_ERR_INVALID, "dequantize: accumulate needs a float32 output");
  const zp_cuq_args a = zp_cuq_make(NULL, out_dtype, n, block, bits, q, scales, out, accumulate);
  for (int64_t i = 0; i < n; i++)
    zp_cuq_dequantize_one(&a, i);
  return ZP_OK;
}
