/* test_grad_stats.c - zp_grad_stats_cpu (optim.h) against a long-double reference; the same bits
 * for every thread count and instruction set; inf/nan detection; errors. */
#define _POSIX_C_SOURCE 200112L /* setenv */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kernels/cpu/convert.h"
#include "kernels/cpu/optim.h"

/* Segments of varied sizes (odd starts in the global index, one that spans several chunks). */
static const int64_t stat_sizes[] = {1, 0, 17, 300001, 15, 65536, 33, 0, 1000, 131071, 7};
#define N_STAT_SEGS ((int32_t)(sizeof stat_sizes / sizeof stat_sizes[0]))

typedef struct {
  void *grad[N_STAT_SEGS];
  zp_opt_segment segs[N_STAT_SEGS];
} stat_data;

static void stat_free(stat_data *d) {
  for (int32_t s = 0; s < N_STAT_SEGS; s++)
    free(d->grad[s]);
}

static float stat_value(const stat_data *d, int32_t dtype, int32_t s, int64_t i) {
  if (dtype == ZP_F32)
    return ((const float *)d->grad[s])[i];
  uint16_t h = ((const uint16_t *)d->grad[s])[i];
  return dtype == ZP_BF16 ? zp_bf16_to_f32(h) : zp_f16_to_f32(h);
}

static void stat_set(stat_data *d, int32_t dtype, int32_t s, int64_t i, float v) {
  if (dtype == ZP_F32)
    ((float *)d->grad[s])[i] = v;
  else
    ((uint16_t *)d->grad[s])[i] = dtype == ZP_BF16 ? zp_f32_to_bf16(v) : zp_f32_to_f16(v);
}

static int stat_init(stat_data *d, int32_t dtype, zt_rng *r) {
  memset(d, 0, sizeof *d);
  size_t elem = dtype == ZP_F32 ? 4 : 2;
  for (int32_t s = 0; s < N_STAT_SEGS; s++) {
    d->grad[s] = malloc((size_t)(stat_sizes[s] > 0 ? stat_sizes[s] : 1) * elem);
    if (d->grad[s] == NULL)
      return 0;
    for (int64_t i = 0; i < stat_sizes[s]; i++)
      stat_set(d, dtype, s, i, (float)((zt_unit(r) - 0.5) * ldexp(1.0, (int)zt_range(r, -12, 8))));
    d->segs[s] = (zp_opt_segment){NULL, d->grad[s], NULL, NULL, NULL, NULL, stat_sizes[s], 1, 0};
  }
  return 1;
}

static long double stat_reference(const stat_data *d, int32_t dtype, double p) {
  long double acc = 0;
  for (int32_t s = 0; s < N_STAT_SEGS; s++)
    for (int64_t i = 0; i < stat_sizes[s]; i++) {
      long double a = fabsl((long double)stat_value(d, dtype, s, i));
      if (isinf(p))
        acc = a > acc ? a : acc;
      else
        acc += p == 2.0 ? a * a : p == 1.0 ? a : powl(a, (long double)p);
    }
  return acc;
}

void test_grad_stats_matches_reference(void) {
  static const double norms[] = {2.0, 1.0, 3.0, 0.5, INFINITY};
  static const char *isas[] = {"scalar", "avx2", "avx512"};
  zt_rng r = zt_rng_seed(77);
  for (int32_t dtype = ZP_F32; dtype <= ZP_F16; dtype++) {
    stat_data d;
    if (!CHECK(stat_init(&d, dtype, &r))) {
      stat_free(&d);
      return;
    }
    for (size_t k = 0; k < sizeof norms / sizeof norms[0]; k++) {
      const double p = norms[k];
      const long double want = stat_reference(&d, dtype, p);
      double first = 0.0;
      for (int isa = 0; isa < 3; isa++) {
        setenv("ZP_CPU_ISA", isas[isa], 1);
        for (int32_t threads = 1; threads <= 3; threads += 2) {
          double got = -1.0;
          int32_t bad = -1;
          if (!CHECK_OK(zp_grad_stats_cpu(d.segs, N_STAT_SEGS, dtype, p, threads, &got, &bad)))
            break;
          /* sum of positive terms in double: relative error <= n * 2^-53 ~ 1e-10 here */
          double rel = fabs((double)((long double)got - want)) / (double)want;
          CHECK_MSG(bad == 0 && rel <= (isinf(p) ? 0.0 : 1e-10),
                    "dtype %d p %g isa %s threads %d: %.17g vs %.17Lg (rel %.3g), nonfinite %d",
                    dtype, p, isas[isa], threads, got, want, rel, bad);
          if (isa == 0 && threads == 1)
            first = got;
          else
            CHECK_MSG(memcmp(&got, &first, sizeof got) == 0,
                      "dtype %d p %g: isa %s threads %d gives %.17g, scalar/1 thread %.17g",
                      dtype, p, isas[isa], threads, got, first);
        }
      }
      unsetenv("ZP_CPU_ISA");
    }
    stat_free(&d);
  }
}

void test_grad_stats_nonfinite(void) {
  zt_rng r = zt_rng_seed(78);
  static const char *isas[] = {"scalar", "avx2", "avx512"};
  for (int32_t dtype = ZP_F32; dtype <= ZP_F16; dtype++) {
    stat_data d;
    if (!CHECK(stat_init(&d, dtype, &r))) {
      stat_free(&d);
      return;
    }
    /* positions: a scalar prologue, a vector body, a tail, a later chunk */
    static const int32_t where_seg[] = {0, 3, 3, 4, 9, 10};
    static const int64_t where_idx[] = {0, 5, 123456, 14, 131070, 6};
    for (size_t w = 0; w < sizeof where_seg / sizeof where_seg[0]; w++) {
      for (int nan = 0; nan <= 1; nan++) {
        const int32_t s = where_seg[w];
        const int64_t i = where_idx[w];
        float saved = stat_value(&d, dtype, s, i);
        stat_set(&d, dtype, s, i, nan ? NAN : -INFINITY);
        for (int isa = 0; isa < 3; isa++) {
          setenv("ZP_CPU_ISA", isas[isa], 1);
          static const double norms[] = {2.0, 1.0, INFINITY, 3.0};
          for (size_t k = 0; k < (w == 0 ? 4u : 3u); k++) { /* pow is slow under ASan */
            double got = 0.0;
            int32_t bad = 0;
            CHECK_OK(zp_grad_stats_cpu(d.segs, N_STAT_SEGS, dtype, norms[k], 2, &got, &bad));
            CHECK_MSG(bad == 1 && (nan ? isnan(got) : isinf(got) && got > 0),
                      "dtype %d isa %s p %g: %s at segment %d index %lld gives %g, nonfinite %d",
                      dtype, isas[isa], norms[k], nan ? "nan" : "-inf", s, (long long)i, got, bad);
          }
        }
        unsetenv("ZP_CPU_ISA");
        stat_set(&d, dtype, s, i, saved);
      }
    }
    stat_free(&d);
  }
}

void test_grad_stats_empty_and_errors(void) {
  double got = -1.0;
  int32_t bad = -1;
  CHECK_OK(zp_grad_stats_cpu(NULL, 0, ZP_F32, 2.0, 1, &got, &bad));
  CHECK(got == 0.0 && bad == 0);
  float g[3] = {1, 2, 3};
  zp_opt_segment seg = {NULL, g, NULL, NULL, NULL, NULL, 3, 1, 0};
  CHECK_FAILS(zp_grad_stats_cpu(&seg, 1, ZP_F32, 0.0, 1, &got, &bad), ZP_ERR_INVALID);
  CHECK_FAILS(zp_grad_stats_cpu(&seg, 1, ZP_F32, -1.0, 1, &got, &bad), ZP_ERR_INVALID);
  CHECK_FAILS(zp_grad_stats_cpu(&seg, 1, ZP_F32, NAN, 1, &got, &bad), ZP_ERR_INVALID);
  CHECK_FAILS(zp_grad_stats_cpu(&seg, 1, 3, 2.0, 1, &got, &bad), ZP_ERR_INVALID);
  CHECK_FAILS(zp_grad_stats_cpu(&seg, 1, ZP_F32, 2.0, 1, NULL, &bad), ZP_ERR_INVALID);
  seg.numel = -1;
  CHECK_FAILS(zp_grad_stats_cpu(&seg, 1, ZP_F32, 2.0, 1, &got, &bad), ZP_ERR_INVALID);
  seg.numel = 3;
  seg.grad = NULL;
  CHECK_FAILS(zp_grad_stats_cpu(&seg, 1, ZP_F32, 2.0, 1, &got, &bad), ZP_ERR_INVALID);
}

/* The documented order, on data where another association gives other bits: with p = 1, lane 0
 * holds 2^52, lanes 8 and 12 hold 0.5. The tree adds (l0 + l8) + (l4 + l12): 2^52 + 0.5 is a
 * tie that rounds to 2^52, twice; pairing l8 with l12 first would give 2^52 + 1. */
void test_grad_stats_fixed_order(void) {
  static const char *isas[] = {"scalar", "avx2", "avx512"};
  float head[5] = {0}, body[64] = {0};
  for (int b = 0; b < 4; b++) { /* global index of body[i] is 5 + i: lane (5 + i) % 16 */
    body[16 * b + 11] = (float)ldexp(1.0, 50); /* lane 0 */
    body[16 * b + 3] = 0.125f;                   /* lane 8 */
    body[16 * b + 7] = 0.125f;                   /* lane 12 */
  }
  const zp_opt_segment segs[2] = {{NULL, head, NULL, NULL, NULL, NULL, 5, 1, 0},
                                  {NULL, body, NULL, NULL, NULL, NULL, 64, 1, 0}};
  for (int isa = 0; isa < 3; isa++) {
    setenv("ZP_CPU_ISA", isas[isa], 1);
    double got = 0.0;
    int32_t bad = 1;
    CHECK_OK(zp_grad_stats_cpu(segs, 2, ZP_F32, 1.0, 1, &got, &bad));
    CHECK_MSG(got == ldexp(1.0, 52) && bad == 0, "isa %s: %.17g, want 2^52 exactly", isas[isa],
              got);
  }
  unsetenv("ZP_CPU_ISA");
}
