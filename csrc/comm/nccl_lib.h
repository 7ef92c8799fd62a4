/* nccl_lib.h - NCCL, loaded at run time: the part of its C API the executor calls, as a table
 * of function pointers filled by dlopen/dlsym, so that nothing links against libnccl.
 *
 * dlopen("libnccl.so.2") finds the NCCL that PyTorch already loaded (the dynamic loader
 * matches the soname of loaded objects first), so the process runs one NCCL. The declarations
 * below are the library's stable ABI as its documentation gives it (the soname's major version
 * freezes it): a result is an int (0 success, 7 in progress), a communicator an opaque pointer,
 * a unique id 128 bytes passed by value, data types and reduction ops small ints. They are our
 * own names for NCCL's values, not a copy of nccl.h, so the core builds where no nccl.h exists
 * (CI: the header ships only in a 300 MB wheel). Where the build finds a real nccl.h it defines
 * ZP_HAVE_NCCL_H and nccl_lib.c checks every value and size below against it at compile time.
 *
 * Invariant: every entry of zp_nccl_lib is non-NULL once zp_nccl_load() succeeded, except
 * get_last_error (NCCL >= 2.13) and the point-to-point four (send, recv, group_start,
 * group_end: NCCL >= 2.7), which are all set or all NULL (zp_nccl_has_p2p). */
#ifndef ZP_NCCL_LIB_H
#define ZP_NCCL_LIB_H

#include <cuda_runtime_api.h>
#include <stddef.h>

#include "common/status.h"

#define ZP_NCCL_ID_BYTES 128

typedef struct zp_nccl_comm_opaque *zp_nccl_handle; /* ncclComm_t */

typedef struct {
  char bytes[ZP_NCCL_ID_BYTES];
} zp_nccl_id; /* ncclUniqueId */

enum { ZP_NCCL_SUCCESS = 0, ZP_NCCL_IN_PROGRESS = 7 }; /* ncclResult_t */

enum { /* ncclDataType_t */
       ZP_NCCL_INT8 = 0,
       ZP_NCCL_UINT8 = 1,
       ZP_NCCL_INT32 = 2,
       ZP_NCCL_UINT32 = 3,
       ZP_NCCL_INT64 = 4,
       ZP_NCCL_UINT64 = 5,
       ZP_NCCL_FLOAT16 = 6,
       ZP_NCCL_FLOAT32 = 7,
       ZP_NCCL_FLOAT64 = 8,
       ZP_NCCL_BFLOAT16 = 9,
       ZP_NCCL_N_DTYPES = 10 /* the ones this executor passes */
};

enum { ZP_NCCL_SUM = 0, ZP_NCCL_PROD = 1, ZP_NCCL_MAX = 2, ZP_NCCL_MIN = 3,
       ZP_NCCL_N_OPS = 4 }; /* ncclRedOp_t */

typedef struct {
  int (*get_version)(int *version);
  int (*get_unique_id)(zp_nccl_id *id);
  int (*comm_init_rank)(zp_nccl_handle *comm, int nranks, zp_nccl_id id, int rank);
  int (*comm_destroy)(zp_nccl_handle comm);
  int (*comm_abort)(zp_nccl_handle comm);
  int (*comm_get_async_error)(zp_nccl_handle comm, int *async_error);
  const char *(*get_error_string)(int result);
  const char *(*get_last_error)(zp_nccl_handle comm); /* NULL before NCCL 2.13 */
  int (*all_reduce)(const void *send, void *recv, size_t count, int dtype, int op,
                    zp_nccl_handle comm, cudaStream_t stream);
  int (*reduce_scatter)(const void *send, void *recv, size_t recv_count, int dtype, int op,
                        zp_nccl_handle comm, cudaStream_t stream);
  int (*all_gather)(const void *send, void *recv, size_t send_count, int dtype,
                    zp_nccl_handle comm, cudaStream_t stream);
  int (*broadcast)(const void *send, void *recv, size_t count, int dtype, int root,
                   zp_nccl_handle comm, cudaStream_t stream);
  /* point-to-point, for the all-to-all; NULL before NCCL 2.7 */
  int (*send)(const void *send, size_t count, int dtype, int peer, zp_nccl_handle comm,
              cudaStream_t stream);
  int (*recv)(void *recv, size_t count, int dtype, int peer, zp_nccl_handle comm,
              cudaStream_t stream);
  int (*group_start)(void);
  int (*group_end)(void);
  int version; /* NCCL's version code, e.g. 22703 for 2.27.3 */
} zp_nccl_lib;

/* Loads NCCL once per process: `path` (NULL: "libnccl.so.2", found as the dynamic loader finds
 * it, the copy PyTorch loaded first) and resolves every entry. Later calls return the loaded
 * table whatever their path. ZP_ERR_SYSTEM with dlerror()'s text when the library or a symbol
 * is missing. */
zp_status zp_nccl_load(const char *path, const zp_nccl_lib **lib);

/* The loaded table, or NULL before a successful zp_nccl_load. */
const zp_nccl_lib *zp_nccl_loaded(void);

/* NCCL's text for a result code (and, when a communicator is given and the library has it,
 * ncclGetLastError's detail) into a zp_fail message: "<what>: NCCL error <n> (<text>): <detail>". */
zp_status zp_nccl_fail(const char *what, int result, zp_nccl_handle comm);

/* 1 when the loaded library has ncclSend, ncclRecv, ncclGroupStart and ncclGroupEnd (NCCL >= 2.7:
 * what the all-to-all is made of), else 0. A library without them still loads: only the
 * all-to-all is refused. */
int zp_nccl_has_p2p(const zp_nccl_lib *lib);

/* Element size of a ZP_NCCL_* data type, 0 for an unknown one. */
size_t zp_nccl_dtype_size(int dtype);

#endif /* ZP_NCCL_LIB_H */
