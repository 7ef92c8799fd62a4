/* optim.c - the fused CPU optimizer family (optim.h): AdamW, Adam, SGD, Adagrad, Lion.
 *
 * Each segment is walked in chunks of ZP_OPT_CHUNK elements: a bf16/fp16 gradient is widened
 * into a chunk buffer that stays in L1, the update body of the kind runs on fp32, and the new
 * master is narrowed into param_out while it is still in L1, so memory is crossed once. An fp32
 * gradient with no param_out skips the chunking (the body runs on the whole range), and so does
 * a bf16 gradient with a bf16 param_out rounded to nearest (the mixed-precision case that
 * matters most): the SIMD bodies of every kind widen and narrow in registers, which saves the
 * chunk's store and reload (4-14% of the time at 10M-30M elements for SGD, Adagrad and Lion)
 * and gives the same bits.
 *
 * The bodies (scalar here; AVX2+FMA and AVX-512F in optim_x86.c; optim_body.h) perform the same
 * float operations in the same order, and the C is compiled as ISO C11 (no floating-point
 * contraction), so every body gives the same bits. The order is torch's (single-tensor CPU path; its AVX2/AVX-512 builds fuse a multiply
 * into a following add, so `a.add(b, alpha=s)` is fma(s, b, a), addcmul is fma, and lerp is
 * ATen's two-branch fma, and addcdiv is (value * t1) / t2). */
#include "kernels/cpu/optim.h"
#include "kernels/cpu/optim_body.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/parallel.h"
#include "kernels/cpu/convert.h"
#include "kernels/cpu/tuning.h"
#include "kernels/optim_common.h"

#if defined(__x86_64__) || defined(__i386__)
#define ZP_X86 1 /* optim_x86.c's bodies exist */
#endif

#define ZP_OPT_CHUNK 1024 /* elements; chunks start at multiples of this within a segment */

/* zp_opt_coef and zp_opt_coef_make (the per-segment constants) are optim_common.h's, shared
 * with the CUDA family. */

/* ---- scalar bodies: the definition every SIMD body reproduces ---- */

void zp_adam_scalar(const zp_opt_coef *c, float *restrict p, const float *restrict g,
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

void zp_sgd_scalar(const zp_opt_coef *c, float *restrict p, const float *restrict g,
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

void zp_adagrad_scalar(const zp_opt_coef *c, float *restrict p, const float *restrict g,
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

void zp_lion_scalar(const zp_opt_coef *c, float *restrict p, const float *restrict g,
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

/* Indexed by zp_isa, then zp_opt_kind (AdamW and Adam share a body). */
static const zp_opt_body zp_opt_bodies[3][ZP_OPT_KINDS] = {
    {zp_adam_scalar, zp_adam_scalar, zp_sgd_scalar, zp_adagrad_scalar, zp_lion_scalar},
#ifdef ZP_X86
    {zp_adam_avx2, zp_adam_avx2, zp_sgd_avx2, zp_adagrad_avx2, zp_lion_avx2},
    {zp_adam_avx512, zp_adam_avx512, zp_sgd_avx512, zp_adagrad_avx512, zp_lion_avx512},
#endif
};

/* Indexed by zp_isa, then zp_opt_kind; the scalar ISA keeps the chunked path. */
static const zp_opt_bf16_body zp_opt_bf16_bodies[3][ZP_OPT_KINDS] = {
    {NULL, NULL, NULL, NULL, NULL},
#ifdef ZP_X86
    {zp_adam_bf16_avx2, zp_adam_bf16_avx2, zp_sgd_bf16_avx2, zp_adagrad_bf16_avx2,
     zp_lion_bf16_avx2},
    {zp_adam_bf16_avx512, zp_adam_bf16_avx512, zp_sgd_bf16_avx512, zp_adagrad_bf16_avx512,
     zp_lion_bf16_avx512},
#endif
};

typedef struct {
  const zp_opt_segment *segments;
  const zp_opt_coef *coefs;
  const int64_t *starts; /* n_segments + 1 prefix sums of numel */
  int32_t n_segments;
  const zp_opt_body *bodies;
  const zp_convert_ops *convert;
  const zp_opt_bf16_body *bf16; /* by kind; NULL: bf16 grad and param_out take the chunks */
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
  const zp_opt_bf16_body bf16 = job->bf16[c->kind];
  if (bf16 != NULL && c->grad_dtype == ZP_BF16 && c->param_dtype == ZP_BF16 &&
      !(c->flags & ZP_OPT_STOCHASTIC_ROUNDING)) {
    uint16_t *out = (uint16_t *)seg->param_out + lo;
    bf16(c, seg->master + lo, (const uint16_t *)seg->grad + lo, zp_at(seg->state0, lo),
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
                    zp_opt_bf16_bodies[tune.isa],
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
