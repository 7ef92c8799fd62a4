/* module.c - zero_py._C: the thin, private CPython binding of the C core.
 *
 * Parses arguments, calls one core function, and turns a failing zp_status into an exception
 * in one place (zp_raise). Keyword arguments, defaults, docstrings and validation of tensors
 * live in Python (zero_py/); tensors arrive here as addresses the Python side took from
 * tensors it owns and checked (contiguous, dtype, device). zp_raise and the table decoding are
 * binding.h's, shared with zero_py._cuda (cuda_module.c). */
#include "python/binding.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/parallel.h"
#include "common/shared_flags.h"
#include "kernels/cpu/convert.h"
#include "kernels/cpu/optim.h"
#include "kernels/cpu/memcopy.h"
#include "kernels/cpu/stream_bound.h"
#include "kernels/cpu/tuning.h"
#include "layout/layout.h"
#include "schedule/schedule.h"

/* Reads a sequence of Python ints into a new int64 array (caller frees): fn's argument `name`,
 * each entry in [lo, hi] (the C field's range; `allowed` is what the core accepts, for the
 * message of an entry outside it). NULL with an exception set. */
static int64_t *zp_int64_array(PyObject *seq, const char *fn, const char *name, int64_t lo,
                               int64_t hi, const char *allowed, Py_ssize_t *n_out) {
  char what[128];
  snprintf(what, sizeof what, "%s: %s must be a sequence of int", fn, name);
  PyObject *fast = PySequence_Fast(seq, what);
  if (fast == NULL)
    return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  int64_t *values = zp_py_alloc_rows(n, sizeof *values);
  if (values == NULL) {
    Py_DECREF(fast);
    return NULL;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    char entry[96];
    snprintf(entry, sizeof entry, "%s[%zd]", name, i);
    if (zp_py_int_arg(PySequence_Fast_GET_ITEM(fast, i), fn, entry, lo, hi, allowed,
                      &values[i]) < 0) {
      free(values);
      Py_DECREF(fast);
      return NULL;
    }
  }
  Py_DECREF(fast);
  *n_out = n;
  return values;
}

static PyObject *zp_list_i32(const int32_t *v, Py_ssize_t n) {
  PyObject *list = PyList_New(n);
  for (Py_ssize_t i = 0; list != NULL && i < n; i++)
    PyList_SET_ITEM(list, i, PyLong_FromLong(v[i]));
  return list;
}

static PyObject *zp_list_i64(const int64_t *v, Py_ssize_t n) {
  PyObject *list = PyList_New(n);
  for (Py_ssize_t i = 0; list != NULL && i < n; i++)
    PyList_SET_ITEM(list, i, PyLong_FromLongLong(v[i]));
  return list;
}

/* layout_plan(numels, groups, buffers, elem_sizes, world_size, align_bytes, bucket_bytes)
 * Integers arrive as objects: a value outside its C type is refused here by name
 * (zp_py_int_arg), every other check is the core's (layout.h). */
static PyObject *zp_py_layout_plan(PyObject *self, PyObject *args) {
  (void)self;
  static const char fn[] = "layout_plan";
  PyObject *numels_o, *groups_o, *buffers_o, *elems_o, *world_o, *align_o, *bucket_o;
  if (!PyArg_ParseTuple(args, "OOOOOOO:layout_plan", &numels_o, &groups_o, &buffers_o, &elems_o,
                        &world_o, &align_o, &bucket_o))
    return NULL;
  int64_t world_size, align_bytes, bucket_bytes;
  if (zp_py_int_arg(world_o, fn, "world_size", INT32_MIN, INT32_MAX, "in [1, 2**31-1]",
                    &world_size) < 0 ||
      zp_py_int_arg(align_o, fn, "align_bytes", INT64_MIN, INT64_MAX,
                    "a power of two in [1, 2**30]", &align_bytes) < 0 ||
      zp_py_int_arg(bucket_o, fn, "bucket_bytes", INT64_MIN, INT64_MAX, "in [1, 2**63-1]",
                    &bucket_bytes) < 0)
    return NULL;
  Py_ssize_t n = 0, n_groups = 0, n_buffers = 0, n_elems = 0;
  int64_t *numels = zp_int64_array(numels_o, fn, "numels", INT64_MIN, INT64_MAX,
                                   "in [1, 2**56] (with numel * elem_size <= 2**56)", &n);
  int64_t *groups = numels ? zp_int64_array(groups_o, fn, "groups", INT32_MIN, INT32_MAX,
                                            "in [0, 2**31-1]", &n_groups)
                           : NULL;
  int64_t *buffers = groups ? zp_int64_array(buffers_o, fn, "buffers", INT32_MIN, INT32_MAX,
                                             "in [0, 64)", &n_buffers)
                            : NULL;
  int64_t *elems = buffers ? zp_int64_array(elems_o, fn, "elem_sizes", INT32_MIN, INT32_MAX,
                                            "1, 2, 4 or 8", &n_elems)
                           : NULL;
  zp_param_desc *descs = NULL;
  PyObject *result = NULL;
  if (elems == NULL)
    goto done;
  if (n_groups != n || n_buffers != n || n_elems != n) {
    PyErr_SetString(PyExc_ValueError, "layout_plan: numels, groups, buffers and elem_sizes must "
                                      "have one entry per parameter");
    goto done;
  }
  if (n > INT32_MAX) {
    PyErr_Format(PyExc_ValueError, "layout_plan: %zd parameters; at most 2**31-1", n);
    goto done;
  }
  descs = zp_py_alloc_rows(n, sizeof *descs);
  if (descs == NULL)
    goto done;
  for (Py_ssize_t i = 0; i < n; i++) {
    descs[i] = (zp_param_desc){numels[i], (int32_t)groups[i], (int32_t)buffers[i],
                               (int32_t)elems[i]};
  }
  zp_layout *l = NULL;
  zp_status status;
  Py_BEGIN_ALLOW_THREADS status =
      zp_layout_plan(descs, (int32_t)n, (int32_t)world_size, align_bytes, bucket_bytes, &l);
  Py_END_ALLOW_THREADS if (status != ZP_OK) {
    zp_raise(status);
    goto done;
  }
  Py_ssize_t nb = l->n_buckets;
  result = Py_BuildValue(
      "{s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:N,s:L,s:L,s:i,s:L}",
      "param_bucket", zp_list_i32(l->param_bucket, n), "param_offset",
      zp_list_i64(l->param_offset, n), "bucket_group", zp_list_i32(l->bucket_group, nb),
      "bucket_buffer", zp_list_i32(l->bucket_buffer, nb), "bucket_numel",
      zp_list_i64(l->bucket_numel, nb), "bucket_shard_numel", zp_list_i64(l->bucket_shard_numel, nb),
      "bucket_flat_offset", zp_list_i64(l->bucket_flat_offset, nb), "bucket_shard_offset",
      zp_list_i64(l->bucket_shard_offset, nb), "bucket_param_start",
      zp_list_i32(l->bucket_param_start, nb + 1), "bucket_params",
      zp_list_i32(l->bucket_params, n), "buffer_numel", zp_list_i64(l->buffer_numel, l->n_buffers),
      "shard_numel", (long long)l->shard_numel, "padding_numel", (long long)l->padding_numel,
      "world_size", l->world_size, "align_bytes", (long long)l->align_bytes);
  zp_layout_free(l);
done:
  free(numels);
  free(groups);
  free(buffers);
  free(elems);
  free(descs);
  return result;
}

/* opt_step(segments, groups, n_threads): the tables of binding.h (ZP_OPT_SEG_FIELDS int64
 * rows, ZP_OPT_GROUP_FIELDS float64 rows). */

/* Segment rows -> zp_opt_segment (caller frees *out). Sets a Python error and returns -1 on
 * failure. */
static Py_ssize_t zp_opt_segments(const Py_buffer *buf, const char *fn, zp_opt_segment **out) {
  if (buf->len % (ZP_OPT_SEG_FIELDS * 8) != 0) {
    PyErr_Format(PyExc_ValueError, "%s: segments must be int64 rows of %d", fn, ZP_OPT_SEG_FIELDS);
    return -1;
  }
  Py_ssize_t n = buf->len / (ZP_OPT_SEG_FIELDS * 8);
  if (n > INT32_MAX) {
    PyErr_Format(PyExc_ValueError, "%s: too many segments (%zd)", fn, n);
    return -1;
  }
  *out = zp_py_opt_segment_rows(buf, n);
  return *out == NULL ? -1 : n;
}

static PyObject *zp_py_opt_step(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer seg_buf, group_buf;
  int n_threads;
  if (!PyArg_ParseTuple(args, "y*y*i:opt_step", &seg_buf, &group_buf, &n_threads))
    return NULL;
  PyObject *result = NULL;
  zp_opt_segment *segs = NULL;
  zp_opt_group *groups = NULL;
  Py_ssize_t n_segs = zp_opt_segments(&seg_buf, "opt_step", &segs);
  if (n_segs < 0)
    goto done;
  if (group_buf.len % (ZP_OPT_GROUP_FIELDS * 8) != 0 ||
      group_buf.len / (ZP_OPT_GROUP_FIELDS * 8) > INT32_MAX) {
    PyErr_Format(PyExc_ValueError, "opt_step: groups must be float64 rows of %d",
                 ZP_OPT_GROUP_FIELDS);
    goto done;
  }
  Py_ssize_t n_groups = group_buf.len / (ZP_OPT_GROUP_FIELDS * 8);
  groups = zp_py_opt_group_rows(&group_buf, n_groups);
  if (groups == NULL)
    goto done;
  zp_status status;
  Py_BEGIN_ALLOW_THREADS status =
      zp_opt_step_cpu(segs, (int32_t)n_segs, groups, (int32_t)n_groups, n_threads);
  Py_END_ALLOW_THREADS if (status != ZP_OK) zp_raise(status);
  else result = Py_NewRef(Py_None);
done:
  free(segs);
  free(groups);
  PyBuffer_Release(&seg_buf);
  PyBuffer_Release(&group_buf);
  return result;
}

/* grad_stats(segments, grad_dtype, norm_type, n_threads) -> (sum_pow, nonfinite) with opt_step's
 * segment rows (only grad and numel are read). */
static PyObject *zp_py_grad_stats(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer seg_buf;
  int grad_dtype, n_threads;
  double norm_type;
  if (!PyArg_ParseTuple(args, "y*idi:grad_stats", &seg_buf, &grad_dtype, &norm_type, &n_threads))
    return NULL;
  PyObject *result = NULL;
  zp_opt_segment *segs = NULL;
  Py_ssize_t n_segs = zp_opt_segments(&seg_buf, "grad_stats", &segs);
  if (n_segs >= 0) {
    double sum_pow = 0.0;
    int32_t nonfinite = 0;
    zp_status status;
    Py_BEGIN_ALLOW_THREADS status = zp_grad_stats_cpu(segs, (int32_t)n_segs, grad_dtype, norm_type,
                                                      n_threads, &sum_pow, &nonfinite);
    Py_END_ALLOW_THREADS if (status != ZP_OK) zp_raise(status);
    else result = Py_BuildValue("(dN)", sum_pow, PyBool_FromLong(nonfinite));
  }
  free(segs);
  PyBuffer_Release(&seg_buf);
  return result;
}

/* flag_publish(address, value): a release store of an int64 the caller mapped (shared memory). */
static PyObject *zp_py_flag_publish(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long addr;
  long long value;
  if (!PyArg_ParseTuple(args, "KL:flag_publish", &addr, &value))
    return NULL;
  if (addr == 0 || addr % sizeof(int64_t) != 0) {
    PyErr_SetString(PyExc_ValueError, "flag_publish: address must be a non-NULL, 8-byte aligned");
    return NULL;
  }
  zp_flag_publish((int64_t *)(uintptr_t)addr, (int64_t)value);
  Py_RETURN_NONE;
}

/* flags_wait(address, n, stride, value, timeout_s): waits, without the GIL, until n int64 flags
 * (stride apart, in elements) are >= value. */
static PyObject *zp_py_flags_wait(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long addr;
  int n;
  long long stride, value;
  double timeout_s;
  if (!PyArg_ParseTuple(args, "KiLLd:flags_wait", &addr, &n, &stride, &value, &timeout_s))
    return NULL;
  if (addr == 0 || addr % sizeof(int64_t) != 0) {
    PyErr_SetString(PyExc_ValueError, "flags_wait: address must be a non-NULL, 8-byte aligned");
    return NULL;
  }
  zp_status status;
  Py_BEGIN_ALLOW_THREADS status = zp_flags_wait_ge((const int64_t *)(uintptr_t)addr, (int32_t)n,
                                                   (int64_t)stride, (int64_t)value, timeout_s,
                                                   NULL);
  Py_END_ALLOW_THREADS if (status != ZP_OK) {
    zp_raise(status);
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyObject *zp_py_cpu_isa(PyObject *self, PyObject *args) {
  (void)self;
  (void)args;
  return PyUnicode_FromString(zp_isa_name(zp_isa_pick()));
}

/* cpu_tuning() -> {"isa", "vendor", "prefetch_bytes", "prefetch_into", "split",
 * "stream_min_bytes"}: what the next kernel call will use. */
static PyObject *zp_py_cpu_tuning(PyObject *self, PyObject *args) {
  (void)self;
  (void)args;
  zp_cpu_tuning t = zp_cpu_tuning_pick();
  return Py_BuildValue("{s:s,s:s,s:i,s:s,s:s,s:L}", "isa", zp_isa_name(t.isa), "vendor",
                       zp_cpu_vendor_name(t.vendor), "prefetch_bytes", (int)t.prefetch_bytes,
                       "prefetch_into", t.prefetch_l1 ? "l1" : "l2", "split",
                       t.split_static ? "static" : "blocks", "stream_min_bytes",
                       (long long)t.stream_min_bytes);
}

/* The int64 rows of 3 in `buf` (released here), lo to hi of them, copied into rows: their
 * count, or -1 with a ValueError naming fn and what the rows are. */
static Py_ssize_t zp_py_rows3(Py_buffer *buf, int64_t (*rows)[3], Py_ssize_t lo, Py_ssize_t hi,
                              const char *fn, const char *what) {
  const Py_ssize_t n = buf->len / (Py_ssize_t)sizeof rows[0];
  if (buf->len % (Py_ssize_t)sizeof rows[0] != 0 || n < lo || n > hi) {
    PyBuffer_Release(buf);
    PyErr_Format(PyExc_ValueError, "%s: %s must be %zd to %zd int64 rows of 3", fn, what, lo,
                 hi);
    return -1;
  }
  if (n > 0)
    memcpy(rows, buf->buf, (size_t)n * sizeof rows[0]);
  PyBuffer_Release(buf);
  return n;
}

/* stream_bound(streams, numel, n_threads): streams are int64 rows (address, elem_bytes,
 * access) of the caller's checked tensors. */
static PyObject *zp_py_stream_bound(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer buf;
  long long numel;
  int n_threads;
  if (!PyArg_ParseTuple(args, "y*Li:stream_bound", &buf, &numel, &n_threads))
    return NULL;
  int64_t rows[ZP_STREAM_MAX][3];
  const Py_ssize_t n = zp_py_rows3(&buf, rows, 1, ZP_STREAM_MAX, "stream_bound", "streams");
  if (n < 0)
    return NULL;
  zp_stream streams[ZP_STREAM_MAX];
  for (Py_ssize_t k = 0; k < n; k++)
    streams[k] = (zp_stream){(void *)(uintptr_t)rows[k][0], (int32_t)rows[k][1],
                             (int32_t)rows[k][2]};
  zp_status status;
  Py_BEGIN_ALLOW_THREADS status =
      zp_stream_bound_cpu(streams, (int32_t)n, (int64_t)numel, n_threads);
  Py_END_ALLOW_THREADS if (status != ZP_OK) return zp_raise(status);
  Py_RETURN_NONE;
}

/* copy_spans(spans, n_threads): spans are int64 rows (dst, src, bytes) of the caller's checked
 * tensors. */
static PyObject *zp_py_copy_spans(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer buf;
  int n_threads;
  if (!PyArg_ParseTuple(args, "y*i:copy_spans", &buf, &n_threads))
    return NULL;
  int64_t rows[ZP_COPY_MAX_SPANS][3];
  const Py_ssize_t n = zp_py_rows3(&buf, rows, 0, ZP_COPY_MAX_SPANS, "copy_spans", "spans");
  if (n < 0)
    return NULL;
  zp_copy_span spans[ZP_COPY_MAX_SPANS];
  for (Py_ssize_t k = 0; k < n; k++)
    spans[k] = (zp_copy_span){(void *)(uintptr_t)rows[k][0],
                              (const void *)(uintptr_t)rows[k][1], rows[k][2]};
  zp_status status;
  Py_BEGIN_ALLOW_THREADS status = zp_copy_spans(spans, (int32_t)n, n_threads);
  Py_END_ALLOW_THREADS if (status != ZP_OK) return zp_raise(status);
  Py_RETURN_NONE;
}

static PyObject *zp_py_default_threads(PyObject *self, PyObject *args) {
  (void)self;
  (void)args;
  return PyLong_FromLong(zp_default_threads());
}

/* ---- Schedule: a Python object owning one zp_schedule ---- */

typedef struct {
  PyObject_HEAD zp_schedule *schedule;
  int32_t *out; /* n_buckets slots for released bucket ids */
} zp_py_schedule;

static PyObject *zp_schedule_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  PyObject *map_o, *n_buckets_o;
  static char *kwlist[] = {"param_bucket", "n_buckets", NULL};
  int64_t n_buckets;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:Schedule", kwlist, &map_o, &n_buckets_o))
    return NULL;
  if (zp_py_int_arg(n_buckets_o, "Schedule", "n_buckets", INT32_MIN, INT32_MAX,
                    "in [1, len(param_bucket)]", &n_buckets) < 0)
    return NULL;
  Py_ssize_t n = 0;
  int64_t *map64 = zp_int64_array(map_o, "Schedule", "param_bucket", INT32_MIN, INT32_MAX,
                                  "a bucket id in [0, n_buckets)", &n);
  if (map64 == NULL)
    return NULL;
  if (n > INT32_MAX) {
    free(map64);
    return PyErr_Format(PyExc_ValueError, "Schedule: %zd parameters; at most 2**31-1", n);
  }
  int32_t *map = zp_py_alloc_rows(n, sizeof *map);
  if (map == NULL) {
    free(map64);
    return NULL;
  }
  for (Py_ssize_t i = 0; i < n; i++)
    map[i] = (int32_t)map64[i];
  free(map64);
  zp_schedule *schedule = NULL;
  zp_status status = zp_schedule_create(map, (int32_t)n, (int32_t)n_buckets, &schedule);
  free(map);
  if (status != ZP_OK)
    return zp_raise(status);
  zp_py_schedule *obj = (zp_py_schedule *)type->tp_alloc(type, 0);
  if (obj == NULL) {
    zp_schedule_destroy(schedule);
    return NULL;
  }
  obj->schedule = schedule;
  obj->out = malloc((size_t)n_buckets * sizeof *obj->out);
  if (obj->out == NULL) {
    Py_DECREF(obj);
    return PyErr_NoMemory();
  }
  return (PyObject *)obj;
}

static void zp_schedule_dealloc(zp_py_schedule *self) {
  PyTypeObject *type = Py_TYPE(self);
  zp_schedule_destroy(self->schedule);
  free(self->out);
  type->tp_free((PyObject *)self);
  Py_DECREF(type);
}

static PyObject *zp_released_tuple(zp_py_schedule *self, zp_status status, int32_t n_out) {
  if (status != ZP_OK)
    return zp_raise(status);
  PyObject *tuple = PyTuple_New(n_out);
  for (int32_t i = 0; tuple != NULL && i < n_out; i++)
    PyTuple_SET_ITEM(tuple, i, PyLong_FromLong(self->out[i]));
  return tuple;
}

static PyObject *zp_schedule_grad_ready_py(zp_py_schedule *self, PyObject *arg) {
  int64_t param;
  if (zp_py_int_arg(arg, "Schedule.grad_ready", "param", INT32_MIN, INT32_MAX,
                    "a parameter index in [0, n_params)", &param) < 0)
    return NULL;
  int32_t n_out = 0;
  int32_t cap = zp_schedule_n_buckets(self->schedule);
  zp_status status = zp_schedule_grad_ready(self->schedule, (int32_t)param, self->out, cap, &n_out);
  return zp_released_tuple(self, status, n_out);
}

static PyObject *zp_schedule_flush_py(zp_py_schedule *self, PyObject *args) {
  (void)args;
  int32_t n_out = 0;
  int32_t cap = zp_schedule_n_buckets(self->schedule);
  zp_status status = zp_schedule_flush(self->schedule, self->out, cap, &n_out);
  return zp_released_tuple(self, status, n_out);
}

static PyObject *zp_schedule_reset_py(zp_py_schedule *self, PyObject *args) {
  (void)args;
  zp_schedule_reset(self->schedule);
  Py_RETURN_NONE;
}

static PyObject *zp_schedule_is_ready_py(zp_py_schedule *self, PyObject *arg) {
  long param = PyLong_AsLong(arg);
  if (param == -1 && PyErr_Occurred())
    return NULL;
  int32_t r = zp_schedule_is_ready(self->schedule, param < 0 || param > INT32_MAX ? -1 : (int32_t)param);
  if (r < 0)
    return PyErr_Format(PyExc_IndexError, "Schedule.is_ready: parameter %ld out of range", param);
  return PyBool_FromLong(r);
}

static PyObject *zp_schedule_released_get(zp_py_schedule *self, void *closure) {
  (void)closure;
  return PyLong_FromLong(zp_schedule_released(self->schedule));
}

static PyMethodDef zp_schedule_methods[] = {
    {"grad_ready", (PyCFunction)zp_schedule_grad_ready_py, METH_O,
     "grad_ready(param) -> tuple of bucket ids released by this event"},
    {"flush", (PyCFunction)zp_schedule_flush_py, METH_NOARGS,
     "flush() -> tuple of every bucket id not yet released"},
    {"reset", (PyCFunction)zp_schedule_reset_py, METH_NOARGS, "start a new pass"},
    {"is_ready", (PyCFunction)zp_schedule_is_ready_py, METH_O,
     "is_ready(param) -> whether it was reported in this pass"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef zp_schedule_getset[] = {
    {"released", (getter)zp_schedule_released_get, NULL, "buckets released in this pass", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyType_Slot zp_schedule_slots[] = {
    {Py_tp_new, zp_schedule_new},
    {Py_tp_dealloc, zp_schedule_dealloc},
    {Py_tp_methods, zp_schedule_methods},
    {Py_tp_getset, zp_schedule_getset},
    {Py_tp_doc, "Schedule(param_bucket, n_buckets): in-order release of gradient buckets"},
    {0, NULL}};

static PyType_Spec zp_schedule_spec = {"zero_py._C.Schedule", sizeof(zp_py_schedule), 0,
                                       Py_TPFLAGS_DEFAULT, zp_schedule_slots};

/* ---- module ---- */

static PyMethodDef zp_methods[] = {
    {"layout_plan", zp_py_layout_plan, METH_VARARGS,
     "layout_plan(numels, groups, buffers, elem_sizes, world_size, align_bytes, bucket_bytes)"},
    {"opt_step", zp_py_opt_step, METH_VARARGS, "opt_step(segments, groups, n_threads)"},
    {"grad_stats", zp_py_grad_stats, METH_VARARGS,
     "grad_stats(segments, grad_dtype, norm_type, n_threads) -> (sum_pow, nonfinite)"},
    {"cpu_isa", zp_py_cpu_isa, METH_NOARGS, "instruction set the CPU kernels dispatch to"},
    {"flag_publish", zp_py_flag_publish, METH_VARARGS, "flag_publish(address, value)"},
    {"flags_wait", zp_py_flags_wait, METH_VARARGS,
     "flags_wait(address, n, stride, value, timeout_s)"},
    {"default_threads", zp_py_default_threads, METH_NOARGS, "threads the CPU kernels use"},
    {"cpu_tuning", zp_py_cpu_tuning, METH_NOARGS, "ISA, vendor and prefetch of the CPU kernels"},
    {"stream_bound", zp_py_stream_bound, METH_VARARGS, "stream_bound(streams, numel, n_threads)"},
    {"copy_spans", zp_py_copy_spans, METH_VARARGS, "copy_spans(spans, n_threads)"},
    {NULL, NULL, 0, NULL}};

static int zp_exec(PyObject *module) {
  PyObject *type = PyType_FromModuleAndSpec(module, &zp_schedule_spec, NULL);
  if (type == NULL)
    return -1;
  int rc = PyModule_AddObjectRef(module, "Schedule", type);
  Py_DECREF(type);
  if (rc == 0)
    rc = zp_prefetch_py_register(module);
  if (rc == 0)
    rc = zp_io_py_register(module);
  return rc == 0 ? zp_quantize_py_register(module) : rc;
}

static PyModuleDef_Slot zp_slots[] = {{Py_mod_exec, zp_exec}, {0, NULL}};

static struct PyModuleDef zp_module = {PyModuleDef_HEAD_INIT, "zero_py._C",
                                       "C core of zero_py (private: use the zero_py package)", 0,
                                       zp_methods, zp_slots, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&zp_module); }
