/* fuzz_input.h - turns a libFuzzer input into the integers a harness feeds the core.
 *
 * Sizes are drawn half the time from a table of edge values (0, +-1, powers of two at the
 * limits of int32, int64 and the core's own bounds) and otherwise from raw input bytes, so
 * the fuzzer reaches the overflow edges at once instead of having to guess 2**62 bit by bit.
 * An exhausted input reads as zeros. Harness code, not core code: a violated invariant traps
 * (FUZZ_ASSERT), which is what the fuzzer reports as a crash. */
#ifndef ZP_FUZZ_INPUT_H
#define ZP_FUZZ_INPUT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define FUZZ_ASSERT(cond)    \
  do {                       \
    if (!(cond))             \
      __builtin_trap();      \
  } while (0)

typedef struct {
  const uint8_t *data;
  size_t size, pos;
} fuzz_input;

static inline uint8_t fuzz_u8(fuzz_input *in) {
  return in->pos < in->size ? in->data[in->pos++] : 0;
}

static inline int fuzz_done(const fuzz_input *in) { return in->pos >= in->size; }

static inline uint64_t fuzz_raw(fuzz_input *in, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; i++)
    v |= (uint64_t)fuzz_u8(in) << (8 * i);
  return v;
}

static const int64_t fuzz_edges[] = {
    0, 1, -1, 2, 3, 4, 8, 16, 64, 4096,
    (int64_t)1 << 30, ((int64_t)1 << 30) + 1, ((int64_t)1 << 31) - 1, (int64_t)1 << 31,
    (int64_t)1 << 32, (int64_t)1 << 51, (int64_t)1 << 54, ((int64_t)1 << 56) - 1,
    (int64_t)1 << 56, ((int64_t)1 << 56) + 1, (int64_t)1 << 61, (int64_t)1 << 62,
    INT64_MAX - 1, INT64_MAX, INT64_MIN, INT64_MIN + 1, -((int64_t)1 << 62), INT32_MIN};
#define FUZZ_N_EDGES ((int)(sizeof fuzz_edges / sizeof fuzz_edges[0]))

/* An int64: an edge value, a small one (0..255) or 8 raw bytes. */
static inline int64_t fuzz_i64(fuzz_input *in) {
  uint8_t sel = fuzz_u8(in);
  if (sel < 128)
    return fuzz_edges[sel % FUZZ_N_EDGES];
  if (sel < 192)
    return (int64_t)fuzz_u8(in);
  uint64_t raw = fuzz_raw(in, 8);
  int64_t v;
  memcpy(&v, &raw, sizeof v);
  return v;
}

/* An int32: an int64 from fuzz_i64 clamped to int32, so the int32 edges come up too. */
static inline int32_t fuzz_i32(fuzz_input *in) {
  int64_t v = fuzz_i64(in);
  return v < INT32_MIN ? INT32_MIN : v > INT32_MAX ? INT32_MAX : (int32_t)v;
}

/* A small count in [lo, hi]. */
static inline int32_t fuzz_count(fuzz_input *in, int32_t lo, int32_t hi) {
  return lo + (int32_t)(fuzz_u8(in) % (uint32_t)(hi - lo + 1));
}

#endif /* ZP_FUZZ_INPUT_H */
