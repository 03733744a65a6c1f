/* pgoutput TupleData read in place, for both extensions: _tuples.c turns it into the
   decoder's list, _rowjson.c (RowPlan.records) straight into records. Whatever these do not
   read (a binary value, an unknown kind, a value past the end) the Python decoder reads,
   and says what is wrong. */
#ifndef SLOTBRIDGE_TUPLEDATA_H
#define SLOTBRIDGE_TUPLEDATA_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef struct {
    const unsigned char *buf;
    Py_ssize_t len, pos;
} TupleData;

/* td from a call's (buf: bytes, pos: int, ...) arguments, of which there must be nargs_wanted;
   -1 with an exception set (usage, for a TypeError) if they are not so. */
static inline int tupledata_open(TupleData *td, PyObject *const *args, Py_ssize_t nargs,
                          Py_ssize_t nargs_wanted, const char *usage) {
    if (nargs != nargs_wanted || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    td->buf = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    td->len = PyBytes_GET_SIZE(args[0]);
    td->pos = PyLong_AsSsize_t(args[1]);
    return td->pos == -1 && PyErr_Occurred() ? -1 : 0;
}

/* The column count at the start; -1 when the buffer has no room for it. */
static inline Py_ssize_t tupledata_count(TupleData *td) {
    if (td->pos < 0 || td->pos + 2 > td->len)
        return -1;
    Py_ssize_t ncols = (td->buf[td->pos] << 8) | td->buf[td->pos + 1];
    td->pos += 2;
    return ncols;
}

/* The next column's kind, and past it: 't' (its text in *s, *n), 'n' (NULL) or 'u' (an
   unchanged TOAST value); 0 for anything else. */
static inline int tupledata_next(TupleData *td, const char **s, Py_ssize_t *n) {
    const unsigned char *buf = td->buf;
    Py_ssize_t pos = td->pos;
    if (pos >= td->len)
        return 0;
    switch (buf[pos]) {
    case 'n':
    case 'u':
        td->pos = pos + 1;
        return buf[pos];
    case 't':
        if (pos + 5 > td->len)
            return 0;
        *n = ((Py_ssize_t)buf[pos + 1] << 24) | (buf[pos + 2] << 16) | (buf[pos + 3] << 8) |
             buf[pos + 4];
        if (*n > td->len - pos - 5)
            return 0;
        *s = (const char *)buf + pos + 5;
        td->pos = pos + 5 + *n;
        return 't';
    }
    return 0;
}

#endif
