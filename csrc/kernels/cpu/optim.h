/* optim.h - the fused CPU optimizer family on flat fp32 master shards: AdamW, Adam, SGD,
 * Adagrad, Lion, in one pass per element with the parameter written back in its own dtype.
 *
 * One call updates any number of segments (contiguous runs sharing a param group and a step
 * count), multithreaded, with the SIMD body, prefetch, split and stores picked at run time per
 * CPU vendor (tuning.h; ZP_CPU_ISA and the other ZP_CPU_* knobs force them).
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

#include "kernels/contract.h" /* zp_opt_segment, zp_opt_group, zp_opt_check */

/* Updates every segment. n_threads <= 0 picks the default (zp_default_threads()). Validates
 * first with zp_opt_check (contract.h): on a refused table nothing is written. */
zp_status zp_opt_step_cpu(const zp_opt_segment *segments, int32_t n_segments,
                          const zp_opt_group *groups, int32_t n_groups, int32_t n_threads);

/* Statistics of gradients for clipping and overflow checks, in one read-only pass:
 * *sum_pow = sum over all elements of |g|^norm_type (norm_type > 0, finite), or the max |g|
 * when norm_type is +inf; *nonfinite = 1 if any element is inf or nan, else 0. Segments use
 * zp_opt_segment's grad and numel only; every grad has dtype grad_dtype. Arguments are checked
 * first by zp_grad_stats_check (contract.h). Accumulates in double (|g|^2 is exact; a general
 * p uses pow()); the result does not depend on the thread count or the ISA (fixed chunks,
 * fixed summation order). With an inf in the data *sum_pow is inf; with a nan it is nan (a
 * max included). */
zp_status zp_grad_stats_cpu(const zp_opt_segment *segments, int32_t n_segments,
                            int32_t grad_dtype, double norm_type, int32_t n_threads,
                            double *sum_pow, int32_t *nonfinite);

#endif /* ZP_OPTIM_H */
