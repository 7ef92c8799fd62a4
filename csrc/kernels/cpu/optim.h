/* optim.h - the fused CPU optimizer family on flat fp32 master shards: AdamW, Adam, SGD,
 * Adagrad, Lion, in one pass per element with the parameter written back in its own dtype.
 *
 * One call updates any number of segments (contiguous runs sharing a param group and a step
 * count), multithreaded, with the SIMD body picked at run time (AVX-512, AVX2+FMA, scalar;
 * ZP_CPU_ISA caps it).
 *
 * Per element, in one pass:
 *   g = grad (bf16/fp16/fp32, widened to fp32) * grad_scale   [unscale, clip, 1/world fused]
 *   g = -g if maximize
 *   master (fp32) and state (fp32) updated with torch.optim.<kind>'s math, in its order
 *   param_out (bf16/fp16/fp32) = master rounded to nearest even (or stochastically, bf16)
 * Per kind (fma = one rounding, as torch's AVX2/AVX-512 kernels compute add(alpha=), addcmul
 * and lerp; sqrt is IEEE):
 *   Adam:    g = fma(wd, master, g) if wd != 0; then as AdamW without the decay
 *   AdamW:   master *= 1 - lr*wd; m = lerp(m, g, 1 - beta1) (ATen's two-branch fma);
 *            v = fma((1-beta2)*g, g, v*beta2); AMSGRAD: vmax = max(vmax, v), used for v below;
 *            master += ((-lr/bc1) * m) / (sqrt(v) / sqrt(bc2) + eps)   [torch's addcdiv; fp32
 *            results equal torch's fused AdamW bit for bit]
 *   SGD:     g = fma(wd, master, g) if wd; with momentum: buf = step == 1 ? g
 *            : fma(1-dampening, g, momentum*buf); g = NESTEROV ? fma(momentum, buf, g) : buf;
 *            master = fma(-lr, g, master)
 *   Adagrad: clr = lr / (1 + (step-1)*lr_decay); g = fma(wd, master, g) if wd;
 *            sum = fma(g, g, sum); master += (-clr*g) / (sqrt(sum) + eps)
 *   Lion:    c = fma(1-beta1, g, beta1*m); master = master*(1-lr*wd) - lr*sign(c)
 *            (sign(0) = 0); m = fma(1-beta2, g, beta2*m)
 * Every ISA and every thread count gives the same bits. On failure nothing is written.
 * The caller checks gradients for inf/nan before the call (zp_grad_stats_cpu): a step with a
 * non-finite gradient must not run. Note that Adam with eps = 0 turns an element whose
 * gradient and moments are all zero (padding, say) into NaN, as torch does. */
#ifndef ZP_OPTIM_H
#define ZP_OPTIM_H

#include <stdint.h>

#include "common/status.h"

typedef enum { ZP_F32 = 0, ZP_BF16 = 1, ZP_F16 = 2 } zp_dtype;

typedef enum {
  ZP_OPT_ADAMW = 0,   /* torch.optim.AdamW */
  ZP_OPT_ADAM = 1,    /* torch.optim.Adam (L2 weight decay added to the gradient) */
  ZP_OPT_SGD = 2,     /* torch.optim.SGD (momentum, dampening, nesterov, weight decay) */
  ZP_OPT_ADAGRAD = 3, /* torch.optim.Adagrad (lr_decay, weight decay, eps) */
  ZP_OPT_LION = 4     /* Lion (Chen et al. 2023): sign update, decoupled weight decay */
} zp_opt_kind;

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

/* Updates every segment. n_threads <= 0 picks the default (zp_default_threads()). Validates
 * first: lr, weight_decay >= 0 and finite; grad_scale finite; Adam*, Lion: betas in [0, 1);
 * Adam*, Adagrad: eps >= 0; SGD: momentum >= 0, NESTEROV needs momentum > 0 and dampening 0;
 * Adagrad: lr_decay >= 0; flags known and meaningful for the kind; the states the kind needs
 * are not NULL (Adam*: state0, state1, AMSGRAD: state2; SGD with momentum, Adagrad, Lion:
 * state0). */
zp_status zp_opt_step_cpu(const zp_opt_segment *segments, int32_t n_segments,
                          const zp_opt_group *groups, int32_t n_groups, int32_t n_threads);

/* The checks zp_opt_step_cpu runs before it touches memory (above), on their own: the CUDA
 * family (kernels/cuda/optim_cuda.h) validates its tables with the same function, so both
 * devices accept and reject the same arguments with the same messages. */
zp_status zp_opt_check(const zp_opt_segment *segments, int32_t n_segments,
                       const zp_opt_group *groups, int32_t n_groups);

/* Statistics of gradients for clipping and overflow checks, in one read-only pass:
 * *sum_pow = sum over all elements of |g|^norm_type (norm_type > 0, finite), or the max |g|
 * when norm_type is +inf; *nonfinite = 1 if any element is inf or nan, else 0. Segments use
 * zp_opt_segment's grad and numel only; every grad has dtype grad_dtype. Accumulates in
 * double (|g|^2 is exact; a general p uses pow()); the result does not depend on the thread
 * count or the ISA (fixed chunks, fixed summation order). With an inf in the data *sum_pow is
 * inf; with a nan it is nan (a max included). */
zp_status zp_grad_stats_cpu(const zp_opt_segment *segments, int32_t n_segments,
                            int32_t grad_dtype, double norm_type, int32_t n_threads,
                            double *sum_pow, int32_t *nonfinite);

/* The argument checks of zp_grad_stats_cpu (segments, grad_dtype, norm_type), shared with the
 * CUDA statistics so that both devices accept and refuse the same tables. */
zp_status zp_grad_stats_check(const zp_opt_segment *segments, int32_t n_segments,
                              int32_t grad_dtype, double norm_type);

#endif /* ZP_OPTIM_H */
