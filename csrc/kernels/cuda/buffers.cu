/* buffers.cu - gradient statistics and segment copies on CUDA (optim_cuda.h).
 *
 * Statistics, deterministic in two stages: stage 1 gives every tile of ZP_STATS_TILE_CUDA
 * elements one block; thread t adds (in double) the terms of its 16 elements in a fixed order,
 * and the block combines its 256 thread sums in a fixed tree (no atomics), into one partial per
 * tile in the workspace. Stage 2 is one block: thread t adds partials t, t + 256, ... in order,
 * then the same tree. The bits depend on nothing but the table.
 *
 * Copies: one block per tile of ZP_CU_TILE elements of any row, 4 elements per thread, widened
 * to fp32, scaled, rounded into the destination dtype (or moved as bits when nothing changes).
 * One launch packs a bucket from many tensors, unpacks it into them, or casts a buffer. */
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/elementwise.cuh"
#include "kernels/cuda/optim_cuda.h"

#define ZP_STATS_PER_THREAD (ZP_STATS_TILE_CUDA / ZP_CU_THREADS) /* 16: 4 vectors of 4 */

typedef enum { ZP_CU_POW_2, ZP_CU_POW_1, ZP_CU_POW_MAX, ZP_CU_POW_GENERAL } zp_cu_pow_kind;

typedef struct {
  const void *grad;
  int64_t numel; /* > 0 */
  int64_t tile0;
  int32_t vec;
  int32_t pad;
} zp_cu_stats_row;

typedef struct {
  double value;   /* sum of terms, or their max */
  uint32_t flags; /* bit 0: an inf or NaN; bit 1: a NaN */
  uint32_t pad;
} zp_cu_partial;

ZP_HD double zp_cu_combine(double a, double b, int kind) {
  return kind == ZP_CU_POW_MAX ? (b > a ? b : a) : a + b;
}

/* Thread `tid` of tile `tile`: its terms, in a fixed order. */
ZP_HD void zp_stats_thread(const zp_cu_stats_row *rows, int32_t n_rows, int64_t tile,
                           int32_t tid, int32_t dtype, int kind, double p, double *value,
                           uint32_t *flags) {
  const zp_cu_stats_row *r = &rows[zp_cu_find_row(rows, n_rows, tile)];
  const int gsize = dtype == ZP_CU_F32 ? 4 : 2;
  double acc = 0.0;
  uint32_t fl = 0;
  ZP_UNROLL
  for (int k = 0; k < ZP_STATS_PER_THREAD / ZP_CU_VEC; k++) {
    const int64_t j = (tile - r->tile0) * ZP_STATS_TILE_CUDA + (int64_t)k * ZP_CU_TILE +
                      (int64_t)tid * ZP_CU_VEC;
    if (j >= r->numel)
      break;
    const int m = r->numel - j < ZP_CU_VEC ? (int)(r->numel - j) : ZP_CU_VEC;
    float x[4];
    zp_cu_load4((const char *)r->grad + j * gsize, dtype, r->vec && m == ZP_CU_VEC, m, x);
    ZP_UNROLL
    for (int e = 0; e < 4; e++) {
      if (e >= m)
        break;
      const uint32_t u = zp_cu_bits(x[e]) & 0x7FFFFFFFu;
      if (u >= 0x7F800000u)
        fl |= u > 0x7F800000u ? 3u : 1u;
      const double a = fabs((double)x[e]);
      const double t = kind == ZP_CU_POW_2 ? a * a : kind == ZP_CU_POW_GENERAL ? pow(a, p) : a;
      acc = zp_cu_combine(acc, t, kind);
    }
  }
  *value = acc;
  *flags = fl;
}

/* The fixed tree over 256 values, the device version (shared memory, one barrier a level). */
__device__ __forceinline__ void zp_cu_tree(double *v, uint32_t *f, int kind) {
  const int tid = (int)threadIdx.x;
  __syncthreads();
  for (int w = ZP_CU_THREADS / 2; w > 0; w >>= 1) {
    if (tid < w) {
      v[tid] = zp_cu_combine(v[tid], v[tid + w], kind);
      f[tid] |= f[tid + w];
    }
    __syncthreads();
  }
}

/* The same tree on the host: level by level, the same additions. */
static void zp_cu_tree_host(double *v, uint32_t *f, int kind) {
  for (int w = ZP_CU_THREADS / 2; w > 0; w >>= 1)
    for (int tid = 0; tid < w; tid++) {
      v[tid] = zp_cu_combine(v[tid], v[tid + w], kind);
      f[tid] |= f[tid + w];
    }
}

__global__ void __launch_bounds__(ZP_CU_THREADS)
    zp_stats_kernel(const zp_cu_stats_row *rows, int32_t n_rows, int32_t dtype, int kind,
                    double p, zp_cu_partial *partials) {
  __shared__ double v[ZP_CU_THREADS];
  __shared__ uint32_t f[ZP_CU_THREADS];
  zp_stats_thread(rows, n_rows, (int64_t)blockIdx.x, (int32_t)threadIdx.x, dtype, kind, p,
                  &v[threadIdx.x], &f[threadIdx.x]);
  zp_cu_tree(v, f, kind);
  if (threadIdx.x == 0) {
    partials[blockIdx.x].value = v[0];
    partials[blockIdx.x].flags = f[0];
  }
}

/* Thread tid's share of stage 2: partials tid, tid + 256, ... in order. */
ZP_HD void zp_total_thread(const zp_cu_partial *partials, int64_t n, int32_t tid, int kind,
                           double *value, uint32_t *flags) {
  double acc = 0.0;
  uint32_t fl = 0;
  for (int64_t i = tid; i < n; i += ZP_CU_THREADS) {
    acc = zp_cu_combine(acc, partials[i].value, kind);
    fl |= partials[i].flags;
  }
  *value = acc;
  *flags = fl;
}

/* The total into out[0..1], as optim_cuda.h says. */
ZP_HD void zp_total_write(double value, uint32_t flags, int kind, double *out, int accumulate) {
  if (flags & 2u)
    value = NAN; /* a max would drop a NaN: report it */
  const double flag = flags != 0 ? 1.0 : 0.0;
  if (!accumulate) {
    out[0] = value, out[1] = flag;
    return;
  }
  if (kind == ZP_CU_POW_MAX)
    out[0] = isnan(value) || isnan(out[0]) ? NAN : (value > out[0] ? value : out[0]);
  else
    out[0] = out[0] + value;
  out[1] = flag > out[1] ? flag : out[1];
}

__global__ void __launch_bounds__(ZP_CU_THREADS)
    zp_total_kernel(const zp_cu_partial *partials, int64_t n, int kind, double *out,
                    int accumulate) {
  __shared__ double v[ZP_CU_THREADS];
  __shared__ uint32_t f[ZP_CU_THREADS];
  zp_total_thread(partials, n, (int32_t)threadIdx.x, kind, &v[threadIdx.x], &f[threadIdx.x]);
  zp_cu_tree(v, f, kind);
  if (threadIdx.x == 0)
    zp_total_write(v[0], f[0], kind, out, accumulate);
}

static size_t zp_align16(size_t n) { return (n + 15) & ~(size_t)15; }

extern "C" size_t zp_grad_stats_workspace_bytes_cuda(int32_t n_segments, int64_t total_numel) {
  size_t rows = (size_t)(n_segments > 0 ? n_segments : 0);
  /* every row adds at most one partly filled tile */
  size_t tiles = (size_t)(total_numel > 0 ? total_numel : 0) / ZP_STATS_TILE_CUDA + rows + 1;
  return zp_align16(rows * sizeof(zp_cu_stats_row)) + tiles * sizeof(zp_cu_partial);
}

/* Validates (zp_grad_stats_check, as the CPU) and builds the device rows (caller frees *out). */
static zp_status zp_stats_rows(const zp_opt_segment *segments, int32_t n_segments,
                               int32_t grad_dtype, double norm_type, zp_cu_stats_row **out,
                               int32_t *n_out, int64_t *n_tiles, int *kind) {
  ZP_TRY(zp_grad_stats_check(segments, n_segments, grad_dtype, norm_type));
  *kind = isinf(norm_type) ? ZP_CU_POW_MAX
          : norm_type == 2.0 ? ZP_CU_POW_2
          : norm_type == 1.0 ? ZP_CU_POW_1
                             : ZP_CU_POW_GENERAL;
  zp_cu_stats_row *rows = (zp_cu_stats_row *)malloc((size_t)(n_segments > 0 ? n_segments : 1) *
                                                    sizeof *rows);
  if (rows == NULL)
    return zp_fail(ZP_ERR_NOMEM, "grad_stats: out of memory for %d segments", n_segments);
  int32_t n = 0;
  int64_t tiles = 0;
  const int gsize = grad_dtype == ZP_F32 ? 4 : 2;
  for (int32_t s = 0; s < n_segments; s++) {
    if (segments[s].numel == 0)
      continue;
    zp_cu_stats_row *r = &rows[n++];
    r->grad = segments[s].grad;
    r->numel = segments[s].numel;
    r->tile0 = tiles;
    r->vec = zp_cu_vec_aligned(r->grad, gsize);
    r->pad = 0;
    tiles += (r->numel + ZP_STATS_TILE_CUDA - 1) / ZP_STATS_TILE_CUDA;
  }
  if (tiles > INT32_MAX) {
    free(rows);
    return zp_fail(ZP_ERR_RANGE, "grad_stats: %lld tiles exceed one launch; split the table",
                   (long long)tiles);
  }
  *out = rows, *n_out = n, *n_tiles = tiles;
  return ZP_OK;
}

extern "C" zp_status zp_grad_stats_cuda(const zp_opt_segment *segments, int32_t n_segments,
                                        int32_t grad_dtype, double norm_type, double *out_dev,
                                        int32_t accumulate, void *workspace,
                                        size_t workspace_bytes, cudaStream_t stream) {
  if (out_dev == NULL)
    return zp_fail(ZP_ERR_INVALID, "grad_stats: out must not be NULL");
  zp_cu_stats_row *rows = NULL;
  int32_t n_rows = 0;
  int64_t n_tiles = 0;
  int kind = 0;
  ZP_TRY(zp_stats_rows(segments, n_segments, grad_dtype, norm_type, &rows, &n_rows, &n_tiles,
                       &kind));
  const size_t table = zp_align16((size_t)n_rows * sizeof *rows);
  const size_t need = table + (size_t)n_tiles * sizeof(zp_cu_partial);
  zp_status status = ZP_OK;
  if (workspace_bytes < need || workspace == NULL)
    status = zp_fail(ZP_ERR_INVALID, "grad_stats: the workspace has %zu bytes, the table and "
                     "partial sums need %zu", workspace_bytes, need);
  else if (n_rows > 0)
    status = zp_cuda_upload("grad_stats", rows, (size_t)n_rows * sizeof *rows, workspace,
                            workspace_bytes, stream);
  free(rows);
  if (status != ZP_OK)
    return status;
  zp_cu_partial *partials = (zp_cu_partial *)((char *)workspace + table);
  if (n_tiles > 0)
    zp_stats_kernel<<<(unsigned)n_tiles, ZP_CU_THREADS, 0, stream>>>(
        (const zp_cu_stats_row *)workspace, n_rows, grad_dtype, kind, norm_type, partials);
  zp_total_kernel<<<1, ZP_CU_THREADS, 0, stream>>>(partials, n_tiles, kind, out_dev, accumulate);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? ZP_OK : zp_cuda_fail("grad_stats: launch", e);
}

extern "C" zp_status zp_grad_stats_emulate(const zp_opt_segment *segments, int32_t n_segments,
                                           int32_t grad_dtype, double norm_type, double *out,
                                           int32_t accumulate) {
  if (out == NULL)
    return zp_fail(ZP_ERR_INVALID, "grad_stats: out must not be NULL");
  zp_cu_stats_row *rows = NULL;
  int32_t n_rows = 0;
  int64_t n_tiles = 0;
  int kind = 0;
  ZP_TRY(zp_stats_rows(segments, n_segments, grad_dtype, norm_type, &rows, &n_rows, &n_tiles,
                       &kind));
  zp_cu_partial *partials =
      (zp_cu_partial *)malloc((size_t)(n_tiles > 0 ? n_tiles : 1) * sizeof *partials);
  if (partials == NULL) {
    free(rows);
    return zp_fail(ZP_ERR_NOMEM, "grad_stats: out of memory for %lld tiles", (long long)n_tiles);
  }
  double v[ZP_CU_THREADS];
  uint32_t f[ZP_CU_THREADS];
  for (int64_t tile = 0; tile < n_tiles; tile++) {
    for (int32_t tid = 0; tid < ZP_CU_THREADS; tid++)
      zp_stats_thread(rows, n_rows, tile, tid, grad_dtype, kind, norm_type, &v[tid], &f[tid]);
    zp_cu_tree_host(v, f, kind);
    partials[tile].value = v[0];
    partials[tile].flags = f[0];
  }
  for (int32_t tid = 0; tid < ZP_CU_THREADS; tid++)
    zp_total_thread(partials, n_tiles, tid, kind, &v[tid], &f[tid]);
  zp_cu_tree_host(v, f, kind);
  zp_total_write(v[0], f[0], kind, out, accumulate);
  free(partials);
  free(rows);
  return ZP_OK;
}

/* ---- segment copies ---- */

typedef struct {
  const void *src; /* NULL: zeros */
  void *dst;
  int64_t numel; /* > 0 */
  int64_t tile0;
  int32_t src_dtype, dst_dtype;
  float scale;
  int32_t raw; /* same dtype, scale 1: move bits */
  int32_t vec;
  int32_t pad;
} zp_cu_copy_row;

ZP_HD void zp_copy_thread(const zp_cu_copy_row *rows, int32_t n_rows, int64_t tile,
                          int32_t tid) {
  const zp_cu_copy_row *r = &rows[zp_cu_find_row(rows, n_rows, tile)];
  const int64_t j = (tile - r->tile0) * ZP_CU_TILE + (int64_t)tid * ZP_CU_VEC;
  if (j >= r->numel)
    return;
  const int m = r->numel - j < ZP_CU_VEC ? (int)(r->numel - j) : ZP_CU_VEC;
  const int vec = r->vec && m == ZP_CU_VEC;
  const int ssize = r->src_dtype == ZP_CU_F32 ? 4 : 2, dsize = r->dst_dtype == ZP_CU_F32 ? 4 : 2;
  char *dst = (char *)r->dst + j * dsize;
  if (r->raw || r->src == NULL) {
    if (dsize == 4) {
      float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (r->src != NULL)
        zp_cu_load4f((const float *)((const char *)r->src + j * ssize), vec, m, v);
      zp_cu_store4f((float *)dst, vec, m, v);
    } else {
      uint16_t h[4] = {0, 0, 0, 0};
      if (r->src != NULL)
        zp_cu_load4h((const uint16_t *)((const char *)r->src + j * ssize), vec, m, h);
      zp_cu_store4h((uint16_t *)dst, vec, m, h);
    }
    return;
  }
  float x[4];
  zp_cu_load4((const char *)r->src + j * ssize, r->src_dtype, vec, m, x);
  if (r->scale != 1.0f) {
ZP_UNROLL
    for (int k = 0; k < 4; k++)
      x[k] = x[k] * r->scale;
  }
  if (dsize == 4) {
    zp_cu_store4f((float *)dst, vec, m, x);
    return;
  }
  uint16_t h[4];
ZP_UNROLL
  for (int k = 0; k < 4; k++)
    h[k] = zp_cu_narrow(x[k], r->dst_dtype);
  zp_cu_store4h((uint16_t *)dst, vec, m, h);
}

__global__ void __launch_bounds__(ZP_CU_THREADS)
    zp_copy_kernel(const zp_cu_copy_row *rows, int32_t n_rows) {
  zp_copy_thread(rows, n_rows, (int64_t)blockIdx.x, (int32_t)threadIdx.x);
}

static zp_status zp_copy_rows(const zp_copy_segment *segments, int32_t n_segments,
                              zp_cu_copy_row **out, int32_t *n_out, int64_t *n_tiles) {
  if (n_segments < 0 || (n_segments > 0 && segments == NULL))
    return zp_fail(ZP_ERR_INVALID, "copy: bad segment list (n_segments=%d)", n_segments);
  for (int32_t s = 0; s < n_segments; s++) {
    const zp_copy_segment *c = &segments[s];
    if (c->numel < 0)
      return zp_fail(ZP_ERR_INVALID, "copy: segment %d has numel %lld; need >= 0", s,
                     (long long)c->numel);
    if (c->src_dtype < ZP_F32 || c->src_dtype > ZP_F16 || c->dst_dtype < ZP_F32 ||
        c->dst_dtype > ZP_F16)
      return zp_fail(ZP_ERR_INVALID, "copy: segment %d has unknown dtypes (src %d, dst %d); use "
                     "0 fp32, 1 bf16, 2 fp16", s, c->src_dtype, c->dst_dtype);
    if (!isfinite(c->scale))
      return zp_fail(ZP_ERR_INVALID, "copy: segment %d has scale %g; it must be finite", s,
                     (double)c->scale);
    if (c->numel > 0 && c->dst == NULL)
      return zp_fail(ZP_ERR_INVALID, "copy: segment %d has a NULL dst", s);
  }
  zp_cu_copy_row *rows = (zp_cu_copy_row *)malloc((size_t)(n_segments > 0 ? n_segments : 1) *
                                                  sizeof *rows);
  if (rows == NULL)
    return zp_fail(ZP_ERR_NOMEM, "copy: out of memory for %d segments", n_segments);
  int32_t n = 0;
  int64_t tiles = 0;
  for (int32_t s = 0; s < n_segments; s++) {
    const zp_copy_segment *c = &segments[s];
    if (c->numel == 0)
      continue;
    zp_cu_copy_row *r = &rows[n++];
    memset(r, 0, sizeof *r);
    r->src = c->src, r->dst = c->dst, r->numel = c->numel, r->tile0 = tiles;
    r->src_dtype = c->src_dtype, r->dst_dtype = c->dst_dtype, r->scale = c->scale;
    r->raw = c->src_dtype == c->dst_dtype && c->scale == 1.0f;
    const int ssize = c->src_dtype == ZP_F32 ? 4 : 2, dsize = c->dst_dtype == ZP_F32 ? 4 : 2;
    r->vec = (c->src == NULL || zp_cu_vec_aligned(c->src, ssize)) &&
             zp_cu_vec_aligned(c->dst, dsize);
    tiles += (c->numel + ZP_CU_TILE - 1) / ZP_CU_TILE;
  }
  if (tiles > INT32_MAX) {
    free(rows);
    return zp_fail(ZP_ERR_RANGE, "copy: %lld tiles exceed one launch; split the table",
                   (long long)tiles);
  }
  *out = rows, *n_out = n, *n_tiles = tiles;
  return ZP_OK;
}

extern "C" size_t zp_copy_workspace_bytes_cuda(int32_t n_segments) {
  return (size_t)(n_segments > 0 ? n_segments : 0) * sizeof(zp_cu_copy_row);
}

extern "C" zp_status zp_copy_cuda(const zp_copy_segment *segments, int32_t n_segments,
                                  void *workspace, size_t workspace_bytes, cudaStream_t stream) {
  zp_cu_copy_row *rows = NULL;
  int32_t n_rows = 0;
  int64_t n_tiles = 0;
  ZP_TRY(zp_copy_rows(segments, n_segments, &rows, &n_rows, &n_tiles));
  zp_status status = ZP_OK;
  if (n_rows > 0)
    status = zp_cuda_upload("copy", rows, (size_t)n_rows * sizeof *rows, workspace,
                            workspace_bytes, stream);
  free(rows);
  if (status != ZP_OK || n_rows == 0)
    return status;
  zp_copy_kernel<<<(unsigned)n_tiles, ZP_CU_THREADS, 0, stream>>>(
      (const zp_cu_copy_row *)workspace, n_rows);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? ZP_OK : zp_cuda_fail("copy: launch", e);
}

extern "C" zp_status zp_copy_emulate(const zp_copy_segment *segments, int32_t n_segments) {
  zp_cu_copy_row *rows = NULL;
  int32_t n_rows = 0;
  int64_t n_tiles = 0;
  ZP_TRY(zp_copy_rows(segments, n_segments, &rows, &n_rows, &n_tiles));
  for (int64_t tile = 0; tile < n_tiles; tile++)
    for (int32_t tid = 0; tid < ZP_CU_THREADS; tid++)
      zp_copy_thread(rows, n_rows, tile, tid);
  free(rows);
  return ZP_OK;
}
