/* test_layout.c - the planner's invariants (layout.h) on random inputs, fixed cases and errors. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "layout/layout.h"

/* ---- one planning problem ------------------------------------------------------------ */

#define MAX_PARAMS 256

typedef struct {
  zp_param_desc params[MAX_PARAMS];
  int32_t n_params;
  int32_t world_size;
  int64_t align_bytes;
  int64_t bucket_bytes;
} problem;

static void describe(const problem *pb) {
  printf("  problem: n_params=%d world_size=%d align_bytes=%lld bucket_bytes=%lld\n",
         pb->n_params, pb->world_size, (long long)pb->align_bytes, (long long)pb->bucket_bytes);
  for (int32_t i = 0; i < pb->n_params && i < 16; i++)
    printf("    param %d: numel=%lld group=%d buffer=%d elem_size=%d\n", i,
           (long long)pb->params[i].numel, pb->params[i].group, pb->params[i].buffer,
           pb->params[i].elem_size);
}

static void random_problem(zt_rng *r, int32_t world_size, problem *pb) {
  static const int64_t aligns[] = {16, 64, 256};
  static const int64_t bucket_sizes[] = {1, 64, 1000, 4096, 40000, 65536, 1 << 20, 25 << 20};
  pb->world_size = world_size;
  pb->align_bytes = aligns[zt_range(r, 0, 2)];
  pb->bucket_bytes = bucket_sizes[zt_range(r, 0, 7)];
  const int64_t max_params = zt_range(r, 0, 9) == 0 ? MAX_PARAMS : 24;
  pb->n_params = (int32_t)zt_range(r, 1, max_params);
  int32_t n_groups = (int32_t)zt_range(r, 1, 4);
  int32_t n_buffers = (int32_t)zt_range(r, 1, 2);
  int32_t elem_size[2];
  for (int32_t b = 0; b < 2; b++) {
    /* mostly 2 or 4 bytes; sometimes 1 or 8 (every size divides the alignments above) */
    static const int32_t sizes[] = {2, 4, 2, 4, 1, 8};
    elem_size[b] = sizes[zt_range(r, 0, 5)];
  }
  for (int32_t i = 0; i < pb->n_params; i++) {
    zp_param_desc *d = &pb->params[i];
    int64_t kind = zt_range(r, 0, 9);
    d->numel = kind < 3   ? zt_range(r, 1, 8) /* tiny */
               : kind < 5 ? zt_range(r, 9, 300)
                          : zt_range(r, 1, 100000);
    d->group = (int32_t)zt_range(r, 0, n_groups - 1);
    /* ids >= n_params (possible with one param) are checked on their own in small_cases */
    d->buffer = (int32_t)zt_range(r, 0, (n_buffers < pb->n_params ? n_buffers : pb->n_params) - 1);
    d->elem_size = elem_size[d->buffer];
  }
}

/* ---- the invariants ------------------------------------------------------------------ */

typedef struct {
  int64_t begin, end;
} span;

static int span_cmp(const void *a, const void *b) {
  const span *x = a, *y = b;
  return (x->begin > y->begin) - (x->begin < y->begin);
}

/* Checks every invariant of layout.h on plan `L` of problem `pb`; returns 1 if all hold. */
static int check_plan(const problem *pb, const zp_layout *L) {
  const int before = zt_failures;
  const int32_t n = pb->n_params;
  const int32_t ws = pb->world_size;
  const int64_t align = pb->align_bytes;

  int32_t max_buffer = -1;
  int32_t buffer_elem_size[MAX_PARAMS];
  int64_t total_numel = 0;
  for (int32_t i = 0; i < n; i++) {
    if (pb->params[i].buffer > max_buffer)
      max_buffer = pb->params[i].buffer;
    buffer_elem_size[pb->params[i].buffer] = pb->params[i].elem_size;
    total_numel += pb->params[i].numel;
  }

  CHECK_EQ(L->n_params, n);
  CHECK_EQ(L->world_size, ws);
  CHECK_EQ(L->align_bytes, align);
  CHECK_EQ(L->n_buffers, max_buffer + 1);
  const int32_t nb = L->n_buckets;
  if (!CHECK(nb >= 1 && nb <= n))
    goto done;

  /* the bucket -> params index: starts, ascending lists, every param exactly once */
  if (!CHECK_EQ(L->bucket_param_start[0], 0) || !CHECK_EQ(L->bucket_param_start[nb], n))
    goto done;
  for (int32_t b = 0; b < nb; b++)
    if (!CHECK_MSG(L->bucket_param_start[b] < L->bucket_param_start[b + 1],
                   "bucket %d holds no parameter (start %d, next %d)", b,
                   L->bucket_param_start[b], L->bucket_param_start[b + 1]))
      goto done;

  int32_t seen[MAX_PARAMS] = {0};
  span spans[MAX_PARAMS];
  for (int32_t b = 0; b < nb; b++) {
    const int32_t start = L->bucket_param_start[b], stop = L->bucket_param_start[b + 1];
    const int32_t buf = L->bucket_buffer[b];
    if (!CHECK_MSG(buf >= 0 && buf < L->n_buffers, "bucket %d: buffer %d", b, buf))
      goto done;
    CHECK_MSG(L->bucket_group[b] >= 0, "bucket %d: group %d", b, L->bucket_group[b]);
    const int64_t es = buffer_elem_size[buf];
    const int64_t align_elems = align / es;
    const int64_t numel = L->bucket_numel[b];

    /* padded length and equal, aligned shards */
    CHECK_MSG(numel > 0 && numel % (ws * align_elems) == 0,
              "bucket %d: numel %lld not a positive multiple of world_size*align_elems=%lld", b,
              (long long)numel, (long long)(ws * align_elems));
    CHECK_MSG(L->bucket_shard_numel[b] * ws == numel, "bucket %d: shard %lld * %d != %lld", b,
              (long long)L->bucket_shard_numel[b], ws, (long long)numel);
    CHECK_MSG(L->bucket_flat_offset[b] >= 0 && L->bucket_flat_offset[b] * es % align == 0,
              "bucket %d: flat offset %lld not aligned", b, (long long)L->bucket_flat_offset[b]);

    int64_t bytes = 0, max_end = 0;
    for (int32_t k = start; k < stop; k++) {
      const int32_t p = L->bucket_params[k];
      if (!CHECK_MSG(p >= 0 && p < n, "bucket %d lists parameter %d", b, p))
        goto done;
      if (k > start)
        CHECK_MSG(p > L->bucket_params[k - 1], "bucket %d: params not ascending (%d after %d)", b,
                  p, L->bucket_params[k - 1]);
      seen[p]++;
      CHECK_MSG(L->param_bucket[p] == b, "param %d: param_bucket %d but listed in bucket %d", p,
                L->param_bucket[p], b);
      CHECK_MSG(pb->params[p].group == L->bucket_group[b] && pb->params[p].buffer == buf,
                "param %d (group %d, buffer %d) in bucket %d (group %d, buffer %d)", p,
                pb->params[p].group, pb->params[p].buffer, b, L->bucket_group[b], buf);
      const int64_t off = L->param_offset[p], end = off + pb->params[p].numel;
      CHECK_MSG(off >= 0 && end <= numel, "param %d: [%lld, %lld) outside bucket %d of %lld", p,
                (long long)off, (long long)end, b, (long long)numel);
      CHECK_MSG(off * es % align == 0,
                "param %d: offset %lld * elem_size %lld not aligned to %lld", p, (long long)off,
                (long long)es, (long long)align);
      spans[k - start] = (span){off, end};
      bytes += pb->params[p].numel * es;
      if (end > max_end)
        max_end = end;
    }
    /* no overlap inside the bucket */
    qsort(spans, (size_t)(stop - start), sizeof spans[0], span_cmp);
    for (int32_t k = 1; k < stop - start; k++)
      CHECK_MSG(spans[k - 1].end <= spans[k].begin,
                "bucket %d: params overlap ([%lld,%lld) and [%lld,%lld))", b,
                (long long)spans[k - 1].begin, (long long)spans[k - 1].end,
                (long long)spans[k].begin, (long long)spans[k].end);
    /* size cap: the parameters' bytes fit bucket_bytes unless the bucket holds one parameter */
    if (stop - start > 1)
      CHECK_MSG(bytes <= pb->bucket_bytes, "bucket %d: %d params, %lld bytes > bucket_bytes %lld",
                b, stop - start, (long long)bytes, (long long)pb->bucket_bytes);
    /* "padded to a multiple of world_size * align": no more than one such unit of tail padding */
    CHECK_MSG(numel - max_end < ws * align_elems,
              "bucket %d: numel %lld but data ends at %lld (unit %lld)", b, (long long)numel,
              (long long)max_end, (long long)(ws * align_elems));
  }
  for (int32_t p = 0; p < n; p++)
    CHECK_MSG(seen[p] == 1, "param %d listed in %d buckets", p, seen[p]);

  /* bucket order: lowest parameter index, highest first */
  for (int32_t b = 0; b + 1 < nb; b++) {
    const int32_t lo = L->bucket_params[L->bucket_param_start[b]];
    const int32_t lo_next = L->bucket_params[L->bucket_param_start[b + 1]];
    CHECK_MSG(lo > lo_next, "bucket order: min param of bucket %d is %d, of bucket %d is %d", b,
              lo, b + 1, lo_next);
  }

  /* shard space: bucket pieces end to end in bucket order */
  int64_t shard_at = 0;
  for (int32_t b = 0; b < nb; b++) {
    CHECK_MSG(L->bucket_shard_offset[b] == shard_at, "bucket %d: shard offset %lld, expected %lld",
              b, (long long)L->bucket_shard_offset[b], (long long)shard_at);
    shard_at += L->bucket_shard_numel[b];
  }
  CHECK_EQ(L->shard_numel, shard_at);

  /* each flat buffer is tiled exactly by its buckets */
  int64_t total_buffer = 0;
  for (int32_t buf = 0; buf < L->n_buffers; buf++) {
    int32_t m = 0;
    for (int32_t b = 0; b < nb; b++)
      if (L->bucket_buffer[b] == buf)
        spans[m++] = (span){L->bucket_flat_offset[b],
                            L->bucket_flat_offset[b] + L->bucket_numel[b]};
    qsort(spans, (size_t)m, sizeof spans[0], span_cmp);
    int64_t at = 0;
    for (int32_t k = 0; k < m; k++) {
      CHECK_MSG(spans[k].begin == at, "buffer %d: a bucket starts at %lld, expected %lld", buf,
                (long long)spans[k].begin, (long long)at);
      at = spans[k].end;
    }
    CHECK_MSG(L->buffer_numel[buf] == at, "buffer %d: numel %lld, buckets cover %lld", buf,
              (long long)L->buffer_numel[buf], (long long)at);
    total_buffer += L->buffer_numel[buf];
  }
  CHECK_EQ(L->padding_numel, total_buffer - total_numel);

done:
  if (zt_failures != before) {
    describe(pb);
    return 0;
  }
  return 1;
}

static zp_status plan(const problem *pb, zp_layout **out) {
  return zp_layout_plan(pb->params, pb->n_params, pb->world_size, pb->align_bytes,
                        pb->bucket_bytes, out);
}

/* ---- tests --------------------------------------------------------------------------- */

void test_layout_invariants_random(void) {
  zt_rng r = zt_rng_seed(12345);
  static problem pb;
  int plans = 0;
  for (int32_t ws = 1; ws <= 128; ws++) {
    for (int rep = 0; rep < 12; rep++) {
      random_problem(&r, ws, &pb);
      zp_layout *L = NULL;
      if (!CHECK_OK(plan(&pb, &L))) {
        describe(&pb);
        return;
      }
      int ok = check_plan(&pb, L);
      zp_layout_free(L);
      plans++;
      if (!ok)
        return; /* one described counter-example is enough */
    }
  }
  printf("  %d random plans checked\n", plans);
}

/* Cases whose plan the header determines completely. */
void test_layout_small_cases(void) {
  zp_layout *L = NULL;

  /* one fp32 parameter of 10 elements, 4 ranks, 16-byte alignment: 4-element units, so the
   * bucket is 16 elements, 4 per rank */
  problem one = {.params = {{10, 0, 0, 4}}, .n_params = 1, .world_size = 4, .align_bytes = 16,
                 .bucket_bytes = 1 << 20};
  if (CHECK_OK(plan(&one, &L))) {
    check_plan(&one, L);
    CHECK_EQ(L->n_buckets, 1);
    CHECK_EQ(L->param_offset[0], 0);
    CHECK_EQ(L->bucket_numel[0], 16);
    CHECK_EQ(L->bucket_shard_numel[0], 4);
    CHECK_EQ(L->shard_numel, 4);
    CHECK_EQ(L->padding_numel, 6);
    CHECK_EQ(L->buffer_numel[0], 16);
    zp_layout_free(L);
  }

  /* a single element on one rank: padded to one alignment unit */
  problem tiny = {.params = {{1, 0, 0, 2}}, .n_params = 1, .world_size = 1, .align_bytes = 256,
                  .bucket_bytes = 1};
  if (CHECK_OK(plan(&tiny, &L))) {
    check_plan(&tiny, L);
    CHECK_EQ(L->bucket_numel[0], 128);
    CHECK_EQ(L->padding_numel, 127);
    zp_layout_free(L);
  }

  /* three params in three groups: three buckets, the last parameter's first */
  problem groups = {.params = {{5, 0, 0, 4}, {6, 1, 0, 4}, {7, 2, 0, 4}}, .n_params = 3,
                    .world_size = 2, .align_bytes = 64, .bucket_bytes = 1 << 20};
  if (CHECK_OK(plan(&groups, &L))) {
    check_plan(&groups, L);
    if (CHECK_EQ(L->n_buckets, 3)) {
      for (int32_t b = 0; b < 3; b++) {
        CHECK_EQ(L->bucket_params[L->bucket_param_start[b]], 2 - b);
        CHECK_EQ(L->bucket_group[b], 2 - b);
      }
    }
    zp_layout_free(L);
  }

  /* params each larger than bucket_bytes: one bucket each, in reverse order */
  problem big = {.params = {{1000, 0, 0, 4}, {2000, 0, 0, 4}, {3000, 0, 0, 4}, {4000, 0, 0, 4}},
                 .n_params = 4, .world_size = 3, .align_bytes = 16, .bucket_bytes = 1000};
  if (CHECK_OK(plan(&big, &L))) {
    check_plan(&big, L);
    if (CHECK_EQ(L->n_buckets, 4))
      for (int32_t b = 0; b < 4; b++)
        CHECK_EQ(L->bucket_params[L->bucket_param_start[b]], 3 - b);
    zp_layout_free(L);
  }

  /* two buffers (bf16 and fp32), only buffer 1 used by one param: buffer 0 is empty */
  problem sparse = {.params = {{3, 0, 1, 4}, {4, 0, 1, 4}}, .n_params = 2, .world_size = 2,
                    .align_bytes = 16, .bucket_bytes = 1 << 20};
  if (CHECK_OK(plan(&sparse, &L))) {
    check_plan(&sparse, L);
    CHECK_EQ(L->n_buffers, 2);
    CHECK_EQ(L->buffer_numel[0], 0);
    CHECK_EQ(L->n_buckets, 1);
    zp_layout_free(L);
  }

  /* one parameter in buffer 1: layout.h allows any buffer id >= 0 (n_buffers is 1 + the
   * largest id), so buffer 0 is simply empty */
  problem lone = {.params = {{9, 0, 1, 2}}, .n_params = 1, .world_size = 2, .align_bytes = 16,
                  .bucket_bytes = 1 << 20};
  if (CHECK_OK(plan(&lone, &L))) {
    check_plan(&lone, L);
    CHECK_EQ(L->n_buffers, 2);
    CHECK_EQ(L->buffer_numel[0], 0);
    CHECK_EQ(L->buffer_numel[1], 16);
    zp_layout_free(L);
  }

  /* bucket_bytes = 1: no two parameters fit together, so every parameter has its own bucket */
  problem many = {.n_params = 40, .world_size = 8, .align_bytes = 64, .bucket_bytes = 1};
  for (int32_t i = 0; i < many.n_params; i++)
    many.params[i] = (zp_param_desc){1 + i * 37 % 101, 0, 0, 2};
  if (CHECK_OK(plan(&many, &L))) {
    check_plan(&many, L);
    CHECK_EQ(L->n_buckets, 40);
    zp_layout_free(L);
  }
}

void test_layout_deterministic(void) {
  zt_rng r = zt_rng_seed(777);
  static problem pb;
  for (int rep = 0; rep < 200; rep++) {
    random_problem(&r, (int32_t)zt_range(&r, 1, 128), &pb);
    zp_layout *a = NULL, *b = NULL;
    if (!CHECK_OK(plan(&pb, &a)))
      return;
    if (!CHECK_OK(plan(&pb, &b))) {
      zp_layout_free(a);
      return;
    }
    int same = a->n_params == b->n_params && a->n_buckets == b->n_buckets &&
               a->n_buffers == b->n_buffers && a->shard_numel == b->shard_numel &&
               a->padding_numel == b->padding_numel;
    if (same) {
      const size_t np = (size_t)a->n_params, nb = (size_t)a->n_buckets, nf = (size_t)a->n_buffers;
      same = !memcmp(a->param_bucket, b->param_bucket, np * sizeof(int32_t)) &&
             !memcmp(a->param_offset, b->param_offset, np * sizeof(int64_t)) &&
             !memcmp(a->bucket_group, b->bucket_group, nb * sizeof(int32_t)) &&
             !memcmp(a->bucket_buffer, b->bucket_buffer, nb * sizeof(int32_t)) &&
             !memcmp(a->bucket_numel, b->bucket_numel, nb * sizeof(int64_t)) &&
             !memcmp(a->bucket_shard_numel, b->bucket_shard_numel, nb * sizeof(int64_t)) &&
             !memcmp(a->bucket_flat_offset, b->bucket_flat_offset, nb * sizeof(int64_t)) &&
             !memcmp(a->bucket_shard_offset, b->bucket_shard_offset, nb * sizeof(int64_t)) &&
             !memcmp(a->bucket_param_start, b->bucket_param_start, (nb + 1) * sizeof(int32_t)) &&
             !memcmp(a->bucket_params, b->bucket_params, np * sizeof(int32_t)) &&
             !memcmp(a->buffer_numel, b->buffer_numel, nf * sizeof(int64_t));
    }
    zp_layout_free(a);
    zp_layout_free(b);
    if (!CHECK_MSG(same, "two plans of the same problem differ")) {
      describe(&pb);
      return;
    }
  }
}

/* n_params == 0: layout.h does not say; accept an empty plan or a failure with a message. */
static void empty_case(void *unused) {
  (void)unused;
  zp_param_desc dummy = {1, 0, 0, 4};
  zp_layout *L = NULL;
  zp_status st = zp_layout_plan(&dummy, 0, 4, 64, 1 << 20, &L);
  if (st == ZP_OK) {
    if (CHECK(L != NULL)) {
      CHECK_EQ(L->n_params, 0);
      CHECK_EQ(L->n_buckets, 0);
      CHECK_EQ(L->shard_numel, 0);
      CHECK_EQ(L->padding_numel, 0);
      zp_layout_free(L);
    }
    printf("  n_params = 0 gives an empty plan\n");
  } else {
    CHECK_MSG(zp_last_error()[0] != '\0', "n_params = 0 failed (%d) without a message", (int)st);
    printf("  n_params = 0 is refused (%d): %s\n", (int)st, zp_last_error());
  }
}

void test_layout_empty(void) {
  zt_run_fresh(empty_case, NULL);
}

typedef struct {
  const char *what;
  zp_param_desc param; /* a second, valid parameter is always planned before it */
  int32_t world_size;
  int64_t align_bytes;
  int64_t bucket_bytes;
} error_case;

static void run_error_case(void *arg) {
  const error_case *c = arg;
  zp_param_desc params[2] = {{100, 0, 0, 4}, c->param};
  zp_layout *L = NULL;
  zp_status st = zp_layout_plan(params, 2, c->world_size, c->align_bytes, c->bucket_bytes, &L);
  if (!CHECK_MSG(st == ZP_ERR_INVALID && zp_last_error()[0] != '\0',
                 "%s: status %d (expected ZP_ERR_INVALID), message \"%s\"", c->what, (int)st,
                 zp_last_error()))
    printf("  (case: %s)\n", c->what);
  if (st == ZP_OK)
    zp_layout_free(L);
}

void test_layout_errors(void) {
  const zp_param_desc ok = {50, 0, 0, 4};
  const error_case cases[] = {
      {"world_size 0", ok, 0, 64, 1 << 20},
      {"world_size -1", ok, -1, 64, 1 << 20},
      {"align_bytes 48 (not a power of two)", ok, 4, 48, 1 << 20},
      {"align_bytes 0", ok, 4, 0, 1 << 20},
      {"align_bytes -64", ok, 4, -64, 1 << 20},
      {"elem_size 4 does not divide align_bytes 2", {50, 0, 0, 4}, 4, 2, 1 << 20},
      {"elem_size 8 does not divide align_bytes 4", {50, 0, 1, 8}, 4, 4, 1 << 20},
      {"elem_size 3", {50, 0, 1, 3}, 4, 64, 1 << 20},
      {"elem_size 0", {50, 0, 1, 0}, 4, 64, 1 << 20},
      {"numel 0", {0, 0, 0, 4}, 4, 64, 1 << 20},
      {"numel -5", {-5, 0, 0, 4}, 4, 64, 1 << 20},
      {"group -1", {50, -1, 0, 4}, 4, 64, 1 << 20},
      {"buffer -1", {50, 0, -1, 4}, 4, 64, 1 << 20},
      {"bucket_bytes 0", ok, 4, 64, 0},
      {"bucket_bytes -1", ok, 4, 64, -1},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    zt_run_fresh(run_error_case, (void *)&cases[i]);
}
