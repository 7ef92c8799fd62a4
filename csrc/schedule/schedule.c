/* schedule.c - in-order release of gradient buckets as their parameters become ready.
 *
 * State per pass: which parameters reported, how many each bucket still waits for, and how
 * many buckets (a prefix, 0 .. released-1) have been released. */
#include "schedule/schedule.h"

#include <stdlib.h>
#include <string.h>

struct zp_schedule {
  int32_t n_params, n_buckets;
  int32_t *param_bucket;   /* copy of the map given at create */
  int32_t *bucket_size;    /* parameters per bucket */
  int32_t *bucket_waiting; /* parameters of the bucket not yet ready in this pass */
  uint8_t *param_ready;    /* 1 once reported in this pass */
  int32_t released;        /* buckets 0 .. released-1 are released */
  int flushed;             /* flush ran in this pass */
};

void zp_schedule_destroy(zp_schedule *s) {
  if (s == NULL)
    return;
  free(s->param_bucket);
  free(s->bucket_size);
  free(s->bucket_waiting);
  free(s->param_ready);
  free(s);
}

zp_status zp_schedule_create(const int32_t *param_bucket, int32_t n_params, int32_t n_buckets,
                             zp_schedule **out) {
  if (out == NULL)
    return zp_fail(ZP_ERR_INVALID, "schedule: out must not be NULL");
  *out = NULL;
  if (n_params < 1 || n_buckets < 1 || param_bucket == NULL)
    return zp_fail(ZP_ERR_INVALID, "schedule: needs >= 1 parameter and bucket (got %d, %d)",
                   n_params, n_buckets);
  /* Checked before any allocation: n_buckets sizes two arrays, and nothing else bounds it. */
  if (n_buckets > n_params)
    return zp_fail(ZP_ERR_INVALID, "schedule: n_buckets=%d exceeds the %d parameters; every "
                   "bucket holds a parameter, so n_buckets must be in [1, n_params]",
                   n_buckets, n_params);
  zp_schedule *s = calloc(1, sizeof *s);
  if (s == NULL)
    return zp_fail(ZP_ERR_NOMEM, "schedule: out of memory");
  s->n_params = n_params;
  s->n_buckets = n_buckets;
  s->param_bucket = malloc((size_t)n_params * sizeof *s->param_bucket);
  s->bucket_size = calloc((size_t)n_buckets, sizeof *s->bucket_size);
  s->bucket_waiting = calloc((size_t)n_buckets, sizeof *s->bucket_waiting);
  s->param_ready = calloc((size_t)n_params, sizeof *s->param_ready);
  if (!s->param_bucket || !s->bucket_size || !s->bucket_waiting || !s->param_ready) {
    zp_schedule_destroy(s);
    return zp_fail(ZP_ERR_NOMEM, "schedule: out of memory for %d parameters", n_params);
  }
  for (int32_t i = 0; i < n_params; i++) {
    int32_t b = param_bucket[i];
    if (b < 0 || b >= n_buckets) {
      zp_schedule_destroy(s);
      return zp_fail(ZP_ERR_RANGE, "schedule: parameter %d maps to bucket %d, outside [0, %d)", i,
                     b, n_buckets);
    }
    s->param_bucket[i] = b;
    s->bucket_size[b]++;
  }
  for (int32_t b = 0; b < n_buckets; b++) {
    if (s->bucket_size[b] == 0) {
      zp_schedule_destroy(s);
      return zp_fail(ZP_ERR_INVALID, "schedule: bucket %d holds no parameter", b);
    }
  }
  zp_schedule_reset(s);
  *out = s;
  return ZP_OK;
}

void zp_schedule_reset(zp_schedule *s) {
  memcpy(s->bucket_waiting, s->bucket_size, (size_t)s->n_buckets * sizeof *s->bucket_waiting);
  memset(s->param_ready, 0, (size_t)s->n_params);
  s->released = 0;
  s->flushed = 0;
}

static zp_status zp_schedule_check_out(const zp_schedule *s, int32_t *out, int32_t capacity,
                                       int32_t *n_out) {
  if (out == NULL || n_out == NULL)
    return zp_fail(ZP_ERR_INVALID, "schedule: out and n_out must not be NULL");
  if (capacity < s->n_buckets)
    return zp_fail(ZP_ERR_INVALID, "schedule: output capacity %d is below the %d buckets",
                   capacity, s->n_buckets);
  *n_out = 0;
  return ZP_OK;
}

zp_status zp_schedule_grad_ready(zp_schedule *s, int32_t param, int32_t *out, int32_t capacity,
                                 int32_t *n_out) {
  ZP_TRY(zp_schedule_check_out(s, out, capacity, n_out));
  if (param < 0 || param >= s->n_params)
    return zp_fail(ZP_ERR_RANGE, "schedule: parameter %d is outside [0, %d)", param, s->n_params);
  if (s->flushed)
    return zp_fail(ZP_ERR_STATE,
                   "schedule: parameter %d reported after the end of backward; reset first", param);
  if (s->param_ready[param])
    return zp_fail(ZP_ERR_STATE, "schedule: parameter %d reported ready twice in one pass", param);
  s->param_ready[param] = 1;
  s->bucket_waiting[s->param_bucket[param]]--;
  while (s->released < s->n_buckets && s->bucket_waiting[s->released] == 0)
    out[(*n_out)++] = s->released++;
  return ZP_OK;
}

zp_status zp_schedule_flush(zp_schedule *s, int32_t *out, int32_t capacity, int32_t *n_out) {
  ZP_TRY(zp_schedule_check_out(s, out, capacity, n_out));
  while (s->released < s->n_buckets)
    out[(*n_out)++] = s->released++;
  s->flushed = 1;
  return ZP_OK;
}

int32_t zp_schedule_n_buckets(const zp_schedule *s) { return s->n_buckets; }

int32_t zp_schedule_released(const zp_schedule *s) { return s->released; }

int32_t zp_schedule_is_ready(const zp_schedule *s, int32_t param) {
  if (param < 0 || param >= s->n_params)
    return -1;
  return s->param_ready[param];
}
