/* test_limits.c - the core's "never abort" rule at the edges of its size arithmetic.
 *
 * Extreme sizes (2**62 bytes of alignment, INT64_MAX elements, 2**31-1 ranks or buckets, byte
 * counts that add up past 2**63) given to the planner, the two schedules, the optimizer
 * tables, parallel_for and the shared flags: each call returns an error status whose message
 * names the argument, or, where the value is allowed, a correct answer. Under ASan and UBSan
 * (make ctest) an overflow or a division by zero fails the run, so these also prove that the
 * arithmetic behind each answer stayed in range. The first cases were crashes: alignment
 * 2**62 with world_size 4 was a SIGFPE in zp_layout_plan (the padded piece size wrapped to 0). */
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "common/parallel.h"
#include "common/shared_flags.h"
#include "kernels/contract.h"
#include "kernels/cpu/optim.h"
#include "layout/layout.h"
#include "schedule/prefetch.h"
#include "schedule/schedule.h"

#define P62 ((int64_t)1 << 62)
#define P56 ((int64_t)1 << 56)

/* `got` is `want` and the message it left names `needle`. The message is cleared first, so it
 * is this call's. */
#define FAILS_NAMING(expr, want, needle)                                                     \
  do {                                                                                      \
    zp_fail(ZP_OK, "%s", "");                                                              \
    zp_status got_ = (expr);                                                                \
    CHECK_MSG(got_ == (want) && strstr(zp_last_error(), (needle)) != NULL,                  \
              "%s: status %d (want %d), message \"%s\" (want it to name \"%s\")", #expr,   \
              (int)got_, (int)(want), zp_last_error(), (needle));                            \
  } while (0)

/* ---- the planner ---------------------------------------------------------------------- */

static zp_status plan1(zp_param_desc p, int32_t world_size, int64_t align, int64_t bucket,
                       zp_layout **out) {
  return zp_layout_plan(&p, 1, world_size, align, bucket, out);
}

void test_limits_layout(void) {
  const zp_param_desc one = {1, 0, 0, 1}, f32 = {50, 0, 0, 4};
  zp_layout *l = NULL;

  /* alignment: the reported SIGFPE, and every other value outside [1, 2**30] */
  FAILS_NAMING(plan1(one, 4, P62, 1 << 20, &l), ZP_ERR_INVALID, "align_bytes");
  FAILS_NAMING(plan1(one, 2, P62, 1 << 20, &l), ZP_ERR_INVALID, "align_bytes");
  FAILS_NAMING(plan1(one, 1, P62, 1 << 20, &l), ZP_ERR_INVALID, "align_bytes");
  FAILS_NAMING(plan1(one, 1, (int64_t)1 << 31, 1 << 20, &l), ZP_ERR_INVALID, "2**30");
  FAILS_NAMING(plan1(one, 1, INT64_MAX, 1 << 20, &l), ZP_ERR_INVALID, "align_bytes");
  FAILS_NAMING(plan1(one, 1, INT64_MIN, 1 << 20, &l), ZP_ERR_INVALID, "align_bytes");
  FAILS_NAMING(plan1(one, 1, 0, 1 << 20, &l), ZP_ERR_INVALID, "power of two");
  FAILS_NAMING(plan1(one, 1, 3, 1 << 20, &l), ZP_ERR_INVALID, "power of two");
  CHECK(l == NULL);

  /* world size and bucket size outside their ranges */
  FAILS_NAMING(plan1(one, INT32_MIN, 64, 1 << 20, &l), ZP_ERR_INVALID, "world_size");
  FAILS_NAMING(plan1(one, 0, 64, 1 << 20, &l), ZP_ERR_INVALID, "world_size");
  FAILS_NAMING(plan1(one, 1, 64, INT64_MIN, &l), ZP_ERR_INVALID, "bucket_bytes");
  FAILS_NAMING(plan1(one, 1, 64, 0, &l), ZP_ERR_INVALID, "bucket_bytes");

  /* parameters past the byte limit, alone or together */
  FAILS_NAMING(plan1((zp_param_desc){INT64_MAX, 0, 0, 1}, 1, 64, 1 << 20, &l), ZP_ERR_INVALID,
               "parameter 0");
  FAILS_NAMING(plan1((zp_param_desc){P62, 0, 0, 4}, 1, 64, 1 << 20, &l), ZP_ERR_INVALID,
               "2**56");
  FAILS_NAMING(plan1((zp_param_desc){P56 / 4 + 1, 0, 0, 4}, 1, 64, 1 << 20, &l),
               ZP_ERR_INVALID, "2**56");
  FAILS_NAMING(plan1((zp_param_desc){INT64_MIN, 0, 0, 4}, 1, 64, 1 << 20, &l), ZP_ERR_INVALID,
               "parameter 0");
  zp_param_desc many[64];
  for (int32_t i = 0; i < 64; i++)
    many[i] = (zp_param_desc){(int64_t)1 << 51, i % 3, 0, 8}; /* 2**54 bytes each */
  FAILS_NAMING(zp_layout_plan(many, 64, 1, 64, INT64_MAX, &l), ZP_ERR_INVALID, "2**56");

  /* the crash inputs the fuzzer found in the planner before the fix (tests/fuzz/regressions/
   * layout/): 27-29 one-byte parameters, alignment 2**61 or 2**62 */
  zp_param_desc bytes29[29];
  for (int32_t i = 0; i < 29; i++)
    bytes29[i] = one;
  FAILS_NAMING(zp_layout_plan(bytes29, 29, 14, (int64_t)1 << 61, P56 / 4, &l), ZP_ERR_INVALID,
               "align_bytes");
  FAILS_NAMING(zp_layout_plan(bytes29, 27, 4096, P62, 3200, &l), ZP_ERR_INVALID, "align_bytes");
  FAILS_NAMING(zp_layout_plan(bytes29, 29, INT32_MAX, P62, P62, &l), ZP_ERR_INVALID,
               "align_bytes");

  /* each parameter fits, but padding to world_size * align pieces does not */
  FAILS_NAMING(plan1(one, INT32_MAX, (int64_t)1 << 30, 1 << 20, &l), ZP_ERR_INVALID,
               "world_size");
  FAILS_NAMING(plan1(one, 1 << 27, (int64_t)1 << 30, 1 << 20, &l), ZP_ERR_INVALID, "2**56");
  for (int32_t i = 0; i < 64; i++)
    many[i] = (zp_param_desc){1, 0, 0, 8};
  FAILS_NAMING(zp_layout_plan(many, 64, 1 << 24, (int64_t)1 << 30, 1, &l), ZP_ERR_INVALID,
               "2**56"); /* 64 buckets of 2**54 bytes */

  /* descriptors outside their fields' ranges */
  FAILS_NAMING(plan1((zp_param_desc){1, 0, 0, INT32_MAX}, 1, 64, 1, &l), ZP_ERR_INVALID,
               "element size");
  FAILS_NAMING(plan1((zp_param_desc){1, 0, 0, INT32_MIN}, 1, 64, 1, &l), ZP_ERR_INVALID,
               "element size");
  FAILS_NAMING(plan1((zp_param_desc){1, INT32_MIN, 0, 4}, 1, 64, 1, &l), ZP_ERR_INVALID,
               "group");
  FAILS_NAMING(plan1((zp_param_desc){1, 0, INT32_MAX, 4}, 1, 64, 1, &l), ZP_ERR_INVALID,
               "buffer");
  FAILS_NAMING(zp_layout_plan(&f32, INT32_MIN, 1, 64, 1, &l), ZP_ERR_INVALID, "n_params");
  FAILS_NAMING(zp_layout_plan(NULL, 1, 1, 64, 1, &l), ZP_ERR_INVALID, "n_params");
  CHECK(l == NULL);

  /* the edges that are allowed plan correctly */
  if (CHECK_OK(plan1(one, 1, (int64_t)1 << 30, INT64_MAX, &l))) {
    CHECK_EQ(l->bucket_numel[0], (int64_t)1 << 30);
    CHECK_EQ(l->padding_numel, ((int64_t)1 << 30) - 1);
  }
  zp_layout_free(l);
  if (CHECK_OK(plan1((zp_param_desc){P56, 0, 0, 1}, 1, 1, 1, &l)))
    CHECK_EQ(l->shard_numel, P56);
  zp_layout_free(l);
  if (CHECK_OK(plan1(one, INT32_MAX, 1, 1, &l))) {
    CHECK_EQ(l->bucket_numel[0], INT32_MAX);
    CHECK_EQ(l->bucket_shard_numel[0], 1);
  }
  zp_layout_free(l);
  if (CHECK_OK(plan1(f32, 1 << 20, 1 << 10, 1, &l))) /* pieces of 256 elements, 2**20 ranks */
    CHECK_EQ(l->buffer_numel[0], (int64_t)1 << 28);
  zp_layout_free(l);
}

/* ---- the schedules -------------------------------------------------------------------- */

void test_limits_schedules(void) {
  const int32_t map[2] = {0, 0};
  zp_schedule *s = NULL;
  /* n_buckets sizes the schedule's arrays: refused before anything is allocated (the
   * fuzzer's find, tests/fuzz/regressions/schedule/: 8 GiB asked for 2 parameters) */
  FAILS_NAMING(zp_schedule_create(map, 2, INT32_MAX, &s), ZP_ERR_INVALID, "n_buckets");
  FAILS_NAMING(zp_schedule_create(map, 2, INT32_MIN, &s), ZP_ERR_INVALID, "bucket");
  FAILS_NAMING(zp_schedule_create(map, INT32_MIN, 1, &s), ZP_ERR_INVALID, "parameter");
  CHECK(s == NULL);

  const int64_t huge[2] = {INT64_MAX, INT64_MAX};
  const int64_t negative[2] = {1, INT64_MIN};
  zp_prefetch *pf = NULL;
  FAILS_NAMING(zp_prefetch_create(2, huge, NULL, 0, &pf), ZP_ERR_INVALID, "2**63-1");
  FAILS_NAMING(zp_prefetch_create(2, negative, NULL, 0, &pf), ZP_ERR_INVALID, "unit 1");
  FAILS_NAMING(zp_prefetch_create(1, huge, NULL, INT64_MIN, &pf), ZP_ERR_INVALID,
               "budget_bytes");
  /* the unit count bounds the command buffer (2 * n + 2): refused before the sizes are read */
  FAILS_NAMING(zp_prefetch_create(INT32_MAX, huge, NULL, 0, &pf), ZP_ERR_INVALID, "units");
  FAILS_NAMING(zp_prefetch_create(INT32_MIN, huge, NULL, 0, &pf), ZP_ERR_INVALID, "unit");
  CHECK(pf == NULL);

  /* units whose bytes add up to exactly INT64_MAX, with the largest budget: live and peak
   * reach INT64_MAX without overflowing */
  const int64_t edge[2] = {INT64_MAX - 1, 1};
  if (!CHECK_OK(zp_prefetch_create(2, edge, NULL, INT64_MAX, &pf)))
    return;
  zp_pf_cmd cmds[6];
  int32_t n_out = 0;
  CHECK_OK(zp_prefetch_begin(pf, ZP_PF_FORWARD));
  CHECK_OK(zp_prefetch_need(pf, 0, cmds, 6, &n_out));
  CHECK_EQ(n_out, 2); /* unit 0 needed, unit 1 prefetched */
  CHECK_EQ(zp_prefetch_live_bytes(pf), INT64_MAX);
  CHECK_OK(zp_prefetch_done(pf, 0, cmds, 6, &n_out));
  CHECK_OK(zp_prefetch_end(pf, cmds, 6, &n_out));
  CHECK_EQ(zp_prefetch_live_bytes(pf), 0);
  CHECK_EQ(zp_prefetch_peak_bytes(pf), INT64_MAX);
  zp_prefetch_destroy(pf);
}

/* ---- the optimizer tables ------------------------------------------------------------- */

void test_limits_kernel_tables(void) {
  float master[4] = {0}, grad[4] = {0}, exp_avg[4] = {0}, exp_avg_sq[4] = {0};
  const zp_opt_group adamw = {ZP_OPT_ADAMW, ZP_F32, ZP_F32, 0, 1e-3, 0.9, 0.999, 1e-8, 0.0,
                              1.0, 0};
  /* memory that is never read: the checks fail first */
  zp_opt_segment seg = {master, grad, exp_avg, exp_avg_sq, NULL, NULL, INT64_MAX, 1, 0};
  FAILS_NAMING(zp_opt_check(&seg, 1, &adamw, 1), ZP_ERR_INVALID, "2**56");
  FAILS_NAMING(zp_opt_step_cpu(&seg, 1, &adamw, 1, 4), ZP_ERR_INVALID, "segment 0");
  FAILS_NAMING(zp_grad_stats_check(&seg, 1, ZP_F32, 2.0), ZP_ERR_INVALID, "2**56");
  double sum = 0.0;
  int32_t nonfinite = 0;
  FAILS_NAMING(zp_grad_stats_cpu(&seg, 1, ZP_F32, 2.0, 4, &sum, &nonfinite), ZP_ERR_INVALID,
               "2**56");
  /* each segment alone is allowed; together they pass the limit (the kernels' prefix sums
   * would overflow at three of them) */
  zp_opt_segment segs[3] = {seg, seg, seg};
  for (int i = 0; i < 3; i++)
    segs[i].numel = P62;
  FAILS_NAMING(zp_opt_step_cpu(segs, 3, &adamw, 1, 1), ZP_ERR_INVALID, "together");
  FAILS_NAMING(zp_grad_stats_cpu(segs, 3, ZP_F32, 1.0, 1, &sum, &nonfinite), ZP_ERR_INVALID,
               "together");
  for (int i = 0; i < 3; i++)
    segs[i].numel = P56 / 2;
  FAILS_NAMING(zp_opt_check(segs, 3, &adamw, 1), ZP_ERR_INVALID, "segment 2");
  seg.numel = INT64_MIN;
  FAILS_NAMING(zp_opt_check(&seg, 1, &adamw, 1), ZP_ERR_INVALID, "numel");
  FAILS_NAMING(zp_grad_stats_check(&seg, 1, ZP_F32, 2.0), ZP_ERR_INVALID, "numel");
  seg.numel = 4;
  seg.step = INT64_MIN;
  FAILS_NAMING(zp_opt_check(&seg, 1, &adamw, 1), ZP_ERR_INVALID, "step");
  seg.step = INT64_MAX; /* allowed: bias corrections of a step that large are 1 */
  CHECK_OK(zp_opt_step_cpu(&seg, 1, &adamw, 1, 1));
}

/* ---- parallel_for and the shared flags ------------------------------------------------ */

typedef struct {
  int64_t covered; /* elements of every range, added atomically */
  int32_t calls;
} coverage;

static void count_range(void *ctx, int64_t begin, int64_t end) {
  coverage *c = ctx;
  __atomic_fetch_add(&c->covered, end - begin, __ATOMIC_RELAXED);
  __atomic_fetch_add(&c->calls, 1, __ATOMIC_RELAXED);
}

void test_limits_parallel_and_flags(void) {
  /* ranges over [0, INT64_MAX): no sum passes n, whatever the grain */
  const int64_t grains[] = {1, 64, INT64_MAX / 3, INT64_MAX - 1, INT64_MAX};
  const int64_t ns[] = {INT64_MAX, INT64_MAX - 1, P62 + 1};
  for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
    for (size_t g = 0; g < sizeof grains / sizeof grains[0]; g++) {
      coverage c = {0, 0};
      CHECK_OK(zp_parallel_for(ns[i], 7, grains[g], 1, count_range, &c));
      CHECK_MSG(c.covered == ns[i] && c.calls >= 1 && c.calls <= 7,
                "parallel_for(n=%lld, grain=%lld): %d ranges covering %lld", (long long)ns[i],
                (long long)grains[g], c.calls, (long long)c.covered);
    }
  }
  /* the same for the shared block queue: its counter must not pass INT64_MAX either */
  for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
    for (size_t g = 2; g < sizeof grains / sizeof grains[0]; g++) {
      coverage c = {0, 0};
      CHECK_OK(zp_parallel_blocks(ns[i], 7, grains[g], 1, count_range, &c));
      CHECK_MSG(c.covered == ns[i] && c.calls >= 1 && c.calls <= 4,
                "parallel_blocks(n=%lld, block=%lld): %d ranges covering %lld", (long long)ns[i],
                (long long)grains[g], c.calls, (long long)c.covered);
    }
  }
  coverage c = {0, 0};
  CHECK_OK(zp_parallel_blocks(5, INT32_MAX, INT64_MIN, INT64_MIN, count_range, &c));
  CHECK_EQ(c.covered, 5);
  c = (coverage){0, 0};
  CHECK_OK(zp_parallel_for(3, INT32_MAX, INT64_MIN, INT64_MIN, count_range, &c));
  CHECK_EQ(c.covered, 3);
  FAILS_NAMING(zp_parallel_for(INT64_MIN, 2, 1, 1, count_range, &c), ZP_ERR_INVALID, "n must");

  /* the last flag's address would overflow: refused before any load */
  int64_t flags[2] = {0, 0};
  FAILS_NAMING(zp_flags_wait_ge(flags, 3, INT64_MAX, 0, 1.0, NULL), ZP_ERR_INVALID, "stride");
  FAILS_NAMING(zp_flags_wait_ge(flags, INT32_MAX, (int64_t)1 << 40, 0, 1.0, NULL),
               ZP_ERR_INVALID, "stride");
  FAILS_NAMING(zp_flags_wait_ge(flags, INT32_MIN, 1, 0, 1.0, NULL), ZP_ERR_INVALID, "n >= 0");
  FAILS_NAMING(zp_flags_wait_ge(flags, 1, INT64_MIN, 0, 1.0, NULL), ZP_ERR_INVALID, "stride");
  CHECK_OK(zp_flags_wait_ge(flags, 1, INT64_MAX, 0, 1.0, NULL)); /* one flag: stride unused */
}
