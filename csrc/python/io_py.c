/* io_py.c - zero_py._C's I/O helpers: crc32c(buffer, crc=0), the checkpoint files' checksum. */
#include "binding.h"
#include "io/checksum.h"

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

static PyMethodDef zp_io_methods[] = {
    {"crc32c", zp_py_crc32c, METH_VARARGS, "crc32c(buffer, crc=0): CRC-32C, continuing crc"},
    {"crc32c_impl", zp_py_crc32c_impl, METH_NOARGS, "sse4.2 or portable"},
    {NULL, NULL, 0, NULL}};

int zp_io_py_register(PyObject *module) { return PyModule_AddFunctions(module, zp_io_methods); }
