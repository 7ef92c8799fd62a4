/* checked.h - int64 size arithmetic that reports overflow instead of wrapping.
 *
 * Signed overflow is undefined behaviour in C, and a wrapped size turns into a division by
 * zero or a short allocation later (SIGFPE, heap overflow): the "never abort" rule of the core
 * (status.h) covers its arithmetic too. Every sum, product or round-up of a caller-given size
 * goes through these; each returns 1 with the result, or 0 (result unspecified) on overflow,
 * which the caller turns into a status that names the argument. GCC and Clang builtins. */
#ifndef ZP_CHECKED_H
#define ZP_CHECKED_H

#include <stdint.h>

static inline int zp_add_i64(int64_t a, int64_t b, int64_t *out) {
  return !__builtin_add_overflow(a, b, out);
}

static inline int zp_mul_i64(int64_t a, int64_t b, int64_t *out) {
  return !__builtin_mul_overflow(a, b, out);
}

/* x rounded up to a multiple of m, for x >= 0 and m >= 1. */
static inline int zp_round_up_i64(int64_t x, int64_t m, int64_t *out) {
  const int64_t r = x % m;
  if (r == 0) {
    *out = x;
    return 1;
  }
  return zp_add_i64(x, m - r, out);
}

#endif /* ZP_CHECKED_H */
