/* shared_flags.c - release stores and bounded acquire waits on int64 flags in shared memory. */
#define _POSIX_C_SOURCE 200809L
#include "common/shared_flags.h"

#include <sched.h>
#include <time.h>

void zp_flag_publish(int64_t *flag, int64_t value) {
  __atomic_store_n(flag, value, __ATOMIC_RELEASE);
}

static double zp_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

zp_status zp_flags_wait_ge(const int64_t *flags, int32_t n, int64_t stride, int64_t value,
                           double timeout_s, int32_t *late) {
  if (late != NULL)
    *late = -1;
  if (flags == NULL || n < 0 || stride < 1)
    return zp_fail(ZP_ERR_INVALID, "flags_wait: flags must be non-NULL, n >= 0, stride >= 1 "
                                    "(got n=%d, stride=%lld)", (int)n, (long long)stride);
  /* the last flag's address, flags + (n - 1) * stride, must not overflow */
  if (n > 1 && stride > INT64_MAX / (int64_t)sizeof *flags / (n - 1))
    return zp_fail(ZP_ERR_INVALID, "flags_wait: %d flags %lld elements apart span more than "
                   "2**63 bytes; lower n or stride", (int)n, (long long)stride);
  if (!(timeout_s > 0))
    return zp_fail(ZP_ERR_INVALID, "flags_wait: timeout must be > 0 s, got %g", timeout_s);
  double deadline = zp_now_s() + timeout_s;
  long pause_ns = 1000;
  int32_t i = 0;
  for (int64_t spins = 0;; spins++) {
    while (i < n && __atomic_load_n(flags + (int64_t)i * stride, __ATOMIC_ACQUIRE) >= value)
      i++;
    if (i == n)
      return ZP_OK;
    if (spins < 64) {
      sched_yield(); /* the peer is likely one time slice away (more ranks than cores) */
      continue;
    }
    if (zp_now_s() > deadline) {
      if (late != NULL)
        *late = i;
      return zp_fail(ZP_ERR_STATE,
                     "rank %d did not publish step %lld within %g s (it died, or the ranks "
                     "call collectives in different orders)", (int)i, (long long)value, timeout_s);
    }
    struct timespec ts = {0, pause_ns};
    nanosleep(&ts, NULL);
    if (pause_ns < 1000000)
      pause_ns *= 2;
  }
}
