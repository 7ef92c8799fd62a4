/* quantize_py.c - zero_py._C.quantize / dequantize: block quantization of communication
 * buffers (kernels/cpu/quantize.h), on addresses the Python side checked
 * (zero_py/kernels/quantize.py). The GIL is released while the kernels run. */
#include "binding.h"
#include "kernels/cpu/quantize.h"

/* quantize(x, x_dtype, n, block, bits, q, scales, n_threads) */
static PyObject *zp_py_quantize(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long x, q, scales;
  int dtype, bits, n_threads;
  long long n, block;
  if (!PyArg_ParseTuple(args, "KiLLiKKi:quantize", &x, &dtype, &n, &block, &bits, &q, &scales,
                        &n_threads))
    return NULL;
  zp_status st;
  Py_BEGIN_ALLOW_THREADS st = zp_quantize(ZP_PTR(x), (zp_dtype)dtype, n, block, bits, ZP_PTR(q),
                                          ZP_PTR(scales), n_threads);
  Py_END_ALLOW_THREADS if (st != ZP_OK) return zp_raise(st);
  Py_RETURN_NONE;
}

/* quantize_sr(x, x_dtype, n, block, bits, q, scales, seed, stream, n_threads) */
static PyObject *zp_py_quantize_sr(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long x, q, scales, seed, stream;
  int dtype, bits, n_threads;
  long long n, block;
  if (!PyArg_ParseTuple(args, "KiLLiKKKKi:quantize_sr", &x, &dtype, &n, &block, &bits, &q,
                        &scales, &seed, &stream, &n_threads))
    return NULL;
  zp_status st;
  Py_BEGIN_ALLOW_THREADS st = zp_quantize_sr(ZP_PTR(x), (zp_dtype)dtype, n, block, bits,
                                             ZP_PTR(q), ZP_PTR(scales), seed, stream, n_threads);
  Py_END_ALLOW_THREADS if (st != ZP_OK) return zp_raise(st);
  Py_RETURN_NONE;
}

/* dequantize(q, scales, n, block, bits, out, out_dtype, accumulate, n_threads) */
static PyObject *zp_py_dequantize(PyObject *self, PyObject *args) {
  (void)self;
  unsigned long long q, scales, out;
  int bits, dtype, accumulate, n_threads;
  long long n, block;
  if (!PyArg_ParseTuple(args, "KKLLiKipi:dequantize", &q, &scales, &n, &block, &bits, &out,
                        &dtype, &accumulate, &n_threads))
    return NULL;
  zp_status st;
  Py_BEGIN_ALLOW_THREADS st = zp_dequantize(ZP_PTR(q), ZP_PTR(scales), n, block, bits, ZP_PTR(out),
                                            (zp_dtype)dtype, accumulate, n_threads);
  Py_END_ALLOW_THREADS if (st != ZP_OK) return zp_raise(st);
  Py_RETURN_NONE;
}

static PyMethodDef zp_quantize_methods[] = {
    {"quantize", zp_py_quantize, METH_VARARGS,
     "quantize(x, x_dtype, n, block, bits, q, scales, n_threads)"},
    {"quantize_sr", zp_py_quantize_sr, METH_VARARGS,
     "quantize_sr(x, x_dtype, n, block, bits, q, scales, seed, stream, n_threads)"},
    {"dequantize", zp_py_dequantize, METH_VARARGS,
     "dequantize(q, scales, n, block, bits, out, out_dtype, accumulate, n_threads)"},
    {NULL, NULL, 0, NULL}};

int zp_quantize_py_register(PyObject *module) {
  return PyModule_AddFunctions(module, zp_quantize_methods);
}
