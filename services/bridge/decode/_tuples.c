/* pgoutput TupleData -> the column values, compiled: decoder._tuple's common case.

read(buf, pos, unchanged) reads the TupleData at pos into a list (str for a text value, None
for NULL, `unchanged` for an unchanged TOAST value) and returns it with the offset after it.
It returns None for anything else (see _tupledata.h), and decoder._tuple reads the message
again in Python to say what is wrong.
*/
#include "_tupledata.h"

static PyObject *read_tuple(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    TupleData td;
    if (tupledata_open(&td, args, nargs, 3, "read(buf: bytes, pos: int, unchanged)") < 0)
        return NULL;
    Py_ssize_t ncols = tupledata_count(&td);
    if (ncols < 0)
        Py_RETURN_NONE;
    PyObject *values = PyList_New(ncols);
    if (values == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < ncols; i++) {
        const char *s;
        Py_ssize_t n;
        PyObject *value;
        switch (tupledata_next(&td, &s, &n)) {
        case 't':
            value = PyUnicode_DecodeUTF8(s, n, NULL);
            if (value == NULL) {
                Py_DECREF(values);
                return NULL;
            }
            break;
        case 'n':
            value = Py_None;
            Py_INCREF(value);
            break;
        case 'u':
            value = args[2];
            Py_INCREF(value);
            break;
        default:
            Py_DECREF(values);
            Py_RETURN_NONE;
        }
        PyList_SET_ITEM(values, i, value);
    }
    PyObject *end = PyLong_FromSsize_t(td.pos);
    if (end == NULL) {
        Py_DECREF(values);
        return NULL;
    }
    PyObject *result = PyTuple_Pack(2, values, end);
    Py_DECREF(values);
    Py_DECREF(end);
    return result;
}

static PyMethodDef methods[] = {
    {"read", (PyCFunction)(void (*)(void))read_tuple, METH_FASTCALL,
     "read(buf, pos, unchanged) -> (values, end) or None: the TupleData at pos"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "services.bridge.decode._tuples",
    .m_doc = "pgoutput TupleData decoding, compiled: the decoder's hot path",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__tuples(void) { return PyModule_Create(&module); }
