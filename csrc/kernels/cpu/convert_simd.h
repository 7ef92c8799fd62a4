/* convert_simd.h - the bf16 packing and rounding steps of convert.c's SIMD bodies, shared with
 * optim.c's bodies that widen and narrow in registers (x86 only; each function carries its
 * target attribute and runs only where zp_isa_pick allows it). Same bits as convert.h's scalar
 * zp_f32_to_bf16 / zp_f32_to_bf16_sr: u + r, shifted down, a NaN made 0x7FC0. */
#ifndef ZP_CONVERT_SIMD_H
#define ZP_CONVERT_SIMD_H

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#ifndef ZP_AVX2
#define ZP_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif
#ifndef ZP_AVX512
#define ZP_AVX512 __attribute__((target("avx512f")))
#endif

/* 8 uint32 lanes holding values < 2^16 -> 8 uint16, in order. */
ZP_AVX2 static inline __m128i zp_pack_u32_avx2(__m256i x) {
  __m256i packed = _mm256_packus_epi32(x, x); /* lanes 0-3 | 0-3 | 4-7 | 4-7 (64-bit groups) */
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

/* bits + r with NaNs replaced by 0x7FC0 << 16, shifted down: the bf16 lanes as uint32. */
ZP_AVX2 static inline __m256i zp_bf16_round_avx2(__m256i u, __m256i r) {
  /* one compare of the value with itself, rather than |bits| > inf's mask and compare */
  const __m256 f = _mm256_castsi256_ps(u);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, r), 16);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}

/* The round-to-nearest-even r of zp_f32_to_bf16 for 8 lanes. */
ZP_AVX2 static inline __m256i zp_bf16_rne_bias_avx2(__m256i u) {
  return _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                          _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
}

ZP_AVX512 static inline __m256i zp_bf16_round_avx512(__m512i u, __m512i r) {
  __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                          _mm512_set1_epi32(0x7F800000));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, r), 16);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

/* The round-to-nearest-even r of zp_f32_to_bf16 for 16 lanes. */
ZP_AVX512 static inline __m512i zp_bf16_rne_bias_avx512(__m512i u) {
  return _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                          _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
}

#endif /* x86 */
#endif /* ZP_CONVERT_SIMD_H */
