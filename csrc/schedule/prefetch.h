/* prefetch.h - the stage-3 parameter schedule: need/done events in, gather/free commands out.
 *
 * Pure C11, holds no tensors and calls nothing. In ZeRO stage 3 the model is cut into units
 * whose parameters live as shards; a unit must be all-gathered before its forward and again
 * before its backward, and freed after. The executor reports need(u) (pre-forward/backward)
 * and done(u) (post-forward/backward); the schedule answers with commands: GATHER u (start an
 * async all-gather of unit u) and FREE u (release its full parameters).
 *
 * Ranks must issue their all-gathers in the same sequence or the collectives mismatch. Each
 * phase therefore has a schedule (the forward order, or its reverse) and a cursor into it:
 * the gathers issued at the cursor ("scheduled": needed, prefetched, skipped or kept) follow
 * the schedule exactly whatever this rank's demands; a unit this rank reaches out of turn
 * makes the cursor issue every unit before it (gathered and at once freed when this rank does
 * not need it), and end() drains the rest. A demand for a unit behind the cursor or outside
 * the schedule is served by an "unscheduled" gather, which is not part of that sequence.
 *
 * Residency carried from phase to phase is the same on every rank that made the same calls:
 * nothing after FORWARD_EVAL or BACKWARD, exactly the keep units of the schedule after a
 * FORWARD. So the guarantee holds across phases too. */
#ifndef ZP_PREFETCH_H
#define ZP_PREFETCH_H

#include <stdint.h>

#include "common/status.h"

typedef enum { ZP_PF_GATHER = 1, ZP_PF_FREE = 2 } zp_pf_cmd_kind;

/* Why a command was issued (for tests and diagnostics; executors need only kind and unit). */
typedef enum {
  ZP_PF_NEEDED = 1,      /* GATHER: the needed unit, reached at its place in the schedule */
  ZP_PF_UNSCHEDULED = 2, /* GATHER: the needed unit, behind the cursor or not in the schedule;
                            the only gather that is not part of the common sequence */
  ZP_PF_PREFETCHED = 3,  /* GATHER: ahead of its need, within the budget */
  ZP_PF_SKIPPED = 4,     /* GATHER then FREE of a scheduled unit this rank passes without
                            needing (by need() reaching a later unit, or end()'s drain) */
  ZP_PF_KEPT = 5,        /* GATHER: FORWARD passes a keep unit without needing it; it stays
                            resident into backward like every keep unit */
  ZP_PF_RELEASED = 6     /* FREE: by done(), or by end() for what must not outlive the phase */
} zp_pf_reason;

typedef struct {
  int32_t kind;   /* zp_pf_cmd_kind */
  int32_t unit;
  int32_t reason; /* zp_pf_reason */
} zp_pf_cmd;

typedef enum {
  ZP_PF_FORWARD = 0,      /* training forward: keep units stay resident after done() */
  ZP_PF_FORWARD_EVAL = 1, /* forward with no backward to follow: done() frees every unit */
  ZP_PF_BACKWARD = 2
} zp_pf_phase;

typedef struct zp_prefetch zp_prefetch;

/* n_units >= 1 units; unit_bytes[u] > 0 their gathered sizes; keep[u] != 0 (keep may be NULL
 * for none) marks units that stay gathered from forward into backward (reshard-after-forward
 * off, or the root unit); budget_bytes >= 0 bounds what prefetching may hold resident
 * (demanded, skipped and kept units are gathered whatever the budget). */
zp_status zp_prefetch_create(int32_t n_units, const int64_t *unit_bytes, const uint8_t *keep,
                             int64_t budget_bytes, zp_prefetch **out);

void zp_prefetch_destroy(zp_prefetch *pf);

/* The least capacity a command buffer must have: 2 * n_units + 2. */
int32_t zp_prefetch_cmd_capacity(const zp_prefetch *pf);

/* The forward order the following phases follow: n distinct unit ids (any subset, 0 <= n <=
 * n_units). Initially 0, 1, ..., n_units-1. Not allowed while a phase is open. */
zp_status zp_prefetch_set_order(zp_prefetch *pf, const int32_t *order, int32_t n);

/* Which units stay gathered from FORWARD into BACKWARD: keep[u] != 0 (NULL for none), as given
 * to create. The executor may widen it between phases, e.g. to the last unit of the order,
 * which backward needs first (kept, it is not gathered again; the residency carried between
 * phases is still the same on every rank that set the same keep). Not allowed while a phase
 * is open. */
zp_status zp_prefetch_set_keep(zp_prefetch *pf, const uint8_t *keep);

/* Writes min(n, cap) ids of the order to out and returns n, its length. */
int32_t zp_prefetch_order(const zp_prefetch *pf, int32_t *out, int32_t cap);

/* Opens a phase (zp_pf_phase). Its schedule: FORWARD and FORWARD_EVAL the order, first to
 * last; BACKWARD the order reversed, leaving out keep units (resident from forward). A phase
 * must be closed by end() before the next begins. */
zp_status zp_prefetch_begin(zp_prefetch *pf, int32_t phase);

/* Unit u is needed now. Commands go to cmds[0 .. *n_out), cap >= zp_prefetch_cmd_capacity():
 * 1. u in the schedule at or after the cursor: each scheduled unit before it not resident is
 *    SKIPPED (GATHER, FREE; in FORWARD a keep unit is KEPT instead), then u is GATHERed
 *    (NEEDED) unless resident; the cursor moves past u.
 * 2. otherwise: GATHER u (UNSCHEDULED) unless resident.
 * 3. prefetch: while the cursor has units, a resident one is passed, another is GATHERed
 *    (PREFETCHED) if live_bytes + its bytes <= budget, else prefetching stops.
 * Afterwards u is resident. A unit may be needed several times in a phase. */
zp_status zp_prefetch_need(zp_prefetch *pf, int32_t u, zp_pf_cmd *cmds, int32_t cap,
                           int32_t *n_out);

/* Unit u's use is over for now. FORWARD: FREE u unless it is a keep unit; FORWARD_EVAL and
 * BACKWARD: FREE u. Then prefetch as need() step 3. u must be resident and must not lie at or
 * after the cursor (either is a done() without its need()). */
zp_status zp_prefetch_done(zp_prefetch *pf, int32_t u, zp_pf_cmd *cmds, int32_t cap,
                           int32_t *n_out);

/* Closes the phase. Drains the schedule from the cursor: resident units are passed; in FORWARD
 * keep units are KEPT; the others SKIPPED. Then FREEs what must not outlive the phase: FORWARD
 * every resident unit that is not a keep unit of the schedule; FORWARD_EVAL and BACKWARD every
 * resident unit (in unit id order). A FORWARD phase records its first-need order (seen()). */
zp_status zp_prefetch_end(zp_prefetch *pf, zp_pf_cmd *cmds, int32_t cap, int32_t *n_out);

/* The units in the order of their first need() during the last ended FORWARD phase: writes
 * min(count, cap) to out and returns the count. */
int32_t zp_prefetch_seen(const zp_prefetch *pf, int32_t *out, int32_t cap);

int32_t zp_prefetch_n_units(const zp_prefetch *pf);
/* The open phase (zp_pf_phase), or -1 when none is open. */
int32_t zp_prefetch_phase(const zp_prefetch *pf);
/* 1 if unit u is resident (gathered and not freed), 0 if not, -1 if u is out of range. */
int32_t zp_prefetch_is_resident(const zp_prefetch *pf, int32_t u);
/* Bytes of the resident units now. */
int64_t zp_prefetch_live_bytes(const zp_prefetch *pf);
/* The most live_bytes since create or reset_peak, counted command by command (a skipped
 * unit's gather counts before its free). */
int64_t zp_prefetch_peak_bytes(const zp_prefetch *pf);
/* Restarts the peak at live_bytes now. */
void zp_prefetch_reset_peak(zp_prefetch *pf);

#endif /* ZP_PREFETCH_H */
