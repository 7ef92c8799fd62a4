/* io_py.c - zero_py._C's I/O: crc32c(buffer, crc=0), the checkpoint files' checksum; io_open()
 * and IoEngine, a Python object owning one zp_io_engine (io/engine.h).
 *
 * IoEngine takes buffer addresses as integers (a tensor's data_ptr()): the caller keeps each
 * buffer alive until its ticket is waited for (zero_py/io/engine.py does). Waits release the
 * GIL. Failing calls raise through zp_raise (binding.h). */
#include "binding.h"
#include "io/checksum.h"
#include "io/engine.h"

/* crc32c(buffer, crc=0) -> int: CRC-32C of any contiguous buffer (bytes, bytearray,
 * memoryview, a NumPy array), continuing from `crc`; the GIL is released while it runs. */
static PyObject *zp_py_crc32c(PyObject *self, PyObject *args) {
  (void)self;
  Py_buffer buf;
  unsigned long long crc = 0;
  if (!PyArg_ParseTuple(args, "y*|K:crc32c", &buf, &crc))
    return NULL;
  if (crc > 0xFFFFFFFFull) {
    PyBuffer_Release(&buf);
    return PyErr_Format(PyExc_ValueError, "crc32c: crc must be a 32-bit value, got %llu", crc);
  }
  uint32_t out;
  Py_BEGIN_ALLOW_THREADS out = zp_crc32c((uint32_t)crc, buf.buf, (size_t)buf.len);
  Py_END_ALLOW_THREADS PyBuffer_Release(&buf);
  return PyLong_FromUnsignedLong(out);
}

static PyObject *zp_py_crc32c_impl(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  return PyUnicode_FromString(zp_crc32c_impl());
}

/* io_open(path, writable, truncate, direct) -> (fd, direct): see zp_io_open. */
static PyObject *zp_py_io_open(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *path_o;
  int writable, truncate, want_direct;
  if (!PyArg_ParseTuple(args, "O&ppp:io_open", PyUnicode_FSConverter, &path_o, &writable,
                        &truncate, &want_direct))
    return NULL;
  int fd = -1, direct = 0;
  zp_status st;
  Py_BEGIN_ALLOW_THREADS st =
      zp_io_open(PyBytes_AS_STRING(path_o), writable, truncate, want_direct, &fd, &direct);
  Py_END_ALLOW_THREADS Py_DECREF(path_o);
  if (st != ZP_OK)
    return zp_raise(st);
  return Py_BuildValue("(iO)", fd, direct ? Py_True : Py_False);
}

typedef struct {
  PyObject_HEAD zp_io_engine *engine;
} zp_py_io_engine;

static PyObject *zp_io_engine_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"n_threads", "max_inflight", NULL};
  int n_threads, max_inflight;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "ii:IoEngine", kwlist, &n_threads,
                                   &max_inflight))
    return NULL;
  zp_py_io_engine *self = (zp_py_io_engine *)type->tp_alloc(type, 0);
  if (self == NULL)
    return NULL;
  zp_status st = zp_io_engine_create(n_threads, max_inflight, &self->engine);
  if (st != ZP_OK) {
    Py_DECREF(self);
    return zp_raise(st);
  }
  return (PyObject *)self;
}

static void zp_io_engine_close_now(zp_py_io_engine *self) {
  zp_io_engine *e = self->engine;
  self->engine = NULL;
  Py_BEGIN_ALLOW_THREADS zp_io_engine_destroy(e);
  Py_END_ALLOW_THREADS
}

static void zp_io_engine_dealloc(zp_py_io_engine *self) {
  PyTypeObject *type = Py_TYPE(self);
  zp_io_engine_close_now(self);
  type->tp_free(self);
  Py_DECREF(type);
}

static zp_io_engine *zp_io_engine_of(zp_py_io_engine *self) {
  if (self->engine == NULL)
    PyErr_SetString(PyExc_RuntimeError, "IoEngine: closed");
  return self->engine;
}

/* submit(op, fd, address, nbytes, offset, direct) -> ticket */
static PyObject *zp_io_engine_submit(zp_py_io_engine *self, PyObject *args) {
  int op, fd, direct;
  unsigned long long address;
  long long nbytes, offset;
  if (!PyArg_ParseTuple(args, "iiKLLp:submit", &op, &fd, &address, &nbytes, &offset, &direct))
    return NULL;
  zp_io_engine *e = zp_io_engine_of(self);
  if (e == NULL)
    return NULL;
  int64_t ticket;
  zp_status st = zp_io_submit(e, (zp_io_op)op, fd, ZP_PTR(address), nbytes, offset, direct,
                              &ticket);
  return st == ZP_OK ? PyLong_FromLongLong(ticket) : zp_raise(st);
}

/* wait(ticket, timeout_ms=-1): the request's outcome (raises its error) */
static PyObject *zp_io_engine_wait(zp_py_io_engine *self, PyObject *args) {
  long long ticket, timeout_ms = -1;
  if (!PyArg_ParseTuple(args, "L|L:wait", &ticket, &timeout_ms))
    return NULL;
  zp_io_engine *e = zp_io_engine_of(self);
  if (e == NULL)
    return NULL;
  zp_status st;
  Py_BEGIN_ALLOW_THREADS st = zp_io_wait(e, ticket, timeout_ms);
  Py_END_ALLOW_THREADS if (st != ZP_OK) return zp_raise(st);
  Py_RETURN_NONE;
}

static PyObject *zp_io_engine_poll(zp_py_io_engine *self, PyObject *arg) {
  long long ticket = PyLong_AsLongLong(arg);
  if (ticket == -1 && PyErr_Occurred())
    return NULL;
  zp_io_engine *e = zp_io_engine_of(self);
  if (e == NULL)
    return NULL;
  int done = 0;
  zp_status st = zp_io_poll(e, ticket, &done);
  if (st != ZP_OK)
    return zp_raise(st);
  return PyBool_FromLong(done);
}

static PyObject *zp_io_engine_close(zp_py_io_engine *self, PyObject *unused) {
  (void)unused;
  zp_io_engine_close_now(self);
  Py_RETURN_NONE;
}

static PyMethodDef zp_io_engine_methods[] = {
    {"submit", (PyCFunction)zp_io_engine_submit, METH_VARARGS,
     "submit(op, fd, address, nbytes, offset, direct) -> ticket"},
    {"wait", (PyCFunction)zp_io_engine_wait, METH_VARARGS, "wait(ticket, timeout_ms=-1)"},
    {"poll", (PyCFunction)zp_io_engine_poll, METH_O, "poll(ticket) -> done"},
    {"close", (PyCFunction)zp_io_engine_close, METH_NOARGS, "stop the workers"},
    {NULL, NULL, 0, NULL}};

static PyType_Slot zp_io_engine_slots[] = {
    {Py_tp_new, zp_io_engine_new},
    {Py_tp_dealloc, zp_io_engine_dealloc},
    {Py_tp_methods, zp_io_engine_methods},
    {Py_tp_doc, "IoEngine(n_threads, max_inflight): the direct-I/O engine (csrc/io/engine.h)"},
    {0, NULL}};

static PyType_Spec zp_io_engine_spec = {"zero_py._C.IoEngine", sizeof(zp_py_io_engine), 0,
                                        Py_TPFLAGS_DEFAULT, zp_io_engine_slots};

static PyMethodDef zp_io_methods[] = {
    {"crc32c", zp_py_crc32c, METH_VARARGS, "crc32c(buffer, crc=0): CRC-32C, continuing crc"},
    {"crc32c_impl", zp_py_crc32c_impl, METH_NOARGS, "sse4.2 or portable"},
    {"io_open", zp_py_io_open, METH_VARARGS,
     "io_open(path, writable, truncate, direct) -> (fd, direct)"},
    {NULL, NULL, 0, NULL}};

int zp_io_py_register(PyObject *module) {
  if (PyModule_AddFunctions(module, zp_io_methods) < 0)
    return -1;
  PyObject *type = PyType_FromModuleAndSpec(module, &zp_io_engine_spec, NULL);
  if (type == NULL)
    return -1;
  int rc = PyModule_AddObjectRef(module, "IoEngine", type);
  Py_DECREF(type);
  if (rc == 0)
    rc = PyModule_AddIntConstant(module, "IO_ALIGN", ZP_IO_ALIGN);
  return rc;
}
