/* test_parallel.c - zp_parallel_for (parallel.h) covers [0, n) exactly once, grain-aligned, with
 * the same split into ranges as ever, from several threads at once, nested, and after fork(). */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "common/parallel.h"

#define MAX_RANGES 4096
#define MAX_THREADS 64

typedef struct {
  atomic_int *hits;    /* calls that covered each index */
  int64_t n;
  pthread_mutex_t lock; /* guards what follows */
  int64_t n_ranges;
  int64_t begin[MAX_RANGES], end[MAX_RANGES];
  pthread_t threads[MAX_THREADS];
  int32_t n_threads_seen;
  int bad_range; /* a range outside [0, n) (not recorded in hits) */
} record;

static void record_range(void *ctx, int64_t begin, int64_t end) {
  record *rec = ctx;
  int bad = begin < 0 || end > rec->n || begin > end;
  if (!bad)
    for (int64_t i = begin; i < end; i++)
      atomic_fetch_add(&rec->hits[i], 1);
  pthread_mutex_lock(&rec->lock);
  rec->bad_range |= bad;
  if (rec->n_ranges < MAX_RANGES) {
    rec->begin[rec->n_ranges] = begin;
    rec->end[rec->n_ranges] = end;
  }
  rec->n_ranges++;
  pthread_t self = pthread_self();
  int32_t known = 0;
  for (int32_t t = 0; t < rec->n_threads_seen; t++)
    known |= pthread_equal(rec->threads[t], self) != 0;
  if (!known && rec->n_threads_seen < MAX_THREADS)
    rec->threads[rec->n_threads_seen++] = self;
  pthread_mutex_unlock(&rec->lock);
}

/* Runs one zp_parallel_for and checks it; returns 1 if everything holds. */
static int run_case(record *rec, int64_t n, int32_t n_threads, int64_t grain,
                    int64_t min_per_thread) {
  const int before = zt_failures;
  rec->n = n;
  rec->n_ranges = 0;
  rec->n_threads_seen = 0;
  rec->bad_range = 0;
  for (int64_t i = 0; i < n; i++)
    atomic_store(&rec->hits[i], 0);

  if (CHECK_OK(zp_parallel_for(n, n_threads, grain, min_per_thread, record_range, rec))) {
    CHECK_MSG(!rec->bad_range, "a range lies outside [0, %lld)", (long long)n);
    for (int64_t i = 0; i < n; i++)
      if (!CHECK_MSG(atomic_load(&rec->hits[i]) == 1, "index %lld covered %d times", (long long)i,
                     atomic_load(&rec->hits[i])))
        break;
    for (int64_t k = 0; k < rec->n_ranges && k < MAX_RANGES; k++)
      if (!CHECK_MSG(rec->begin[k] % grain == 0, "range [%lld, %lld) starts off the grain",
                     (long long)rec->begin[k], (long long)rec->end[k]))
        break;
    CHECK_MSG(rec->n_threads_seen <= n_threads, "%d threads ran, %d allowed", rec->n_threads_seen,
              n_threads);
    if (n < min_per_thread) /* below min_per_thread for even one extra thread: the caller alone */
      CHECK_MSG(rec->n_threads_seen <= 1 &&
                    (rec->n_threads_seen == 0 || pthread_equal(rec->threads[0], pthread_self())),
                "n %lld < min_per_thread %lld but %d threads (or another thread) ran", (long long)n,
                (long long)min_per_thread, rec->n_threads_seen);
  }
  if (zt_failures != before) {
    printf("  (case: n=%lld n_threads=%d grain=%lld min_per_thread=%lld)\n", (long long)n,
           n_threads, (long long)grain, (long long)min_per_thread);
    return 0;
  }
  return 1;
}

static record *new_record(int64_t max_n) {
  record *rec = calloc(1, sizeof *rec);
  if (!rec)
    return NULL;
  rec->hits = calloc((size_t)max_n, sizeof *rec->hits);
  pthread_mutex_init(&rec->lock, NULL);
  return rec;
}

static void free_record(record *rec) {
  pthread_mutex_destroy(&rec->lock);
  free(rec->hits);
  free(rec);
}

void test_parallel_for_coverage(void) {
  static const int64_t ns[] = {0, 1, 2, 7, 63, 64, 65, 1000, 4097, 100000, 1000003};
  static const int32_t threads[] = {1, 2, 3, 4, 8, 16};
  static const int64_t grains[] = {1, 7, 16, 64, 1000};
  static const int64_t mins[] = {1, 100, 10000};
  const int64_t max_n = 1000003;
  record *rec = new_record(max_n);
  if (!CHECK(rec && rec->hits))
    return;
  int cases = 0;
  for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++)
    for (size_t b = 0; b < sizeof threads / sizeof threads[0]; b++)
      for (size_t c = 0; c < sizeof grains / sizeof grains[0]; c++)
        for (size_t d = 0; d < sizeof mins / sizeof mins[0]; d++) {
          cases++;
          if (!run_case(rec, ns[a], threads[b], grains[c], mins[d])) {
            free_record(rec);
            return;
          }
        }
  printf("  %d cases, default threads %d\n", cases, zp_default_threads());
  CHECK(zp_default_threads() >= 1);
  free_record(rec);
}

/* Random small problems, where off-by-one errors at range ends are most likely. */
void test_parallel_for_small_n(void) {
  zt_rng r = zt_rng_seed(31337);
  record *rec = new_record(5000);
  if (!CHECK(rec && rec->hits))
    return;
  for (int rep = 0; rep < 300; rep++) {
    int64_t n = zt_range(&r, 0, 5000);
    int32_t t = (int32_t)zt_range(&r, 1, 12);
    int64_t grain = zt_range(&r, 1, 300);
    int64_t min_per_thread = zt_range(&r, 1, 2000);
    if (!run_case(rec, n, t, grain, min_per_thread))
      break;
  }
  free_record(rec);
}

/* ---- the persistent pool: the same split as ever, from any thread, nested, across fork ---- */

/* The split zp_parallel_for made before the pool (one range per thread, ceil(n / threads)
 * rounded up to the grain), written out again: kernels such as grad_stats rely on it for
 * reductions that do not depend on timing. Returns the number of ranges. */
static int32_t reference_split(int64_t n, int32_t n_threads, int64_t grain, int64_t min_per_thread,
                               int64_t *begin, int64_t *end) {
  if (grain < 1)
    grain = 1;
  if (n_threads <= 0)
    n_threads = zp_default_threads();
  if (n_threads > 256)
    n_threads = 256;
  if (min_per_thread < 1)
    min_per_thread = 1;
  if (n / min_per_thread < n_threads)
    n_threads = n / min_per_thread < 1 ? 1 : (int32_t)(n / min_per_thread);
  if (n == 0)
    return 0;
  int64_t per = (n + n_threads - 1) / n_threads;
  per = (per + grain - 1) / grain * grain;
  if (per > n || n_threads == 1)
    per = n;
  int32_t k = 0;
  for (int64_t lo = 0; lo < n; lo += per, k++) {
    begin[k] = lo;
    end[k] = lo + per < n ? lo + per : n;
  }
  return k;
}

static int compare_begin(const void *a, const void *b) {
  const int64_t *x = a, *y = b;
  return x[0] < y[0] ? -1 : x[0] > y[0];
}

void test_parallel_for_same_ranges(void) {
  static const int64_t ns[] = {1, 2, 3, 17, 64, 100, 255, 256, 257, 1000, 4096, 65537, 1000003};
  static const int32_t threads[] = {0, 1, 2, 3, 5, 8, 15, 16, 17, 64, 300};
  static const int64_t grains[] = {0, 1, 3, 16, 64, 4096};
  static const int64_t mins[] = {0, 1, 7, 1000, 65536};
  record *rec = new_record(1000003);
  int64_t(*got)[2] = malloc(MAX_RANGES * sizeof *got);
  int64_t *want_begin = malloc(MAX_RANGES * sizeof *want_begin);
  int64_t *want_end = malloc(MAX_RANGES * sizeof *want_end);
  if (!CHECK(rec && rec->hits && got && want_begin && want_end))
    goto out;
  int cases = 0;
  for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++)
    for (size_t b = 0; b < sizeof threads / sizeof threads[0]; b++)
      for (size_t c = 0; c < sizeof grains / sizeof grains[0]; c++)
        for (size_t d = 0; d < sizeof mins / sizeof mins[0]; d++) {
          int64_t n = ns[a], grain = grains[c], min_per_thread = mins[d];
          int32_t t = threads[b];
          rec->n = n;
          rec->n_ranges = 0;
          rec->n_threads_seen = 0;
          rec->bad_range = 0;
          if (!CHECK_OK(zp_parallel_for(n, t, grain, min_per_thread, record_range, rec)))
            goto out;
          int32_t k = reference_split(n, t, grain, min_per_thread, want_begin, want_end);
          for (int64_t r = 0; r < rec->n_ranges && r < MAX_RANGES; r++) {
            got[r][0] = rec->begin[r];
            got[r][1] = rec->end[r];
          }
          qsort(got, (size_t)rec->n_ranges, sizeof *got, compare_begin);
          int same = rec->n_ranges == k;
          for (int32_t r = 0; same && r < k; r++)
            same = got[r][0] == want_begin[r] && got[r][1] == want_end[r];
          if (!CHECK_MSG(same, "n=%lld threads=%d grain=%lld min=%lld: %lld ranges, want %d",
                         (long long)n, t, (long long)grain, (long long)min_per_thread,
                         (long long)rec->n_ranges, k))
            goto out;
          cases++;
        }
  printf("  %d cases\n", cases);
out:
  free(want_end);
  free(want_begin);
  free(got);
  if (rec)
    free_record(rec);
}

/* Covers [0, n) with counts, for callers that check off the test's main thread (the CHECK
 * counters are not thread-safe). */
typedef struct {
  _Atomic int32_t *hits;
  int64_t n;
  _Atomic int32_t bad;
} counting;

static void count_hits(void *ctx, int64_t begin, int64_t end) {
  counting *c = ctx;
  if (begin < 0 || end > c->n || begin > end) {
    atomic_store(&c->bad, 1);
    return;
  }
  for (int64_t i = begin; i < end; i++)
    atomic_fetch_add_explicit(&c->hits[i], 1, memory_order_relaxed);
}

/* Runs zp_parallel_for (or zp_parallel_blocks) over n; 1 if every index was covered once. */
static int covered_once(int64_t n, int32_t threads, int64_t grain, int blocks) {
  counting c = {calloc((size_t)(n > 0 ? n : 1), sizeof(_Atomic int32_t)), n, 0};
  if (c.hits == NULL)
    return 0;
  zp_status s = blocks ? zp_parallel_blocks(n, threads, grain, 1, count_hits, &c)
                       : zp_parallel_for(n, threads, grain, 1, count_hits, &c);
  int ok = s == ZP_OK && !atomic_load(&c.bad);
  for (int64_t i = 0; ok && i < n; i++)
    ok = atomic_load(&c.hits[i]) == 1;
  free(c.hits);
  return ok;
}

typedef struct {
  uint64_t seed;
  int calls, failed;
} caller_job;

static void *concurrent_caller(void *arg) {
  caller_job *job = arg;
  zt_rng r = zt_rng_seed(job->seed);
  for (int i = 0; i < job->calls; i++) {
    int64_t n = zt_range(&r, 0, 20000);
    int32_t t = (int32_t)zt_range(&r, 1, 8);
    int64_t grain = zt_range(&r, 1, 100);
    job->failed += !covered_once(n, t, grain, (int)zt_range(&r, 0, 1));
  }
  return NULL;
}

/* Several threads call at once (Python's main thread, the offload worker, copy threads): every
 * call completes and covers its own range. */
void test_parallel_for_concurrent_callers(void) {
  enum { CALLERS = 4, CALLS = 200 };
  pthread_t threads[CALLERS];
  caller_job jobs[CALLERS];
  int started = 0;
  for (int i = 0; i < CALLERS; i++) {
    jobs[i] = (caller_job){(uint64_t)i + 77, CALLS, 0};
    if (!CHECK(pthread_create(&threads[i], NULL, concurrent_caller, &jobs[i]) == 0))
      break;
    started++;
  }
  for (int i = 0; i < started; i++) {
    pthread_join(threads[i], NULL);
    CHECK_MSG(jobs[i].failed == 0, "caller %d: %d of %d calls missed or repeated an index", i,
              jobs[i].failed, jobs[i].calls);
  }
}

typedef struct {
  _Atomic int32_t outer_ranges, inner_ok, inner_bad;
} nesting;

static void nested_range(void *ctx, int64_t begin, int64_t end) {
  (void)begin, (void)end;
  nesting *nest = ctx;
  atomic_fetch_add(&nest->outer_ranges, 1);
  /* the inner call runs on this thread: its ranges all see this pthread_self */
  record *rec = new_record(5000);
  if (rec == NULL || rec->hits == NULL) {
    atomic_fetch_add(&nest->inner_bad, 1);
    return;
  }
  rec->n = 5000;
  int ok = zp_parallel_for(5000, 4, 16, 1, record_range, rec) == ZP_OK && !rec->bad_range &&
           rec->n_ranges == 4 && rec->n_threads_seen == 1 &&
           pthread_equal(rec->threads[0], pthread_self());
  for (int64_t i = 0; ok && i < 5000; i++)
    ok = atomic_load(&rec->hits[i]) == 1;
  ok = ok && covered_once(3000, 3, 64, 1); /* the block queue nests too */
  atomic_fetch_add(ok ? &nest->inner_ok : &nest->inner_bad, 1);
  free_record(rec);
}

/* A zp_parallel_for inside a task (on a pool worker or on the caller) runs inline. */
void test_parallel_for_nested(void) {
  nesting nest = {0, 0, 0};
  for (int rep = 0; rep < 20; rep++)
    CHECK_OK(zp_parallel_for(4, 4, 1, 1, nested_range, &nest));
  CHECK_EQ(atomic_load(&nest.outer_ranges), 80);
  CHECK_EQ(atomic_load(&nest.inner_ok), 80);
  CHECK_EQ(atomic_load(&nest.inner_bad), 0);
}

/* ---- fork ---- */

static void slow_range(void *ctx, int64_t begin, int64_t end) {
  struct timespec ms10 = {0, 10 * 1000 * 1000};
  nanosleep(&ms10, NULL);
  record_range(ctx, begin, end);
}

/* In a fork()ed child: the pool works (several threads run a slow job) and covers ranges.
 * Returns an exit status: 0 when all holds, else a bit per failed part. */
static int child_uses_pool(int spin_zero) {
  if (spin_zero && setenv("ZP_POOL_SPIN_US", "0", 1) != 0)
    return 64;
  int status = 0;
  record *rec = new_record(4000);
  if (rec == NULL || rec->hits == NULL)
    return 32;
  rec->n = 4;
  if (zp_parallel_for(4, 4, 1, 1, slow_range, rec) != ZP_OK || rec->bad_range ||
      rec->n_ranges != 4)
    status |= 1;
  for (int64_t i = 0; i < 4; i++)
    if (atomic_load(&rec->hits[i]) != 1)
      status |= 1;
  if (rec->n_threads_seen < 2) /* the caller alone: the new pool did not start */
    status |= 2;
  free_record(rec);
  /* back-to-back and spaced calls: workers found spinning, asleep (spin 0), or woken */
  struct timespec ms2 = {0, 2 * 1000 * 1000};
  for (int i = 0; i < 200; i++) {
    if (!covered_once(4000, 3, 16, i % 2))
      status |= 4;
    if (i % 50 == 0)
      nanosleep(&ms2, NULL);
  }
  if (!covered_once(4000, 8, 16, 0)) /* the child's pool grows too */
    status |= 8;
  return status;
}

typedef struct {
  _Atomic int32_t stop;
  int failed;
} busy_loop;

static void *keep_pool_busy(void *arg) {
  busy_loop *loop = arg;
  while (!atomic_load(&loop->stop))
    loop->failed += !covered_once(20000, 4, 64, 0);
  return NULL;
}

/* Waits for the child at most `seconds`; its exit status, or -1 (killed: it hung). */
static int wait_child(pid_t pid, int seconds) {
  struct timespec ms10 = {0, 10 * 1000 * 1000};
  for (int i = 0; i < seconds * 100; i++) {
    int st;
    pid_t got = waitpid(pid, &st, WNOHANG);
    if (got == pid)
      return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    if (got < 0)
      return -2;
    nanosleep(&ms10, NULL);
  }
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  return -1;
}

/* fork() while the pool runs jobs on another thread: the child must start a pool of its own
 * (the parent's threads did not survive, and its lock may have been held), with the default
 * spin and with ZP_POOL_SPIN_US=0 (set before the child's first use). */
void test_parallel_for_fork(void) {
  CHECK(covered_once(100000, 4, 64, 0)); /* the parent's pool exists */
  busy_loop loop = {0, 0};
  pthread_t busy;
  if (!CHECK(pthread_create(&busy, NULL, keep_pool_busy, &loop) == 0))
    return;
  for (int rep = 0; rep < 6; rep++) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0)
      _exit(child_uses_pool(rep % 2));
    if (!CHECK_MSG(pid > 0, "fork failed"))
      break;
    int status = wait_child(pid, 60);
    CHECK_MSG(status == 0,
              "child %d (spin %s): status %d (-1 hung; bits: 1 ranges, 2 one thread, 4 repeated "
              "calls, 8 growth)",
              rep, rep % 2 ? "0" : "default", status);
  }
  atomic_store(&loop.stop, 1);
  pthread_join(busy, NULL);
  CHECK_MSG(loop.failed == 0, "%d calls of the busy thread failed", loop.failed);
  CHECK(covered_once(100000, 4, 64, 0)); /* the parent's pool still works */
}
