/* binding.h - what the C files of the CPython binding (csrc/python/) share. */
#ifndef ZP_BINDING_H
#define ZP_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "common/status.h"

/* The one place where core statuses become Python exceptions (module.c): sets the exception
 * for a failing `status`, with zp_last_error() as its message, and returns NULL. */
PyObject *zp_raise(zp_status status);

/* Adds zero_py._C.Prefetch and its PF_* constants to the module (prefetch_py.c). Returns 0, or
 * -1 with an exception set. */
int zp_prefetch_py_register(PyObject *module);

#endif /* ZP_BINDING_H */
