/* nccl_py.c - zero_py._cuda's NCCL part: nccl_load, nccl_unique_id and nccl_has_p2p
 * (comm/nccl_lib.h), and the NcclComm and NcclWork types: one communicator and the collectives
 * issued on it (comm/communicator.h). Addresses and streams arrive as integers that
 * zero_py/collectives/nccl.py took from objects it owns and checked; statuses become
 * exceptions through zp_raise (binding.h). */
#include "python/binding.h"

#include <stdint.h>
#include <string.h>

#include "comm/communicator.h"
#include "comm/nccl_lib.h"

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
  zp_cuda_module_state *state = PyType_GetModuleState(Py_TYPE(self));
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

static PyMethodDef zp_nccl_methods[] = {
    {"nccl_load", zp_py_nccl_load, METH_VARARGS, "nccl_load([path]) -> NCCL's version code"},
    {"nccl_unique_id", zp_py_nccl_unique_id, METH_NOARGS, "a new ncclUniqueId, as 128 bytes"},
    {"nccl_has_p2p", zp_py_nccl_has_p2p, METH_NOARGS,
     "whether the loaded NCCL has ncclSend/ncclRecv/ncclGroupStart/ncclGroupEnd (2.7+): the "
     "all-to-all (collective 4)"},
    {NULL, NULL, 0, NULL}};

int zp_nccl_py_register(PyObject *module) {
  if (PyModule_AddFunctions(module, zp_nccl_methods) < 0)
    return -1;
  zp_cuda_module_state *state = PyModule_GetState(module);
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
  return 0;
}
