/* memcopy.c - zp_copy_spans (memcopy.h): the spans laid end to end as one byte range, cut into
 * blocks of ZP_COPY_BLOCK bytes that the threads take in turn, each block copied span piece by
 * span piece with memcpy. */
#include "kernels/cpu/memcopy.h"

#include <stdint.h>
#include <string.h>

#include "common/parallel.h"

#define ZP_COPY_BLOCK ((int64_t)1 << 20)

typedef struct {
  const zp_copy_span *spans;
  int32_t n;
  int64_t start[ZP_COPY_MAX_SPANS + 1]; /* each span's first byte in the joined range */
} zp_copy_job;

static void zp_copy_range(void *ctx, int64_t lo, int64_t hi) {
  const zp_copy_job *job = ctx;
  for (int32_t k = 0; k < job->n && lo < hi; k++) {
    const int64_t a = job->start[k], b = job->start[k + 1];
    if (b <= lo || a >= hi)
      continue;
    const int64_t from = lo > a ? lo : a, to = hi < b ? hi : b;
    memcpy((char *)job->spans[k].dst + (from - a), (const char *)job->spans[k].src + (from - a),
           (size_t)(to - from));
  }
}

static int zp_overlap(const void *p, int64_t n, const void *q, int64_t m) {
  const uintptr_t a = (uintptr_t)p, b = (uintptr_t)q;
  return n > 0 && m > 0 && a < b + (uintptr_t)m && b < a + (uintptr_t)n;
}

zp_status zp_copy_spans(const zp_copy_span *spans, int32_t n, int32_t n_threads) {
  if (n < 0 || n > ZP_COPY_MAX_SPANS || (n > 0 && spans == NULL))
    return zp_fail(ZP_ERR_INVALID, "copy_spans: 0 to %d spans, got %d%s", ZP_COPY_MAX_SPANS,
                   (int)n, n > 0 && spans == NULL ? " and no table" : "");
  zp_copy_job job = {spans, n, {0}};
  for (int32_t k = 0; k < n; k++) {
    const zp_copy_span *s = &spans[k];
    if (s->bytes < 0 || (s->bytes > 0 && (s->dst == NULL || s->src == NULL)))
      return zp_fail(ZP_ERR_INVALID, "copy_spans: span %d has %lld bytes from %p to %p", (int)k,
                     (long long)s->bytes, s->src, s->dst);
    if (s->bytes > INT64_MAX - job.start[k])
      return zp_fail(ZP_ERR_RANGE, "copy_spans: the spans add up to more than 2^63 bytes");
    job.start[k + 1] = job.start[k] + s->bytes;
    for (int32_t j = 0; j <= k; j++) {
      const zp_copy_span *t = &spans[j];
      const char *what = zp_overlap(s->dst, s->bytes, t->src, t->bytes) ? "source"
                         : j < k && zp_overlap(s->dst, s->bytes, t->dst, t->bytes) ? "destination"
                                                                                  : NULL;
      if (what == NULL && j < k && zp_overlap(s->src, s->bytes, t->dst, t->bytes))
        return zp_fail(ZP_ERR_INVALID, "copy_spans: span %d's source overlaps span %d's "
                       "destination", (int)k, (int)j);
      if (what != NULL)
        return zp_fail(ZP_ERR_INVALID, "copy_spans: span %d's destination overlaps span %d's %s",
                       (int)k, (int)j, what);
    }
  }
  return zp_parallel_blocks(job.start[n], n_threads, ZP_COPY_BLOCK, ZP_COPY_BLOCK,
                            zp_copy_range, &job);
}
