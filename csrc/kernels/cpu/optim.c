/* optim.c - the fused CPU optimizer family (optim.h): AdamW, Adam, SGD, Adagrad, Lion.
 *
 * Each segment is walked in chunks of ZP_OPT_CHUNK elements: a bf16/fp16 gradient is widened
 * into a chunk buffer that stays in L1, the update body of the kind runs on fp32, and the new
 * master is narrowed into param_out while it is still in L1, so memory is crossed once. An fp32
 * gradient with no param_out skips the chunking (the body runs on the whole range), and so does
 * Adam* with a bf16 gradient and a bf16 param_out rounded to nearest (the mixed-precision case
 * that matters most): its SIMD bodies widen and narrow in registers, which saves the chunk's
 * store and reload (~20% of the compute per element) and gives the same bits.
 *
 * The bodies (scalar, AVX2+FMA, AVX-512F) perform the same float operations in the same order,
 * and the C is compiled as ISO C11 (no floating-point contraction), so every body gives the same
 * bits. The order is torch's (single-tensor CPU path; its AVX2/AVX-512 builds fuse a multiply
 * into a following add, so `a.add(b, alpha=s)` is fma(s, b, a), addcmul is fma, and lerp is
 * ATen's two-branch fma, and addcdiv is (value * t1) / t2). */
#include "kernels/cpu/optim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/parallel.h"
#include "kernels/cpu/convert.h"
#include "kernels/cpu/convert_simd.h"
#include "kernels/cpu/tuning.h"
#include "kernels/optim_common.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ZP_X86 1
#endif

#define ZP_OPT_CHUNK 1024 /* elements; chunks start at multiples of this within a segment */

/* zp_opt_coef and zp_opt_coef_make (the per-segment constants) are optim_common.h's, shared
 * with the CUDA family. */

/* pf: software prefetch distance in elements (0: none; negative: into L1, see ZP_PF); the scalar
 * bodies ignore it. */
typedef void (*zp_opt_body)(const zp_opt_coef *c, float *restrict p, const float *restrict g,
                            float *restrict s0, float *restrict s1, float *restrict s2, int64_t n,
                            int64_t pf);

/* ---- scalar bodies: the definition every SIMD body reproduces ---- */

static void zp_adam_scalar(const zp_opt_coef *c, float *restrict p, const float *restrict g,
                           float *restrict m, float *restrict v, float *restrict vmax,
                           int64_t n, int64_t pf) {
  (void)pf;
  for (int64_t i = 0; i < n; i++) {
    float gi = g[i] * c->scale;
    if (c->use_l2)
      gi = fmaf(c->wd, p[i], gi);
    float pi = p[i] * c->decay;
    float d = gi - m[i];
    float mi = c->lerp_small ? fmaf(c->lerp_w, d, m[i]) : fmaf(c->lerp_wm1, d, gi);
    float vi = fmaf(c->omb2 * gi, gi, v[i] * c->b2);
    float vv = vi;
    if (c->amsgrad) {
      vv = vmax[i] > vi ? vmax[i] : vi; /* as MAXPS(vmax, v) */
      vmax[i] = vv;
    }
    float denom = sqrtf(vv) / c->bc2_sqrt + c->eps;
    p[i] = pi + (c->neg_step * mi) / denom;
    m[i] = mi;
    v[i] = vi;
  }
}

static void zp_sgd_scalar(const zp_opt_coef *c, float *restrict p, const float *restrict g,
                          float *restrict buf, float *restrict s1, float *restrict s2,
                          int64_t n, int64_t pf) {
  (void)pf;
  (void)s1, (void)s2;
  for (int64_t i = 0; i < n; i++) {
    float gi = g[i] * c->scale;
    if (c->use_l2)
      gi = fmaf(c->wd, p[i], gi);
    if (c->momentum) {
      float b = c->first ? gi : fmaf(c->omb2, gi, buf[i] * c->b1);
      buf[i] = b;
      gi = c->nesterov ? fmaf(c->b1, b, gi) : b;
    }
    p[i] = fmaf(c->neg_step, gi, p[i]);
  }
}

static void zp_adagrad_scalar(const zp_opt_coef *c, float *restrict p, const float *restrict g,
                              float *restrict sum, float *restrict s1, float *restrict s2,
                              int64_t n, int64_t pf) {
  (void)pf;
  (void)s1, (void)s2;
  for (int64_t i = 0; i < n; i++) {
    float gi = g[i] * c->scale;
    if (c->use_l2)
      gi = fmaf(c->wd, p[i], gi);
    float si = fmaf(gi, gi, sum[i]);
    sum[i] = si;
    p[i] = p[i] + (c->neg_step * gi) / (sqrtf(si) + c->eps);
  }
}

static void zp_lion_scalar(const zp_opt_coef *c, float *restrict p, const float *restrict g,
                           float *restrict m, float *restrict s1, float *restrict s2,
                           int64_t n, int64_t pf) {
  (void)pf;
  (void)s1, (void)s2;
  for (int64_t i = 0; i < n; i++) {
    float gi = g[i] * c->scale;
    float ci = fmaf(c->omb1, gi, m[i] * c->b1);
    /* -lr * sign(c); sign(0) * -lr is -0, which leaves any p unchanged */
    float u = ci > 0.0f ? c->neg_step : ci < 0.0f ? c->pos_lr : -0.0f;
    p[i] = p[i] * c->decay + u;
    m[i] = fmaf(c->omb2, gi, m[i] * c->b2);
  }
}

#ifdef ZP_X86
/* Software prefetch |pf| elements ahead (tuning.h; 2 KiB by default): the hardware prefetcher
 * alone leaves ~15% of the bandwidth unused with four streams per core. Into L2 (pf > 0), or
 * L1 (pf < 0: ZP_CPU_PREFETCH=<bytes>:l1); see tuning.h. A prefetch past the end of a buffer is
 * harmless. */
static inline void zp_prefetch(const float *at, int64_t pf) {
  if (pf > 0)
    _mm_prefetch((const char *)(at + pf), _MM_HINT_T1);
  else
    _mm_prefetch((const char *)(at - pf), _MM_HINT_T0);
}
#define ZP_PF(ptr, at) zp_prefetch((ptr) + (at), pf)

/* ---- AVX2 + FMA: 8 lanes ---- */
#define ZP_AVX2 __attribute__((target("avx2,fma,f16c")))

typedef struct {
  __m256 scale, wd, decay, w, wm1, b2, omb2, neg_step, bc2, eps;
  int l2, small, ams;
} zp_adam256;

#define ZP_INLINE2 __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

ZP_INLINE2 zp_adam256 zp_adam256_load(const zp_opt_coef *c) {
  return (zp_adam256){_mm256_set1_ps(c->scale),    _mm256_set1_ps(c->wd),
                      _mm256_set1_ps(c->decay),    _mm256_set1_ps(c->lerp_w),
                      _mm256_set1_ps(c->lerp_wm1), _mm256_set1_ps(c->b2),
                      _mm256_set1_ps(c->omb2),     _mm256_set1_ps(c->neg_step),
                      _mm256_set1_ps(c->bc2_sqrt), _mm256_set1_ps(c->eps),
                      c->use_l2,                   c->lerp_small,
                      c->amsgrad};
}

/* One Adam* step of 8 elements whose gradient g (unscaled) is already in a register; stores
 * master, m, v (and vmax) and returns the new master. */
ZP_INLINE2 __m256 zp_adam8(const zp_adam256 *k, float *p, __m256 g, float *m, float *v,
                           float *vmax) {
  __m256 pi = _mm256_loadu_ps(p);
  __m256 gi = _mm256_mul_ps(g, k->scale);
  if (k->l2)
    gi = _mm256_fmadd_ps(k->wd, pi, gi);
  __m256 mi = _mm256_loadu_ps(m);
  __m256 d = _mm256_sub_ps(gi, mi);
  mi = k->small ? _mm256_fmadd_ps(k->w, d, mi) : _mm256_fmadd_ps(k->wm1, d, gi);
  __m256 vi = _mm256_mul_ps(_mm256_loadu_ps(v), k->b2);
  vi = _mm256_fmadd_ps(_mm256_mul_ps(k->omb2, gi), gi, vi);
  __m256 vv = vi;
  if (k->ams) {
    vv = _mm256_max_ps(_mm256_loadu_ps(vmax), vi);
    _mm256_storeu_ps(vmax, vv);
  }
  __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vv), k->bc2), k->eps);
  pi = _mm256_add_ps(_mm256_mul_ps(pi, k->decay),
                     _mm256_div_ps(_mm256_mul_ps(k->neg_step, mi), denom));
  _mm256_storeu_ps(p, pi);
  _mm256_storeu_ps(m, mi);
  _mm256_storeu_ps(v, vi);
  return pi;
}

ZP_AVX2 static void zp_adam_avx2(const zp_opt_coef *c, float *restrict p, const float *restrict g,
                                 float *restrict m, float *restrict v, float *restrict vmax,
                                 int64_t n, int64_t pf) {
  const zp_adam256 k = zp_adam256_load(c);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if (pf != 0 && (i & 15) == 0) {
      ZP_PF(p, i), ZP_PF(g, i), ZP_PF(m, i), ZP_PF(v, i);
      if (k.ams)
        ZP_PF(vmax, i);
    }
    (void)zp_adam8(&k, p + i, _mm256_loadu_ps(g + i), m + i, v + i, k.ams ? vmax + i : NULL);
  }
  zp_adam_scalar(c, p + i, g + i, m + i, v + i, vmax ? vmax + i : NULL, n - i, pf);
}

/* Adam* with a bf16 gradient and a bf16 param_out rounded to nearest even: the gradient is
 * widened and the master narrowed in registers, so no chunk buffer is written and read back
 * (convert.c's widen, then the body, then convert.c's narrow: the same bits). nt: streaming
 * stores for out, which is then 16-byte aligned. The last < 8 (or 16) elements take the scalar
 * path. */
static void zp_adam_bf16_tail(const zp_opt_coef *c, float *p, const uint16_t *g, float *m,
                              float *v, float *vmax, uint16_t *out, int64_t n) {
  float gw[32] = {0}; /* the SIMD bodies leave fewer than 32: one piece */
  for (int64_t j = 0; j < n; j += 32) {
    const int64_t k = n - j < 32 ? n - j : 32;
    for (int64_t i = 0; i < k; i++)
      gw[i] = zp_bf16_to_f32(g[j + i]);
    zp_adam_scalar(c, p + j, gw, m + j, v + j, vmax ? vmax + j : NULL, k, 0);
    for (int64_t i = 0; i < k; i++)
      out[j + i] = zp_f32_to_bf16(p[j + i]);
  }
}

static inline void zp_prefetch16(const uint16_t *at, int64_t pf) {
  if (pf > 0)
    _mm_prefetch((const char *)(at + pf), _MM_HINT_T1);
  else
    _mm_prefetch((const char *)(at - pf), _MM_HINT_T0);
}

ZP_AVX2 static void zp_adam_bf16_avx2(const zp_opt_coef *c, float *restrict p,
                                      const uint16_t *restrict g, float *restrict m,
                                      float *restrict v, float *restrict vmax,
                                      uint16_t *restrict out, int64_t n, int64_t pf, int nt) {
  const zp_adam256 k = zp_adam256_load(c);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if (pf != 0 && (i & 15) == 0) {
      ZP_PF(p, i), ZP_PF(m, i), ZP_PF(v, i);
      if ((i & 31) == 0)
        zp_prefetch16(g + i, pf);
      if (k.ams)
        ZP_PF(vmax, i);
    }
    __m256i gw = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(g + i)));
    __m256 pi = zp_adam8(&k, p + i, _mm256_castsi256_ps(_mm256_slli_epi32(gw, 16)), m + i,
                         v + i, k.ams ? vmax + i : NULL);
    __m256i u = _mm256_castps_si256(pi);
    __m128i b = zp_pack_u32_avx2(zp_bf16_round_avx2(u, zp_bf16_rne_bias_avx2(u)));
    if (nt)
      _mm_stream_si128((__m128i *)(out + i), b);
    else
      _mm_storeu_si128((__m128i *)(out + i), b);
  }
  zp_adam_bf16_tail(c, p + i, g + i, m + i, v + i, vmax ? vmax + i : NULL, out + i, n - i);
}

ZP_AVX2 static void zp_sgd_avx2(const zp_opt_coef *c, float *restrict p, const float *restrict g,
                                float *restrict buf, float *restrict s1, float *restrict s2,
                                int64_t n, int64_t pf) {
  const __m256 scale = _mm256_set1_ps(c->scale), wd = _mm256_set1_ps(c->wd);
  const __m256 mom = _mm256_set1_ps(c->b1), omd = _mm256_set1_ps(c->omb2);
  const __m256 neg_lr = _mm256_set1_ps(c->neg_step);
  const int l2 = c->use_l2, momentum = c->momentum, first = c->first, nesterov = c->nesterov;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if (pf != 0 && (i & 15) == 0) {
      ZP_PF(p, i), ZP_PF(g, i);
      if (momentum && !first)
        ZP_PF(buf, i);
    }
    __m256 pi = _mm256_loadu_ps(p + i);
    __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(g + i), scale);
    if (l2)
      gi = _mm256_fmadd_ps(wd, pi, gi);
    if (momentum) {
      __m256 b = first ? gi : _mm256_fmadd_ps(omd, gi, _mm256_mul_ps(_mm256_loadu_ps(buf + i), mom));
      _mm256_storeu_ps(buf + i, b);
      gi = nesterov ? _mm256_fmadd_ps(mom, b, gi) : b;
    }
    _mm256_storeu_ps(p + i, _mm256_fmadd_ps(neg_lr, gi, pi));
  }
  zp_sgd_scalar(c, p + i, g + i, buf ? buf + i : NULL, s1, s2, n - i, pf);
}

ZP_AVX2 static void zp_adagrad_avx2(const zp_opt_coef *c, float *restrict p,
                                    const float *restrict g, float *restrict sum,
                                    float *restrict s1, float *restrict s2, int64_t n, int64_t pf) {
  const __m256 scale = _mm256_set1_ps(c->scale), wd = _mm256_set1_ps(c->wd);
  const __m256 neg_clr = _mm256_set1_ps(c->neg_step), eps = _mm256_set1_ps(c->eps);
  const int l2 = c->use_l2;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if (pf != 0 && (i & 15) == 0)
      ZP_PF(p, i), ZP_PF(g, i), ZP_PF(sum, i);
    __m256 pi = _mm256_loadu_ps(p + i);
    __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(g + i), scale);
    if (l2)
      gi = _mm256_fmadd_ps(wd, pi, gi);
    __m256 si = _mm256_fmadd_ps(gi, gi, _mm256_loadu_ps(sum + i));
    _mm256_storeu_ps(sum + i, si);
    __m256 std = _mm256_add_ps(_mm256_sqrt_ps(si), eps);
    _mm256_storeu_ps(p + i, _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(neg_clr, gi), std)));
  }
  zp_adagrad_scalar(c, p + i, g + i, sum + i, s1, s2, n - i, pf);
}

ZP_AVX2 static void zp_lion_avx2(const zp_opt_coef *c, float *restrict p, const float *restrict g,
                                 float *restrict m, float *restrict s1, float *restrict s2,
                                 int64_t n, int64_t pf) {
  const __m256 scale = _mm256_set1_ps(c->scale), decay = _mm256_set1_ps(c->decay);
  const __m256 b1 = _mm256_set1_ps(c->b1), omb1 = _mm256_set1_ps(c->omb1);
  const __m256 b2 = _mm256_set1_ps(c->b2), omb2 = _mm256_set1_ps(c->omb2);
  const __m256 neg_lr = _mm256_set1_ps(c->neg_step), pos_lr = _mm256_set1_ps(c->pos_lr);
  const __m256 zero = _mm256_setzero_ps(), neg_zero = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if (pf != 0 && (i & 15) == 0)
      ZP_PF(p, i), ZP_PF(g, i), ZP_PF(m, i);
    __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(g + i), scale);
    __m256 mi = _mm256_loadu_ps(m + i);
    __m256 ci = _mm256_fmadd_ps(omb1, gi, _mm256_mul_ps(mi, b1));
    __m256 u = _mm256_blendv_ps(neg_zero, pos_lr, _mm256_cmp_ps(ci, zero, _CMP_LT_OQ));
    u = _mm256_blendv_ps(u, neg_lr, _mm256_cmp_ps(ci, zero, _CMP_GT_OQ));
    _mm256_storeu_ps(p + i, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(p + i), decay), u));
    _mm256_storeu_ps(m + i, _mm256_fmadd_ps(omb2, gi, _mm256_mul_ps(mi, b2)));
  }
  zp_lion_scalar(c, p + i, g + i, m + i, s1, s2, n - i, pf);
}

/* ---- AVX-512F: 16 lanes, two vectors per iteration (two independent div/sqrt chains) ---- */
#define ZP_AVX512 __attribute__((target("avx512f")))
#define ZP_INLINE512 __attribute__((target("avx512f"), always_inline)) static inline

typedef struct {
  __m512 scale, wd, decay, w, wm1, b1, omb1, b2, omb2, neg_step, pos_lr, bc2, eps;
  int l2, small, ams, momentum, first, nesterov;
} zp_coef512;

ZP_INLINE512 zp_coef512 zp_coef512_load(const zp_opt_coef *c) {
  return (zp_coef512){_mm512_set1_ps(c->scale),    _mm512_set1_ps(c->wd),
                      _mm512_set1_ps(c->decay),    _mm512_set1_ps(c->lerp_w),
                      _mm512_set1_ps(c->lerp_wm1), _mm512_set1_ps(c->b1),
                      _mm512_set1_ps(c->omb1),     _mm512_set1_ps(c->b2),
                      _mm512_set1_ps(c->omb2),     _mm512_set1_ps(c->neg_step),
                      _mm512_set1_ps(c->pos_lr),   _mm512_set1_ps(c->bc2_sqrt),
                      _mm512_set1_ps(c->eps),      c->use_l2,
                      c->lerp_small,               c->amsgrad,
                      c->momentum,                 c->first,
                      c->nesterov};
}

/* One Adam* step of 16 elements whose gradient g (unscaled) is already in a register; stores
 * master, m, v (and vmax) and returns the new master. */
ZP_INLINE512 __m512 zp_adam16_g(const zp_coef512 *k, float *p, __m512 g, float *m, float *v,
                                float *vmax) {
  __m512 pi = _mm512_loadu_ps(p);
  __m512 gi = _mm512_mul_ps(g, k->scale);
  if (k->l2)
    gi = _mm512_fmadd_ps(k->wd, pi, gi);
  __m512 mi = _mm512_loadu_ps(m);
  __m512 d = _mm512_sub_ps(gi, mi);
  mi = k->small ? _mm512_fmadd_ps(k->w, d, mi) : _mm512_fmadd_ps(k->wm1, d, gi);
  __m512 vi = _mm512_mul_ps(_mm512_loadu_ps(v), k->b2);
  vi = _mm512_fmadd_ps(_mm512_mul_ps(k->omb2, gi), gi, vi);
  __m512 vv = vi;
  if (k->ams) {
    vv = _mm512_max_ps(_mm512_loadu_ps(vmax), vi);
    _mm512_storeu_ps(vmax, vv);
  }
  __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vv), k->bc2), k->eps);
  pi = _mm512_add_ps(_mm512_mul_ps(pi, k->decay),
                     _mm512_div_ps(_mm512_mul_ps(k->neg_step, mi), denom));
  _mm512_storeu_ps(p, pi);
  _mm512_storeu_ps(m, mi);
  _mm512_storeu_ps(v, vi);
  return pi;
}

ZP_INLINE512 void zp_adam16(const zp_coef512 *k, float *p, const float *g, float *m, float *v,
                            float *vmax) {
  (void)zp_adam16_g(k, p, _mm512_loadu_ps(g), m, v, vmax);
}

/* zp_adam16 with a bf16 gradient and a bf16 param_out (see zp_adam_bf16_avx2). */
ZP_INLINE512 void zp_adam16_bf16(const zp_coef512 *k, float *p, const uint16_t *g, float *m,
                                 float *v, float *vmax, uint16_t *out, int nt) {
  __m512i gw = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)g));
  __m512 pi = zp_adam16_g(k, p, _mm512_castsi512_ps(_mm512_slli_epi32(gw, 16)), m, v, vmax);
  __m512i u = _mm512_castps_si512(pi);
  __m256i b = zp_bf16_round_avx512(u, zp_bf16_rne_bias_avx512(u));
  if (nt)
    _mm256_stream_si256((__m256i *)out, b);
  else
    _mm256_storeu_si256((__m256i *)out, b);
}

ZP_AVX512 static void zp_adam_avx512(const zp_opt_coef *c, float *restrict p,
                                     const float *restrict g, float *restrict m,
                                     float *restrict v, float *restrict vmax,
                                     int64_t n, int64_t pf) {
  const zp_coef512 k = zp_coef512_load(c);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    if (pf != 0) {
      ZP_PF(p, i), ZP_PF(g, i), ZP_PF(m, i), ZP_PF(v, i);
      ZP_PF(p, i + 16), ZP_PF(g, i + 16), ZP_PF(m, i + 16), ZP_PF(v, i + 16);
      if (k.ams)
        ZP_PF(vmax, i), ZP_PF(vmax, i + 16);
    }
    zp_adam16(&k, p + i, g + i, m + i, v + i, k.ams ? vmax + i : NULL);
    zp_adam16(&k, p + i + 16, g + i + 16, m + i + 16, v + i + 16, k.ams ? vmax + i + 16 : NULL);
  }
  for (; i + 16 <= n; i += 16)
    zp_adam16(&k, p + i, g + i, m + i, v + i, k.ams ? vmax + i : NULL);
  zp_adam_scalar(c, p + i, g + i, m + i, v + i, vmax ? vmax + i : NULL, n - i, pf);
}

ZP_AVX512 static void zp_adam_bf16_avx512(const zp_opt_coef *c, float *restrict p,
                                        const uint16_t *restrict g, float *restrict m,
                                        float *restrict v, float *restrict vmax,
                                        uint16_t *restrict out, int64_t n, int64_t pf, int nt) {
  const zp_coef512 k = zp_coef512_load(c);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    if (pf != 0) {
      ZP_PF(p, i), ZP_PF(m, i), ZP_PF(v, i);
      ZP_PF(p, i + 16), ZP_PF(m, i + 16), ZP_PF(v, i + 16);
      zp_prefetch16(g + i, pf);
      if (k.ams)
        ZP_PF(vmax, i), ZP_PF(vmax, i + 16);
    }
    zp_adam16_bf16(&k, p + i, g + i, m + i, v + i, k.ams ? vmax + i : NULL, out + i, nt);
    zp_adam16_bf16(&k, p + i + 16, g + i + 16, m + i + 16, v + i + 16,
                   k.ams ? vmax + i + 16 : NULL, out + i + 16, nt);
  }
  zp_adam_bf16_tail(c, p + i, g + i, m + i, v + i, vmax ? vmax + i : NULL, out + i, n - i);
}

ZP_AVX512 static void zp_sgd_avx512(const zp_opt_coef *c, float *restrict p,
                                    const float *restrict g, float *restrict buf,
                                    float *restrict s1, float *restrict s2, int64_t n, int64_t pf) {
  const zp_coef512 k = zp_coef512_load(c);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    if (pf != 0) {
      ZP_PF(p, i), ZP_PF(g, i);
      if (k.momentum && !k.first)
        ZP_PF(buf, i);
    }
    __m512 pi = _mm512_loadu_ps(p + i);
    __m512 gi = _mm512_mul_ps(_mm512_loadu_ps(g + i), k.scale);
    if (k.l2)
      gi = _mm512_fmadd_ps(k.wd, pi, gi);
    if (k.momentum) {
      __m512 b = k.first ? gi
                         : _mm512_fmadd_ps(k.omb2, gi, _mm512_mul_ps(_mm512_loadu_ps(buf + i), k.b1));
      _mm512_storeu_ps(buf + i, b);
      gi = k.nesterov ? _mm512_fmadd_ps(k.b1, b, gi) : b;
    }
    _mm512_storeu_ps(p + i, _mm512_fmadd_ps(k.neg_step, gi, pi));
  }
  zp_sgd_scalar(c, p + i, g + i, buf ? buf + i : NULL, s1, s2, n - i, pf);
}

ZP_INLINE512 void zp_adagrad16(const zp_coef512 *k, float *p, const float *g, float *sum) {
  __m512 pi = _mm512_loadu_ps(p);
  __m512 gi = _mm512_mul_ps(_mm512_loadu_ps(g), k->scale);
  if (k->l2)
    gi = _mm512_fmadd_ps(k->wd, pi, gi);
  __m512 si = _mm512_fmadd_ps(gi, gi, _mm512_loadu_ps(sum));
  _mm512_storeu_ps(sum, si);
  __m512 std = _mm512_add_ps(_mm512_sqrt_ps(si), k->eps);
  _mm512_storeu_ps(p, _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(k->neg_step, gi), std)));
}

ZP_AVX512 static void zp_adagrad_avx512(const zp_opt_coef *c, float *restrict p,
                                        const float *restrict g, float *restrict sum,
                                        float *restrict s1, float *restrict s2,
                                        int64_t n, int64_t pf) {
  const zp_coef512 k = zp_coef512_load(c);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    if (pf != 0) {
      ZP_PF(p, i), ZP_PF(g, i), ZP_PF(sum, i);
      ZP_PF(p, i + 16), ZP_PF(g, i + 16), ZP_PF(sum, i + 16);
    }
    zp_adagrad16(&k, p + i, g + i, sum + i);
    zp_adagrad16(&k, p + i + 16, g + i + 16, sum + i + 16);
  }
  for (; i + 16 <= n; i += 16)
    zp_adagrad16(&k, p + i, g + i, sum + i);
  zp_adagrad_scalar(c, p + i, g + i, sum + i, s1, s2, n - i, pf);
}

ZP_AVX512 static void zp_lion_avx512(const zp_opt_coef *c, float *restrict p,
                                     const float *restrict g, float *restrict m,
                                     float *restrict s1, float *restrict s2,
                                     int64_t n, int64_t pf) {
  const zp_coef512 k = zp_coef512_load(c);
  const __m512 zero = _mm512_setzero_ps(), neg_zero = _mm512_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    if (pf != 0)
      ZP_PF(p, i), ZP_PF(g, i), ZP_PF(m, i);
    __m512 gi = _mm512_mul_ps(_mm512_loadu_ps(g + i), k.scale);
    __m512 mi = _mm512_loadu_ps(m + i);
    __m512 ci = _mm512_fmadd_ps(k.omb1, gi, _mm512_mul_ps(mi, k.b1));
    __m512 u = _mm512_mask_mov_ps(neg_zero, _mm512_cmp_ps_mask(ci, zero, _CMP_LT_OQ), k.pos_lr);
    u = _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(ci, zero, _CMP_GT_OQ), k.neg_step);
    _mm512_storeu_ps(p + i, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(p + i), k.decay), u));
    _mm512_storeu_ps(m + i, _mm512_fmadd_ps(k.omb2, gi, _mm512_mul_ps(mi, k.b2)));
  }
  zp_lion_scalar(c, p + i, g + i, m + i, s1, s2, n - i, pf);
}
#endif

/* Indexed by zp_isa, then zp_opt_kind (AdamW and Adam share a body). */
static const zp_opt_body zp_opt_bodies[3][ZP_OPT_KINDS] = {
    {zp_adam_scalar, zp_adam_scalar, zp_sgd_scalar, zp_adagrad_scalar, zp_lion_scalar},
#ifdef ZP_X86
    {zp_adam_avx2, zp_adam_avx2, zp_sgd_avx2, zp_adagrad_avx2, zp_lion_avx2},
    {zp_adam_avx512, zp_adam_avx512, zp_sgd_avx512, zp_adagrad_avx512, zp_lion_avx512},
#endif
};

typedef void (*zp_adam_bf16_body)(const zp_opt_coef *c, float *restrict p,
                                  const uint16_t *restrict g, float *restrict m,
                                  float *restrict v, float *restrict vmax,
                                  uint16_t *restrict out, int64_t n, int64_t pf, int nt);

/* Indexed by zp_isa: the scalar ISA keeps the chunked path. */
static const zp_adam_bf16_body zp_adam_bf16_bodies[3] = {
    NULL,
#ifdef ZP_X86
    zp_adam_bf16_avx2,
    zp_adam_bf16_avx512,
#endif
};

typedef struct {
  const zp_opt_segment *segments;
  const zp_opt_coef *coefs;
  const int64_t *starts; /* n_segments + 1 prefix sums of numel */
  int32_t n_segments;
  const zp_opt_body *bodies;
  const zp_convert_ops *convert;
  zp_adam_bf16_body adam_bf16; /* NULL: Adam* with bf16 grad and param_out takes the chunks */
  int64_t pf; /* prefetch distance in fp32 elements; negative: into L1 */
  int64_t stream_min_bytes; /* a 16-bit param_out this large gets streaming stores; 0: never */
} zp_opt_job;

static float *zp_at(float *p, int64_t i) { return p ? p + i : NULL; }

/* Elements [lo, hi) of segment s. */
static void zp_opt_run_segment(const zp_opt_job *job, int32_t s, int64_t lo, int64_t hi) {
  const zp_opt_segment *seg = &job->segments[s];
  const zp_opt_coef *c = &job->coefs[s];
  const zp_opt_body body = job->bodies[c->kind];
  if (c->grad_dtype == ZP_F32 && seg->param_out == NULL) {
    body(c, seg->master + lo, (const float *)seg->grad + lo, zp_at(seg->state0, lo),
         zp_at(seg->state1, lo), zp_at(seg->state2, lo), hi - lo, job->pf);
    return;
  }
  /* A 16-bit param_out is written, never read: past the caches' size, streaming stores save
   * the read of each line before its write (2 of 30 bytes per element for AdamW). */
  const int nt = job->stream_min_bytes > 0 && c->param_dtype != ZP_F32 &&
                 seg->numel * 2 >= job->stream_min_bytes;
  if (job->adam_bf16 != NULL && (c->kind == ZP_OPT_ADAMW || c->kind == ZP_OPT_ADAM) &&
      c->grad_dtype == ZP_BF16 && c->param_dtype == ZP_BF16 &&
      !(c->flags & ZP_OPT_STOCHASTIC_ROUNDING)) {
    uint16_t *out = (uint16_t *)seg->param_out + lo;
    job->adam_bf16(c, seg->master + lo, (const uint16_t *)seg->grad + lo, zp_at(seg->state0, lo),
                   zp_at(seg->state1, lo), zp_at(seg->state2, lo), out, hi - lo, job->pf,
                   nt && ((uintptr_t)out & 31) == 0);
    if (nt)
      job->convert->fence();
    return;
  }
  float chunk[ZP_OPT_CHUNK];
  for (int64_t j = lo, e; j < hi; j = e) {
    e = (j / ZP_OPT_CHUNK + 1) * ZP_OPT_CHUNK;
    e = e < hi ? e : hi;
    const int64_t n = e - j;
    const float *g = chunk;
    if (c->grad_dtype == ZP_F32)
      g = (const float *)seg->grad + j;
    else if (c->grad_dtype == ZP_BF16)
      job->convert->widen_bf16((const uint16_t *)seg->grad + j, chunk, n);
    else
      job->convert->widen_f16((const uint16_t *)seg->grad + j, chunk, n);
    float *master = seg->master + j;
    body(c, master, g, zp_at(seg->state0, j), zp_at(seg->state1, j), zp_at(seg->state2, j), n,
         job->pf);
    if (seg->param_out == NULL)
      continue;
    if (c->param_dtype == ZP_F32) {
      float *out = (float *)seg->param_out + j;
      if (out != master)
        memcpy(out, master, (size_t)n * sizeof *out);
    } else if (c->param_dtype == ZP_F16) {
      (nt ? job->convert->narrow_f16_nt : job->convert->narrow_f16)(
          master, (uint16_t *)seg->param_out + j, n);
    } else if (c->flags & ZP_OPT_STOCHASTIC_ROUNDING) {
      /* a chunk never crosses a multiple of 2^32: the high index bits go into the key */
      (nt ? job->convert->narrow_bf16_sr_nt : job->convert->narrow_bf16_sr)(
          master, (uint16_t *)seg->param_out + j, n,
          zp_sr_key(c->seed, (uint64_t)s, (uint64_t)j >> 32), (uint32_t)j);
    } else {
      (nt ? job->convert->narrow_bf16_nt : job->convert->narrow_bf16)(
          master, (uint16_t *)seg->param_out + j, n);
    }
  }
  if (nt)
    job->convert->fence(); /* before the thread takes its next block or is joined */
}

/* Runs the elements [begin, end) of the segments laid end to end. */
static void zp_opt_range(void *ctx, int64_t begin, int64_t end) {
  const zp_opt_job *job = ctx;
  int32_t s = 0;
  while (job->starts[s + 1] <= begin)
    s++;
  for (; s < job->n_segments && job->starts[s] < end; s++) {
    int64_t lo = begin > job->starts[s] ? begin - job->starts[s] : 0;
    int64_t hi = (end < job->starts[s + 1] ? end : job->starts[s + 1]) - job->starts[s];
    if (hi > lo)
      zp_opt_run_segment(job, s, lo, hi);
  }
}

zp_status zp_opt_step_cpu(const zp_opt_segment *segments, int32_t n_segments,
                          const zp_opt_group *groups, int32_t n_groups, int32_t n_threads) {
  ZP_TRY(zp_opt_check(segments, n_segments, groups, n_groups));
  if (n_segments == 0)
    return ZP_OK;

  zp_opt_coef *coefs = malloc((size_t)n_segments * sizeof *coefs);
  int64_t *starts = malloc(((size_t)n_segments + 1) * sizeof *starts);
  if (coefs == NULL || starts == NULL) {
    free(coefs);
    free(starts);
    return zp_fail(ZP_ERR_NOMEM, "opt_step: out of memory for %d segments", n_segments);
  }
  starts[0] = 0;
  for (int32_t s = 0; s < n_segments; s++) {
    coefs[s] = zp_opt_coef_make(&groups[segments[s].group], segments[s].step);
    starts[s + 1] = starts[s] + segments[s].numel;
  }
  zp_cpu_tuning tune = zp_cpu_tuning_pick();
  zp_opt_job job = {segments,
                    coefs,
                    starts,
                    n_segments,
                    zp_opt_bodies[tune.isa],
                    zp_convert_ops_for(tune.isa),
                    zp_adam_bf16_bodies[tune.isa],
                    tune.prefetch_bytes / (int64_t)sizeof(float) * (tune.prefetch_l1 ? -1 : 1),
                    tune.stream_min_bytes};
  /* 64 elements: a cache line of fp32 and two of bf16 per range start; below 64K elements a
   * thread is not worth starting. */
  const int64_t n = starts[n_segments];
  zp_status status =
      tune.split_static
          ? zp_parallel_for(n, n_threads, 64, ZP_CPU_BLOCK, zp_opt_range, &job)
          : zp_parallel_blocks(n, n_threads, ZP_CPU_BLOCK, ZP_CPU_BLOCK, zp_opt_range, &job);
  free(coefs);
  free(starts);
  return status;
}
