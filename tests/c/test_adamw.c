/* test_adamw.c - the fused CPU AdamW step (adamw.h) against a double-precision scalar reference.
 *
 * Tolerance: each step is checked on its own (the reference starts from the kernel's fp32 state
 * of the step before), and an output passes when |kernel - reference| <= RTOL * (sum of the
 * magnitudes of the terms that make it), RTOL = 1e-5: fp32 rounding is ~6e-8 per operation. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kernels/cpu/adamw.h"

#define RTOL 1e-5
#define N_STEPS 100
#define GUARD_VALUE 12345.0f

static const zp_adamw_group test_groups[] = {
    /* lr    beta1 beta2   eps   wd    grad_scale */
    {1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0},
    {3e-2, 0.8, 0.95, 1e-3, 0.0, 0.125},
    {5e-4, 0.0, 0.5, 0.0, 0.5, 2.0},
    {2e-3, 0.99, 0.9999, 1e-6, 1.0, 1.0},
    {0.0, 0.9, 0.999, 1e-8, 0.3, 1.0}, /* lr 0: param unchanged, moments still updated */
};
#define N_GROUPS ((int32_t)(sizeof test_groups / sizeof test_groups[0]))

/* Segments: sizes around vector widths, empty ones, and one large enough for several threads. */
typedef struct {
  int64_t numel, first_step, gap; /* gap: guard floats before the segment (alignment varies) */
  int32_t group;
} seg_spec;

static const seg_spec specs[] = {
    {300000, 1, 0, 0}, {0, 1, 3, 1},    {1, 1, 5, 2},     {7, 7, 16, 3},    {8, 1, 1, 0},
    {15, 2, 2, 1},     {16, 1000, 16, 2}, {17, 1, 3, 0},   {33, 50, 7, 1},   {0, 3, 0, 2},
    {1000, 1, 9, 3},   {4099, 10, 32, 1}, {65, 1, 13, 2},  {31, 1, 1, 0},   {40, 1, 2, 4},
    {3, 5, 1, 4},
};
#define N_SEGS ((int32_t)(sizeof specs / sizeof specs[0]))

typedef struct {
  int64_t total;                /* floats per array, guards included */
  float *p, *g, *m, *v;         /* kernel state */
  float *p0, *g0, *m0, *v0;     /* copies taken before a step */
  int64_t offset[N_SEGS];
  zp_adamw_segment segs[N_SEGS];
} state;

static float *alloc_floats(int64_t n) {
  /* 64-byte aligned base; segments start at varied offsets from it */
  size_t bytes = (size_t)((n * 4 + 63) / 64 * 64);
  return aligned_alloc(64, bytes ? bytes : 64);
}

static void state_free(state *s) {
  free(s->p), free(s->g), free(s->m), free(s->v);
  free(s->p0), free(s->g0), free(s->m0), free(s->v0);
}

/* A non-zero value of magnitude in [lo, hi) and random sign. */
static float nonzero(zt_rng *r, double lo, double hi) {
  double x = lo + (hi - lo) * zt_unit(r);
  return (float)(zt_next(r) & 1 ? x : -x);
}

static int state_init(state *s, zt_rng *r) {
  int64_t at = 0;
  for (int32_t k = 0; k < N_SEGS; k++) {
    at += specs[k].gap;
    s->offset[k] = at;
    at += specs[k].numel;
  }
  s->total = at + 5; /* a trailing guard */
  float **arrays[] = {&s->p, &s->g, &s->m, &s->v, &s->p0, &s->g0, &s->m0, &s->v0};
  for (int i = 0; i < 8; i++)
    if (!(*arrays[i] = alloc_floats(s->total)))
      return 0;
  for (int64_t i = 0; i < s->total; i++)
    s->p[i] = s->g[i] = s->m[i] = s->v[i] = GUARD_VALUE;
  for (int32_t k = 0; k < N_SEGS; k++) {
    const int64_t o = s->offset[k];
    for (int64_t i = 0; i < specs[k].numel; i++) {
      s->p[o + i] = nonzero(r, 0.01, 2.0);
      /* a segment that starts at a later step carries moments from earlier steps */
      s->m[o + i] = specs[k].first_step > 1 ? nonzero(r, 1e-4, 0.1) : 0.0f;
      s->v[o + i] = specs[k].first_step > 1 ? (float)(1e-6 + 0.01 * zt_unit(r)) : 0.0f;
    }
    s->segs[k] = (zp_adamw_segment){s->p + o, s->g + o, s->m + o, s->v + o, specs[k].numel,
                                    specs[k].first_step, specs[k].group};
  }
  return 1;
}

/* Fresh non-zero gradients of a per-segment scale, then a copy of the whole state. */
static void new_grads_and_snapshot(state *s, zt_rng *r) {
  static const double scales[] = {1.0, 1e-3, 1e3};
  for (int32_t k = 0; k < N_SEGS; k++) {
    const double scale = scales[k % 3];
    for (int64_t i = 0; i < specs[k].numel; i++)
      s->g[s->offset[k] + i] = nonzero(r, 1e-3 * scale, scale);
  }
  const size_t bytes = (size_t)s->total * sizeof(float);
  memcpy(s->p0, s->p, bytes);
  memcpy(s->g0, s->g, bytes);
  memcpy(s->m0, s->m, bytes);
  memcpy(s->v0, s->v, bytes);
}

static int close_enough(double got, double want, double scale) {
  return fabs(got - want) <= RTOL * scale + 1e-37;
}

/* Checks the step just taken against the reference; returns 1 if it matches. */
static int check_step(const state *s, int step_index) {
  /* grad untouched and guards untouched (for every array) */
  if (!CHECK_MSG(memcmp(s->g, s->g0, (size_t)s->total * sizeof(float)) == 0,
                 "step %d: the gradient was modified", step_index))
    return 0;
  int64_t at = 0;
  for (int32_t k = 0; k <= N_SEGS; k++) {
    const int64_t stop = k < N_SEGS ? s->offset[k] : s->total;
    for (int64_t i = at; i < stop; i++)
      if (!CHECK_MSG(s->p[i] == GUARD_VALUE && s->m[i] == GUARD_VALUE && s->v[i] == GUARD_VALUE,
                     "step %d: element %lld outside every segment was written", step_index,
                     (long long)i))
        return 0;
    if (k < N_SEGS)
      at = s->offset[k] + specs[k].numel;
  }

  for (int32_t k = 0; k < N_SEGS; k++) {
    const zp_adamw_group *hp = &test_groups[specs[k].group];
    const double step = (double)s->segs[k].step;
    const double bc1 = 1.0 - pow(hp->beta1, step), bc2 = 1.0 - pow(hp->beta2, step);
    for (int64_t i = 0; i < specs[k].numel; i++) {
      const int64_t e = s->offset[k] + i;
      const double g = (double)s->g0[e] * hp->grad_scale;
      const double p = (double)s->p0[e] * (1.0 - hp->lr * hp->weight_decay);
      const double m0 = s->m0[e], v0 = s->v0[e];
      const double m = m0 + (1.0 - hp->beta1) * (g - m0);
      const double v = v0 * hp->beta2 + (1.0 - hp->beta2) * g * g;
      const double denom = sqrt(v) / sqrt(bc2) + hp->eps;
      const double p_new = p - hp->lr / bc1 * m / denom;
      const double m_scale = fabs(m0) + fabs(g);
      const double p_scale = fabs(p) + hp->lr / bc1 * m_scale / denom;
      if (!CHECK_MSG(close_enough(s->m[e], m, m_scale) && close_enough(s->v[e], v, v) &&
                         close_enough(s->p[e], p_new, p_scale),
                     "step %d, segment %d (group %d, step %lld), element %lld: "
                     "p %.9g want %.9g, m %.9g want %.9g, v %.9g want %.9g "
                     "(from p %.9g g %.9g m %.9g v %.9g)",
                     step_index, k, specs[k].group, (long long)s->segs[k].step, (long long)i,
                     (double)s->p[e], p_new, (double)s->m[e], m, (double)s->v[e], v,
                     (double)s->p0[e], (double)s->g0[e], m0, v0))
        return 0;
    }
  }
  return 1;
}

void test_adamw_isa(void) {
  const char *isa = zp_adamw_isa();
  if (!CHECK(isa != NULL))
    return;
  CHECK_MSG(!strcmp(isa, "avx512") || !strcmp(isa, "avx2") || !strcmp(isa, "scalar"),
            "zp_adamw_isa() = \"%s\"", isa);
  printf("  isa: %s\n", isa);
}

void test_adamw_matches_reference(void) {
  static const int32_t thread_counts[] = {1, 2, 3, 0};
  zt_rng r = zt_rng_seed(4242);
  state s;
  memset(&s, 0, sizeof s);
  if (!CHECK(state_init(&s, &r))) {
    state_free(&s);
    return;
  }
  for (int t = 0; t < N_STEPS; t++) {
    for (int32_t k = 0; k < N_SEGS; k++)
      s.segs[k].step = specs[k].first_step + t;
    new_grads_and_snapshot(&s, &r);
    const int32_t n_threads = thread_counts[t % 4];
    if (!CHECK_OK(zp_adamw_step_cpu(s.segs, N_SEGS, test_groups, N_GROUPS, n_threads)))
      break;
    if (!check_step(&s, t)) {
      printf("  (n_threads %d)\n", n_threads);
      break;
    }
  }
  state_free(&s);
}

/* The same step on 1, 2 and 3 threads: each result matches the reference (and, reported for
 * information, whether they are bitwise identical). */
void test_adamw_threads_agree(void) {
  zt_rng r = zt_rng_seed(5151);
  state s;
  memset(&s, 0, sizeof s);
  float *first = NULL;
  if (!CHECK(state_init(&s, &r)) || !CHECK((first = malloc((size_t)s.total * sizeof(float))))) {
    state_free(&s);
    return;
  }
  new_grads_and_snapshot(&s, &r);
  int identical = 1;
  for (int32_t n_threads = 1; n_threads <= 3; n_threads++) {
    /* restore the state the step starts from */
    memcpy(s.p, s.p0, (size_t)s.total * sizeof(float));
    memcpy(s.m, s.m0, (size_t)s.total * sizeof(float));
    memcpy(s.v, s.v0, (size_t)s.total * sizeof(float));
    if (!CHECK_OK(zp_adamw_step_cpu(s.segs, N_SEGS, test_groups, N_GROUPS, n_threads)))
      break;
    if (!check_step(&s, 0)) {
      printf("  (n_threads %d)\n", n_threads);
      break;
    }
    if (n_threads == 1)
      memcpy(first, s.p, (size_t)s.total * sizeof(float));
    else
      identical &= memcmp(first, s.p, (size_t)s.total * sizeof(float)) == 0;
  }
  printf("  results on 1, 2, 3 threads bitwise identical: %s\n", identical ? "yes" : "no");
  free(first);
  state_free(&s);
}

/* ---- errors, each on a fresh thread so the message is proven to come from that call ------ */

typedef struct {
  const char *what;
  zp_adamw_group group;
  int64_t numel, step;
  int32_t seg_group, n_groups;
  int range_ok; /* the status may be ZP_ERR_RANGE as well as ZP_ERR_INVALID */
} error_case;

static void run_error_case(void *arg) {
  const error_case *c = arg;
  float p[4] = {1, 2, 3, 4}, g[4] = {1, 1, 1, 1}, m[4] = {0}, v[4] = {0};
  const zp_adamw_segment seg = {p, g, m, v, c->numel, c->step, c->seg_group};
  zp_status st = zp_adamw_step_cpu(&seg, 1, &c->group, c->n_groups, 1);
  CHECK_MSG((st == ZP_ERR_INVALID || (c->range_ok && st == ZP_ERR_RANGE)) &&
                zp_last_error()[0] != '\0',
            "%s: status %d (expected ZP_ERR_INVALID%s), message \"%s\"", c->what, (int)st,
            c->range_ok ? " or ZP_ERR_RANGE" : "", zp_last_error());
  if (st != ZP_OK && (p[0] != 1 || m[0] != 0 || v[0] != 0))
    printf("  note: %s: the failing call modified the state (adamw.h does not say it may not)\n",
           c->what);
}

void test_adamw_errors(void) {
  const zp_adamw_group ok = {1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0};
  const error_case cases[] = {
      {"lr -1e-3", {-1e-3, ok.beta1, ok.beta2, ok.eps, ok.weight_decay, 1.0}, 4, 1, 0, 1, 0},
      {"lr NaN", {NAN, ok.beta1, ok.beta2, ok.eps, ok.weight_decay, 1.0}, 4, 1, 0, 1, 0},
      {"beta1 1.0", {ok.lr, 1.0, ok.beta2, ok.eps, ok.weight_decay, 1.0}, 4, 1, 0, 1, 0},
      {"beta1 -0.1", {ok.lr, -0.1, ok.beta2, ok.eps, ok.weight_decay, 1.0}, 4, 1, 0, 1, 0},
      {"beta2 1.0", {ok.lr, ok.beta1, 1.0, ok.eps, ok.weight_decay, 1.0}, 4, 1, 0, 1, 0},
      {"beta2 1.5", {ok.lr, ok.beta1, 1.5, ok.eps, ok.weight_decay, 1.0}, 4, 1, 0, 1, 0},
      {"eps -1e-8", {ok.lr, ok.beta1, ok.beta2, -1e-8, ok.weight_decay, 1.0}, 4, 1, 0, 1, 0},
      {"weight_decay -0.1", {ok.lr, ok.beta1, ok.beta2, ok.eps, -0.1, 1.0}, 4, 1, 0, 1, 0},
      {"segment numel -1", ok, -1, 1, 0, 1, 1},
      {"segment step 0", ok, 4, 0, 0, 1, 1},
      {"segment group 1 of 1", ok, 4, 1, 1, 1, 1},
      {"segment group -1", ok, 4, 1, -1, 1, 1},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    zt_run_fresh(run_error_case, (void *)&cases[i]);
}
