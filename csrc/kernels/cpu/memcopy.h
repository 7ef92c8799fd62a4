/* memcopy.h - host memory copies on the kernels' threads: several (dst, src, bytes) spans in
 * one call, split into blocks across threads (zp_parallel_blocks), for copies too large for
 * one core's bandwidth (the offloaded optimizer's early-update backups: offload/early.py). */
#ifndef ZP_MEMCOPY_H
#define ZP_MEMCOPY_H

#include <stdint.h>

#include "common/status.h"

#define ZP_COPY_MAX_SPANS 64 /* spans per call */

typedef struct {
  void *dst;
  const void *src;
  int64_t bytes; /* >= 0; dst and src NULL only when 0 */
} zp_copy_span;

/* Copies every span (memcpy semantics). Spans must not overlap their own source or any other
 * span's destination; a span that does is an error and nothing is copied. n_threads <= 0: the
 * default (ZP_NUM_THREADS, else the CPUs this process may run on). */
zp_status zp_copy_spans(const zp_copy_span *spans, int32_t n, int32_t n_threads);

#endif /* ZP_MEMCOPY_H */
