/* communicator.c - an NCCL communicator, its collectives and its watchdog (communicator.h).
 *
 * Locks: `state` guards the pending list, the failure and the reference counts and is held
 * only briefly, never across an NCCL call; `enqueue` serialises the NCCL calls of callers (a
 * communicator takes one collective at a time, in the same order on every rank). The watchdog
 * takes only `state`, so it can always reach ncclCommAbort. */
#define _GNU_SOURCE
#include "comm/communicator.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define ZP_COMM_REASON 480

struct zp_work {
  zp_comm *comm;
  cudaEvent_t done;
  int refs;          /* the caller's and the pending list's; guarded by comm->state */
  uint64_t seq;      /* 1 for the communicator's first collective */
  zp_coll coll;
  double issued_s;   /* monotonic clock at enqueue */
};

struct zp_comm {
  const zp_nccl_lib *lib;
  zp_nccl_handle handle;
  int rank, nranks, device;
  double timeout_s;
  cudaEvent_t ready; /* recorded on the caller's stream before each collective */
  pthread_mutex_t state, enqueue;
  pthread_cond_t wake;
  pthread_t watchdog;
  int watchdog_running, stop;
  zp_work **pending; /* issued, not yet seen complete, oldest first */
  int n_pending, cap_pending;
  uint64_t seq;
  double enqueue_since_s; /* > 0 while a caller is inside an NCCL call */
  zp_coll enqueue_coll;
  int failed, aborted;
  char reason[ZP_COMM_REASON];
};

static const char *const zp_coll_names[] = {"all_reduce", "reduce_scatter", "all_gather",
                                            "broadcast", "all_to_all"};

static double zp_now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static zp_status zp_cuda_error(const char *what, cudaError_t e) {
  (void)cudaGetLastError();
  return zp_fail(ZP_ERR_SYSTEM, "%s: CUDA error %s: %s", what, cudaGetErrorName(e),
                 cudaGetErrorString(e));
}

/* Makes `device` current for this thread; *prev receives the one to restore. */
static zp_status zp_enter_device(int device, int *prev) {
  cudaError_t e = cudaGetDevice(prev);
  if (e == cudaSuccess && *prev != device)
    e = cudaSetDevice(device);
  return e == cudaSuccess ? ZP_OK : zp_cuda_error("nccl: cudaSetDevice", e);
}

static void zp_leave_device(int device, int prev) {
  if (prev != device)
    (void)cudaSetDevice(prev);
}

/* Records the first failure and aborts NCCL. Called without `state` held. */
static void zp_comm_fail(zp_comm *c, const char *reason) {
  pthread_mutex_lock(&c->state);
  int first = !c->failed;
  if (first) {
    c->failed = 1;
    snprintf(c->reason, sizeof c->reason, "%s", reason);
  }
  int abort_now = !c->aborted && c->handle != NULL;
  c->aborted = 1;
  pthread_mutex_unlock(&c->state);
  if (abort_now)
    (void)c->lib->comm_abort(c->handle); /* unblocks NCCL kernels and blocked NCCL calls */
}

static zp_status zp_comm_failure(zp_comm *c) {
  /* caller holds `state` */
  return zp_fail(ZP_ERR_SYSTEM, "NCCL communicator (rank %d of %d) has failed: %s", c->rank,
                 c->nranks, c->reason);
}

static void zp_work_unref_locked(zp_work *w) {
  if (--w->refs == 0) {
    (void)cudaEventDestroy(w->done);
    free(w);
  }
}

/* One pass of the watchdog: retire finished works, find a timeout or an asynchronous error.
 * Writes the reason of a failure into `reason` and returns 1, else 0. */
static int zp_watch_once(zp_comm *c, char *reason, size_t reason_size) {
  const double now = zp_now_s();
  int bad = 0;
  pthread_mutex_lock(&c->state);
  if (c->failed) {
    pthread_mutex_unlock(&c->state);
    return 0;
  }
  int kept = 0;
  for (int i = 0; i < c->n_pending; i++) {
    zp_work *w = c->pending[i];
    cudaError_t e = bad ? cudaErrorNotReady : cudaEventQuery(w->done);
    if (e == cudaSuccess) {
      zp_work_unref_locked(w);
      continue;
    }
    c->pending[kept++] = w;
    if (bad)
      continue;
    if (e != cudaErrorNotReady) {
      (void)cudaGetLastError();
      snprintf(reason, reason_size, "collective #%llu (%s) failed on the device: CUDA error %s: "
               "%s", (unsigned long long)w->seq, zp_coll_names[w->coll], cudaGetErrorName(e),
               cudaGetErrorString(e));
      bad = 1;
    } else if (now - w->issued_s > c->timeout_s) {
      snprintf(reason, reason_size, "collective #%llu (%s) did not finish within %g s: a peer "
               "has probably died or issued other collectives; the communicator was aborted",
               (unsigned long long)w->seq, zp_coll_names[w->coll], c->timeout_s);
      bad = 1;
    }
  }
  c->n_pending = kept;
  if (!bad && c->enqueue_since_s > 0.0 && now - c->enqueue_since_s > c->timeout_s) {
    snprintf(reason, reason_size, "enqueuing collective #%llu (%s) did not return within %g s: "
             "a peer has probably died; the communicator was aborted",
             (unsigned long long)c->seq + 1, zp_coll_names[c->enqueue_coll], c->timeout_s);
    bad = 1;
  }
  pthread_mutex_unlock(&c->state);
  if (!bad) {
    int async = ZP_NCCL_SUCCESS;
    int rc = c->lib->comm_get_async_error(c->handle, &async);
    if (rc == ZP_NCCL_SUCCESS && async != ZP_NCCL_SUCCESS && async != ZP_NCCL_IN_PROGRESS) {
      const char *detail = c->lib->get_last_error != NULL ? c->lib->get_last_error(c->handle)
                                                          : NULL;
      snprintf(reason, reason_size, "NCCL reported an asynchronous error %d (%s)%s%s", async,
               c->lib->get_error_string(async), detail && detail[0] ? ": " : "",
               detail ? detail : "");
      bad = 1;
    }
  }
  return bad;
}

static void *zp_watchdog_main(void *arg) {
  zp_comm *c = arg;
  (void)cudaSetDevice(c->device); /* event queries need the communicator's device */
  double period = c->timeout_s / 20.0;
  period = period < 0.001 ? 0.001 : period > 0.1 ? 0.1 : period;
  char reason[ZP_COMM_REASON];
  pthread_mutex_lock(&c->state);
  while (!c->stop) {
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    double t = (double)until.tv_sec + 1e-9 * (double)until.tv_nsec + period;
    until.tv_sec = (time_t)t;
    until.tv_nsec = (long)((t - (double)until.tv_sec) * 1e9);
    pthread_cond_timedwait(&c->wake, &c->state, &until);
    if (c->stop)
      break;
    pthread_mutex_unlock(&c->state);
    if (zp_watch_once(c, reason, sizeof reason))
      zp_comm_fail(c, reason);
    pthread_mutex_lock(&c->state);
  }
  pthread_mutex_unlock(&c->state);
  return NULL;
}

zp_status zp_comm_create(const zp_nccl_id *id, int nranks, int rank, int device,
                         double timeout_s, zp_comm **out) {
  const zp_nccl_lib *lib = zp_nccl_loaded();
  if (lib == NULL)
    return zp_fail(ZP_ERR_STATE, "nccl: the library is not loaded (call nccl_load first)");
  if (id == NULL || out == NULL)
    return zp_fail(ZP_ERR_INVALID, "nccl: id and out must not be NULL");
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return zp_fail(ZP_ERR_INVALID, "nccl: rank %d of %d: need 0 <= rank < nranks", rank, nranks);
  if (device < 0)
    return zp_fail(ZP_ERR_INVALID, "nccl: device %d: need a CUDA device index >= 0", device);
  if (!(timeout_s > 0.0) || !isfinite(timeout_s))
    return zp_fail(ZP_ERR_INVALID, "nccl: timeout %g s: need a finite number > 0", timeout_s);
  zp_comm *c = calloc(1, sizeof *c);
  if (c == NULL)
    return zp_fail(ZP_ERR_NOMEM, "nccl: out of memory");
  c->lib = lib, c->rank = rank, c->nranks = nranks, c->device = device;
  c->timeout_s = timeout_s;
  int prev = 0;
  zp_status st = zp_enter_device(device, &prev);
  if (st != ZP_OK) {
    free(c);
    return st;
  }
  cudaError_t e = cudaEventCreateWithFlags(&c->ready, cudaEventDisableTiming);
  if (e != cudaSuccess) {
    zp_leave_device(device, prev);
    free(c);
    return zp_cuda_error("nccl: cudaEventCreate", e);
  }
  int rc = lib->comm_init_rank(&c->handle, nranks, *id, rank);
  zp_leave_device(device, prev);
  if (rc != ZP_NCCL_SUCCESS) {
    (void)cudaEventDestroy(c->ready);
    free(c);
    return zp_nccl_fail("ncclCommInitRank", rc, NULL);
  }
  pthread_condattr_t attr;
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_cond_init(&c->wake, &attr);
  pthread_condattr_destroy(&attr);
  pthread_mutex_init(&c->state, NULL);
  pthread_mutex_init(&c->enqueue, NULL);
  if (pthread_create(&c->watchdog, NULL, zp_watchdog_main, c) != 0) {
    (void)lib->comm_destroy(c->handle);
    (void)cudaEventDestroy(c->ready);
    pthread_cond_destroy(&c->wake);
    pthread_mutex_destroy(&c->state);
    pthread_mutex_destroy(&c->enqueue);
    free(c);
    return zp_fail(ZP_ERR_SYSTEM, "nccl: cannot start the watchdog thread");
  }
  c->watchdog_running = 1;
  *out = c;
  return ZP_OK;
}

void zp_comm_destroy(zp_comm *c) {
  if (c == NULL)
    return;
  pthread_mutex_lock(&c->state);
  c->stop = 1;
  pthread_cond_signal(&c->wake);
  pthread_mutex_unlock(&c->state);
  if (c->watchdog_running)
    pthread_join(c->watchdog, NULL);
  int prev = 0;
  int entered = zp_enter_device(c->device, &prev) == ZP_OK;
  pthread_mutex_lock(&c->state);
  int idle = 1;
  for (int i = 0; i < c->n_pending; i++) {
    if (cudaEventQuery(c->pending[i]->done) != cudaSuccess)
      idle = 0;
    zp_work_unref_locked(c->pending[i]);
  }
  (void)cudaGetLastError();
  free(c->pending);
  c->pending = NULL, c->n_pending = 0;
  int aborted = c->aborted;
  c->aborted = 1;
  pthread_mutex_unlock(&c->state);
  if (!aborted) {
    if (idle && !c->failed)
      (void)c->lib->comm_destroy(c->handle);
    else
      (void)c->lib->comm_abort(c->handle);
  }
  (void)cudaEventDestroy(c->ready);
  if (entered)
    zp_leave_device(c->device, prev);
  pthread_cond_destroy(&c->wake);
  pthread_mutex_destroy(&c->state);
  pthread_mutex_destroy(&c->enqueue);
  /* works the caller still holds point here: zp_work_release must not run after this */
  free(c);
}

zp_status zp_comm_status(zp_comm *c) {
  pthread_mutex_lock(&c->state);
  zp_status st = c->failed ? zp_comm_failure(c) : ZP_OK;
  pthread_mutex_unlock(&c->state);
  return st;
}

void zp_comm_abort(zp_comm *c, const char *reason) {
  zp_comm_fail(c, reason != NULL ? reason : "aborted by the caller");
}

int zp_comm_rank(const zp_comm *c) { return c->rank; }
int zp_comm_size(const zp_comm *c) { return c->nranks; }
int zp_comm_device(const zp_comm *c) { return c->device; }

/* The all-to-all's own conditions: the library has the point-to-point calls, the buffers' size
 * is a size_t, and they do not overlap (the peers' writes into recv would race with the reads
 * of send: NCCL runs the group's transfers concurrently). */
static zp_status zp_check_all_to_all(const zp_comm *c, const void *send, void *recv,
                                     size_t count, int dtype) {
  if (!zp_nccl_has_p2p(c->lib))
    return zp_fail(ZP_ERR_STATE, "nccl all_to_all: the loaded NCCL (version code %d) has no "
                   "ncclSend/ncclRecv/ncclGroupStart/ncclGroupEnd; they came in NCCL 2.7",
                   c->lib->version);
  const size_t elem = zp_nccl_dtype_size(dtype);
  if (count > SIZE_MAX / elem / (size_t)c->nranks)
    return zp_fail(ZP_ERR_INVALID, "nccl all_to_all: %zu elements to each of %d ranks "
                   "overflow a size_t of bytes", count, c->nranks);
  const size_t bytes = count * elem * (size_t)c->nranks;
  const uintptr_t s = (uintptr_t)send, r = (uintptr_t)recv;
  if (s > UINTPTR_MAX - bytes || r > UINTPTR_MAX - bytes)
    return zp_fail(ZP_ERR_INVALID, "nccl all_to_all: a buffer of %zu bytes wraps the address "
                   "space", bytes);
  if (s < r + bytes && r < s + bytes)
    return zp_fail(ZP_ERR_INVALID, "nccl all_to_all: send and recv overlap (it cannot run in "
                   "place)");
  return ZP_OK;
}

static zp_status zp_check_args(const zp_comm *c, zp_coll coll, const void *send, void *recv,
                               size_t count, int dtype, int op, int root) {
  const char *name = coll >= ZP_COLL_ALL_REDUCE && coll <= ZP_COLL_ALL_TO_ALL
                         ? zp_coll_names[coll] : NULL;
  if (name == NULL)
    return zp_fail(ZP_ERR_INVALID, "nccl: unknown collective %d", (int)coll);
  if (zp_nccl_dtype_size(dtype) == 0)
    return zp_fail(ZP_ERR_INVALID, "nccl %s: unknown data type %d", name, dtype);
  if ((coll == ZP_COLL_ALL_REDUCE || coll == ZP_COLL_REDUCE_SCATTER) &&
      (op < 0 || op >= ZP_NCCL_N_OPS))
    return zp_fail(ZP_ERR_INVALID, "nccl %s: unknown reduction op %d (0 sum, 1 prod, 2 max, "
                   "3 min)", name, op);
  if (coll == ZP_COLL_BROADCAST && (root < 0 || root >= c->nranks))
    return zp_fail(ZP_ERR_INVALID, "nccl broadcast: root %d outside [0, %d)", root, c->nranks);
  if (count == 0)
    return zp_fail(ZP_ERR_INVALID, "nccl %s: count is 0 (skip empty collectives)", name);
  if (send == NULL || recv == NULL)
    return zp_fail(ZP_ERR_INVALID, "nccl %s: NULL %s buffer", name, send == NULL ? "send"
                                                                                  : "recv");
  if (coll == ZP_COLL_ALL_TO_ALL)
    return zp_check_all_to_all(c, send, recv, count, dtype);
  return ZP_OK;
}

/* The all-to-all as NCCL builds it: inside one ncclGroupStart/End, an ncclSend of chunk p of
 * `send` and an ncclRecv into chunk p of `recv` for every rank p (this one included: NCCL copies
 * that pair locally). Grouped, the 2 * nranks calls are launched together, so no rank waits on a
 * peer that posts its pairs in another order. Called with `enqueue` held, like every NCCL call.
 * Returns NCCL's result and, on failure, names the call that failed in *failed_call. */
static int zp_enqueue_all_to_all(zp_comm *c, const void *send, void *recv, size_t count,
                                 int dtype, cudaStream_t stream, const char **failed_call) {
  const size_t chunk = count * zp_nccl_dtype_size(dtype); /* checked by zp_check_all_to_all */
  int rc = c->lib->group_start();
  if (rc != ZP_NCCL_SUCCESS) {
    *failed_call = "ncclGroupStart";
    return rc;
  }
  for (int peer = 0; peer < c->nranks && rc == ZP_NCCL_SUCCESS; peer++) {
    rc = c->lib->send((const char *)send + (size_t)peer * chunk, count, dtype, peer, c->handle,
                      stream);
    if (rc != ZP_NCCL_SUCCESS) {
      *failed_call = "ncclSend";
      break;
    }
    rc = c->lib->recv((char *)recv + (size_t)peer * chunk, count, dtype, peer, c->handle,
                      stream);
    if (rc != ZP_NCCL_SUCCESS)
      *failed_call = "ncclRecv";
  }
  /* the group is closed even after a failed call: left open, it would swallow this thread's
   * next NCCL call into a group that never launches */
  int end = c->lib->group_end();
  if (rc == ZP_NCCL_SUCCESS && end != ZP_NCCL_SUCCESS)
    *failed_call = "ncclGroupEnd";
  return rc != ZP_NCCL_SUCCESS ? rc : end;
}

zp_status zp_comm_collective(zp_comm *c, zp_coll coll, const void *send, void *recv,
                             size_t count, int dtype, int op, int root, cudaStream_t comm_stream,
                             cudaStream_t after, zp_work **out) {
  ZP_TRY(zp_check_args(c, coll, send, recv, count, dtype, op, root));
  ZP_TRY(zp_comm_status(c));
  zp_work *w = calloc(1, sizeof *w);
  if (w == NULL)
    return zp_fail(ZP_ERR_NOMEM, "nccl: out of memory");
  int prev = 0;
  zp_status st = zp_enter_device(c->device, &prev);
  if (st != ZP_OK) {
    free(w);
    return st;
  }
  cudaError_t e = cudaEventCreateWithFlags(&w->done, cudaEventDisableTiming);
  if (e != cudaSuccess) {
    zp_leave_device(c->device, prev);
    free(w);
    return zp_cuda_error("nccl: cudaEventCreate", e);
  }
  w->comm = c, w->coll = coll, w->refs = 2; /* the caller's and the pending list's */

  pthread_mutex_lock(&c->enqueue);
  e = cudaSuccess;
  if (after != comm_stream) {
    e = cudaEventRecord(c->ready, after);
    if (e == cudaSuccess)
      e = cudaStreamWaitEvent(comm_stream, c->ready, 0);
  }
  int rc = ZP_NCCL_SUCCESS;
  const char *failed_call = NULL; /* within an all-to-all's group: which NCCL call failed */
  if (e == cudaSuccess) {
    pthread_mutex_lock(&c->state);
    int failed = c->failed;
    c->enqueue_since_s = zp_now_s();
    c->enqueue_coll = coll;
    pthread_mutex_unlock(&c->state);
    if (failed) {
      rc = -1;
    } else {
      switch (coll) {
      case ZP_COLL_ALL_REDUCE:
        rc = c->lib->all_reduce(send, recv, count, dtype, op, c->handle, comm_stream);
        break;
      case ZP_COLL_REDUCE_SCATTER:
        rc = c->lib->reduce_scatter(send, recv, count, dtype, op, c->handle, comm_stream);
        break;
      case ZP_COLL_ALL_GATHER:
        rc = c->lib->all_gather(send, recv, count, dtype, c->handle, comm_stream);
        break;
      case ZP_COLL_ALL_TO_ALL:
        rc = zp_enqueue_all_to_all(c, send, recv, count, dtype, comm_stream, &failed_call);
        break;
      default:
        rc = c->lib->broadcast(send, recv, count, dtype, root, c->handle, comm_stream);
        break;
      }
    }
    if (rc == ZP_NCCL_SUCCESS)
      e = cudaEventRecord(w->done, comm_stream);
  }
  pthread_mutex_lock(&c->state);
  c->enqueue_since_s = 0.0;
  if (e == cudaSuccess && rc == ZP_NCCL_SUCCESS) {
    w->seq = ++c->seq;
    w->issued_s = zp_now_s();
    if (c->n_pending == c->cap_pending) {
      int cap = c->cap_pending ? 2 * c->cap_pending : 16;
      zp_work **grown = realloc(c->pending, (size_t)cap * sizeof *grown);
      if (grown == NULL) {
        /* unwatched, the work still completes; it only escapes the timeout */
        w->refs = 1;
      } else {
        c->pending = grown, c->cap_pending = cap;
      }
    }
    if (w->refs == 2)
      c->pending[c->n_pending++] = w;
  }
  pthread_mutex_unlock(&c->state);
  pthread_mutex_unlock(&c->enqueue);
  zp_leave_device(c->device, prev);

  if (e != cudaSuccess || rc != ZP_NCCL_SUCCESS) {
    (void)cudaEventDestroy(w->done);
    free(w);
    if (e != cudaSuccess)
      return zp_cuda_error("nccl: ordering events", e);
    if (rc == -1)
      return zp_comm_status(c);
    char what[64];
    snprintf(what, sizeof what, "%s%s%s%s", zp_coll_names[coll], failed_call ? " (" : "",
             failed_call ? failed_call : "", failed_call ? ")" : "");
    return zp_nccl_fail(what, rc, c->handle);
  }
  *out = w;
  return ZP_OK;
}

zp_status zp_work_wait(zp_work *w, cudaStream_t stream) {
  ZP_TRY(zp_comm_status(w->comm));
  cudaError_t e = cudaStreamWaitEvent(stream, w->done, 0);
  return e == cudaSuccess ? ZP_OK : zp_cuda_error("nccl: cudaStreamWaitEvent", e);
}

zp_status zp_work_query(zp_work *w, int *done) {
  pthread_mutex_lock(&w->comm->state);
  int failed = w->comm->failed;
  pthread_mutex_unlock(&w->comm->state);
  if (failed) {
    *done = 1;
    return ZP_OK;
  }
  cudaError_t e = cudaEventQuery(w->done);
  if (e == cudaSuccess || e == cudaErrorNotReady) {
    *done = e == cudaSuccess;
    return ZP_OK;
  }
  *done = 1;
  return zp_cuda_error("nccl: cudaEventQuery", e);
}

zp_status zp_work_synchronize(zp_work *w) {
  struct timespec pause = {0, 50000}; /* 50 us: a collective takes at least that */
  for (;;) {
    ZP_TRY(zp_comm_status(w->comm));
    cudaError_t e = cudaEventQuery(w->done);
    if (e == cudaSuccess)
      return ZP_OK;
    if (e != cudaErrorNotReady)
      return zp_cuda_error("nccl: cudaEventQuery", e);
    nanosleep(&pause, NULL);
  }
}

void zp_work_release(zp_work *w) {
  if (w == NULL)
    return;
  zp_comm *c = w->comm;
  pthread_mutex_lock(&c->state);
  zp_work_unref_locked(w);
  pthread_mutex_unlock(&c->state);
}
