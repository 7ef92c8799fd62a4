/* contract.h - the tables every optimizer kernel family reads, and the checks that decide
 * which tables are valid: the CPU family (kernels/cpu/optim.h) and the CUDA family
 * (kernels/cuda/optim_cuda.h) both include this header and run these checks before they touch
 * memory, so both devices accept and reject the same arguments with the same messages.
 *
 * Invariant: this header and contract.c know no device and no kernel: plain C11 (also valid
 * C++, for nvcc's host code), no Python, no CUDA. The math of each kind is documented with
 * the CPU family (optim.h); the per-segment constants both families derive from a group row
 * are in optim_common.h. */
#ifndef ZP_CONTRACT_H
#define ZP_CONTRACT_H

#include <stdint.h>

#include "common/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { ZP_F32 = 0, ZP_BF16 = 1, ZP_F16 = 2 } zp_dtype;

typedef enum {
  ZP_OPT_ADAMW = 0,   /* torch.optim.AdamW */
  ZP_OPT_ADAM = 1,    /* torch.optim.Adam (L2 weight decay added to the gradient) */
  ZP_OPT_SGD = 2,     /* torch.optim.SGD (momentum, dampening, nesterov, weight decay) */
  ZP_OPT_ADAGRAD = 3, /* torch.optim.Adagrad (lr_decay, weight decay, eps) */
  ZP_OPT_LION = 4     /* Lion (Chen et al. 2023): sign update, decoupled weight decay */
} zp_opt_kind;

#define ZP_OPT_KINDS 5 /* kinds are 0 .. ZP_OPT_KINDS - 1 */

enum {
  ZP_OPT_MAXIMIZE = 1 << 0,
  ZP_OPT_AMSGRAD = 1 << 1,            /* Adam/AdamW: keep max of exp_avg_sq in state2 */
  ZP_OPT_NESTEROV = 1 << 2,           /* SGD */
  ZP_OPT_STOCHASTIC_ROUNDING = 1 << 3 /* bf16 param_out only (an error otherwise): a 16-bit
                                       * hash of (group seed, segment index in this call's
                                       * table, element index in the segment) is added to the
                                       * fp32 bits before truncation; unbiased, and independent
                                       * of threads and ISA. The same table and seed give the
                                       * same bits. */
};

#define ZP_OPT_ALL_FLAGS \
  (ZP_OPT_MAXIMIZE | ZP_OPT_AMSGRAD | ZP_OPT_NESTEROV | ZP_OPT_STOCHASTIC_ROUNDING)

/* One contiguous run of elements sharing a param group and a step count. Addresses are host
 * memory for the CPU family, device memory for the CUDA family. */
typedef struct {
  float *master;         /* fp32 master weights, updated in place */
  const void *grad;      /* gradient, in the group's grad_dtype, read only */
  float *state0;         /* Adam*: exp_avg; SGD: momentum_buffer; Adagrad: sum; Lion: exp_avg */
  float *state1;         /* Adam*: exp_avg_sq; NULL otherwise */
  float *state2;         /* Adam* with AMSGRAD: max_exp_avg_sq; NULL otherwise */
  void *param_out;       /* master rounded to param_dtype (NaN -> 0x7FC0 in bf16); NULL when
                          * the master is the param (then param_dtype must be ZP_F32); never
                          * read, so it may hold garbage */
  int64_t numel;         /* elements, >= 0 */
  int64_t step;          /* step count after this update, >= 1 (SGD: 1 = first step, the
                          * momentum buffer is written, not read) */
  int32_t group;         /* index into the groups array */
} zp_opt_segment;

typedef struct {
  int32_t kind;        /* zp_opt_kind */
  int32_t grad_dtype;  /* zp_dtype of every segment's grad */
  int32_t param_dtype; /* zp_dtype of every segment's param_out */
  int32_t flags;       /* ZP_OPT_* bits */
  double lr;
  double beta1;        /* Adam*, Lion: beta1; SGD: momentum; Adagrad: lr_decay */
  double beta2;        /* Adam*, Lion: beta2; SGD: dampening; Adagrad: unused */
  double eps;          /* Adam*, Adagrad */
  double weight_decay;
  double grad_scale;   /* multiplies the gradient first */
  uint64_t seed;       /* stochastic rounding: a new value every step */
} zp_opt_group;

/* The most elements one call's table may hold, all segments together (2**56: 256 PiB of fp32,
 * far beyond any machine). The kernels add segment lengths into int64 offsets and multiply
 * them by element sizes; this bound keeps that arithmetic from overflowing. */
#define ZP_OPT_MAX_NUMEL ((int64_t)1 << 56)

/* The checks of an optimizer step's tables, run before any memory is touched: lr,
 * weight_decay >= 0 and finite; grad_scale finite; Adam*, Lion: betas in [0, 1); Adam*,
 * Adagrad: eps >= 0; SGD: momentum >= 0, NESTEROV needs momentum > 0 (with any dampening, as
 * torch.optim.SGD computes for a param group); Adagrad: lr_decay >= 0; flags known and
 * meaningful for the kind; every segment names a group, has numel >= 0 and step >= 1, and the
 * segments' numel add up to at most ZP_OPT_MAX_NUMEL; a non-empty one has master and grad, and
 * the states the kind needs (Adam*: state0, state1, AMSGRAD: state2; SGD with momentum,
 * Adagrad, Lion: state0), and a param_out unless param_dtype is ZP_F32. NaN fails every
 * check. */
zp_status zp_opt_check(const zp_opt_segment *segments, int32_t n_segments,
                       const zp_opt_group *groups, int32_t n_groups);

/* The checks of a gradient-statistics call (zp_grad_stats_cpu, zp_grad_stats_cuda), which
 * read only each segment's grad and numel: a segment list, a known grad_dtype, norm_type > 0
 * (+inf allowed), numel >= 0 adding up to at most ZP_OPT_MAX_NUMEL, and a grad wherever
 * numel > 0. */
zp_status zp_grad_stats_check(const zp_opt_segment *segments, int32_t n_segments,
                              int32_t grad_dtype, double norm_type);

#ifdef __cplusplus
}
#endif

#endif /* ZP_CONTRACT_H */
