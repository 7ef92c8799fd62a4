/* fake_cudart.c - host stand-ins for the CUDA runtime calls csrc/comm/communicator.c makes, so
 * that the communicator runs on a machine without a GPU (tests/test_nccl_core.py). An event is
 * complete once recorded, unless fake_cuda_hold_events(1) keeps every event pending (a
 * collective that never finishes, for the watchdog). */
#include <cuda_runtime_api.h>
#include <stdatomic.h>
#include <stdlib.h>

struct CUevent_st {
  int recorded;
};

static atomic_int fake_hold;
static _Thread_local int fake_device;

void fake_cuda_hold_events(int hold) { atomic_store(&fake_hold, hold); }

cudaError_t cudaGetDevice(int *device) {
  *device = fake_device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  fake_device = device;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
  (void)flags;
  *event = calloc(1, sizeof **event);
  return *event != NULL ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  free(event);
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  (void)stream;
  event->recorded = 1;
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  (void)stream, (void)event, (void)flags;
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  return event->recorded && !atomic_load(&fake_hold) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaGetLastError(void) { return cudaSuccess; }

const char *cudaGetErrorName(cudaError_t error) { return error ? "cudaErrorFake" : "cudaSuccess"; }

const char *cudaGetErrorString(cudaError_t error) { return error ? "fake error" : "no error"; }
