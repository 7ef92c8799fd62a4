/* communicator.h - one NCCL communicator with its collectives, their completion events and a
 * watchdog thread: the native executor's core.
 *
 * Ordering (no host synchronisation): a collective records an event on the caller's stream
 * (`after`: the stream that produced its input), makes the communicator's stream wait for it,
 * enqueues the NCCL call there, and records its `done` event. zp_work_wait makes any stream wait
 * for `done`; only zp_work_synchronize blocks the host.
 *
 * Failure (a dead or diverged peer, a network error): the watchdog polls every work's event and
 * ncclCommGetAsyncError. When NCCL reports an error, or a collective is still running (or still
 * being enqueued) `timeout_s` after it was issued, it records the reason and calls
 * ncclCommAbort, which ends NCCL's kernels, so that streams waiting on them move on instead of
 * hanging. From then on every call on the communicator returns ZP_ERR_SYSTEM with that reason:
 * the failure reaches the caller at its next wait, is_completed or collective.
 *
 * Threads: collectives and waits may come from any thread (enqueues are serialised by a mutex);
 * the watchdog never waits for that mutex, so it can abort a call blocked inside NCCL.
 * ncclCommInitRank itself blocks until every rank has joined. */
#ifndef ZP_COMMUNICATOR_H
#define ZP_COMMUNICATOR_H

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#include "comm/nccl_lib.h"
#include "common/status.h"

typedef struct zp_comm zp_comm;
typedef struct zp_work zp_work;

typedef enum {
  ZP_COLL_ALL_REDUCE = 0,     /* count elements, in place when send == recv */
  ZP_COLL_REDUCE_SCATTER = 1, /* count = elements each rank receives; send has nranks * count */
  ZP_COLL_ALL_GATHER = 2,     /* count = elements each rank sends; recv has nranks * count */
  ZP_COLL_BROADCAST = 3,      /* count elements from rank `root` */
  ZP_COLL_ALL_TO_ALL = 4      /* count = elements sent to (and received from) each rank, self
                                 included: send and recv have nranks * count each and must not
                                 overlap. NCCL >= 2.7 (zp_nccl_has_p2p), else ZP_ERR_STATE */
} zp_coll;

/* Joins rank `rank` of `nranks` to the communicator named by `id` on CUDA device `device`
 * (NCCL must be loaded: zp_nccl_load). timeout_s > 0: how long a collective may run. */
zp_status zp_comm_create(const zp_nccl_id *id, int nranks, int rank, int device,
                         double timeout_s, zp_comm **out);

/* Stops the watchdog and frees the communicator: ncclCommDestroy when it is healthy and idle,
 * ncclCommAbort otherwise (a pending collective would make destroy wait for it). Works still
 * held by the caller stay valid for zp_work_release only. */
void zp_comm_destroy(zp_comm *comm);

/* Enqueues one collective (see zp_coll) on `comm_stream`, ordered after `after`'s work so far.
 * dtype: ZP_NCCL_*; op: ZP_NCCL_SUM/PROD/MAX/MIN (ignored by all-gather, broadcast and
 * all-to-all). The all-to-all is one ncclGroupStart/End of an ncclSend and an ncclRecv per
 * rank, so it is one operation to the events and the watchdog like the others. On success
 * *work holds a reference the caller releases with zp_work_release. */
zp_status zp_comm_collective(zp_comm *comm, zp_coll coll, const void *send, void *recv,
                             size_t count, int dtype, int op, int root, cudaStream_t comm_stream,
                             cudaStream_t after, zp_work **work);

/* ZP_OK while the communicator is healthy; else its failure (the watchdog's reason). */
zp_status zp_comm_status(zp_comm *comm);

/* Aborts now, with `reason` as the failure every later call reports. */
void zp_comm_abort(zp_comm *comm, const char *reason);

int zp_comm_rank(const zp_comm *comm);
int zp_comm_size(const zp_comm *comm);
int zp_comm_device(const zp_comm *comm);

/* Makes `stream` wait for the collective (device-side; returns at once). */
zp_status zp_work_wait(zp_work *work, cudaStream_t stream);

/* *done = 1 when the collective has finished, or when the communicator has failed (the next
 * wait reports it); 0 while it runs. */
zp_status zp_work_query(zp_work *work, int *done);

/* Blocks the host until the collective has finished, polling; fails as soon as the communicator
 * fails (so at most its timeout after a peer died). */
zp_status zp_work_synchronize(zp_work *work);

void zp_work_release(zp_work *work);

#endif /* ZP_COMMUNICATOR_H */
