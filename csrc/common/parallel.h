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

/* Threads to use when the caller does not say: ZP_NUM_THREADS if set, else the CPUs this
 * process may run on. */
int32_t zp_default_threads(void);

#endif /* ZP_PARALLEL_H */
