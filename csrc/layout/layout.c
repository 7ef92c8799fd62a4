/* layout.c - zp_layout_plan: buckets, alignment padding and per-rank shard ranges.
 *
 * Two passes. The first walks parameters from last to first and appends each to the open
 * bucket of its (group, buffer) key, closing that bucket when the next parameter would not
 * fit; this keeps a bucket's parameters close in backward order. The second sorts buckets by
 * their lowest parameter index, highest first, and assigns flat and shard offsets in that
 * order.
 *
 * Sizes: the checks bound every parameter to ZP_LAYOUT_MAX_BYTES and align_bytes to
 * ZP_LAYOUT_MAX_ALIGN; pass 1 bounds the sum of the aligned parameters, pass 3 the padded
 * buckets (world_size * align can pad a bucket far beyond its parameters), each with checked
 * arithmetic (common/checked.h). Every other sum is below those bounds. */
#include "layout/layout.h"

#include <stdlib.h>
#include <string.h>

#include "common/checked.h"

/* The one message for a plan whose flat buffers would exceed ZP_LAYOUT_MAX_BYTES. */
static zp_status zp_layout_too_big(const char *what, int32_t world_size, int64_t align_bytes) {
  return zp_fail(ZP_ERR_INVALID,
                 "layout: %s need more than 2**56 bytes (64 PiB), the planner's limit "
                 "(world_size=%d, align_bytes=%lld); lower world_size or align_bytes, or lay out "
                 "fewer elements", what, world_size, (long long)align_bytes);
}

void zp_layout_free(zp_layout *layout) {
  if (layout == NULL)
    return;
  free(layout->param_bucket);
  free(layout->param_offset);
  free(layout->bucket_group);
  free(layout->bucket_buffer);
  free(layout->bucket_numel);
  free(layout->bucket_shard_numel);
  free(layout->bucket_flat_offset);
  free(layout->bucket_shard_offset);
  free(layout->bucket_param_start);
  free(layout->bucket_params);
  free(layout->buffer_numel);
  free(layout);
}

static zp_status zp_layout_check(const zp_param_desc *params, int32_t n_params,
                                 int32_t world_size, int64_t align_bytes, int64_t bucket_bytes) {
  if (n_params < 1 || params == NULL)
    return zp_fail(ZP_ERR_INVALID, "layout: no parameters to lay out (n_params=%d)", n_params);
  if (world_size < 1)
    return zp_fail(ZP_ERR_INVALID,
                   "layout: world_size must be >= 1 (and at most 2**31-1), got %d", world_size);
  if (align_bytes < 1 || align_bytes > ZP_LAYOUT_MAX_ALIGN || (align_bytes & (align_bytes - 1)))
    return zp_fail(ZP_ERR_INVALID,
                   "layout: align_bytes must be a power of two in [1, 2**30], got %lld",
                   (long long)align_bytes);
  if (bucket_bytes < 1)
    return zp_fail(ZP_ERR_INVALID, "layout: bucket_bytes must be in [1, 2**63-1], got %lld",
                   (long long)bucket_bytes);
  for (int32_t i = 0; i < n_params; i++) {
    const zp_param_desc *p = &params[i];
    if (p->numel < 1)
      return zp_fail(ZP_ERR_INVALID,
                     "layout: parameter %d has %lld elements; leave empty parameters out", i,
                     (long long)p->numel);
    if (p->group < 0)
      return zp_fail(ZP_ERR_INVALID, "layout: parameter %d has group %d; groups are >= 0", i,
                     p->group);
    if (p->buffer < 0 || p->buffer >= ZP_LAYOUT_MAX_BUFFERS)
      return zp_fail(ZP_ERR_INVALID, "layout: parameter %d has buffer %d; buffer ids are in [0, %d)",
                     i, p->buffer, ZP_LAYOUT_MAX_BUFFERS);
    if (p->elem_size != 1 && p->elem_size != 2 && p->elem_size != 4 && p->elem_size != 8)
      return zp_fail(ZP_ERR_INVALID, "layout: parameter %d has element size %d; use 1, 2, 4 or 8",
                     i, p->elem_size);
    if (align_bytes % p->elem_size != 0)
      return zp_fail(ZP_ERR_INVALID,
                     "layout: align_bytes=%lld is not a multiple of parameter %d's element size %d",
                     (long long)align_bytes, i, p->elem_size);
    int64_t bytes;
    if (!zp_mul_i64(p->numel, p->elem_size, &bytes) || bytes > ZP_LAYOUT_MAX_BYTES)
      return zp_fail(ZP_ERR_INVALID,
                     "layout: parameter %d has %lld elements of %d bytes; numel * elem_size "
                     "must be at most 2**56 bytes", i, (long long)p->numel, p->elem_size);
  }
  return ZP_OK;
}

/* A bucket while pass 1 is filling it. */
typedef struct {
  int32_t group, buffer, elem_size;
  int32_t min_param; /* lowest parameter index so far: the last one appended */
  int64_t fill;      /* elements used, each parameter rounded up to the alignment */
} zp_draft_bucket;

/* qsort has no context argument in C11, so drafts are sorted through an index array that
 * carries the sort key with it. */
typedef struct {
  int32_t min_param;
  int32_t draft;
} zp_draft_key;

static int zp_cmp_key_desc(const void *a, const void *b) {
  const zp_draft_key *x = a, *y = b;
  return (x->min_param < y->min_param) - (x->min_param > y->min_param);
}

static zp_status zp_layout_alloc(zp_layout *l, int32_t n_params, int32_t n_buckets,
                                 int32_t n_buffers) {
  l->param_bucket = calloc((size_t)n_params, sizeof *l->param_bucket);
  l->param_offset = calloc((size_t)n_params, sizeof *l->param_offset);
  l->bucket_group = calloc((size_t)n_buckets, sizeof *l->bucket_group);
  l->bucket_buffer = calloc((size_t)n_buckets, sizeof *l->bucket_buffer);
  l->bucket_numel = calloc((size_t)n_buckets, sizeof *l->bucket_numel);
  l->bucket_shard_numel = calloc((size_t)n_buckets, sizeof *l->bucket_shard_numel);
  l->bucket_flat_offset = calloc((size_t)n_buckets, sizeof *l->bucket_flat_offset);
  l->bucket_shard_offset = calloc((size_t)n_buckets, sizeof *l->bucket_shard_offset);
  l->bucket_param_start = calloc((size_t)n_buckets + 1, sizeof *l->bucket_param_start);
  l->bucket_params = calloc((size_t)n_params, sizeof *l->bucket_params);
  l->buffer_numel = calloc((size_t)n_buffers, sizeof *l->buffer_numel);
  if (!l->param_bucket || !l->param_offset || !l->bucket_group || !l->bucket_buffer ||
      !l->bucket_numel || !l->bucket_shard_numel || !l->bucket_flat_offset ||
      !l->bucket_shard_offset || !l->bucket_param_start || !l->bucket_params || !l->buffer_numel)
    return zp_fail(ZP_ERR_NOMEM, "layout: out of memory for %d parameters", n_params);
  return ZP_OK;
}

zp_status zp_layout_plan(const zp_param_desc *params, int32_t n_params, int32_t world_size,
                         int64_t align_bytes, int64_t bucket_bytes, zp_layout **out) {
  if (out == NULL)
    return zp_fail(ZP_ERR_INVALID, "layout: out must not be NULL");
  *out = NULL;
  ZP_TRY(zp_layout_check(params, n_params, world_size, align_bytes, bucket_bytes));

  zp_status status = ZP_OK;
  zp_draft_bucket *drafts = calloc((size_t)n_params, sizeof *drafts);
  int32_t *draft_of = calloc((size_t)n_params, sizeof *draft_of); /* param -> draft bucket */
  int32_t *open = calloc((size_t)n_params, sizeof *open);         /* open draft per key */
  int32_t *final_of = calloc((size_t)n_params, sizeof *final_of); /* draft -> final bucket */
  zp_draft_key *keys = calloc((size_t)n_params, sizeof *keys);
  int64_t *buffer_elem = calloc(ZP_LAYOUT_MAX_BUFFERS, sizeof *buffer_elem);
  int64_t *cursor = NULL;
  zp_layout *l = calloc(1, sizeof *l);
  if (!drafts || !draft_of || !open || !final_of || !keys || !buffer_elem || !l) {
    status = zp_fail(ZP_ERR_NOMEM, "layout: out of memory for %d parameters", n_params);
    goto done;
  }

  /* Pass 1: from the last parameter to the first, fill one open bucket per (group, buffer). */
  int32_t n_drafts = 0, n_open = 0, n_buffers = 0;
  int64_t aligned_bytes = 0; /* the parameters rounded up to the alignment, all buffers */
  for (int32_t i = n_params - 1; i >= 0; i--) {
    const zp_param_desc *p = &params[i];
    if (buffer_elem[p->buffer] == 0)
      buffer_elem[p->buffer] = p->elem_size;
    if (buffer_elem[p->buffer] != p->elem_size) {
      status = zp_fail(ZP_ERR_INVALID,
                       "layout: buffer %d holds elements of %lld and %d bytes; one dtype per buffer",
                       p->buffer, (long long)buffer_elem[p->buffer], p->elem_size);
      goto done;
    }
    if (p->buffer + 1 > n_buffers)
      n_buffers = p->buffer + 1;
    const int64_t align_elems = align_bytes / p->elem_size;
    int64_t rounded, rounded_bytes;
    if (!zp_round_up_i64(p->numel, align_elems, &rounded) ||
        !zp_mul_i64(rounded, p->elem_size, &rounded_bytes) ||
        !zp_add_i64(aligned_bytes, rounded_bytes, &aligned_bytes) ||
        aligned_bytes > ZP_LAYOUT_MAX_BYTES) {
      status = zp_layout_too_big("the parameters, each aligned,", world_size, align_bytes);
      goto done;
    }
    int32_t k = 0;
    while (k < n_open && !(drafts[open[k]].group == p->group && drafts[open[k]].buffer == p->buffer))
      k++;
    int32_t d = k < n_open ? open[k] : -1;
    /* fill * elem_size <= aligned_bytes and numel * elem_size <= 2**56: no overflow */
    if (d >= 0 && (drafts[d].fill + p->numel) * p->elem_size > bucket_bytes)
      d = -1; /* full: this key starts a new bucket */
    if (d < 0) {
      d = n_drafts++;
      drafts[d] = (zp_draft_bucket){p->group, p->buffer, p->elem_size, i, 0};
      if (k == n_open)
        n_open++;
      open[k] = d;
    }
    drafts[d].fill += rounded;
    drafts[d].min_param = i;
    draft_of[i] = d;
  }

  /* Pass 2: bucket order is by lowest parameter, highest first. */
  for (int32_t d = 0; d < n_drafts; d++)
    keys[d] = (zp_draft_key){drafts[d].min_param, d};
  qsort(keys, (size_t)n_drafts, sizeof *keys, zp_cmp_key_desc);
  for (int32_t b = 0; b < n_drafts; b++)
    final_of[keys[b].draft] = b;

  status = zp_layout_alloc(l, n_params, n_drafts, n_buffers);
  if (status != ZP_OK)
    goto done;
  l->n_params = n_params;
  l->n_buckets = n_drafts;
  l->n_buffers = n_buffers;
  l->world_size = world_size;
  l->align_bytes = align_bytes;

  /* Pass 3: bucket membership (ascending parameters), offsets inside buckets, then offsets of
   * buckets inside their flat buffer and inside the shard space. */
  for (int32_t i = 0; i < n_params; i++) {
    l->param_bucket[i] = final_of[draft_of[i]];
    l->bucket_param_start[l->param_bucket[i] + 1]++;
  }
  for (int32_t b = 0; b < n_drafts; b++)
    l->bucket_param_start[b + 1] += l->bucket_param_start[b];
  cursor = calloc((size_t)n_drafts, sizeof *cursor);
  if (cursor == NULL) {
    status = zp_fail(ZP_ERR_NOMEM, "layout: out of memory for %d buckets", n_drafts);
    goto done;
  }
  for (int32_t i = 0; i < n_params; i++) {
    int32_t b = l->param_bucket[i];
    l->bucket_params[l->bucket_param_start[b] + cursor[b]++] = i;
  }
  int64_t shard_offset = 0, used = 0, flat_bytes = 0;
  for (int32_t b = 0; b < n_drafts; b++) {
    const zp_draft_bucket *draft = &drafts[keys[b].draft];
    const int64_t align_elems = align_bytes / draft->elem_size;
    int64_t end = 0; /* at most the draft's fill: below 2**56 elements */
    for (int32_t j = l->bucket_param_start[b]; j < l->bucket_param_start[b + 1]; j++) {
      int32_t i = l->bucket_params[j];
      int64_t offset = (end + align_elems - 1) / align_elems * align_elems;
      l->param_offset[i] = offset;
      end = offset + params[i].numel;
      used += params[i].numel;
    }
    /* world_size * align can be 2**61 elements: the padded bucket is where a plan overflows */
    int64_t piece_elems, bucket_numel, padded_bytes;
    if (!zp_mul_i64(world_size, align_elems, &piece_elems) ||
        !zp_round_up_i64(end, piece_elems, &bucket_numel) ||
        !zp_mul_i64(bucket_numel, draft->elem_size, &padded_bytes) ||
        !zp_add_i64(flat_bytes, padded_bytes, &flat_bytes) ||
        flat_bytes > ZP_LAYOUT_MAX_BYTES) {
      status = zp_layout_too_big("the flat buffers, padded to world_size * align_bytes,",
                                 world_size, align_bytes);
      goto done;
    }
    /* every sum below is at most flat_bytes, so at most 2**56 */
    l->bucket_group[b] = draft->group;
    l->bucket_buffer[b] = draft->buffer;
    l->bucket_numel[b] = bucket_numel;
    l->bucket_shard_numel[b] = bucket_numel / world_size;
    l->bucket_flat_offset[b] = l->buffer_numel[draft->buffer];
    l->buffer_numel[draft->buffer] += bucket_numel;
    l->bucket_shard_offset[b] = shard_offset;
    shard_offset += l->bucket_shard_numel[b];
  }
  int64_t total = 0;
  for (int32_t k = 0; k < n_buffers; k++)
    total += l->buffer_numel[k];
  l->shard_numel = shard_offset;
  l->padding_numel = total - used;

done:
  free(drafts);
  free(draft_of);
  free(open);
  free(final_of);
  free(keys);
  free(buffer_elem);
  free(cursor);
  if (status == ZP_OK) {
    *out = l;
  } else {
    zp_layout_free(l);
  }
  return status;
}
