/* optim_bodies.c - the CPU optimizer family's update bodies (kernels/cpu/optim_body.h) timed
 * alone: one thread, no Python, no table, data that stays in L2, so what is measured is the
 * body's arithmetic and shuffles per element, not memory. optim_kernels.py measures the whole
 * step against memory; this says which body to tune when that step falls short of its bound.
 *
 * Each body is first checked against the scalar body (the definition) on the same inputs, bit
 * for bit, then timed: the minimum over trials of `reps` calls, in ns per element.
 *   make bench-bodies              (n = 16384 elements, 400 calls per trial, 30 trials)
 *   build/optim_bodies N REPS TRIALS
 * Exit status 1 when a body's bits differ from the scalar body's. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/optim_body.h"

#if !defined(__x86_64__) && !defined(__i386__)
int main(void) {
  puts("optim_bodies: x86 only (the SIMD bodies)");
  return 0;
}
#else

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void print_cpu(void) {
  char line[256] = "unknown";
  FILE *f = fopen("/proc/cpuinfo", "r");
  while (f != NULL && fgets(line, sizeof line, f) != NULL)
    if (strncmp(line, "model name", 10) == 0)
      break;
  if (f != NULL)
    fclose(f);
  const char *name = strchr(line, ':');
  printf("CPU: %s", name != NULL ? name + 2 : line);
  printf("ISA picked for this CPU: %s\n", zp_isa_name(zp_isa_pick()));
}

typedef struct {
  const char *name;
  zp_opt_body scalar, avx2, avx512;
  zp_opt_bf16_body avx2_bf16, avx512_bf16;
  int states; /* how many of s0..s2 the kind reads and writes */
  int kind;
} zp_kind_row;

static const zp_kind_row kinds[] = {
    {"adamw", zp_adam_scalar, zp_adam_avx2, zp_adam_avx512, zp_adam_bf16_avx2,
     zp_adam_bf16_avx512, 2, ZP_OPT_ADAMW},
    {"sgd", zp_sgd_scalar, zp_sgd_avx2, zp_sgd_avx512, zp_sgd_bf16_avx2, zp_sgd_bf16_avx512, 1,
     ZP_OPT_SGD},
    {"adagrad", zp_adagrad_scalar, zp_adagrad_avx2, zp_adagrad_avx512, zp_adagrad_bf16_avx2,
     zp_adagrad_bf16_avx512, 1, ZP_OPT_ADAGRAD},
    {"lion", zp_lion_scalar, zp_lion_avx2, zp_lion_avx512, zp_lion_bf16_avx2,
     zp_lion_bf16_avx512, 1, ZP_OPT_LION},
};

/* Coefficients of a mid-training step, as zp_opt_coef_make would give them: decoupled decay,
 * momentum on, nothing that leaves the body's common path. */
static zp_opt_coef coef_for(int kind) {
  zp_opt_coef c;
  memset(&c, 0, sizeof c);
  c.kind = kind, c.scale = 1.0f, c.decay = 0.9995f, c.eps = 1e-8f;
  c.lerp_w = 0.1f, c.lerp_wm1 = -0.9f, c.lerp_small = 1;
  c.b1 = 0.9f, c.omb1 = 0.1f, c.b2 = 0.999f, c.omb2 = 0.001f;
  c.neg_step = -1e-3f, c.pos_lr = 1e-3f, c.bc2_sqrt = 0.3f, c.momentum = 1;
  return c;
}

typedef struct {
  int64_t n;
  float *p, *g, *s[3];
  uint16_t *gb, *out;
} zp_bufs;

/* Values of unit scale with no zeros: no denormals appear over many calls (a zero gradient
 * would decay the momentum into them and time the CPU's slow path instead). */
static void fill(zp_bufs *b, uint32_t seed) {
  uint32_t x = seed;
  for (int64_t i = 0; i < b->n; i++) {
    x = x * 1664525u + 1013904223u;
    float r = (float)(x >> 8) / 16777216.0f; /* [0, 1) */
    b->p[i] = 1.0f + r;
    b->gb[i] = zp_f32_to_bf16(r - 0.5f >= 0 ? r + 0.01f : r - 1.01f);
    b->g[i] = zp_bf16_to_f32(b->gb[i]);
    for (int k = 0; k < 3; k++)
      b->s[k][i] = 0.01f + 0.001f * r * (float)(k + 1);
  }
}

/* One call of each body on the same inputs as the scalar body: 0 when the bits agree. */
static int check(const zp_kind_row *k, zp_opt_body body, zp_opt_bf16_body bf16, zp_bufs *ref,
                 zp_bufs *got, const char *isa) {
  const zp_opt_coef c = coef_for(k->kind);
  float *rs[3] = {NULL, NULL, NULL}, *gs[3] = {NULL, NULL, NULL};
  for (int i = 0; i < k->states; i++)
    rs[i] = ref->s[i], gs[i] = got->s[i];
  int bad = 0;
  fill(ref, 7), fill(got, 7);
  k->scalar(&c, ref->p, ref->g, rs[0], rs[1], rs[2], ref->n, 0);
  if (bf16 != NULL) {
    bf16(&c, got->p, got->gb, gs[0], gs[1], gs[2], got->out, got->n, 512, 0);
    for (int64_t i = 0; i < got->n; i++)
      bad |= got->out[i] != zp_f32_to_bf16(ref->p[i]);
  } else {
    body(&c, got->p, got->g, gs[0], gs[1], gs[2], got->n, 512);
  }
  bad |= memcmp(ref->p, got->p, (size_t)ref->n * sizeof(float)) != 0;
  for (int i = 0; i < k->states; i++)
    bad |= memcmp(rs[i], gs[i], (size_t)ref->n * sizeof(float)) != 0;
  if (bad)
    fprintf(stderr, "MISMATCH: %s %s %s differs from the scalar body\n", k->name, isa,
           bf16 != NULL ? "bf16" : "fp32");
  return bad;
}

static double time_body(const zp_kind_row *k, zp_opt_body body, zp_opt_bf16_body bf16,
                        zp_bufs *b, int reps, int trials) {
  const zp_opt_coef c = coef_for(k->kind);
  float *s[3] = {NULL, NULL, NULL};
  for (int i = 0; i < k->states; i++)
    s[i] = b->s[i];
  fill(b, 11);
  double best = 1e30;
  for (int t = 0; t < trials; t++) {
    double t0 = now_s();
    for (int r = 0; r < reps; r++) {
      if (bf16 != NULL)
        bf16(&c, b->p, b->gb, s[0], s[1], s[2], b->out, b->n, 512, 0);
      else
        body(&c, b->p, b->g, s[0], s[1], s[2], b->n, 512);
    }
    double dt = now_s() - t0;
    best = dt < best ? dt : best;
  }
  return best / ((double)b->n * reps) * 1e9;
}

/* A table cell: the time, or "-" where the body was not run (negative). */
static void cell(char *buf, size_t size, double ns) {
  if (ns < 0)
    snprintf(buf, size, "-");
  else
    snprintf(buf, size, "%.3f", ns);
}

static int alloc(zp_bufs *b, int64_t n) {
  b->n = n;
  size_t f = ((size_t)n * sizeof(float) + 63) / 64 * 64, h = ((size_t)n * 2 + 63) / 64 * 64;
  b->p = aligned_alloc(64, f), b->g = aligned_alloc(64, f);
  for (int k = 0; k < 3; k++)
    b->s[k] = aligned_alloc(64, f);
  b->gb = aligned_alloc(64, h), b->out = aligned_alloc(64, h);
  return b->p && b->g && b->s[0] && b->s[1] && b->s[2] && b->gb && b->out;
}

int main(int argc, char **argv) {
  const int64_t n = argc > 1 ? atoll(argv[1]) : 16384;
  const int reps = argc > 2 ? atoi(argv[2]) : 400, trials = argc > 3 ? atoi(argv[3]) : 30;
  if (n < 1 || reps < 1 || trials < 1) {
    fprintf(stderr, "usage: %s [N>0 [REPS>0 [TRIALS>0]]]\n", argv[0]);
    return 2;
  }
  zp_bufs ref, got;
  if (!alloc(&ref, n) || !alloc(&got, n)) {
    fprintf(stderr, "optim_bodies: out of memory for %lld elements\n", (long long)n);
    return 2;
  }
  print_cpu();
  printf("one thread, %lld elements (%.0f KiB per fp32 stream), min of %d trials of %d calls\n\n",
         (long long)n, (double)n * 4 / 1024, trials, reps);
  __builtin_cpu_init();
  const int has512 = __builtin_cpu_supports("avx512f");
  const int has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                   __builtin_cpu_supports("f16c");
  printf("| optimizer | grad/param | scalar ns/elem | avx2 ns/elem | avx512 ns/elem |\n");
  printf("|---|---|---:|---:|---:|\n");
  int bad = 0;
  for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
    const zp_kind_row *k = &kinds[i];
    for (int wide = 0; wide < 2; wide++) {
      const int bf = wide == 1;
      double t2 = -1, t512 = -1;
      double ts = bf ? -1 : time_body(k, k->scalar, NULL, &got, reps, trials);
      if (has2) {
        bad |= check(k, k->avx2, bf ? k->avx2_bf16 : NULL, &ref, &got, "avx2");
        t2 = time_body(k, k->avx2, bf ? k->avx2_bf16 : NULL, &got, reps, trials);
      }
      if (has512) {
        bad |= check(k, k->avx512, bf ? k->avx512_bf16 : NULL, &ref, &got, "avx512");
        t512 = time_body(k, k->avx512, bf ? k->avx512_bf16 : NULL, &got, reps, trials);
      }
      char s[32], a[32], b[32];
      cell(s, sizeof s, ts), cell(a, sizeof a, t2), cell(b, sizeof b, t512);
      printf("| %s | %s | %s | %s | %s |\n", k->name, bf ? "bf16/bf16" : "fp32/fp32", s, a, b);
    }
  }
  return bad;
}
#endif
