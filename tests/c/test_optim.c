/* test_optim.c - the fused optimizer family (optim.h) against a double-precision reference.
 *
 * Every kind with its flags and every grad/param dtype, over 24 steps on segments of awkward
 * sizes and alignments. Each step is checked on its own: the reference starts from the kernel's
 * fp32 state of the step before, and a value passes when |kernel - reference| <= RTOL * (sum of
 * the magnitudes of the terms that make it), RTOL = 1e-5 (fp32 rounding is ~6e-8 per
 * operation). param_out (poisoned with NaN before each step) must be exactly the kernel's new
 * master rounded (RNE, or the stochastic rounding of convert.h); bytes before each buffer are
 * guards that must stay untouched. Then: every ISA, thread count and prefetch distance gives
 * the same bits, and bad arguments fail with a message. Last, the family's bound
 * (stream_bound.h) and the block split it shares with the kernels (zp_parallel_blocks). */
#define _POSIX_C_SOURCE 200112L /* setenv */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kernels/cpu/convert.h"
#include "kernels/cpu/optim.h"
#include "kernels/cpu/stream_bound.h"
#include "kernels/cpu/tuning.h"
#include "common/parallel.h"

#define RTOL 1e-5
#define N_STEPS 24
#define GUARD 0xA5

#define MAXI ZP_OPT_MAXIMIZE
#define AMS ZP_OPT_AMSGRAD
#define NEST ZP_OPT_NESTEROV
#define SR ZP_OPT_STOCHASTIC_ROUNDING

typedef struct {
  zp_opt_group g;
  int with_out; /* param_out given (always, unless param_dtype is fp32) */
} test_group;

static const test_group groups0[] = {
    /* kind grad param flags lr beta1 beta2 eps wd grad_scale seed */
    {{ZP_OPT_ADAMW, ZP_F32, ZP_F32, 0, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0, 0}, 0},
    {{ZP_OPT_ADAMW, ZP_BF16, ZP_BF16, AMS | MAXI, 3e-2, 0.8, 0.95, 1e-3, 0.1, 0.5, 0}, 1},
    {{ZP_OPT_ADAM, ZP_F16, ZP_F16, 0, 1e-2, 0.3, 0.9, 1e-6, 0.1, 2.0, 0}, 1},
    {{ZP_OPT_ADAM, ZP_F32, ZP_F32, AMS, 5e-4, 0.0, 0.5, 1e-8, 0.0, 1.0, 0}, 1},
    {{ZP_OPT_SGD, ZP_F32, ZP_BF16, SR, 1e-2, 0.9, 0.1, 0.0, 1e-2, 1.0, 0}, 1},
    {{ZP_OPT_SGD, ZP_BF16, ZP_F16, NEST | MAXI, 0.1, 0.8, 0.0, 0.0, 0.0, 0.25, 0}, 1},
    {{ZP_OPT_SGD, ZP_F16, ZP_F32, 0, 1e-3, 0.0, 0.0, 0.0, 0.3, 1.0, 0}, 0},
    {{ZP_OPT_ADAGRAD, ZP_F32, ZP_BF16, 0, 1e-2, 0.01, 0.0, 1e-10, 0.05, 1.0, 0}, 1},
    {{ZP_OPT_ADAGRAD, ZP_F16, ZP_F32, MAXI, 0.1, 0.0, 0.0, 0.1, 0.0, 3.0, 0}, 1},
    {{ZP_OPT_LION, ZP_F32, ZP_BF16, SR, 1e-4, 0.9, 0.99, 0.0, 0.1, 1.0, 0}, 1},
    {{ZP_OPT_LION, ZP_BF16, ZP_F16, MAXI, 3e-4, 0.95, 0.98, 0.0, 0.0, 1.0, 0}, 1},
    {{ZP_OPT_ADAMW, ZP_F16, ZP_BF16, SR, 0.0, 0.9, 0.999, 1e-8, 0.3, 1.0, 0}, 1},
    {{ZP_OPT_SGD, ZP_F32, ZP_F32, 0, 1e-2, 0.5, 0.5, 0.0, 0.0, 1.0, 0}, 0},
    /* nesterov with dampening: torch.optim.SGD computes it for a param group that sets both */
    {{ZP_OPT_SGD, ZP_F32, ZP_BF16, NEST, 1e-2, 0.9, 0.25, 0.0, 1e-2, 1.0, 0}, 1},
};
#define N_GROUPS ((int32_t)(sizeof groups0 / sizeof groups0[0]))

typedef struct {
  int64_t numel, first_step;
  int32_t group, off; /* off: guard elements before each buffer (alignment varies) */
} seg_spec;

static const seg_spec specs[] = {
    {300000, 1, 4, 0}, {0, 1, 0, 3},     {1, 1, 1, 1},    {7, 7, 2, 2},     {8, 1, 3, 0},
    {15, 2, 5, 1},     {16, 1000, 0, 3}, {17, 1, 6, 2},   {33, 50, 7, 1},   {1000, 1, 8, 3},
    {4099, 10, 9, 1},  {65, 1, 10, 2},   {31, 1, 5, 0},   {2049, 3, 1, 1},  {70001, 1, 9, 2},
    {40, 1, 11, 1},    {3000, 1, 12, 3}, {129, 4, 2, 0},  {1031, 1, 7, 2},  {9, 1, 10, 0},
    {513, 3, 13, 1},   {17, 1, 13, 2},
};
#define N_SEGS ((int32_t)(sizeof specs / sizeof specs[0]))

static size_t dtype_size(int32_t d) { return d == ZP_F32 ? 4 : 2; }

typedef struct {
  test_group groups[N_GROUPS];
  zp_opt_group gs[N_GROUPS];
  zp_opt_segment segs[N_SEGS];
  unsigned char *alloc[N_SEGS][6]; /* master, state0-2, grad, out (NULL when unused) */
  float *snap[N_SEGS][4];          /* master, state0-2 before the step */
  float *gw[N_SEGS];               /* the gradient widened to fp32 */
} fixture;

static void fixture_free(fixture *f) {
  for (int32_t s = 0; s < N_SEGS; s++) {
    for (int a = 0; a < 6; a++)
      free(f->alloc[s][a]);
    for (int a = 0; a < 4; a++)
      free(f->snap[s][a]);
    free(f->gw[s]);
  }
}

static float nonzero(zt_rng *r, double lo, double hi) {
  double x = lo + (hi - lo) * zt_unit(r);
  return (float)(zt_next(r) & 1 ? x : -x);
}

/* A buffer of n elements of `size` bytes after `off` guard elements. */
static void *guarded(fixture *f, int32_t s, int a, int64_t n, size_t size, int32_t off) {
  size_t bytes = (size_t)(n + off) * size;
  f->alloc[s][a] = malloc(bytes ? bytes : 1);
  if (f->alloc[s][a] == NULL)
    return NULL;
  memset(f->alloc[s][a], GUARD, bytes);
  return f->alloc[s][a] + (size_t)off * size;
}

static int fixture_init(fixture *f, zt_rng *r) {
  memset(f, 0, sizeof *f);
  memcpy(f->groups, groups0, sizeof groups0);
  for (int32_t k = 0; k < N_GROUPS; k++)
    f->gs[k] = f->groups[k].g;
  for (int32_t s = 0; s < N_SEGS; s++) {
    const seg_spec *sp = &specs[s];
    const test_group *tg = &f->groups[sp->group];
    const zp_opt_group *g = &tg->g;
    const int64_t n = sp->numel;
    int adam = g->kind == ZP_OPT_ADAMW || g->kind == ZP_OPT_ADAM;
    int need[3] = {g->kind != ZP_OPT_SGD || g->beta1 != 0.0, adam, adam && (g->flags & AMS)};
    zp_opt_segment *seg = &f->segs[s];
    *seg = (zp_opt_segment){NULL, NULL, NULL, NULL, NULL, NULL, n, sp->first_step, sp->group};
    if (!(seg->master = guarded(f, s, 0, n, 4, sp->off)))
      return 0;
    float *st[3] = {NULL, NULL, NULL};
    for (int a = 0; a < 3; a++)
      if (need[a] && !(st[a] = guarded(f, s, 1 + a, n, 4, sp->off)))
        return 0;
    seg->state0 = st[0], seg->state1 = st[1], seg->state2 = st[2];
    if (!(seg->grad = guarded(f, s, 4, n, dtype_size(g->grad_dtype), sp->off)))
      return 0;
    if (tg->with_out && !(seg->param_out = guarded(f, s, 5, n, dtype_size(g->param_dtype), sp->off)))
      return 0;
    for (int a = 0; a < 4; a++)
      if (!(f->snap[s][a] = malloc((size_t)(n > 0 ? n : 1) * 4)))
        return 0;
    if (!(f->gw[s] = malloc((size_t)(n > 0 ? n : 1) * 4)))
      return 0;
    const int later = sp->first_step > 1;
    for (int64_t i = 0; i < n; i++) {
      seg->master[i] = nonzero(r, 0.01, 2.0);
      if (adam) {
        st[0][i] = later ? nonzero(r, 1e-4, 0.1) : 0.0f;
        st[1][i] = later ? (float)(1e-6 + 0.01 * zt_unit(r)) : 0.0f;
        if (st[2])
          st[2][i] = st[1][i] * (float)(1.0 + zt_unit(r) * (zt_next(r) & 1));
      } else if (g->kind == ZP_OPT_SGD && st[0]) {
        st[0][i] = later ? nonzero(r, 1e-4, 0.1) : NAN; /* step 1 must not read it */
      } else if (g->kind == ZP_OPT_ADAGRAD) {
        st[0][i] = (float)(0.1 * zt_unit(r)); /* initial_accumulator_value, or later sums */
      } else if (g->kind == ZP_OPT_LION) {
        st[0][i] = later ? nonzero(r, 1e-4, 0.1) : 0.0f;
      }
    }
  }
  return 1;
}

/* New gradients in each segment's dtype, their widened values, a poisoned param_out, and a copy
 * of master and states. */
static void new_step(fixture *f, zt_rng *r, int t) {
  static const double scales[] = {1.0, 1e-3, 1e3};
  for (int32_t k = 0; k < N_GROUPS; k++)
    f->gs[k].seed = 1000u + (uint64_t)t * 7919u + (uint64_t)k;
  for (int32_t s = 0; s < N_SEGS; s++) {
    zp_opt_segment *seg = &f->segs[s];
    const zp_opt_group *g = &f->gs[seg->group];
    seg->step = specs[s].first_step + t;
    for (int64_t i = 0; i < seg->numel; i++) {
      float x = nonzero(r, 1e-3 * scales[s % 3], scales[s % 3]);
      if (g->grad_dtype == ZP_F32) {
        ((float *)seg->grad)[i] = x;
        f->gw[s][i] = x;
      } else if (g->grad_dtype == ZP_BF16) {
        ((uint16_t *)seg->grad)[i] = zp_f32_to_bf16(x);
        f->gw[s][i] = zp_bf16_to_f32(zp_f32_to_bf16(x));
      } else {
        ((uint16_t *)seg->grad)[i] = zp_f32_to_f16(x);
        f->gw[s][i] = zp_f16_to_f32(zp_f32_to_f16(x));
      }
    }
    if (seg->param_out)
      memset(seg->param_out, 0xFF, (size_t)seg->numel * dtype_size(g->param_dtype)); /* NaN */
    float *cur[4] = {seg->master, seg->state0, seg->state1, seg->state2};
    for (int a = 0; a < 4; a++)
      if (cur[a])
        memcpy(f->snap[s][a], cur[a], (size_t)seg->numel * 4);
  }
}

static int close_enough(double got, double want, double scale) {
  return fabs(got - want) <= RTOL * scale + 1e-30;
}

/* Expected master and states of one element, from the kernel's previous fp32 values. */
typedef struct {
  double p, s[3];
  double p_scale, s_scale[3];
  int skip_p; /* Lion: the sign of a c that cancels to ~0 is not defined by the reference */
} expect;

static expect reference(const zp_opt_group *g, int64_t step, float gw, const float prev[4]) {
  expect e = {0};
  const double sgn = (g->flags & MAXI) ? -1.0 : 1.0, p0 = prev[0];
  double gr = sgn * gw * g->grad_scale, gmag = fabs(gr);
  const int l2 = g->kind != ZP_OPT_ADAMW && g->kind != ZP_OPT_LION && g->weight_decay != 0.0;
  if (l2)
    gr += g->weight_decay * p0, gmag += g->weight_decay * fabs(p0);
  if (g->kind == ZP_OPT_ADAMW || g->kind == ZP_OPT_ADAM) {
    const double bc1 = 1.0 - pow(g->beta1, (double)step), bc2 = 1.0 - pow(g->beta2, (double)step);
    const double decay = g->kind == ZP_OPT_ADAMW ? 1.0 - g->lr * g->weight_decay : 1.0;
    const double m0 = prev[1], v0 = prev[2];
    e.s[0] = m0 + (1.0 - g->beta1) * (gr - m0);
    e.s_scale[0] = fabs(m0) + gmag;
    e.s[1] = v0 * g->beta2 + (1.0 - g->beta2) * gr * gr;
    e.s_scale[1] = v0 * g->beta2 + (1.0 - g->beta2) * gmag * gmag;
    double vv = e.s[1];
    if (g->flags & AMS) {
      e.s[2] = vv = prev[3] > e.s[1] ? prev[3] : e.s[1];
      e.s_scale[2] = e.s_scale[1] + prev[3];
    }
    const double denom = sqrt(vv) / sqrt(bc2) + g->eps;
    e.p = p0 * decay - g->lr / bc1 * e.s[0] / denom;
    e.p_scale = fabs(p0) + g->lr / bc1 * e.s_scale[0] / denom;
  } else if (g->kind == ZP_OPT_SGD) {
    double u = gr, umag = gmag;
    if (g->beta1 != 0.0) {
      double b = step == 1 ? gr : g->beta1 * prev[1] + (1.0 - g->beta2) * gr;
      double bmag = step == 1 ? gmag : g->beta1 * fabs(prev[1]) + fabs(1.0 - g->beta2) * gmag;
      e.s[0] = b, e.s_scale[0] = bmag;
      u = (g->flags & NEST) ? gr + g->beta1 * b : b;
      umag = (g->flags & NEST) ? gmag + g->beta1 * bmag : bmag;
    }
    e.p = p0 - g->lr * u;
    e.p_scale = fabs(p0) + g->lr * umag;
  } else if (g->kind == ZP_OPT_ADAGRAD) {
    const double clr = g->lr / (1.0 + (double)(step - 1) * g->beta1);
    e.s[0] = prev[1] + gr * gr;
    e.s_scale[0] = prev[1] + gmag * gmag;
    const double std = sqrt(e.s[0]) + g->eps;
    e.p = p0 - clr * gr / std;
    e.p_scale = fabs(p0) + clr * gmag / std;
  } else { /* Lion */
    const double m0 = prev[1];
    const double c = g->beta1 * m0 + (1.0 - g->beta1) * gr;
    const double cmag = g->beta1 * fabs(m0) + (1.0 - g->beta1) * gmag;
    e.skip_p = fabs(c) <= 1e-5 * cmag;
    e.p = p0 * (1.0 - g->lr * g->weight_decay) - g->lr * (c > 0 ? 1.0 : c < 0 ? -1.0 : 0.0);
    e.p_scale = fabs(p0) + g->lr;
    e.s[0] = g->beta2 * m0 + (1.0 - g->beta2) * gr;
    e.s_scale[0] = g->beta2 * fabs(m0) + (1.0 - g->beta2) * gmag;
  }
  return e;
}

/* param_out must be the new master rounded exactly as convert.h says. */
static uint32_t expected_out(const zp_opt_group *g, int32_t s, int64_t i, float master) {
  if (g->param_dtype == ZP_F32)
    return zp_f32_bits(master);
  if (g->param_dtype == ZP_F16)
    return zp_f32_to_f16(master);
  if (g->flags & SR)
    return zp_f32_to_bf16_sr(
        master, zp_sr_bits(zp_sr_key(g->seed, (uint64_t)s, (uint64_t)i >> 32), (uint32_t)i));
  return zp_f32_to_bf16(master);
}

static int guards_intact(const fixture *f, int32_t s) {
  for (int a = 0; a < 6; a++) {
    const unsigned char *base = f->alloc[s][a];
    size_t size = a == 4   ? dtype_size(f->gs[specs[s].group].grad_dtype)
                  : a == 5 ? dtype_size(f->gs[specs[s].group].param_dtype)
                           : 4;
    for (size_t b = 0; base && b < (size_t)specs[s].off * size; b++)
      if (base[b] != GUARD)
        return 0;
  }
  return 1;
}

static int check_step(const fixture *f, int t) {
  for (int32_t s = 0; s < N_SEGS; s++) {
    const zp_opt_segment *seg = &f->segs[s];
    const zp_opt_group *g = &f->gs[seg->group];
    if (!CHECK_MSG(guards_intact(f, s), "step %d segment %d: a guard before a buffer was written",
                   t, s))
      return 0;
    float *cur[4] = {seg->master, seg->state0, seg->state1, seg->state2};
    for (int64_t i = 0; i < seg->numel; i++) {
      float prev[4];
      for (int a = 0; a < 4; a++)
        prev[a] = cur[a] ? f->snap[s][a][i] : 0.0f;
      expect e = reference(g, seg->step, f->gw[s][i], prev);
      int ok = e.skip_p || close_enough(seg->master[i], e.p, e.p_scale);
      for (int a = 0; a < 3; a++)
        ok &= cur[a + 1] == NULL || close_enough(cur[a + 1][i], e.s[a], e.s_scale[a]);
      if (!CHECK_MSG(ok, "step %d, segment %d (group %d, kind %d, step %lld), element %lld: "
                         "master %.9g want %.9g; state0 %.9g want %.9g; state1 %.9g want %.9g "
                         "(from p %.9g g %.9g s0 %.9g s1 %.9g)",
                     t, s, seg->group, g->kind, (long long)seg->step, (long long)i,
                     (double)seg->master[i], e.p, cur[1] ? (double)cur[1][i] : 0.0, e.s[0],
                     cur[2] ? (double)cur[2][i] : 0.0, e.s[1], (double)prev[0],
                     (double)f->gw[s][i], (double)prev[1], (double)prev[2]))
        return 0;
      if (seg->param_out) {
        uint32_t got = g->param_dtype == ZP_F32 ? zp_f32_bits(((float *)seg->param_out)[i])
                                                : ((uint16_t *)seg->param_out)[i];
        uint32_t want = expected_out(g, s, i, seg->master[i]);
        if (!CHECK_MSG(got == want, "step %d segment %d element %lld: param_out 0x%x, want 0x%x "
                                    "(master %.9g, dtype %d)",
                       t, s, (long long)i, got, want, (double)seg->master[i], g->param_dtype))
          return 0;
      }
    }
  }
  return 1;
}

void test_optim_matches_reference(void) {
  static const int32_t thread_counts[] = {1, 2, 3, 0};
  zt_rng r = zt_rng_seed(2024);
  fixture *f = calloc(1, sizeof *f);
  if (!CHECK(f != NULL) || !CHECK(fixture_init(f, &r))) {
    if (f)
      fixture_free(f);
    free(f);
    return;
  }
  for (int t = 0; t < N_STEPS; t++) {
    new_step(f, &r, t);
    const int32_t n_threads = thread_counts[t % 4];
    if (!CHECK_OK(zp_opt_step_cpu(f->segs, N_SEGS, f->gs, N_GROUPS, n_threads)))
      break;
    if (!check_step(f, t)) {
      printf("  (n_threads %d)\n", n_threads);
      break;
    }
  }
  fixture_free(f);
  free(f);
}

/* Every (ISA, thread count) pair takes the same step from the same state: identical bits. */
void test_optim_isas_and_threads_agree(void) {
  static const char *isas[] = {"scalar", "avx2", "avx512"};
  zt_rng r = zt_rng_seed(31337);
  fixture *f = calloc(1, sizeof *f);
  unsigned char **first = calloc(N_SEGS * 6, sizeof *first);
  if (!CHECK(f != NULL && first != NULL) || !CHECK(fixture_init(f, &r))) {
    if (f)
      fixture_free(f);
    free(f), free(first);
    return;
  }
  new_step(f, &r, 0);
  for (int32_t s = 0; s < N_SEGS; s++)
    f->segs[s].step = specs[s].first_step; /* SGD's step-1 path included */
  /* the prefetch distance changes with the thread count so that every ISA meets every
   * distance (none, less than a line, the default, far) without 3 x 3 x 4 runs */
  static const char *prefetch[] = {"0", "100:l1", "2048", "65536"};
  int runs = 0;
  for (int isa = 0; isa < 3; isa++) {
    setenv("ZP_CPU_ISA", isas[isa], 1);
    for (int32_t threads = 1; threads <= 3; threads++, runs++) {
      setenv("ZP_CPU_PREFETCH", prefetch[(isa + threads) % 4], 1);
      /* streaming stores for every 16-bit param_out (1 byte and up), at awkward offsets */
      setenv("ZP_CPU_STREAM", threads == 2 ? "1" : "0", 1);
      for (int32_t s = 0; s < N_SEGS; s++) { /* back to the state before the step */
        zp_opt_segment *seg = &f->segs[s];
        float *cur[4] = {seg->master, seg->state0, seg->state1, seg->state2};
        for (int a = 0; a < 4; a++)
          if (cur[a])
            memcpy(cur[a], f->snap[s][a], (size_t)seg->numel * 4);
      }
      if (!CHECK_OK(zp_opt_step_cpu(f->segs, N_SEGS, f->gs, N_GROUPS, threads)))
        break;
      for (int32_t s = 0; s < N_SEGS; s++) {
        for (int a = 0; a < 6; a++) {
          const zp_opt_group *g = &f->gs[specs[s].group];
          size_t size = a == 4 ? dtype_size(g->grad_dtype) : a == 5 ? dtype_size(g->param_dtype) : 4;
          size_t bytes = (size_t)(specs[s].numel + specs[s].off) * size;
          if (f->alloc[s][a] == NULL)
            continue;
          if (runs == 0) {
            first[s * 6 + a] = malloc(bytes ? bytes : 1);
            if (first[s * 6 + a])
              memcpy(first[s * 6 + a], f->alloc[s][a], bytes);
          } else if (first[s * 6 + a]) {
            CHECK_MSG(memcmp(first[s * 6 + a], f->alloc[s][a], bytes) == 0,
                      "isa %s, %d threads, prefetch %s: segment %d buffer %d differs from "
                      "scalar, 1 thread",
                      isas[isa], threads, prefetch[(isa + threads) % 4], s, a);
          }
        }
      }
    }
  }
  unsetenv("ZP_CPU_ISA");
  unsetenv("ZP_CPU_PREFETCH");
  unsetenv("ZP_CPU_STREAM");
  printf("  %d runs (isa x threads x prefetch) compared bitwise; isa here: %s (%s)\n", runs,
         zp_isa_name(zp_isa_pick()), zp_cpu_vendor_name(zp_cpu_vendor_id()));
  for (int i = 0; i < N_SEGS * 6; i++)
    free(first[i]);
  free(first);
  fixture_free(f);
  free(f);
}

/* ---- errors, each on a fresh thread so the message is proven to come from that call ------ */

typedef struct {
  const char *what;
  zp_opt_group group;
  int64_t numel, step;
  int32_t seg_group;
  int drop; /* bit a: pass state a as NULL; bit 3: param_out NULL; bit 4: master NULL */
  zp_status want;
} error_case;

static void run_error_case(void *arg) {
  const error_case *c = arg;
  float p[4] = {1, 2, 3, 4}, g[4] = {1, 1, 1, 1}, s0[4] = {0}, s1[4] = {0}, s2[4] = {0};
  uint16_t out[4] = {0};
  const zp_opt_segment seg = {(c->drop & 16) ? NULL : p, g,
                              (c->drop & 1) ? NULL : s0, (c->drop & 2) ? NULL : s1,
                              (c->drop & 4) ? NULL : s2, (c->drop & 8) ? NULL : out,
                              c->numel, c->step, c->seg_group};
  zp_status st = zp_opt_step_cpu(&seg, 1, &c->group, 1, 1);
  CHECK_MSG(st == c->want && zp_last_error()[0] != '\0',
            "%s: status %d (expected %d), message \"%s\"", c->what, (int)st, (int)c->want,
            zp_last_error());
  CHECK_MSG(p[0] == 1 && s0[0] == 0 && out[0] == 0, "%s: a failing call modified its buffers",
            c->what);
}

#define G(kind, gd, pd, flags, lr, b1, b2, eps, wd, scale) \
  {kind, gd, pd, flags, lr, b1, b2, eps, wd, scale, 0}
#define BAD(what, group, ...) {what, group, 4, 1, 0, __VA_ARGS__}

void test_optim_errors(void) {
  const error_case cases[] = {
      BAD("unknown kind", G(7, 0, 1, 0, 1e-3, 0.9, 0.999, 1e-8, 0, 1), 0, ZP_ERR_INVALID),
      BAD("unknown grad dtype", G(0, 3, 1, 0, 1e-3, 0.9, 0.999, 1e-8, 0, 1), 0, ZP_ERR_INVALID),
      BAD("unknown param dtype", G(0, 0, -1, 0, 1e-3, 0.9, 0.999, 1e-8, 0, 1), 0, ZP_ERR_INVALID),
      BAD("unknown flag", G(0, 0, 1, 64, 1e-3, 0.9, 0.999, 1e-8, 0, 1), 0, ZP_ERR_INVALID),
      BAD("amsgrad on sgd", G(2, 0, 1, AMS, 1e-3, 0.9, 0, 0, 0, 1), 0, ZP_ERR_INVALID),
      BAD("nesterov on adamw", G(0, 0, 1, NEST, 1e-3, 0.9, 0.999, 1e-8, 0, 1), 0, ZP_ERR_INVALID),
      BAD("nesterov without momentum", G(2, 0, 1, NEST, 1e-3, 0, 0, 0, 0, 1), 0, ZP_ERR_INVALID),
      BAD("stochastic rounding to fp16", G(0, 0, 2, SR, 1e-3, 0.9, 0.999, 1e-8, 0, 1), 0,
          ZP_ERR_INVALID),
      BAD("lr -1", G(0, 0, 1, 0, -1, 0.9, 0.999, 1e-8, 0, 1), 0, ZP_ERR_INVALID),
      BAD("lr nan", G(3, 0, 1, 0, NAN, 0, 0, 1e-10, 0, 1), 0, ZP_ERR_INVALID),
      BAD("beta1 1", G(0, 0, 1, 0, 1e-3, 1.0, 0.999, 1e-8, 0, 1), 0, ZP_ERR_INVALID),
      BAD("beta2 -0.1 (lion)", G(4, 0, 1, 0, 1e-3, 0.9, -0.1, 0, 0, 1), 0, ZP_ERR_INVALID),
      BAD("eps -1", G(1, 0, 1, 0, 1e-3, 0.9, 0.999, -1, 0, 1), 0, ZP_ERR_INVALID),
      BAD("weight_decay -1", G(2, 0, 1, 0, 1e-3, 0, 0, 0, -1, 1), 0, ZP_ERR_INVALID),
      BAD("grad_scale inf", G(0, 0, 1, 0, 1e-3, 0.9, 0.999, 1e-8, 0, INFINITY), 0, ZP_ERR_INVALID),
      BAD("momentum -0.5", G(2, 0, 1, 0, 1e-3, -0.5, 0, 0, 0, 1), 0, ZP_ERR_INVALID),
      BAD("lr_decay -1", G(3, 0, 1, 0, 1e-3, -1, 0, 1e-10, 0, 1), 0, ZP_ERR_INVALID),
      BAD("adam without state1", G(0, 0, 1, 0, 1e-3, 0.9, 0.999, 1e-8, 0, 1), 2, ZP_ERR_INVALID),
      BAD("amsgrad without state2", G(1, 0, 1, AMS, 1e-3, 0.9, 0.999, 1e-8, 0, 1), 4,
          ZP_ERR_INVALID),
      BAD("sgd momentum without state0", G(2, 0, 1, 0, 1e-3, 0.9, 0, 0, 0, 1), 1, ZP_ERR_INVALID),
      BAD("adagrad without state0", G(3, 0, 1, 0, 1e-3, 0, 0, 1e-10, 0, 1), 1, ZP_ERR_INVALID),
      BAD("lion without state0", G(4, 0, 1, 0, 1e-3, 0.9, 0.99, 0, 0, 1), 1, ZP_ERR_INVALID),
      BAD("bf16 param without param_out", G(4, 0, 1, 0, 1e-3, 0.9, 0.99, 0, 0, 1), 8,
          ZP_ERR_INVALID),
      BAD("no master", G(2, 0, 1, 0, 1e-3, 0, 0, 0, 0, 1), 16, ZP_ERR_INVALID),
      {"numel -1", G(0, 0, 1, 0, 1e-3, 0.9, 0.999, 1e-8, 0, 1), -1, 1, 0, 0, ZP_ERR_INVALID},
      {"step 0", G(0, 0, 1, 0, 1e-3, 0.9, 0.999, 1e-8, 0, 1), 4, 0, 0, 0, ZP_ERR_INVALID},
      {"group 1 of 1", G(0, 0, 1, 0, 1e-3, 0.9, 0.999, 1e-8, 0, 1), 4, 1, 1, 0, ZP_ERR_RANGE},
      {"group -1", G(0, 0, 1, 0, 1e-3, 0.9, 0.999, 1e-8, 0, 1), 4, 1, -1, 0, ZP_ERR_RANGE},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    zt_run_fresh(run_error_case, (void *)&cases[i]);
  /* valid edge cases: SGD without momentum needs no state; an empty call */
  float p[2] = {1, 2}, g[2] = {1, 1};
  const zp_opt_group sgd = G(2, 0, 0, 0, 0.5, 0, 0, 0, 0, 1);
  const zp_opt_segment seg = {p, g, NULL, NULL, NULL, NULL, 2, 1, 0};
  CHECK_OK(zp_opt_step_cpu(&seg, 1, &sgd, 1, 1));
  CHECK(p[0] == 0.5f && p[1] == 1.5f);
  CHECK_OK(zp_opt_step_cpu(NULL, 0, NULL, 0, 1));
}

/* ---- the bound and the block split ------------------------------------------------------ */

static void mark_range(void *ctx, int64_t begin, int64_t end) {
  unsigned char *hits = ctx;
  for (int64_t i = begin; i < end; i++)
    hits[i]++; /* each element belongs to one block: no two threads write one byte */
}

/* Every element is visited exactly once, whatever the thread count and block size. */
void test_parallel_blocks_coverage(void) {
  static const int64_t sizes[] = {0, 1, 63, 64, 1000, 65536 * 3 + 7};
  static const int64_t blocks[] = {1, 64, 1000, 65536};
  for (size_t a = 0; a < sizeof sizes / sizeof *sizes; a++)
    for (size_t b = 0; b < sizeof blocks / sizeof *blocks; b++)
      for (int32_t threads = 0; threads <= 5; threads++) {
        int64_t n = sizes[a];
        unsigned char *hits = calloc((size_t)n + 1, 1);
        if (!CHECK(hits != NULL))
          return;
        CHECK_OK(zp_parallel_blocks(n, threads, blocks[b], 1, mark_range, hits));
        int64_t bad = -1;
        for (int64_t i = 0; i < n && bad < 0; i++)
          if (hits[i] != 1)
            bad = i;
        CHECK_MSG(bad < 0, "n %lld, block %lld, %d threads: element %lld visited %d times",
                  (long long)n, (long long)blocks[b], threads, (long long)bad,
                  bad < 0 ? 1 : hits[bad]);
        free(hits);
      }
  CHECK_FAILS(zp_parallel_blocks(-1, 1, 64, 1, mark_range, NULL), ZP_ERR_INVALID);
}

/* The bound leaves read and update streams as they were (every bit pattern) and zeroes write
 * streams, on every ISA, at sizes around its 16-element blocks and the 64K thread blocks. */
void test_stream_bound(void) {
  static const char *isas[] = {"scalar", "avx2", "avx512"};
  static const int64_t sizes[] = {0, 1, 15, 16, 33, 70001};
  static const int32_t bytes[] = {4, 2, 4, 4, 2, 4, 2};
  static const int32_t access[] = {ZP_STREAM_READ,   ZP_STREAM_READ,   ZP_STREAM_UPDATE,
                                   ZP_STREAM_UPDATE, ZP_STREAM_UPDATE, ZP_STREAM_WRITE,
                                   ZP_STREAM_WRITE};
  enum { NS = 7 };
  zt_rng r = zt_rng_seed(77);
  for (size_t z = 0; z < sizeof sizes / sizeof *sizes; z++) {
    const int64_t n = sizes[z];
    zp_stream st[NS];
    unsigned char *want[NS];
    int ok = 1;
    for (int k = 0; k < NS; k++) {
      size_t len = (size_t)n * (size_t)bytes[k] + 1;
      st[k] = (zp_stream){malloc(len), bytes[k], access[k]};
      want[k] = malloc(len);
      ok = ok && st[k].data != NULL && want[k] != NULL;
      for (size_t i = 0; ok && i < len; i++)
        ((unsigned char *)st[k].data)[i] = (unsigned char)zt_next(&r);
      if (ok)
        memcpy(want[k], st[k].data, len);
      if (ok && access[k] == ZP_STREAM_WRITE) /* zeroed, the byte past the end kept */
        memset(want[k], 0, len - 1);
    }
    for (int isa = 0; ok && isa < 3; isa++) {
      setenv("ZP_CPU_ISA", isas[isa], 1);
      for (int32_t threads = 1; threads <= 3; threads++) {
        setenv("ZP_CPU_STREAM", threads == 2 ? "1" : "0", 1); /* streaming stores, or none */
        CHECK_OK(zp_stream_bound_cpu(st, NS, n, threads));
        for (int k = 0; k < NS; k++)
          CHECK_MSG(memcmp(st[k].data, want[k], (size_t)n * (size_t)bytes[k] + 1) == 0,
                    "n %lld, isa %s, %d threads: stream %d (access %d) is not as expected",
                    (long long)n, isas[isa], threads, k, access[k]);
      }
    }
    unsetenv("ZP_CPU_ISA");
    unsetenv("ZP_CPU_STREAM");
    CHECK(ok);
    for (int k = 0; k < NS; k++)
      free(st[k].data), free(want[k]);
  }
  float x[4] = {0};
  zp_stream bad = {x, 8, ZP_STREAM_READ};
  CHECK_FAILS(zp_stream_bound_cpu(&bad, 1, 4, 1), ZP_ERR_INVALID);
  bad = (zp_stream){x, 4, 0};
  CHECK_FAILS(zp_stream_bound_cpu(&bad, 1, 4, 1), ZP_ERR_INVALID);
  bad = (zp_stream){NULL, 4, ZP_STREAM_READ};
  CHECK_FAILS(zp_stream_bound_cpu(&bad, 1, 4, 1), ZP_ERR_INVALID);
  CHECK_FAILS(zp_stream_bound_cpu(&bad, 0, 4, 1), ZP_ERR_INVALID);
  CHECK_FAILS(zp_stream_bound_cpu(&bad, ZP_STREAM_MAX + 1, 4, 1), ZP_ERR_INVALID);
  bad = (zp_stream){x, 4, ZP_STREAM_UPDATE};
  CHECK_FAILS(zp_stream_bound_cpu(&bad, 1, -1, 1), ZP_ERR_INVALID);
}

/* ZP_CPU_ISA and ZP_CPU_PREFETCH are read at every call; bad values leave the default. */
void test_cpu_tuning_env(void) {
  unsetenv("ZP_CPU_ISA");
  unsetenv("ZP_CPU_PREFETCH");
  zp_cpu_tuning t = zp_cpu_tuning_pick();
  CHECK_EQ(t.prefetch_bytes, ZP_CPU_PREFETCH_DEFAULT);
  CHECK_EQ(t.stream_min_bytes, ZP_CPU_STREAM_DEFAULT);
  setenv("ZP_CPU_STREAM", "0", 1);
  CHECK_EQ(zp_cpu_tuning_pick().stream_min_bytes, 0);
  setenv("ZP_CPU_STREAM", "-5", 1);
  CHECK_EQ(zp_cpu_tuning_pick().stream_min_bytes, ZP_CPU_STREAM_DEFAULT);
  unsetenv("ZP_CPU_STREAM");
  CHECK(t.isa == zp_isa_pick());
  if (t.vendor == ZP_VENDOR_AMD)
    CHECK(t.isa <= ZP_ISA_AVX2);
  setenv("ZP_CPU_ISA", "scalar", 1);
  CHECK(zp_cpu_tuning_pick().isa == ZP_ISA_SCALAR);
  setenv("ZP_CPU_ISA", "avx2", 1);
  CHECK(zp_cpu_tuning_pick().isa <= ZP_ISA_AVX2);
  unsetenv("ZP_CPU_ISA");
  static const char *bad[] = {"-1", "x", "12ab", "99999999999999999999", "2097152", ":l1",
                              "64:l3"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    setenv("ZP_CPU_PREFETCH", bad[i], 1);
    CHECK_MSG(zp_cpu_tuning_pick().prefetch_bytes == ZP_CPU_PREFETCH_DEFAULT,
              "ZP_CPU_PREFETCH=%s was not ignored", bad[i]);
  }
  CHECK_EQ(zp_cpu_tuning_pick().prefetch_l1, 0);
  setenv("ZP_CPU_PREFETCH", "0", 1);
  CHECK_EQ(zp_cpu_tuning_pick().prefetch_bytes, 0);
  setenv("ZP_CPU_PREFETCH", "512:l1", 1);
  CHECK_EQ(zp_cpu_tuning_pick().prefetch_bytes, 512);
  CHECK_EQ(zp_cpu_tuning_pick().prefetch_l1, 1);
  unsetenv("ZP_CPU_PREFETCH");
}
