/* prefetch_py.c - zero_py._C.Prefetch: a Python object owning one zp_prefetch (prefetch.h).
 *
 * Commands come back as a tuple of (kind, unit) pairs, kind PF_GATHER or PF_FREE; the core's
 * reason for each command stays in C. Failing calls raise through zp_raise (binding.h). */
#include "python/binding.h"

#include <stdint.h>
#include <stdlib.h>

#include "schedule/prefetch.h"

typedef struct {
  PyObject_HEAD zp_prefetch *pf;
  zp_pf_cmd *cmds; /* zp_prefetch_cmd_capacity() slots */
  int32_t cap;
  int32_t *ids; /* n_units slots for order() and seen() */
} zp_py_prefetch;

/* A Python int that must be a unit id -> int32; ids beyond int32 raise IndexError here, the
 * others go to the core, which checks them against the unit count. */
static int zp_pf_unit_arg(PyObject *arg, const char *fn, int32_t *out) {
  long long v = PyLong_AsLongLong(arg);
  if (v == -1 && PyErr_Occurred())
    return -1;
  if (v < INT32_MIN || v > INT32_MAX) {
    PyErr_Format(PyExc_IndexError, "Prefetch.%s: unit %lld is out of range", fn, v);
    return -1;
  }
  *out = (int32_t)v;
  return 0;
}

static PyObject *zp_prefetch_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"unit_bytes", "keep", "budget_bytes", NULL};
  PyObject *bytes_o, *keep_o, *budget_o;
  int64_t budget;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO:Prefetch", kwlist, &bytes_o, &keep_o,
                                   &budget_o))
    return NULL;
  if (zp_py_int_arg(budget_o, "Prefetch", "budget_bytes", INT64_MIN, INT64_MAX,
                    "in [0, 2**63-1]", &budget) < 0)
    return NULL;
  PyObject *bytes_f = PySequence_Fast(bytes_o, "Prefetch: unit_bytes must be a sequence of int");
  if (bytes_f == NULL)
    return NULL;
  PyObject *keep_f = PySequence_Fast(keep_o, "Prefetch: keep must be a sequence of bool");
  if (keep_f == NULL) {
    Py_DECREF(bytes_f);
    return NULL;
  }
  PyObject *result = NULL;
  int64_t *bytes = NULL;
  uint8_t *keep = NULL;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(bytes_f);
  if (PySequence_Fast_GET_SIZE(keep_f) != n) {
    PyErr_Format(PyExc_ValueError, "Prefetch: keep has %zd entries, unit_bytes %zd; give one "
                 "per unit", PySequence_Fast_GET_SIZE(keep_f), n);
    goto done;
  }
  if (n > INT32_MAX) {
    PyErr_Format(PyExc_ValueError, "Prefetch: %zd units is too many", n);
    goto done;
  }
  bytes = malloc((size_t)(n > 0 ? n : 1) * sizeof *bytes);
  keep = malloc((size_t)(n > 0 ? n : 1));
  if (bytes == NULL || keep == NULL) {
    PyErr_NoMemory();
    goto done;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    char name[64];
    snprintf(name, sizeof name, "unit_bytes[%zd]", i);
    if (zp_py_int_arg(PySequence_Fast_GET_ITEM(bytes_f, i), "Prefetch", name, INT64_MIN,
                      INT64_MAX, "in [1, 2**63-1], all units adding up to at most 2**63-1",
                      &bytes[i]) < 0)
      goto done;
    int k = PyObject_IsTrue(PySequence_Fast_GET_ITEM(keep_f, i));
    if (k < 0)
      goto done;
    keep[i] = (uint8_t)k;
  }
  zp_prefetch *pf = NULL;
  zp_status status = zp_prefetch_create((int32_t)n, bytes, keep, budget, &pf);
  if (status != ZP_OK) {
    zp_raise(status);
    goto done;
  }
  zp_py_prefetch *obj = (zp_py_prefetch *)type->tp_alloc(type, 0);
  if (obj == NULL) {
    zp_prefetch_destroy(pf);
    goto done;
  }
  obj->pf = pf;
  obj->cap = zp_prefetch_cmd_capacity(pf);
  obj->cmds = malloc((size_t)obj->cap * sizeof *obj->cmds);
  obj->ids = malloc((size_t)n * sizeof *obj->ids);
  if (obj->cmds == NULL || obj->ids == NULL) {
    Py_DECREF(obj);
    PyErr_NoMemory();
    goto done;
  }
  result = (PyObject *)obj;
done:
  free(bytes);
  free(keep);
  Py_DECREF(bytes_f);
  Py_DECREF(keep_f);
  return result;
}

static void zp_prefetch_dealloc(zp_py_prefetch *self) {
  PyTypeObject *type = Py_TYPE(self);
  zp_prefetch_destroy(self->pf);
  free(self->cmds);
  free(self->ids);
  type->tp_free((PyObject *)self);
  Py_DECREF(type);
}

/* The commands of a call as a tuple of (kind, unit) pairs, or the call's exception. */
static PyObject *zp_pf_cmds_tuple(const zp_py_prefetch *self, zp_status status, int32_t n_out) {
  if (status != ZP_OK)
    return zp_raise(status);
  PyObject *tuple = PyTuple_New(n_out);
  for (int32_t i = 0; tuple != NULL && i < n_out; i++) {
    PyObject *pair = Py_BuildValue("(ii)", (int)self->cmds[i].kind, (int)self->cmds[i].unit);
    if (pair == NULL) {
      Py_CLEAR(tuple);
      break;
    }
    PyTuple_SET_ITEM(tuple, i, pair);
  }
  return tuple;
}

static PyObject *zp_pf_ids_tuple(const int32_t *ids, int32_t n) {
  PyObject *tuple = PyTuple_New(n);
  for (int32_t i = 0; tuple != NULL && i < n; i++) {
    PyObject *v = PyLong_FromLong(ids[i]);
    if (v == NULL) {
      Py_CLEAR(tuple);
      break;
    }
    PyTuple_SET_ITEM(tuple, i, v);
  }
  return tuple;
}

static PyObject *zp_prefetch_set_order_py(zp_py_prefetch *self, PyObject *arg) {
  PyObject *fast = PySequence_Fast(arg, "Prefetch.set_order: order must be a sequence of int");
  if (fast == NULL)
    return NULL;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  const int32_t n_units = zp_prefetch_n_units(self->pf);
  if (n > n_units) {
    Py_DECREF(fast);
    return PyErr_Format(PyExc_ValueError, "Prefetch.set_order: an order of %zd units; there are "
                        "%d units", n, n_units);
  }
  int32_t *order = malloc((size_t)(n > 0 ? n : 1) * sizeof *order);
  if (order == NULL) {
    Py_DECREF(fast);
    return PyErr_NoMemory();
  }
  PyObject *result = NULL;
  for (Py_ssize_t i = 0; i < n; i++)
    if (zp_pf_unit_arg(PySequence_Fast_GET_ITEM(fast, i), "set_order", &order[i]) < 0)
      goto done;
  zp_status status = zp_prefetch_set_order(self->pf, order, (int32_t)n);
  result = status == ZP_OK ? Py_NewRef(Py_None) : zp_raise(status);
done:
  free(order);
  Py_DECREF(fast);
  return result;
}

static PyObject *zp_prefetch_set_keep_py(zp_py_prefetch *self, PyObject *arg) {
  PyObject *fast = PySequence_Fast(arg, "Prefetch.set_keep: keep must be a sequence of bool");
  if (fast == NULL)
    return NULL;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  const int32_t n_units = zp_prefetch_n_units(self->pf);
  if (n != n_units) {
    Py_DECREF(fast);
    return PyErr_Format(PyExc_ValueError, "Prefetch.set_keep: keep has %zd entries; give one "
                        "per unit (%d)", n, n_units);
  }
  uint8_t *keep = malloc((size_t)(n > 0 ? n : 1));
  if (keep == NULL) {
    Py_DECREF(fast);
    return PyErr_NoMemory();
  }
  PyObject *result = NULL;
  for (Py_ssize_t i = 0; i < n; i++) {
    int k = PyObject_IsTrue(PySequence_Fast_GET_ITEM(fast, i));
    if (k < 0)
      goto done;
    keep[i] = (uint8_t)k;
  }
  zp_status status = zp_prefetch_set_keep(self->pf, keep);
  result = status == ZP_OK ? Py_NewRef(Py_None) : zp_raise(status);
done:
  free(keep);
  Py_DECREF(fast);
  return result;
}

static PyObject *zp_prefetch_order_py(zp_py_prefetch *self, PyObject *args) {
  (void)args;
  int32_t n = zp_prefetch_order(self->pf, self->ids, zp_prefetch_n_units(self->pf));
  return zp_pf_ids_tuple(self->ids, n);
}

static PyObject *zp_prefetch_seen_py(zp_py_prefetch *self, PyObject *args) {
  (void)args;
  int32_t n = zp_prefetch_seen(self->pf, self->ids, zp_prefetch_n_units(self->pf));
  return zp_pf_ids_tuple(self->ids, n);
}

static PyObject *zp_prefetch_begin_py(zp_py_prefetch *self, PyObject *arg) {
  long phase = PyLong_AsLong(arg);
  if (phase == -1 && PyErr_Occurred())
    return NULL;
  if (phase < INT32_MIN || phase > INT32_MAX)
    return PyErr_Format(PyExc_ValueError, "Prefetch.begin: phase %ld is not PF_FORWARD (0), "
                        "PF_FORWARD_EVAL (1) or PF_BACKWARD (2)", phase);
  zp_status status = zp_prefetch_begin(self->pf, (int32_t)phase);
  return status == ZP_OK ? Py_NewRef(Py_None) : zp_raise(status);
}

static PyObject *zp_prefetch_need_py(zp_py_prefetch *self, PyObject *arg) {
  int32_t u, n_out = 0;
  if (zp_pf_unit_arg(arg, "need", &u) < 0)
    return NULL;
  zp_status status = zp_prefetch_need(self->pf, u, self->cmds, self->cap, &n_out);
  return zp_pf_cmds_tuple(self, status, n_out);
}

static PyObject *zp_prefetch_done_py(zp_py_prefetch *self, PyObject *arg) {
  int32_t u, n_out = 0;
  if (zp_pf_unit_arg(arg, "done", &u) < 0)
    return NULL;
  zp_status status = zp_prefetch_done(self->pf, u, self->cmds, self->cap, &n_out);
  return zp_pf_cmds_tuple(self, status, n_out);
}

static PyObject *zp_prefetch_end_py(zp_py_prefetch *self, PyObject *args) {
  (void)args;
  int32_t n_out = 0;
  zp_status status = zp_prefetch_end(self->pf, self->cmds, self->cap, &n_out);
  return zp_pf_cmds_tuple(self, status, n_out);
}

static PyObject *zp_prefetch_is_resident_py(zp_py_prefetch *self, PyObject *arg) {
  int32_t u;
  if (zp_pf_unit_arg(arg, "is_resident", &u) < 0)
    return NULL;
  int32_t r = zp_prefetch_is_resident(self->pf, u);
  if (r < 0)
    return PyErr_Format(PyExc_IndexError, "Prefetch.is_resident: unit %d is outside [0, %d)", u,
                        zp_prefetch_n_units(self->pf));
  return PyBool_FromLong(r);
}

static PyObject *zp_prefetch_reset_peak_py(zp_py_prefetch *self, PyObject *args) {
  (void)args;
  zp_prefetch_reset_peak(self->pf);
  Py_RETURN_NONE;
}

static PyObject *zp_prefetch_live_bytes_get(zp_py_prefetch *self, void *closure) {
  (void)closure;
  return PyLong_FromLongLong(zp_prefetch_live_bytes(self->pf));
}

static PyObject *zp_prefetch_peak_bytes_get(zp_py_prefetch *self, void *closure) {
  (void)closure;
  return PyLong_FromLongLong(zp_prefetch_peak_bytes(self->pf));
}

static PyMethodDef zp_prefetch_methods[] = {
    {"set_keep", (PyCFunction)zp_prefetch_set_keep_py, METH_O,
     "set_keep(keep): one bool per unit, the units kept gathered from forward into backward"},
    {"set_order", (PyCFunction)zp_prefetch_set_order_py, METH_O,
     "set_order(order): the forward order (distinct unit ids) the following phases follow"},
    {"order", (PyCFunction)zp_prefetch_order_py, METH_NOARGS, "order() -> tuple of unit ids"},
    {"begin", (PyCFunction)zp_prefetch_begin_py, METH_O,
     "begin(phase): open PF_FORWARD, PF_FORWARD_EVAL or PF_BACKWARD"},
    {"need", (PyCFunction)zp_prefetch_need_py, METH_O,
     "need(unit) -> tuple of (kind, unit) commands; afterwards the unit is resident"},
    {"done", (PyCFunction)zp_prefetch_done_py, METH_O,
     "done(unit) -> tuple of (kind, unit) commands"},
    {"end", (PyCFunction)zp_prefetch_end_py, METH_NOARGS,
     "end() -> tuple of (kind, unit) commands that drain and close the phase"},
    {"seen", (PyCFunction)zp_prefetch_seen_py, METH_NOARGS,
     "seen() -> units in the order of their first need in the last ended PF_FORWARD phase"},
    {"is_resident", (PyCFunction)zp_prefetch_is_resident_py, METH_O,
     "is_resident(unit) -> whether the unit is gathered now"},
    {"reset_peak", (PyCFunction)zp_prefetch_reset_peak_py, METH_NOARGS,
     "restart peak_bytes at live_bytes"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef zp_prefetch_getset[] = {
    {"live_bytes", (getter)zp_prefetch_live_bytes_get, NULL, "bytes of the resident units", NULL},
    {"peak_bytes", (getter)zp_prefetch_peak_bytes_get, NULL,
     "the most live_bytes since creation or reset_peak()", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyType_Slot zp_prefetch_slots[] = {
    {Py_tp_new, zp_prefetch_new},
    {Py_tp_dealloc, zp_prefetch_dealloc},
    {Py_tp_methods, zp_prefetch_methods},
    {Py_tp_getset, zp_prefetch_getset},
    {Py_tp_doc, "Prefetch(unit_bytes, keep, budget_bytes): the stage-3 gather/free schedule"},
    {0, NULL}};

static PyType_Spec zp_prefetch_spec = {"zero_py._C.Prefetch", sizeof(zp_py_prefetch), 0,
                                       Py_TPFLAGS_DEFAULT, zp_prefetch_slots};

int zp_prefetch_py_register(PyObject *module) {
  PyObject *type = PyType_FromModuleAndSpec(module, &zp_prefetch_spec, NULL);
  if (type == NULL)
    return -1;
  int rc = PyModule_AddObjectRef(module, "Prefetch", type);
  Py_DECREF(type);
  if (rc == 0)
    rc = PyModule_AddIntConstant(module, "PF_GATHER", ZP_PF_GATHER);
  if (rc == 0)
    rc = PyModule_AddIntConstant(module, "PF_FREE", ZP_PF_FREE);
  if (rc == 0)
    rc = PyModule_AddIntConstant(module, "PF_FORWARD", ZP_PF_FORWARD);
  if (rc == 0)
    rc = PyModule_AddIntConstant(module, "PF_FORWARD_EVAL", ZP_PF_FORWARD_EVAL);
  if (rc == 0)
    rc = PyModule_AddIntConstant(module, "PF_BACKWARD", ZP_PF_BACKWARD);
  return rc;
}
