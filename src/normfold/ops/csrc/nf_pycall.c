/* A CPython extension that calls the kernel library's three entry points with fewer costs than
 * ctypes. ctypes converts each argument through a generic type table and builds a call frame with
 * libffi: about 2 us per call for nf_forward_simple's 12 arguments, more than the kernel itself at
 * decode sizes. Here each argument is one PyLong/PyFloat read (METH_FASTCALL: no argument tuple).
 *
 * It links nothing and includes no kernel header: `bind` receives the addresses of nf_forward,
 * nf_forward_simple and nf_backward from the already loaded kernel library (normfold/ops/pycall.py),
 * so this file only needs Python.h and is rebuilt only when the Python version changes.
 * The GIL is released around each kernel call, as ctypes does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef int (*nf_forward_t)(int, const void *, int64_t, const void *, int64_t, const void *, int, const void *,
                            int, void *, void *, float *, int64_t, int64_t, float, int, int);
typedef int (*nf_forward_simple_t)(int, const void *, const void *, int, const void *, int, void *, int64_t,
                                   int64_t, float, int, int);
typedef int (*nf_backward_t)(int, const void *, const void *, const void *, int64_t, const void *, int,
                             const float *, void *, float *, float *, int64_t, int64_t, int, int);

static nf_forward_t g_forward;
static nf_forward_simple_t g_forward_simple;
static nf_backward_t g_backward;

/* An address argument: an int (a data_ptr()) or None for NULL. */
static void *addr(PyObject *o) { return o == Py_None ? NULL : PyLong_AsVoidPtr(o); }
static long long i64(PyObject *o) { return PyLong_AsLongLong(o); }
static int i32(PyObject *o) { return (int)PyLong_AsLong(o); }

static int check(const char *name, Py_ssize_t got, Py_ssize_t want, const void *fn) {
    if (got != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, got);
        return -1;
    }
    if (!fn) {
        PyErr_Format(PyExc_RuntimeError, "%s: no kernel library bound (call bind first)", name);
        return -1;
    }
    return 0;
}

/* forward_simple(dtype, x, w, wdt, b, bdt, y, rows, n, eps, compressed, nthreads) -> int */
static PyObject *forward_simple(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    (void)self;
    if (check("forward_simple", na, 12, (const void *)g_forward_simple)) return NULL;
    const int dtype = i32(a[0]), wdt = i32(a[3]), bdt = i32(a[5]), nth = i32(a[11]);
    const void *x = addr(a[1]), *w = addr(a[2]), *b = addr(a[4]);
    void *y = addr(a[6]);
    const int64_t rows = i64(a[7]), n = i64(a[8]);
    const float eps = (float)PyFloat_AsDouble(a[9]);
    const int compressed = PyObject_IsTrue(a[10]);
    if (PyErr_Occurred()) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = g_forward_simple(dtype, x, w, wdt, b, bdt, y, rows, n, eps, compressed, nth);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

/* forward(dtype, x, xs, res, rst, w, wdt, b, bdt, y, s, rstd, rows, n, eps, compressed, nthreads) -> int */
static PyObject *forward(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    (void)self;
    if (check("forward", na, 17, (const void *)g_forward)) return NULL;
    const int dtype = i32(a[0]), wdt = i32(a[6]), bdt = i32(a[8]), nth = i32(a[16]);
    const void *x = addr(a[1]), *res = addr(a[3]), *w = addr(a[5]), *b = addr(a[7]);
    void *y = addr(a[9]), *s = addr(a[10]);
    float *rstd = (float *)addr(a[11]);
    const int64_t xs = i64(a[2]), rst = i64(a[4]), rows = i64(a[12]), n = i64(a[13]);
    const float eps = (float)PyFloat_AsDouble(a[14]);
    const int compressed = PyObject_IsTrue(a[15]);
    if (PyErr_Occurred()) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = g_forward(dtype, x, xs, res, rst, w, wdt, b, bdt, y, s, rstd, rows, n, eps, compressed, nth);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

/* backward(dtype, dy, ds, x, xs, w, wdt, rstd, dx, dw_part, db_part, rows, n, compressed, nthreads) -> int */
static PyObject *backward(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    (void)self;
    if (check("backward", na, 15, (const void *)g_backward)) return NULL;
    const int dtype = i32(a[0]), wdt = i32(a[6]), nth = i32(a[14]);
    const void *dy = addr(a[1]), *ds = addr(a[2]), *x = addr(a[3]), *w = addr(a[5]);
    const float *rstd = (const float *)addr(a[7]);
    void *dx = addr(a[8]);
    float *dw = (float *)addr(a[9]), *db = (float *)addr(a[10]);
    const int64_t xs = i64(a[4]), rows = i64(a[11]), n = i64(a[12]);
    const int compressed = PyObject_IsTrue(a[13]);
    if (PyErr_Occurred()) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = g_backward(dtype, dy, ds, x, xs, w, wdt, rstd, dx, dw, db, rows, n, compressed, nth);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

/* bind(forward_addr, forward_simple_addr, backward_addr): the kernel library's entry points. */
static PyObject *bind(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    (void)self;
    if (na != 3) {
        PyErr_Format(PyExc_TypeError, "bind takes 3 arguments (%zd given)", na);
        return NULL;
    }
    void *f = PyLong_AsVoidPtr(a[0]), *fs = PyLong_AsVoidPtr(a[1]), *bw = PyLong_AsVoidPtr(a[2]);
    if (PyErr_Occurred()) return NULL;
    if (!f || !fs || !bw) {
        PyErr_SetString(PyExc_ValueError, "bind: null kernel address");
        return NULL;
    }
    g_forward = (nf_forward_t)f;
    g_forward_simple = (nf_forward_simple_t)fs;
    g_backward = (nf_backward_t)bw;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL, "bind(forward, forward_simple, backward addresses)"},
    {"forward", (PyCFunction)(void (*)(void))forward, METH_FASTCALL, "nf_forward's 17 arguments -> rc"},
    {"forward_simple", (PyCFunction)(void (*)(void))forward_simple, METH_FASTCALL,
     "nf_forward_simple's 12 arguments -> rc"},
    {"backward", (PyCFunction)(void (*)(void))backward, METH_FASTCALL, "nf_backward's 15 arguments -> rc"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_nf_pycall", "normfold kernel call shim", -1, methods};

PyMODINIT_FUNC PyInit__nf_pycall(void) { return PyModule_Create(&module); }
