/* test_convert.c - bf16/fp16 conversions (convert.h): independent references, every ISA alike.
 *
 * The references here do not reuse convert.h's arithmetic: bf16 picks the nearer of the two
 * bf16 neighbours in double, fp16 binary-searches the ordered fp16 codes decoded with ldexp. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kernels/cpu/convert.h"

static float from_bits(uint32_t u) { return zp_bits_f32(u); }

/* Value of a finite fp16 magnitude code (0 .. 0x7BFF), or 65536 for 0x7C00 (where rounding to
 * inf starts: IEEE rounds to inf what would round to 2^16 with an unbounded exponent). */
static double f16_code_value(uint32_t c) {
  if (c >= 0x7C00)
    return 65536.0;
  uint32_t e = c >> 10, m = c & 0x3FF;
  return e == 0 ? ldexp((double)m, -24) : ldexp((double)(m | 0x400), (int)e - 25);
}

static uint16_t ref_f32_to_f16(float x) {
  uint16_t sign = signbit(x) ? 0x8000 : 0;
  double a = fabs((double)x);
  if (isnan(x))
    return 0; /* not used: NaNs are checked separately */
  if (a >= 65520.0)
    return sign | 0x7C00;
  uint32_t lo = 0, hi = 0x7C00; /* value(lo) <= a < value(hi) */
  while (hi - lo > 1) {
    uint32_t mid = (lo + hi) / 2;
    if (f16_code_value(mid) <= a)
      lo = mid;
    else
      hi = mid;
  }
  double dl = a - f16_code_value(lo), dh = f16_code_value(hi) - a;
  uint32_t c = dl < dh ? lo : dh < dl ? hi : (lo & 1 ? hi : lo);
  return (uint16_t)(sign | c);
}

static uint16_t ref_f32_to_bf16(float x) {
  uint32_t u = zp_f32_bits(x);
  uint32_t lo = u & 0xFFFF0000u, hi = lo + 0x10000u; /* same sign, magnitudes around |x| */
  double dl = fabs((double)x - (double)from_bits(lo));
  double dh = (hi & 0x7FFFFFFFu) == 0x7F800000u
                  ? fabs(ldexp(1.0, 128) - fabs((double)x)) /* rounds to inf past the top */
                  : fabs((double)from_bits(hi) - (double)x);
  uint32_t r = dl < dh ? lo : dh < dl ? hi : ((lo >> 16) & 1 ? hi : lo);
  return (uint16_t)(r >> 16);
}

/* Every level the CPU runs, lowest first. */
static int isa_levels(zp_isa *out) {
  int n = 0;
  for (int i = 0; i <= (int)zp_isa_pick(); i++)
    out[n++] = (zp_isa)i;
  return n;
}

void test_convert_isa(void) {
  zp_isa isa = zp_isa_pick();
  printf("  optim kernels isa: %s\n", zp_isa_name(isa));
  CHECK(isa >= ZP_ISA_SCALAR && isa <= ZP_ISA_AVX512);
}

void test_convert_f16_widen_exhaustive(void) {
  static uint16_t all[65536];
  static float out[65536];
  for (uint32_t h = 0; h < 65536; h++)
    all[h] = (uint16_t)h;
  zp_isa levels[3];
  int n_levels = isa_levels(levels);
  for (int l = 0; l < n_levels; l++) {
    zp_convert_ops_for(levels[l])->widen_f16(all, out, 65536);
    for (uint32_t h = 0; h < 65536; h++) {
      uint32_t e = (h >> 10) & 0x1F, m = h & 0x3FF;
      float got = out[h];
      int ok;
      if (e == 0x1F && m != 0) /* quiet NaN, same sign, payload on top */
        ok = zp_f32_bits(got) == (((h & 0x8000u) << 16) | 0x7FC00000u | (m << 13));
      else
        ok = (double)got == (h & 0x8000 ? -1 : 1) * (e == 0x1F ? INFINITY : f16_code_value(h & 0x7FFF)) &&
             !!signbit(got) == ((h & 0x8000) != 0);
      if (!CHECK_MSG(ok && zp_f32_bits(got) == zp_f32_bits(zp_f16_to_f32((uint16_t)h)),
                     "%s: fp16 0x%04x -> %a (0x%08x)", zp_isa_name(levels[l]), h, (double)got,
                     zp_f32_bits(got)))
        return;
    }
  }
  /* bf16 widening is a shift: spot-check the same codes */
  zp_convert_ops_for(zp_isa_pick())->widen_bf16(all, out, 65536);
  for (uint32_t h = 0; h < 65536; h++)
    if (!CHECK_MSG(zp_f32_bits(out[h]) == h << 16, "bf16 0x%04x", h))
      return;
}

/* fp32 bit patterns that exercise rounding: ties, neighbours of ties, range edges, specials,
 * and random patterns over every exponent. */
static int32_t narrow_inputs(float *x, int32_t cap, zt_rng *r) {
  int32_t n = 0;
  static const uint32_t fixed[] = {
      0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001,
      0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F7F8000, 0x7F7F7FFF, /* bf16 ties */
      0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000, 0xC77FF000, /* fp16 top */
      0x38800000, 0x387FE000, 0x387FF000, 0x33000000, 0x33000001, 0x33800000, 0x32FFFFFF,
      0x33C00000, 0x34200000, 0x3F801000, 0x3F803000, 0x3F802000, /* fp16 subnormals, ties */
  };
  for (size_t i = 0; i < sizeof fixed / sizeof fixed[0] && n < cap; i++)
    x[n++] = from_bits(fixed[i]);
  while (n < cap) {
    uint32_t u = (uint32_t)zt_next(r);
    switch (zt_range(r, 0, 3)) {
    case 0: /* a tie or near-tie for bf16 */
      u = (u & 0xFFFF0000u) | 0x8000u | (uint32_t)zt_range(r, 0, 1) * (uint32_t)zt_range(r, 0, 1);
      break;
    case 1: /* fp16 range, tie-ish low bits */
      u = (u & 0x80000000u) | ((uint32_t)zt_range(r, 100, 143) << 23) | (u & 0x7FE000u) |
          (zt_range(r, 0, 1) ? 0x1000u : (u & 0x1FFFu));
      break;
    default:
      break;
    }
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
      u = 0x3F800000u; /* NaNs are checked on their own below */
    x[n++] = from_bits(u);
  }
  return n;
}

void test_convert_narrow_rne(void) {
  enum { N = 200003 };
  float *x = malloc(N * sizeof *x);
  uint16_t *out = malloc(N * sizeof *out);
  if (!CHECK(x && out)) {
    free(x), free(out);
    return;
  }
  zt_rng r = zt_rng_seed(11);
  int32_t n = narrow_inputs(x, N, &r);
  zp_isa levels[3];
  int n_levels = isa_levels(levels);
  for (int l = 0; l < n_levels; l++) {
    const zp_convert_ops *ops = zp_convert_ops_for(levels[l]);
    ops->narrow_bf16(x, out, n);
    for (int32_t i = 0; i < n; i++)
      if (!CHECK_MSG(out[i] == ref_f32_to_bf16(x[i]) && out[i] == zp_f32_to_bf16(x[i]),
                     "%s: bf16(%a = 0x%08x) = 0x%04x, want 0x%04x", zp_isa_name(levels[l]),
                     (double)x[i], zp_f32_bits(x[i]), out[i], ref_f32_to_bf16(x[i])))
        break;
    ops->narrow_f16(x, out, n);
    for (int32_t i = 0; i < n; i++)
      if (!CHECK_MSG(out[i] == ref_f32_to_f16(x[i]) && out[i] == zp_f32_to_f16(x[i]),
                     "%s: fp16(%a = 0x%08x) = 0x%04x, want 0x%04x", zp_isa_name(levels[l]),
                     (double)x[i], zp_f32_bits(x[i]), out[i], ref_f32_to_f16(x[i])))
        break;
  }
  free(x), free(out);
}

void test_convert_nan(void) {
  static const uint32_t nans[] = {0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FA0F000,
                                  0x7FFFFFFF, 0xFFFFFFFF, 0x7F80FFFF, 0x7FC0FFFF, 0xFF812345,
                                  0x7FC00000, 0x7FC00000, 0x7FC00000, 0x7FC00000, 0x7FC00000,
                                  0x7FC00000, 0x7FC00000};
  enum { N = sizeof nans / sizeof nans[0] };
  float x[N];
  uint16_t out[N];
  for (int i = 0; i < N; i++)
    x[i] = from_bits(nans[i]);
  zp_isa levels[3];
  int n_levels = isa_levels(levels);
  for (int l = 0; l < n_levels; l++) {
    const zp_convert_ops *ops = zp_convert_ops_for(levels[l]);
    ops->narrow_bf16(x, out, N);
    for (int i = 0; i < N; i++)
      CHECK_MSG(out[i] == 0x7FC0, "%s: bf16 of NaN 0x%08x = 0x%04x", zp_isa_name(levels[l]),
                nans[i], out[i]);
    ops->narrow_bf16_sr(x, out, N, 0x12345678u, 0xFFFFFFF0u);
    for (int i = 0; i < N; i++)
      CHECK_MSG(out[i] == 0x7FC0, "%s: stochastic bf16 of NaN 0x%08x = 0x%04x",
                zp_isa_name(levels[l]), nans[i], out[i]);
    ops->narrow_f16(x, out, N);
    for (int i = 0; i < N; i++) {
      uint16_t want = (uint16_t)(((nans[i] >> 16) & 0x8000u) | 0x7E00u | ((nans[i] >> 13) & 0x3FFu));
      CHECK_MSG(out[i] == want, "%s: fp16 of NaN 0x%08x = 0x%04x, want 0x%04x",
                zp_isa_name(levels[l]), nans[i], out[i], want);
    }
  }
}

/* Stochastic rounding: always one of the two neighbours; unbiased on average; the same bits on
 * every ISA for any split of the index range. */
void test_convert_stochastic_rounding(void) {
  enum { N = 1 << 20 };
  float *x = malloc(N * sizeof *x);
  uint16_t *a = malloc(N * sizeof *a), *b = malloc(N * sizeof *b);
  if (!CHECK(x && a && b)) {
    free(x), free(a), free(b);
    return;
  }
  static const double fracs[] = {0.0, 0.3, 0.5, 0.9, 1.0 / 65536.0, 0.999};
  const uint32_t key = zp_sr_key(42, 3, 0);
  for (size_t f = 0; f < sizeof fracs / sizeof fracs[0]; f++) {
    const double ulp = ldexp(1.0, -7), base = -1.5; /* bf16 ulp in [1, 2) */
    const double value = base - fracs[f] * ulp;
    for (int32_t i = 0; i < N; i++)
      x[i] = (float)value;
    zp_convert_ops_for(zp_isa_pick())->narrow_bf16_sr(x, a, N, key, 0);
    double sum = 0.0;
    int neighbours = 1;
    for (int32_t i = 0; i < N; i++) {
      double v = (double)zp_bf16_to_f32(a[i]);
      neighbours &= v == base || v == base - ulp;
      sum += v;
    }
    double mean = sum / N, p = fracs[f];
    double sigma = ulp * sqrt(p * (1 - p) / N) + 1e-12;
    /* the fp32 value itself is exact here; the 16-bit noise quantises p to 1/65536 */
    CHECK_MSG(neighbours, "frac %g: a result that is not a neighbour", p);
    CHECK_MSG(fabs(mean - (double)(float)value) <= 6 * sigma + ulp / 65536.0,
              "frac %g: mean %.12g, value %.12g, sigma %.3g", p, mean, (double)(float)value, sigma);
  }
  /* random values: ISA and split independence */
  zt_rng r = zt_rng_seed(99);
  for (int32_t i = 0; i < N; i++)
    x[i] = (float)((zt_unit(&r) - 0.5) * ldexp(1.0, (int)zt_range(&r, -30, 30)));
  zp_convert_ops_for(ZP_ISA_SCALAR)->narrow_bf16_sr(x, a, N, key, 1000);
  zp_isa levels[3];
  int n_levels = isa_levels(levels);
  for (int l = 0; l < n_levels; l++) {
    const zp_convert_ops *ops = zp_convert_ops_for(levels[l]);
    int32_t at = 0;
    while (at < N) { /* uneven pieces: tails and odd starts */
      int32_t len = (int32_t)zt_range(&r, 0, 3000);
      len = len < N - at ? len : N - at;
      ops->narrow_bf16_sr(x + at, b + at, len, key, 1000u + (uint32_t)at);
      at += len;
    }
    if (!CHECK_MSG(memcmp(a, b, N * sizeof *a) == 0, "%s: stochastic rounding differs from scalar",
                   zp_isa_name(levels[l])))
      break;
  }
  /* the noise depends on the key: another seed changes most of the inexact results */
  zp_convert_ops_for(ZP_ISA_SCALAR)->narrow_bf16_sr(x, b, N, zp_sr_key(43, 3, 0), 1000);
  int32_t differ = 0;
  for (int32_t i = 0; i < N; i++)
    differ += a[i] != b[i];
  CHECK_MSG(differ > N / 8, "another seed changed only %d of %d results", differ, (int)N);
  free(x), free(a), free(b);
}
