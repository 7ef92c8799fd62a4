/* parallel.c - zp_parallel_for: a fork-join over [0, n) on a persistent, process-wide pool.
 *
 * The split of [0, n) into tasks is computed by the caller exactly as it always was (one range
 * per thread, starts rounded up to the grain); the pool only decides which thread runs which
 * task. Task 0 runs on the caller, then the caller and the pool's workers claim the remaining
 * tasks from one counter, so a worker that is slow to wake (or that could not be created) costs
 * nothing but its share: the caller takes its tasks.
 *
 * Why a pool: creating and joining the threads at every call cost 0.6 ms for an empty 2-thread
 * call made 2 ms after the previous one, on a 2-vCPU VM (0.03 ms back to back), as much as the
 * memory-bound work of a million-element update; an offloaded step calls once per bucket. Workers spin for ZP_POOL_SPIN_US after
 * each job (back-to-back calls find them awake), then sleep on a condition variable.
 *
 * Invariants:
 * - One job at a time holds the pool (`busy`). A caller that finds it busy does not wait: it
 *   runs its job on threads of its own, created for the call (the path used before the pool).
 *   So no caller ever waits for another caller's job, and no cycle of waits can form, whatever
 *   the range functions do (they might, say, wait for a flag another caller's kernel sets);
 *   concurrent callers cost what every call cost before the pool.
 * - A thread inside a job (a worker, or a caller running its share) runs any nested
 *   zp_parallel_for inline, in task order: it neither waits for the pool it is part of nor
 *   multiplies threads.
 * - After fork() the child forgets the parent's pool (its threads did not survive) and starts
 *   a new one on first use; the old pool's memory is kept reachable, never freed.
 * - Every wait is a bounded spin followed by a blocking wait on a condition variable that the
 *   awaited event signals: nothing spins forever, nothing waits for an event that cannot come. */
#define _GNU_SOURCE
#include "common/parallel.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/checked.h"

#define ZP_MAX_THREADS 256
#define ZP_POOL_SPIN_US_DEFAULT 500
#define ZP_POOL_SPIN_US_MAX 1000000

/* The claim word packs a job's identity and its next unclaimed task, so that claiming is one
 * compare-and-swap that fails for a worker still looking at an older job:
 * bits 20..63 epoch (1, 2, ... per job), 10..19 task count, 0..9 next task to claim. */
#define ZP_CLAIM_TASK_BITS 10
#define ZP_CLAIM_EPOCH(w) ((w) >> (2 * ZP_CLAIM_TASK_BITS))
#define ZP_CLAIM_TASKS(w) (((w) >> ZP_CLAIM_TASK_BITS) & ((1u << ZP_CLAIM_TASK_BITS) - 1))
#define ZP_CLAIM_NEXT(w) ((w) & ((1u << ZP_CLAIM_TASK_BITS) - 1))
_Static_assert(ZP_MAX_THREADS < (1 << ZP_CLAIM_TASK_BITS), "a task count must fit its field");

typedef struct zp_pool {
  _Alignas(64) _Atomic uint64_t claim; /* see ZP_CLAIM_*; epoch 0: no job yet */
  _Alignas(64) _Atomic int32_t pending; /* tasks 1.. of the job not finished yet */
  _Atomic int32_t caller_sleeping;      /* the caller waits on `done` */
  _Alignas(64) _Atomic int32_t busy;    /* a job holds the pool: only its caller goes on */
  _Atomic int32_t sleepers;             /* workers waiting on `wake` */
  int32_t n_workers;                    /* threads started; written by the busy holder only */
  int64_t spin_ns;                      /* how long a waiting thread spins before it sleeps */
  pthread_mutex_t lock;                 /* guards the sleeps on `wake` and `done` */
  pthread_cond_t wake;                  /* a new epoch was published */
  pthread_cond_t done;                  /* `pending` reached 0 */
  /* The job, written by the busy holder before it publishes the epoch. */
  zp_range_fn fn;
  void *ctx;
  int64_t begin[ZP_MAX_THREADS], end[ZP_MAX_THREADS];
  struct zp_pool *abandoned_next; /* older pools a fork() left behind, kept reachable */
} zp_pool;

static _Atomic(zp_pool *) zp_the_pool;
static zp_pool *zp_abandoned_pools;
static pthread_once_t zp_atfork_once = PTHREAD_ONCE_INIT;
/* Non-zero while this thread runs a task (a worker, always) or a caller's share of a job. */
static _Thread_local int zp_in_job;

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

/* ---- waiting: a bounded spin, then a sleep ---- */

static inline void zp_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield" ::: "memory");
#endif
}

static int64_t zp_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

typedef bool (*zp_ready_fn)(zp_pool *p, uint64_t arg);

/* Spins until ready(p, arg) or p->spin_ns pass; true if ready. Yields the CPU every few
 * microseconds so that a spinning thread gives way to runnable work on its CPU. */
static bool zp_spin(zp_pool *p, zp_ready_fn ready, uint64_t arg) {
  if (p->spin_ns <= 0)
    return ready(p, arg);
  const int64_t deadline = zp_now_ns() + p->spin_ns;
  for (;;) {
    for (int i = 0; i < 64; i++) {
      if (ready(p, arg))
        return true;
      zp_cpu_relax();
    }
    if (zp_now_ns() >= deadline)
      return ready(p, arg);
    sched_yield();
  }
}

static bool zp_new_epoch(zp_pool *p, uint64_t done_epoch) {
  return ZP_CLAIM_EPOCH(atomic_load(&p->claim)) != done_epoch;
}

static bool zp_all_done(zp_pool *p, uint64_t unused) {
  (void)unused;
  return atomic_load(&p->pending) == 0;
}

/* ---- the workers ---- */

/* Claims and runs tasks of the job whose claim word is `w` until none is left or the job is
 * over. A claim succeeds only while the epoch is that job's, and the job stays published
 * (its fn, ctx and ranges unchanged) until every claimed task has finished. */
static void zp_run_claimed(zp_pool *p, uint64_t w) {
  const uint64_t epoch = ZP_CLAIM_EPOCH(w);
  while (ZP_CLAIM_EPOCH(w) == epoch && ZP_CLAIM_NEXT(w) < ZP_CLAIM_TASKS(w)) {
    if (!atomic_compare_exchange_weak(&p->claim, &w, w + 1))
      continue; /* w now holds the current word */
    const uint32_t t = (uint32_t)ZP_CLAIM_NEXT(w);
    p->fn(p->ctx, p->begin[t], p->end[t]);
    /* The last task to finish wakes the caller if it went to sleep (it set caller_sleeping
     * before its last look at pending: one of the two sees the other's store). */
    if (atomic_fetch_sub(&p->pending, 1) == 1 && atomic_load(&p->caller_sleeping)) {
      pthread_mutex_lock(&p->lock);
      pthread_cond_signal(&p->done);
      pthread_mutex_unlock(&p->lock);
    }
    w = atomic_load(&p->claim);
  }
}

static void *zp_pool_worker(void *arg) {
  zp_pool *p = arg;
  zp_in_job = 1;
  uint64_t done_epoch = 0; /* a worker joins the job in flight when it starts, if any */
  for (;;) {
    if (!zp_spin(p, zp_new_epoch, done_epoch)) {
      pthread_mutex_lock(&p->lock);
      atomic_fetch_add(&p->sleepers, 1); /* before the last look at the epoch: see the caller */
      while (!zp_new_epoch(p, done_epoch))
        pthread_cond_wait(&p->wake, &p->lock);
      atomic_fetch_sub(&p->sleepers, 1);
      pthread_mutex_unlock(&p->lock);
    }
    uint64_t w = atomic_load(&p->claim);
    zp_run_claimed(p, w);
    done_epoch = ZP_CLAIM_EPOCH(w);
  }
  return NULL;
}

/* Starts workers until there are `want` (ZP_MAX_THREADS - 1 at most); stops at the first
 * failure, whose tasks the caller then runs. Workers block the asynchronous signals, which
 * then go to the application's own threads (Python's handlers run on its main thread anyway);
 * the synchronous ones (a fault in a range function) stay deliverable, so that crash handlers
 * such as faulthandler still report them. */
static void zp_pool_grow(zp_pool *p, int32_t want) {
  if (p->n_workers >= want)
    return;
  pthread_attr_t attr;
  if (pthread_attr_init(&attr) != 0)
    return;
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  sigset_t all, old;
  sigfillset(&all);
  static const int synchronous[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGABRT, SIGSYS};
  for (size_t i = 0; i < sizeof synchronous / sizeof synchronous[0]; i++)
    sigdelset(&all, synchronous[i]);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  while (p->n_workers < want) {
    pthread_t thread;
    if (pthread_create(&thread, &attr, zp_pool_worker, p) != 0)
      break;
    p->n_workers++;
  }
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  pthread_attr_destroy(&attr);
}

/* ---- the process-wide pool ---- */

/* In a child of fork() only the forking thread exists: the pool's workers are gone, and its
 * lock may have been held by one of them. The child leaves that pool alone for good and starts
 * a new one on first use. */
static void zp_pool_atfork_child(void) {
  zp_pool *old = atomic_load(&zp_the_pool);
  if (old != NULL) {
    old->abandoned_next = zp_abandoned_pools;
    zp_abandoned_pools = old;
  }
  atomic_store(&zp_the_pool, NULL);
}

static void zp_pool_register_atfork(void) { pthread_atfork(NULL, NULL, zp_pool_atfork_child); }

static int64_t zp_pool_spin_ns(void) {
  long us = ZP_POOL_SPIN_US_DEFAULT;
  const char *env = getenv("ZP_POOL_SPIN_US");
  if (env != NULL && env[0] != '\0') {
    char *end;
    long v = strtol(env, &end, 10);
    if (*end == '\0' && v >= 0 && v <= ZP_POOL_SPIN_US_MAX)
      us = v;
  }
  return (int64_t)us * 1000;
}

/* The pool, created on first use (NULL if that fails: the caller then starts its own threads).
 * Lock-free: of two threads that create one at once, the loser frees its own. */
static zp_pool *zp_pool_get(void) {
  zp_pool *p = atomic_load(&zp_the_pool);
  if (p != NULL)
    return p;
  pthread_once(&zp_atfork_once, zp_pool_register_atfork);
  p = aligned_alloc(_Alignof(zp_pool), sizeof(zp_pool));
  if (p == NULL)
    return NULL;
  memset(p, 0, sizeof *p);
  if (pthread_mutex_init(&p->lock, NULL) != 0) {
    free(p);
    return NULL;
  }
  if (pthread_cond_init(&p->wake, NULL) != 0) {
    pthread_mutex_destroy(&p->lock);
    free(p);
    return NULL;
  }
  if (pthread_cond_init(&p->done, NULL) != 0) {
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->lock);
    free(p);
    return NULL;
  }
  p->spin_ns = zp_pool_spin_ns();
  zp_pool *expected = NULL;
  if (!atomic_compare_exchange_strong(&zp_the_pool, &expected, p)) {
    pthread_cond_destroy(&p->done);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->lock);
    free(p);
    return expected;
  }
  return p;
}

/* Runs tasks 1..n_tasks-1 on the pool and task 0 here; false (nothing run) if the pool is
 * missing or another job holds it. */
static bool zp_pool_run(const int64_t *begin, const int64_t *end, int32_t n_tasks, zp_range_fn fn,
                        void *ctx) {
  zp_pool *p = zp_pool_get();
  int32_t idle = 0;
  if (p == NULL || !atomic_compare_exchange_strong(&p->busy, &idle, 1))
    return false;
  zp_pool_grow(p, n_tasks - 1);
  p->fn = fn;
  p->ctx = ctx;
  memcpy(p->begin, begin, (size_t)n_tasks * sizeof *begin);
  memcpy(p->end, end, (size_t)n_tasks * sizeof *end);
  atomic_store(&p->pending, n_tasks - 1);
  const uint64_t epoch = ZP_CLAIM_EPOCH(atomic_load(&p->claim)) + 1;
  atomic_store(&p->claim, epoch << (2 * ZP_CLAIM_TASK_BITS) |
                              (uint64_t)n_tasks << ZP_CLAIM_TASK_BITS | 1u);
  /* A worker counts itself a sleeper before its last look at the epoch, and the epoch is
   * stored before this look at the sleepers: either it sees the job or it is woken here. */
  int32_t sleeping = atomic_load(&p->sleepers);
  if (sleeping > 0) {
    pthread_mutex_lock(&p->lock);
    for (int32_t i = 0; i < sleeping && i < n_tasks - 1; i++)
      pthread_cond_signal(&p->wake);
    pthread_mutex_unlock(&p->lock);
  }
  fn(ctx, begin[0], end[0]);
  zp_run_claimed(p, atomic_load(&p->claim)); /* tasks no worker has taken yet */
  if (!zp_spin(p, zp_all_done, 0)) {
    pthread_mutex_lock(&p->lock);
    atomic_store(&p->caller_sleeping, 1);
    while (!zp_all_done(p, 0))
      pthread_cond_wait(&p->done, &p->lock);
    atomic_store(&p->caller_sleeping, 0);
    pthread_mutex_unlock(&p->lock);
  }
  atomic_store(&p->busy, 0);
  return true;
}

/* ---- threads of the caller's own: the pool is busy (or could not be made) ---- */

typedef struct {
  zp_range_fn fn;
  void *ctx;
  int64_t begin, end;
} zp_range_task;

static void *zp_range_thread(void *arg) {
  zp_range_task *task = arg;
  zp_in_job = 1;
  task->fn(task->ctx, task->begin, task->end);
  return NULL;
}

static void zp_spawn_run(const int64_t *begin, const int64_t *end, int32_t n_tasks,
                         zp_range_fn fn, void *ctx) {
  zp_range_task tasks[ZP_MAX_THREADS];
  pthread_t threads[ZP_MAX_THREADS];
  int32_t started = 0;
  for (int32_t t = 1; t < n_tasks; t++) {
    tasks[t] = (zp_range_task){fn, ctx, begin[t], end[t]};
    if (pthread_create(&threads[t], NULL, zp_range_thread, &tasks[t]) != 0) {
      /* no thread: the work still gets done, here, only slower */
      for (int32_t u = t; u < n_tasks; u++)
        fn(ctx, begin[u], end[u]);
      break;
    }
    started = t;
  }
  fn(ctx, begin[0], end[0]);
  for (int32_t t = 1; t <= started; t++)
    pthread_join(threads[t], NULL);
}

/* ---- the public calls ---- */

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

  int64_t begin[ZP_MAX_THREADS], end[ZP_MAX_THREADS];
  /* Written so that no sum passes n, whatever n (up to 2**63-1) and grain: a range of at
   * least n / n_threads elements, rounded up to the grain (one range when that overflows),
   * so at most n_threads ranges. */
  int64_t per = n / n_threads + (n % n_threads != 0);
  if (!zp_round_up_i64(per, grain, &per) || per > n)
    per = n;
  int32_t n_tasks = 0;
  for (int64_t lo = 0; lo < n; lo = end[n_tasks - 1]) {
    begin[n_tasks] = lo;
    end[n_tasks] = per < n - lo ? lo + per : n;
    n_tasks++;
  }
  const int outer = zp_in_job;
  if (outer || n_tasks == 1) { /* nested in a task: the same ranges, in order, on this thread */
    for (int32_t t = 0; t < n_tasks; t++)
      fn(ctx, begin[t], end[t]);
    return ZP_OK;
  }
  zp_in_job = 1;
  if (!zp_pool_run(begin, end, n_tasks, fn, ctx))
    zp_spawn_run(begin, end, n_tasks, fn, ctx);
  zp_in_job = outer;
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
