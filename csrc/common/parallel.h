/* parallel.h - split [0, n) across threads: the caller's thread plus a persistent pool's.
 *
 * The pool is process-wide, started on first use and grown to the largest thread count asked
 * (256 at most). A call returns once every range has run. Calls from several threads at once
 * are safe: one job at a time runs on the pool, and a caller that finds it busy runs its job on
 * threads it starts for the call instead of waiting. A call made from inside a range function
 * runs its ranges inline, in order, on the calling thread. After fork() the child starts a new
 * pool on first use.
 *
 * Environment (read when the pool starts: first use in a process, or in a fork()ed child):
 *   ZP_POOL_SPIN_US  microseconds a pool thread spins (pausing, yielding its CPU every few
 *                    microseconds) for the next job, and a caller for its job's last ranges,
 *                    before sleeping on a condition variable; default 500, 0 sleeps at once,
 *                    at most 1000000. Calls closer together than this find the threads awake;
 *                    a larger value burns more idle CPU after each call.
 *   ZP_NUM_THREADS   see zp_default_threads. */
#ifndef ZP_PARALLEL_H
#define ZP_PARALLEL_H

#include <stdint.h>

#include "common/status.h"

/* fn(ctx, begin, end) runs on disjoint ranges covering [0, n); range starts are multiples of
 * `grain` (elements) so that threads do not share cache lines. Runs on one thread when n is
 * below `min_per_thread` per extra thread. The ranges depend only on the arguments (one per
 * thread: ceil(n / threads) rounded up to the grain), never on timing, so a reduction over
 * them is deterministic; only which thread runs which range varies. */
typedef void (*zp_range_fn)(void *ctx, int64_t begin, int64_t end);
zp_status zp_parallel_for(int64_t n, int32_t n_threads, int64_t grain, int64_t min_per_thread,
                          zp_range_fn fn, void *ctx);

/* As zp_parallel_for, but the threads take blocks of `block` elements (a multiple of `grain`
 * inside [0, n)) in turn from a shared counter until none is left, so a thread slowed down by
 * another process on its CPU (or by a sibling on its core) does less of the work instead of
 * holding up the call. For work whose result does not depend on which thread runs which
 * range. */
zp_status zp_parallel_blocks(int64_t n, int32_t n_threads, int64_t block, int64_t min_per_thread,
                             zp_range_fn fn, void *ctx);

/* Threads to use when the caller does not say: ZP_NUM_THREADS if set, else the CPUs this
 * process may run on. */
int32_t zp_default_threads(void);

#endif /* ZP_PARALLEL_H */
