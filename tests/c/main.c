/* main.c - runs every C unit test and ends with one line "N passed, N failed". */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "check.h"

/* Every test function of every file, in the order they run. */
#define ZT_ALL_TESTS(X)            \
  X(test_layout_invariants_random) \
  X(test_layout_small_cases)       \
  X(test_layout_deterministic)     \
  X(test_layout_empty)             \
  X(test_layout_errors)            \
  X(test_schedule_random_orders)   \
  X(test_schedule_flush_and_reset) \
  X(test_schedule_errors)          \
  X(test_prefetch_exact_commands)  \
  X(test_prefetch_keep_last_unit)  \
  X(test_prefetch_order_and_seen)  \
  X(test_prefetch_random_two_ranks) \
  X(test_prefetch_errors)          \
  X(test_prefetch_errors_leave_no_trace) \
  X(test_parallel_for_coverage)    \
  X(test_parallel_for_small_n)     \
  X(test_parallel_for_same_ranges) \
  X(test_parallel_for_concurrent_callers) \
  X(test_parallel_for_nested)      \
  X(test_parallel_for_fork)        \
  X(test_convert_isa)                 \
  X(test_convert_f16_widen_exhaustive) \
  X(test_convert_narrow_rne)          \
  X(test_convert_nan)                 \
  X(test_convert_stochastic_rounding) \
  X(test_grad_stats_matches_reference) \
  X(test_grad_stats_nonfinite)        \
  X(test_grad_stats_empty_and_errors) \
  X(test_grad_stats_fixed_order)      \
  X(test_optim_matches_reference)     \
  X(test_optim_isas_and_threads_agree) \
  X(test_optim_errors)               \
  X(test_parallel_blocks_coverage)   \
  X(test_stream_bound)               \
  X(test_cpu_tuning_env)             \
  X(test_shared_flags_publish_then_wait) \
  X(test_shared_flags_timeout_and_errors) \
  X(test_limits_layout)              \
  X(test_limits_schedules)           \
  X(test_limits_kernel_tables)       \
  X(test_limits_parallel_and_flags)  \
  X(test_checksum_known_values)      \
  X(test_checksum_paths_agree)       \
  X(test_checksum_three_chains)      \
  X(test_io_engine_round_trip)       \
  X(test_io_engine_errors)           \
  X(test_copy_spans_matches_memcpy)  \
  X(test_copy_spans_errors)

#define ZT_DECLARE(name) void name(void);
ZT_ALL_TESTS(ZT_DECLARE)
#undef ZT_DECLARE

typedef struct {
  const char *name;
  void (*fn)(void);
} zt_test;

#define ZT_ENTRY(name) {#name, name},
static const zt_test zt_tests[] = {ZT_ALL_TESTS(ZT_ENTRY)};
#undef ZT_ENTRY

#define ZT_MAX_PRINTED 10

int zt_failures = 0;

int zt_check(int ok, const char *file, int line, const char *fmt, ...) {
  if (ok)
    return 1;
  if (++zt_failures <= ZT_MAX_PRINTED) {
    va_list args;
    va_start(args, fmt);
    fprintf(stdout, "  FAIL %s:%d: ", file, line);
    vfprintf(stdout, fmt, args);
    fprintf(stdout, "\n");
    va_end(args);
  } else if (zt_failures == ZT_MAX_PRINTED + 1) {
    fprintf(stdout, "  (further failures of this test not printed)\n");
  }
  return 0;
}

int zt_check_status(zp_status got, zp_status want, const char *file, int line, const char *expr) {
  if (want == ZP_OK)
    return zt_check(got == ZP_OK, file, line, "%s returned %d (%s)", expr, (int)got,
                    zp_last_error());
  if (!zt_check(got == want, file, line, "%s returned %d, expected %d (message: \"%s\")", expr,
                (int)got, (int)want, got == ZP_OK ? "" : zp_last_error()))
    return 0;
  return zt_check(zp_last_error()[0] != '\0', file, line, "%s failed without a message", expr);
}

typedef struct {
  void (*fn)(void *);
  void *arg;
} zt_fresh_call;

static void *zt_fresh_main(void *p) {
  zt_fresh_call *call = p;
  zt_check(zp_last_error()[0] == '\0', __FILE__, __LINE__,
           "zp_last_error() is not empty on a new thread");
  call->fn(call->arg);
  return NULL;
}

void zt_run_fresh(void (*fn)(void *), void *arg) {
  zt_fresh_call call = {fn, arg};
  pthread_t thread;
  if (!zt_check(pthread_create(&thread, NULL, zt_fresh_main, &call) == 0, __FILE__, __LINE__,
                "pthread_create failed"))
    return;
  pthread_join(thread, NULL);
}

int main(void) {
  int passed = 0, failed = 0;
  for (size_t i = 0; i < sizeof zt_tests / sizeof zt_tests[0]; i++) {
    zt_failures = 0;
    printf("%s\n", zt_tests[i].name);
    fflush(stdout);
    zt_tests[i].fn();
    if (zt_failures == 0) {
      passed++;
    } else {
      failed++;
      printf("  -> FAILED (%d checks)\n", zt_failures);
    }
    fflush(stdout);
  }
  printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
