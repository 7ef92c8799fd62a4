/* fake_nccl.c - a libnccl.so.2 stand-in for tests/test_nccl_core.py: every call the executor
 * makes, with int results as in csrc/comm/nccl_lib.h, appended to a log the test reads
 * (fake_nccl_log). Built with -DFAKE_NO_P2P it lacks ncclSend/ncclRecv/ncclGroupStart/
 * ncclGroupEnd, as NCCL before 2.7 does. Knobs: fake_nccl_fail_at(k) makes the k-th logged call
 * fail with 2 (ncclSystemError); fake_nccl_block_group_end(1) makes ncclGroupEnd wait until
 * ncclCommAbort (an enqueue stuck on a dead peer). */
#define _POSIX_C_SOURCE 200809L
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
  char name[24];
  const void *buf;
  size_t count;
  int dtype, peer, depth; /* peer: or root; depth: the ncclGroupStart nesting at the call */
  void *stream;
} fake_call;

#define FAKE_MAX_CALLS 256
static fake_call fake_log[FAKE_MAX_CALLS];
static int fake_n, fake_fail_at_call = -1, fake_depth;
static atomic_int fake_block_end, fake_aborted;

struct fake_comm {
  int nranks, rank;
};

typedef struct {
  char bytes[128];
} fake_id; /* ncclUniqueId, passed by value */

int fake_nccl_calls(void) { return fake_n; }
const fake_call *fake_nccl_log(int i) { return i >= 0 && i < fake_n ? &fake_log[i] : NULL; }
void fake_nccl_reset(void) { fake_n = 0, fake_fail_at_call = -1; }
void fake_nccl_fail_at(int k) { fake_fail_at_call = k; }
void fake_nccl_block_group_end(int on) { atomic_store(&fake_block_end, on); }
int fake_nccl_depth(void) { return fake_depth; }

static int fake_record(const char *name, const void *buf, size_t count, int dtype, int peer,
                       void *stream) {
  if (fake_n == FAKE_MAX_CALLS)
    return 3;
  fake_call *c = &fake_log[fake_n];
  snprintf(c->name, sizeof c->name, "%s", name);
  c->buf = buf, c->count = count, c->dtype = dtype, c->peer = peer, c->depth = fake_depth;
  c->stream = stream;
  return fake_n++ == fake_fail_at_call ? 2 : 0;
}

int ncclGetVersion(int *v) {
  *v = 22703;
  return 0;
}
int ncclGetUniqueId(void *id) {
  memset(id, 7, 128);
  return 0;
}
int ncclCommInitRank(struct fake_comm **comm, int nranks, fake_id id, int rank) {
  (void)id;
  *comm = malloc(sizeof **comm);
  if (*comm == NULL)
    return 2;
  (*comm)->nranks = nranks, (*comm)->rank = rank;
  atomic_store(&fake_aborted, 0);
  return 0;
}
int ncclCommDestroy(struct fake_comm *comm) {
  fake_record("ncclCommDestroy", NULL, 0, 0, 0, NULL);
  free(comm);
  return 0;
}
int ncclCommAbort(struct fake_comm *comm) {
  fake_record("ncclCommAbort", NULL, 0, 0, 0, NULL);
  free(comm); /* as NCCL's abort frees the communicator */
  atomic_store(&fake_aborted, 1);
  return 0;
}
int ncclCommGetAsyncError(struct fake_comm *comm, int *err) {
  (void)comm;
  *err = 0;
  return 0;
}
const char *ncclGetErrorString(int r) { return r ? "fake failure" : "no error"; }
const char *ncclGetLastError(struct fake_comm *comm) {
  (void)comm;
  return "fake detail";
}
int ncclAllReduce(const void *s, void *r, size_t n, int dt, int op, void *comm, void *stream) {
  (void)r, (void)op, (void)comm;
  return fake_record("ncclAllReduce", s, n, dt, 0, stream);
}
int ncclReduceScatter(const void *s, void *r, size_t n, int dt, int op, void *comm,
                      void *stream) {
  (void)r, (void)op, (void)comm;
  return fake_record("ncclReduceScatter", s, n, dt, 0, stream);
}
int ncclAllGather(const void *s, void *r, size_t n, int dt, void *comm, void *stream) {
  (void)r, (void)comm;
  return fake_record("ncclAllGather", s, n, dt, 0, stream);
}
int ncclBroadcast(const void *s, void *r, size_t n, int dt, int root, void *comm, void *stream) {
  (void)r, (void)comm;
  return fake_record("ncclBroadcast", s, n, dt, root, stream);
}

#ifndef FAKE_NO_P2P
int ncclSend(const void *s, size_t n, int dt, int peer, void *comm, void *stream) {
  (void)comm;
  return fake_record("ncclSend", s, n, dt, peer, stream);
}
int ncclRecv(void *r, size_t n, int dt, int peer, void *comm, void *stream) {
  (void)comm;
  return fake_record("ncclRecv", r, n, dt, peer, stream);
}
int ncclGroupStart(void) {
  int rc = fake_record("ncclGroupStart", NULL, 0, 0, 0, NULL);
  fake_depth++;
  return rc;
}
int ncclGroupEnd(void) {
  fake_depth--;
  if (atomic_load(&fake_block_end)) {
    struct timespec pause = {0, 1000000};
    while (!atomic_load(&fake_aborted))
      nanosleep(&pause, NULL);
    fake_record("ncclGroupEnd", NULL, 0, 0, 0, NULL);
    return 6; /* ncclRemoteError, as an aborted group returns */
  }
  return fake_record("ncclGroupEnd", NULL, 0, 0, 0, NULL);
}
#endif
