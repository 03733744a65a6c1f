/* Spool file records, split in one call: the read side of spool.py's file format,
   "<u64 lsn><u32 length><payload>" big-endian, which a big transaction's publication reads
   a million times over. spool._split_python is the same function in Python, and the
   fallback where this is not compiled. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define HEADER 12

/* split(buf, pos) -> (records, end): the (lsn, payload) of every whole record in buf from
   pos, and where the first record not wholly in buf starts. */
static PyObject *split(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "split(buf: bytes, pos: int)");
        return NULL;
    }
    const unsigned char *buf = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t held = PyBytes_GET_SIZE(args[0]);
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    if (pos == -1 && PyErr_Occurred())
        return NULL;
    if (pos < 0 || pos > held) {
        PyErr_SetString(PyExc_ValueError, "pos outside buf");
        return NULL;
    }
    PyObject *records = PyList_New(0);
    if (records == NULL)
        return NULL;
    while (held - pos >= HEADER) {
        const unsigned char *h = buf + pos;
        unsigned long long lsn = 0;
        for (int i = 0; i < 8; i++)
            lsn = (lsn << 8) | h[i];
        Py_ssize_t length =
            ((Py_ssize_t)h[8] << 24) | ((Py_ssize_t)h[9] << 16) | (h[10] << 8) | h[11];
        if (length > held - pos - HEADER)
            break;
        PyObject *record = Py_BuildValue("(Ky#)", lsn, (const char *)h + HEADER, length);
        if (record == NULL || PyList_Append(records, record) < 0) {
            Py_XDECREF(record);
            Py_DECREF(records);
            return NULL;
        }
        Py_DECREF(record);
        pos += HEADER + length;
    }
    return Py_BuildValue("(Nn)", records, pos);
}

static PyMethodDef methods[] = {
    {"split", (PyCFunction)(void (*)(void))split, METH_FASTCALL,
     "split(buf, pos) -> (records, end): the (lsn, payload) of each whole spool record in buf "
     "from pos, and where the first one not wholly in buf starts"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "services.bridge.assemble._spoolread",
    .m_doc = "Spool file records, split in one call",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__spoolread(void) { return PyModule_Create(&module); }
