/* optim.cu - the fused optimizer family on CUDA (optim_cuda.h): one launch updates a whole
 * segment table, each element with the CPU family's float operations.
 *
 * The host turns the caller's rows into device rows (coefficients computed once per row by the
 * CPU family's zp_opt_coef_make, kernels/optim_common.h; empty rows dropped; each row's first
 * tile), copies them into the workspace, and launches one block per tile of ZP_CU_TILE elements.
 * A block finds its row by binary search, each thread updates 4 consecutive elements with
 * 16-byte fp32 and 8-byte 16-bit accesses when the row's addresses allow it, else one element
 * at a time. Memory is crossed once: 28 bytes per element for AdamW with an fp32 master and
 * bf16 gradient and parameter. */
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/elementwise.cuh"
#include "kernels/cuda/optim_cuda.h"

/* One non-empty row of the caller's table, as the device reads it. */
typedef struct {
  float *master;
  const void *grad;
  float *s0, *s1, *s2;
  void *out;          /* NULL when the master is the parameter */
  int64_t numel;      /* > 0 */
  int64_t tile0;      /* the first tile (block) of this row */
  zp_opt_coef c;      /* optim_common.h's, as the CPU family computes them (grad_dtype, seed) */
  int32_t index;      /* the row's index in the caller's table: the rounding noise's stream */
  uint32_t sr_key0;   /* zp_cu_sr_key(c.seed, index, 0): the key below element 2^32 */
  int32_t vec;        /* every address is aligned for 4-element accesses */
} zp_cu_opt_row;

/* Thread `tid` of block `tile`: elements [j, j + 4) of its row. `extra` multiplies the scale
 * when has_extra (the device scale factor). */
ZP_HD void zp_opt_thread(const zp_cu_opt_row *rows, int32_t n_rows, int64_t tile, int32_t tid,
                         int has_extra, float extra) {
  const zp_cu_opt_row *r = &rows[zp_cu_find_row(rows, n_rows, tile)];
  const int64_t j = (tile - r->tile0) * ZP_CU_TILE + (int64_t)tid * ZP_CU_VEC;
  if (j >= r->numel)
    return;
  const int m = r->numel - j < ZP_CU_VEC ? (int)(r->numel - j) : ZP_CU_VEC;
  const int vec = r->vec && m == ZP_CU_VEC;
  const zp_opt_coef *c = &r->c;
  const float scale = has_extra ? c->scale * extra : c->scale;
  const int gsize = c->grad_dtype == ZP_CU_F32 ? 4 : 2;
  float p[4], g[4], s0[4] = {0, 0, 0, 0}, s1[4] = {0, 0, 0, 0}, s2[4] = {0, 0, 0, 0};
  zp_cu_load4f(r->master + j, vec, m, p);
  zp_cu_load4((const char *)r->grad + j * gsize, c->grad_dtype, vec, m, g);
  if (r->s0)
    zp_cu_load4f(r->s0 + j, vec, m, s0);
  if (r->s1)
    zp_cu_load4f(r->s1 + j, vec, m, s1);
  if (r->s2)
    zp_cu_load4f(r->s2 + j, vec, m, s2);
ZP_UNROLL
  for (int k = 0; k < 4; k++)
    zp_cu_update(c, g[k] * scale, &p[k], &s0[k], &s1[k], &s2[k]);
  zp_cu_store4f(r->master + j, vec, m, p);
  if (r->s0)
    zp_cu_store4f(r->s0 + j, vec, m, s0);
  if (r->s1)
    zp_cu_store4f(r->s1 + j, vec, m, s1);
  if (r->s2)
    zp_cu_store4f(r->s2 + j, vec, m, s2);
  if (r->out == NULL)
    return;
  if (c->param_dtype == ZP_CU_F32) {
    if ((float *)r->out != r->master)
      zp_cu_store4f((float *)r->out + j, vec, m, p);
    return;
  }
  uint16_t h[4];
  if (c->flags & ZP_OPT_STOCHASTIC_ROUNDING) {
ZP_UNROLL
    for (int k = 0; k < 4; k++) {
      const uint64_t e = (uint64_t)(j + k);
      const uint32_t key = (e >> 32) == 0 ? r->sr_key0 : zp_cu_sr_key(c->seed, (uint64_t)r->index, e >> 32);
      h[k] = zp_cu_to_bf16_sr(p[k], zp_cu_sr_bits(key, (uint32_t)e));
    }
  } else {
ZP_UNROLL
    for (int k = 0; k < 4; k++)
      h[k] = zp_cu_narrow(p[k], c->param_dtype);
  }
  zp_cu_store4h((uint16_t *)r->out + j, vec, m, h);
}

__global__ void __launch_bounds__(ZP_CU_THREADS)
    zp_opt_kernel(const zp_cu_opt_row *rows, int32_t n_rows, const float *scale_dev) {
  float extra = 1.0f;
  if (scale_dev != NULL) {
    extra = *scale_dev;
    if (!isfinite(extra))
      return; /* a skipped step: nothing is written */
  }
  zp_opt_thread(rows, n_rows, (int64_t)blockIdx.x, (int32_t)threadIdx.x, scale_dev != NULL,
                extra);
}

/* Validated rows -> device rows (caller frees *out). */
static zp_status zp_opt_rows(const zp_opt_segment *segments, int32_t n_segments,
                             const zp_opt_group *groups, zp_cu_opt_row **out, int32_t *n_out,
                             int64_t *n_tiles) {
  zp_cu_opt_row *rows = (zp_cu_opt_row *)malloc((size_t)(n_segments > 0 ? n_segments : 1) *
                                                sizeof *rows);
  if (rows == NULL)
    return zp_fail(ZP_ERR_NOMEM, "opt_step: out of memory for %d segments", n_segments);
  int32_t n = 0;
  int64_t tiles = 0;
  for (int32_t s = 0; s < n_segments; s++) {
    const zp_opt_segment *seg = &segments[s];
    if (seg->numel == 0)
      continue;
    const zp_opt_group *g = &groups[seg->group];
    zp_cu_opt_row *r = &rows[n++];
    memset(r, 0, sizeof *r);
    r->master = seg->master, r->grad = seg->grad;
    r->s0 = seg->state0, r->s1 = seg->state1, r->s2 = seg->state2;
    r->out = seg->param_out;
    r->numel = seg->numel;
    r->tile0 = tiles;
    r->c = zp_opt_coef_make(g, seg->step);
    r->index = s;
    r->sr_key0 = zp_cu_sr_key(g->seed, (uint64_t)s, 0);
    const int gsize = g->grad_dtype == ZP_F32 ? 4 : 2, osize = g->param_dtype == ZP_F32 ? 4 : 2;
    r->vec = zp_cu_vec_aligned(r->master, 4) && zp_cu_vec_aligned(r->grad, gsize) &&
             (r->s0 == NULL || zp_cu_vec_aligned(r->s0, 4)) &&
             (r->s1 == NULL || zp_cu_vec_aligned(r->s1, 4)) &&
             (r->s2 == NULL || zp_cu_vec_aligned(r->s2, 4)) &&
             (r->out == NULL || zp_cu_vec_aligned(r->out, osize));
    tiles += (seg->numel + ZP_CU_TILE - 1) / ZP_CU_TILE;
  }
  if (tiles > INT32_MAX) {
    free(rows);
    return zp_fail(ZP_ERR_RANGE, "opt_step: %lld elements exceed one launch (%lld tiles of %d, "
                   "at most %d); split the table", (long long)(tiles * ZP_CU_TILE),
                   (long long)tiles, ZP_CU_TILE, INT32_MAX);
  }
  *out = rows, *n_out = n, *n_tiles = tiles;
  return ZP_OK;
}

extern "C" zp_status zp_cuda_fail(const char *what, cudaError_t e) {
  (void)cudaGetLastError();
  return zp_fail(ZP_ERR_SYSTEM, "%s: CUDA error %s: %s", what, cudaGetErrorName(e),
                 cudaGetErrorString(e));
}

extern "C" size_t zp_opt_workspace_bytes_cuda(int32_t n_segments) {
  return (size_t)(n_segments > 0 ? n_segments : 0) * sizeof(zp_cu_opt_row);
}

extern "C" zp_status zp_opt_step_cuda(const zp_opt_segment *segments, int32_t n_segments,
                                      const zp_opt_group *groups, int32_t n_groups,
                                      const float *scale_dev, void *workspace,
                                      size_t workspace_bytes, cudaStream_t stream) {
  ZP_TRY(zp_opt_check(segments, n_segments, groups, n_groups));
  zp_cu_opt_row *rows = NULL;
  int32_t n_rows = 0;
  int64_t n_tiles = 0;
  ZP_TRY(zp_opt_rows(segments, n_segments, groups, &rows, &n_rows, &n_tiles));
  zp_status status = ZP_OK;
  if (n_rows > 0)
    status = zp_cuda_upload("opt_step", rows, (size_t)n_rows * sizeof *rows, workspace,
                            workspace_bytes, stream);
  free(rows);
  if (status != ZP_OK || n_rows == 0)
    return status;
  zp_opt_kernel<<<(unsigned)n_tiles, ZP_CU_THREADS, 0, stream>>>(
      (const zp_cu_opt_row *)workspace, n_rows, scale_dev);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? ZP_OK : zp_cuda_fail("opt_step: launch", e);
}

extern "C" zp_status zp_opt_step_emulate(const zp_opt_segment *segments, int32_t n_segments,
                                         const zp_opt_group *groups, int32_t n_groups,
                                         const float *scale) {
  ZP_TRY(zp_opt_check(segments, n_segments, groups, n_groups));
  if (scale != NULL && !isfinite(*scale))
    return ZP_OK;
  zp_cu_opt_row *rows = NULL;
  int32_t n_rows = 0;
  int64_t n_tiles = 0;
  ZP_TRY(zp_opt_rows(segments, n_segments, groups, &rows, &n_rows, &n_tiles));
  for (int64_t tile = 0; tile < n_tiles; tile++)
    for (int32_t tid = 0; tid < ZP_CU_THREADS; tid++)
      zp_opt_thread(rows, n_rows, tile, tid, scale != NULL, scale ? *scale : 1.0f);
  free(rows);
  return ZP_OK;
}

extern "C" zp_status zp_cuda_device_count(int32_t *count) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  *count = e == cudaSuccess ? n : 0;
  return e == cudaSuccess ? ZP_OK : zp_cuda_fail("device_count", e);
}
