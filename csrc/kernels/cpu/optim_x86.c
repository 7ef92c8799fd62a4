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
/* always_inline: GCC does not inline a plain static function into the target("avx*") loops
 * below, then finds it free of side effects (a prefetch has none it models) and deletes every
 * call, prefetches and all. */
__attribute__((always_inline)) static inline void zp_prefetch(const float *at, int64_t pf) {
  if (pf > 0)
    _mm_prefetch((const char *)(at + pf), _MM_HINT_T1);
  else
    _mm_prefetch((const char *)(at - pf), _MM_HINT_T0);
}
#define ZP_PF(ptr, at) zp_prefetch((ptr) + (at), pf)

/* ---- AVX2 + FMA: 8 lanes ---- */
#define ZP_AVX2 __attribute__((target("avx2,fma,f16c")))

typedef struct {
  __m256 scale, wd, decay, w, wm1, b1, omb1, b2, omb2, neg_step, pos_lr, bc2, eps;
  int l2, small, ams, momentum, first, nesterov;
} zp_coef256;

#define ZP_INLINE2 __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

ZP_INLINE2 zp_coef256 zp_coef256_load(const zp_opt_coef *c) {
  return (zp_coef256){_mm256_set1_ps(c->scale),    _mm256_set1_ps(c->wd),
                      _mm256_set1_ps(c->decay),    _mm256_set1_ps(c->lerp_w),
                      _mm256_set1_ps(c->lerp_wm1), _mm256_set1_ps(c->b1),
                      _mm256_set1_ps(c->omb1),     _mm256_set1_ps(c->b2),
                      _mm256_set1_ps(c->omb2),     _mm256_set1_ps(c->neg_step),
                      _mm256_set1_ps(c->pos_lr),   _mm256_set1_ps(c->bc2_sqrt),
                      _mm256_set1_ps(c->eps),      c->use_l2,
                      c->lerp_small,               c->amsgrad,
                      c->momentum,                 c->first,
                      c->nesterov};
}

/* The steps of 8 elements, one per kind: the gradient g (unscaled) is already in a register;
 * each stores the master and its states and returns the new master. s0..s2 are the kind's
 * states as in zp_opt_body (Adam*: m, v, vmax). */
typedef __m256 (*zp_step8)(const zp_coef256 *k, float *p, __m256 g, float *s0, float *s1,
                           float *s2);

ZP_INLINE2 __m256 zp_adam8(const zp_coef256 *k, float *p, __m256 g, float *m, float *v,
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

ZP_INLINE2 __m256 zp_sgd8(const zp_coef256 *k, float *p, __m256 g, float *buf, float *s1,
                          float *s2) {
  (void)s1, (void)s2;
  __m256 pi = _mm256_loadu_ps(p);
  __m256 gi = _mm256_mul_ps(g, k->scale);
  if (k->l2)
    gi = _mm256_fmadd_ps(k->wd, pi, gi);
  if (k->momentum) {
    __m256 b = k->first ? gi
                        : _mm256_fmadd_ps(k->omb2, gi, _mm256_mul_ps(_mm256_loadu_ps(buf), k->b1));
    _mm256_storeu_ps(buf, b);
    gi = k->nesterov ? _mm256_fmadd_ps(k->b1, b, gi) : b;
  }
  pi = _mm256_fmadd_ps(k->neg_step, gi, pi);
  _mm256_storeu_ps(p, pi);
  return pi;
}

ZP_INLINE2 __m256 zp_adagrad8(const zp_coef256 *k, float *p, __m256 g, float *sum, float *s1,
                              float *s2) {
  (void)s1, (void)s2;
  __m256 pi = _mm256_loadu_ps(p);
  __m256 gi = _mm256_mul_ps(g, k->scale);
  if (k->l2)
    gi = _mm256_fmadd_ps(k->wd, pi, gi);
  __m256 si = _mm256_fmadd_ps(gi, gi, _mm256_loadu_ps(sum));
  _mm256_storeu_ps(sum, si);
  __m256 std = _mm256_add_ps(_mm256_sqrt_ps(si), k->eps);
  pi = _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(k->neg_step, gi), std));
  _mm256_storeu_ps(p, pi);
  return pi;
}

ZP_INLINE2 __m256 zp_lion8(const zp_coef256 *k, float *p, __m256 g, float *m, float *s1,
                           float *s2) {
  (void)s1, (void)s2;
  const __m256 zero = _mm256_setzero_ps(), neg_zero = _mm256_set1_ps(-0.0f);
  __m256 gi = _mm256_mul_ps(g, k->scale);
  __m256 mi = _mm256_loadu_ps(m);
  __m256 ci = _mm256_fmadd_ps(k->omb1, gi, _mm256_mul_ps(mi, k->b1));
  __m256 u = _mm256_blendv_ps(neg_zero, k->pos_lr, _mm256_cmp_ps(ci, zero, _CMP_LT_OQ));
  u = _mm256_blendv_ps(u, k->neg_step, _mm256_cmp_ps(ci, zero, _CMP_GT_OQ));
  __m256 pi = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(p), k->decay), u);
  _mm256_storeu_ps(p, pi);
  _mm256_storeu_ps(m, _mm256_fmadd_ps(k->omb2, gi, _mm256_mul_ps(mi, k->b2)));
  return pi;
}

static float *zp_off(float *s, int64_t i) { return s ? s + i : NULL; }

/* The fp32 body of one kind: a step per 8 elements, prefetching every stream it has (a state
 * the kind does not use is NULL; Adam*'s vmax only with amsgrad), then the scalar body on the
 * last < 8. */
ZP_INLINE2 void zp_run8(zp_step8 step, zp_opt_body scalar, const zp_opt_coef *c, float *p,
                        const float *g, float *s0, float *s1, float *s2, int64_t n, int64_t pf) {
  const zp_coef256 k = zp_coef256_load(c);
  s2 = c->amsgrad ? s2 : NULL; /* vmax: Adam*'s third state, only with amsgrad */
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) { /* two steps per line of each stream */
    if (pf != 0) {
      ZP_PF(p, i), ZP_PF(g, i);
      if (s0)
        ZP_PF(s0, i);
      if (s1)
        ZP_PF(s1, i);
      if (s2)
        ZP_PF(s2, i);
    }
    (void)step(&k, p + i, _mm256_loadu_ps(g + i), zp_off(s0, i), zp_off(s1, i), zp_off(s2, i));
    (void)step(&k, p + i + 8, _mm256_loadu_ps(g + i + 8), zp_off(s0, i + 8), zp_off(s1, i + 8),
               zp_off(s2, i + 8));
  }
  if (i + 8 <= n) {
    (void)step(&k, p + i, _mm256_loadu_ps(g + i), zp_off(s0, i), zp_off(s1, i), zp_off(s2, i));
    i += 8;
  }
  scalar(c, p + i, g + i, zp_off(s0, i), zp_off(s1, i), zp_off(s2, i), n - i, pf);
}

/* A bf16 gradient and a bf16 param_out rounded to nearest even: the gradient is widened and the
 * master narrowed in registers, so no chunk buffer is written and read back (convert.c's
 * widen, then the body, then convert.c's narrow: the same bits). nt: streaming stores for out,
 * which is then 16-byte aligned. The last elements the SIMD loop leaves take the scalar body. */
static void zp_bf16_tail(const zp_opt_coef *c, zp_opt_body scalar, float *p, const uint16_t *g,
                         float *s0, float *s1, float *s2, uint16_t *out, int64_t n) {
  float gw[32] = {0};
  for (int64_t j = 0; j < n; j += 32) {
    const int64_t k = n - j < 32 ? n - j : 32;
    for (int64_t i = 0; i < k; i++)
      gw[i] = zp_bf16_to_f32(g[j + i]);
    scalar(c, p + j, gw, zp_off(s0, j), zp_off(s1, j), zp_off(s2, j), k, 0);
    for (int64_t i = 0; i < k; i++)
      out[j + i] = zp_f32_to_bf16(p[j + i]);
  }
}

__attribute__((always_inline)) static inline void zp_prefetch16(const uint16_t *at,
                                                              int64_t pf) {
  if (pf > 0)
    _mm_prefetch((const char *)(at + pf), _MM_HINT_T1);
  else
    _mm_prefetch((const char *)(at - pf), _MM_HINT_T0);
}

/* One step of 8 with a bf16 gradient and a bf16 param_out. */
ZP_INLINE2 void zp_step8_bf16(zp_step8 step, const zp_coef256 *k, float *p, const uint16_t *g,
                              float *s0, float *s1, float *s2, uint16_t *out, int nt) {
  __m256i gw = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)g));
  __m256 pi = step(k, p, _mm256_castsi256_ps(_mm256_slli_epi32(gw, 16)), s0, s1, s2);
  __m256i u = _mm256_castps_si256(pi);
  __m128i b = zp_pack_u32_avx2(zp_bf16_round_avx2(u, zp_bf16_rne_bias_avx2(u)));
  if (nt)
    _mm_stream_si128((__m128i *)out, b);
  else
    _mm_storeu_si128((__m128i *)out, b);
}

/* Two steps of 8 whose bf16 results leave in one 32-byte store: one pack and one permute for
 * 16 elements instead of two each (AVX2's shuffles share two ports with the update's math). */
ZP_INLINE2 void zp_step16_bf16_avx2(zp_step8 step, const zp_coef256 *k, float *p,
                                    const uint16_t *g, float *s0, float *s1, float *s2,
                                    uint16_t *out, int nt) {
  __m256i g16 = _mm256_loadu_si256((const __m256i *)g);
  /* 64-bit groups 0,2,1,3: each 128-bit lane's low half holds elements 0-3 | 4-7, its high half
   * 8-11 | 12-15, so unpacking with zero below widens them in order (bf16 -> fp32 bits) */
  g16 = _mm256_permute4x64_epi64(g16, 0xD8);
  const __m256i zero = _mm256_setzero_si256();
  __m256 lo = step(k, p, _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, g16)), s0, s1, s2);
  __m256 hi = step(k, p + 8, _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, g16)),
                   s0 ? s0 + 8 : NULL, s1 ? s1 + 8 : NULL, s2 ? s2 + 8 : NULL);
  __m256i a = _mm256_castps_si256(lo), b = _mm256_castps_si256(hi);
  a = zp_bf16_round_avx2(a, zp_bf16_rne_bias_avx2(a));
  b = zp_bf16_round_avx2(b, zp_bf16_rne_bias_avx2(b));
  /* packus interleaves the lanes' 64-bit groups (a0-3 b0-3 | a4-7 b4-7); 0xD8 puts them back */
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
  if (nt)
    _mm256_stream_si256((__m256i *)out, packed);
  else
    _mm256_storeu_si256((__m256i *)out, packed);
}

/* Two steps of 8 per iteration (a line of each fp32 stream), as zp_run8; returns how many
 * elements it did (a multiple of 8). */
ZP_INLINE2 int64_t zp_loop8_bf16(zp_step8 step, const zp_coef256 *k, float *p, const uint16_t *g,
                                 float *s0, float *s1, float *s2, uint16_t *out, int64_t n,
                                 int64_t pf, int nt) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    if (pf != 0) {
      ZP_PF(p, i);
      if (s0)
        ZP_PF(s0, i);
      if (s1)
        ZP_PF(s1, i);
      if (s2)
        ZP_PF(s2, i);
      if ((i & 31) == 0)
        zp_prefetch16(g + i, pf);
    }
    zp_step16_bf16_avx2(step, k, p + i, g + i, zp_off(s0, i), zp_off(s1, i), zp_off(s2, i),
                        out + i, nt);
  }
  if (i + 8 <= n) {
    zp_step8_bf16(step, k, p + i, g + i, zp_off(s0, i), zp_off(s1, i), zp_off(s2, i), out + i,
                  nt);
    i += 8;
  }
  return i;
}

ZP_INLINE2 void zp_run8_bf16(zp_step8 step, zp_opt_body scalar, const zp_opt_coef *c, float *p,
                             const uint16_t *g, float *s0, float *s1, float *s2, uint16_t *out,
                             int64_t n, int64_t pf, int nt) {
  const zp_coef256 k = zp_coef256_load(c);
  s2 = c->amsgrad ? s2 : NULL;
  int64_t i;
  if (!k.l2 && !k.ams && pf > 0) {
    /* The common case (decoupled weight decay, no amsgrad, prefetch into L2) in loops of its
     * own, where those tests and the streaming choice are constants: the general loop spends
     * as many instructions on them as on the update, and on AVX2's 16 registers, spills. */
    zp_coef256 kc = k;
    kc.l2 = 0, kc.ams = 0;
    i = nt ? zp_loop8_bf16(step, &kc, p, g, s0, s1, NULL, out, n, pf, 1)
           : zp_loop8_bf16(step, &kc, p, g, s0, s1, NULL, out, n, pf, 0);
  } else {
    i = zp_loop8_bf16(step, &k, p, g, s0, s1, s2, out, n, pf, nt);
  }
  zp_bf16_tail(c, scalar, p + i, g + i, zp_off(s0, i), zp_off(s1, i), zp_off(s2, i), out + i,
               n - i);
}

/* One body per kind and ISA, fp32 and bf16, from the kind's step and the ISA's loops. */
#define ZP_X86_BODIES(kind, step, attr, isa, run, run_bf16)                                      \
  attr void zp_##kind##_##isa(const zp_opt_coef *c, float *restrict p, const float *restrict g,  \
                              float *restrict s0, float *restrict s1, float *restrict s2,        \
                              int64_t n, int64_t pf) {                                           \
    run(step, zp_##kind##_scalar, c, p, g, s0, s1, s2, n, pf);                                   \
  }                                                                                              \
  attr void zp_##kind##_bf16_##isa(const zp_opt_coef *c, float *restrict p,                      \
                                   const uint16_t *restrict g, float *restrict s0,               \
                                   float *restrict s1, float *restrict s2,                       \
                                   uint16_t *restrict out, int64_t n, int64_t pf, int nt) {      \
    run_bf16(step, zp_##kind##_scalar, c, p, g, s0, s1, s2, out, n, pf, nt);                     \
  }

ZP_X86_BODIES(adam, zp_adam8, ZP_AVX2, avx2, zp_run8, zp_run8_bf16)
ZP_X86_BODIES(sgd, zp_sgd8, ZP_AVX2, avx2, zp_run8, zp_run8_bf16)
ZP_X86_BODIES(adagrad, zp_adagrad8, ZP_AVX2, avx2, zp_run8, zp_run8_bf16)
ZP_X86_BODIES(lion, zp_lion8, ZP_AVX2, avx2, zp_run8, zp_run8_bf16)

/* ---- AVX-512F: 16 lanes, two steps per iteration (two independent div/sqrt chains) ---- */
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

/* The steps of 16 elements, as the 8-element ones above. */
typedef __m512 (*zp_step16)(const zp_coef512 *k, float *p, __m512 g, float *s0, float *s1,
                            float *s2);

ZP_INLINE512 __m512 zp_adam16(const zp_coef512 *k, float *p, __m512 g, float *m, float *v,
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

ZP_INLINE512 __m512 zp_sgd16(const zp_coef512 *k, float *p, __m512 g, float *buf, float *s1,
                             float *s2) {
  (void)s1, (void)s2;
  __m512 pi = _mm512_loadu_ps(p);
  __m512 gi = _mm512_mul_ps(g, k->scale);
  if (k->l2)
    gi = _mm512_fmadd_ps(k->wd, pi, gi);
  if (k->momentum) {
    __m512 b = k->first ? gi
                        : _mm512_fmadd_ps(k->omb2, gi, _mm512_mul_ps(_mm512_loadu_ps(buf), k->b1));
    _mm512_storeu_ps(buf, b);
    gi = k->nesterov ? _mm512_fmadd_ps(k->b1, b, gi) : b;
  }
  pi = _mm512_fmadd_ps(k->neg_step, gi, pi);
  _mm512_storeu_ps(p, pi);
  return pi;
}

ZP_INLINE512 __m512 zp_adagrad16(const zp_coef512 *k, float *p, __m512 g, float *sum,
                                 float *s1, float *s2) {
  (void)s1, (void)s2;
  __m512 pi = _mm512_loadu_ps(p);
  __m512 gi = _mm512_mul_ps(g, k->scale);
  if (k->l2)
    gi = _mm512_fmadd_ps(k->wd, pi, gi);
  __m512 si = _mm512_fmadd_ps(gi, gi, _mm512_loadu_ps(sum));
  _mm512_storeu_ps(sum, si);
  __m512 std = _mm512_add_ps(_mm512_sqrt_ps(si), k->eps);
  pi = _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(k->neg_step, gi), std));
  _mm512_storeu_ps(p, pi);
  return pi;
}

ZP_INLINE512 __m512 zp_lion16(const zp_coef512 *k, float *p, __m512 g, float *m, float *s1,
                              float *s2) {
  (void)s1, (void)s2;
  const __m512 zero = _mm512_setzero_ps(), neg_zero = _mm512_set1_ps(-0.0f);
  __m512 gi = _mm512_mul_ps(g, k->scale);
  __m512 mi = _mm512_loadu_ps(m);
  __m512 ci = _mm512_fmadd_ps(k->omb1, gi, _mm512_mul_ps(mi, k->b1));
  __m512 u = _mm512_mask_mov_ps(neg_zero, _mm512_cmp_ps_mask(ci, zero, _CMP_LT_OQ), k->pos_lr);
  u = _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(ci, zero, _CMP_GT_OQ), k->neg_step);
  __m512 pi = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(p), k->decay), u);
  _mm512_storeu_ps(p, pi);
  _mm512_storeu_ps(m, _mm512_fmadd_ps(k->omb2, gi, _mm512_mul_ps(mi, k->b2)));
  return pi;
}

/* Two lines ahead of each fp32 stream (32 elements) per iteration. */
ZP_INLINE512 void zp_prefetch32(float *p, float *s0, float *s1, float *s2, int64_t i,
                                int64_t pf) {
  ZP_PF(p, i), ZP_PF(p, i + 16);
  if (s0)
    ZP_PF(s0, i), ZP_PF(s0, i + 16);
  if (s1)
    ZP_PF(s1, i), ZP_PF(s1, i + 16);
  if (s2)
    ZP_PF(s2, i), ZP_PF(s2, i + 16);
}

ZP_INLINE512 void zp_run16(zp_step16 step, zp_opt_body scalar, const zp_opt_coef *c, float *p,
                           const float *g, float *s0, float *s1, float *s2, int64_t n,
                           int64_t pf) {
  const zp_coef512 k = zp_coef512_load(c);
  s2 = c->amsgrad ? s2 : NULL;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    if (pf != 0) {
      zp_prefetch32(p, s0, s1, s2, i, pf);
      ZP_PF(g, i), ZP_PF(g, i + 16);
    }
    (void)step(&k, p + i, _mm512_loadu_ps(g + i), zp_off(s0, i), zp_off(s1, i), zp_off(s2, i));
    (void)step(&k, p + i + 16, _mm512_loadu_ps(g + i + 16), zp_off(s0, i + 16),
               zp_off(s1, i + 16), zp_off(s2, i + 16));
  }
  for (; i + 16 <= n; i += 16)
    (void)step(&k, p + i, _mm512_loadu_ps(g + i), zp_off(s0, i), zp_off(s1, i), zp_off(s2, i));
  scalar(c, p + i, g + i, zp_off(s0, i), zp_off(s1, i), zp_off(s2, i), n - i, pf);
}

/* A step of 16 with a bf16 gradient and a bf16 param_out (see zp_run8_bf16). */
ZP_INLINE512 void zp_step16_bf16(zp_step16 step, const zp_coef512 *k, float *p,
                                 const uint16_t *g, float *s0, float *s1, float *s2,
                                 uint16_t *out, int nt) {
  __m512i gw = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)g));
  __m512 pi = step(k, p, _mm512_castsi512_ps(_mm512_slli_epi32(gw, 16)), s0, s1, s2);
  __m512i u = _mm512_castps_si512(pi);
  __m256i b = zp_bf16_round_avx512(u, zp_bf16_rne_bias_avx512(u));
  if (nt)
    _mm256_stream_si256((__m256i *)out, b);
  else
    _mm256_storeu_si256((__m256i *)out, b);
}

ZP_INLINE512 void zp_run16_bf16(zp_step16 step, zp_opt_body scalar, const zp_opt_coef *c,
                                float *p, const uint16_t *g, float *s0, float *s1, float *s2,
                                uint16_t *out, int64_t n, int64_t pf, int nt) {
  const zp_coef512 k = zp_coef512_load(c);
  s2 = c->amsgrad ? s2 : NULL;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    if (pf != 0) {
      zp_prefetch32(p, s0, s1, s2, i, pf);
      zp_prefetch16(g + i, pf);
    }
    zp_step16_bf16(step, &k, p + i, g + i, zp_off(s0, i), zp_off(s1, i), zp_off(s2, i), out + i,
                   nt);
    zp_step16_bf16(step, &k, p + i + 16, g + i + 16, zp_off(s0, i + 16), zp_off(s1, i + 16),
                   zp_off(s2, i + 16), out + i + 16, nt);
  }
  zp_bf16_tail(c, scalar, p + i, g + i, zp_off(s0, i), zp_off(s1, i), zp_off(s2, i), out + i,
               n - i);
}

ZP_X86_BODIES(adam, zp_adam16, ZP_AVX512, avx512, zp_run16, zp_run16_bf16)
ZP_X86_BODIES(sgd, zp_sgd16, ZP_AVX512, avx512, zp_run16, zp_run16_bf16)
ZP_X86_BODIES(adagrad, zp_adagrad16, ZP_AVX512, avx512, zp_run16, zp_run16_bf16)
ZP_X86_BODIES(lion, zp_lion16, ZP_AVX512, avx512, zp_run16, zp_run16_bf16)

#else
typedef int zp_optim_x86_unused; /* ISO C: a translation unit is not empty */
#endif
