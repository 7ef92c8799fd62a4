/* test_comm.c - csrc/comm/communicator.c without a GPU: the CUDA runtime is fake_cudart.c and
 * NCCL is fake_nccl.c (loaded by path, as zp_nccl_load loads the real one), so every call the
 * communicator makes is logged and checked. Run by tests/test_nccl_core.py:
 *   test_comm <libfake_nccl.so> p2p     the all-to-all's calls, checks, failures and watchdog
 *   test_comm <libfake_nccl_old.so> old  a library without ncclSend/ncclRecv (NCCL < 2.7) */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "comm/communicator.h"
#include "comm/nccl_lib.h"

typedef struct {
  char name[24];
  const void *buf;
  size_t count;
  int dtype, peer, depth;
  void *stream;
} fake_call; /* fake_nccl.c's */

static int (*calls)(void);
static const fake_call *(*log_at)(int);
static void (*reset)(void), (*fail_at)(int), (*block_group_end)(int);
static int (*depth)(void);
void fake_cuda_hold_events(int hold);

static int failures;
#define CHECK(cond)                                                                        \
  ((cond) ? 1 : (fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond), \
                 failures++, 0))
#define CHECK_MSG(st, code, text)                                                          \
  (CHECK((st) == (code)) && CHECK(strstr(zp_last_error(), (text)) != NULL) ? 1           \
       : (fprintf(stderr, "  message: %s\n", zp_last_error()), 0))

static void *sym(void *h, const char *name) {
  void *f = dlsym(h, name);
  if (f == NULL) {
    fprintf(stderr, "fake library has no %s\n", name);
    failures++;
  }
  return f;
}

#define BIND(var, name)                                                                    \
  do {                                                                                     \
    void *f_ = sym(h, name);                                                               \
    memcpy(&(var), &f_, sizeof(var));                                                      \
  } while (0)

static int is(int i, const char *name) {
  const fake_call *c = log_at(i);
  return c != NULL && strcmp(c->name, name) == 0;
}

static void sleep_s(double s) {
  struct timespec t = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  nanosleep(&t, NULL);
}

static zp_comm *make(int nranks, int rank, double timeout_s) {
  zp_nccl_id id;
  memset(&id, 0, sizeof id);
  zp_comm *c = NULL;
  if (!CHECK(zp_comm_create(&id, nranks, rank, 0, timeout_s, &c) == ZP_OK))
    fprintf(stderr, "  %s\n", zp_last_error());
  return c;
}

/* The grouped calls: ncclGroupStart, then per rank p an ncclSend of send chunk p and an ncclRecv
 * into recv chunk p, inside the group and on the communicator's stream, then ncclGroupEnd. */
static void test_all_to_all_calls(void) {
  zp_comm *c = make(4, 1, 60.0);
  float send[40], recv[40];
  cudaStream_t stream = (cudaStream_t)(void *)0x5000, after = (cudaStream_t)(void *)0x6000;
  reset();
  zp_work *w = NULL;
  CHECK(zp_comm_collective(c, ZP_COLL_ALL_TO_ALL, send, recv, 10, ZP_NCCL_FLOAT32, 0, 0, stream,
                           after, &w) == ZP_OK);
  CHECK(calls() == 2 + 2 * 4);
  CHECK(is(0, "ncclGroupStart"));
  for (int p = 0; p < 4; p++) {
    const fake_call *s = log_at(1 + 2 * p), *r = log_at(2 + 2 * p);
    CHECK(is(1 + 2 * p, "ncclSend") && is(2 + 2 * p, "ncclRecv"));
    CHECK(s->buf == send + 10 * p && r->buf == recv + 10 * p);
    CHECK(s->count == 10 && r->count == 10 && s->dtype == ZP_NCCL_FLOAT32);
    CHECK(s->peer == p && r->peer == p && s->depth == 1 && r->depth == 1);
    CHECK(s->stream == (void *)stream && r->stream == (void *)stream);
  }
  CHECK(is(9, "ncclGroupEnd") && depth() == 0);
  CHECK(zp_work_synchronize(w) == ZP_OK);
  zp_work_release(w);

  /* bf16 chunks of an odd count: byte offsets, not element offsets of another size */
  unsigned short b_send[4 * 3], b_recv[4 * 3];
  reset();
  CHECK(zp_comm_collective(c, ZP_COLL_ALL_TO_ALL, b_send, b_recv, 3, ZP_NCCL_BFLOAT16, 0, 0,
                           stream, after, &w) == ZP_OK);
  CHECK(log_at(7)->buf == b_send + 9 && log_at(8)->buf == b_recv + 9);
  zp_work_release(w);

  /* refused before NCCL sees anything */
  reset();
  CHECK_MSG(zp_comm_collective(c, ZP_COLL_ALL_TO_ALL, send, send + 5, 5, ZP_NCCL_FLOAT32, 0, 0,
                               stream, after, &w), ZP_ERR_INVALID, "overlap");
  CHECK_MSG(zp_comm_collective(c, ZP_COLL_ALL_TO_ALL, send, recv, 0, ZP_NCCL_FLOAT32, 0, 0,
                               stream, after, &w), ZP_ERR_INVALID, "count is 0");
  CHECK_MSG(zp_comm_collective(c, ZP_COLL_ALL_TO_ALL, send, recv, (size_t)1 << 62,
                               ZP_NCCL_FLOAT32, 0, 0, stream, after, &w), ZP_ERR_INVALID,
            "overflow");
  CHECK_MSG(zp_comm_collective(c, ZP_COLL_ALL_TO_ALL, send, NULL, 10, ZP_NCCL_FLOAT32, 0, 0,
                               stream, after, &w), ZP_ERR_INVALID, "NULL recv");
  CHECK_MSG(zp_comm_collective(c, (zp_coll)5, send, recv, 10, ZP_NCCL_FLOAT32, 0, 0, stream,
                               after, &w), ZP_ERR_INVALID, "unknown collective 5");
  CHECK(calls() == 0);

  /* a failed call inside the group: named in the message, and the group is still closed */
  reset();
  fail_at(4); /* GroupStart, Send 0, Recv 0, Send 1, Recv 1 */
  CHECK_MSG(zp_comm_collective(c, ZP_COLL_ALL_TO_ALL, send, recv, 10, ZP_NCCL_FLOAT32, 0, 0,
                               stream, after, &w), ZP_ERR_SYSTEM,
            "all_to_all (ncclRecv): NCCL error 2 (fake failure): fake detail");
  CHECK(calls() == 6 && is(5, "ncclGroupEnd") && depth() == 0);
  reset();
  fail_at(1);
  CHECK_MSG(zp_comm_collective(c, ZP_COLL_ALL_TO_ALL, send, recv, 10, ZP_NCCL_FLOAT32, 0, 0,
                               stream, after, &w), ZP_ERR_SYSTEM, "all_to_all (ncclSend)");
  CHECK(calls() == 3 && is(2, "ncclGroupEnd") && depth() == 0);
  reset();
  fail_at(9);
  CHECK_MSG(zp_comm_collective(c, ZP_COLL_ALL_TO_ALL, send, recv, 10, ZP_NCCL_FLOAT32, 0, 0,
                               stream, after, &w), ZP_ERR_SYSTEM, "all_to_all (ncclGroupEnd)");
  /* the others' messages are as before, and the communicator still works */
  reset();
  fail_at(0);
  CHECK_MSG(zp_comm_collective(c, ZP_COLL_ALL_REDUCE, send, send, 10, ZP_NCCL_FLOAT32, 0, 0,
                               stream, after, &w), ZP_ERR_SYSTEM, "all_reduce: NCCL error 2");
  reset();
  CHECK(zp_comm_collective(c, ZP_COLL_ALL_TO_ALL, send, recv, 10, ZP_NCCL_FLOAT32, 0, 0, stream,
                           after, &w) == ZP_OK);
  zp_work_release(w);
  CHECK(zp_comm_status(c) == ZP_OK);
  zp_comm_destroy(c);
}

/* One rank: its chunk goes to itself (NCCL copies a send/recv pair to self locally). */
static void test_all_to_all_one_rank(void) {
  zp_comm *c = make(1, 0, 60.0);
  double send[7], recv[7];
  zp_work *w = NULL;
  reset();
  CHECK(zp_comm_collective(c, ZP_COLL_ALL_TO_ALL, send, recv, 7, ZP_NCCL_FLOAT64, 0, 0,
                           (cudaStream_t)0, (cudaStream_t)0, &w) == ZP_OK);
  CHECK(calls() == 4 && log_at(1)->peer == 0 && log_at(2)->buf == recv);
  zp_work_release(w);
  zp_comm_destroy(c);
}

/* The watchdog covers the all-to-all as any collective: one that does not finish, and one whose
 * enqueue (ncclGroupEnd) blocks, abort the communicator with a reason naming it. */
static void test_watchdog(void) {
  float send[8], recv[8];
  zp_work *w = NULL;
  zp_comm *c = make(2, 0, 0.2);
  fake_cuda_hold_events(1);
  CHECK(zp_comm_collective(c, ZP_COLL_ALL_TO_ALL, send, recv, 4, ZP_NCCL_FLOAT32, 0, 0,
                           (cudaStream_t)0, (cudaStream_t)0, &w) == ZP_OK);
  CHECK_MSG(zp_work_synchronize(w), ZP_ERR_SYSTEM,
            "collective #1 (all_to_all) did not finish within 0.2 s");
  fake_cuda_hold_events(0);
  CHECK_MSG(zp_comm_collective(c, ZP_COLL_ALL_TO_ALL, send, recv, 4, ZP_NCCL_FLOAT32, 0, 0,
                               (cudaStream_t)0, (cudaStream_t)0, &w), ZP_ERR_SYSTEM,
            "has failed");
  zp_work_release(w);
  zp_comm_destroy(c);

  c = make(2, 0, 0.2);
  block_group_end(1);
  reset();
  zp_status st = zp_comm_collective(c, ZP_COLL_ALL_TO_ALL, send, recv, 4, ZP_NCCL_FLOAT32, 0, 0,
                                    (cudaStream_t)0, (cudaStream_t)0, &w);
  block_group_end(0);
  CHECK(st == ZP_ERR_SYSTEM);
  CHECK_MSG(zp_comm_status(c), ZP_ERR_SYSTEM,
            "enqueuing collective #1 (all_to_all) did not return within 0.2 s");
  zp_comm_destroy(c);
  sleep_s(0.01);
}

/* NCCL < 2.7: it loads, every collective but the all-to-all runs, and the all-to-all says why. */
static void test_old_library(const zp_nccl_lib *lib) {
  CHECK(!zp_nccl_has_p2p(lib) && lib->send == NULL && lib->group_end == NULL);
  zp_comm *c = make(2, 0, 60.0);
  float send[8], recv[8];
  zp_work *w = NULL;
  CHECK_MSG(zp_comm_collective(c, ZP_COLL_ALL_TO_ALL, send, recv, 4, ZP_NCCL_FLOAT32, 0, 0,
                               (cudaStream_t)0, (cudaStream_t)0, &w), ZP_ERR_STATE,
            "has no ncclSend/ncclRecv/ncclGroupStart/ncclGroupEnd; they came in NCCL 2.7");
  CHECK(zp_comm_collective(c, ZP_COLL_ALL_GATHER, send, recv, 4, ZP_NCCL_FLOAT32, 0, 0,
                           (cudaStream_t)0, (cudaStream_t)0, &w) == ZP_OK);
  zp_work_release(w);
  zp_comm_destroy(c);
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s <fake libnccl> p2p|old\n", argv[0]);
    return 2;
  }
  const zp_nccl_lib *lib = NULL;
  if (zp_nccl_load(argv[1], &lib) != ZP_OK) {
    fprintf(stderr, "zp_nccl_load: %s\n", zp_last_error());
    return 1;
  }
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_NOLOAD); /* the copy zp_nccl_load opened */
  if (h == NULL) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 1;
  }
  BIND(calls, "fake_nccl_calls");
  BIND(log_at, "fake_nccl_log");
  BIND(reset, "fake_nccl_reset");
  BIND(fail_at, "fake_nccl_fail_at");
  BIND(block_group_end, "fake_nccl_block_group_end");
  BIND(depth, "fake_nccl_depth");
  if (failures)
    return 1;
  if (strcmp(argv[2], "old") == 0) {
    test_old_library(lib);
  } else {
    CHECK(zp_nccl_has_p2p(lib));
    test_all_to_all_calls();
    test_all_to_all_one_rank();
    test_watchdog();
  }
  dlclose(h);
  printf("%s: %d failure(s)\n", argv[2], failures);
  return failures != 0;
}
