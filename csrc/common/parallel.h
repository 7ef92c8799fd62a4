/* parallel.h - split [0, n) across threads: the caller's thread plus pthreads it waits for. */
#ifndef ZP_PARALLEL_H
#define ZP_PARALLEL_H

#include <stdint.h>

#include "common/status.h"

/* fn(ctx, begin, end) runs on disjoint ranges covering [0, n); range starts are multiples of
 * `grain` (elements) so that threads do not share cache lines. Runs on one thread when n is
 * below `min_per_thread` per extra thread. */
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
