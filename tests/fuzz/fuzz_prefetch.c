/* fuzz_prefetch.c - libFuzzer harness of the stage-3 gather/free schedule (prefetch.h).
 *
 * Any input becomes up to 32 units (sizes from edge values, up to byte counts that add up to
 * past 2**63), keep bits and a budget, then a run of calls in any order: set_order (with
 * duplicates and ids out of range), set_keep, begin (any phase id), need and done (any unit
 * id), end, reset_peak. After each call a shadow of the residency, rebuilt from the commands
 * alone, must match the schedule: a GATHER only of a unit not resident, a FREE only of one
 * that is, live_bytes the bytes of the resident units, peak_bytes at least that; a call that
 * fails must leave no trace (prefetch.c's promise). */
#include <string.h>

#include "fuzz_input.h"
#include "schedule/prefetch.h"

#define MAX_UNITS 32
#define CAP (2 * MAX_UNITS + 2)

typedef struct {
  uint8_t resident[MAX_UNITS];
  int64_t live, peak;
  int32_t phase;
} shadow;

static void snapshot(const zp_prefetch *pf, int32_t n, shadow *s) {
  for (int32_t u = 0; u < n; u++)
    s->resident[u] = (uint8_t)zp_prefetch_is_resident(pf, u);
  s->live = zp_prefetch_live_bytes(pf);
  s->peak = zp_prefetch_peak_bytes(pf);
  s->phase = zp_prefetch_phase(pf);
}

/* Applies the commands of a successful call to `s` and checks them against the schedule. */
static void apply(const zp_prefetch *pf, int32_t n, const int64_t *bytes, const zp_pf_cmd *cmds,
                  int32_t n_out, shadow *s) {
  FUZZ_ASSERT(n_out >= 0 && n_out <= zp_prefetch_cmd_capacity(pf));
  for (int32_t k = 0; k < n_out; k++) {
    const int32_t u = cmds[k].unit;
    FUZZ_ASSERT(u >= 0 && u < n);
    if (cmds[k].kind == ZP_PF_GATHER) {
      FUZZ_ASSERT(!s->resident[u]);
      s->resident[u] = 1;
      s->live += bytes[u]; /* the units add up to at most INT64_MAX: create checked it */
    } else {
      FUZZ_ASSERT(cmds[k].kind == ZP_PF_FREE && s->resident[u]);
      s->resident[u] = 0;
      s->live -= bytes[u];
    }
    FUZZ_ASSERT(s->live >= 0);
  }
  for (int32_t u = 0; u < n; u++)
    FUZZ_ASSERT(zp_prefetch_is_resident(pf, u) == s->resident[u]);
  FUZZ_ASSERT(zp_prefetch_live_bytes(pf) == s->live);
  FUZZ_ASSERT(zp_prefetch_peak_bytes(pf) >= s->live);
}

static void unchanged(const zp_prefetch *pf, int32_t n, const shadow *before) {
  shadow now;
  snapshot(pf, n, &now);
  FUZZ_ASSERT(zp_last_error()[0] != '\0');
  FUZZ_ASSERT(memcmp(now.resident, before->resident, (size_t)n) == 0);
  FUZZ_ASSERT(now.live == before->live && now.peak == before->peak &&
              now.phase == before->phase);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_input in = {data, size, 0};
  const int32_t n = fuzz_u8(&in) & 1 ? fuzz_i32(&in) : fuzz_count(&in, 1, MAX_UNITS);
  int64_t bytes[MAX_UNITS];
  uint8_t keep[MAX_UNITS];
  const int32_t n_read = n < 0 ? 0 : n > MAX_UNITS ? MAX_UNITS : n;
  for (int32_t u = 0; u < n_read; u++) {
    bytes[u] = fuzz_u8(&in) & 1 ? fuzz_i64(&in) : fuzz_count(&in, 1, 255);
    keep[u] = fuzz_u8(&in) & 1;
  }
  const int64_t budget = fuzz_u8(&in) & 1 ? fuzz_i64(&in) : fuzz_count(&in, 0, 255) * 4;
  zp_prefetch *pf = NULL;
  if (n > MAX_UNITS) { /* the sizes array must be that long: only the refusal can be tried */
    if (n > (INT32_MAX - 2) / 2)
      FUZZ_ASSERT(zp_prefetch_create(n, bytes, keep, budget, &pf) != ZP_OK && pf == NULL);
    return 0;
  }
  if (zp_prefetch_create(n, bytes, fuzz_u8(&in) & 1 ? keep : NULL, budget, &pf) != ZP_OK) {
    FUZZ_ASSERT(pf == NULL && zp_last_error()[0] != '\0');
    return 0;
  }
  zp_pf_cmd cmds[CAP];
  shadow s = {{0}, 0, 0, -1};
  while (!fuzz_done(&in)) {
    const uint8_t op = fuzz_u8(&in);
    const int32_t cap = op & 0x80 ? fuzz_count(&in, 0, CAP) : CAP;
    const int32_t unit = op & 0x40 ? fuzz_i32(&in) : fuzz_count(&in, 0, n - 1);
    shadow before = s;
    zp_status st = ZP_OK;
    int32_t n_out = 0;
    zp_fail(ZP_OK, "%s", ""); /* so that a failure's message is seen to be new */
    switch (op % 8) {
    case 0: {
      int32_t order[MAX_UNITS + 1];
      const int32_t len = fuzz_count(&in, 0, MAX_UNITS + 1) % (n + 2);
      for (int32_t k = 0; k < len; k++)
        order[k] = op & 0x20 ? fuzz_i32(&in) : fuzz_count(&in, 0, n - 1);
      st = zp_prefetch_set_order(pf, order, len);
      break;
    }
    case 1: {
      uint8_t k[MAX_UNITS];
      for (int32_t u = 0; u < n; u++)
        k[u] = fuzz_u8(&in) & 1;
      st = zp_prefetch_set_keep(pf, op & 0x20 ? NULL : k);
      break;
    }
    case 2:
      st = zp_prefetch_begin(pf, op & 0x20 ? fuzz_i32(&in) : fuzz_count(&in, 0, 2));
      break;
    case 3:
    case 4:
      st = zp_prefetch_need(pf, unit, cmds, cap, &n_out);
      break;
    case 5:
      st = zp_prefetch_done(pf, unit, cmds, cap, &n_out);
      break;
    case 6:
      st = zp_prefetch_end(pf, cmds, cap, &n_out);
      break;
    default:
      zp_prefetch_reset_peak(pf);
      s.peak = s.live;
      continue;
    }
    if (st != ZP_OK) {
      unchanged(pf, n, &before);
      continue;
    }
    if (op % 8 >= 3 && op % 8 <= 6)
      apply(pf, n, bytes, cmds, n_out, &s);
    if (op % 8 == 3 || op % 8 == 4)
      FUZZ_ASSERT(zp_prefetch_is_resident(pf, unit) == 1);
    if (op % 8 == 6) { /* nothing outlives BACKWARD or FORWARD_EVAL */
      if (before.phase != ZP_PF_FORWARD)
        FUZZ_ASSERT(s.live == 0);
    }
    s.phase = zp_prefetch_phase(pf);
    s.peak = zp_prefetch_peak_bytes(pf);
  }
  zp_prefetch_destroy(pf);
  return 0;
}
