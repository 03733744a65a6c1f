/* Whole regular transactions read off the replication stream in one call.

   Most of a busy source's stream is regular transactions of a few row changes each: Begin,
   Insert/Update/Delete..., Commit. Reading them one CopyData message at a time in Python
   (the stream's framing, the decoder's Begin and Commit, the assembler's spool) cost the
   socket thread 1.7-3.5 us a message (bench/profile_receiver.py). read() does the same for
   such transactions in C and hands each one back sealed, as the spool's (lsn, payload)
   entries; every other message it hands back as stream.next_message frames it, for the Python
   path (the reference: ReplicationConnection.next_message, Assembler.feed).

   A transaction still open when the buffered messages run out is returned as it stands
   (``partial``), for the next call to go on with; one that meets anything but a row change
   before its Commit (a relation, a keepalive, a change over max_change, more than the
   spool's memory) is handed to the assembler as opened with the changes so far
   (Assembler.opened), and the assembler takes it from there. So read() may only be called
   between the assembler's transactions (Assembler.between_transactions). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* What stopped a read (the second element of its result). */
enum { DRAINED = 0, STOPPED = 1, ENDED = 2, FULL = 3 };

#define XLOGDATA_HEADER 25 /* 'w', dataStart, walEnd, sendTime */
#define KEEPALIVE_SIZE 18  /* 'k', walEnd, sendTime, replyRequested */
#define BEGIN_SIZE 21      /* 'B', final LSN, commit time, xid */
#define COMMIT_SIZE 26     /* 'C', flags, commit LSN, end LSN, commit time */

static uint64_t be64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = (v << 8) | p[i];
    return v;
}

static uint32_t be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

/* The frames' kinds and a sealed transaction's tag, made once. */
static PyObject *KIND_W, *KIND_K, *SEALED, *OPENED;

/* A new tuple of n references stolen from items (NULL if any is NULL). */
static PyObject *tuple_of(Py_ssize_t n, PyObject **items) {
    PyObject *t = NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (items[i] == NULL)
            goto fail;
    t = PyTuple_New(n);
    if (t == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SET_ITEM(t, i, items[i]);
    return t;
fail:
    for (Py_ssize_t i = 0; i < n; i++)
        Py_XDECREF(items[i]);
    return NULL;
}

/* The transaction being read: its xid and its changes so far. */
typedef struct {
    int open;
    uint32_t xid;
    PyObject *entries; /* [(lsn, payload)], as Spool keeps them */
    Py_ssize_t memory;
} Open;

static void open_clear(Open *t) {
    Py_CLEAR(t->entries);
    t->open = 0;
    t->memory = 0;
}

static int append_new(PyObject *list, PyObject *item) {
    if (item == NULL)
        return -1;
    int rc = PyList_Append(list, item);
    Py_DECREF(item);
    return rc;
}

/* The open transaction onto items as ("B", xid, entries, memory), for the assembler to
   go on with (Assembler.opened): it met a message this reader leaves to it. */
static int hand_back(Open *t, PyObject *items) {
    if (!t->open)
        return 0;
    if (append_new(items, Py_BuildValue("(OkOn)", OPENED, (unsigned long)t->xid, t->entries,
                                        t->memory)) < 0)
        return -1;
    open_clear(t);
    return 0;
}

/* One CopyData message: its bytes, and the object they belong to. */
typedef struct {
    Py_buffer view;
    PyObject *result;
} Frame;

/* get_copy_data(1): 1 with a frame, 0 when libpq holds no whole message, -1 at the end of
   the stream, -2 with an exception set. */
static int next_frame(PyObject *get_copy_data, PyObject *async_flag, Frame *f) {
    f->result = PyObject_CallOneArg(get_copy_data, async_flag);
    if (f->result == NULL)
        return -2;
    if (!PyTuple_Check(f->result) || PyTuple_GET_SIZE(f->result) != 2) {
        PyErr_SetString(PyExc_TypeError, "get_copy_data must return (nbytes, data)");
        Py_CLEAR(f->result);
        return -2;
    }
    Py_ssize_t nbytes = PyLong_AsSsize_t(PyTuple_GET_ITEM(f->result, 0));
    if (nbytes == -1 && PyErr_Occurred()) {
        Py_CLEAR(f->result);
        return -2;
    }
    if (nbytes <= 0) {
        Py_CLEAR(f->result);
        return nbytes == 0 ? 0 : -1;
    }
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(f->result, 1), &f->view, PyBUF_SIMPLE) < 0) {
        Py_CLEAR(f->result);
        return -2;
    }
    return 1;
}

static void frame_release(Frame *f) {
    PyBuffer_Release(&f->view);
    Py_CLEAR(f->result);
}

/* The frame as stream.next_message gives it ('w' and 'k'), for the Python path. */
static PyObject *frame_tuple(const unsigned char *p, Py_ssize_t n) {
    if (p[0] == 'w')
        return Py_BuildValue("(OKKy#)", KIND_W, (unsigned long long)be64(p + 1),
                             (unsigned long long)be64(p + 9), (const char *)p + XLOGDATA_HEADER,
                             n - XLOGDATA_HEADER);
    return Py_BuildValue("(OKiO)", KIND_K, (unsigned long long)be64(p + 1), 0,
                         p[17] ? Py_True : Py_False);
}

/* The open transaction as read() returns it, (xid, entries, memory), or None. */
static PyObject *partial_of(Open *t) {
    if (!t->open)
        Py_RETURN_NONE;
    PyObject *partial = Py_BuildValue("(kOn)", (unsigned long)t->xid, t->entries, t->memory);
    if (partial != NULL)
        open_clear(t);
    return partial;
}

/* Go on with a transaction a previous read() returned open. */
static int resume(Open *t, PyObject *partial) {
    unsigned long xid;
    PyObject *entries;
    if (!PyArg_ParseTuple(partial, "kO!n", &xid, &PyList_Type, &entries, &t->memory))
        return -1;
    t->xid = (uint32_t)xid;
    Py_INCREF(entries);
    t->entries = entries;
    t->open = 1;
    return 0;
}

/* What a read takes: the spool's memory limit, the largest change spooled as it is (-1:
   any), and the sealed transactions' bytes after which it returns. */
typedef struct {
    Py_ssize_t memory_limit, max_change, max_bytes;
} Limits;

/* How far a read got: the highest WAL end, and the sealed transactions' bytes. */
typedef struct {
    unsigned long long received;
    Py_ssize_t sealed_bytes;
} Progress;

/* One frame into the open transaction t, or sealed onto items: 1 when taken (or skipped,
   as stream.next_message skips frames it does not know), 0 when it is the Python path's, -1
   on error (a frame too short for its kind: stream.next_message fails on it too). */
static int take(Open *t, const unsigned char *p, Py_ssize_t n, const Limits *limits,
                PyObject *items, Progress *read) {
    if (p[0] != 'w' && p[0] != 'k')
        return 1;
    if (n < (p[0] == 'w' ? XLOGDATA_HEADER : KEEPALIVE_SIZE)) {
        PyErr_Format(PyExc_ValueError, "replication stream: a '%c' message of %zd bytes", p[0],
                     n);
        return -1;
    }
    if (p[0] == 'k') {
        if (be64(p + 1) > read->received)
            read->received = be64(p + 1);
        return 0; /* the daemon answers a keepalive before it reads on */
    }
    unsigned long long start = be64(p + 1), end = be64(p + 9);
    if (end > read->received)
        read->received = end;
    const unsigned char *m = p + XLOGDATA_HEADER;
    Py_ssize_t size = n - XLOGDATA_HEADER;
    if (size == 0)
        return 0;
    if (!t->open && m[0] == 'B' && size == BEGIN_SIZE) {
        t->entries = PyList_New(0);
        if (t->entries == NULL)
            return -1;
        t->open = 1;
        t->xid = be32(m + 17);
        return 1;
    }
    if (t->open && (m[0] == 'I' || m[0] == 'U' || m[0] == 'D') &&
        (limits->max_change < 0 || size <= limits->max_change) &&
        t->memory + size <= limits->memory_limit) {
        PyObject *entry[2] = {PyLong_FromUnsignedLongLong(start),
                              PyBytes_FromStringAndSize((const char *)m, size)};
        PyObject *pair = tuple_of(2, entry);
        /* An int and bytes make no cycle: the collector need not see the pair. Tracked,
           every pair of a backlog was walked by the young collections (the collector's own
           time, services/common/collector.py). */
        if (pair != NULL)
            PyObject_GC_UnTrack(pair);
        if (append_new(t->entries, pair) < 0)
            return -1;
        t->memory += size;
        return 1;
    }
    if (t->open && m[0] == 'C' && size == COMMIT_SIZE) {
        Py_INCREF(SEALED);
        PyObject *fields[7] = {SEALED,
                               PyLong_FromUnsignedLong(t->xid),
                               PyLong_FromUnsignedLongLong(be64(m + 2)),
                               PyLong_FromUnsignedLongLong(be64(m + 10)),
                               PyLong_FromLongLong((long long)be64(m + 18)),
                               t->entries,
                               PyLong_FromSsize_t(t->memory)};
        t->entries = NULL; /* the sealed tuple holds it now */
        read->sealed_bytes += t->memory;
        open_clear(t);
        return append_new(items, tuple_of(7, fields)) < 0 ? -1 : 1;
    }
    return 0;
}

/* read(get_copy_data, memory_limit, max_change, max_bytes, partial)
       -> (items, state, received, partial) */
static PyObject *read_runs(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "read(get_copy_data, memory_limit, max_change, max_bytes, partial)");
        return NULL;
    }
    PyObject *get_copy_data = args[0];
    Limits limits = {PyLong_AsSsize_t(args[1]), PyLong_AsSsize_t(args[2]),
                     PyLong_AsSsize_t(args[3])};
    if (PyErr_Occurred())
        return NULL;
    PyObject *async_flag = PyLong_FromLong(1);
    PyObject *items = PyList_New(0);
    if (async_flag == NULL || items == NULL) {
        Py_XDECREF(async_flag);
        Py_XDECREF(items);
        return NULL;
    }
    Open t = {0};
    if (args[4] != Py_None && resume(&t, args[4]) < 0) {
        Py_DECREF(async_flag);
        Py_DECREF(items);
        return NULL;
    }
    Progress read = {0, 0};
    int state = DRAINED;
    Frame f;
    for (;;) {
        int got = next_frame(get_copy_data, async_flag, &f);
        if (got == -2)
            goto error;
        if (got <= 0) {
            state = got == 0 ? DRAINED : ENDED;
            break;
        }
        int taken = take(&t, f.view.buf, f.view.len, &limits, items, &read);
        /* Anything else goes to the Python path, after the transaction it interrupts. */
        if (taken == 0 &&
            (hand_back(&t, items) < 0 || append_new(items, frame_tuple(f.view.buf, f.view.len)) < 0))
            taken = -1;
        frame_release(&f);
        if (taken < 0)
            goto error;
        if (taken == 0) {
            state = STOPPED;
            break;
        }
        if (!t.open && read.sealed_bytes >= limits.max_bytes) {
            state = FULL;
            break;
        }
    }
    /* Buffered messages ran out inside a transaction: the next call goes on with it. At
       the stream's end nobody will: the assembler holds it open, as after a message. */
    PyObject *partial = NULL;
    if (state == DRAINED)
        partial = partial_of(&t);
    else if (hand_back(&t, items) == 0) {
        partial = Py_None;
        Py_INCREF(partial);
    }
    if (partial == NULL)
        goto error;
    Py_DECREF(async_flag);
    return Py_BuildValue("(NiKN)", items, state, read.received, partial);
error:
    open_clear(&t);
    Py_DECREF(async_flag);
    Py_DECREF(items);
    return NULL;
}

static PyMethodDef methods[] = {
    {"read", (PyCFunction)(void (*)(void))read_runs, METH_FASTCALL,
     "read(get_copy_data, memory_limit, max_change, max_bytes, partial) -> (items, state, "
     "received, partial): what libpq holds of the replication stream, regular transactions "
     "sealed"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "services.bridge.decode._runs",
    .m_doc = "Whole regular transactions read off the replication stream in one call",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__runs(void) {
    KIND_W = PyUnicode_InternFromString("w");
    KIND_K = PyUnicode_InternFromString("k");
    SEALED = PyUnicode_InternFromString("T");
    OPENED = PyUnicode_InternFromString("B");
    if (KIND_W == NULL || KIND_K == NULL || SEALED == NULL || OPENED == NULL)
        return NULL;
    return PyModule_Create(&module);
}
