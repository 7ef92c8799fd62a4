/* adamw.c - fused AdamW over flat fp32 segments: AVX-512, AVX2+FMA or scalar, picked at run time.
 *
 * Every variant performs the same float operations in the same order, so results do not
 * depend on the CPU or the thread count. The order is torch's CPU AdamW (single-tensor path,
 * whose vectorized ATen kernels fuse): the lerp of the first moment is ATen's two-branch fused
 * multiply-add, addcmul of the second moment is one fma, the bias correction of sqrt(v) a true
 * division, and addcdiv is (value * m) / denom. The result equals torch's bit for bit but for
 * sqrt (torch's CPU sqrt is off by one ulp on ~1% of inputs; this one is exact).
 * The build does not use -march: the SIMD bodies carry target attributes and are only
 * called after __builtin_cpu_supports says the CPU has them. */
#include "kernels/cpu/adamw.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/parallel.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ZP_X86 1
#endif

/* Per-segment constants, as the float values torch would use. */
typedef struct {
  float decay;      /* 1 - lr * weight_decay */
  float lerp_w;     /* 1 - beta1 */
  float lerp_wm1;   /* ATen's other lerp branch, for lerp_w >= 0.5: g + (w - 1) * (g - m) */
  int lerp_small;   /* lerp_w < 0.5 */
  float beta2;
  float one_minus_beta2;
  float neg_step;   /* -lr / (1 - beta1^step) */
  float bc2_sqrt;   /* sqrt(1 - beta2^step) */
  float eps;
  float grad_scale;
} zp_adamw_coef;

#ifdef ZP_X86
/* Software prefetch of the four streams 2 KiB ahead (one cache line each). The hardware
 * prefetcher alone leaves ~8% of the bandwidth unused on four concurrent streams per core;
 * measured in benchmarks/adamw_kernel.py. A prefetch past the end of a buffer is harmless. */
#define ZP_PREFETCH_DISTANCE 512 /* floats */
#define ZP_PREFETCH_AHEAD(at)                                                                 \
  do {                                                                                        \
    _mm_prefetch((const char *)(p + (at) + ZP_PREFETCH_DISTANCE), _MM_HINT_T0);               \
    _mm_prefetch((const char *)(g + (at) + ZP_PREFETCH_DISTANCE), _MM_HINT_T0);               \
    _mm_prefetch((const char *)(m + (at) + ZP_PREFETCH_DISTANCE), _MM_HINT_T0);               \
    _mm_prefetch((const char *)(v + (at) + ZP_PREFETCH_DISTANCE), _MM_HINT_T0);               \
  } while (0)
#endif

typedef void (*zp_adamw_body)(const zp_adamw_coef *c, float *restrict p, const float *restrict g,
                              float *restrict m, float *restrict v, int64_t n);

static void zp_adamw_scalar(const zp_adamw_coef *c, float *restrict p, const float *restrict g,
                            float *restrict m, float *restrict v, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    float gi = g[i] * c->grad_scale;
    float pi = p[i] * c->decay;
    float d = gi - m[i];
    float mi = c->lerp_small ? fmaf(c->lerp_w, d, m[i]) : fmaf(c->lerp_wm1, d, gi);
    float vi = fmaf(c->one_minus_beta2 * gi, gi, v[i] * c->beta2);
    float denom = sqrtf(vi) / c->bc2_sqrt + c->eps;
    p[i] = pi + (c->neg_step * mi) / denom;
    m[i] = mi;
    v[i] = vi;
  }
}

#ifdef ZP_X86
__attribute__((target("avx2,fma"))) static void
zp_adamw_avx2(const zp_adamw_coef *c, float *restrict p, const float *restrict g, float *restrict m,
              float *restrict v, int64_t n) {
  const __m256 decay = _mm256_set1_ps(c->decay), w = _mm256_set1_ps(c->lerp_w);
  const __m256 b2 = _mm256_set1_ps(c->beta2), omb2 = _mm256_set1_ps(c->one_minus_beta2);
  const __m256 neg_step = _mm256_set1_ps(c->neg_step), bc2 = _mm256_set1_ps(c->bc2_sqrt);
  const __m256 wm1 = _mm256_set1_ps(c->lerp_wm1);
  const int small = c->lerp_small;
  const __m256 eps = _mm256_set1_ps(c->eps), scale = _mm256_set1_ps(c->grad_scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if ((i & 15) == 0)
      ZP_PREFETCH_AHEAD(i);
    __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(g + i), scale);
    __m256 mi = _mm256_loadu_ps(m + i);
    __m256 pi = _mm256_mul_ps(_mm256_loadu_ps(p + i), decay);
    __m256 d = _mm256_sub_ps(gi, mi);
    mi = small ? _mm256_fmadd_ps(w, d, mi) : _mm256_fmadd_ps(wm1, d, gi);
    __m256 vi = _mm256_mul_ps(_mm256_loadu_ps(v + i), b2);
    vi = _mm256_fmadd_ps(_mm256_mul_ps(omb2, gi), gi, vi);
    __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), bc2), eps);
    pi = _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(neg_step, mi), denom));
    _mm256_storeu_ps(p + i, pi);
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
  }
  zp_adamw_scalar(c, p + i, g + i, m + i, v + i, n - i);
}

/* One 16-float vector of the update; inlined twice per iteration of the AVX-512 loop so that
 * two independent sqrt/div chains are in flight. */
#define ZP_ADAMW_AVX512_BODY(off)                                                            \
  do {                                                                                       \
    __m512 gi = _mm512_mul_ps(_mm512_loadu_ps(g + i + (off)), scale);                          \
    __m512 mi = _mm512_loadu_ps(m + i + (off));                                                \
    __m512 pi = _mm512_mul_ps(_mm512_loadu_ps(p + i + (off)), decay);                          \
    __m512 d = _mm512_sub_ps(gi, mi);                                                          \
    mi = small ? _mm512_fmadd_ps(w, d, mi) : _mm512_fmadd_ps(wm1, d, gi);                      \
    __m512 vi = _mm512_mul_ps(_mm512_loadu_ps(v + i + (off)), b2);                             \
    vi = _mm512_fmadd_ps(_mm512_mul_ps(omb2, gi), gi, vi);                                     \
    __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), bc2), eps);                 \
    pi = _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(neg_step, mi), denom));                 \
    _mm512_storeu_ps(p + i + (off), pi);                                                       \
    _mm512_storeu_ps(m + i + (off), mi);                                                       \
    _mm512_storeu_ps(v + i + (off), vi);                                                       \
  } while (0)

__attribute__((target("avx512f"))) static void
zp_adamw_avx512(const zp_adamw_coef *c, float *restrict p, const float *restrict g,
                float *restrict m, float *restrict v, int64_t n) {
  const __m512 decay = _mm512_set1_ps(c->decay), w = _mm512_set1_ps(c->lerp_w);
  const __m512 b2 = _mm512_set1_ps(c->beta2), omb2 = _mm512_set1_ps(c->one_minus_beta2);
  const __m512 neg_step = _mm512_set1_ps(c->neg_step), bc2 = _mm512_set1_ps(c->bc2_sqrt);
  const __m512 wm1 = _mm512_set1_ps(c->lerp_wm1);
  const int small = c->lerp_small;
  const __m512 eps = _mm512_set1_ps(c->eps), scale = _mm512_set1_ps(c->grad_scale);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    ZP_PREFETCH_AHEAD(i);
    ZP_PREFETCH_AHEAD(i + 16);
    ZP_ADAMW_AVX512_BODY(0);
    ZP_ADAMW_AVX512_BODY(16);
  }
  for (; i + 16 <= n; i += 16)
    ZP_ADAMW_AVX512_BODY(0);
  zp_adamw_scalar(c, p + i, g + i, m + i, v + i, n - i);
}
#endif

/* The best body this CPU runs, capped by ZP_CPU_ISA ("avx512", "avx2" or "scalar") when set:
 * the tests use the cap to check every path against the others. */
static zp_adamw_body zp_adamw_pick(const char **isa) {
  const char *cap = getenv("ZP_CPU_ISA");
  int allow512 = cap == NULL || cap[0] == '\0' || strcmp(cap, "avx512") == 0;
  int allow2 = allow512 || strcmp(cap, "avx2") == 0;
#ifdef ZP_X86
  __builtin_cpu_init();
  if (allow512 && __builtin_cpu_supports("avx512f")) {
    *isa = "avx512";
    return zp_adamw_avx512;
  }
  if (allow2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    *isa = "avx2";
    return zp_adamw_avx2;
  }
#else
  (void)allow2;
#endif
  *isa = "scalar";
  return zp_adamw_scalar;
}

const char *zp_adamw_isa(void) {
  const char *isa;
  zp_adamw_pick(&isa);
  return isa;
}

typedef struct {
  const zp_adamw_segment *segments;
  const zp_adamw_coef *coefs;
  const int64_t *starts; /* n_segments + 1 prefix sums of numel */
  int32_t n_segments;
  zp_adamw_body body;
} zp_adamw_job;

/* Runs the elements [begin, end) of the segments laid end to end. */
static void zp_adamw_range(void *ctx, int64_t begin, int64_t end) {
  const zp_adamw_job *job = ctx;
  int32_t s = 0;
  while (job->starts[s + 1] <= begin)
    s++;
  for (; s < job->n_segments && job->starts[s] < end; s++) {
    const zp_adamw_segment *seg = &job->segments[s];
    int64_t lo = begin > job->starts[s] ? begin - job->starts[s] : 0;
    int64_t hi = (end < job->starts[s + 1] ? end : job->starts[s + 1]) - job->starts[s];
    if (hi > lo)
      job->body(&job->coefs[s], seg->param + lo, seg->grad + lo, seg->exp_avg + lo,
                seg->exp_avg_sq + lo, hi - lo);
  }
}

static zp_status zp_adamw_check_group(const zp_adamw_group *g, int32_t index) {
  /* Written so that NaN fails every check. */
  if (!(g->lr >= 0.0))
    return zp_fail(ZP_ERR_INVALID, "adamw: group %d: lr must be >= 0, got %g", index, g->lr);
  if (!(g->beta1 >= 0.0 && g->beta1 < 1.0))
    return zp_fail(ZP_ERR_INVALID, "adamw: group %d: beta1 must be in [0, 1), got %g", index,
                   g->beta1);
  if (!(g->beta2 >= 0.0 && g->beta2 < 1.0))
    return zp_fail(ZP_ERR_INVALID, "adamw: group %d: beta2 must be in [0, 1), got %g", index,
                   g->beta2);
  if (!(g->eps >= 0.0))
    return zp_fail(ZP_ERR_INVALID, "adamw: group %d: eps must be >= 0, got %g", index, g->eps);
  if (!(g->weight_decay >= 0.0))
    return zp_fail(ZP_ERR_INVALID, "adamw: group %d: weight_decay must be >= 0, got %g", index,
                   g->weight_decay);
  if (!isfinite(g->grad_scale))
    return zp_fail(ZP_ERR_INVALID, "adamw: group %d: grad_scale must be finite, got %g", index,
                   g->grad_scale);
  return ZP_OK;
}

zp_status zp_adamw_step_cpu(const zp_adamw_segment *segments, int32_t n_segments,
                            const zp_adamw_group *groups, int32_t n_groups, int32_t n_threads) {
  if (n_segments < 0 || (n_segments > 0 && (segments == NULL || groups == NULL)))
    return zp_fail(ZP_ERR_INVALID, "adamw: bad segment list (n_segments=%d)", n_segments);
  for (int32_t k = 0; k < n_groups; k++)
    ZP_TRY(zp_adamw_check_group(&groups[k], k));
  for (int32_t s = 0; s < n_segments; s++) {
    const zp_adamw_segment *seg = &segments[s];
    if (seg->group < 0 || seg->group >= n_groups)
      return zp_fail(ZP_ERR_RANGE, "adamw: segment %d names group %d, outside [0, %d)", s,
                     seg->group, n_groups);
    if (seg->numel < 0 || seg->step < 1)
      return zp_fail(ZP_ERR_INVALID, "adamw: segment %d has numel %lld, step %lld; need >= 0, >= 1",
                     s, (long long)seg->numel, (long long)seg->step);
    if (seg->numel > 0 && (!seg->param || !seg->grad || !seg->exp_avg || !seg->exp_avg_sq))
      return zp_fail(ZP_ERR_INVALID, "adamw: segment %d has a NULL buffer", s);
  }
  if (n_segments == 0)
    return ZP_OK;

  zp_adamw_coef *coefs = malloc((size_t)n_segments * sizeof *coefs);
  int64_t *starts = malloc(((size_t)n_segments + 1) * sizeof *starts);
  if (coefs == NULL || starts == NULL) {
    free(coefs);
    free(starts);
    return zp_fail(ZP_ERR_NOMEM, "adamw: out of memory for %d segments", n_segments);
  }
  starts[0] = 0;
  for (int32_t s = 0; s < n_segments; s++) {
    const zp_adamw_segment *seg = &segments[s];
    const zp_adamw_group *g = &groups[seg->group];
    double bc1 = 1.0 - pow(g->beta1, (double)seg->step);
    double bc2 = 1.0 - pow(g->beta2, (double)seg->step);
    coefs[s] = (zp_adamw_coef){
        .decay = (float)(1.0 - g->lr * g->weight_decay),
        .lerp_w = (float)(1.0 - g->beta1),
        .beta2 = (float)g->beta2,
        .one_minus_beta2 = (float)(1.0 - g->beta2),
        .neg_step = (float)(-(g->lr / bc1)),
        .lerp_wm1 = (float)(1.0 - g->beta1) - 1.0f,
        .lerp_small = fabsf((float)(1.0 - g->beta1)) < 0.5f,
        .bc2_sqrt = (float)sqrt(bc2),
        .eps = (float)g->eps,
        .grad_scale = (float)g->grad_scale,
    };
    starts[s + 1] = starts[s] + seg->numel;
  }
  const char *isa;
  zp_adamw_job job = {segments, coefs, starts, n_segments, zp_adamw_pick(&isa)};
  /* 16 floats = one cache line per range start; below 64K elements a thread is not worth it. */
  zp_status status = zp_parallel_for(starts[n_segments], n_threads, 16, 1 << 16, zp_adamw_range, &job);
  free(coefs);
  free(starts);
  return status;
}
