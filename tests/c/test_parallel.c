/* test_parallel.c - zp_parallel_for (parallel.h) covers [0, n) exactly once, grain-aligned. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

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
