/* upload.cu - zp_cuda_upload: a kernel's host-built table into its device workspace without a
 * host wait.
 *
 * cudaMemcpyAsync from pageable memory synchronizes with the stream before it copies, so every
 * launch that uploaded its table that way made the host wait for all the work queued before it
 * (seen on an H100: backward returned within 1 ms of the GPU finishing it; the host never ran
 * ahead). Here the table is first copied into a pinned staging slot, from which the copy is
 * truly asynchronous. Each device has a ring of ZP_UP_SLOTS slots of ZP_UP_SLOT_BYTES, made at
 * its first upload, each with an event recorded after the copy that reads it; a slot is reused
 * only once its event has completed (the host waits only when the device is a whole ring of
 * uploads behind). Tables larger than a slot, and devices whose ring could not be made (pinned
 * memory refused), take the pageable copy: slower, never wrong. ZP_CUDA_PINNED_UPLOAD=0 (read
 * at a device's first upload) keeps every device on the pageable copy, the behaviour before
 * the ring. One lock serializes the rings' bookkeeping; the rings live until the process
 * ends. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/optim_cuda.h"

#define ZP_UP_SLOTS 64
#define ZP_UP_SLOT_BYTES ((size_t)64 * 1024)
#define ZP_UP_DEVICES 64

typedef struct {
  int state;           /* 0: not made yet; 1: ready; -1: unavailable (pageable copies) */
  unsigned char *host; /* ZP_UP_SLOTS * ZP_UP_SLOT_BYTES pinned bytes */
  cudaEvent_t done[ZP_UP_SLOTS];
  int pending[ZP_UP_SLOTS]; /* done[i] recorded after a copy from slot i */
  int next;
} zp_up_ring;

static zp_up_ring zp_up_rings[ZP_UP_DEVICES];
static pthread_mutex_t zp_up_lock = PTHREAD_MUTEX_INITIALIZER;

/* Makes the current device's ring, or marks it unavailable. Lock held. */
static void zp_up_make(zp_up_ring *r) {
  int made = 0;
  void *host = NULL;
  const char *env = getenv("ZP_CUDA_PINNED_UPLOAD");
  if (env != NULL && strcmp(env, "0") == 0) {
    r->state = -1;
    return;
  }
  if (cudaHostAlloc(&host, ZP_UP_SLOTS * ZP_UP_SLOT_BYTES, cudaHostAllocPortable) == cudaSuccess) {
    for (; made < ZP_UP_SLOTS; made++)
      if (cudaEventCreateWithFlags(&r->done[made], cudaEventDisableTiming) != cudaSuccess)
        break;
  }
  if (host == NULL || made < ZP_UP_SLOTS) {
    for (int i = 0; i < made; i++)
      (void)cudaEventDestroy(r->done[i]);
    if (host != NULL)
      (void)cudaFreeHost(host);
    (void)cudaGetLastError(); /* the pageable copy stands in: no error to report */
    r->state = -1;
    return;
  }
  r->host = (unsigned char *)host;
  memset(r->pending, 0, sizeof r->pending);
  r->next = 0;
  r->state = 1;
}

static zp_status zp_up_pageable(const char *what, const void *table, size_t bytes,
                                void *workspace, cudaStream_t stream) {
  cudaError_t e = cudaMemcpyAsync(workspace, table, bytes, cudaMemcpyHostToDevice, stream);
  return e == cudaSuccess ? ZP_OK : zp_cuda_fail(what, e);
}

extern "C" zp_status zp_cuda_upload(const char *what, const void *table, size_t bytes,
                                    void *workspace, size_t workspace_bytes,
                                    cudaStream_t stream) {
  if (workspace == NULL || workspace_bytes < bytes)
    return zp_fail(ZP_ERR_INVALID, "%s: the workspace has %zu bytes at %p, the table needs %zu",
                   what, workspace_bytes, workspace, bytes);
  if ((uintptr_t)workspace % 16 != 0)
    return zp_fail(ZP_ERR_INVALID, "%s: the workspace at %p is not 16-byte aligned", what,
                   workspace);
  int dev = -1;
  if (bytes > ZP_UP_SLOT_BYTES || cudaGetDevice(&dev) != cudaSuccess || dev < 0 ||
      dev >= ZP_UP_DEVICES) {
    (void)cudaGetLastError();
    return zp_up_pageable(what, table, bytes, workspace, stream);
  }
  pthread_mutex_lock(&zp_up_lock);
  zp_up_ring *r = &zp_up_rings[dev];
  if (r->state == 0)
    zp_up_make(r);
  if (r->state < 0) {
    pthread_mutex_unlock(&zp_up_lock);
    return zp_up_pageable(what, table, bytes, workspace, stream);
  }
  const int i = r->next;
  cudaError_t e = cudaSuccess;
  if (r->pending[i]) { /* the device is a whole ring behind: wait for the slot's last copy */
    e = cudaEventSynchronize(r->done[i]);
    if (e != cudaSuccess) {
      pthread_mutex_unlock(&zp_up_lock);
      return zp_cuda_fail(what, e);
    }
    r->pending[i] = 0;
  }
  unsigned char *slot = r->host + (size_t)i * ZP_UP_SLOT_BYTES;
  memcpy(slot, table, bytes);
  e = cudaMemcpyAsync(workspace, slot, bytes, cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess) {
    e = cudaEventRecord(r->done[i], stream);
    if (e != cudaSuccess) /* queued, but with no event to tell when it has read the slot */
      (void)cudaStreamSynchronize(stream);
    else
      r->pending[i] = 1;
  }
  r->next = (i + 1) % ZP_UP_SLOTS;
  pthread_mutex_unlock(&zp_up_lock);
  return e == cudaSuccess ? ZP_OK : zp_cuda_fail(what, e);
}
