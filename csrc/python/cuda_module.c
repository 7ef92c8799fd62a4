/* cuda_module.c - zero_py._cuda: the thin, private CPython binding of the CUDA kernels
 * (kernels/cuda/optim_cuda.h, quantize_cuda.h) and the module itself; its NCCL part
 * (nccl_load, NcclComm, NcclWork over comm/communicator.h) is nccl_py.c, added at exec.
 *
 * A module of its own, linked with the CUDA runtime (static) and nothing else of CUDA, so that
 * zero_py._C never depends on CUDA and `import zero_py` works everywhere; this module imports on
 * any machine (the runtime only looks for a driver when first called) and reports a missing
 * driver or device as an exception from the call. Tensors, streams and workspaces arrive as
 * addresses that zero_py/kernels/cuda.py and zero_py/collectives/nccl.py took from objects they
 * own and checked; validation, keyword arguments and docstrings live there. Statuses become
 * exceptions in one place (zp_raise), and the optimizer tables are decoded as zero_py._C decodes
 * them: both are binding.h's. */
#include "python/binding.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
    {NULL, NULL, 0, NULL}};

static int zp_exec(PyObject *module) {
  if (zp_nccl_py_register(module) < 0)
    return -1;
  if (PyModule_AddIntConstant(module, "STATS_TILE", ZP_STATS_TILE_CUDA) < 0)
    return -1;
  return 0;
}

static int zp_traverse(PyObject *module, visitproc visit, void *arg) {
  zp_cuda_module_state *state = PyModule_GetState(module);
  Py_VISIT(state->work_type);
  return 0;
}

static int zp_clear(PyObject *module) {
  zp_cuda_module_state *state = PyModule_GetState(module);
  Py_CLEAR(state->work_type);
  return 0;
}

static void zp_free(void *module) { zp_clear((PyObject *)module); }

static PyModuleDef_Slot zp_slots[] = {{Py_mod_exec, zp_exec}, {0, NULL}};

static struct PyModuleDef zp_module = {PyModuleDef_HEAD_INIT,
                                       "zero_py._cuda",
                                       "CUDA kernels and NCCL executor of zero_py (private)",
                                       sizeof(zp_cuda_module_state),
                                       zp_methods,
                                       zp_slots,
                                       zp_traverse,
                                       zp_clear,
                                       zp_free};

PyMODINIT_FUNC PyInit__cuda(void) { return PyModuleDef_Init(&zp_module); }
