/* parallel.c - zp_parallel_for: a fork-join over [0, n) with pthreads, joined before returning.
 *
 * Threads are created per call: the kernels that use this move megabytes per call, so the
 * ~20 us of thread start-up is noise beside them, and no pool outlives a call (nothing to
 * clean up at exit, safe across fork()). */
#define _GNU_SOURCE
#include "common/parallel.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common/checked.h"

#define ZP_MAX_THREADS 256

typedef struct {
  zp_range_fn fn;
  void *ctx;
  int64_t begin, end;
} zp_range_task;

static void *zp_range_thread(void *arg) {
  zp_range_task *task = arg;
  task->fn(task->ctx, task->begin, task->end);
  return NULL;
}

int32_t zp_default_threads(void) {
  const char *env = getenv("ZP_NUM_THREADS");
  if (env != NULL && env[0] != '\0') {
    long v = strtol(env, NULL, 10);
    if (v >= 1 && v <= ZP_MAX_THREADS)
      return (int32_t)v;
  }
#ifdef CPU_COUNT
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n >= 1)
      return n > ZP_MAX_THREADS ? ZP_MAX_THREADS : n;
  }
#endif
  return 1;
}

zp_status zp_parallel_for(int64_t n, int32_t n_threads, int64_t grain, int64_t min_per_thread,
                          zp_range_fn fn, void *ctx) {
  if (n < 0)
    return zp_fail(ZP_ERR_INVALID, "parallel_for: n must be >= 0, got %lld", (long long)n);
  if (grain < 1)
    grain = 1;
  if (n_threads <= 0)
    n_threads = zp_default_threads();
  if (n_threads > ZP_MAX_THREADS)
    n_threads = ZP_MAX_THREADS;
  if (min_per_thread < 1)
    min_per_thread = 1;
  int64_t useful = n / min_per_thread;
  if (useful < n_threads)
    n_threads = useful < 1 ? 1 : (int32_t)useful;
  if (n == 0)
    return ZP_OK;
  if (n_threads == 1) {
    fn(ctx, 0, n);
    return ZP_OK;
  }

  zp_range_task tasks[ZP_MAX_THREADS];
  pthread_t threads[ZP_MAX_THREADS];
  /* Written so that no sum passes n, whatever n (up to 2**63-1) and grain: a range of at
   * least n / n_threads elements, rounded up to the grain (one range when that overflows),
   * so at most n_threads ranges. */
  int64_t per = n / n_threads + (n % n_threads != 0);
  if (!zp_round_up_i64(per, grain, &per) || per > n)
    per = n;
  int32_t n_tasks = 0;
  for (int64_t begin = 0; begin < n; begin = tasks[n_tasks - 1].end) {
    tasks[n_tasks].fn = fn;
    tasks[n_tasks].ctx = ctx;
    tasks[n_tasks].begin = begin;
    tasks[n_tasks].end = per < n - begin ? begin + per : n;
    n_tasks++;
  }
  /* Task 0 runs on the calling thread; if a thread cannot start, its task runs here too. */
  int32_t started = 0;
  for (int32_t t = 1; t < n_tasks; t++) {
    if (pthread_create(&threads[t], NULL, zp_range_thread, &tasks[t]) != 0) {
      /* no thread: the work still gets done, here, only slower */
      for (int32_t u = t; u < n_tasks; u++)
        fn(ctx, tasks[u].begin, tasks[u].end);
      break;
    }
    started = t;
  }
  fn(ctx, tasks[0].begin, tasks[0].end);
  for (int32_t t = 1; t <= started; t++)
    pthread_join(threads[t], NULL);
  return ZP_OK;
}

typedef struct {
  zp_range_fn fn;
  void *ctx;
  int64_t n, block;
  uint64_t n_blocks;
  /* The first block no thread has taken. Counted in blocks, unsigned: every thread takes one
   * past the end before it stops, and an element counter could pass INT64_MAX there. */
  _Atomic uint64_t next;
} zp_block_queue;

static void zp_blocks_drain(void *arg, int64_t begin, int64_t end) {
  (void)begin, (void)end;
  zp_block_queue *q = arg;
  for (;;) {
    uint64_t b = atomic_fetch_add_explicit(&q->next, 1, memory_order_relaxed);
    if (b >= q->n_blocks)
      return;
    int64_t lo = (int64_t)b * q->block; /* b <= (n - 1) / block: lo < n */
    q->fn(q->ctx, lo, q->block < q->n - lo ? lo + q->block : q->n);
  }
}

zp_status zp_parallel_blocks(int64_t n, int32_t n_threads, int64_t block, int64_t min_per_thread,
                             zp_range_fn fn, void *ctx) {
  if (n < 0)
    return zp_fail(ZP_ERR_INVALID, "parallel_blocks: n must be >= 0, got %lld", (long long)n);
  if (block < 1)
    block = 1;
  if (n_threads <= 0)
    n_threads = zp_default_threads();
  if (n_threads > ZP_MAX_THREADS)
    n_threads = ZP_MAX_THREADS;
  if (min_per_thread < 1)
    min_per_thread = 1;
  if (n / min_per_thread < n_threads)
    n_threads = n / min_per_thread < 1 ? 1 : (int32_t)(n / min_per_thread);
  if (n == 0)
    return ZP_OK;
  if (n_threads == 1) {
    fn(ctx, 0, n);
    return ZP_OK;
  }
  zp_block_queue q = {fn, ctx, n, block, (uint64_t)(n / block + (n % block != 0)), 0};
  /* each of the n_threads tasks drains the same queue; the ranges it is given are unused */
  return zp_parallel_for(n_threads, n_threads, 1, 1, zp_blocks_drain, &q);
}
