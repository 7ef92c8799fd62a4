/* fuzz_layout.c - libFuzzer harness of the planner, zp_layout_plan (layout.h).
 *
 * Any input becomes a planning problem: world size, alignment, bucket bytes and up to 64
 * parameter descriptions, each drawn from edge values or raw bytes (fuzz_input.h). The plan
 * must come back as an error with a message, or as a plan that satisfies every invariant of
 * layout.h; anything else (a crash, a sanitizer report, a broken invariant) is a finding. */
#include <stdlib.h>

#include "fuzz_input.h"
#include "layout/layout.h"

#define MAX_PARAMS 64

static void check_plan(const zp_param_desc *p, int32_t n, int32_t ws, int64_t align,
                       const zp_layout *l) {
  FUZZ_ASSERT(l->n_params == n && l->world_size == ws && l->align_bytes == align);
  FUZZ_ASSERT(l->n_buckets >= 1 && l->n_buckets <= n);
  FUZZ_ASSERT(l->n_buffers >= 1 && l->n_buffers <= ZP_LAYOUT_MAX_BUFFERS);
  FUZZ_ASSERT(l->bucket_param_start[0] == 0 && l->bucket_param_start[l->n_buckets] == n);
  int64_t used = 0, shard = 0, total_bytes = 0;
  int64_t flat_end[ZP_LAYOUT_MAX_BUFFERS] = {0};
  for (int32_t b = 0; b < l->n_buckets; b++) {
    const int32_t buf = l->bucket_buffer[b];
    FUZZ_ASSERT(buf >= 0 && buf < l->n_buffers);
    FUZZ_ASSERT(l->bucket_param_start[b] < l->bucket_param_start[b + 1]);
    const int32_t first = l->bucket_params[l->bucket_param_start[b]];
    const int64_t elem = p[first].elem_size, align_elems = align / elem;
    /* padded to world_size equal, aligned pieces */
    FUZZ_ASSERT(l->bucket_numel[b] % (align_elems * ws) == 0);
    FUZZ_ASSERT(l->bucket_shard_numel[b] * ws == l->bucket_numel[b]);
    FUZZ_ASSERT(l->bucket_flat_offset[b] == flat_end[buf]); /* buckets tile their buffer */
    flat_end[buf] += l->bucket_numel[b];
    FUZZ_ASSERT(l->bucket_shard_offset[b] == shard);
    shard += l->bucket_shard_numel[b];
    total_bytes += l->bucket_numel[b] * elem;
    FUZZ_ASSERT(total_bytes <= ZP_LAYOUT_MAX_BYTES);
    int64_t end = 0;
    int32_t prev = -1;
    for (int32_t j = l->bucket_param_start[b]; j < l->bucket_param_start[b + 1]; j++) {
      const int32_t i = l->bucket_params[j];
      FUZZ_ASSERT(i > prev && i < n && l->param_bucket[i] == b); /* ascending, consistent */
      FUZZ_ASSERT(p[i].group == l->bucket_group[b] && p[i].buffer == buf);
      FUZZ_ASSERT(p[i].elem_size == elem);
      FUZZ_ASSERT(l->param_offset[i] >= end && l->param_offset[i] % align_elems == 0);
      end = l->param_offset[i] + p[i].numel;
      FUZZ_ASSERT(end <= l->bucket_numel[b]);
      used += p[i].numel;
      prev = i;
    }
  }
  int64_t total = 0;
  for (int32_t k = 0; k < l->n_buffers; k++) {
    FUZZ_ASSERT(l->buffer_numel[k] == flat_end[k]);
    total += l->buffer_numel[k];
  }
  FUZZ_ASSERT(l->shard_numel == shard && l->padding_numel == total - used);
  /* the bucket order: by lowest parameter, highest first */
  for (int32_t b = 1; b < l->n_buckets; b++)
    FUZZ_ASSERT(l->bucket_params[l->bucket_param_start[b - 1]] >
                l->bucket_params[l->bucket_param_start[b]]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_input in = {data, size, 0};
  const int32_t world_size = fuzz_u8(&in) & 1 ? fuzz_i32(&in) : fuzz_count(&in, 1, 16);
  const int64_t align = fuzz_u8(&in) & 1 ? fuzz_i64(&in) : (int64_t)1 << fuzz_count(&in, 0, 10);
  const int64_t bucket = fuzz_u8(&in) & 1 ? fuzz_i64(&in) : fuzz_count(&in, 1, 255) * 64;
  const int32_t n = fuzz_count(&in, 0, MAX_PARAMS);
  zp_param_desc p[MAX_PARAMS];
  static const int32_t elem_sizes[4] = {1, 2, 4, 8};
  for (int32_t i = 0; i < n; i++) {
    const uint8_t mode = fuzz_u8(&in);
    p[i].numel = mode & 1 ? fuzz_i64(&in) : fuzz_count(&in, 1, 255);
    p[i].group = mode & 2 ? fuzz_i32(&in) : fuzz_count(&in, 0, 3);
    p[i].buffer = mode & 4 ? fuzz_i32(&in) : fuzz_count(&in, 0, 2);
    p[i].elem_size = mode & 8 ? fuzz_i32(&in) : elem_sizes[fuzz_count(&in, 0, 3)];
  }
  zp_layout *l = NULL;
  zp_status st = zp_layout_plan(p, n, world_size, align, bucket, &l);
  if (st == ZP_OK) {
    check_plan(p, n, world_size, align, l);
  } else {
    FUZZ_ASSERT(l == NULL && zp_last_error()[0] != '\0');
  }
  zp_layout_free(l);
  return 0;
}
