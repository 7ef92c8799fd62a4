/* status.c - the per-thread last-error message behind zp_fail() and zp_last_error(). */
#include "common/status.h"

#include <stdarg.h>
#include <stdio.h>

#define ZP_ERROR_CAPACITY 512

static _Thread_local char zp_error_message[ZP_ERROR_CAPACITY];

zp_status zp_fail(zp_status code, const char *fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(zp_error_message, sizeof zp_error_message, fmt, args);
  va_end(args);
  return code;
}

const char *zp_last_error(void) { return zp_error_message; }
