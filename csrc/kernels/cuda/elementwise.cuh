/* elementwise.cuh - the per-element math of the CUDA kernels, as __host__ __device__ code:
 * fp32 <-> bf16/fp16 conversions, the stochastic-rounding hash, the optimizer family's update
 * of one element (its coefficients, zp_opt_coef, are the CPU family's: kernels/optim_common.h),
 * and the vector loads and stores of 4 elements.
 *
 * Invariant: every function gives the bits of its twin in the CPU family
 * (kernels/cpu/convert.h, kernels/cpu/optim.c): the same float operations in the same order,
 * fmaf only where the CPU writes fma, conversions in integer arithmetic (no cvt instruction:
 * their NaN payloads differ from the CPU's). That holds on the device only when compiled with
 * --fmad=false, IEEE division and sqrt and no flush-to-zero (setup.py's nvcc flags), and on
 * the host (the *_emulate functions) with -ffp-contract=off. */
#ifndef ZP_CUDA_ELEMENTWISE_CUH
#define ZP_CUDA_ELEMENTWISE_CUH

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/optim_common.h"

#define ZP_HD static __host__ __device__ __forceinline__

/* Loops over the 4 elements of a thread are unrolled on the device, so that the arrays holding
 * them stay in registers (every index a constant; a tail is handled by `k < n` tests, never by
 * a loop bound that varies). */
#ifdef __CUDA_ARCH__
#define ZP_UNROLL _Pragma("unroll")
#else
#define ZP_UNROLL
#endif

/* Threads per block and elements per thread of every kernel in this folder. */
#define ZP_CU_THREADS 256
#define ZP_CU_VEC 4
#define ZP_CU_TILE (ZP_CU_THREADS * ZP_CU_VEC) /* elements per block (optimizer, copies) */

enum { ZP_CU_F32 = 0, ZP_CU_BF16 = 1, ZP_CU_F16 = 2 }; /* = zp_dtype */

ZP_HD uint32_t zp_cu_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
#endif
}

ZP_HD float zp_cu_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}

/* ---- conversions (convert.h's scalar functions, operation for operation) ---- */

ZP_HD float zp_cu_from_bf16(uint16_t h) { return zp_cu_float((uint32_t)h << 16); }

ZP_HD uint16_t zp_cu_to_bf16(float f) {
  uint32_t u = zp_cu_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u)
    return 0x7FC0;
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

ZP_HD uint16_t zp_cu_to_bf16_sr(float f, uint32_t r) {
  uint32_t u = zp_cu_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u)
    return 0x7FC0;
  return (uint16_t)((u + r) >> 16);
}

ZP_HD float zp_cu_from_f16(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (exp == 0x1F)
    return zp_cu_float(sign | 0x7F800000u | (mant << 13) | (mant ? 0x400000u : 0u));
  if (exp != 0)
    return zp_cu_float(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0)
    return zp_cu_float(sign);
  uint32_t e = 113;
  while (!(mant & 0x400u)) {
    mant <<= 1;
    e--;
  }
  return zp_cu_float(sign | (e << 23) | ((mant & 0x3FFu) << 13));
}

ZP_HD uint16_t zp_cu_to_f16(float f) {
  uint32_t u = zp_cu_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u)
    return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u)
    return (uint16_t)(sign | 0x7C00u);
  if (a >= 0x38800000u) {
    uint32_t r = a - 0x38000000u;
    return (uint16_t)(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
  }
  uint32_t e = a >> 23;
  if (e < 102)
    return sign;
  uint32_t m = (a & 0x7FFFFFu) | 0x800000u, shift = 126 - e;
  uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u)))
    q++;
  return (uint16_t)(sign | q);
}

/* 16-bit value of `dtype` (bf16 or fp16) -> fp32, and back with round to nearest even. */
ZP_HD float zp_cu_widen(uint16_t h, int32_t dtype) {
  return dtype == ZP_CU_BF16 ? zp_cu_from_bf16(h) : zp_cu_from_f16(h);
}

ZP_HD uint16_t zp_cu_narrow(float f, int32_t dtype) {
  return dtype == ZP_CU_BF16 ? zp_cu_to_bf16(f) : zp_cu_to_f16(f);
}

/* ---- stochastic rounding noise: convert.c's zp_sr_key and convert.h's zp_sr_bits ---- */

ZP_HD uint64_t zp_cu_mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

ZP_HD uint32_t zp_cu_sr_key(uint64_t seed, uint64_t stream, uint64_t index_hi) {
  uint64_t k = zp_cu_mix64(seed + 0x9E3779B97F4A7C15ull);
  k = zp_cu_mix64(k ^ (stream * 0xD1B54A32D192ED03ull + 1));
  k = zp_cu_mix64(k ^ (index_hi * 0x8CB92BA72F3D8DD7ull + 2));
  return (uint32_t)(k >> 32);
}

ZP_HD uint32_t zp_cu_sr_bits(uint32_t key, uint32_t index) {
  uint32_t x = index * 0x9E3779B1u + key;
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x >> 16;
}

/* ---- vector access: 4 consecutive elements, one 16-byte (fp32) or 8-byte (16-bit) access
 * when `vec` says the address is aligned for it, else one element at a time (n < 4 at a
 * segment's end). ---- */

ZP_HD void zp_cu_load4f(const float *p, int vec, int n, float out[4]) {
  if (vec) {
#ifdef __CUDA_ARCH__
    float4 v = __ldca((const float4 *)p); /* explicitly global: see zp_cu_store4f */
#else
    float4 v = *(const float4 *)p;
#endif
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
    return;
  }
  ZP_UNROLL
  for (int k = 0; k < 4; k++)
    out[k] = k < n ? p[k] : 0.0f;
}

ZP_HD void zp_cu_store4f(float *p, int vec, int n, const float v[4]) {
  if (vec) {
    float4 w = make_float4(v[0], v[1], v[2], v[3]);
#ifdef __CUDA_ARCH__
    __stwb((float4 *)p, w); /* one st.global.v4: a plain store was seen split into four */
#else
    *(float4 *)p = w;
#endif
    return;
  }
  ZP_UNROLL
  for (int k = 0; k < 4; k++)
    if (k < n)
      p[k] = v[k];
}

ZP_HD void zp_cu_load4h(const uint16_t *p, int vec, int n, uint16_t out[4]) {
  if (vec) {
#ifdef __CUDA_ARCH__
    uint2 v = __ldca((const uint2 *)p);
#else
    uint2 v = *(const uint2 *)p;
#endif
    out[0] = (uint16_t)(v.x & 0xFFFFu), out[1] = (uint16_t)(v.x >> 16);
    out[2] = (uint16_t)(v.y & 0xFFFFu), out[3] = (uint16_t)(v.y >> 16);
    return;
  }
  ZP_UNROLL
  for (int k = 0; k < 4; k++)
    out[k] = k < n ? p[k] : (uint16_t)0;
}

ZP_HD void zp_cu_store4h(uint16_t *p, int vec, int n, const uint16_t v[4]) {
  if (vec) {
    uint2 w = make_uint2((uint32_t)v[0] | ((uint32_t)v[1] << 16),
                         (uint32_t)v[2] | ((uint32_t)v[3] << 16));
#ifdef __CUDA_ARCH__
    __stwb((uint2 *)p, w);
#else
    *(uint2 *)p = w;
#endif
    return;
  }
  ZP_UNROLL
  for (int k = 0; k < 4; k++)
    if (k < n)
      p[k] = v[k];
}

/* 4 elements of a buffer of `dtype`, widened to fp32. */
ZP_HD void zp_cu_load4(const void *p, int32_t dtype, int vec, int n, float out[4]) {
  if (dtype == ZP_CU_F32) {
    zp_cu_load4f((const float *)p, vec, n, out);
    return;
  }
  uint16_t h[4];
  zp_cu_load4h((const uint16_t *)p, vec, n, h);
  ZP_UNROLL
  for (int k = 0; k < 4; k++)
    out[k] = zp_cu_widen(h[k], dtype);
}

/* True when `p` is aligned for a 4-element vector access of elements of `elem_size` bytes. */
static inline int zp_cu_vec_aligned(const void *p, int elem_size) {
  return ((uintptr_t)p % (uintptr_t)(4 * elem_size)) == 0;
}

/* The table row that block `tile` works on: rows hold `tile0`, the first tile of each
 * (non-empty) row, increasing; the answer is the last row with tile0 <= tile. */
template <typename Row>
ZP_HD int32_t zp_cu_find_row(const Row *rows, int32_t n, int64_t tile) {
  int32_t lo = 0, hi = n - 1;
  while (lo < hi) {
    int32_t mid = lo + (hi - lo + 1) / 2;
    if (rows[mid].tile0 <= tile)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

/* ---- the optimizer family (optim.h): the update of one element, with the coefficients of
 * kernels/optim_common.h ---- */

/* One element: p the fp32 master, g the widened gradient times `scale`, s0..s2 the states
 * (meaningful per kind, as optim.h says). */
ZP_HD void zp_cu_update(const zp_opt_coef *c, float gi, float *p, float *s0, float *s1,
                        float *s2) {
  switch (c->kind) {
  case ZP_OPT_ADAMW:
  case ZP_OPT_ADAM: {
    if (c->use_l2)
      gi = fmaf(c->wd, *p, gi);
    float pi = *p * c->decay;
    float d = gi - *s0;
    float mi = c->lerp_small ? fmaf(c->lerp_w, d, *s0) : fmaf(c->lerp_wm1, d, gi);
    float vi = fmaf(c->omb2 * gi, gi, *s1 * c->b2);
    float vv = vi;
    if (c->amsgrad) {
      vv = *s2 > vi ? *s2 : vi;
      *s2 = vv;
    }
    float denom = sqrtf(vv) / c->bc2_sqrt + c->eps;
    *p = pi + (c->neg_step * mi) / denom;
    *s0 = mi;
    *s1 = vi;
    break;
  }
  case ZP_OPT_SGD:
    if (c->use_l2)
      gi = fmaf(c->wd, *p, gi);
    if (c->momentum) {
      float b = c->first ? gi : fmaf(c->omb2, gi, *s0 * c->b1);
      *s0 = b;
      gi = c->nesterov ? fmaf(c->b1, b, gi) : b;
    }
    *p = fmaf(c->neg_step, gi, *p);
    break;
  case ZP_OPT_ADAGRAD: {
    if (c->use_l2)
      gi = fmaf(c->wd, *p, gi);
    float si = fmaf(gi, gi, *s0);
    *s0 = si;
    *p = *p + (c->neg_step * gi) / (sqrtf(si) + c->eps);
    break;
  }
  default: { /* ZP_OPT_LION */
    float ci = fmaf(c->omb1, gi, *s0 * c->b1);
    float u = ci > 0.0f ? c->neg_step : ci < 0.0f ? c->pos_lr : -0.0f;
    *p = *p * c->decay + u;
    *s0 = fmaf(c->omb2, gi, *s0 * c->b2);
    break;
  }
  }
}

#endif /* ZP_CUDA_ELEMENTWISE_CUH */
