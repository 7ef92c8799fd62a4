/* quantize.c - block quantization (quantize.h): one body per direction, written so that the
 * compiler vectorizes it, instantiated for the scalar, AVX2 and AVX-512 targets and chosen by
 * zp_isa_pick(); threads take whole blocks (zp_parallel_for), so the split changes nothing. */
#include "kernels/cpu/quantize.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "common/parallel.h"
#include "kernels/cpu/convert.h"

#define ZP_Q_MAX_BLOCK (1 << 24)

typedef struct {
  const void *x;
  zp_dtype dtype;
  int64_t n, block;
  int bits;
  int8_t *q;
  float *scales;
  void *out;
  int accumulate;
  zp_isa isa;
  int stochastic;  /* zp_quantize_sr: round with the noise of (seed, stream, element index) */
  uint64_t seed, stream;
} zp_q_job;

static inline __attribute__((always_inline)) float zp_q_load(const void *x, zp_dtype dt,
                                                             int64_t i) {
  return dt == ZP_F32 ? ((const float *)x)[i] : zp_bf16_to_f32(((const uint16_t *)x)[i]);
}

static inline __attribute__((always_inline)) int32_t zp_q_one(float x, float inv, float qmax) {
  float v = rintf(x * inv);
  v = v > qmax ? qmax : (v < -qmax ? -qmax : v);
  return (int32_t)v;
}

/* Stochastic rounding of x * inv with 16 bits of noise r (quantize.h): up with probability
 * (y - floor(y)), to 2^-16. No addition of the noise, so no fused multiply-add can change the
 * bits between targets (CUDA's zp_cuq_one_sr is the same expression). */
static inline __attribute__((always_inline)) int32_t zp_q_one_sr(float x, float inv, float qmax,
                                                                 uint32_t r) {
  const float y = x * inv;
  float v = floorf(y);
  v += (y - v) * 65536.0f > (float)r ? 1.0f : 0.0f;
  v = v > qmax ? qmax : (v < -qmax ? -qmax : v);
  return (int32_t)v;
}

/* Stochastic rounding of element i (zp_q_one_sr with its noise). A block holds at most 2^24
 * elements, so it crosses at most one multiple of 2^32: `key` is the key of the high bits of
 * the block's first element (hi32), `key_next` of the next. */
#define ZP_Q_SR(i, xv)                                                                        \
  zp_q_one_sr((xv), inv, qmax,                                                                \
              zp_sr_bits(((uint64_t)(i) >> 32) == hi32 ? key : key_next, (uint32_t)(i)))
#define ZP_Q_RN(i, xv) zp_q_one((xv), inv, qmax)

/* The rounding pass of one block [lo, hi) with ROUND(i, x): straight into q (int8) or into
 * packed pairs (int4). */
#define ZP_Q_WRITE(LOAD, ROUND)                                                               \
  do {                                                                                        \
    if (j->bits == 8) {                                                                       \
      int8_t *q = j->q;                                                                       \
      for (int64_t i = lo; i < hi; i++)                                                       \
        q[i] = (int8_t)ROUND(i, LOAD(i));                                                     \
    } else {                                                                                  \
      uint8_t *out = (uint8_t *)j->q;                                                         \
      const int64_t pairs_end = lo + ((hi - lo) & ~(int64_t)1);                               \
      for (int64_t i = lo; i < pairs_end; i += 2)                                             \
        out[i / 2] = (uint8_t)((ROUND(i, LOAD(i)) & 0xF) |                                    \
                               ((ROUND(i + 1, LOAD(i + 1)) & 0xF) << 4));                     \
      if (pairs_end < hi) /* an odd last value: its high nibble is 0 */                       \
        out[pairs_end / 2] = (uint8_t)(ROUND(pairs_end, LOAD(pairs_end)) & 0xF);              \
    }                                                                                         \
  } while (0)

/* One block [lo, hi) of values read by LOAD(i): the absmax pass, then the rounding pass. A
 * macro, so that each dtype and rounding gets its own loops with the load inlined (the
 * compiler vectorizes them per target). */
#define ZP_Q_BLOCK(LOAD)                                                                      \
  do {                                                                                        \
    float absmax = 0.0f;                                                                      \
    int finite = 1;                                                                           \
    for (int64_t i = lo; i < hi; i++) {                                                       \
      float a = fabsf(LOAD(i));                                                               \
      finite &= a <= 3.4028234663852886e38f; /* false for inf and NaN */                      \
      absmax = a > absmax ? a : absmax;                                                       \
    }                                                                                         \
    const int zero = !finite || absmax == 0.0f;                                               \
    const float inv = zero ? 0.0f : qmax / absmax;                                            \
    j->scales[b] = !finite ? NAN : (zero ? 0.0f : absmax / qmax);                             \
    if (zero) {                                                                               \
      memset((uint8_t *)j->q + (j->bits == 8 ? lo : lo / 2), 0,                               \
             (size_t)(j->bits == 8 ? hi - lo : (hi - lo + 1) / 2));                           \
    } else if (j->stochastic) {                                                               \
      const uint64_t hi32 = (uint64_t)lo >> 32;                                               \
      const uint32_t key = zp_sr_key(j->seed, j->stream, hi32);                               \
      const uint32_t key_next = zp_sr_key(j->seed, j->stream, hi32 + 1);                      \
      ZP_Q_WRITE(LOAD, ZP_Q_SR);                                                              \
    } else {                                                                                  \
      ZP_Q_WRITE(LOAD, ZP_Q_RN);                                                              \
    }                                                                                         \
  } while (0)

static inline __attribute__((always_inline)) void zp_q_range(zp_q_job *j, int64_t b0,
                                                             int64_t b1) {
  const float qmax = j->bits == 8 ? 127.0f : 7.0f;
  const float *xf = (const float *)j->x;
  const uint16_t *xh = (const uint16_t *)j->x;
#define ZP_LOAD_F32(i) (xf[i])
#define ZP_LOAD_BF16(i) (zp_bf16_to_f32(xh[i]))
  for (int64_t b = b0; b < b1; b++) {
    const int64_t lo = b * j->block, hi = lo + j->block < j->n ? lo + j->block : j->n;
    if (j->dtype == ZP_F32)
      ZP_Q_BLOCK(ZP_LOAD_F32);
    else
      ZP_Q_BLOCK(ZP_LOAD_BF16);
  }
#undef ZP_LOAD_F32
#undef ZP_LOAD_BF16
}

static inline __attribute__((always_inline)) void zp_dq_range(zp_q_job *j, int64_t b0,
                                                              int64_t b1) {
  for (int64_t b = b0; b < b1; b++) {
    const int64_t lo = b * j->block, hi = lo + j->block < j->n ? lo + j->block : j->n;
    const float s = j->scales[b];
    for (int64_t i = lo; i < hi; i++) {
      int32_t v;
      if (j->bits == 8) {
        v = j->q[i];
      } else {
        uint8_t byte = ((const uint8_t *)j->q)[i / 2];
        v = (i & 1) ? (byte >> 4) : (byte & 0xF);
        v = v >= 8 ? v - 16 : v;
      }
      float x = (float)v * s;
      if (j->dtype == ZP_F32) {
        float *o = (float *)j->out;
        o[i] = j->accumulate ? o[i] + x : x;
      } else {
        ((uint16_t *)j->out)[i] = zp_f32_to_bf16(x);
      }
    }
  }
}

static void zp_q_scalar(void *ctx, int64_t b0, int64_t b1) { zp_q_range(ctx, b0, b1); }
static void zp_dq_scalar(void *ctx, int64_t b0, int64_t b1) { zp_dq_range(ctx, b0, b1); }
#if defined(__x86_64__)
__attribute__((target("avx2,fma,f16c"))) static void zp_q_avx2(void *ctx, int64_t b0,
                                                               int64_t b1) {
  zp_q_range(ctx, b0, b1);
}
__attribute__((target("avx2,fma,f16c"))) static void zp_dq_avx2(void *ctx, int64_t b0,
                                                                int64_t b1) {
  zp_dq_range(ctx, b0, b1);
}
__attribute__((target("avx512f"))) static void zp_q_avx512(void *ctx, int64_t b0, int64_t b1) {
  zp_q_range(ctx, b0, b1);
}
__attribute__((target("avx512f"))) static void zp_dq_avx512(void *ctx, int64_t b0,
                                                            int64_t b1) {
  zp_dq_range(ctx, b0, b1);
}
#endif

static zp_status zp_q_check(const char *fn, zp_dtype dtype, int64_t n, int64_t block, int bits,
                            const void *a, const void *b, const void *c) {
  if (bits != 8 && bits != 4)
    return zp_fail(ZP_ERR_INVALID, "%s: bits must be 8 or 4, got %d", fn, bits);
  if (dtype != ZP_F32 && dtype != ZP_BF16)
    return zp_fail(ZP_ERR_INVALID, "%s: values must be float32 or bfloat16 (dtype code %d)", fn,
                   (int)dtype);
  if (n < 0)
    return zp_fail(ZP_ERR_INVALID, "%s: n must be >= 0, got %lld", fn, (long long)n);
  if (block < 1 || block > ZP_Q_MAX_BLOCK || (bits == 4 && block % 2))
    return zp_fail(ZP_ERR_INVALID, "%s: block must be in [1, 2**24]%s, got %lld", fn,
                   bits == 4 ? " and even (int4 packs two values per byte)" : "",
                   (long long)block);
  if (n > 0 && (a == NULL || b == NULL || c == NULL))
    return zp_fail(ZP_ERR_INVALID, "%s: a buffer is NULL", fn);
  return ZP_OK;
}

static int32_t zp_q_threads(int32_t n_threads) {
  return n_threads > 0 ? n_threads : zp_default_threads();
}

static zp_status zp_quantize_job(zp_q_job job, int32_t n_threads) {
  const int64_t n = job.n, block = job.block;
  zp_range_fn fn = zp_q_scalar;
#if defined(__x86_64__)
  fn = job.isa == ZP_ISA_AVX512 ? zp_q_avx512 : job.isa == ZP_ISA_AVX2 ? zp_q_avx2 : fn;
#endif
  const int64_t n_blocks = (n - 1) / block + 1;
  const int64_t per = (1 << 16) / block + 1; /* blocks per thread at the least: 64K values */
  return zp_parallel_for(n_blocks, zp_q_threads(n_threads), 1, per, fn, &job);
}

zp_status zp_quantize(const void *x, zp_dtype x_dtype, int64_t n, int64_t block, int bits,
                      int8_t *q, float *scales, int32_t n_threads) {
  ZP_TRY(zp_q_check("quantize", x_dtype, n, block, bits, x, q, scales));
  if (n == 0)
    return ZP_OK;
  zp_q_job job = {x, x_dtype, n, block, bits, q, scales, NULL, 0, zp_isa_pick(), 0, 0, 0};
  return zp_quantize_job(job, n_threads);
}

zp_status zp_quantize_sr(const void *x, zp_dtype x_dtype, int64_t n, int64_t block, int bits,
                         int8_t *q, float *scales, uint64_t seed, uint64_t stream,
                         int32_t n_threads) {
  ZP_TRY(zp_q_check("quantize_sr", x_dtype, n, block, bits, x, q, scales));
  if (n == 0)
    return ZP_OK;
  zp_q_job job = {x, x_dtype, n, block, bits, q, scales, NULL, 0, zp_isa_pick(), 1, seed,
                  stream};
  return zp_quantize_job(job, n_threads);
}

zp_status zp_dequantize(const int8_t *q, const float *scales, int64_t n, int64_t block, int bits,
                        void *out, zp_dtype out_dtype, int accumulate, int32_t n_threads) {
  ZP_TRY(zp_q_check("dequantize", out_dtype, n, block, bits, q, scales, out));
  if (accumulate && out_dtype != ZP_F32)
    return zp_fail(ZP_ERR_INVALID, "dequantize: accumulate needs a float32 output");
  if (n == 0)
    return ZP_OK;
  zp_q_job job = {NULL, out_dtype, n, block, bits, (int8_t *)q, (float *)scales, out,
                  accumulate, zp_isa_pick(), 0, 0, 0};
  zp_range_fn fn = zp_dq_scalar;
#if defined(__x86_64__)
  fn = job.isa == ZP_ISA_AVX512 ? zp_dq_avx512 : job.isa == ZP_ISA_AVX2 ? zp_dq_avx2 : fn;
#endif
  const int64_t n_blocks = (n - 1) / block + 1;
  const int64_t per = (1 << 16) / block + 1;
  return zp_parallel_for(n_blocks, zp_q_threads(n_threads), 1, per, fn, &job);
}
