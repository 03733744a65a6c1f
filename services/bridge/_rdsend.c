/* Records straight into the librdkafka producer that a confluent-kafka Producer wraps.

   confluent-kafka's produce() costs about 0.6 us a record, as much as building the record:
   it parses its arguments by keyword, allocates a per-record state for its delivery
   callback and looks the topic up by name, every call. librdkafka's
   rd_kafka_produce_batch() takes a run of records for one topic in one call, at about
   0.27 us a record. sink.py sends through here the records with no headers for topics
   whose partitions are proven (sink.FirstWrites).

   What this relies on, and checks before it is used (bind):
   - confluent-kafka's Producer object starts with its rd_kafka_t pointer (its Handle struct,
     unchanged since 0.9), and that handle's opaque is the Producer itself (it sets it, to
     find itself in callbacks): bind refuses a pointer whose opaque is not the Producer;
   - the librdkafka functions are looked up in confluent-kafka's own extension module and
     what it links, so they are the very library that handle belongs to.
   A Sender holds the Producer, so the handle outlives it; nobody may close() that Producer
   while the Sender is in use. Records sent here carry no per-record state, so
   confluent-kafka's delivery callback skips them: a failed delivery among them is heard of
   when the transaction's commit fails (librdkafka fails the commit of a transaction with
   any failed delivery), and sink.UnnamedDeliveryFailure takes it from there. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>

/* librdkafka's public ABI (rdkafka.h), which is not installed with the wheel. */
typedef struct rd_kafka_s rd_kafka_t;
typedef struct rd_kafka_topic_s rd_kafka_topic_t;
typedef struct {
    int err;
    rd_kafka_topic_t *rkt;
    int32_t partition;
    void *payload;
    size_t len;
    void *key;
    size_t key_len;
    int64_t offset;
    void *_private;
} rd_kafka_message_t;
#define RD_KAFKA_PARTITION_UA (-1)
#define RD_KAFKA_MSG_F_COPY 0x2
#define RD_KAFKA_PRODUCER 0

static rd_kafka_topic_t *(*topic_new)(rd_kafka_t *, const char *, void *);
static void (*topic_destroy)(rd_kafka_topic_t *);
static int (*produce_batch)(rd_kafka_topic_t *, int32_t, int, rd_kafka_message_t *, int);
static void *(*opaque_of)(const rd_kafka_t *);
static int (*type_of)(const rd_kafka_t *);

/* The most records one produce_batch call takes (and the stack array holds). */
#define BATCH 256

typedef struct {
    PyObject_HEAD
    PyObject *producer; /* held, so the rd_kafka_t outlives this object */
    rd_kafka_t *rk;
    PyObject *topics; /* topic name -> capsule of its rd_kafka_topic_t */
} Sender;

/* What confluent-kafka's Handle struct starts with. */
typedef struct {
    PyObject_HEAD
    rd_kafka_t *rk;
} HandleHead;

static int load_symbols(const char *library) {
    void *lib = dlopen(library, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL) {
        PyErr_Format(PyExc_OSError, "%s is not loaded: %s", library, dlerror());
        return -1;
    }
    /* The module stays loaded as long as confluent-kafka does: no dlclose. */
    void *found[5] = {dlsym(lib, "rd_kafka_topic_new"), dlsym(lib, "rd_kafka_topic_destroy"),
                      dlsym(lib, "rd_kafka_produce_batch"), dlsym(lib, "rd_kafka_opaque"),
                      dlsym(lib, "rd_kafka_type")};
    for (int i = 0; i < 5; i++)
        if (found[i] == NULL) {
            PyErr_Format(PyExc_OSError, "librdkafka's functions are not visible from %s",
                         library);
            return -1;
        }
    /* All or none: bind() takes topic_new being set for all of them loaded. */
    *(void **)&topic_destroy = found[1];
    *(void **)&produce_batch = found[2];
    *(void **)&opaque_of = found[3];
    *(void **)&type_of = found[4];
    *(void **)&topic_new = found[0];
    return 0;
}

static PyTypeObject SenderType;

/* bind(library, producer) -> Sender: library is the path of confluent-kafka's extension
   module (confluent_kafka.cimpl.__file__), where the first successful call finds the
   librdkafka functions; a process has one confluent-kafka. */
static PyObject *bind(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    const char *library;
    if (nargs != 2 || !PyUnicode_Check(args[0]) ||
        (library = PyUnicode_AsUTF8(args[0])) == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "bind(library: str, producer: Producer)");
        return NULL;
    }
    PyObject *producer = args[1];
    if (strcmp(Py_TYPE(producer)->tp_name, "cimpl.Producer") != 0 ||
        Py_TYPE(producer)->tp_basicsize < (Py_ssize_t)sizeof(HandleHead)) {
        PyErr_Format(PyExc_TypeError, "not a confluent-kafka Producer: %s",
                     Py_TYPE(producer)->tp_name);
        return NULL;
    }
    if (topic_new == NULL && load_symbols(library) < 0)
        return NULL;
    rd_kafka_t *rk = ((HandleHead *)producer)->rk;
    if (rk == NULL || opaque_of(rk) != (void *)producer || type_of(rk) != RD_KAFKA_PRODUCER) {
        PyErr_SetString(PyExc_ValueError,
                        "the Producer's handle is not where this confluent-kafka version "
                        "was expected to keep it");
        return NULL;
    }
    Sender *self = PyObject_New(Sender, &SenderType);
    if (self == NULL)
        return NULL;
    self->topics = PyDict_New();
    if (self->topics == NULL) {
        self->producer = NULL;
        Py_DECREF(self);
        return NULL;
    }
    Py_INCREF(producer);
    self->producer = producer;
    self->rk = rk;
    return (PyObject *)self;
}

static void drop_topic(PyObject *capsule) {
    topic_destroy(PyCapsule_GetPointer(capsule, "rd_kafka_topic_t"));
}

static void Sender_dealloc(Sender *self) {
    /* Topic handles first: they must go before the rd_kafka_t they belong to. */
    Py_XDECREF(self->topics);
    Py_XDECREF(self->producer);
    PyObject_Free(self);
}

static rd_kafka_topic_t *topic_of(Sender *self, PyObject *topic) {
    PyObject *capsule = PyDict_GetItemWithError(self->topics, topic);
    if (capsule != NULL)
        return PyCapsule_GetPointer(capsule, "rd_kafka_topic_t");
    if (PyErr_Occurred())
        return NULL;
    const char *name = PyUnicode_AsUTF8(topic);
    if (name == NULL)
        return NULL;
    rd_kafka_topic_t *rkt = topic_new(self->rk, name, NULL);
    if (rkt == NULL) {
        PyErr_Format(PyExc_ValueError, "librdkafka refused topic %R", topic);
        return NULL;
    }
    capsule = PyCapsule_New(rkt, "rd_kafka_topic_t", drop_topic);
    if (capsule == NULL) {
        topic_destroy(rkt);
        return NULL;
    }
    int failed = PyDict_SetItem(self->topics, topic, capsule);
    Py_DECREF(capsule);
    return failed ? NULL : rkt;
}

/* The record as a message for this path in msg, or 0 if it is not one: a 4-tuple
   (topic, key, value, None) of a str and bytes-or-None. */
static int as_message(PyObject *record, rd_kafka_message_t *msg) {
    if (!PyTuple_CheckExact(record) || PyTuple_GET_SIZE(record) != 4 ||
        PyTuple_GET_ITEM(record, 3) != Py_None ||
        !PyUnicode_CheckExact(PyTuple_GET_ITEM(record, 0)))
        return 0;
    PyObject *key = PyTuple_GET_ITEM(record, 1), *value = PyTuple_GET_ITEM(record, 2);
    if ((key != Py_None && !PyBytes_CheckExact(key)) ||
        (value != Py_None && !PyBytes_CheckExact(value)))
        return 0;
    memset(msg, 0, sizeof(*msg));
    if (key != Py_None) {
        msg->key = PyBytes_AS_STRING(key);
        msg->key_len = (size_t)PyBytes_GET_SIZE(key);
    }
    if (value != Py_None) {
        msg->payload = PyBytes_AS_STRING(value);
        msg->len = (size_t)PyBytes_GET_SIZE(value);
    }
    return 1;
}

/* send(records, start, settled) -> (end, err): hands librdkafka the records of the list
   from start on, in order, and stops at the first it does not take: end is its index
   (len(records) when it took them all) and err why: 0 when the record is not for this path
   (headers, or a topic not in settled), else librdkafka's error code (-184, QUEUE_FULL, when
   its queue is full). Records before end are queued; after a refusal other than a full
   queue, some after it may be too, so the caller must abort the transaction then. */
static PyObject *Sender_send(Sender *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_CheckExact(args[0]) || !PyAnySet_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "send(records: list, start: int, settled: set[str])");
        return NULL;
    }
    PyObject *records = args[0], *settled = args[2];
    Py_ssize_t count = PyList_GET_SIZE(records);
    Py_ssize_t i = PyLong_AsSsize_t(args[1]);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    if (i < 0 || i > count) {
        PyErr_SetString(PyExc_ValueError, "start outside records");
        return NULL;
    }
    rd_kafka_message_t batch[BATCH];
    while (i < count && as_message(PyList_GET_ITEM(records, i), &batch[0])) {
        PyObject *topic = PyTuple_GET_ITEM(PyList_GET_ITEM(records, i), 0);
        /* The run of records for this topic that follows, each of them for this path. */
        int n = 1;
        while (i + n < count && n < BATCH &&
               as_message(PyList_GET_ITEM(records, i + n), &batch[n])) {
            PyObject *next = PyTuple_GET_ITEM(PyList_GET_ITEM(records, i + n), 0);
            if (next != topic && PyUnicode_Compare(next, topic) != 0)
                break;
            n++;
        }
        int known = PySet_Contains(settled, topic);
        if (known < 0)
            return NULL;
        if (!known)
            break;
        rd_kafka_topic_t *rkt = topic_of(self, topic);
        if (rkt == NULL)
            return NULL;
        int taken = produce_batch(rkt, RD_KAFKA_PARTITION_UA, RD_KAFKA_MSG_F_COPY, batch, n);
        if (taken < n) {
            for (int j = 0; j < n; j++)
                if (batch[j].err)
                    return Py_BuildValue("(ni)", i + j, batch[j].err);
        }
        i += n;
    }
    return Py_BuildValue("(ni)", i, 0);
}

static PyMethodDef Sender_methods[] = {
    {"send", (PyCFunction)(void (*)(void))Sender_send, METH_FASTCALL,
     "send(records, start, settled) -> (end, err): queue records[start:] in librdkafka, up "
     "to the first it does not take"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SenderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "services.bridge._rdsend.Sender",
    .tp_basicsize = sizeof(Sender),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Sender_dealloc,
    .tp_methods = Sender_methods,
    .tp_doc = "Sends records through a confluent-kafka Producer's librdkafka handle.",
};

static PyMethodDef methods[] = {
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(library, producer) -> Sender, for the Producer's own librdkafka handle"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "services.bridge._rdsend",
    .m_doc = "Records straight into a confluent-kafka Producer's librdkafka handle.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__rdsend(void) {
    if (PyType_Ready(&SenderType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddObjectRef(m, "Sender", (PyObject *)&SenderType) < 0)
        Py_CLEAR(m);
    return m;
}
