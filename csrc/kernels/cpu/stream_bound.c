/* stream_bound.c - zp_stream_bound_cpu (stream_bound.h): the optimizer family's streams with no
 * math, as its fair bound.
 *
 * Fair means: the same split of the elements across threads, instruction set and prefetch
 * distance (zp_cpu_tuning_pick, as zp_opt_step_cpu), streams walked side by side 16 elements
 * at a time as the bodies walk them, and every byte really moved. The values read
 * are folded into the stored values through a mask that is zero at run time, so the compiler
 * can drop neither a load nor a store, and the updates leave the data as it was. */
#include "kernels/cpu/stream_bound.h"

#include <string.h>

#include "common/parallel.h"
#include "kernels/cpu/tuning.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ZP_X86 1
#endif

typedef struct {
  zp_stream s[ZP_STREAM_MAX];
  int32_t n;
  int64_t pf_bytes; /* negative: into L1 */
  int nt;           /* streaming stores for the write streams */
  uint32_t mask; /* 0, from the caller's side of the compiler's view */
  zp_isa isa;
} zp_bound_job;

static void zp_bound_scalar(const zp_bound_job *job, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; i++) {
    uint32_t acc = 0;
    for (int32_t k = 0; k < job->n; k++) {
      const zp_stream *st = &job->s[k];
      if (st->access != ZP_STREAM_READ)
        continue;
      acc |= st->elem_bytes == 4 ? ((const uint32_t *)st->data)[i]
                                 : ((const uint16_t *)st->data)[i];
    }
    acc &= job->mask;
    for (int32_t k = 0; k < job->n; k++) {
      const zp_stream *st = &job->s[k];
      if (st->access == ZP_STREAM_READ)
        continue;
      int keep = st->access == ZP_STREAM_UPDATE;
      if (st->elem_bytes == 4) {
        uint32_t *d = (uint32_t *)st->data + i;
        *d = (keep ? *d : 0u) ^ acc;
      } else {
        uint16_t *d = (uint16_t *)st->data + i;
        *d = (uint16_t)((keep ? *d : 0u) ^ acc);
      }
    }
  }
}

#ifdef ZP_X86
/* The SIMD bodies take the streams sorted by kind (zp_bound_sort) so that the loop over
 * 16-element blocks holds no branch on a stream's kind: at 2 to 5 streams per block those
 * branches would cost more than the bodies' own loop. fp32 streams move 64 bytes per block,
 * 16-bit ones 32; every line that is loaded is prefetched pf bytes ahead into L2, as the
 * bodies do. */
typedef struct {
  const char *r4[ZP_STREAM_MAX], *r2[ZP_STREAM_MAX];
  char *u4[ZP_STREAM_MAX], *u2[ZP_STREAM_MAX], *w4[ZP_STREAM_MAX], *w2[ZP_STREAM_MAX];
  int32_t nr4, nr2, nu4, nu2, nw4, nw2;
} zp_bound_sorted;

static void zp_bound_sort(const zp_bound_job *job, zp_bound_sorted *o) {
  memset(o, 0, sizeof *o);
  for (int32_t k = 0; k < job->n; k++) {
    const zp_stream *st = &job->s[k];
    int wide = st->elem_bytes == 4;
    if (st->access == ZP_STREAM_READ)
      (wide ? o->r4 : o->r2)[wide ? o->nr4++ : o->nr2++] = st->data;
    else if (st->access == ZP_STREAM_UPDATE)
      (wide ? o->u4 : o->u2)[wide ? o->nu4++ : o->nu2++] = st->data;
    else
      (wide ? o->w4 : o->w2)[wide ? o->nw4++ : o->nw2++] = st->data;
  }
}

/* pf > 0: into L2; pf < 0: into L1 (ZP_CPU_PREFETCH=<bytes>:l1), as the bodies */
#define ZP_BPF(ptr)                                  \
  do {                                               \
    if (pf > 0)                                      \
      _mm_prefetch((ptr) + pf, _MM_HINT_T1);         \
    else                                             \
      _mm_prefetch((ptr) - pf, _MM_HINT_T0);         \
  } while (0)

/* Write streams take streaming stores where the kernels' outputs do (nt: zp_cpu_tuning's
 * stream_min_bytes, every write stream 64-byte aligned). */
#define ZP_BOUND_STORE256(at, v)                  \
  do {                                            \
    if (nt)                                       \
      _mm256_stream_si256((__m256i *)(at), (v));  \
    else                                          \
      _mm256_storeu_si256((__m256i *)(at), (v));  \
  } while (0)

/* One body per ISA, inlined into each caller with the stream counts as constants, so that the
 * common shapes (below) run with their loops over streams unrolled, as the optimizer bodies
 * run theirs; other shapes take the same body with counts read at run time. */
#define ZP_BOUND_ARGS                                                                          \
  const zp_bound_sorted *o, int64_t lo, int64_t hi, int64_t pf, uint32_t mask32, int nt,     \
      int32_t nr4, int32_t nr2, int32_t nu4, int32_t nu2, int32_t nw4, int32_t nw2

__attribute__((target("avx2"), always_inline)) static inline int64_t
zp_bound_avx2_body(ZP_BOUND_ARGS) {
  const __m256i mask = _mm256_set1_epi32((int)mask32), zero = _mm256_setzero_si256();
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) {
    const int64_t b4 = i * 4, b2 = i * 2;
    const int line2 = pf != 0 && (i & 31) == 0;
    __m256i acc = zero;
    for (int32_t k = 0; k < nr4; k++) {
      if (pf != 0)
        ZP_BPF(o->r4[k] + b4);
      acc = _mm256_or_si256(acc, _mm256_loadu_si256((const __m256i *)(o->r4[k] + b4)));
      acc = _mm256_or_si256(acc, _mm256_loadu_si256((const __m256i *)(o->r4[k] + b4 + 32)));
    }
    for (int32_t k = 0; k < nr2; k++) {
      if (line2)
        ZP_BPF(o->r2[k] + b2);
      acc = _mm256_or_si256(acc, _mm256_loadu_si256((const __m256i *)(o->r2[k] + b2)));
    }
    acc = _mm256_and_si256(acc, mask);
    for (int32_t k = 0; k < nu4; k++) {
      __m256i *d = (__m256i *)(o->u4[k] + b4);
      if (pf != 0)
        ZP_BPF(o->u4[k] + b4);
      _mm256_storeu_si256(d, _mm256_xor_si256(_mm256_loadu_si256(d), acc));
      _mm256_storeu_si256(d + 1, _mm256_xor_si256(_mm256_loadu_si256(d + 1), acc));
    }
    for (int32_t k = 0; k < nu2; k++) {
      __m256i *d = (__m256i *)(o->u2[k] + b2);
      if (line2)
        ZP_BPF(o->u2[k] + b2);
      _mm256_storeu_si256(d, _mm256_xor_si256(_mm256_loadu_si256(d), acc));
    }
    for (int32_t k = 0; k < nw4; k++) {
      ZP_BOUND_STORE256(o->w4[k] + b4, acc);
      ZP_BOUND_STORE256(o->w4[k] + b4 + 32, acc);
    }
    for (int32_t k = 0; k < nw2; k++)
      ZP_BOUND_STORE256(o->w2[k] + b2, acc);
  }
  return i;
}

__attribute__((target("avx512f"), always_inline)) static inline int64_t
zp_bound_avx512_body(ZP_BOUND_ARGS) {
  const __m512i mask = _mm512_set1_epi32((int)mask32);
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) {
    const int64_t b4 = i * 4, b2 = i * 2;
    const int line2 = pf != 0 && (i & 31) == 0;
    __m512i acc = _mm512_setzero_si512();
    for (int32_t k = 0; k < nr4; k++) {
      if (pf != 0)
        ZP_BPF(o->r4[k] + b4);
      acc = _mm512_or_si512(acc, _mm512_loadu_si512(o->r4[k] + b4));
    }
    for (int32_t k = 0; k < nr2; k++) {
      if (line2)
        ZP_BPF(o->r2[k] + b2);
      acc = _mm512_or_si512(
          acc, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(o->r2[k] + b2))));
    }
    acc = _mm512_and_si512(acc, mask);
    const __m256i acc2 = _mm512_castsi512_si256(acc);
    for (int32_t k = 0; k < nu4; k++) {
      char *d = o->u4[k] + b4;
      if (pf != 0)
        ZP_BPF(d);
      _mm512_storeu_si512(d, _mm512_xor_si512(_mm512_loadu_si512(d), acc));
    }
    for (int32_t k = 0; k < nu2; k++) {
      __m256i *d = (__m256i *)(o->u2[k] + b2);
      if (line2)
        ZP_BPF(o->u2[k] + b2);
      _mm256_storeu_si256(d, _mm256_xor_si256(_mm256_loadu_si256(d), acc2));
    }
    for (int32_t k = 0; k < nw4; k++) {
      if (nt)
        _mm512_stream_si512((void *)(o->w4[k] + b4), acc);
      else
        _mm512_storeu_si512(o->w4[k] + b4, acc);
    }
    for (int32_t k = 0; k < nw2; k++)
      ZP_BOUND_STORE256(o->w2[k] + b2, acc2);
  }
  return i;
}

/* The shapes of the optimizer family: one gradient (fp32 or 16-bit), the master and 0 to 3
 * states updated, and at most one 16-bit parameter written. */
#define ZP_BOUND_SHAPE(isa, tgt, body, r4, r2, u4, w2)                                      \
  __attribute__((target(tgt))) static int64_t zp_bound_##isa##_##r4##r2##u4##w2(              \
      const zp_bound_sorted *o, int64_t lo, int64_t hi, int64_t pf, uint32_t mask, int nt) {  \
    return body(o, lo, hi, pf, mask, nt, r4, r2, u4, 0, 0, w2);                               \
  }
#define ZP_BOUND_SHAPES(isa, t, b)                                                            \
  ZP_BOUND_SHAPE(isa, t, b, 1, 0, 1, 0) ZP_BOUND_SHAPE(isa, t, b, 1, 0, 2, 0)                \
  ZP_BOUND_SHAPE(isa, t, b, 1, 0, 3, 0) ZP_BOUND_SHAPE(isa, t, b, 1, 0, 4, 0)                \
  ZP_BOUND_SHAPE(isa, t, b, 1, 0, 1, 1) ZP_BOUND_SHAPE(isa, t, b, 1, 0, 2, 1)                \
  ZP_BOUND_SHAPE(isa, t, b, 1, 0, 3, 1) ZP_BOUND_SHAPE(isa, t, b, 1, 0, 4, 1)                \
  ZP_BOUND_SHAPE(isa, t, b, 0, 1, 1, 0) ZP_BOUND_SHAPE(isa, t, b, 0, 1, 2, 0)                \
  ZP_BOUND_SHAPE(isa, t, b, 0, 1, 3, 0) ZP_BOUND_SHAPE(isa, t, b, 0, 1, 4, 0)                \
  ZP_BOUND_SHAPE(isa, t, b, 0, 1, 1, 1) ZP_BOUND_SHAPE(isa, t, b, 0, 1, 2, 1)                \
  ZP_BOUND_SHAPE(isa, t, b, 0, 1, 3, 1) ZP_BOUND_SHAPE(isa, t, b, 0, 1, 4, 1)
ZP_BOUND_SHAPES(1, "avx2", zp_bound_avx2_body)
ZP_BOUND_SHAPES(2, "avx512f", zp_bound_avx512_body)

typedef int64_t (*zp_bound_shape_fn)(const zp_bound_sorted *, int64_t, int64_t, int64_t,
                                     uint32_t, int);
/* [isa - 1][r2][u4 - 1][w2] */
static const zp_bound_shape_fn zp_bound_shapes[2][2][4][2] = {
    {{{zp_bound_1_1010, zp_bound_1_1011}, {zp_bound_1_1020, zp_bound_1_1021},
      {zp_bound_1_1030, zp_bound_1_1031}, {zp_bound_1_1040, zp_bound_1_1041}},
     {{zp_bound_1_0110, zp_bound_1_0111}, {zp_bound_1_0120, zp_bound_1_0121},
      {zp_bound_1_0130, zp_bound_1_0131}, {zp_bound_1_0140, zp_bound_1_0141}}},
    {{{zp_bound_2_1010, zp_bound_2_1011}, {zp_bound_2_1020, zp_bound_2_1021},
      {zp_bound_2_1030, zp_bound_2_1031}, {zp_bound_2_1040, zp_bound_2_1041}},
     {{zp_bound_2_0110, zp_bound_2_0111}, {zp_bound_2_0120, zp_bound_2_0121},
      {zp_bound_2_0130, zp_bound_2_0131}, {zp_bound_2_0140, zp_bound_2_0141}}},
};

__attribute__((target("avx2"))) static int64_t zp_bound_avx2_any(const zp_bound_sorted *o,
                                                                 int64_t lo, int64_t hi,
                                                                 int64_t pf, uint32_t mask,
                                                                 int nt) {
  return zp_bound_avx2_body(o, lo, hi, pf, mask, nt, o->nr4, o->nr2, o->nu4, o->nu2, o->nw4,
                            o->nw2);
}

__attribute__((target("avx512f"))) static int64_t zp_bound_avx512_any(const zp_bound_sorted *o,
                                                                     int64_t lo, int64_t hi,
                                                                     int64_t pf, uint32_t mask,
                                                                     int nt) {
  return zp_bound_avx512_body(o, lo, hi, pf, mask, nt, o->nr4, o->nr2, o->nu4, o->nu2, o->nw4,
                              o->nw2);
}

/* Elements [lo, hi) on a SIMD ISA: the shape's own body when it has one; returns where the
 * scalar tail starts. */
static int64_t zp_bound_simd(const zp_bound_job *job, int64_t lo, int64_t hi) {
  zp_bound_sorted o;
  zp_bound_sort(job, &o);
  const int isa512 = job->isa == ZP_ISA_AVX512;
  if (o.nr4 + o.nr2 == 1 && o.nu4 >= 1 && o.nu4 <= 4 && o.nu2 == 0 && o.nw4 == 0 &&
      o.nw2 <= 1)
    return zp_bound_shapes[isa512][o.nr2][o.nu4 - 1][o.nw2](&o, lo, hi, job->pf_bytes,
                                                            job->mask, job->nt);
  return isa512 ? zp_bound_avx512_any(&o, lo, hi, job->pf_bytes, job->mask, job->nt)
                : zp_bound_avx2_any(&o, lo, hi, job->pf_bytes, job->mask, job->nt);
}
#endif

static void zp_bound_range(void *ctx, int64_t begin, int64_t end) {
  const zp_bound_job *job = ctx;
#ifdef ZP_X86
  if (job->isa != ZP_ISA_SCALAR) {
    begin = zp_bound_simd(job, begin, end);
    if (job->nt)
      _mm_sfence(); /* before the thread takes its next block or is joined */
  }
#endif
  zp_bound_scalar(job, begin, end);
}

/* Read at run time so that the compiler cannot prove the mask is zero. */
static volatile uint32_t zp_bound_mask = 0;

zp_status zp_stream_bound_cpu(const zp_stream *streams, int32_t n_streams, int64_t numel,
                              int32_t n_threads) {
  if (n_streams < 1 || n_streams > ZP_STREAM_MAX)
    return zp_fail(ZP_ERR_INVALID, "stream_bound: %d streams; 1 to %d", n_streams,
                   ZP_STREAM_MAX);
  if (streams == NULL || numel < 0)
    return zp_fail(ZP_ERR_INVALID, "stream_bound: streams must not be NULL and numel >= 0");
  for (int32_t k = 0; k < n_streams; k++) {
    const zp_stream *st = &streams[k];
    if (st->elem_bytes != 2 && st->elem_bytes != 4)
      return zp_fail(ZP_ERR_INVALID, "stream_bound: stream %d has %d-byte elements; 2 or 4",
                     k, st->elem_bytes);
    if (st->access < ZP_STREAM_READ || st->access > ZP_STREAM_UPDATE)
      return zp_fail(ZP_ERR_INVALID, "stream_bound: stream %d: access %d is not read (1), "
                     "write (2) or update (3)", k, st->access);
    if (st->data == NULL && numel > 0)
      return zp_fail(ZP_ERR_INVALID, "stream_bound: stream %d has no data", k);
  }
  zp_cpu_tuning tune = zp_cpu_tuning_pick();
  zp_bound_job job;
  memset(&job, 0, sizeof job);
  memcpy(job.s, streams, (size_t)n_streams * sizeof *streams);
  job.n = n_streams;
  job.pf_bytes = tune.prefetch_l1 ? -(int64_t)tune.prefetch_bytes : tune.prefetch_bytes;
  job.mask = zp_bound_mask;
  job.isa = tune.isa;
  /* as the kernels: streaming stores for write-only outputs from stream_min_bytes on (they
   * need aligned addresses: every block of a write stream starts on a 64-byte boundary) */
  job.nt = tune.stream_min_bytes > 0;
  for (int32_t k = 0; k < n_streams; k++)
    if (streams[k].access == ZP_STREAM_WRITE)
      job.nt = job.nt && numel * streams[k].elem_bytes >= tune.stream_min_bytes &&
               (uintptr_t)streams[k].data % 64 == 0;
  /* zp_opt_step_cpu's split, so that both see the same ranges */
  return tune.split_static
             ? zp_parallel_for(numel, n_threads, 64, ZP_CPU_BLOCK, zp_bound_range, &job)
             : zp_parallel_blocks(numel, n_threads, ZP_CPU_BLOCK, ZP_CPU_BLOCK, zp_bound_range,
                                  &job);
}
