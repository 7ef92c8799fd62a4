/* check.h - a minimal test harness: CHECK macros that count failures, a PRNG, fresh-thread runs. */
#ifndef ZT_CHECK_H
#define ZT_CHECK_H

#include <stdint.h>

#include "common/status.h"

/* Failures of the test function now running (reset by main.c before each test). */
extern int zt_failures;

/* Records a failure (printing at most a few per test) unless `ok`; returns `ok`. */
int zt_check(int ok, const char *file, int line, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;

/* Every CHECK is an expression worth 1 when it holds, so a test can stop: if (!CHECK(x)) return; */
#define CHECK(cond) zt_check((cond) ? 1 : 0, __FILE__, __LINE__, "CHECK(%s)", #cond)
#define CHECK_MSG(cond, ...) zt_check((cond) ? 1 : 0, __FILE__, __LINE__, __VA_ARGS__)
#define CHECK_EQ(a, b)                                                                    \
  zt_check((int64_t)(a) == (int64_t)(b), __FILE__, __LINE__, "CHECK_EQ(%s, %s): %lld != %lld", \
           #a, #b, (long long)(a), (long long)(b))
#define CHECK_OK(expr)                                                                    \
  zt_check_status((expr), ZP_OK, __FILE__, __LINE__, #expr)
/* The call fails with `code` and leaves a non-empty message in zp_last_error(). */
#define CHECK_FAILS(expr, code) zt_check_status((expr), (code), __FILE__, __LINE__, #expr)

int zt_check_status(zp_status got, zp_status want, const char *file, int line, const char *expr);

/* Runs fn(arg) on a new thread and waits for it, so that zp_last_error() starts out empty
 * there and an error case proves that the call itself left a message. */
void zt_run_fresh(void (*fn)(void *), void *arg);

/* xorshift64* PRNG: deterministic for a given seed. */
typedef struct {
  uint64_t s;
} zt_rng;
static inline zt_rng zt_rng_seed(uint64_t seed) {
  zt_rng r = {seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull};
  if (r.s == 0)
    r.s = 1;
  return r;
}
static inline uint64_t zt_next(zt_rng *r) {
  r->s ^= r->s >> 12;
  r->s ^= r->s << 25;
  r->s ^= r->s >> 27;
  return r->s * 0x2545F4914F6CDD1Dull;
}
/* Uniform integer in [lo, hi]. */
static inline int64_t zt_range(zt_rng *r, int64_t lo, int64_t hi) {
  return lo + (int64_t)(zt_next(r) % (uint64_t)(hi - lo + 1));
}
/* Uniform double in [0, 1). */
static inline double zt_unit(zt_rng *r) {
  return (double)(zt_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

#endif /* ZT_CHECK_H */
