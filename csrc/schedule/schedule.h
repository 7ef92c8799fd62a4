/* schedule.h - the gradient-reduction state machine: grad-ready events in, bucket launches out.
 *
 * Pure C11, holds no tensors and calls nothing. An executor reports each parameter whose
 * gradient is ready; the schedule answers with the buckets that may now be reduce-scattered.
 * Buckets are released strictly in index order (bucket b only after 0..b-1), so every rank
 * issues its collectives in the same order whatever order its gradients arrive in; that is
 * what keeps ranks that take different paths through a model from deadlocking. At the end of
 * backward, flush releases every bucket not yet released, in order (parameters that got no
 * gradient are reduced as zeros). reset starts the next backward pass. */
#ifndef ZP_SCHEDULE_H
#define ZP_SCHEDULE_H

#include <stdint.h>

#include "common/status.h"

typedef struct zp_schedule zp_schedule;

/* param_bucket[i] is the bucket of parameter i, in [0, n_buckets). Every bucket must hold at
 * least one parameter. */
zp_status zp_schedule_create(const int32_t *param_bucket, int32_t n_params, int32_t n_buckets,
                             zp_schedule **out);

void zp_schedule_destroy(zp_schedule *schedule);

/* Forgets the current pass: no parameter ready, no bucket released. */
void zp_schedule_reset(zp_schedule *schedule);

/* Parameter `param` has its gradient. Writes the buckets released by this event, in launch
 * order, to out[0 .. *n_out); `capacity` must be >= n_buckets. Reporting a parameter twice in
 * one pass, or after flush, is an error. */
zp_status zp_schedule_grad_ready(zp_schedule *schedule, int32_t param, int32_t *out,
                                 int32_t capacity, int32_t *n_out);

/* Backward is over: releases every bucket not yet released, in order. */
zp_status zp_schedule_flush(zp_schedule *schedule, int32_t *out, int32_t capacity,
                            int32_t *n_out);

int32_t zp_schedule_n_buckets(const zp_schedule *schedule);
/* Buckets released so far in this pass (they are 0 .. released-1). */
int32_t zp_schedule_released(const zp_schedule *schedule);
/* 1 if parameter `param` was reported in this pass, 0 if not, -1 if out of range. */
int32_t zp_schedule_is_ready(const zp_schedule *schedule, int32_t param);

#endif /* ZP_SCHEDULE_H */
