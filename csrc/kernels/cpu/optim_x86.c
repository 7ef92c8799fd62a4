/* optim_x86.c - the optimizer family's x86 SIMD bodies (optim_body.h): AVX2 + FMA (8 lanes) and
 * AVX-512F (16 lanes) versions of optim.c's scalar bodies, the same float operations in the same
 * order, so every body gives the same bits (optim.c's opening comment says which order). optim.c
 * picks one per call (tuning.h's ISA). */
#include "kernels/cpu/optim_body.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/convert_simd.h"

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

ZP_AVX2 void zp_adam_avx2(const zp_opt_coef *c, float *restrict p, const float *restrict g,
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

ZP_AVX2 void zp_adam_bf16_avx2(const zp_opt_coef *c, float *restrict p,
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

ZP_AVX2 void zp_sgd_avx2(const zp_opt_coef *c, float *restrict p, const float *restrict g,
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

ZP_AVX2 void zp_adagrad_avx2(const zp_opt_coef *c, float *restrict p,
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

ZP_AVX2 void zp_lion_avx2(const zp_opt_coef *c, float *restrict p, const float *restrict g,
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

ZP_AVX512 void zp_adam_avx512(const zp_opt_coef *c, float *restrict p,
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

ZP_AVX512 void zp_adam_bf16_avx512(const zp_opt_coef *c, float *restrict p,
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

ZP_AVX512 void zp_sgd_avx512(const zp_opt_coef *c, float *restrict p,
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

ZP_AVX512 void zp_adagrad_avx512(const zp_opt_coef *c, float *restrict p,
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

ZP_AVX512 void zp_lion_avx512(const zp_opt_coef *c, float *restrict p,
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

#else
typedef int zp_optim_x86_unused; /* ISO C: a translation unit is not empty */
#endif
