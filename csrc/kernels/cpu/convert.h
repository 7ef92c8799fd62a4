/* convert.h - bf16/fp16 <-> fp32 conversions (scalar and per instruction set) and the ISA choice.
 *
 * Invariant: every instruction set gives the same bits as the scalar functions below, for every
 * input, NaNs included, so that kernels built on them do not depend on the CPU:
 *   - widening is exact; an fp16 NaN becomes a quiet fp32 NaN with its payload (as VCVTPH2PS);
 *   - fp32 -> bf16 rounds to nearest even, a NaN becomes 0x7FC0 (as torch's .to(bfloat16));
 *   - fp32 -> fp16 rounds to nearest even, overflows to inf, keeps subnormals, and a NaN keeps
 *     its sign and top payload bits, quiet (as VCVTPS2PH; torch's cast differs on NaN payloads);
 *   - fp32 -> bf16 stochastic: a 16-bit random value r is added to the fp32 bits before the
 *     low 16 bits are dropped, so x rounds up with probability (low 16 bits of x) / 2^16:
 *     unbiased. r comes from a counter-based hash of (key, element index), not from any state,
 *     so the result does not depend on how the work is split across threads. */
#ifndef ZP_CONVERT_H
#define ZP_CONVERT_H

#include <stdint.h>
#include <string.h>

/* Instruction sets of the CPU kernels of this family, lowest first. ZP_ISA_AVX2 needs AVX2, FMA
 * and F16C; ZP_ISA_AVX512 needs AVX-512F on top. */
typedef enum { ZP_ISA_SCALAR = 0, ZP_ISA_AVX2 = 1, ZP_ISA_AVX512 = 2 } zp_isa;

/* The instruction set the kernels use now (tuning.c): ZP_CPU_ISA ("avx512", "avx2", "scalar")
 * when set, else the vendor's default (tuning.h), in both cases capped by what the CPU runs.
 * Every level below the one returned runs too. */
zp_isa zp_isa_pick(void);
const char *zp_isa_name(zp_isa isa);

static inline uint32_t zp_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static inline float zp_bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline float zp_bf16_to_f32(uint16_t h) { return zp_bits_f32((uint32_t)h << 16); }

static inline uint16_t zp_f32_to_bf16(float f) {
  uint32_t u = zp_f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u)
    return 0x7FC0;
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* r: 16 random bits (see zp_sr_bits). */
static inline uint16_t zp_f32_to_bf16_sr(float f, uint32_t r) {
  uint32_t u = zp_f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u)
    return 0x7FC0;
  return (uint16_t)((u + r) >> 16);
}

static inline float zp_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (exp == 0x1F) /* inf, or NaN made quiet */
    return zp_bits_f32(sign | 0x7F800000u | (mant << 13) | (mant ? 0x400000u : 0u));
  if (exp != 0)
    return zp_bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0)
    return zp_bits_f32(sign);
  /* subnormal: mant * 2^-24, normalised */
  uint32_t e = 113;
  while (!(mant & 0x400u)) {
    mant <<= 1;
    e--;
  }
  return zp_bits_f32(sign | (e << 23) | ((mant & 0x3FFu) << 13));
}

static inline uint16_t zp_f32_to_f16(float f) {
  uint32_t u = zp_f32_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) /* NaN: quiet, top payload bits */
    return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) /* rounds to 65536 or more: inf (65520 is a tie that goes up) */
    return (uint16_t)(sign | 0x7C00u);
  if (a >= 0x38800000u) { /* normal fp16: rebias the exponent by 112, round at bit 13 */
    uint32_t r = a - 0x38000000u;
    return (uint16_t)(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
  }
  uint32_t e = a >> 23;
  if (e < 102) /* below half the smallest subnormal (2^-25): zero */
    return sign;
  /* subnormal fp16 in units of 2^-24: (mantissa with its implicit bit) >> (126 - e), RNE */
  uint32_t m = (a & 0x7FFFFFu) | 0x800000u, shift = 126 - e;
  uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u)))
    q++;
  return (uint16_t)(sign | q);
}

/* Stochastic rounding noise. zp_sr_key mixes the 64-bit inputs that are constant over a run
 * of elements (a seed, a stream such as the segment index, and bits 32-63 of the element
 * index); zp_sr_bits hashes (key, bits 0-31 of the element index) into 16 bits. For a fixed
 * key the hash is a bijection of the index, so neighbours never share a value. */
uint32_t zp_sr_key(uint64_t seed, uint64_t stream, uint64_t index_hi);

static inline uint32_t zp_sr_bits(uint32_t key, uint32_t index) {
  uint32_t x = index * 0x9E3779B1u + key;
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x >> 16;
}

/* Whole-buffer conversions for one instruction set. `index0` is the element index of src[0]
 * within the run the key belongs to (bits 0-31 only: a call must not cross a multiple of 2^32). */
typedef struct {
  void (*widen_bf16)(const uint16_t *src, float *dst, int64_t n);
  void (*widen_f16)(const uint16_t *src, float *dst, int64_t n);
  void (*narrow_bf16)(const float *src, uint16_t *dst, int64_t n);
  void (*narrow_f16)(const float *src, uint16_t *dst, int64_t n);
  void (*narrow_bf16_sr)(const float *src, uint16_t *dst, int64_t n, uint32_t key,
                         uint32_t index0);
  /* The same bits written with streaming (non-temporal) stores, which skip reading each
   * destination line before writing it: for outputs too large to stay in cache. The caller
   * runs fence() after its last streaming store and before it signals completion. */
  void (*narrow_bf16_nt)(const float *src, uint16_t *dst, int64_t n);
  void (*narrow_f16_nt)(const float *src, uint16_t *dst, int64_t n);
  void (*narrow_bf16_sr_nt)(const float *src, uint16_t *dst, int64_t n, uint32_t key,
                            uint32_t index0);
  void (*fence)(void);
} zp_convert_ops;

/* The conversions of `isa`, which the CPU must run (at most zp_isa_pick()). */
const zp_convert_ops *zp_convert_ops_for(zp_isa isa);

#endif /* ZP_CONVERT_H */
