/* binding.h - what the C files of the CPython bindings (csrc/python/) share: those of
 * zero_py._C (module.c, prefetch_py.c, ...) and zero_py._cuda (cuda_module.c, nccl_py.c), which
 * are separate extension modules, so the helpers both need are static inline here rather than
 * in one of them. */
#ifndef ZP_BINDING_H
#define ZP_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "kernels/contract.h"

/* The one place where core statuses become Python exceptions: sets the exception for a
 * failing `status`, with zp_last_error() as its message, and returns NULL. */
static inline PyObject *zp_raise(zp_status status) {
  PyObject *type;
  switch (status) {
  case ZP_ERR_NOMEM:
    type = PyExc_MemoryError;
    break;
  case ZP_ERR_INVALID:
    type = PyExc_ValueError;
    break;
  case ZP_ERR_RANGE:
    type = PyExc_IndexError;
    break;
  case ZP_ERR_STATE:
  case ZP_ERR_SYSTEM:
  default:
    type = PyExc_RuntimeError;
    break;
  }
  PyErr_SetString(type, zp_last_error());
  return NULL;
}

/* An address the Python side took from an object it owns (a tensor's data_ptr, a stream, a
 * workspace), passed as a 64-bit integer; 0 is NULL. */
#define ZP_PTR(v) ((void *)(uintptr_t)(v))

/* malloc for n rows (at least one) of `size` bytes each; NULL with MemoryError set. */
static inline void *zp_py_alloc_rows(Py_ssize_t n, size_t size) {
  void *rows = malloc((size_t)(n > 0 ? n : 1) * size);
  if (rows == NULL)
    PyErr_NoMemory();
  return rows;
}

/* A Python int argument -> int64, refused with OverflowError when it is outside [lo, hi], the
 * range of the C parameter it is passed as (INT32_MIN..INT32_MAX or INT64_MIN..INT64_MAX):
 * PyArg_ParseTuple's own overflow message names neither the call nor the argument. `allowed`
 * says what the core accepts (e.g. "a power of two in [1, 2**30]"), which is what the caller
 * must change the value to; values inside [lo, hi] go on to the core, which checks them.
 * Returns 0, or -1 with an exception set (TypeError for a non-int). */
static inline int zp_py_int_arg(PyObject *o, const char *fn, const char *name, int64_t lo,
                                int64_t hi, const char *allowed, int64_t *out) {
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (v == -1 && PyErr_Occurred())
    return -1;
  if (overflow != 0 || v < lo || v > hi) {
    PyErr_Format(PyExc_OverflowError, "%s: %s must be %s, got %S", fn, name, allowed, o);
    return -1;
  }
  *out = (int64_t)v;
  return 0;
}

/* ---- the optimizer family's tables, the same in both modules ----
 * segments: int64 rows of ZP_OPT_SEG_FIELDS (master, grad, state0, state1, state2, param_out
 * addresses [0 = NULL], numel, step, group, unused); groups: float64 rows of
 * ZP_OPT_GROUP_FIELDS (kind, grad_dtype, param_dtype, flags, lr, beta1, beta2, eps,
 * weight_decay, grad_scale, seed), the first four and seed integers stored as float64. Each
 * module checks the buffers' lengths with its own messages, then decodes them here; the core
 * validates the values (zp_opt_check). */
#define ZP_OPT_SEG_FIELDS 10
#define ZP_OPT_GROUP_FIELDS 11

/* The first n segment rows of `buf` -> a new zp_opt_segment array (caller frees); NULL with
 * MemoryError set. A group index outside int32 becomes -1 (the core rejects it). */
static inline zp_opt_segment *zp_py_opt_segment_rows(const Py_buffer *buf, Py_ssize_t n) {
  zp_opt_segment *segs = zp_py_alloc_rows(n, sizeof *segs);
  if (segs == NULL)
    return NULL;
  for (Py_ssize_t s = 0; s < n; s++) {
    int64_t row[ZP_OPT_SEG_FIELDS];
    memcpy(row, (const char *)buf->buf + s * sizeof row, sizeof row);
    int32_t group = row[8] < INT32_MIN || row[8] > INT32_MAX ? -1 : (int32_t)row[8];
    segs[s] = (zp_opt_segment){ZP_PTR(row[0]), ZP_PTR(row[1]), ZP_PTR(row[2]), ZP_PTR(row[3]),
                               ZP_PTR(row[4]), ZP_PTR(row[5]), row[6], row[7], group};
  }
  return segs;
}

/* A float64 that must hold a small integer (kind, dtype, flags) -> int32, or -1 when it does
 * not (the core then rejects it with a message naming the field). */
static inline int32_t zp_py_small_int(double v) {
  return v >= -1.0 && v <= 1048576.0 && v == (double)(int32_t)v ? (int32_t)v : -1;
}

/* The first n group rows of `buf` -> a new zp_opt_group array (caller frees); NULL with
 * ValueError (a seed that is not an integer in [0, 2**53]) or MemoryError set. */
static inline zp_opt_group *zp_py_opt_group_rows(const Py_buffer *buf, Py_ssize_t n) {
  zp_opt_group *groups = zp_py_alloc_rows(n, sizeof *groups);
  if (groups == NULL)
    return NULL;
  for (Py_ssize_t k = 0; k < n; k++) {
    double row[ZP_OPT_GROUP_FIELDS];
    memcpy(row, (const char *)buf->buf + k * sizeof row, sizeof row);
    if (!(row[10] >= 0.0 && row[10] <= 9007199254740992.0 &&
          row[10] == (double)(uint64_t)row[10])) {
      /* PyErr_Format has no %g: the value goes through Python's own float repr */
      char *got = PyOS_double_to_string(row[10], 'r', 0, 0, NULL);
      PyErr_Format(PyExc_ValueError, "opt_step: group %zd: seed must be an integer in "
                   "[0, 2**53], got %s", k, got != NULL ? got : "?");
      PyMem_Free(got);
      free(groups);
      return NULL;
    }
    groups[k] = (zp_opt_group){zp_py_small_int(row[0]), zp_py_small_int(row[1]),
                               zp_py_small_int(row[2]), zp_py_small_int(row[3]), row[4], row[5],
                               row[6], row[7], row[8], row[9], (uint64_t)row[10]};
  }
  return groups;
}

/* Adds zero_py._C.Prefetch and its PF_* constants to the module (prefetch_py.c). Returns 0, or
 * -1 with an exception set. */
int zp_prefetch_py_register(PyObject *module);

/* Adds zero_py._C.crc32c, crc32c_impl, io_open, IoEngine and IO_ALIGN (io_py.c). Returns 0,
 * or -1 with an exception set. */
int zp_io_py_register(PyObject *module);

/* Adds zero_py._C.quantize and dequantize (quantize_py.c). Returns 0, or -1 with an exception
 * set. */
int zp_quantize_py_register(PyObject *module);

/* zero_py._cuda's per-module state (cuda_module.c's module; nccl_py.c sets work_type, the
 * NcclWork type that NcclComm.collective allocates). */
typedef struct {
  PyTypeObject *work_type;
} zp_cuda_module_state;

/* Adds zero_py._cuda.nccl_load, nccl_unique_id, nccl_has_p2p, NcclComm and NcclWork
 * (nccl_py.c). Returns 0, or -1 with an exception set. */
int zp_nccl_py_register(PyObject *module);

#endif /* ZP_BINDING_H */
