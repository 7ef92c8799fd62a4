/* optim_body.h - the optimizer family's update bodies, private to it: what optim.c's job runner
 * calls on one range of one segment. The scalar bodies (optim.c) are the definition; the x86
 * SIMD bodies (optim_x86.c) reproduce them bit for bit.
 * defines: zp_opt_body, zp_opt_bf16_body, and the bodies of each ISA. */
#ifndef ZP_KERNELS_CPU_OPTIM_BODY_H
#define ZP_KERNELS_CPU_OPTIM_BODY_H

#include <stdint.h>

#include "kernels/optim_common.h"

/* One update of n elements: master p, fp32 gradient g (unscaled: c->scale applies), states
 * s0..s2 (the kind's; unused ones may be NULL). pf: software prefetch distance in elements (0:
 * none; negative: into L1, see optim_x86.c's ZP_PF); the scalar bodies ignore it. */
typedef void (*zp_opt_body)(const zp_opt_coef *c, float *restrict p, const float *restrict g,
                            float *restrict s0, float *restrict s1, float *restrict s2, int64_t n,
                            int64_t pf);

/* One update with a bf16 gradient g and a bf16 param_out `out` rounded to nearest even, widened
 * and narrowed in registers (the same bits as widening into a buffer, zp_opt_body, narrowing).
 * nt: streaming stores for out, which is then 16-byte aligned. */
typedef void (*zp_opt_bf16_body)(const zp_opt_coef *c, float *restrict p,
                                 const uint16_t *restrict g, float *restrict s0,
                                 float *restrict s1, float *restrict s2, uint16_t *restrict out,
                                 int64_t n, int64_t pf, int nt);

/* optim.c: the scalar bodies (AdamW and Adam share one); the SIMD bodies end on them. */
void zp_adam_scalar(const zp_opt_coef *c, float *restrict p, const float *restrict g,
                    float *restrict m, float *restrict v, float *restrict vmax, int64_t n,
                    int64_t pf);
void zp_sgd_scalar(const zp_opt_coef *c, float *restrict p, const float *restrict g,
                   float *restrict buf, float *restrict s1, float *restrict s2, int64_t n,
                   int64_t pf);
void zp_adagrad_scalar(const zp_opt_coef *c, float *restrict p, const float *restrict g,
                       float *restrict sum, float *restrict s1, float *restrict s2, int64_t n,
                       int64_t pf);
void zp_lion_scalar(const zp_opt_coef *c, float *restrict p, const float *restrict g,
                    float *restrict m, float *restrict s1, float *restrict s2, int64_t n,
                    int64_t pf);

#if defined(__x86_64__) || defined(__i386__)
/* optim_x86.c: AVX2 + FMA, and AVX-512F (call only where the CPU has them: tuning.h). */
#define ZP_OPT_X86_BODIES_OF(kind, isa)                                                          \
  void zp_##kind##_##isa(const zp_opt_coef *c, float *restrict p, const float *restrict g,     \
                         float *restrict s0, float *restrict s1, float *restrict s2, int64_t n, \
                         int64_t pf);                                                          \
  void zp_##kind##_bf16_##isa(const zp_opt_coef *c, float *restrict p,                         \
                              const uint16_t *restrict g, float *restrict s0,                  \
                              float *restrict s1, float *restrict s2, uint16_t *restrict out,  \
                              int64_t n, int64_t pf, int nt);
#define ZP_OPT_X86_BODIES(isa)                                                                   \
  ZP_OPT_X86_BODIES_OF(adam, isa)                                                              \
  ZP_OPT_X86_BODIES_OF(sgd, isa)                                                               \
  ZP_OPT_X86_BODIES_OF(adagrad, isa)                                                           \
  ZP_OPT_X86_BODIES_OF(lion, isa)
ZP_OPT_X86_BODIES(avx2)
ZP_OPT_X86_BODIES(avx512)
#undef ZP_OPT_X86_BODIES
#undef ZP_OPT_X86_BODIES_OF
#endif

#endif
