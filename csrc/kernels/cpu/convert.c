/* convert.c - bf16/fp16 <-> fp32 buffer conversions: scalar, AVX2+F16C, AVX-512F.
 *
 * bf16 is converted with integer shifts and adds (the same bits on every path); fp16 with the
 * F16C / AVX-512F conversion instructions, which the scalar functions in convert.h reproduce
 * bit for bit. No -march: SIMD bodies carry target attributes and run only after
 * __builtin_cpu_supports says the CPU has them (zp_isa_pick, tuning.c). */
#include "kernels/cpu/convert.h"
#include "kernels/cpu/convert_simd.h"

#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ZP_X86 1
#endif

const char *zp_isa_name(zp_isa isa) {
  return isa == ZP_ISA_AVX512 ? "avx512" : isa == ZP_ISA_AVX2 ? "avx2" : "scalar";
}

static uint64_t zp_mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

uint32_t zp_sr_key(uint64_t seed, uint64_t stream, uint64_t index_hi) {
  uint64_t k = zp_mix64(seed + 0x9E3779B97F4A7C15ull);
  k = zp_mix64(k ^ (stream * 0xD1B54A32D192ED03ull + 1));
  k = zp_mix64(k ^ (index_hi * 0x8CB92BA72F3D8DD7ull + 2));
  return (uint32_t)(k >> 32);
}

/* ---- scalar ---- */

static void zp_widen_bf16_scalar(const uint16_t *src, float *dst, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    dst[i] = zp_bf16_to_f32(src[i]);
}

static void zp_widen_f16_scalar(const uint16_t *src, float *dst, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    dst[i] = zp_f16_to_f32(src[i]);
}

static void zp_narrow_bf16_scalar(const float *src, uint16_t *dst, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    dst[i] = zp_f32_to_bf16(src[i]);
}

static void zp_narrow_f16_scalar(const float *src, uint16_t *dst, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    dst[i] = zp_f32_to_f16(src[i]);
}

static void zp_narrow_bf16_sr_scalar(const float *src, uint16_t *dst, int64_t n, uint32_t key,
                                     uint32_t index0) {
  for (int64_t i = 0; i < n; i++)
    dst[i] = zp_f32_to_bf16_sr(src[i], zp_sr_bits(key, index0 + (uint32_t)i));
}

static void zp_no_fence(void) {}

/* scalar: the streaming forms are the plain ones (no such store in C) */
static const zp_convert_ops zp_convert_scalar = {
    zp_widen_bf16_scalar,     zp_widen_f16_scalar,   zp_narrow_bf16_scalar,
    zp_narrow_f16_scalar,     zp_narrow_bf16_sr_scalar, zp_narrow_bf16_scalar,
    zp_narrow_f16_scalar,     zp_narrow_bf16_sr_scalar, zp_no_fence};

#ifdef ZP_X86
/* Widening reads a 16-bit stream that is not read anywhere else: prefetch it 2 KiB ahead, one
 * cache line (32 elements) at a time, as optim.c does for its streams. */
#define ZP_CV_PF(i)                                                                    \
  do {                                                                                 \
    if (((i) & 31) == 0)                                                               \
      _mm_prefetch((const char *)(src + (i) + 1024), _MM_HINT_T0);                     \
  } while (0)

/* Elements before dst + i is `align`-byte aligned (streaming stores need it), at most n. */
static int64_t zp_nt_head(const uint16_t *dst, int64_t n, uintptr_t align) {
  int64_t head = (int64_t)(((align - ((uintptr_t)dst & (align - 1))) & (align - 1)) / 2);
  return head < n ? head : n;
}

/* Orders this thread's streaming stores before whatever it does next (a join, a flag). */
static void zp_stream_fence(void) { _mm_sfence(); }

/* ---- AVX2 + F16C: 8 elements per vector ---- */
#define ZP_AVX2 __attribute__((target("avx2,fma,f16c")))

ZP_AVX2 static void zp_widen_bf16_avx2(const uint16_t *src, float *dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    ZP_CV_PF(i);
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  zp_widen_bf16_scalar(src + i, dst + i, n - i);
}

ZP_AVX2 static void zp_widen_f16_avx2(const uint16_t *src, float *dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    ZP_CV_PF(i);
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
  }
  zp_widen_f16_scalar(src + i, dst + i, n - i);
}

/* 8 narrowed elements to dst: a streaming store (nt, dst 16-byte aligned) or a plain one. */
ZP_AVX2 static inline void zp_store8_avx2(uint16_t *dst, __m128i v, int nt) {
  if (nt)
    _mm_stream_si128((__m128i *)dst, v);
  else
    _mm_storeu_si128((__m128i *)dst, v);
}

ZP_AVX2 static inline __attribute__((always_inline)) void
zp_narrow_bf16_avx2_t(const float *src, uint16_t *dst, int64_t n, int nt) {
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
  int64_t i = nt ? zp_nt_head(dst, n, 16) : 0;
  zp_narrow_bf16_scalar(src, dst, i);
  for (; i + 8 <= n; i += 8) {
    __m256i u = _mm256_castps_si256(_mm256_loadu_ps(src + i));
    __m256i r = _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), one));
    zp_store8_avx2(dst + i, zp_pack_u32_avx2(zp_bf16_round_avx2(u, r)), nt);
  }
  zp_narrow_bf16_scalar(src + i, dst + i, n - i);
}

ZP_AVX2 static inline __attribute__((always_inline)) void
zp_narrow_f16_avx2_t(const float *src, uint16_t *dst, int64_t n, int nt) {
  int64_t i = nt ? zp_nt_head(dst, n, 16) : 0;
  zp_narrow_f16_scalar(src, dst, i);
  for (; i + 8 <= n; i += 8)
    zp_store8_avx2(dst + i,
                   _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                   nt);
  zp_narrow_f16_scalar(src + i, dst + i, n - i);
}

/* zp_sr_bits on 8 lanes. */
ZP_AVX2 static inline __m256i zp_sr_bits_avx2(__m256i index, __m256i key) {
  __m256i x = _mm256_add_epi32(_mm256_mullo_epi32(index, _mm256_set1_epi32((int)0x9E3779B1u)), key);
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x85EBCA6Bu));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 13));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0xC2B2AE35u));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  return _mm256_srli_epi32(x, 16);
}

ZP_AVX2 static inline __attribute__((always_inline)) void
zp_narrow_bf16_sr_avx2_t(const float *src, uint16_t *dst, int64_t n, uint32_t key,
                         uint32_t index0, int nt) {
  int64_t i = nt ? zp_nt_head(dst, n, 16) : 0;
  zp_narrow_bf16_sr_scalar(src, dst, i, key, index0);
  const __m256i k = _mm256_set1_epi32((int)key), eight = _mm256_set1_epi32(8);
  __m256i index = _mm256_add_epi32(_mm256_set1_epi32((int)(index0 + (uint32_t)i)),
                                   _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (; i + 8 <= n; i += 8) {
    __m256i u = _mm256_castps_si256(_mm256_loadu_ps(src + i));
    __m256i r = zp_sr_bits_avx2(index, k);
    zp_store8_avx2(dst + i, zp_pack_u32_avx2(zp_bf16_round_avx2(u, r)), nt);
    index = _mm256_add_epi32(index, eight);
  }
  zp_narrow_bf16_sr_scalar(src + i, dst + i, n - i, key, index0 + (uint32_t)i);
}

ZP_AVX2 static void zp_narrow_bf16_avx2(const float *src, uint16_t *dst, int64_t n) {
  zp_narrow_bf16_avx2_t(src, dst, n, 0);
}
ZP_AVX2 static void zp_narrow_f16_avx2(const float *src, uint16_t *dst, int64_t n) {
  zp_narrow_f16_avx2_t(src, dst, n, 0);
}
ZP_AVX2 static void zp_narrow_bf16_sr_avx2(const float *src, uint16_t *dst, int64_t n,
                                           uint32_t key, uint32_t index0) {
  zp_narrow_bf16_sr_avx2_t(src, dst, n, key, index0, 0);
}
ZP_AVX2 static void zp_narrow_bf16_avx2_nt(const float *src, uint16_t *dst, int64_t n) {
  zp_narrow_bf16_avx2_t(src, dst, n, 1);
}
ZP_AVX2 static void zp_narrow_f16_avx2_nt(const float *src, uint16_t *dst, int64_t n) {
  zp_narrow_f16_avx2_t(src, dst, n, 1);
}
ZP_AVX2 static void zp_narrow_bf16_sr_avx2_nt(const float *src, uint16_t *dst, int64_t n,
                                              uint32_t key, uint32_t index0) {
  zp_narrow_bf16_sr_avx2_t(src, dst, n, key, index0, 1);
}

static const zp_convert_ops zp_convert_avx2 = {
    zp_widen_bf16_avx2,     zp_widen_f16_avx2,      zp_narrow_bf16_avx2,      zp_narrow_f16_avx2,
    zp_narrow_bf16_sr_avx2, zp_narrow_bf16_avx2_nt, zp_narrow_f16_avx2_nt, zp_narrow_bf16_sr_avx2_nt,
    zp_stream_fence};

/* ---- AVX-512F: 16 elements per vector ---- */
#define ZP_AVX512 __attribute__((target("avx512f")))

ZP_AVX512 static void zp_widen_bf16_avx512(const uint16_t *src, float *dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    ZP_CV_PF(i);
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
  zp_widen_bf16_scalar(src + i, dst + i, n - i);
}

ZP_AVX512 static void zp_widen_f16_avx512(const uint16_t *src, float *dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    ZP_CV_PF(i);
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
  }
  zp_widen_f16_scalar(src + i, dst + i, n - i);
}

/* 16 narrowed elements to dst: a streaming store (nt, dst 32-byte aligned) or a plain one. */
ZP_AVX512 static inline void zp_store16_avx512(uint16_t *dst, __m256i v, int nt) {
  if (nt)
    _mm256_stream_si256((__m256i *)dst, v);
  else
    _mm256_storeu_si256((__m256i *)dst, v);
}

ZP_AVX512 static inline __attribute__((always_inline)) void
zp_narrow_bf16_avx512_t(const float *src, uint16_t *dst, int64_t n, int nt) {
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  int64_t i = nt ? zp_nt_head(dst, n, 32) : 0;
  zp_narrow_bf16_scalar(src, dst, i);
  for (; i + 16 <= n; i += 16) {
    __m512i u = _mm512_castps_si512(_mm512_loadu_ps(src + i));
    __m512i r = _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
    zp_store16_avx512(dst + i, zp_bf16_round_avx512(u, r), nt);
  }
  zp_narrow_bf16_scalar(src + i, dst + i, n - i);
}

ZP_AVX512 static inline __attribute__((always_inline)) void
zp_narrow_f16_avx512_t(const float *src, uint16_t *dst, int64_t n, int nt) {
  int64_t i = nt ? zp_nt_head(dst, n, 32) : 0;
  zp_narrow_f16_scalar(src, dst, i);
  for (; i + 16 <= n; i += 16)
    zp_store16_avx512(dst + i,
                      _mm512_cvtps_ph(_mm512_loadu_ps(src + i),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                      nt);
  zp_narrow_f16_scalar(src + i, dst + i, n - i);
}

ZP_AVX512 static inline __m512i zp_sr_bits_avx512(__m512i index, __m512i key) {
  __m512i x = _mm512_add_epi32(_mm512_mullo_epi32(index, _mm512_set1_epi32((int)0x9E3779B1u)), key);
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x85EBCA6Bu));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 13));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0xC2B2AE35u));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  return _mm512_srli_epi32(x, 16);
}

ZP_AVX512 static inline __attribute__((always_inline)) void
zp_narrow_bf16_sr_avx512_t(const float *src, uint16_t *dst, int64_t n, uint32_t key,
                           uint32_t index0, int nt) {
  int64_t i = nt ? zp_nt_head(dst, n, 32) : 0;
  zp_narrow_bf16_sr_scalar(src, dst, i, key, index0);
  const __m512i k = _mm512_set1_epi32((int)key), sixteen = _mm512_set1_epi32(16);
  __m512i index = _mm512_add_epi32(
      _mm512_set1_epi32((int)(index0 + (uint32_t)i)),
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  for (; i + 16 <= n; i += 16) {
    __m512i u = _mm512_castps_si512(_mm512_loadu_ps(src + i));
    zp_store16_avx512(dst + i, zp_bf16_round_avx512(u, zp_sr_bits_avx512(index, k)), nt);
    index = _mm512_add_epi32(index, sixteen);
  }
  zp_narrow_bf16_sr_scalar(src + i, dst + i, n - i, key, index0 + (uint32_t)i);
}

ZP_AVX512 static void zp_narrow_bf16_avx512(const float *src, uint16_t *dst, int64_t n) {
  zp_narrow_bf16_avx512_t(src, dst, n, 0);
}
ZP_AVX512 static void zp_narrow_f16_avx512(const float *src, uint16_t *dst, int64_t n) {
  zp_narrow_f16_avx512_t(src, dst, n, 0);
}
ZP_AVX512 static void zp_narrow_bf16_sr_avx512(const float *src, uint16_t *dst, int64_t n,
                                               uint32_t key, uint32_t index0) {
  zp_narrow_bf16_sr_avx512_t(src, dst, n, key, index0, 0);
}
ZP_AVX512 static void zp_narrow_bf16_avx512_nt(const float *src, uint16_t *dst, int64_t n) {
  zp_narrow_bf16_avx512_t(src, dst, n, 1);
}
ZP_AVX512 static void zp_narrow_f16_avx512_nt(const float *src, uint16_t *dst, int64_t n) {
  zp_narrow_f16_avx512_t(src, dst, n, 1);
}
ZP_AVX512 static void zp_narrow_bf16_sr_avx512_nt(const float *src, uint16_t *dst, int64_t n,
                                                  uint32_t key, uint32_t index0) {
  zp_narrow_bf16_sr_avx512_t(src, dst, n, key, index0, 1);
}

static const zp_convert_ops zp_convert_avx512 = {
    zp_widen_bf16_avx512,        zp_widen_f16_avx512,     zp_narrow_bf16_avx512,
    zp_narrow_f16_avx512,        zp_narrow_bf16_sr_avx512, zp_narrow_bf16_avx512_nt,
    zp_narrow_f16_avx512_nt,     zp_narrow_bf16_sr_avx512_nt, zp_stream_fence};
#endif

const zp_convert_ops *zp_convert_ops_for(zp_isa isa) {
#ifdef ZP_X86
  if (isa == ZP_ISA_AVX512)
    return &zp_convert_avx512;
  if (isa == ZP_ISA_AVX2)
    return &zp_convert_avx2;
#else
  (void)isa;
#endif
  return &zp_convert_scalar;
}
