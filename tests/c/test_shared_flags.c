/* test_shared_flags.c - zp_flag_publish / zp_flags_wait_ge: a writer thread's data is seen by a
 * reader that waited for its flag, a wait for what never comes ends at its timeout with the
 * late index, and bad arguments fail with a message. */
#include <pthread.h>
#include <string.h>

#include "check.h"
#include "common/shared_flags.h"

enum { ZT_N = 4, ZT_ROUNDS = 2000, ZT_WORDS = 64 };

typedef struct {
  int64_t flags[ZT_N];  /* one per writer */
  int64_t data[ZT_N][ZT_WORDS];
} zt_board;

typedef struct {
  zt_board *board;
  int who;
} zt_writer_arg;

static void *zt_writer(void *p) {
  zt_writer_arg *a = p;
  for (int64_t r = 1; r <= ZT_ROUNDS; r++) {
    /* wait until every writer finished round r - 1 (so the reader had it), then write round r */
    if (zp_flags_wait_ge(a->board->flags, ZT_N, 1, r - 1, 10.0, NULL) != ZP_OK)
      return NULL;
    for (int w = 0; w < ZT_WORDS; w++)
      a->board->data[a->who][w] = r * 1000 + w;
    zp_flag_publish(&a->board->flags[a->who], r);
  }
  return NULL;
}

void test_shared_flags_publish_then_wait(void) {
  static zt_board board;
  memset(&board, 0, sizeof board);
  pthread_t threads[ZT_N];
  zt_writer_arg args[ZT_N];
  for (int i = 0; i < ZT_N; i++) {
    args[i] = (zt_writer_arg){&board, i};
    pthread_create(&threads[i], NULL, zt_writer, &args[i]);
  }
  int bad = 0;
  for (int64_t r = 1; r <= ZT_ROUNDS && !bad; r++) {
    if (!CHECK_OK(zp_flags_wait_ge(board.flags, ZT_N, 1, r, 10.0, NULL)))
      break;
    /* a writer may already be one round ahead: at least round r, and whole */
    for (int i = 0; i < ZT_N; i++)
      for (int w = 0; w < ZT_WORDS; w++)
        bad |= board.data[i][w] / 1000 < r;
  }
  CHECK(!bad);
  for (int i = 0; i < ZT_N; i++)
    pthread_join(threads[i], NULL);
}

void test_shared_flags_timeout_and_errors(void) {
  int64_t flags[6] = {5, 0, 5, 0, 5, 0}; /* stride 2: 5, 5, 5 arrived; stride 1: index 1 late */
  int32_t late = 99;
  CHECK_OK(zp_flags_wait_ge(flags, 3, 2, 5, 1.0, &late));
  CHECK_EQ(late, -1);
  CHECK_FAILS(zp_flags_wait_ge(flags, 3, 1, 5, 0.05, &late), ZP_ERR_STATE);
  CHECK_EQ(late, 1);
  CHECK(strstr(zp_last_error(), "rank 1 did not publish step 5") != NULL);
  CHECK_FAILS(zp_flags_wait_ge(NULL, 1, 1, 0, 1.0, NULL), ZP_ERR_INVALID);
  CHECK_FAILS(zp_flags_wait_ge(flags, 1, 0, 0, 1.0, NULL), ZP_ERR_INVALID);
  CHECK_FAILS(zp_flags_wait_ge(flags, 1, 1, 0, 0.0, NULL), ZP_ERR_INVALID);
  CHECK_OK(zp_flags_wait_ge(flags, 0, 1, 100, 1.0, NULL)); /* nothing to wait for */
  zp_flag_publish(&flags[1], 7);
  CHECK_OK(zp_flags_wait_ge(flags, 2, 1, 5, 1.0, NULL));
}
