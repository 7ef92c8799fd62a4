/* status.h - status codes and the per-thread error message of the C core.
 *
 * Invariant: no function of the core prints, exits or aborts. A function that fails returns
 * a non-zero zp_status and leaves a message for the caller in zp_last_error(); the Python
 * binding turns the pair into an exception in one place (csrc/python/module.c). */
#ifndef ZP_STATUS_H
#define ZP_STATUS_H

#ifdef __cplusplus
extern "C" { /* nvcc compiles the CUDA family's host code as C++ */
#endif

typedef enum {
  ZP_OK = 0,
  ZP_ERR_INVALID = 1, /* an argument is out of its domain: the caller must change it */
  ZP_ERR_RANGE = 2,   /* an index or size is outside the object it refers to */
  ZP_ERR_STATE = 3,   /* the call is not allowed in the object's current state */
  ZP_ERR_NOMEM = 4,   /* an allocation failed */
  ZP_ERR_SYSTEM = 5   /* the operating system refused (threads, ...) */
} zp_status;

/* Records a printf-style message for this thread and returns `code` (for `return zp_fail(...)`). */
zp_status zp_fail(zp_status code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* The message of the last failure on this thread ("" when none). Valid until the next failure. */
const char *zp_last_error(void);

/* Propagates a failing status to the caller: ZP_TRY(zp_something(...)); */
#define ZP_TRY(expr)                  \
  do {                                \
    zp_status zp_try_status_ = (expr); \
    if (zp_try_status_ != ZP_OK)      \
      return zp_try_status_;          \
  } while (0)

#ifdef __cplusplus
}
#endif

#endif /* ZP_STATUS_H */
