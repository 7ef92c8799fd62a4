/* contract.c - the argument checks of the optimizer tables (contract.h), shared by the CPU
 * and CUDA kernel families. Every message names the call (opt_step, grad_stats), the row and
 * what to change; nothing here reads a master, a gradient or a state. */
#include "kernels/contract.h"

#include <math.h>
#include <stddef.h>

static const char *const zp_kind_names[ZP_OPT_KINDS] = {"adamw", "adam", "sgd", "adagrad", "lion"};

/* Adds segment s's numel (>= 0) to *total, failing once the table passes ZP_OPT_MAX_NUMEL:
 * both bounds are below 2**62, so the sum cannot overflow. */
static zp_status zp_check_total(const char *fn, int64_t *total, int64_t numel, int32_t s) {
  if (numel > ZP_OPT_MAX_NUMEL - *total)
    return zp_fail(ZP_ERR_INVALID, "%s: segments 0..%d hold more than 2**56 elements together "
                   "(segment %d has numel %lld); the segments of one call must add up to at most "
                   "2**56", fn, s, s, (long long)numel);
  *total += numel;
  return ZP_OK;
}

/* Written so that NaN fails every check. */
static zp_status zp_opt_check_group(const zp_opt_group *g, int32_t k) {
  if (g->kind < 0 || g->kind >= ZP_OPT_KINDS)
    return zp_fail(ZP_ERR_INVALID, "opt_step: group %d: unknown kind %d (0 adamw, 1 adam, 2 sgd, "
                   "3 adagrad, 4 lion)", k, g->kind);
  const char *kind = zp_kind_names[g->kind];
  if (g->grad_dtype < ZP_F32 || g->grad_dtype > ZP_F16 || g->param_dtype < ZP_F32 ||
      g->param_dtype > ZP_F16)
    return zp_fail(ZP_ERR_INVALID, "opt_step: group %d (%s): unknown dtype (grad %d, param %d); "
                   "use 0 fp32, 1 bf16, 2 fp16", k, kind, g->grad_dtype, g->param_dtype);
  if (g->flags & ~ZP_OPT_ALL_FLAGS)
    return zp_fail(ZP_ERR_INVALID, "opt_step: group %d (%s): unknown flag bits 0x%x", k, kind,
                   (unsigned)(g->flags & ~ZP_OPT_ALL_FLAGS));
  if ((g->flags & ZP_OPT_AMSGRAD) && g->kind != ZP_OPT_ADAMW && g->kind != ZP_OPT_ADAM)
    return zp_fail(ZP_ERR_INVALID, "opt_step: group %d (%s): amsgrad is for adam/adamw only", k,
                   kind);
  if ((g->flags & ZP_OPT_NESTEROV) && g->kind != ZP_OPT_SGD)
    return zp_fail(ZP_ERR_INVALID, "opt_step: group %d (%s): nesterov is for sgd only", k, kind);
  if ((g->flags & ZP_OPT_STOCHASTIC_ROUNDING) && g->param_dtype != ZP_BF16)
    return zp_fail(ZP_ERR_INVALID, "opt_step: group %d (%s): stochastic rounding needs a bf16 "
                   "param_out (param_dtype %d)", k, kind, g->param_dtype);
  if (!(g->lr >= 0.0 && isfinite(g->lr)))
    return zp_fail(ZP_ERR_INVALID, "opt_step: group %d (%s): lr must be finite and >= 0, got %g",
                   k, kind, g->lr);
  if (!(g->weight_decay >= 0.0 && isfinite(g->weight_decay)))
    return zp_fail(ZP_ERR_INVALID, "opt_step: group %d (%s): weight_decay must be finite and "
                   ">= 0, got %g", k, kind, g->weight_decay);
  if (!isfinite(g->grad_scale))
    return zp_fail(ZP_ERR_INVALID, "opt_step: group %d (%s): grad_scale must be finite, got %g", k,
                   kind, g->grad_scale);
  if (g->kind == ZP_OPT_SGD) {
    if (!(g->beta1 >= 0.0 && isfinite(g->beta1)))
      return zp_fail(ZP_ERR_INVALID, "opt_step: group %d (sgd): momentum (beta1) must be finite "
                     "and >= 0, got %g", k, g->beta1);
    if (!isfinite(g->beta2))
      return zp_fail(ZP_ERR_INVALID, "opt_step: group %d (sgd): dampening (beta2) must be "
                     "finite, got %g", k, g->beta2);
    /* Any dampening: torch.optim.SGD refuses nesterov with dampening only in its constructor,
       and computes it for a param group that sets both (buf dampened, then g + momentum*buf) */
    if ((g->flags & ZP_OPT_NESTEROV) && !(g->beta1 > 0.0))
      return zp_fail(ZP_ERR_INVALID, "opt_step: group %d (sgd): nesterov needs momentum > 0 "
                     "(got %g)", k, g->beta1);
    return ZP_OK;
  }
  if (g->kind == ZP_OPT_ADAGRAD) {
    if (!(g->beta1 >= 0.0 && isfinite(g->beta1)))
      return zp_fail(ZP_ERR_INVALID, "opt_step: group %d (adagrad): lr_decay (beta1) must be "
                     "finite and >= 0, got %g", k, g->beta1);
  } else {
    if (!(g->beta1 >= 0.0 && g->beta1 < 1.0))
      return zp_fail(ZP_ERR_INVALID, "opt_step: group %d (%s): beta1 must be in [0, 1), got %g", k,
                     kind, g->beta1);
    if (!(g->beta2 >= 0.0 && g->beta2 < 1.0))
      return zp_fail(ZP_ERR_INVALID, "opt_step: group %d (%s): beta2 must be in [0, 1), got %g", k,
                     kind, g->beta2);
  }
  if (g->kind != ZP_OPT_LION && !(g->eps >= 0.0 && isfinite(g->eps)))
    return zp_fail(ZP_ERR_INVALID, "opt_step: group %d (%s): eps must be finite and >= 0, got %g",
                   k, kind, g->eps);
  return ZP_OK;
}

static zp_status zp_opt_check_segment(const zp_opt_segment *seg, int32_t s,
                                      const zp_opt_group *groups, int32_t n_groups) {
  if (seg->group < 0 || seg->group >= n_groups)
    return zp_fail(ZP_ERR_RANGE, "opt_step: segment %d names group %d, outside [0, %d)", s,
                   seg->group, n_groups);
  if (seg->numel < 0 || seg->step < 1)
    return zp_fail(ZP_ERR_INVALID, "opt_step: segment %d has numel %lld, step %lld; need >= 0, "
                   ">= 1", s, (long long)seg->numel, (long long)seg->step);
  if (seg->numel == 0)
    return ZP_OK;
  const zp_opt_group *g = &groups[seg->group];
  const char *kind = zp_kind_names[g->kind];
  if (seg->master == NULL || seg->grad == NULL)
    return zp_fail(ZP_ERR_INVALID, "opt_step: segment %d (%s) has a NULL %s", s, kind,
                   seg->master == NULL ? "master" : "grad");
  int adam = g->kind == ZP_OPT_ADAMW || g->kind == ZP_OPT_ADAM;
  int need0 = g->kind != ZP_OPT_SGD || g->beta1 != 0.0;
  if (need0 && seg->state0 == NULL)
    return zp_fail(ZP_ERR_INVALID, "opt_step: segment %d (%s) needs state0 (%s)", s, kind,
                   adam || g->kind == ZP_OPT_LION ? "exp_avg"
                   : g->kind == ZP_OPT_SGD        ? "momentum_buffer, as momentum != 0"
                                                  : "sum");
  if (adam && seg->state1 == NULL)
    return zp_fail(ZP_ERR_INVALID, "opt_step: segment %d (%s) needs state1 (exp_avg_sq)", s, kind);
  if (adam && (g->flags & ZP_OPT_AMSGRAD) && seg->state2 == NULL)
    return zp_fail(ZP_ERR_INVALID, "opt_step: segment %d (%s, amsgrad) needs state2 "
                   "(max_exp_avg_sq)", s, kind);
  if (g->param_dtype != ZP_F32 && seg->param_out == NULL)
    return zp_fail(ZP_ERR_INVALID, "opt_step: segment %d (%s) has param_dtype %d but no "
                   "param_out; pass one, or param_dtype 0 (fp32) when the master is the param",
                   s, kind, g->param_dtype);
  return ZP_OK;
}

zp_status zp_opt_check(const zp_opt_segment *segments, int32_t n_segments,
                       const zp_opt_group *groups, int32_t n_groups) {
  if (n_segments < 0 || n_groups < 0 || (n_segments > 0 && (segments == NULL || groups == NULL)))
    return zp_fail(ZP_ERR_INVALID, "opt_step: bad segment list (n_segments=%d, n_groups=%d)",
                   n_segments, n_groups);
  for (int32_t k = 0; k < n_groups; k++)
    ZP_TRY(zp_opt_check_group(&groups[k], k));
  int64_t total = 0;
  for (int32_t s = 0; s < n_segments; s++) {
    ZP_TRY(zp_opt_check_segment(&segments[s], s, groups, n_groups));
    ZP_TRY(zp_check_total("opt_step", &total, segments[s].numel, s));
  }
  return ZP_OK;
}

zp_status zp_grad_stats_check(const zp_opt_segment *segments, int32_t n_segments,
                              int32_t grad_dtype, double norm_type) {
  if (n_segments < 0 || (n_segments > 0 && segments == NULL))
    return zp_fail(ZP_ERR_INVALID, "grad_stats: bad segment list (n_segments=%d)", n_segments);
  if (grad_dtype < ZP_F32 || grad_dtype > ZP_F16)
    return zp_fail(ZP_ERR_INVALID, "grad_stats: unknown grad dtype %d (0 fp32, 1 bf16, 2 fp16)",
                   grad_dtype);
  if (!(norm_type > 0.0))
    return zp_fail(ZP_ERR_INVALID, "grad_stats: norm_type must be > 0 (or +inf), got %g",
                   norm_type);
  int64_t total = 0;
  for (int32_t s = 0; s < n_segments; s++) {
    if (segments[s].numel < 0)
      return zp_fail(ZP_ERR_INVALID, "grad_stats: segment %d has numel %lld; need >= 0", s,
                     (long long)segments[s].numel);
    ZP_TRY(zp_check_total("grad_stats", &total, segments[s].numel, s));
    if (segments[s].numel > 0 && segments[s].grad == NULL)
      return zp_fail(ZP_ERR_INVALID, "grad_stats: segment %d has a NULL grad", s);
  }
  return ZP_OK;
}
