/* layout.h - the planner: which bytes of which flat buffer every parameter, bucket and rank owns.
 *
 * Pure C11: no CUDA, no Python, no I/O. Both executors (torch.distributed and native NCCL) and
 * every stage follow the plan made here, so it is the single source of truth for sharding.
 *
 * The plan. Parameters are grouped into buckets; a bucket holds parameters of one param group
 * and one flat buffer (one dtype), at most `bucket_bytes` of them unless a single parameter is
 * larger. Inside a bucket each parameter starts at a multiple of `align_bytes`, and the
 * bucket's length is padded to a multiple of world_size * align, so it splits into world_size
 * equal shards whose starts are aligned too. Rank r owns shard r of every bucket; its pieces,
 * laid end to end in bucket order, form the rank's shard space (gradient shard, fp32 master,
 * optimizer state), where bucket b starts at bucket_shard_offset[b].
 *
 * Bucket order is the order gradients are expected to complete in backward: buckets are sorted
 * by their lowest parameter index, highest first, so a model whose parameters are registered
 * in forward order fills bucket 0 first. The order depends only on the inputs, so it is the
 * same on every rank. */
#ifndef ZP_LAYOUT_H
#define ZP_LAYOUT_H

#include <stdint.h>

#include "common/status.h"

/* Flat buffers are one per dtype, so a handful; ids beyond this are refused. */
#define ZP_LAYOUT_MAX_BUFFERS 64

/* The planner's size limits. Every size is checked against them before it is computed, so no
 * input (2**62 bytes of alignment, 2**31-1 ranks, 2**62 elements) can overflow the int64
 * arithmetic: the call fails with ZP_ERR_INVALID and a message naming the argument instead.
 * - align_bytes: a power of two in [1, ZP_LAYOUT_MAX_ALIGN] (1 GiB: above a huge page, far
 *   above what vector loads or NCCL want).
 * - the flat buffers together, padding included, hold at most ZP_LAYOUT_MAX_BYTES bytes
 *   (64 PiB, far beyond any machine). Every element count of a plan is then below 2**56, so a
 *   caller may multiply one by the bytes of its state (fp32 master plus three fp32 states is
 *   16 bytes per element) or add up a few without overflowing int64 either. */
#define ZP_LAYOUT_MAX_ALIGN ((int64_t)1 << 30)
#define ZP_LAYOUT_MAX_BYTES ((int64_t)1 << 56)

/* What the planner needs to know of one parameter. */
typedef struct {
  int64_t numel;     /* elements, >= 1 */
  int32_t group;     /* param group index, >= 0 */
  int32_t buffer;    /* flat buffer (one per dtype) it lives in, in [0, ZP_LAYOUT_MAX_BUFFERS) */
  int32_t elem_size; /* bytes per element of that buffer: 1, 2, 4 or 8 */
} zp_param_desc;

typedef struct {
  int32_t n_params;
  int32_t n_buckets;
  int32_t n_buffers;   /* 1 + the largest buffer id */
  int32_t world_size;
  int64_t align_bytes; /* every parameter and shard starts on this many bytes */

  /* per parameter (n_params) */
  int32_t *param_bucket; /* bucket holding the parameter */
  int64_t *param_offset; /* element offset of the parameter inside its bucket */

  /* per bucket (n_buckets) */
  int32_t *bucket_group;
  int32_t *bucket_buffer;
  int64_t *bucket_numel;        /* elements, padded: a multiple of world_size * align elems */
  int64_t *bucket_shard_numel;  /* bucket_numel / world_size */
  int64_t *bucket_flat_offset;  /* element offset of the bucket inside its flat buffer */
  int64_t *bucket_shard_offset; /* element offset of the rank's piece inside its shard space */
  int32_t *bucket_param_start;  /* n_buckets + 1 entries: the bucket's parameters are */
  int32_t *bucket_params;       /* bucket_params[start[b] .. start[b+1]), ascending */

  /* per flat buffer (n_buffers) */
  int64_t *buffer_numel; /* elements of the flat buffer, padding included */

  int64_t shard_numel;   /* elements of one rank's shard space: sum of bucket_shard_numel */
  int64_t padding_numel; /* elements of all flat buffers that belong to no parameter */
} zp_layout;

/* Plans the layout of `n_params` parameters for `world_size` >= 1 ranks. `align_bytes` must be
 * a power of two in [1, ZP_LAYOUT_MAX_ALIGN] that every elem_size divides; `bucket_bytes` >= 1
 * (any int64: INT64_MAX puts each (group, buffer) in one bucket). The plan must fit in
 * ZP_LAYOUT_MAX_BYTES. On success *out holds a plan to release with zp_layout_free(). */
zp_status zp_layout_plan(const zp_param_desc *params, int32_t n_params, int32_t world_size,
                         int64_t align_bytes, int64_t bucket_bytes, zp_layout **out);

void zp_layout_free(zp_layout *layout);

#endif /* ZP_LAYOUT_H */
