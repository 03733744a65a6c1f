/* pgoutput TupleData -> the column values, compiled: decoder._tuple's common case.

read(buf, pos, unchanged) reads the TupleData at pos into a list (str for a text value, None
for NULL, `unchanged` for an unchanged TOAST value) and returns it with the offset after it.
It returns None for anything else (a binary value, an unknown kind, a value past the end of
the buffer), and decoder._tuple reads the message again in Python to say what is wrong.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *read_tuple(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "read(buf: bytes, pos: int, unchanged)");
        return NULL;
    }
    const unsigned char *buf = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t len = PyBytes_GET_SIZE(args[0]);
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    if (pos == -1 && PyErr_Occurred())
        return NULL;
    if (pos < 0 || pos + 2 > len)
        Py_RETURN_NONE;
    Py_ssize_t ncols = (buf[pos] << 8) | buf[pos + 1];
    pos += 2;
    PyObject *values = PyList_New(ncols);
    if (values == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < ncols; i++) {
        if (pos >= len)
            goto fallback;
        PyObject *value;
        switch (buf[pos]) {
        case 't': {
            if (pos + 5 > len)
                goto fallback;
            Py_ssize_t n = ((Py_ssize_t)buf[pos + 1] << 24) | (buf[pos + 2] << 16) |
                           (buf[pos + 3] << 8) | buf[pos + 4];
            pos += 5;
            if (n > len - pos)
                goto fallback;
            value = PyUnicode_DecodeUTF8((const char *)buf + pos, n, NULL);
            if (value == NULL) {
                Py_DECREF(values);
                return NULL;
            }
            pos += n;
            break;
        }
        case 'n':
            value = Py_None;
            Py_INCREF(value);
            pos += 1;
            break;
        case 'u':
            value = args[2];
            Py_INCREF(value);
            pos += 1;
            break;
        default:
            goto fallback;
        }
        PyList_SET_ITEM(values, i, value);
    }
    PyObject *end = PyLong_FromSsize_t(pos);
    if (end == NULL) {
        Py_DECREF(values);
        return NULL;
    }
    PyObject *result = PyTuple_Pack(2, values, end);
    Py_DECREF(values);
    Py_DECREF(end);
    return result;
fallback:
    Py_DECREF(values);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"read", (PyCFunction)(void (*)(void))read_tuple, METH_FASTCALL,
     "read(buf, pos, unchanged) -> (values, end) or None: the TupleData at pos"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "services.bridge._tuples",
    .m_doc = "pgoutput TupleData decoding, compiled: the decoder's hot path",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__tuples(void) { return PyModule_Create(&module); }
