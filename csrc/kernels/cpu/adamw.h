/* adamw.h - fused AdamW step on flat fp32 shards in host memory (torch.optim.AdamW's math).
 *
 * One call updates any number of segments: contiguous runs of elements that share a param
 * group and a step count. Per element, in one pass over memory:
 *   g  = grad * grad_scale
 *   p  = p * (1 - lr * weight_decay)                    (decoupled weight decay)
 *   m  = lerp(m, g, 1 - beta1)
 *   v  = v * beta2 + (1 - beta2) * g * g
 *   p  = p - lr / (1 - beta1^step) * m / (sqrt(v) * (1 / sqrt(1 - beta2^step)) + eps)
 * which is torch.optim.AdamW (amsgrad=False, maximize=False) in the same order, but for the
 * reciprocal of the bias correction (about one ulp apart).
 * Moves 28 bytes per element (p, g, m, v read; p, m, v written). */
#ifndef ZP_ADAMW_H
#define ZP_ADAMW_H

#include <stdint.h>

#include "common/status.h"

typedef struct {
  float *param;            /* fp32 master (updated in place) */
  const float *grad;       /* fp32 gradient (read only) */
  float *exp_avg;          /* first moment (updated in place) */
  float *exp_avg_sq;       /* second moment (updated in place) */
  int64_t numel;           /* elements, >= 0 */
  int64_t step;            /* step count after this update, >= 1 */
  int32_t group;           /* index into the groups array */
} zp_adamw_segment;

typedef struct {
  double lr, beta1, beta2, eps, weight_decay;
  double grad_scale; /* multiplies the gradient first (1/world_size to average a sum) */
} zp_adamw_group;

/* Updates every segment. n_threads <= 0 picks the default (zp_default_threads()). Validates
 * hyperparameters as torch does (lr >= 0, 0 <= beta < 1, eps >= 0, weight_decay >= 0). */
zp_status zp_adamw_step_cpu(const zp_adamw_segment *segments, int32_t n_segments,
                            const zp_adamw_group *groups, int32_t n_groups, int32_t n_threads);

/* The instruction set the kernel dispatched to on this CPU: "avx512", "avx2" or "scalar". */
const char *zp_adamw_isa(void);

#endif /* ZP_ADAMW_H */
