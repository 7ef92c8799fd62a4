/* test_prefetch.c - the stage-3 gather/free schedule (prefetch.h): exact small cases, random
 * two-rank runs checked against a model of residency, and errors. */
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "schedule/prefetch.h"

#define MAX_UNITS 24
#define CAP (2 * MAX_UNITS + 2)

/* ---- exact small cases ----------------------------------------------------------------- */

typedef struct {
  int32_t kind, unit, reason;
} want_cmd;

#define G(u, r) {ZP_PF_GATHER, u, ZP_PF_##r}
#define F(u, r) {ZP_PF_FREE, u, ZP_PF_##r}

/* The call's commands equal want[0 .. n_want). */
static int same_cmds(const char *what, const zp_pf_cmd *got, int32_t n_got, const want_cmd *want,
                     int32_t n_want) {
  int ok = CHECK_MSG(n_got == n_want, "%s: %d commands, expected %d", what, n_got, n_want);
  for (int32_t k = 0; ok && k < n_got; k++)
    ok = CHECK_MSG(got[k].kind == want[k].kind && got[k].unit == want[k].unit &&
                       got[k].reason == want[k].reason,
                   "%s: command %d is (%d, %d, reason %d), expected (%d, %d, reason %d)", what, k,
                   got[k].kind, got[k].unit, got[k].reason, want[k].kind, want[k].unit,
                   want[k].reason);
  return ok;
}

#define EXPECT(call, ...)                                                               \
  do {                                                                                  \
    static const want_cmd want_[] = {__VA_ARGS__};                                      \
    zp_pf_cmd got_[CAP];                                                                \
    int32_t n_got_ = -1;                                                                \
    if (CHECK_OK(call))                                                                 \
      same_cmds(#call, got_, n_got_, want_ + 1, (int32_t)(sizeof want_ / sizeof want_[0]) - 1); \
  } while (0)
/* The first want_ entry is a placeholder so that an empty list compiles. */
#define NONE {0, 0, 0}
#define NEED(pf, u, ...) EXPECT(zp_prefetch_need(pf, u, got_, CAP, &n_got_), NONE, ##__VA_ARGS__)
#define DONE(pf, u, ...) EXPECT(zp_prefetch_done(pf, u, got_, CAP, &n_got_), NONE, ##__VA_ARGS__)
#define END(pf, ...) EXPECT(zp_prefetch_end(pf, got_, CAP, &n_got_), NONE, ##__VA_ARGS__)

static zp_prefetch *make(int32_t n, const int64_t *bytes, const uint8_t *keep, int64_t budget) {
  zp_prefetch *pf = NULL;
  if (!CHECK_OK(zp_prefetch_create(n, bytes, keep, budget, &pf)))
    return NULL;
  return pf;
}

void test_prefetch_exact_commands(void) {
  static const int64_t bytes[5] = {10, 10, 10, 10, 10};
  /* a window of two units (budget 25): the needed unit and one ahead */
  zp_prefetch *pf = make(4, bytes, NULL, 25);
  if (!pf)
    return;
  CHECK_EQ(zp_prefetch_cmd_capacity(pf), 10);
  CHECK_EQ(zp_prefetch_phase(pf), -1);
  CHECK_OK(zp_prefetch_begin(pf, ZP_PF_FORWARD));
  CHECK_EQ(zp_prefetch_phase(pf), ZP_PF_FORWARD);
  NEED(pf, 0, G(0, NEEDED), G(1, PREFETCHED));
  CHECK_EQ(zp_prefetch_live_bytes(pf), 20);
  DONE(pf, 0, F(0, RELEASED), G(2, PREFETCHED));
  NEED(pf, 1);
  NEED(pf, 1); /* needed again: already resident */
  DONE(pf, 1, F(1, RELEASED), G(3, PREFETCHED));
  NEED(pf, 2);
  DONE(pf, 2, F(2, RELEASED));
  NEED(pf, 3);
  DONE(pf, 3, F(3, RELEASED));
  NEED(pf, 0, G(0, UNSCHEDULED)); /* behind the cursor */
  END(pf, F(0, RELEASED));        /* needed, never done */
  CHECK_EQ(zp_prefetch_live_bytes(pf), 0);
  CHECK_EQ(zp_prefetch_peak_bytes(pf), 20);
  zp_prefetch_reset_peak(pf);
  CHECK_EQ(zp_prefetch_peak_bytes(pf), 0);

  /* demands out of schedule order: the units before the needed one are skipped (gathered and
   * freed), a prefetched unit that is never needed is freed by end(), end() drains the rest */
  CHECK_OK(zp_prefetch_begin(pf, ZP_PF_FORWARD_EVAL));
  NEED(pf, 2, G(0, SKIPPED), F(0, SKIPPED), G(1, SKIPPED), F(1, SKIPPED), G(2, NEEDED),
       G(3, PREFETCHED));
  NEED(pf, 1, G(1, UNSCHEDULED));
  CHECK_EQ(zp_prefetch_live_bytes(pf), 30);
  DONE(pf, 1, F(1, RELEASED));
  DONE(pf, 2, F(2, RELEASED));
  END(pf, F(3, RELEASED));
  CHECK_EQ(zp_prefetch_peak_bytes(pf), 30);
  zp_prefetch_destroy(pf);

  /* budget 0: nothing is prefetched; end() drains what was never needed */
  pf = make(4, bytes, NULL, 0);
  if (!pf)
    return;
  CHECK_OK(zp_prefetch_begin(pf, ZP_PF_FORWARD));
  NEED(pf, 1, G(0, SKIPPED), F(0, SKIPPED), G(1, NEEDED));
  DONE(pf, 1, F(1, RELEASED));
  END(pf, G(2, SKIPPED), F(2, SKIPPED), G(3, SKIPPED), F(3, SKIPPED));
  CHECK_EQ(zp_prefetch_peak_bytes(pf), 10);
  zp_prefetch_destroy(pf);

  /* keep units: unit 0 (the root) and 3 stay resident from forward into backward, where the
   * schedule (3, 2, 1, 0 reversed, keep units left out) is 2, 1 */
  static const uint8_t keep[4] = {1, 0, 0, 1};
  pf = make(4, bytes, keep, 20);
  if (!pf)
    return;
  CHECK_OK(zp_prefetch_begin(pf, ZP_PF_FORWARD));
  NEED(pf, 0, G(0, NEEDED), G(1, PREFETCHED));
  NEED(pf, 1);
  DONE(pf, 1, F(1, RELEASED), G(2, PREFETCHED));
  NEED(pf, 3, G(3, NEEDED)); /* beyond the budget: a need is always served */
  DONE(pf, 3);
  DONE(pf, 0);
  END(pf, F(2, RELEASED)); /* prefetched, never needed */
  CHECK_EQ(zp_prefetch_live_bytes(pf), 20);
  CHECK_EQ(zp_prefetch_is_resident(pf, 0), 1);
  CHECK_EQ(zp_prefetch_is_resident(pf, 3), 1);
  CHECK_OK(zp_prefetch_begin(pf, ZP_PF_BACKWARD));
  NEED(pf, 3); /* resident from forward, not in the backward schedule */
  DONE(pf, 3, F(3, RELEASED), G(2, PREFETCHED));
  NEED(pf, 2);
  DONE(pf, 2, F(2, RELEASED), G(1, PREFETCHED));
  NEED(pf, 0);
  END(pf, F(0, RELEASED), F(1, RELEASED)); /* 1 prefetched, never needed */
  CHECK_EQ(zp_prefetch_live_bytes(pf), 0);

  /* a keep unit passed by forward is KEPT, not skipped; one never reached is kept by end() */
  CHECK_OK(zp_prefetch_begin(pf, ZP_PF_FORWARD));
  NEED(pf, 1, G(0, KEPT), G(1, NEEDED));
  DONE(pf, 1, F(1, RELEASED), G(2, PREFETCHED));
  END(pf, G(3, KEPT), F(2, RELEASED));
  CHECK_OK(zp_prefetch_begin(pf, ZP_PF_FORWARD_EVAL)); /* forward again: keep units passed */
  NEED(pf, 3, G(1, SKIPPED), F(1, SKIPPED), G(2, SKIPPED), F(2, SKIPPED));
  DONE(pf, 3, F(3, RELEASED));
  END(pf, F(0, RELEASED));
  zp_prefetch_destroy(pf);
}

void test_prefetch_keep_last_unit(void) {
  /* the executor keeps the root (0) and, from the second step on, the last unit of the order
   * (3): backward starts on it without gathering it again, and the peak stays at the root plus
   * two units, as without it */
  static const int64_t bytes[4] = {10, 10, 10, 10};
  static const uint8_t root[4] = {1, 0, 0, 0}, root_and_last[4] = {1, 0, 0, 1};
  zp_prefetch *pf = make(4, bytes, root, 30);
  if (!pf)
    return;
  CHECK_OK(zp_prefetch_set_keep(pf, root_and_last));
  CHECK_OK(zp_prefetch_begin(pf, ZP_PF_FORWARD));
  CHECK_FAILS(zp_prefetch_set_keep(pf, root), ZP_ERR_STATE); /* not during a phase */
  NEED(pf, 0, G(0, NEEDED), G(1, PREFETCHED), G(2, PREFETCHED));
  NEED(pf, 1);
  DONE(pf, 1, F(1, RELEASED), G(3, PREFETCHED));
  NEED(pf, 2);
  DONE(pf, 2, F(2, RELEASED));
  NEED(pf, 3);
  DONE(pf, 3); /* kept */
  DONE(pf, 0);
  END(pf);
  CHECK_EQ(zp_prefetch_live_bytes(pf), 20);
  CHECK_OK(zp_prefetch_begin(pf, ZP_PF_BACKWARD)); /* schedule 2, 1 */
  NEED(pf, 3, G(2, PREFETCHED));                   /* resident: no gather */
  DONE(pf, 3, F(3, RELEASED), G(1, PREFETCHED));
  NEED(pf, 2);
  DONE(pf, 2, F(2, RELEASED));
  NEED(pf, 1);
  DONE(pf, 1, F(1, RELEASED));
  NEED(pf, 0);
  END(pf, F(0, RELEASED));
  CHECK_EQ(zp_prefetch_live_bytes(pf), 0);
  CHECK_EQ(zp_prefetch_peak_bytes(pf), 30);
  /* back to the root alone: the last unit is freed after its forward again */
  CHECK_OK(zp_prefetch_set_keep(pf, root));
  CHECK_OK(zp_prefetch_begin(pf, ZP_PF_FORWARD));
  NEED(pf, 0, G(0, NEEDED), G(1, PREFETCHED), G(2, PREFETCHED));
  NEED(pf, 3, G(3, NEEDED));
  DONE(pf, 3, F(3, RELEASED));
  END(pf, F(1, RELEASED), F(2, RELEASED)); /* prefetched, never needed */
  CHECK_EQ(zp_prefetch_is_resident(pf, 0), 1);
  CHECK_EQ(zp_prefetch_live_bytes(pf), 10);
  zp_prefetch_destroy(pf);
}

void test_prefetch_order_and_seen(void) {
  static const int64_t bytes[5] = {1, 2, 3, 4, 5};
  static const uint8_t keep[5] = {0, 0, 1, 0, 0};
  zp_prefetch *pf = make(5, bytes, keep, 0);
  if (!pf)
    return;
  int32_t out[5];
  CHECK_EQ(zp_prefetch_seen(pf, out, 5), 0);
  CHECK_EQ(zp_prefetch_order(pf, out, 5), 5);
  for (int32_t k = 0; k < 5; k++)
    CHECK_EQ(out[k], k);
  static const int32_t order[3] = {4, 2, 0};
  CHECK_OK(zp_prefetch_set_order(pf, order, 3));
  CHECK_EQ(zp_prefetch_order(pf, out, 2), 3); /* a short buffer gets a prefix */
  CHECK(out[0] == 4 && out[1] == 2);

  /* forward in another order than the schedule 4, 2, 0; units 1, 3 are outside it */
  CHECK_OK(zp_prefetch_begin(pf, ZP_PF_FORWARD));
  NEED(pf, 3, G(3, UNSCHEDULED));
  NEED(pf, 0, G(4, SKIPPED), F(4, SKIPPED), G(2, KEPT), G(0, NEEDED));
  NEED(pf, 3);
  NEED(pf, 4, G(4, UNSCHEDULED));
  DONE(pf, 4, F(4, RELEASED));
  END(pf, F(0, RELEASED), F(3, RELEASED));
  CHECK_EQ(zp_prefetch_seen(pf, out, 5), 3);
  CHECK(out[0] == 3 && out[1] == 0 && out[2] == 4);

  /* backward: 0 then 4 (2 is a keep unit); neither eval nor backward changes seen() */
  CHECK_OK(zp_prefetch_begin(pf, ZP_PF_BACKWARD));
  NEED(pf, 4, G(0, SKIPPED), F(0, SKIPPED), G(4, NEEDED));
  NEED(pf, 2);
  DONE(pf, 2, F(2, RELEASED));
  END(pf, F(4, RELEASED));
  CHECK_OK(zp_prefetch_begin(pf, ZP_PF_FORWARD_EVAL));
  NEED(pf, 1, G(1, UNSCHEDULED));
  END(pf, G(4, SKIPPED), F(4, SKIPPED), G(2, SKIPPED), F(2, SKIPPED), G(0, SKIPPED),
      F(0, SKIPPED), F(1, RELEASED));
  CHECK_EQ(zp_prefetch_seen(pf, out, 5), 3);
  CHECK(out[0] == 3 && out[1] == 0 && out[2] == 4);

  /* an empty order: every gather is unscheduled, end() frees */
  CHECK_OK(zp_prefetch_set_order(pf, NULL, 0));
  CHECK_EQ(zp_prefetch_order(pf, out, 5), 0);
  CHECK_OK(zp_prefetch_begin(pf, ZP_PF_FORWARD));
  NEED(pf, 2, G(2, UNSCHEDULED));
  DONE(pf, 2);
  END(pf, F(2, RELEASED)); /* a keep unit outside the schedule does not outlive forward */
  CHECK_EQ(zp_prefetch_seen(pf, out, 5), 1);
  CHECK_EQ(out[0], 2);
  zp_prefetch_destroy(pf);
}

/* ---- random runs: two ranks, each against a reference model ------------------------------ */

typedef struct {
  zp_prefetch *pf;
  zt_rng rng;
  int32_t n;
  const int64_t *bytes;
  const uint8_t *keep;
  int64_t budget;
  uint8_t res[MAX_UNITS];     /* residency, simulated from the commands */
  uint8_t needed[MAX_UNITS];  /* needed and not yet done */
  uint8_t pending[MAX_UNITS]; /* prefetched and not yet needed or freed */
  uint8_t was_needed[MAX_UNITS];
  int64_t live, peak;
  int32_t seq[2 * MAX_UNITS]; /* the phase's scheduled gathers */
  int32_t n_seq;
  int32_t first[MAX_UNITS]; /* the phase's first-need order */
  int32_t n_first;
  int32_t seen[MAX_UNITS]; /* the first-need order of the last FORWARD */
  int32_t n_seen;
  /* the reference: the rules of prefetch.h, written out plainly */
  int32_t phase, sched[MAX_UNITS], n_sched, cursor;
  uint8_t m_res[MAX_UNITS];
  int64_t m_live;
  want_cmd want[CAP];
  int32_t n_want;
} rank;

static void m_gather(rank *r, int32_t u, int32_t why) {
  r->m_res[u] = 1;
  r->m_live += r->bytes[u];
  r->want[r->n_want++] = (want_cmd){ZP_PF_GATHER, u, why};
}

static void m_free(rank *r, int32_t u, int32_t why) {
  r->m_res[u] = 0;
  r->m_live -= r->bytes[u];
  r->want[r->n_want++] = (want_cmd){ZP_PF_FREE, u, why};
}

/* The unit at the cursor, not needed: passed if resident, kept (FORWARD, keep unit), or skipped. */
static void m_pass(rank *r) {
  const int32_t x = r->sched[r->cursor++];
  if (r->m_res[x])
    return;
  if (r->phase == ZP_PF_FORWARD && r->keep[x]) {
    m_gather(r, x, ZP_PF_KEPT);
  } else {
    m_gather(r, x, ZP_PF_SKIPPED);
    m_free(r, x, ZP_PF_SKIPPED);
  }
}

static void m_prefetch(rank *r) {
  for (; r->cursor < r->n_sched; r->cursor++) {
    const int32_t x = r->sched[r->cursor];
    if (r->m_res[x])
      continue;
    if (r->m_live + r->bytes[x] > r->budget)
      break;
    m_gather(r, x, ZP_PF_PREFETCHED);
  }
}

static void m_need(rank *r, int32_t u) {
  r->n_want = 0;
  int32_t p = -1;
  for (int32_t k = r->cursor; k < r->n_sched; k++)
    if (r->sched[k] == u)
      p = k;
  if (p >= 0) {
    while (r->cursor < p)
      m_pass(r);
    r->cursor++;
    if (!r->m_res[u])
      m_gather(r, u, ZP_PF_NEEDED);
  } else if (!r->m_res[u]) {
    m_gather(r, u, ZP_PF_UNSCHEDULED);
  }
  m_prefetch(r);
}

static void m_done(rank *r, int32_t u) {
  r->n_want = 0;
  if (r->phase != ZP_PF_FORWARD || !r->keep[u])
    m_free(r, u, ZP_PF_RELEASED);
  m_prefetch(r);
}

static void m_end(rank *r) {
  r->n_want = 0;
  while (r->cursor < r->n_sched)
    m_pass(r);
  for (int32_t u = 0; u < r->n; u++) {
    int in_sched = 0;
    for (int32_t k = 0; k < r->n_sched; k++)
      in_sched |= r->sched[k] == u;
    if (r->m_res[u] && !(r->phase == ZP_PF_FORWARD && r->keep[u] && in_sched))
      m_free(r, u, ZP_PF_RELEASED);
  }
}

static int64_t bytes_where(const rank *r, const uint8_t *set, const uint8_t *and_set) {
  int64_t sum = 0;
  for (int32_t u = 0; u < r->n; u++)
    if (set[u] && (and_set == NULL || and_set[u]))
      sum += r->bytes[u];
  return sum;
}

/* Applies a call's commands to the model, checking each against it. */
static int apply(rank *r, const zp_pf_cmd *cmds, int32_t n_cmds) {
  int ok = 1;
  for (int32_t k = 0; ok && k < n_cmds; k++) {
    const int32_t u = cmds[k].unit, why = cmds[k].reason;
    ok = CHECK_MSG(u >= 0 && u < r->n, "command %d names unit %d", k, u);
    if (ok && cmds[k].kind == ZP_PF_GATHER) {
      ok = CHECK_MSG(!r->res[u], "GATHER %d of a resident unit", u) &&
           CHECK_MSG(why >= ZP_PF_NEEDED && why <= ZP_PF_KEPT && why != ZP_PF_RELEASED,
                     "GATHER %d with reason %d", u, why);
      if (ok && why == ZP_PF_SKIPPED)
        ok = CHECK_MSG(k + 1 < n_cmds && cmds[k + 1].kind == ZP_PF_FREE && cmds[k + 1].unit == u &&
                           cmds[k + 1].reason == ZP_PF_SKIPPED,
                       "a skipped GATHER %d is not followed by its FREE", u);
      if (ok && why == ZP_PF_KEPT)
        ok = CHECK_MSG(r->keep[u], "unit %d KEPT, but it is not a keep unit", u);
      r->res[u] = 1;
      r->live += r->bytes[u];
      if (r->live > r->peak)
        r->peak = r->live;
      r->pending[u] = why == ZP_PF_PREFETCHED;
      if (why != ZP_PF_UNSCHEDULED)
        r->seq[r->n_seq++] = u;
    } else if (ok) {
      ok = CHECK_MSG(cmds[k].kind == ZP_PF_FREE, "command kind %d", cmds[k].kind) &&
           CHECK_MSG(r->res[u], "FREE %d of a unit that is not resident", u) &&
           CHECK_MSG(why == ZP_PF_SKIPPED || why == ZP_PF_RELEASED, "FREE %d with reason %d", u,
                     why);
      if (ok && why == ZP_PF_SKIPPED)
        ok = CHECK_MSG(k > 0 && cmds[k - 1].kind == ZP_PF_GATHER && cmds[k - 1].unit == u,
                       "a skipped FREE %d does not follow its GATHER", u);
      r->res[u] = r->needed[u] = r->pending[u] = 0;
      r->live -= r->bytes[u];
    }
  }
  /* the object agrees with the model; prefetching kept within the budget */
  for (int32_t u = 0; ok && u < r->n; u++)
    ok = CHECK_MSG(zp_prefetch_is_resident(r->pf, u) == r->res[u], "unit %d: is_resident %d, "
                   "the commands say %d", u, zp_prefetch_is_resident(r->pf, u), r->res[u]);
  ok = ok && CHECK_EQ(zp_prefetch_live_bytes(r->pf), r->live);
  ok = ok && CHECK_EQ(zp_prefetch_peak_bytes(r->pf), r->peak);
  const int64_t pending = bytes_where(r, r->pending, NULL);
  ok = ok && CHECK_MSG(pending <= r->budget, "prefetched units hold %lld bytes, budget %lld",
                       (long long)pending, (long long)r->budget);
  const int64_t bound = r->budget + bytes_where(r, r->needed, NULL) +
                        bytes_where(r, r->res, r->keep);
  ok = ok && CHECK_MSG(r->live <= bound, "live %lld > budget + needed + resident keep = %lld",
                       (long long)r->live, (long long)bound);
  return ok;
}

static int r_need(rank *r, int32_t u) {
  zp_pf_cmd cmds[CAP];
  int32_t n_cmds = -1;
  if (!CHECK_OK(zp_prefetch_need(r->pf, u, cmds, CAP, &n_cmds)))
    return 0;
  m_need(r, u);
  if (!same_cmds("need (against the reference)", cmds, n_cmds, r->want, r->n_want))
    return 0;
  r->needed[u] = 1;
  r->pending[u] = 0;
  if (!r->was_needed[u]) {
    r->was_needed[u] = 1;
    r->first[r->n_first++] = u;
  }
  return apply(r, cmds, n_cmds) && CHECK_MSG(r->res[u], "need(%d) left it not resident", u);
}

static int r_done(rank *r, int32_t u, int32_t phase) {
  zp_pf_cmd cmds[CAP];
  int32_t n_cmds = -1;
  if (!CHECK_OK(zp_prefetch_done(r->pf, u, cmds, CAP, &n_cmds)))
    return 0;
  m_done(r, u);
  if (!same_cmds("done (against the reference)", cmds, n_cmds, r->want, r->n_want))
    return 0;
  const int frees = !(phase == ZP_PF_FORWARD && r->keep[u]);
  int ok = CHECK_MSG(frees ? n_cmds >= 1 && cmds[0].kind == ZP_PF_FREE && cmds[0].unit == u
                           : n_cmds == 0 || cmds[0].kind == ZP_PF_GATHER,
                     "done(%d) in phase %d: frees %d, first command (%d, %d)", u, phase, frees,
                     n_cmds > 0 ? cmds[0].kind : -1, n_cmds > 0 ? cmds[0].unit : -1);
  r->needed[u] = 0;
  r->pending[u] = 0;
  return ok && apply(r, cmds, n_cmds);
}

/* The phase's schedule as the caller computes it from the order. */
static int32_t schedule_of(const int32_t *order, int32_t n_order, const uint8_t *keep,
                           int32_t phase, int32_t *sched) {
  int32_t n = 0;
  for (int32_t k = 0; k < n_order; k++) {
    int32_t u = phase == ZP_PF_BACKWARD ? order[n_order - 1 - k] : order[k];
    if (phase != ZP_PF_BACKWARD || !keep[u])
      sched[n++] = u;
  }
  return n;
}

static void shuffle(zt_rng *g, int32_t *v, int32_t n) {
  for (int32_t i = n - 1; i > 0; i--) {
    int32_t j = (int32_t)zt_range(g, 0, i), t = v[i];
    v[i] = v[j];
    v[j] = t;
  }
}

/* One rank's phase: random demands (mostly the schedule's units, roughly in its order, some
 * left out, some outside it, some repeated), done() of random outstanding units in between.
 * Returns 0 on a failed check. */
static int run_phase(rank *r, int32_t phase, const int32_t *sched, int32_t n_sched) {
  zt_rng *g = &r->rng;
  int32_t demands[3 * MAX_UNITS], n_dem = 0;
  const double p_take = zt_range(g, 0, 2) == 0 ? 1.0 : zt_unit(g);
  for (int32_t k = 0; k < n_sched; k++)
    if (zt_unit(g) < p_take)
      demands[n_dem++] = sched[k];
  for (int32_t u = 0; u < r->n; u++) /* units outside the schedule (backward: keep units) */
    if (zt_range(g, 0, 5) == 0)
      demands[n_dem++] = u;
  const int mix = (int)zt_range(g, 0, 3);
  if (mix == 0) {
    shuffle(g, demands, n_dem);
  } else if (mix == 1) {
    for (int32_t s = 0; s < 3 && n_dem > 1; s++) {
      int32_t i = (int32_t)zt_range(g, 0, n_dem - 1), j = (int32_t)zt_range(g, 0, n_dem - 1);
      int32_t t = demands[i];
      demands[i] = demands[j];
      demands[j] = t;
    }
  }
  for (int32_t s = (int32_t)zt_range(g, 0, 3); s > 0 && n_dem > 0; s--) /* repeats */
  {
    const int32_t again = demands[zt_range(g, 0, n_dem - 1)];
    demands[n_dem++] = again;
  }

  for (int32_t k = 0; k < n_dem; k++) {
    /* done() of some outstanding units (any order: nested and interleaved uses) */
    for (int32_t u = 0; u < r->n; u++)
      if (r->needed[u] && zt_range(g, 0, 2) == 0 && !r_done(r, u, phase))
        return 0;
    if (!r_need(r, demands[k]))
      return 0;
  }
  for (int32_t u = 0; u < r->n; u++) /* most uses end; some never do */
    if (r->needed[u] && zt_range(g, 0, 7) != 0 && !r_done(r, u, phase))
      return 0;
  return 1;
}

static int r_end(rank *r, int32_t phase, const int32_t *sched, int32_t n_sched) {
  zp_pf_cmd cmds[CAP];
  int32_t n_cmds = -1;
  if (!CHECK_OK(zp_prefetch_end(r->pf, cmds, CAP, &n_cmds)))
    return 0;
  m_end(r);
  if (!same_cmds("end (against the reference)", cmds, n_cmds, r->want, r->n_want) ||
      !apply(r, cmds, n_cmds))
    return 0;
  /* what outlives the phase: after FORWARD exactly the keep units of its schedule */
  uint8_t want[MAX_UNITS] = {0};
  if (phase == ZP_PF_FORWARD)
    for (int32_t k = 0; k < n_sched; k++)
      want[sched[k]] = r->keep[sched[k]];
  int ok = 1;
  for (int32_t u = 0; ok && u < r->n; u++)
    ok = CHECK_MSG(r->res[u] == want[u], "after phase %d unit %d resident %d, expected %d", phase,
                   u, r->res[u], want[u]);
  memset(r->needed, 0, sizeof r->needed);
  memset(r->pending, 0, sizeof r->pending);
  if (phase == ZP_PF_FORWARD) { /* seen() changes after FORWARD only */
    memcpy(r->seen, r->first, sizeof r->seen);
    r->n_seen = r->n_first;
  }
  int32_t seen[MAX_UNITS];
  ok = ok && CHECK_EQ(zp_prefetch_seen(r->pf, seen, MAX_UNITS), r->n_seen);
  for (int32_t k = 0; ok && k < r->n_seen; k++)
    ok = CHECK_EQ(seen[k], r->seen[k]);
  return ok;
}

void test_prefetch_random_two_ranks(void) {
  zt_rng g = zt_rng_seed(3);
  int64_t bytes[MAX_UNITS];
  uint8_t keep[MAX_UNITS];
  int32_t order[MAX_UNITS], sched[MAX_UNITS];
  static rank ranks[2];
  int phases_run = 0, skips_seen = 0;
  for (int rep = 0; rep < 600; rep++) {
    const int32_t n = (int32_t)zt_range(&g, 1, MAX_UNITS);
    const int64_t max_bytes = zt_range(&g, 0, 1) ? 1 : 100; /* equal sizes or mixed */
    int64_t total = 0;
    for (int32_t u = 0; u < n; u++) {
      bytes[u] = zt_range(&g, 1, max_bytes);
      keep[u] = zt_range(&g, 0, 3) == 0;
      total += bytes[u];
    }
    int ok = 1;
    for (int i = 0; i < 2; i++) {
      rank *r = &ranks[i];
      memset(r, 0, sizeof *r);
      r->rng = zt_rng_seed(1000 * (uint64_t)rep + (uint64_t)i);
      r->n = n;
      r->bytes = bytes;
      r->keep = keep;
      /* budgets may differ between ranks: they change when gathers happen, not which */
      const int64_t kind = zt_range(&g, 0, 4);
      r->budget = kind == 0 ? 0 : kind == 1 ? total : zt_range(&g, 0, total);
      r->pf = make(n, bytes, keep, r->budget);
      ok = ok && r->pf != NULL;
    }
    int32_t n_order = n;
    for (int32_t u = 0; u < n; u++)
      order[u] = u;
    int32_t prev = -1;
    for (int step = 0; ok && step < 10; step++) {
      /* between phases, sometimes a new order: a random subset, or rank 0's seen() */
      const int64_t change = zt_range(&g, 0, 5);
      if (change <= 1) {
        if (change == 0) {
          for (int32_t u = 0; u < n; u++)
            order[u] = u;
          shuffle(&g, order, n);
          n_order = (int32_t)zt_range(&g, 0, n);
        } else {
          n_order = zp_prefetch_seen(ranks[0].pf, order, MAX_UNITS);
        }
        for (int i = 0; ok && i < 2; i++)
          ok = CHECK_OK(zp_prefetch_set_order(ranks[i].pf, order, n_order));
      }
      /* mostly forward then backward; sometimes eval, or forward twice */
      int32_t phase = prev == ZP_PF_FORWARD && zt_range(&g, 0, 5) != 0 ? ZP_PF_BACKWARD
                      : zt_range(&g, 0, 4) == 0                      ? ZP_PF_FORWARD_EVAL
                                                                     : ZP_PF_FORWARD;
      const int32_t n_sched = schedule_of(order, n_order, keep, phase, sched);
      /* the scheduled gathers this phase must issue: its schedule less what is resident */
      int32_t expect[MAX_UNITS], n_expect = 0;
      for (int32_t k = 0; k < n_sched; k++)
        if (!ranks[0].res[sched[k]])
          expect[n_expect++] = sched[k];
      for (int i = 0; ok && i < 2; i++) {
        rank *r = &ranks[i];
        r->n_seq = r->n_first = 0;
        memset(r->was_needed, 0, sizeof r->was_needed);
        if (zt_range(&g, 0, 3) == 0) {
          zp_prefetch_reset_peak(r->pf);
          r->peak = r->live;
        }
        r->phase = phase;
        r->n_sched = n_sched;
        r->cursor = 0;
        memcpy(r->sched, sched, sizeof r->sched);
        ok = CHECK_OK(zp_prefetch_begin(r->pf, phase)) && run_phase(r, phase, sched, n_sched) &&
             r_end(r, phase, sched, n_sched);
        ok = ok && CHECK_MSG(r->n_seq == n_expect, "rank %d issued %d scheduled gathers, the "
                             "schedule has %d to gather", i, r->n_seq, n_expect);
        for (int32_t k = 0; ok && k < n_expect; k++)
          ok = CHECK_MSG(r->seq[k] == expect[k], "rank %d: scheduled gather %d is unit %d, the "
                         "schedule says %d", i, k, r->seq[k], expect[k]);
      }
      /* THE consistency property: both ranks issued the same scheduled gathers */
      ok = ok && CHECK_EQ(ranks[0].n_seq, ranks[1].n_seq);
      for (int32_t k = 0; ok && k < ranks[0].n_seq; k++)
        ok = CHECK_EQ(ranks[0].seq[k], ranks[1].seq[k]);
      for (int32_t u = 0; ok && u < n; u++)
        ok = CHECK_EQ(ranks[0].res[u], ranks[1].res[u]);
      skips_seen += ranks[0].n_seq != ranks[0].n_first;
      phases_run++;
      prev = phase;
    }
    for (int i = 0; i < 2; i++)
      zp_prefetch_destroy(ranks[i].pf);
    if (!ok) {
      printf("  (rep %d: n=%d budgets %lld, %lld)\n", rep, n, (long long)ranks[0].budget,
             (long long)ranks[1].budget);
      return;
    }
  }
  CHECK(phases_run == 6000);
  CHECK(skips_seen > 1000); /* the demands did leave units out */
}

/* ---- errors ----------------------------------------------------------------------------- */

static const int64_t four_bytes[4] = {10, 20, 30, 40};

static void err_create(void *unused) {
  (void)unused;
  zp_prefetch *pf = (zp_prefetch *)&pf;
  static const int64_t zero[2] = {10, 0}, huge[2] = {INT64_MAX, 1};
  CHECK_FAILS(zp_prefetch_create(0, four_bytes, NULL, 0, &pf), ZP_ERR_INVALID);
  CHECK(pf == NULL);
  CHECK_FAILS(zp_prefetch_create(2, NULL, NULL, 0, &pf), ZP_ERR_INVALID);
  CHECK_FAILS(zp_prefetch_create(2, zero, NULL, 0, &pf), ZP_ERR_INVALID);
  CHECK_FAILS(zp_prefetch_create(2, huge, NULL, 0, &pf), ZP_ERR_INVALID);
  CHECK_FAILS(zp_prefetch_create(4, four_bytes, NULL, -1, &pf), ZP_ERR_INVALID);
  CHECK_FAILS(zp_prefetch_create(4, four_bytes, NULL, 0, NULL), ZP_ERR_INVALID);
}

static void err_no_phase(void *unused) {
  (void)unused;
  zp_pf_cmd cmds[CAP];
  int32_t n_out;
  zp_prefetch *pf = make(4, four_bytes, NULL, 0);
  if (!pf)
    return;
  CHECK_FAILS(zp_prefetch_need(pf, 0, cmds, CAP, &n_out), ZP_ERR_STATE);
  CHECK_FAILS(zp_prefetch_done(pf, 0, cmds, CAP, &n_out), ZP_ERR_STATE);
  CHECK_FAILS(zp_prefetch_end(pf, cmds, CAP, &n_out), ZP_ERR_STATE);
  zp_prefetch_destroy(pf);
}

static void err_unit_range(void *unused) {
  (void)unused;
  zp_pf_cmd cmds[CAP];
  int32_t n_out;
  zp_prefetch *pf = make(4, four_bytes, NULL, 0);
  if (!pf)
    return;
  CHECK_OK(zp_prefetch_begin(pf, ZP_PF_FORWARD));
  CHECK_FAILS(zp_prefetch_need(pf, 4, cmds, CAP, &n_out), ZP_ERR_RANGE);
  CHECK_FAILS(zp_prefetch_need(pf, -1, cmds, CAP, &n_out), ZP_ERR_RANGE);
  CHECK_FAILS(zp_prefetch_done(pf, 4, cmds, CAP, &n_out), ZP_ERR_RANGE);
  CHECK_EQ(zp_prefetch_is_resident(pf, 4), -1);
  CHECK_EQ(zp_prefetch_is_resident(pf, -1), -1);
  zp_prefetch_destroy(pf);
}

static void err_capacity(void *unused) {
  (void)unused;
  zp_pf_cmd cmds[CAP];
  int32_t n_out;
  zp_prefetch *pf = make(4, four_bytes, NULL, 0);
  if (!pf)
    return;
  CHECK_OK(zp_prefetch_begin(pf, ZP_PF_FORWARD));
  CHECK_FAILS(zp_prefetch_need(pf, 0, cmds, 9, &n_out), ZP_ERR_INVALID);
  CHECK_FAILS(zp_prefetch_need(pf, 0, NULL, CAP, &n_out), ZP_ERR_INVALID);
  CHECK_FAILS(zp_prefetch_need(pf, 0, cmds, CAP, NULL), ZP_ERR_INVALID);
  CHECK_FAILS(zp_prefetch_end(pf, cmds, 9, &n_out), ZP_ERR_INVALID);
  CHECK_OK(zp_prefetch_need(pf, 0, cmds, 10, &n_out));
  CHECK_FAILS(zp_prefetch_done(pf, 0, cmds, 0, &n_out), ZP_ERR_INVALID);
  CHECK_EQ(zp_prefetch_is_resident(pf, 0), 1);
  zp_prefetch_destroy(pf);
}

static void err_order(void *unused) {
  (void)unused;
  zp_pf_cmd cmds[CAP];
  int32_t n_out, out[4];
  zp_prefetch *pf = make(4, four_bytes, NULL, 0);
  if (!pf)
    return;
  static const int32_t dup[3] = {2, 0, 2}, range[2] = {1, 4}, neg[1] = {-1}, ok3[3] = {3, 1, 0};
  static const int32_t five[5] = {0, 1, 2, 3, 0};
  CHECK_FAILS(zp_prefetch_set_order(pf, dup, 3), ZP_ERR_INVALID);
  CHECK_FAILS(zp_prefetch_set_order(pf, range, 2), ZP_ERR_RANGE);
  CHECK_FAILS(zp_prefetch_set_order(pf, neg, 1), ZP_ERR_RANGE);
  CHECK_FAILS(zp_prefetch_set_order(pf, five, 5), ZP_ERR_INVALID);
  CHECK_FAILS(zp_prefetch_set_order(pf, ok3, -1), ZP_ERR_INVALID);
  CHECK_FAILS(zp_prefetch_set_order(pf, NULL, 2), ZP_ERR_INVALID);
  /* the failed calls left the order alone, and a later duplicate check still works */
  CHECK_EQ(zp_prefetch_order(pf, out, 4), 4);
  CHECK(out[0] == 0 && out[1] == 1 && out[2] == 2 && out[3] == 3);
  CHECK_FAILS(zp_prefetch_set_order(pf, dup, 3), ZP_ERR_INVALID);
  CHECK_OK(zp_prefetch_set_order(pf, ok3, 3));
  CHECK_OK(zp_prefetch_begin(pf, ZP_PF_FORWARD));
  CHECK_FAILS(zp_prefetch_set_order(pf, ok3, 2), ZP_ERR_STATE);
  CHECK_OK(zp_prefetch_end(pf, cmds, CAP, &n_out));
  CHECK_EQ(zp_prefetch_order(pf, out, 4), 3);
  CHECK(out[0] == 3 && out[1] == 1 && out[2] == 0);
  zp_prefetch_destroy(pf);
}

static void err_phase(void *unused) {
  (void)unused;
  zp_pf_cmd cmds[CAP];
  int32_t n_out;
  zp_prefetch *pf = make(4, four_bytes, NULL, 0);
  if (!pf)
    return;
  CHECK_FAILS(zp_prefetch_begin(pf, 3), ZP_ERR_INVALID);
  CHECK_FAILS(zp_prefetch_begin(pf, -1), ZP_ERR_INVALID);
  CHECK_EQ(zp_prefetch_phase(pf), -1);
  CHECK_OK(zp_prefetch_begin(pf, ZP_PF_BACKWARD));
  CHECK_FAILS(zp_prefetch_begin(pf, ZP_PF_FORWARD), ZP_ERR_STATE);
  CHECK_EQ(zp_prefetch_phase(pf), ZP_PF_BACKWARD);
  CHECK_OK(zp_prefetch_end(pf, cmds, CAP, &n_out));
  CHECK_FAILS(zp_prefetch_end(pf, cmds, CAP, &n_out), ZP_ERR_STATE);
  zp_prefetch_destroy(pf);
}

static void err_done_without_need(void *unused) {
  (void)unused;
  zp_pf_cmd cmds[CAP];
  int32_t n_out;
  static const uint8_t keep[4] = {0, 0, 1, 0};
  zp_prefetch *pf = make(4, four_bytes, keep, 0);
  if (!pf)
    return;
  CHECK_OK(zp_prefetch_begin(pf, ZP_PF_FORWARD));
  CHECK_FAILS(zp_prefetch_done(pf, 1, cmds, CAP, &n_out), ZP_ERR_STATE); /* not resident */
  CHECK_OK(zp_prefetch_need(pf, 2, cmds, CAP, &n_out));
  CHECK_OK(zp_prefetch_done(pf, 2, cmds, CAP, &n_out)); /* keep: stays resident */
  CHECK_OK(zp_prefetch_end(pf, cmds, CAP, &n_out));
  /* forward again: 2 is resident but not yet reached; done(2) would free it on this rank only */
  CHECK_OK(zp_prefetch_begin(pf, ZP_PF_FORWARD_EVAL));
  CHECK_FAILS(zp_prefetch_done(pf, 2, cmds, CAP, &n_out), ZP_ERR_STATE);
  CHECK_EQ(zp_prefetch_is_resident(pf, 2), 1);
  CHECK_OK(zp_prefetch_need(pf, 3, cmds, CAP, &n_out));
  CHECK_OK(zp_prefetch_done(pf, 2, cmds, CAP, &n_out)); /* reached now */
  CHECK_EQ(n_out, 1);
  CHECK_EQ(zp_prefetch_is_resident(pf, 2), 0);
  CHECK_FAILS(zp_prefetch_done(pf, 2, cmds, CAP, &n_out), ZP_ERR_STATE); /* done twice */
  zp_prefetch_destroy(pf);
}

void test_prefetch_errors(void) {
  zt_run_fresh(err_create, NULL);
  zt_run_fresh(err_no_phase, NULL);
  zt_run_fresh(err_unit_range, NULL);
  zt_run_fresh(err_capacity, NULL);
  zt_run_fresh(err_order, NULL);
  zt_run_fresh(err_phase, NULL);
  zt_run_fresh(err_done_without_need, NULL);
}

/* Twins receive the same valid calls; one also gets failing calls in between. Every answer and
 * every observable must stay equal: a failing call changes nothing. */
void test_prefetch_errors_leave_no_trace(void) {
  zt_rng g = zt_rng_seed(77);
  int64_t bytes[MAX_UNITS];
  uint8_t keep[MAX_UNITS];
  int32_t order[MAX_UNITS];
  int failures_injected = 0;
  for (int rep = 0; rep < 200; rep++) {
    const int32_t n = (int32_t)zt_range(&g, 1, MAX_UNITS);
    for (int32_t u = 0; u < n; u++) {
      bytes[u] = zt_range(&g, 1, 50);
      keep[u] = zt_range(&g, 0, 3) == 0;
    }
    const int64_t budget = zt_range(&g, 0, 200);
    zp_prefetch *a = make(n, bytes, keep, budget), *b = make(n, bytes, keep, budget);
    int ok = a != NULL && b != NULL;
    for (int step = 0; ok && step < 120; step++) {
      /* first a failing call on b */
      zp_pf_cmd cb[CAP], ca[CAP];
      int32_t nb = -7, na = -1;
      const int open = zp_prefetch_phase(b) >= 0;
      int injected = 1;
      switch (zt_range(&g, 0, 7)) {
      case 0:
        ok = CHECK_FAILS(zp_prefetch_need(b, (int32_t)zt_range(&g, n, n + 3), cb, CAP, &nb),
                         open ? ZP_ERR_RANGE : ZP_ERR_STATE);
        break;
      case 1:
        ok = CHECK_FAILS(zp_prefetch_need(b, 0, cb, 2 * n + 1, &nb), ZP_ERR_INVALID);
        break;
      case 2:
        ok = open ? CHECK_FAILS(zp_prefetch_begin(b, (int32_t)zt_range(&g, 0, 2)), ZP_ERR_STATE)
                  : CHECK_FAILS(zp_prefetch_begin(b, (int32_t)zt_range(&g, 3, 9)), ZP_ERR_INVALID);
        break;
      case 3: {
        int32_t u = (int32_t)zt_range(&g, 0, n - 1);
        if (open && !zp_prefetch_is_resident(b, u))
          ok = CHECK_FAILS(zp_prefetch_done(b, u, cb, CAP, &nb), ZP_ERR_STATE);
        else
          injected = 0;
        break;
      }
      case 4: { /* a good order but for its last entry: a duplicate or out of range */
        for (int32_t u = 0; u < n; u++)
          order[u] = u;
        shuffle(&g, order, n);
        const int dup = n > 1 && zt_range(&g, 0, 1);
        order[n - 1] = dup ? order[0] : n;
        ok = CHECK_FAILS(zp_prefetch_set_order(b, order, n),
                         open ? ZP_ERR_STATE : dup ? ZP_ERR_INVALID : ZP_ERR_RANGE);
        break;
      }
      case 5:
        ok = CHECK_FAILS(zp_prefetch_end(b, cb, 1, &nb), ZP_ERR_INVALID);
        break;
      default:
        injected = 0;
        break;
      }
      if (!ok)
        break;
      failures_injected += injected;
      CHECK(nb == -7); /* a failing call does not touch n_out */
      /* then the same valid call on both */
      zp_status sa, sb;
      const int64_t what = zt_range(&g, 0, 9);
      if (!open) {
        if (what == 0) {
          for (int32_t u = 0; u < n; u++)
            order[u] = u;
          shuffle(&g, order, n);
          int32_t k = (int32_t)zt_range(&g, 0, n);
          sa = zp_prefetch_set_order(a, order, k);
          sb = zp_prefetch_set_order(b, order, k);
          na = nb = 0;
        } else {
          int32_t phase = (int32_t)zt_range(&g, 0, 2);
          sa = zp_prefetch_begin(a, phase);
          sb = zp_prefetch_begin(b, phase);
          na = nb = 0;
        }
      } else if (what < 6) {
        int32_t u = (int32_t)zt_range(&g, 0, n - 1);
        sa = zp_prefetch_need(a, u, ca, CAP, &na);
        sb = zp_prefetch_need(b, u, cb, CAP, &nb);
      } else if (what < 9) {
        /* done of a resident unit the phase has reached: need it first to be sure */
        int32_t u = (int32_t)zt_range(&g, 0, n - 1);
        sa = zp_prefetch_need(a, u, ca, CAP, &na);
        sb = zp_prefetch_need(b, u, cb, CAP, &nb);
        ok = CHECK_OK(sa) && CHECK_OK(sb) && CHECK_EQ(na, nb);
        for (int32_t k = 0; ok && k < na; k++)
          ok = CHECK(ca[k].kind == cb[k].kind && ca[k].unit == cb[k].unit);
        sa = zp_prefetch_done(a, u, ca, CAP, &na);
        sb = zp_prefetch_done(b, u, cb, CAP, &nb);
      } else {
        sa = zp_prefetch_end(a, ca, CAP, &na);
        sb = zp_prefetch_end(b, cb, CAP, &nb);
      }
      ok = ok && CHECK_OK(sa) && CHECK_OK(sb) && CHECK_EQ(na, nb);
      for (int32_t k = 0; ok && k < na; k++)
        ok = CHECK(ca[k].kind == cb[k].kind && ca[k].unit == cb[k].unit &&
                   ca[k].reason == cb[k].reason);
      ok = ok && CHECK_EQ(zp_prefetch_phase(a), zp_prefetch_phase(b));
      ok = ok && CHECK_EQ(zp_prefetch_live_bytes(a), zp_prefetch_live_bytes(b));
      ok = ok && CHECK_EQ(zp_prefetch_peak_bytes(a), zp_prefetch_peak_bytes(b));
      for (int32_t u = 0; ok && u < n; u++)
        ok = CHECK_EQ(zp_prefetch_is_resident(a, u), zp_prefetch_is_resident(b, u));
      int32_t oa[MAX_UNITS], ob[MAX_UNITS];
      int32_t la = zp_prefetch_order(a, oa, MAX_UNITS), lb = zp_prefetch_order(b, ob, MAX_UNITS);
      ok = ok && CHECK_EQ(la, lb) && CHECK(memcmp(oa, ob, (size_t)la * sizeof *oa) == 0);
      la = zp_prefetch_seen(a, oa, MAX_UNITS);
      lb = zp_prefetch_seen(b, ob, MAX_UNITS);
      ok = ok && CHECK_EQ(la, lb) && CHECK(memcmp(oa, ob, (size_t)la * sizeof *oa) == 0);
    }
    zp_prefetch_destroy(a);
    zp_prefetch_destroy(b);
    if (!ok) {
      printf("  (rep %d: n=%d)\n", rep, n);
      return;
    }
  }
  CHECK(failures_injected > 10000);
}
