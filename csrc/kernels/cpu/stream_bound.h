/* stream_bound.h - the physical bound of the CPU optimizer family: one pass that moves the
 * same streams as an optimizer step (reads, in-place updates, write-only outputs) and does no
 * math, with the same threads, split, instruction set and prefetch as zp_opt_step_cpu.
 *
 * A step cannot be faster than this pass over its streams on the same machine, so the
 * benchmark reports each kernel as a fraction of it (benchmarks/optim_kernels.py). For fp32
 * AdamW: read grad, update master, exp_avg, exp_avg_sq. For bf16 with fp32 masters: read the
 * bf16 grad, update master and states, write the bf16 parameter. */
#ifndef ZP_STREAM_BOUND_H
#define ZP_STREAM_BOUND_H

#include <stdint.h>

#include "common/status.h"

typedef enum {
  ZP_STREAM_READ = 1,   /* loaded */
  ZP_STREAM_WRITE = 2,  /* stored, not loaded: receives zeros */
  ZP_STREAM_UPDATE = 3  /* loaded and stored back unchanged */
} zp_stream_access;

#define ZP_STREAM_MAX 8

typedef struct {
  void *data;          /* numel elements of elem_bytes; READ streams are only read */
  int32_t elem_bytes;  /* 2 or 4 */
  int32_t access;      /* zp_stream_access */
} zp_stream;

/* Moves numel elements of every stream once. n_threads <= 0: zp_default_threads(). Leaves
 * READ and UPDATE streams as they were and zeroes WRITE streams. */
zp_status zp_stream_bound_cpu(const zp_stream *streams, int32_t n_streams, int64_t numel,
                              int32_t n_threads);

#endif /* ZP_STREAM_BOUND_H */
