/* fuzz_contract.c - libFuzzer harness of the optimizer tables' checks (kernels/contract.h).
 *
 * Any input becomes up to 4 group rows (kinds, dtypes and flags as any int32; coefficients
 * from edge values, NaN and infinities included) and up to 8 segment rows (numel and step
 * from edge values, any group index, addresses NULL or not). The checks read no memory behind
 * the addresses, so they may be fake. zp_opt_check and zp_grad_stats_check must fail with a
 * message, or accept only what contract.h promises the kernels: groups in range, numel >= 0,
 * step >= 1, and at most ZP_OPT_MAX_NUMEL elements in all (the kernels' offsets then fit). */
#include <math.h>

#include "fuzz_input.h"
#include "kernels/contract.h"

#define MAX_GROUPS 4
#define MAX_SEGMENTS 8

static double fuzz_double(fuzz_input *in) {
  static const double edges[] = {0.0, -0.0, 1.0, -1.0, 0.5, 0.9, 0.999, 1e-8, 2.0, 1e308,
                                 INFINITY, -INFINITY, NAN};
  const uint8_t sel = fuzz_u8(in);
  if (sel < 192)
    return edges[sel % (sizeof edges / sizeof edges[0])];
  const uint64_t raw = fuzz_raw(in, 8);
  double v;
  memcpy(&v, &raw, sizeof v);
  return v;
}

static void *fuzz_address(fuzz_input *in) {
  return fuzz_u8(in) % 4 == 0 ? NULL : (void *)(uintptr_t)0x1000; /* never dereferenced */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_input in = {data, size, 0};
  zp_opt_group groups[MAX_GROUPS];
  zp_opt_segment segs[MAX_SEGMENTS];
  const int32_t n_groups = fuzz_count(&in, 0, MAX_GROUPS);
  for (int32_t k = 0; k < n_groups; k++) {
    const uint8_t mode = fuzz_u8(&in);
    groups[k] = (zp_opt_group){
        mode & 1 ? fuzz_i32(&in) : fuzz_count(&in, 0, ZP_OPT_KINDS - 1),
        mode & 2 ? fuzz_i32(&in) : fuzz_count(&in, 0, 2),
        mode & 2 ? fuzz_i32(&in) : fuzz_count(&in, 0, 2),
        mode & 4 ? fuzz_i32(&in) : fuzz_count(&in, 0, ZP_OPT_ALL_FLAGS),
        fuzz_double(&in), fuzz_double(&in), fuzz_double(&in), fuzz_double(&in),
        fuzz_double(&in), fuzz_double(&in), fuzz_raw(&in, 8)};
  }
  const int32_t n_segments = fuzz_count(&in, 0, MAX_SEGMENTS);
  for (int32_t s = 0; s < n_segments; s++) {
    const uint8_t mode = fuzz_u8(&in);
    segs[s] = (zp_opt_segment){fuzz_address(&in), fuzz_address(&in), fuzz_address(&in),
                               fuzz_address(&in), fuzz_address(&in), fuzz_address(&in),
                               mode & 1 ? fuzz_i64(&in) : fuzz_count(&in, 0, 255),
                               mode & 2 ? fuzz_i64(&in) : fuzz_count(&in, 1, 255),
                               mode & 4 ? fuzz_i32(&in) : fuzz_count(&in, 0, MAX_GROUPS - 1)};
  }
  /* the table as Python hands it over, or with a count that does not match it */
  const int32_t claimed = fuzz_u8(&in) & 1 ? fuzz_i32(&in) : n_segments;
  const int32_t n = claimed <= n_segments ? claimed : n_segments; /* never past the arrays */

  zp_fail(ZP_OK, "%s", "");
  if (zp_opt_check(segs, n, groups, n_groups) == ZP_OK) {
    FUZZ_ASSERT(n >= 0);
    int64_t total = 0;
    for (int32_t s = 0; s < n; s++) {
      const zp_opt_segment *g = &segs[s];
      FUZZ_ASSERT(g->group >= 0 && g->group < n_groups && g->numel >= 0 && g->step >= 1);
      FUZZ_ASSERT(g->numel <= ZP_OPT_MAX_NUMEL - total);
      total += g->numel;
      const zp_opt_group *grp = &groups[g->group];
      FUZZ_ASSERT(grp->kind >= 0 && grp->kind < ZP_OPT_KINDS);
      FUZZ_ASSERT(isfinite(grp->lr) && grp->lr >= 0.0 && isfinite(grp->grad_scale));
      FUZZ_ASSERT(g->numel == 0 || (g->master != NULL && g->grad != NULL));
    }
  } else {
    FUZZ_ASSERT(zp_last_error()[0] != '\0');
  }

  zp_fail(ZP_OK, "%s", "");
  const double norm_type = fuzz_double(&in);
  const int32_t dtype = fuzz_u8(&in) & 1 ? fuzz_i32(&in) : fuzz_count(&in, 0, 2);
  if (zp_grad_stats_check(segs, n, dtype, norm_type) == ZP_OK) {
    FUZZ_ASSERT(n >= 0 && norm_type > 0.0 && dtype >= ZP_F32 && dtype <= ZP_F16);
    int64_t total = 0;
    for (int32_t s = 0; s < n; s++) {
      FUZZ_ASSERT(segs[s].numel >= 0 && segs[s].numel <= ZP_OPT_MAX_NUMEL - total);
      total += segs[s].numel;
      FUZZ_ASSERT(segs[s].numel == 0 || segs[s].grad != NULL);
    }
  } else {
    FUZZ_ASSERT(zp_last_error()[0] != '\0');
  }
  return 0;
}
