/* shared_flags.h - sequence numbers published between processes through shared memory.
 *
 * A writer fills a buffer that other processes map, then publishes a sequence number with
 * release order; a reader waits until the number is there with acquire order, then reads the
 * buffer. Whatever the writer's thread wrote before publishing (threads it joined included) is
 * visible to a reader that saw the number. Used by the host shared-memory all-gather
 * (zero_py/collectives/shm.py). Invariant: a wait never blocks past its timeout. */
#ifndef ZP_SHARED_FLAGS_H
#define ZP_SHARED_FLAGS_H

#include <stdint.h>

#include "common/status.h"

/* *flag = value, with release order. */
void zp_flag_publish(int64_t *flag, int64_t value);

/* Waits until flags[i * stride] >= value for every i in [0, n): spins a little, then sleeps
 * with a growing pause (at most 1 ms). ZP_ERR_STATE after timeout_s seconds, with a message
 * naming the first index that had not arrived (also in *late when late != NULL, else -1). */
zp_status zp_flags_wait_ge(const int64_t *flags, int32_t n, int64_t stride, int64_t value,
                           double timeout_s, int32_t *late);

#endif
