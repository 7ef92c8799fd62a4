/* test_memcopy.c - zp_copy_spans (memcopy.h) against memcpy: spans of every size around the
 * block, thread counts, and the errors (which copy nothing). */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kernels/cpu/memcopy.h"

void test_copy_spans_matches_memcpy(void) {
  zt_rng rng = zt_rng_seed(11);
  const int64_t sizes[] = {0, 1, 7, 4096, (1 << 20) - 3, 1 << 20, (1 << 20) + 5, 3 << 20};
  const int n_sizes = (int)(sizeof sizes / sizeof sizes[0]);
  int64_t total = 0;
  for (int k = 0; k < n_sizes; k++)
    total += sizes[k];
  unsigned char *src = malloc((size_t)total), *dst = malloc((size_t)total);
  if (!CHECK(src != NULL && dst != NULL))
    goto out;
  for (int64_t i = 0; i < total; i++)
    src[i] = (unsigned char)zt_next(&rng);
  for (int threads = 1; threads <= 5; threads += 2) {
    memset(dst, 0xA5, (size_t)total);
    zp_copy_span spans[8];
    int64_t at = 0;
    for (int k = 0; k < n_sizes; k++) { /* reversed order: span k lands where span n-1-k sat */
      spans[k] = (zp_copy_span){dst + total - at - sizes[k], src + at, sizes[k]};
      at += sizes[k];
    }
    CHECK_OK(zp_copy_spans(spans, n_sizes, threads));
    at = 0;
    for (int k = 0; k < n_sizes; k++) {
      CHECK_MSG(memcmp(dst + total - at - sizes[k], src + at, (size_t)sizes[k]) == 0,
                "span %d (%lld bytes) at %d threads", k, (long long)sizes[k], threads);
      at += sizes[k];
    }
  }
  CHECK_OK(zp_copy_spans(NULL, 0, 0)); /* nothing to copy */
out:
  free(src);
  free(dst);
}

static void copy_errors(void *arg) {
  (void)arg;
  unsigned char a[64], b[64];
  memset(a, 1, sizeof a);
  memset(b, 2, sizeof b);
  zp_copy_span s[2] = {{b, a, 32}, {b + 16, a + 32, 32}}; /* destinations overlap */
  CHECK_FAILS(zp_copy_spans(s, 2, 2), ZP_ERR_INVALID);
  s[1] = (zp_copy_span){a + 40, b, 8}; /* its source is span 0's destination */
  CHECK_FAILS(zp_copy_spans(s, 2, 2), ZP_ERR_INVALID);
  s[1] = (zp_copy_span){b + 40, b + 36, 8}; /* overlaps its own source */
  CHECK_FAILS(zp_copy_spans(s, 2, 2), ZP_ERR_INVALID);
  s[1] = (zp_copy_span){b + 40, a + 40, -1};
  CHECK_FAILS(zp_copy_spans(s, 2, 2), ZP_ERR_INVALID);
  s[1] = (zp_copy_span){NULL, a + 40, 8};
  CHECK_FAILS(zp_copy_spans(s, 2, 2), ZP_ERR_INVALID);
  CHECK_FAILS(zp_copy_spans(NULL, 1, 2), ZP_ERR_INVALID);
  CHECK_FAILS(zp_copy_spans(s, 65, 2), ZP_ERR_INVALID);
  for (size_t i = 0; i < sizeof b; i++) /* a failed call copied nothing */
    if (!CHECK(b[i] == 2))
      break;
}

void test_copy_spans_errors(void) { zt_run_fresh(copy_errors, NULL); }
