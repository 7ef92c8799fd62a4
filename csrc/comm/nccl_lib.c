/* nccl_lib.c - dlopen of libnccl.so.2 and the error text of its results (nccl_lib.h). */
#include "comm/nccl_lib.h"

#include <dlfcn.h>
#include <pthread.h>
#include <string.h>

#ifdef ZP_HAVE_NCCL_H
/* A real nccl.h was found at build time: hold our declarations to it. */
#include <nccl.h>
_Static_assert(sizeof(zp_nccl_id) == sizeof(ncclUniqueId), "ncclUniqueId size");
_Static_assert(sizeof(ncclResult_t) == sizeof(int), "ncclResult_t is an int");
_Static_assert(sizeof(ncclDataType_t) == sizeof(int), "ncclDataType_t is an int");
_Static_assert(sizeof(ncclRedOp_t) == sizeof(int), "ncclRedOp_t is an int");
#define ZP_SAME(ours, theirs) ((int)(ours) == (int)(theirs))
_Static_assert(ZP_SAME(ZP_NCCL_SUCCESS, ncclSuccess) &&
                   ZP_SAME(ZP_NCCL_IN_PROGRESS, ncclInProgress),
               "result codes");
_Static_assert(ZP_SAME(ZP_NCCL_INT8, ncclInt8) && ZP_SAME(ZP_NCCL_UINT8, ncclUint8) &&
                   ZP_SAME(ZP_NCCL_INT32, ncclInt32) && ZP_SAME(ZP_NCCL_UINT32, ncclUint32) &&
                   ZP_SAME(ZP_NCCL_INT64, ncclInt64) && ZP_SAME(ZP_NCCL_UINT64, ncclUint64) &&
                   ZP_SAME(ZP_NCCL_FLOAT16, ncclFloat16) &&
                   ZP_SAME(ZP_NCCL_FLOAT32, ncclFloat32) &&
                   ZP_SAME(ZP_NCCL_FLOAT64, ncclFloat64) &&
                   ZP_SAME(ZP_NCCL_BFLOAT16, ncclBfloat16),
               "data types");
_Static_assert(ZP_SAME(ZP_NCCL_SUM, ncclSum) && ZP_SAME(ZP_NCCL_PROD, ncclProd) &&
                   ZP_SAME(ZP_NCCL_MAX, ncclMax) && ZP_SAME(ZP_NCCL_MIN, ncclMin),
               "reduction ops");
#endif

static zp_nccl_lib zp_lib;
static int zp_lib_ready;
static pthread_mutex_t zp_lib_mutex = PTHREAD_MUTEX_INITIALIZER;

/* dlsym into a typed slot (ISO C has no cast between object and function pointers). */
static int zp_sym(void *handle, const char *name, void *slot, size_t slot_size) {
  void *f = dlsym(handle, name);
  if (f == NULL)
    return 0;
  memcpy(slot, &f, slot_size);
  return 1;
}

#define ZP_SYM(field, name) zp_sym(handle, name, &lib.field, sizeof lib.field)

zp_status zp_nccl_load(const char *path, const zp_nccl_lib **out) {
  pthread_mutex_lock(&zp_lib_mutex);
  if (zp_lib_ready) {
    *out = &zp_lib;
    pthread_mutex_unlock(&zp_lib_mutex);
    return ZP_OK;
  }
  const char *name = path != NULL && path[0] != '\0' ? path : "libnccl.so.2";
  void *handle = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (handle == NULL) {
    const char *why = dlerror();
    pthread_mutex_unlock(&zp_lib_mutex);
    return zp_fail(ZP_ERR_SYSTEM, "cannot load NCCL from %s: %s", name, why ? why : "?");
  }
  zp_nccl_lib lib;
  memset(&lib, 0, sizeof lib);
  const char *missing = NULL;
  if (!ZP_SYM(get_version, "ncclGetVersion"))
    missing = "ncclGetVersion";
  else if (!ZP_SYM(get_unique_id, "ncclGetUniqueId"))
    missing = "ncclGetUniqueId";
  else if (!ZP_SYM(comm_init_rank, "ncclCommInitRank"))
    missing = "ncclCommInitRank";
  else if (!ZP_SYM(comm_destroy, "ncclCommDestroy"))
    missing = "ncclCommDestroy";
  else if (!ZP_SYM(comm_abort, "ncclCommAbort"))
    missing = "ncclCommAbort";
  else if (!ZP_SYM(comm_get_async_error, "ncclCommGetAsyncError"))
    missing = "ncclCommGetAsyncError";
  else if (!ZP_SYM(get_error_string, "ncclGetErrorString"))
    missing = "ncclGetErrorString";
  else if (!ZP_SYM(all_reduce, "ncclAllReduce"))
    missing = "ncclAllReduce";
  else if (!ZP_SYM(reduce_scatter, "ncclReduceScatter"))
    missing = "ncclReduceScatter";
  else if (!ZP_SYM(all_gather, "ncclAllGather"))
    missing = "ncclAllGather";
  else if (!ZP_SYM(broadcast, "ncclBroadcast"))
    missing = "ncclBroadcast";
  if (missing != NULL) {
    dlclose(handle);
    pthread_mutex_unlock(&zp_lib_mutex);
    return zp_fail(ZP_ERR_SYSTEM, "%s has no %s: NCCL 2.7 or newer is needed", name, missing);
  }
  (void)ZP_SYM(get_last_error, "ncclGetLastError"); /* optional */
  /* optional as a set: a library older than 2.7 runs every collective but the all-to-all */
  if (!(ZP_SYM(send, "ncclSend") && ZP_SYM(recv, "ncclRecv") &&
        ZP_SYM(group_start, "ncclGroupStart") && ZP_SYM(group_end, "ncclGroupEnd")))
    lib.send = NULL, lib.recv = NULL, lib.group_start = NULL, lib.group_end = NULL;
  int rc = lib.get_version(&lib.version);
  if (rc != ZP_NCCL_SUCCESS) {
    pthread_mutex_unlock(&zp_lib_mutex);
    return zp_fail(ZP_ERR_SYSTEM, "ncclGetVersion failed with %d", rc);
  }
  /* the handle stays open for the life of the process: communicators may outlive any caller */
  zp_lib = lib;
  zp_lib_ready = 1;
  *out = &zp_lib;
  pthread_mutex_unlock(&zp_lib_mutex);
  return ZP_OK;
}

const zp_nccl_lib *zp_nccl_loaded(void) {
  pthread_mutex_lock(&zp_lib_mutex);
  const zp_nccl_lib *lib = zp_lib_ready ? &zp_lib : NULL;
  pthread_mutex_unlock(&zp_lib_mutex);
  return lib;
}

zp_status zp_nccl_fail(const char *what, int result, zp_nccl_handle comm) {
  const zp_nccl_lib *lib = zp_nccl_loaded();
  const char *text = lib != NULL ? lib->get_error_string(result) : NULL;
  const char *detail = lib != NULL && lib->get_last_error != NULL && comm != NULL
                           ? lib->get_last_error(comm)
                           : NULL;
  return zp_fail(ZP_ERR_SYSTEM, "%s: NCCL error %d (%s)%s%s", what, result,
                 text != NULL ? text : "unknown", detail != NULL && detail[0] ? ": " : "",
                 detail != NULL ? detail : "");
}

int zp_nccl_has_p2p(const zp_nccl_lib *lib) {
  return lib != NULL && lib->send != NULL && lib->recv != NULL && lib->group_start != NULL &&
         lib->group_end != NULL;
}

size_t zp_nccl_dtype_size(int dtype) {
  switch (dtype) {
  case ZP_NCCL_INT8:
  case ZP_NCCL_UINT8:
    return 1;
  case ZP_NCCL_FLOAT16:
  case ZP_NCCL_BFLOAT16:
    return 2;
  case ZP_NCCL_INT32:
  case ZP_NCCL_UINT32:
  case ZP_NCCL_FLOAT32:
    return 4;
  case ZP_NCCL_INT64:
  case ZP_NCCL_UINT64:
  case ZP_NCCL_FLOAT64:
    return 8;
  default:
    return 0;
  }
}
