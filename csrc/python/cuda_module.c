/* cuda_module.c - zero_py._cuda: the thin, private CPython binding of the CUDA kernels
 * (kernels/cuda/optim_cuda.h) and the NCCL communicator (comm/communicator.h).
 *
 * A module of its own, linked with the CUDA runtime (static) and nothing else of CUDA, so that
 * zero_py._C never depends on CUDA and `import zero_py` works everywhere; this module imports on
 * any machine (the runtime only looks for a driver when first called) and reports a missing
 * driver or device as an exception from the call. Tensors, streams and workspaces arrive as
 * addresses that zero_py/cuda.py and zero_py/nccl.py took from objects they own and checked;
 * validation, keyword arguments and docstrings live there. Statuses become exceptions in one
 * place (zp_raise), and the optimizer tables are decoded as zero_py._C decodes them: both are
 * binding.h's. */
#include "python/binding.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "comm/communicator.h"
#include "comm/nccl_lib.h"
#include "kernels/cuda/optim_cuda.h"
#include "kernels/cuda/quantize_cuda.h"

/* ---- tables: zero_py._C's segment and group rows (binding.h), and copy rows ---- */

#define ZP_COPY_FIELDS 6

static Py_ssize_t zp_rows(const Py_buffer *buf, int fields, const char *fn) {
  if (buf->len % (fields * 8) != 0 || buf->len / (fields * 8) > INT32_MAX) {
    PyErr_Format(PyExc_ValueError, "%s: rows must be 8-byte values, %d per row", fn, fields);
    return -1;
  }
  return buf->len / (fields * 8);
}

static zp_opt_segment *zp_opt_segments(const Py_buffer *buf, const char *fn, Py_ssize_t *n_out) {
  Py_ssize_t n = zp_rows(buf, ZP_OPT_SEG_FIELDS, fn);
  if (n < 0)
    return NULL;
  zp_opt_segment *segs = zp_py_opt_segment_rows(buf, n);
  if (segs != NULL)
    *n_out = n;
  return segs;
}

static zp_opt_group *zp_opt_groups(const Py_buffer *buf, Py_ssize_t *n_out) {
  Py_ssize_t n = zp_rows(buf, ZP_OPT_GROUP_FIELDS, "opt_step groups");
  if (n < 0)
    return NULL;
  zp_opt_group *groups = zp_py_opt_group_rows(buf, n);
  if (groups != NULL)
    *n_out = n;
  return groups;
}

/* Copy rows: src, dst (addresses; src 0 = zeros), numel, src_dtype, dst_dtype, scale (the
 * float32's bits in the low 32 bits). */
static zp_copy_segment *zp_copy_rows(const Py_buffer *buf, Py_ssize_t *n_out) {
  Py_ssize_t n = zp_rows(buf, ZP_COPY_FIELDS, "copy");
  if (n < 0)
    return NULL;
  zp_copy_segment *segs = zp_py_alloc_rows(n, sizeof *segs);
  if (segs == NULL)
    return NULL;
  for (Py_ssize_t s = 0; s < n; s++) {
    int64_t row[ZP_COPY_FIELDS];
    memcpy(row, (const char *)buf->buf + s * sizeof row, sizeof row);
    uint32_t bits = (uint32_t)row[5];
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    int32_t sd = row[3] < 0 || row[3] > 1000 ? -1 : (int32_t)row[3];
    int32_t dd = row[4] < 0 || row[4] > 1000 ? -1 : (int32_t)row[4];
    segs[s] = (zp_copy_segment){ZP_PTR(row[0]), ZP_PTR(row[1]), row[2], sd, dd, scale};
  }
  *n_out = n;
  return segs;
}

/* ---- kernels ---- */

/* opt_step(segments, groups, scale_dev, workspace, workspace_bytes, stream) */
static PyObject *zp_py_opt_step(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer sb, gb;
  unsigned long long scale, ws, ws_bytes, stream;
  if (!PyArg_ParseTuple(args, "y*y*KKKK:opt_step", &sb, &gb, &scale, &ws, &ws_bytes, &stream))
    return NULL;
  PyObject *result = NULL;
  Py_ssize_t n_segs = 0, n_groups = 0;
  zp_opt_segment *segs = zp_opt_segments(&sb, "opt_step", &n_segs);
  zp_opt_group *groups = segs ? zp_opt_groups(&gb, &n_groups) : NULL;
  if (groups != NULL) {
    zp_status st = zp_opt_step_cuda(segs, (int32_t)n_segs, groups, (int32_t)n_groups,
                                    ZP_PTR(scale), ZP_PTR(ws), (size_t)ws_bytes, ZP_PTR(stream));
    result = st == ZP_OK ? Py_NewRef(Py_None) : zp_raise(st);
  }
  free(segs);
  free(groups);
  PyBuffer_Release(&sb);
  PyBuffer_Release(&gb);
  return result;
}

/* opt_step_emulate(segments, groups, scale or None) on host memory */
static PyObject *zp_py_opt_step_emulate(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer sb, gb;
  PyObject *scale_o;
  if (!PyArg_ParseTuple(args, "y*y*O:opt_step_emulate", &sb, &gb, &scale_o))
    return NULL;
  PyObject *result = NULL;
  float scale = 1.0f;
  int has_scale = scale_o != Py_None;
  if (has_scale) {
    scale = (float)PyFloat_AsDouble(scale_o);
    if (scale == -1.0f && PyErr_Occurred()) {
      PyBuffer_Release(&sb);
      PyBuffer_Release(&gb);
      return NULL;
    }
  }
  Py_ssize_t n_segs = 0, n_groups = 0;
  zp_opt_segment *segs = zp_opt_segments(&sb, "opt_step_emulate", &n_segs);
  zp_opt_group *groups = segs ? zp_opt_groups(&gb, &n_groups) : NULL;
  if (groups != NULL) {
    zp_status st;
    Py_BEGIN_ALLOW_THREADS st = zp_opt_step_emulate(segs, (int32_t)n_segs, groups,
                                                    (int32_t)n_groups, has_scale ? &scale : NULL);
    Py_END_ALLOW_THREADS result = st == ZP_OK ? Py_NewRef(Py_None) : zp_raise(st);
  }
  free(segs);
  free(groups);
  PyBuffer_Release(&sb);
  PyBuffer_Release(&gb);
  return result;
}

static PyObject *zp_py_opt_workspace_bytes(PyObject *self, PyObject *args) {
  (void)self;
  int n;
  if (!PyArg_ParseTuple(args, "i:opt_workspace_bytes", &n))
    return NULL;
  return PyLong_FromSize_t(zp_opt_workspace_bytes_cuda(n));
}

/* grad_stats(segments, grad_dtype, norm_type, out, accumulate, workspace, workspace_bytes,
 * stream) */
static PyObject *zp_py_grad_stats(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer sb;
  int dtype, accumulate;
  double norm_type;
  unsigned long long out, ws, ws_bytes, stream;
  if (!PyArg_ParseTuple(args, "y*idKpKKK:grad_stats", &sb, &dtype, &norm_type, &out, &accumulate,
                        &ws, &ws_bytes, &stream))
    return NULL;
  PyObject *result = NULL;
  Py_ssize_t n = 0;
  zp_opt_segment *segs = zp_opt_segments(&sb, "grad_stats", &n);
  if (segs != NULL) {
    zp_status st = zp_grad_stats_cuda(segs, (int32_t)n, dtype, norm_type, ZP_PTR(out),
                                      accumulate, ZP_PTR(ws), (size_t)ws_bytes, ZP_PTR(stream));
    result = st == ZP_OK ? Py_NewRef(Py_None) : zp_raise(st);
  }
  free(segs);
  PyBuffer_Release(&sb);
  return result;
}

/* grad_stats_emulate(segments, grad_dtype, norm_type, before) -> (sum_pow, flag): before is
 * None, or the (sum_pow, flag) to accumulate into */
static PyObject *zp_py_grad_stats_emulate(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer sb;
  int dtype;
  double norm_type;
  PyObject *before;
  if (!PyArg_ParseTuple(args, "y*idO:grad_stats_emulate", &sb, &dtype, &norm_type, &before))
    return NULL;
  double out[2] = {0.0, 0.0};
  int accumulate = before != Py_None;
  if (accumulate && !PyArg_ParseTuple(before, "dd:grad_stats_emulate before", &out[0], &out[1])) {
    PyBuffer_Release(&sb);
    return NULL;
  }
  PyObject *result = NULL;
  Py_ssize_t n = 0;
  zp_opt_segment *segs = zp_opt_segments(&sb, "grad_stats_emulate", &n);
  if (segs != NULL) {
    zp_status st;
    Py_BEGIN_ALLOW_THREADS st =
        zp_grad_stats_emulate(segs, (int32_t)n, dtype, norm_type, out, accumulate);
    Py_END_ALLOW_THREADS result = st == ZP_OK ? Py_BuildValue("(dd)", out[0], out[1])
                                              : zp_raise(st);
  }
  free(segs);
  PyBuffer_Release(&sb);
  return result;
}

static PyObject *zp_py_grad_stats_workspace_bytes(PyObject *self, PyObject *args) {
  (void)self;
  int n;
  long long numel;
  if (!PyArg_ParseTuple(args, "iL:grad_stats_workspace_bytes", &n, &numel))
    return NULL;
  return PyLong_FromSize_t(zp_grad_stats_workspace_bytes_cuda(n, numel));
}

/* copy(rows, workspace, workspace_bytes, stream) */
static PyObject *zp_py_copy(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer rb;
  unsigned long long ws, ws_bytes, stream;
  if (!PyArg_ParseTuple(args, "y*KKK:copy", &rb, &ws, &ws_bytes, &stream))
    return NULL;
  PyObject *result = NULL;
  Py_ssize_t n = 0;
  zp_copy_segment *segs = zp_copy_rows(&rb, &n);
  if (segs != NULL) {
    zp_status st = zp_copy_cuda(segs, (int32_t)n, ZP_PTR(ws), (size_t)ws_bytes, ZP_PTR(stream));
    result = st == ZP_OK ? Py_NewRef(Py_None) : zp_raise(st);
  }
  free(segs);
  PyBuffer_Release(&rb);
  return result;
}

static PyObject *zp_py_copy_emulate(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer rb;
  if (!PyArg_ParseTuple(args, "y*:copy_emulate", &rb))
    return NULL;
  PyObject *result = NULL;
  Py_ssize_t n = 0;
  zp_copy_segment *segs = zp_copy_rows(&rb, &n);
  if (segs != NULL) {
    zp_status st;
    Py_BEGIN_ALLOW_THREADS st = zp_copy_emulate(segs, (int32_t)n);
    Py_END_ALLOW_THREADS result = st == ZP_OK ? Py_NewRef(Py_None) : zp_raise(st);
  }
  free(segs);
  PyBuffer_Release(&rb);
  return result;
}

static PyObject *zp_py_copy_workspace_bytes(PyObject *self, PyObject *args) {
  (void)self;
  int n;
  if (!PyArg_ParseTuple(args, "i:copy_workspace_bytes", &n))
    return NULL;
  return PyLong_FromSize_t(zp_copy_workspace_bytes_cuda(n));
}

/* quantize(x, x_dtype, n, block, bits, q, scales, stochastic, seed, stream, cuda_stream);
 * emulate=True (the _emulate variant, no cuda_stream): the kernels' code on host memory */
static PyObject *zp_py_quantize_any(PyObject *args, int emulate) {
  unsigned long long x, q, scales, seed, noise_stream, stream = 0;
  int dtype, bits, stochastic;
  long long n, block;
  if (!PyArg_ParseTuple(args, emulate ? "KiLLiKKpKK:quantize_emulate" : "KiLLiKKpKKK:quantize",
                        &x, &dtype, &n, &block, &bits, &q, &scales, &stochastic, &seed,
                        &noise_stream, &stream))
    return NULL;
  const uint64_t noise[2] = {seed, noise_stream};
  const uint64_t *noise_or_null = stochastic ? noise : NULL;
  zp_status st;
  if (emulate) {
    Py_BEGIN_ALLOW_THREADS st = zp_quantize_emulate(ZP_PTR(x), dtype, n, block, bits, ZP_PTR(q),
                                                    ZP_PTR(scales), noise_or_null);
    Py_END_ALLOW_THREADS
  } else {
    st = zp_quantize_cuda(ZP_PTR(x), dtype, n, block, bits, ZP_PTR(q), ZP_PTR(scales),
                          noise_or_null, ZP_PTR(stream));
  }
  return st == ZP_OK ? Py_NewRef(Py_None) : zp_raise(st);
}

static PyObject *zp_py_quantize(PyObject *self, PyObject *args) {
  (void)self;
  return zp_py_quantize_any(args, 0);
}

static PyObject *zp_py_quantize_emulate(PyObject *self, PyObject *args) {
  (void)self;
  return zp_py_quantize_any(args, 1);
}

/* dequantize(q, scales, n, block, bits, out, out_dtype, accumulate, stream) */
static PyObject *zp_py_dequantize_any(PyObject *args, int emulate) {
  unsigned long long q, scales, out, stream = 0;
  int dtype, bits, accumulate;
  long long n, block;
  if (!PyArg_ParseTuple(args, emulate ? "KKLLiKip:dequantize_emulate" : "KKLLiKipK:dequantize",
                        &q, &scales, &n, &block, &bits, &out, &dtype, &accumulate, &stream))
    return NULL;
  zp_status st;
  if (emulate) {
    Py_BEGIN_ALLOW_THREADS st = zp_dequantize_emulate(ZP_PTR(q), ZP_PTR(scales), n, block, bits,
                                                      ZP_PTR(out), dtype, accumulate);
    Py_END_ALLOW_THREADS
  } else {
    st = zp_dequantize_cuda(ZP_PTR(q), ZP_PTR(scales), n, block, bits, ZP_PTR(out), dtype,
                            accumulate, ZP_PTR(stream));
  }
  return st == ZP_OK ? Py_NewRef(Py_None) : zp_raise(st);
}

static PyObject *zp_py_dequantize(PyObject *self, PyObject *args) {
  (void)self;
  return zp_py_dequantize_any(args, 0);
}

static PyObject *zp_py_dequantize_emulate(PyObject *self, PyObject *args) {
  (void)self;
  return zp_py_dequantize_any(args, 1);
}

static PyObject *zp_py_device_count(PyObject *self, PyObject *args) {
  (void)self;
  (void)args;
  int32_t n = 0;
  zp_status st = zp_cuda_device_count(&n);
  return st == ZP_OK ? PyLong_FromLong(n) : zp_raise(st);
}

/* ---- NCCL ---- */

static PyObject *zp_py_nccl_load(PyObject *self, PyObject *args) {
  (void)self;
  const char *path = NULL;
  if (!PyArg_ParseTuple(args, "|z:nccl_load", &path))
    return NULL;
  const zp_nccl_lib *lib = NULL;
  zp_status st;
  Py_BEGIN_ALLOW_THREADS st = zp_nccl_load(path, &lib);
  Py_END_ALLOW_THREADS if (st != ZP_OK) return zp_raise(st);
  return PyLong_FromLong(lib->version);
}

static PyObject *zp_py_nccl_unique_id(PyObject *self, PyObject *args) {
  (void)self;
  (void)args;
  const zp_nccl_lib *lib = zp_nccl_loaded();
  if (lib == NULL)
    return PyErr_Format(PyExc_RuntimeError, "nccl_unique_id: NCCL is not loaded (nccl_load)");
  zp_nccl_id id;
  int rc = lib->get_unique_id(&id);
  if (rc != ZP_NCCL_SUCCESS)
    return zp_raise(zp_nccl_fail("ncclGetUniqueId", rc, NULL));
  return PyBytes_FromStringAndSize(id.bytes, sizeof id.bytes);
}

static PyObject *zp_py_nccl_has_p2p(PyObject *self, PyObject *args) {
  (void)self;
  (void)args;
  const zp_nccl_lib *lib = zp_nccl_loaded();
  if (lib == NULL)
    return PyErr_Format(PyExc_RuntimeError, "nccl_has_p2p: NCCL is not loaded (nccl_load)");
  return PyBool_FromLong(zp_nccl_has_p2p(lib));
}

typedef struct {
  PyObject_HEAD zp_comm *comm;
} zp_py_comm;

typedef struct {
  PyObject_HEAD zp_work *work;
  PyObject *comm; /* the zp_py_comm: a work must not outlive its communicator */
} zp_py_work;

typedef struct {
  PyTypeObject *work_type;
} zp_module_state;

static PyObject *zp_comm_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"unique_id", "nranks", "rank", "device", "timeout_s", NULL};
  Py_buffer id;
  int nranks, rank, device;
  double timeout_s;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*iiid:NcclComm", kwlist, &id, &nranks, &rank,
                                   &device, &timeout_s))
    return NULL;
  if (id.len != ZP_NCCL_ID_BYTES) {
    PyBuffer_Release(&id);
    return PyErr_Format(PyExc_ValueError, "NcclComm: unique_id has %zd bytes, expected %d",
                        id.len, ZP_NCCL_ID_BYTES);
  }
  zp_nccl_id nid;
  memcpy(nid.bytes, id.buf, sizeof nid.bytes);
  PyBuffer_Release(&id);
  zp_comm *comm = NULL;
  zp_status st;
  Py_BEGIN_ALLOW_THREADS st = zp_comm_create(&nid, nranks, rank, device, timeout_s, &comm);
  Py_END_ALLOW_THREADS if (st != ZP_OK) return zp_raise(st);
  zp_py_comm *obj = (zp_py_comm *)type->tp_alloc(type, 0);
  if (obj == NULL) {
    zp_comm_destroy(comm);
    return NULL;
  }
  obj->comm = comm;
  return (PyObject *)obj;
}

static void zp_comm_dealloc(zp_py_comm *self) {
  PyTypeObject *type = Py_TYPE(self);
  zp_comm *comm = self->comm;
  self->comm = NULL;
  if (comm != NULL) {
    Py_BEGIN_ALLOW_THREADS zp_comm_destroy(comm);
    Py_END_ALLOW_THREADS
  }
  type->tp_free((PyObject *)self);
  Py_DECREF(type);
}

/* collective(coll, send, recv, count, dtype, op, root, comm_stream, after_stream) -> NcclWork */
static PyObject *zp_comm_collective_py(zp_py_comm *self, PyObject *args) {
  int coll, dtype, op, root;
  unsigned long long send, recv, count, comm_stream, after;
  if (!PyArg_ParseTuple(args, "iKKKiiiKK:collective", &coll, &send, &recv, &count, &dtype, &op,
                        &root, &comm_stream, &after))
    return NULL;
  zp_module_state *state = PyType_GetModuleState(Py_TYPE(self));
  if (state == NULL)
    return NULL;
  zp_work *work = NULL;
  zp_status st;
  Py_BEGIN_ALLOW_THREADS st =
      zp_comm_collective(self->comm, (zp_coll)coll, ZP_PTR(send), ZP_PTR(recv), (size_t)count,
                         dtype, op, root, ZP_PTR(comm_stream), ZP_PTR(after), &work);
  Py_END_ALLOW_THREADS if (st != ZP_OK) return zp_raise(st);
  zp_py_work *w = (zp_py_work *)state->work_type->tp_alloc(state->work_type, 0);
  if (w == NULL) {
    zp_work_release(work);
    return NULL;
  }
  w->work = work;
  w->comm = Py_NewRef((PyObject *)self);
  return (PyObject *)w;
}

static PyObject *zp_comm_check_py(zp_py_comm *self, PyObject *args) {
  (void)args;
  zp_status st = zp_comm_status(self->comm);
  return st == ZP_OK ? Py_NewRef(Py_None) : zp_raise(st);
}

static PyObject *zp_comm_abort_py(zp_py_comm *self, PyObject *args) {
  const char *reason = "aborted by the caller";
  if (!PyArg_ParseTuple(args, "|s:abort", &reason))
    return NULL;
  Py_BEGIN_ALLOW_THREADS zp_comm_abort(self->comm, reason);
  Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyMethodDef zp_comm_methods[] = {
    {"collective", (PyCFunction)zp_comm_collective_py, METH_VARARGS,
     "collective(coll, send, recv, count, dtype, op, root, comm_stream, after_stream) -> "
     "NcclWork"},
    {"check", (PyCFunction)zp_comm_check_py, METH_NOARGS,
     "raises RuntimeError with the reason once the communicator has failed"},
    {"abort", (PyCFunction)zp_comm_abort_py, METH_VARARGS,
     "abort([reason]): ncclCommAbort on this communicator; the process goes on, and waits on "
     "it raise with the reason"},
    {NULL, NULL, 0, NULL}};

static PyType_Slot zp_comm_slots[] = {
    {Py_tp_new, zp_comm_new},
    {Py_tp_dealloc, zp_comm_dealloc},
    {Py_tp_methods, zp_comm_methods},
    {Py_tp_doc, "NcclComm(unique_id, nranks, rank, device, timeout_s): one NCCL communicator "
                "with a watchdog"},
    {0, NULL}};

static PyType_Spec zp_comm_spec = {"zero_py._cuda.NcclComm", sizeof(zp_py_comm), 0,
                                   Py_TPFLAGS_DEFAULT, zp_comm_slots};

static void zp_work_dealloc(zp_py_work *self) {
  PyTypeObject *type = Py_TYPE(self);
  if (self->work != NULL)
    zp_work_release(self->work);
  Py_XDECREF(self->comm);
  type->tp_free((PyObject *)self);
  Py_DECREF(type);
}

static PyObject *zp_work_wait_py(zp_py_work *self, PyObject *args) {
  unsigned long long stream;
  if (!PyArg_ParseTuple(args, "K:wait", &stream))
    return NULL;
  zp_status st = zp_work_wait(self->work, ZP_PTR(stream));
  return st == ZP_OK ? Py_NewRef(Py_None) : zp_raise(st);
}

static PyObject *zp_work_is_completed_py(zp_py_work *self, PyObject *args) {
  (void)args;
  int done = 0;
  zp_status st = zp_work_query(self->work, &done);
  return st == ZP_OK ? PyBool_FromLong(done) : zp_raise(st);
}

static PyObject *zp_work_synchronize_py(zp_py_work *self, PyObject *args) {
  (void)args;
  zp_status st;
  Py_BEGIN_ALLOW_THREADS st = zp_work_synchronize(self->work);
  Py_END_ALLOW_THREADS return st == ZP_OK ? Py_NewRef(Py_None) : zp_raise(st);
}

static PyMethodDef zp_work_methods[] = {
    {"wait", (PyCFunction)zp_work_wait_py, METH_VARARGS,
     "wait(stream): the stream waits for the collective (the host does not)"},
    {"is_completed", (PyCFunction)zp_work_is_completed_py, METH_NOARGS,
     "whether the collective has finished (True too once the communicator failed)"},
    {"synchronize", (PyCFunction)zp_work_synchronize_py, METH_NOARGS,
     "blocks until the collective finished; raises if the communicator fails meanwhile"},
    {NULL, NULL, 0, NULL}};

static PyType_Slot zp_work_slots[] = {{Py_tp_dealloc, zp_work_dealloc},
                                      {Py_tp_methods, zp_work_methods},
                                      {Py_tp_doc, "one collective issued on an NcclComm"},
                                      {0, NULL}};

static PyType_Spec zp_work_spec = {"zero_py._cuda.NcclWork", sizeof(zp_py_work), 0,
                                   Py_TPFLAGS_DEFAULT, zp_work_slots};

/* ---- module ---- */

static PyMethodDef zp_methods[] = {
    {"device_count", zp_py_device_count, METH_NOARGS,
     "CUDA devices visible to this process; RuntimeError with CUDA's reason when none can be"},
    {"opt_step", zp_py_opt_step, METH_VARARGS,
     "opt_step(segments, groups, scale_dev, workspace, workspace_bytes, stream)"},
    {"opt_step_emulate", zp_py_opt_step_emulate, METH_VARARGS,
     "opt_step_emulate(segments, groups, scale): the kernel's code on host memory"},
    {"opt_workspace_bytes", zp_py_opt_workspace_bytes, METH_VARARGS,
     "opt_workspace_bytes(n_segments)"},
    {"grad_stats", zp_py_grad_stats, METH_VARARGS,
     "grad_stats(segments, grad_dtype, norm_type, out, accumulate, workspace, workspace_bytes, "
     "stream)"},
    {"grad_stats_emulate", zp_py_grad_stats_emulate, METH_VARARGS,
     "grad_stats_emulate(segments, grad_dtype, norm_type, before) -> (sum_pow, flag)"},
    {"grad_stats_workspace_bytes", zp_py_grad_stats_workspace_bytes, METH_VARARGS,
     "grad_stats_workspace_bytes(n_segments, total_numel)"},
    {"copy", zp_py_copy, METH_VARARGS, "copy(rows, workspace, workspace_bytes, stream)"},
    {"copy_emulate", zp_py_copy_emulate, METH_VARARGS, "copy_emulate(rows) on host memory"},
    {"copy_workspace_bytes", zp_py_copy_workspace_bytes, METH_VARARGS,
     "copy_workspace_bytes(n_segments)"},
    {"quantize", zp_py_quantize, METH_VARARGS,
     "quantize(x, x_dtype, n, block, bits, q, scales, stochastic, seed, noise_stream, stream)"},
    {"quantize_emulate", zp_py_quantize_emulate, METH_VARARGS,
     "quantize_emulate(x, x_dtype, n, block, bits, q, scales, stochastic, seed, noise_stream) "
     "on host memory"},
    {"dequantize", zp_py_dequantize, METH_VARARGS,
     "dequantize(q, scales, n, block, bits, out, out_dtype, accumulate, stream)"},
    {"dequantize_emulate", zp_py_dequantize_emulate, METH_VARARGS,
     "dequantize_emulate(q, scales, n, block, bits, out, out_dtype, accumulate) on host memory"},
    {"nccl_load", zp_py_nccl_load, METH_VARARGS, "nccl_load([path]) -> NCCL's version code"},
    {"nccl_unique_id", zp_py_nccl_unique_id, METH_NOARGS, "a new ncclUniqueId, as 128 bytes"},
    {"nccl_has_p2p", zp_py_nccl_has_p2p, METH_NOARGS,
     "whether the loaded NCCL has ncclSend/ncclRecv/ncclGroupStart/ncclGroupEnd (2.7+): the "
     "all-to-all (collective 4)"},
    {NULL, NULL, 0, NULL}};

static int zp_exec(PyObject *module) {
  zp_module_state *state = PyModule_GetState(module);
  PyObject *comm_type = PyType_FromModuleAndSpec(module, &zp_comm_spec, NULL);
  if (comm_type == NULL)
    return -1;
  int rc = PyModule_AddObjectRef(module, "NcclComm", comm_type);
  Py_DECREF(comm_type);
  if (rc < 0)
    return -1;
  PyObject *work_type = PyType_FromModuleAndSpec(module, &zp_work_spec, NULL);
  if (work_type == NULL)
    return -1;
  state->work_type = (PyTypeObject *)work_type; /* the module's reference */
  if (PyModule_AddObjectRef(module, "NcclWork", work_type) < 0)
    return -1;
  if (PyModule_AddIntConstant(module, "STATS_TILE", ZP_STATS_TILE_CUDA) < 0)
    return -1;
  return 0;
}

static int zp_traverse(PyObject *module, visitproc visit, void *arg) {
  zp_module_state *state = PyModule_GetState(module);
  Py_VISIT(state->work_type);
  return 0;
}

static int zp_clear(PyObject *module) {
  zp_module_state *state = PyModule_GetState(module);
  Py_CLEAR(state->work_type);
  return 0;
}

static void zp_free(void *module) { zp_clear((PyObject *)module); }

static PyModuleDef_Slot zp_slots[] = {{Py_mod_exec, zp_exec}, {0, NULL}};

static struct PyModuleDef zp_module = {PyModuleDef_HEAD_INIT,
                                       "zero_py._cuda",
                                       "CUDA kernels and NCCL executor of zero_py (private)",
                                       sizeof(zp_module_state),
                                       zp_methods,
                                       zp_slots,
                                       zp_traverse,
                                       zp_clear,
                                       zp_free};

PyMODINIT_FUNC PyInit__cuda(void) { return PyModuleDef_Init(&zp_module); }
