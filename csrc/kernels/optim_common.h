/* optim_common.h - what the CPU optimizer family (kernels/cpu/optim.c) and the CUDA family
 * (kernels/cuda/optim.cu) share beyond their tables and argument checks (contract.h): the
 * per-segment coefficients, as the float values torch would use, and the one function that
 * computes them from a group row.
 *
 * Both families compute these constants on the host, once per segment, in double and then
 * rounded to float, so this is host code only: C11 (optim.c, compiled by the C compiler) and
 * C++ (optim.cu's host side, compiled by nvcc). Both builds keep floating-point contraction off
 * (ISO C11; nvcc's -ffp-contract=off), so the two families get the same bits. Each family keeps
 * its own per-element math (optim.c's bodies, elementwise.cuh's zp_cu_update), which reads
 * these fields on the CPU and on the device. */
#ifndef ZP_OPTIM_COMMON_H
#define ZP_OPTIM_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/contract.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Per-segment constants. Each kind reads its own. */
typedef struct {
  int32_t kind, grad_dtype, param_dtype, flags;
  float scale;        /* grad_scale, negated for maximize */
  float decay;        /* AdamW, Lion: 1 - lr * weight_decay; Adam: 1 */
  float wd;           /* Adam, SGD, Adagrad: L2 term added to the gradient when use_l2 */
  int32_t use_l2;
  float lerp_w;       /* Adam*: 1 - beta1, and ATen's other branch w - 1 when w >= 0.5 */
  float lerp_wm1;
  int32_t lerp_small;
  float b1, omb1;     /* Lion: beta1, 1 - beta1; SGD: b1 = momentum */
  float b2, omb2;     /* Adam*, Lion: beta2, 1 - beta2; SGD: omb2 = 1 - dampening */
  float neg_step;     /* Adam*: -lr / bc1; SGD, Lion: -lr; Adagrad: -clr */
  float pos_lr;       /* Lion: lr */
  float bc2_sqrt;     /* Adam*: sqrt(1 - beta2^step) */
  float eps;
  int32_t amsgrad, momentum, first, nesterov;
  uint64_t seed;      /* stochastic rounding */
} zp_opt_coef;

/* The coefficients of a segment of group `g` at step count `step`; `g` passed zp_opt_check. */
static inline zp_opt_coef zp_opt_coef_make(const zp_opt_group *g, int64_t step) {
  zp_opt_coef c;
  memset(&c, 0, sizeof c);
  c.kind = g->kind, c.grad_dtype = g->grad_dtype, c.param_dtype = g->param_dtype;
  c.flags = g->flags, c.seed = g->seed;
  c.scale = (float)g->grad_scale;
  if (g->flags & ZP_OPT_MAXIMIZE)
    c.scale = -c.scale; /* -(g * s) == g * -s exactly */
  c.decay = 1.0f;
  c.wd = (float)g->weight_decay;
  c.use_l2 = g->kind != ZP_OPT_ADAMW && g->kind != ZP_OPT_LION && g->weight_decay != 0.0;
  c.eps = (float)g->eps;
  switch (g->kind) {
  case ZP_OPT_ADAMW:
  case ZP_OPT_ADAM: {
    double bc1 = 1.0 - pow(g->beta1, (double)step), bc2 = 1.0 - pow(g->beta2, (double)step);
    if (g->kind == ZP_OPT_ADAMW)
      c.decay = (float)(1.0 - g->lr * g->weight_decay);
    c.lerp_w = (float)(1.0 - g->beta1);
    c.lerp_wm1 = c.lerp_w - 1.0f;
    c.lerp_small = fabsf(c.lerp_w) < 0.5f;
    c.b2 = (float)g->beta2;
    c.omb2 = (float)(1.0 - g->beta2);
    c.neg_step = (float)(-(g->lr / bc1));
    c.bc2_sqrt = (float)sqrt(bc2);
    c.amsgrad = (g->flags & ZP_OPT_AMSGRAD) != 0;
    break;
  }
  case ZP_OPT_SGD:
    c.b1 = (float)g->beta1;
    c.omb2 = (float)(1.0 - g->beta2);
    c.neg_step = (float)(-g->lr);
    c.momentum = g->beta1 != 0.0;
    c.first = step == 1;
    c.nesterov = (g->flags & ZP_OPT_NESTEROV) != 0;
    break;
  case ZP_OPT_ADAGRAD:
    c.neg_step = (float)(-(g->lr / (1.0 + (double)(step - 1) * g->beta1)));
    break;
  default: /* ZP_OPT_LION */
    c.decay = (float)(1.0 - g->lr * g->weight_decay);
    c.b1 = (float)g->beta1, c.omb1 = (float)(1.0 - g->beta1);
    c.b2 = (float)g->beta2, c.omb2 = (float)(1.0 - g->beta2);
    c.neg_step = (float)(-g->lr), c.pos_lr = (float)g->lr;
    break;
  }
  return c;
}

#ifdef __cplusplus
}
#endif

#endif /* ZP_OPTIM_COMMON_H */
