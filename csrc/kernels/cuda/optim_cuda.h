/* optim_cuda.h - the CUDA kernels of the C core, as a C API: the fused optimizer family,
 * gradient statistics, and segment copies (packing, unpacking and casting buffers).
 *
 * Tables are those of kernels/contract.h, as the CPU family's (kernels/cpu/optim.h), with
 * device addresses: zp_opt_segment rows and zp_opt_group rows, validated by the same
 * zp_opt_check, so both devices accept and reject the same arguments with the same messages.
 * This family does not link the CPU family: contract.c is all the two share in code.
 *
 * Every function that enqueues device work takes its stream and returns without waiting for
 * the device (no host synchronisation): its table reaches the device through `workspace`, a
 * caller-owned device buffer of at least the *_workspace_bytes() it asks for, with one
 * asynchronous copy from host memory, and then one kernel launch covers the whole table
 * (the statistics take two: partial sums, then their fixed-order total). The workspace must
 * not be reused before that work has run: device memory from PyTorch's caching allocator,
 * allocated and freed around the call on the same stream, satisfies this. Arguments are
 * validated before the device is touched; a CUDA failure (no driver, bad address, launch
 * error) returns ZP_ERR_SYSTEM with CUDA's message.
 *
 * Numerics: every element gets exactly the CPU family's float operations (see
 * elementwise.cuh), so for the same table the CUDA and CPU families write the same bits. The
 * *_emulate functions run the kernels' own code on the host, block by block and thread by
 * thread, over host memory: that is how the CPU test suite checks the device algorithms
 * (tiling, segment search, vector and tail paths, the reduction order) without a GPU. */
#ifndef ZP_OPTIM_CUDA_H
#define ZP_OPTIM_CUDA_H

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "kernels/contract.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the optimizer family (optim.cu) ---- */

/* Bytes of workspace zp_opt_step_cuda needs for a table of n_segments rows. */
size_t zp_opt_workspace_bytes_cuda(int32_t n_segments);

/* zp_opt_step_cpu's update on device memory. scale_dev: NULL, or a device float that
 * multiplies every group's grad_scale (an unscale or clip factor computed on the device); when
 * it holds inf or NaN the kernel writes nothing (a step skipped without a host round trip).
 * With scale_dev NULL the bits equal zp_opt_step_cpu's. */
zp_status zp_opt_step_cuda(const zp_opt_segment *segments, int32_t n_segments,
                           const zp_opt_group *groups, int32_t n_groups, const float *scale_dev,
                           void *workspace, size_t workspace_bytes, cudaStream_t stream);

/* The same computation, by the kernel's code, on host memory (scale as *scale_dev; NULL =
 * none). */
zp_status zp_opt_step_emulate(const zp_opt_segment *segments, int32_t n_segments,
                              const zp_opt_group *groups, int32_t n_groups,
                              const float *scale);

/* ---- gradient statistics (buffers.cu) ---- */

/* Workspace for zp_grad_stats_cuda over n_segments rows holding total_numel elements. */
size_t zp_grad_stats_workspace_bytes_cuda(int32_t n_segments, int64_t total_numel);

/* zp_grad_stats_cpu's statistics into device memory: out_dev[0] = sum of |g|^norm_type (max |g|
 * when norm_type is +inf; NaN when any element is NaN), out_dev[1] = 1.0 when an element is
 * inf or NaN, else 0.0. accumulate != 0 combines with what out_dev holds (sum, or max for
 * +inf; the flag by max), so one buffer can collect several dtypes in stream order.
 * Deterministic: fixed tiles of ZP_STATS_TILE_CUDA elements, each summed in double in a fixed
 * order and tree, then the tile sums added in a fixed order by one block: the same bits on every
 * run and every GPU (not those of the CPU, whose chunking differs). */
#define ZP_STATS_TILE_CUDA 4096
zp_status zp_grad_stats_cuda(const zp_opt_segment *segments, int32_t n_segments,
                             int32_t grad_dtype, double norm_type, double *out_dev,
                             int32_t accumulate, void *workspace, size_t workspace_bytes,
                             cudaStream_t stream);

zp_status zp_grad_stats_emulate(const zp_opt_segment *segments, int32_t n_segments,
                                int32_t grad_dtype, double norm_type, double *out,
                                int32_t accumulate);

/* ---- segment copies (buffers.cu): pack many tensors into a bucket, unpack, cast ---- */

typedef struct {
  const void *src;   /* NULL: dst is filled with zeros */
  void *dst;         /* must not overlap src unless src == dst */
  int64_t numel;     /* >= 0 */
  int32_t src_dtype; /* zp_dtype */
  int32_t dst_dtype; /* zp_dtype */
  float scale;       /* finite; each value is widened to fp32, times scale (skipped when 1),
                      * rounded to nearest even in dst_dtype (NaN -> 0x7FC0 in bf16): a copy
                      * with equal dtypes and scale 1 moves the bits unchanged */
} zp_copy_segment;

size_t zp_copy_workspace_bytes_cuda(int32_t n_segments);

zp_status zp_copy_cuda(const zp_copy_segment *segments, int32_t n_segments, void *workspace,
                       size_t workspace_bytes, cudaStream_t stream);

zp_status zp_copy_emulate(const zp_copy_segment *segments, int32_t n_segments);

/* ---- device queries ---- */

/* Number of CUDA devices, or ZP_ERR_SYSTEM with CUDA's reason (no driver, no device). */
zp_status zp_cuda_device_count(int32_t *count);

/* ---- shared by the .cu files of this folder ---- */

/* ZP_ERR_SYSTEM with CUDA's name and text for `e`, which is cleared so that it does not
 * resurface in an unrelated later call. */
zp_status zp_cuda_fail(const char *what, cudaError_t e);

/* Checks the workspace (large enough, 16-byte aligned) and copies the host table into it on
 * `stream`, for the current device; the host table may be freed on return (upload.cu). The
 * table goes through a ring of pinned staging slots, so the host does not wait for the stream
 * (a copy from pageable memory would: the driver synchronizes with the stream first); a table
 * larger than a slot, or a device whose ring could not be made, takes the pageable copy. */
zp_status zp_cuda_upload(const char *what, const void *table, size_t bytes, void *workspace,
                         size_t workspace_bytes, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* ZP_OPTIM_CUDA_H */
