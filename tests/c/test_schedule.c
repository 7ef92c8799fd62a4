/* test_schedule.c - the grad-ready state machine (schedule.h) against a reference model. */
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "schedule/schedule.h"

#define MAX_PARAMS 200
#define MAX_BUCKETS 40

/* A random param -> bucket map where every bucket holds at least one parameter. */
static void random_map(zt_rng *r, int32_t *map, int32_t *n_params, int32_t *n_buckets) {
  *n_buckets = (int32_t)zt_range(r, 1, MAX_BUCKETS);
  const int64_t max_params = zt_range(r, 0, 3) == 0 ? MAX_PARAMS : *n_buckets + 10;
  *n_params = (int32_t)zt_range(r, *n_buckets, max_params);
  for (int32_t i = 0; i < *n_params; i++)
    map[i] = i < *n_buckets ? i : (int32_t)zt_range(r, 0, *n_buckets - 1);
  for (int32_t i = *n_params - 1; i > 0; i--) {
    int32_t j = (int32_t)zt_range(r, 0, i), t = map[i];
    map[i] = map[j];
    map[j] = t;
  }
}

static void random_order(zt_rng *r, int32_t *order, int32_t n) {
  for (int32_t i = 0; i < n; i++)
    order[i] = i;
  for (int32_t i = n - 1; i > 0; i--) {
    int32_t j = (int32_t)zt_range(r, 0, i), t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
}

/* The reference: a bucket is released once all its params are ready and all earlier buckets
 * are released; each event releases everything that has become releasable. */
typedef struct {
  const int32_t *map;
  int32_t n_params, n_buckets, released;
  int32_t size[MAX_BUCKETS], ready_count[MAX_BUCKETS];
  int8_t ready[MAX_PARAMS];
} model;

static void model_init(model *m, const int32_t *map, int32_t n_params, int32_t n_buckets) {
  memset(m, 0, sizeof *m);
  m->map = map;
  m->n_params = n_params;
  m->n_buckets = n_buckets;
  for (int32_t i = 0; i < n_params; i++)
    m->size[map[i]]++;
}

static void model_reset(model *m) {
  m->released = 0;
  memset(m->ready_count, 0, sizeof m->ready_count);
  memset(m->ready, 0, sizeof m->ready);
}

/* Returns how many buckets the event releases (they are the model's released-k .. released-1). */
static int32_t model_ready(model *m, int32_t p) {
  int32_t before = m->released;
  m->ready[p] = 1;
  m->ready_count[m->map[p]]++;
  while (m->released < m->n_buckets && m->ready_count[m->released] == m->size[m->released])
    m->released++;
  return m->released - before;
}

/* Reports `p` to both and compares the answers; returns 1 if they agree. */
static int step(zp_schedule *s, model *m, int32_t p) {
  int32_t out[MAX_BUCKETS], n_out = -1;
  const int32_t first = m->released;
  if (!CHECK_OK(zp_schedule_grad_ready(s, p, out, MAX_BUCKETS, &n_out)))
    return 0;
  const int32_t want = model_ready(m, p);
  int ok = CHECK_MSG(n_out == want, "param %d: released %d buckets, expected %d", p, n_out, want);
  for (int32_t k = 0; ok && k < n_out; k++)
    ok = CHECK_MSG(out[k] == first + k, "param %d: out[%d] = %d, expected %d", p, k, out[k],
                   first + k);
  ok = ok && CHECK_EQ(zp_schedule_released(s), m->released);
  ok = ok && CHECK_EQ(zp_schedule_is_ready(s, p), 1);
  return ok;
}

/* Flushes and checks that exactly the unreleased buckets come out, in order. */
static int flush(zp_schedule *s, model *m) {
  int32_t out[MAX_BUCKETS], n_out = -1;
  if (!CHECK_OK(zp_schedule_flush(s, out, MAX_BUCKETS, &n_out)))
    return 0;
  int ok = CHECK_EQ(n_out, m->n_buckets - m->released);
  for (int32_t k = 0; ok && k < n_out; k++)
    ok = CHECK_EQ(out[k], m->released + k);
  m->released = m->n_buckets;
  return ok && CHECK_EQ(zp_schedule_released(s), m->n_buckets);
}

static int check_fresh_pass(const zp_schedule *s, const model *m) {
  int ok = CHECK_EQ(zp_schedule_released(s), 0);
  for (int32_t p = 0; ok && p < m->n_params; p++)
    ok = CHECK_EQ(zp_schedule_is_ready(s, p), 0);
  return ok;
}

void test_schedule_random_orders(void) {
  zt_rng r = zt_rng_seed(2024);
  int32_t map[MAX_PARAMS], order[MAX_PARAMS], n_params, n_buckets;
  static model m;
  for (int rep = 0; rep < 400; rep++) {
    random_map(&r, map, &n_params, &n_buckets);
    zp_schedule *s = NULL;
    if (!CHECK_OK(zp_schedule_create(map, n_params, n_buckets, &s)))
      return;
    model_init(&m, map, n_params, n_buckets);
    int ok = CHECK_EQ(zp_schedule_n_buckets(s), n_buckets) && check_fresh_pass(s, &m);
    CHECK_EQ(zp_schedule_is_ready(s, -1), -1);
    CHECK_EQ(zp_schedule_is_ready(s, n_params), -1);
    /* several passes over the same schedule, each in a new random order */
    for (int pass = 0; ok && pass < 3; pass++) {
      random_order(&r, order, n_params);
      for (int32_t k = 0; ok && k < n_params; k++)
        ok = step(s, &m, order[k]);
      ok = ok && CHECK_EQ(zp_schedule_released(s), n_buckets);
      ok = ok && flush(s, &m); /* nothing left: releases no bucket */
      zp_schedule_reset(s);
      model_reset(&m);
      ok = ok && check_fresh_pass(s, &m);
    }
    zp_schedule_destroy(s);
    if (!ok) {
      printf("  (rep %d: n_params=%d n_buckets=%d)\n", rep, n_params, n_buckets);
      return;
    }
  }
}

void test_schedule_flush_and_reset(void) {
  zt_rng r = zt_rng_seed(99);
  int32_t map[MAX_PARAMS], order[MAX_PARAMS], n_params, n_buckets;
  static model m;
  for (int rep = 0; rep < 400; rep++) {
    random_map(&r, map, &n_params, &n_buckets);
    zp_schedule *s = NULL;
    if (!CHECK_OK(zp_schedule_create(map, n_params, n_buckets, &s)))
      return;
    model_init(&m, map, n_params, n_buckets);
    int ok = 1;
    for (int pass = 0; ok && pass < 3; pass++) {
      /* a partial backward: only some parameters get a gradient, then flush */
      random_order(&r, order, n_params);
      int32_t k_ready = (int32_t)zt_range(&r, 0, n_params);
      for (int32_t k = 0; ok && k < k_ready; k++)
        ok = step(s, &m, order[k]);
      for (int32_t k = k_ready; ok && k < n_params; k++)
        ok = CHECK_EQ(zp_schedule_is_ready(s, order[k]), 0);
      ok = ok && flush(s, &m);
      zp_schedule_reset(s);
      model_reset(&m);
      ok = ok && check_fresh_pass(s, &m);
    }
    /* reset in the middle of a pass forgets it too */
    random_order(&r, order, n_params);
    for (int32_t k = 0; ok && k < n_params / 2; k++)
      ok = step(s, &m, order[k]);
    zp_schedule_reset(s);
    model_reset(&m);
    ok = ok && check_fresh_pass(s, &m);
    for (int32_t k = 0; ok && k < n_params; k++)
      ok = step(s, &m, order[k]);
    zp_schedule_destroy(s);
    if (!ok) {
      printf("  (rep %d: n_params=%d n_buckets=%d)\n", rep, n_params, n_buckets);
      return;
    }
  }
}

/* ---- errors, each on a fresh thread so the message is proven to come from that call ------ */

/* params 0,1 -> bucket 1; params 2,3 -> bucket 0 */
static const int32_t small_map[4] = {1, 1, 0, 0};

static zp_schedule *make_small(void) {
  zp_schedule *s = NULL;
  if (!CHECK_OK(zp_schedule_create(small_map, 4, 2, &s)))
    return NULL;
  return s;
}

static void err_twice(void *unused) {
  (void)unused;
  int32_t out[2], n_out;
  zp_schedule *s = make_small();
  if (!s)
    return;
  CHECK_OK(zp_schedule_grad_ready(s, 0, out, 2, &n_out));
  CHECK_FAILS(zp_schedule_grad_ready(s, 0, out, 2, &n_out), ZP_ERR_STATE);
  zp_schedule_destroy(s);
}

static void err_out_of_range(void *unused) {
  (void)unused;
  int32_t out[2], n_out;
  zp_schedule *s = make_small();
  if (!s)
    return;
  CHECK_FAILS(zp_schedule_grad_ready(s, 4, out, 2, &n_out), ZP_ERR_RANGE);
  CHECK_FAILS(zp_schedule_grad_ready(s, -1, out, 2, &n_out), ZP_ERR_RANGE);
  zp_schedule_destroy(s);
}

static void err_after_flush(void *unused) {
  (void)unused;
  int32_t out[2], n_out;
  zp_schedule *s = make_small();
  if (!s)
    return;
  CHECK_OK(zp_schedule_grad_ready(s, 2, out, 2, &n_out));
  CHECK_OK(zp_schedule_flush(s, out, 2, &n_out));
  CHECK_EQ(n_out, 2);
  CHECK_FAILS(zp_schedule_grad_ready(s, 0, out, 2, &n_out), ZP_ERR_STATE);
  /* reset makes it usable again */
  zp_schedule_reset(s);
  CHECK_OK(zp_schedule_grad_ready(s, 0, out, 2, &n_out));
  CHECK_EQ(n_out, 0);
  zp_schedule_destroy(s);
}

/* capacity < n_buckets: an argument error; status.h allows INVALID (bad argument) or RANGE (a
 * size outside the object), so either is accepted. */
static void err_capacity(void *unused) {
  (void)unused;
  int32_t out[2], n_out;
  zp_schedule *s = make_small();
  if (!s)
    return;
  zp_status st = zp_schedule_grad_ready(s, 2, out, 1, &n_out);
  CHECK_MSG((st == ZP_ERR_INVALID || st == ZP_ERR_RANGE) && zp_last_error()[0] != '\0',
            "grad_ready with capacity 1 < 2 buckets: status %d, message \"%s\"", (int)st,
            zp_last_error());
  zp_schedule_destroy(s);

  s = make_small();
  if (!s)
    return;
  st = zp_schedule_flush(s, out, 1, &n_out);
  CHECK_MSG((st == ZP_ERR_INVALID || st == ZP_ERR_RANGE) && zp_last_error()[0] != '\0',
            "flush with capacity 1 < 2 buckets: status %d, message \"%s\"", (int)st,
            zp_last_error());
  zp_schedule_destroy(s);
}

typedef struct {
  const char *what;
  int32_t map[4];
  int32_t n_params, n_buckets;
} create_case;

static void err_create(void *arg) {
  const create_case *c = arg;
  zp_schedule *s = NULL;
  zp_status st = zp_schedule_create(c->map, c->n_params, c->n_buckets, &s);
  CHECK_MSG((st == ZP_ERR_INVALID || st == ZP_ERR_RANGE) && zp_last_error()[0] != '\0',
            "create with %s: status %d (expected INVALID or RANGE), message \"%s\"", c->what,
            (int)st, zp_last_error());
  if (st == ZP_OK)
    zp_schedule_destroy(s);
}

void test_schedule_errors(void) {
  zt_run_fresh(err_twice, NULL);
  zt_run_fresh(err_out_of_range, NULL);
  zt_run_fresh(err_after_flush, NULL);
  zt_run_fresh(err_capacity, NULL);
  static const create_case creates[] = {
      {"bucket 1 holding no parameter", {0, 0, 2, 2}, 4, 3},
      {"a param in bucket 3 of 3", {0, 1, 2, 3}, 4, 3},
      {"a param in bucket -1", {0, 1, -1, 2}, 4, 3},
  };
  for (size_t i = 0; i < sizeof creates / sizeof creates[0]; i++)
    zt_run_fresh(err_create, (void *)&creates[i]);
}
