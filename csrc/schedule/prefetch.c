/* prefetch.c - the stage-3 gather/free schedule (prefetch.h).
 *
 * State: the order; while a phase is open its schedule (sched[0 .. n_sched)), each unit's
 * place in it (pos[u], -1 when absent) and the cursor (units before it have been issued or
 * passed); which units are resident and their bytes; the first-need order of this phase and
 * of the last ended FORWARD. Every call checks all its preconditions before it changes
 * anything, and no step after the checks can fail, so a failing call leaves no trace. */
#include "schedule/prefetch.h"

#include <stdlib.h>
#include <string.h>

struct zp_prefetch {
  int32_t n_units;
  int64_t *unit_bytes;
  uint8_t *keep;
  int64_t budget;
  int32_t *order; /* the forward order, n_order distinct ids */
  int32_t n_order;
  int32_t phase;  /* open phase, or -1 */
  int32_t *sched; /* the open phase's schedule */
  int32_t n_sched;
  int32_t cursor;
  int32_t *pos;       /* unit -> index in sched, or -1 */
  uint8_t *resident;
  uint8_t *was_needed; /* needed at least once in the open phase */
  int32_t *first_need; /* the open phase's first-need order, n_first */
  int32_t n_first;
  int32_t *seen; /* first-need order of the last ended FORWARD, n_seen */
  int32_t n_seen;
  int64_t live, peak;
};

/* An emitter of commands into a buffer whose capacity was checked beforehand. */
typedef struct {
  zp_prefetch *pf;
  zp_pf_cmd *cmds;
  int32_t n;
} zp_pf_out;

static void zp_pf_gather(zp_pf_out *o, int32_t u, int32_t reason) {
  zp_prefetch *pf = o->pf;
  pf->resident[u] = 1;
  pf->live += pf->unit_bytes[u];
  if (pf->live > pf->peak)
    pf->peak = pf->live;
  o->cmds[o->n++] = (zp_pf_cmd){ZP_PF_GATHER, u, reason};
}

static void zp_pf_free(zp_pf_out *o, int32_t u, int32_t reason) {
  zp_prefetch *pf = o->pf;
  pf->resident[u] = 0;
  pf->live -= pf->unit_bytes[u];
  o->cmds[o->n++] = (zp_pf_cmd){ZP_PF_FREE, u, reason};
}

void zp_prefetch_destroy(zp_prefetch *pf) {
  if (pf == NULL)
    return;
  free(pf->unit_bytes);
  free(pf->keep);
  free(pf->order);
  free(pf->sched);
  free(pf->pos);
  free(pf->resident);
  free(pf->was_needed);
  free(pf->first_need);
  free(pf->seen);
  free(pf);
}

zp_status zp_prefetch_create(int32_t n_units, const int64_t *unit_bytes, const uint8_t *keep,
                             int64_t budget_bytes, zp_prefetch **out) {
  if (out == NULL)
    return zp_fail(ZP_ERR_INVALID, "prefetch: out must not be NULL");
  *out = NULL;
  if (n_units < 1 || unit_bytes == NULL)
    return zp_fail(ZP_ERR_INVALID, "prefetch: needs >= 1 unit and its sizes (got %d units)",
                   n_units);
  if (n_units > (INT32_MAX - 2) / 2)
    return zp_fail(ZP_ERR_INVALID, "prefetch: %d units is too many (at most %d)", n_units,
                   (INT32_MAX - 2) / 2);
  if (budget_bytes < 0)
    return zp_fail(ZP_ERR_INVALID, "prefetch: budget_bytes must be >= 0, got %lld",
                   (long long)budget_bytes);
  int64_t total = 0;
  for (int32_t u = 0; u < n_units; u++) {
    if (unit_bytes[u] <= 0)
      return zp_fail(ZP_ERR_INVALID, "prefetch: unit %d has %lld bytes; every unit needs > 0", u,
                     (long long)unit_bytes[u]);
    if (unit_bytes[u] > INT64_MAX - total)
      return zp_fail(ZP_ERR_INVALID, "prefetch: unit_bytes add up to more than 2**63-1 at unit "
                     "%d (%lld bytes); the units together must fit in int64", u,
                     (long long)unit_bytes[u]);
    total += unit_bytes[u];
  }
  zp_prefetch *pf = calloc(1, sizeof *pf);
  if (pf == NULL)
    return zp_fail(ZP_ERR_NOMEM, "prefetch: out of memory");
  const size_t n = (size_t)n_units;
  pf->n_units = n_units;
  pf->budget = budget_bytes;
  pf->phase = -1;
  pf->unit_bytes = malloc(n * sizeof *pf->unit_bytes);
  pf->keep = calloc(n, 1);
  pf->order = malloc(n * sizeof *pf->order);
  pf->sched = malloc(n * sizeof *pf->sched);
  pf->pos = malloc(n * sizeof *pf->pos);
  pf->resident = calloc(n, 1);
  pf->was_needed = calloc(n, 1);
  pf->first_need = malloc(n * sizeof *pf->first_need);
  pf->seen = malloc(n * sizeof *pf->seen);
  if (!pf->unit_bytes || !pf->keep || !pf->order || !pf->sched || !pf->pos || !pf->resident ||
      !pf->was_needed || !pf->first_need || !pf->seen) {
    zp_prefetch_destroy(pf);
    return zp_fail(ZP_ERR_NOMEM, "prefetch: out of memory for %d units", n_units);
  }
  memcpy(pf->unit_bytes, unit_bytes, n * sizeof *pf->unit_bytes);
  for (int32_t u = 0; u < n_units; u++) {
    pf->keep[u] = keep != NULL && keep[u] != 0;
    pf->order[u] = u;
    pf->pos[u] = -1;
  }
  pf->n_order = n_units;
  *out = pf;
  return ZP_OK;
}

int32_t zp_prefetch_cmd_capacity(const zp_prefetch *pf) { return 2 * pf->n_units + 2; }

zp_status zp_prefetch_set_order(zp_prefetch *pf, const int32_t *order, int32_t n) {
  if (pf->phase >= 0)
    return zp_fail(ZP_ERR_STATE, "prefetch: set_order during an open phase; call end() first");
  if (n < 0 || n > pf->n_units)
    return zp_fail(ZP_ERR_INVALID, "prefetch: an order of %d units; it must hold 0 to %d", n,
                   pf->n_units);
  if (n > 0 && order == NULL)
    return zp_fail(ZP_ERR_INVALID, "prefetch: order must not be NULL");
  /* pos is all -1 between phases: borrow it to find duplicates, and restore it */
  zp_status status = ZP_OK;
  int32_t k = 0;
  for (; k < n; k++) {
    int32_t u = order[k];
    if (u < 0 || u >= pf->n_units) {
      status = zp_fail(ZP_ERR_RANGE, "prefetch: order[%d] = %d is outside [0, %d)", k, u,
                       pf->n_units);
      break;
    }
    if (pf->pos[u] >= 0) {
      status = zp_fail(ZP_ERR_INVALID, "prefetch: unit %d appears twice in the order (at %d and %d)",
                       u, pf->pos[u], k);
      break;
    }
    pf->pos[u] = k;
  }
  for (int32_t j = 0; j < k; j++)
    pf->pos[order[j]] = -1;
  if (status != ZP_OK)
    return status;
  if (n > 0)
    memcpy(pf->order, order, (size_t)n * sizeof *pf->order);
  pf->n_order = n;
  return ZP_OK;
}

zp_status zp_prefetch_set_keep(zp_prefetch *pf, const uint8_t *keep) {
  if (pf->phase >= 0)
    return zp_fail(ZP_ERR_STATE, "prefetch: set_keep during an open phase; call end() first");
  for (int32_t u = 0; u < pf->n_units; u++)
    pf->keep[u] = keep != NULL && keep[u] != 0;
  return ZP_OK;
}

int32_t zp_prefetch_order(const zp_prefetch *pf, int32_t *out, int32_t cap) {
  for (int32_t k = 0; k < pf->n_order && k < cap; k++)
    out[k] = pf->order[k];
  return pf->n_order;
}

zp_status zp_prefetch_begin(zp_prefetch *pf, int32_t phase) {
  if (phase != ZP_PF_FORWARD && phase != ZP_PF_FORWARD_EVAL && phase != ZP_PF_BACKWARD)
    return zp_fail(ZP_ERR_INVALID,
                   "prefetch: phase %d is not FORWARD (0), FORWARD_EVAL (1) or BACKWARD (2)",
                   phase);
  if (pf->phase >= 0)
    return zp_fail(ZP_ERR_STATE, "prefetch: begin(%d) while phase %d is open; call end() first",
                   phase, pf->phase);
  pf->n_sched = 0;
  if (phase == ZP_PF_BACKWARD) {
    for (int32_t k = pf->n_order - 1; k >= 0; k--)
      if (!pf->keep[pf->order[k]])
        pf->sched[pf->n_sched++] = pf->order[k];
  } else {
    memcpy(pf->sched, pf->order, (size_t)pf->n_order * sizeof *pf->sched);
    pf->n_sched = pf->n_order;
  }
  for (int32_t k = 0; k < pf->n_sched; k++)
    pf->pos[pf->sched[k]] = k;
  memset(pf->was_needed, 0, (size_t)pf->n_units);
  pf->n_first = 0;
  pf->cursor = 0;
  pf->phase = phase;
  return ZP_OK;
}

/* The checks every command-producing call shares. */
static zp_status zp_pf_check_call(const zp_prefetch *pf, const char *fn, zp_pf_cmd *cmds,
                                  int32_t cap, int32_t *n_out) {
  if (cmds == NULL || n_out == NULL)
    return zp_fail(ZP_ERR_INVALID, "prefetch: %s: cmds and n_out must not be NULL", fn);
  if (cap < zp_prefetch_cmd_capacity(pf))
    return zp_fail(ZP_ERR_INVALID, "prefetch: %s: command capacity %d is below 2 * %d units + 2",
                   fn, cap, pf->n_units);
  if (pf->phase < 0)
    return zp_fail(ZP_ERR_STATE, "prefetch: %s outside a phase; call begin() first", fn);
  return ZP_OK;
}

static zp_status zp_pf_check_unit(const zp_prefetch *pf, const char *fn, int32_t u) {
  if (u < 0 || u >= pf->n_units)
    return zp_fail(ZP_ERR_RANGE, "prefetch: %s(%d): unit outside [0, %d)", fn, u, pf->n_units);
  return ZP_OK;
}

/* Issues the scheduled unit at the cursor without a need for it: passed when resident, KEPT
 * in FORWARD when a keep unit, else SKIPPED (gathered and freed at once). */
static void zp_pf_pass(zp_pf_out *o) {
  zp_prefetch *pf = o->pf;
  int32_t x = pf->sched[pf->cursor++];
  if (pf->resident[x])
    return;
  if (pf->phase == ZP_PF_FORWARD && pf->keep[x]) {
    zp_pf_gather(o, x, ZP_PF_KEPT);
  } else {
    zp_pf_gather(o, x, ZP_PF_SKIPPED);
    zp_pf_free(o, x, ZP_PF_SKIPPED);
  }
}

static void zp_pf_prefetch(zp_pf_out *o) {
  zp_prefetch *pf = o->pf;
  while (pf->cursor < pf->n_sched) {
    int32_t x = pf->sched[pf->cursor];
    if (!pf->resident[x]) {
      if (pf->live + pf->unit_bytes[x] > pf->budget) /* live <= sum of bytes: no overflow */
        return;
      zp_pf_gather(o, x, ZP_PF_PREFETCHED);
    }
    pf->cursor++;
  }
}

zp_status zp_prefetch_need(zp_prefetch *pf, int32_t u, zp_pf_cmd *cmds, int32_t cap,
                           int32_t *n_out) {
  ZP_TRY(zp_pf_check_call(pf, "need", cmds, cap, n_out));
  ZP_TRY(zp_pf_check_unit(pf, "need", u));
  zp_pf_out o = {pf, cmds, 0};
  const int32_t p = pf->pos[u];
  if (p >= pf->cursor) {
    while (pf->cursor < p)
      zp_pf_pass(&o);
    pf->cursor = p + 1;
    if (!pf->resident[u])
      zp_pf_gather(&o, u, ZP_PF_NEEDED);
  } else if (!pf->resident[u]) {
    zp_pf_gather(&o, u, ZP_PF_UNSCHEDULED);
  }
  if (!pf->was_needed[u]) {
    pf->was_needed[u] = 1;
    pf->first_need[pf->n_first++] = u;
  }
  zp_pf_prefetch(&o);
  *n_out = o.n;
  return ZP_OK;
}

zp_status zp_prefetch_done(zp_prefetch *pf, int32_t u, zp_pf_cmd *cmds, int32_t cap,
                           int32_t *n_out) {
  ZP_TRY(zp_pf_check_call(pf, "done", cmds, cap, n_out));
  ZP_TRY(zp_pf_check_unit(pf, "done", u));
  if (!pf->resident[u])
    return zp_fail(ZP_ERR_STATE, "prefetch: done(%d): the unit is not resident; a need(%d) is "
                                 "missing before it", u, u);
  if (pf->pos[u] >= pf->cursor)
    return zp_fail(ZP_ERR_STATE, "prefetch: done(%d) before the phase reached the unit; a "
                                 "need(%d) is missing before it", u, u);
  zp_pf_out o = {pf, cmds, 0};
  if (pf->phase != ZP_PF_FORWARD || !pf->keep[u])
    zp_pf_free(&o, u, ZP_PF_RELEASED);
  zp_pf_prefetch(&o);
  *n_out = o.n;
  return ZP_OK;
}

zp_status zp_prefetch_end(zp_prefetch *pf, zp_pf_cmd *cmds, int32_t cap, int32_t *n_out) {
  ZP_TRY(zp_pf_check_call(pf, "end", cmds, cap, n_out));
  zp_pf_out o = {pf, cmds, 0};
  while (pf->cursor < pf->n_sched)
    zp_pf_pass(&o);
  const int forward = pf->phase == ZP_PF_FORWARD;
  for (int32_t u = 0; u < pf->n_units; u++) {
    /* FORWARD keeps the keep units of its schedule: every rank has exactly those */
    if (pf->resident[u] && !(forward && pf->keep[u] && pf->pos[u] >= 0))
      zp_pf_free(&o, u, ZP_PF_RELEASED);
  }
  for (int32_t k = 0; k < pf->n_sched; k++)
    pf->pos[pf->sched[k]] = -1;
  if (forward) {
    memcpy(pf->seen, pf->first_need, (size_t)pf->n_first * sizeof *pf->seen);
    pf->n_seen = pf->n_first;
  }
  pf->n_sched = 0;
  pf->cursor = 0;
  pf->phase = -1;
  *n_out = o.n;
  return ZP_OK;
}

int32_t zp_prefetch_seen(const zp_prefetch *pf, int32_t *out, int32_t cap) {
  for (int32_t k = 0; k < pf->n_seen && k < cap; k++)
    out[k] = pf->seen[k];
  return pf->n_seen;
}

int32_t zp_prefetch_n_units(const zp_prefetch *pf) { return pf->n_units; }

int32_t zp_prefetch_phase(const zp_prefetch *pf) { return pf->phase; }

int32_t zp_prefetch_is_resident(const zp_prefetch *pf, int32_t u) {
  if (u < 0 || u >= pf->n_units)
    return -1;
  return pf->resident[u];
}

int64_t zp_prefetch_live_bytes(const zp_prefetch *pf) { return pf->live; }

int64_t zp_prefetch_peak_bytes(const zp_prefetch *pf) { return pf->peak; }

void zp_prefetch_reset_peak(zp_prefetch *pf) { pf->peak = pf->live; }
