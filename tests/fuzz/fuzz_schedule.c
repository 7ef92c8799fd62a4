/* fuzz_schedule.c - libFuzzer harness of the gradient-bucket schedule (schedule.h).
 *
 * Any input becomes a parameter-to-bucket map (edge values allowed: negative buckets, bucket
 * counts up to 2**31-1) and then a run of events: grad_ready of any parameter id, flush,
 * reset, with output capacities that may be too small. A shadow model checks every answer:
 * buckets are released in index order, only once all their parameters are ready or at flush,
 * and a failing call changes nothing. */
#include <stdlib.h>
#include <string.h>

#include "fuzz_input.h"
#include "schedule/schedule.h"

#define MAX_PARAMS 64

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_input in = {data, size, 0};
  const int32_t n_params = fuzz_u8(&in) & 1 ? fuzz_i32(&in) : fuzz_count(&in, 1, MAX_PARAMS);
  const int32_t n_buckets = fuzz_u8(&in) & 1 ? fuzz_i32(&in) : fuzz_count(&in, 1, MAX_PARAMS);
  if (n_params > MAX_PARAMS) /* the map is the caller's array of n_params entries */
    return 0;
  int32_t map[MAX_PARAMS];
  for (int32_t i = 0; i < n_params; i++)
    map[i] = fuzz_u8(&in) & 1 ? fuzz_i32(&in) : fuzz_count(&in, 0, MAX_PARAMS - 1);
  zp_schedule *s = NULL;
  if (zp_schedule_create(map, n_params, n_buckets, &s) != ZP_OK) {
    FUZZ_ASSERT(s == NULL && zp_last_error()[0] != '\0');
    return 0;
  }
  /* created: the map was valid, so n_buckets <= n_params <= MAX_PARAMS */
  FUZZ_ASSERT(n_buckets >= 1 && n_buckets <= n_params);
  int32_t waiting[MAX_PARAMS] = {0};
  uint8_t ready[MAX_PARAMS] = {0};
  for (int32_t i = 0; i < n_params; i++)
    waiting[map[i]]++;
  int32_t released = 0, flushed = 0;
  int32_t out[MAX_PARAMS + 1];
  while (!fuzz_done(&in)) {
    const uint8_t op = fuzz_u8(&in);
    /* capacity: mostly enough, sometimes one short or an edge value */
    const int32_t cap = op & 0x10 ? fuzz_i32(&in) : op & 0x20 ? n_buckets - 1 : n_buckets;
    int32_t n_out = -1;
    if ((op & 3) == 0 || (op & 3) == 1) {
      const int32_t param = op & 0x40 ? fuzz_i32(&in) : fuzz_count(&in, 0, n_params - 1);
      const zp_status st = zp_schedule_grad_ready(s, param, out, cap < n_buckets ? cap : n_buckets,
                                                  &n_out);
      const int valid = cap >= n_buckets && param >= 0 && param < n_params && !flushed &&
                        !ready[param];
      FUZZ_ASSERT((st == ZP_OK) == valid);
      if (st != ZP_OK) {
        FUZZ_ASSERT(zp_last_error()[0] != '\0' && zp_schedule_released(s) == released);
        continue;
      }
      ready[param] = 1;
      waiting[map[param]]--;
      int32_t expect = 0;
      while (released < n_buckets && waiting[released] == 0)
        FUZZ_ASSERT(expect < n_out && out[expect++] == released++);
      FUZZ_ASSERT(expect == n_out);
    } else if ((op & 3) == 2) {
      const zp_status st = zp_schedule_flush(s, out, cap < n_buckets ? cap : n_buckets, &n_out);
      FUZZ_ASSERT((st == ZP_OK) == (cap >= n_buckets));
      if (st != ZP_OK)
        continue;
      for (int32_t k = 0; k < n_out; k++)
        FUZZ_ASSERT(out[k] == released++);
      FUZZ_ASSERT(released == n_buckets);
      flushed = 1;
    } else {
      zp_schedule_reset(s);
      released = flushed = 0;
      memset(ready, 0, sizeof ready);
      memset(waiting, 0, sizeof waiting);
      for (int32_t i = 0; i < n_params; i++)
        waiting[map[i]]++;
    }
    FUZZ_ASSERT(zp_schedule_released(s) == released);
    for (int32_t i = 0; i < n_params; i++)
      FUZZ_ASSERT(zp_schedule_is_ready(s, i) == ready[i]);
  }
  zp_schedule_destroy(s);
  return 0;
}
