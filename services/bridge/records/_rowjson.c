/* A row's text values -> its JSON object and key object, in one pass without dicts.

The hot path of the default record format (see catalog.row_plan): the values come as the
snapshot reader gives them (a list or tuple of str or None), or as the stream's pgoutput
TupleData, read in place (records: no str per column), and the output
must be byte for byte what orjson.dumps({name: converter(text)}) writes, which
tests/unit/test_rowjson.py holds it to. Each column has a kind saying how its text becomes
JSON; the common kinds are handled here, any text a kind does not recognise goes to the
column's Python converter (which also raises the converter's errors), as do the rare types.
*/
#include "_hmac.h"
#include "_tupledata.h"
#include <stdint.h>
#include <string.h>

/* Column kinds, as catalog.row_plan spells them in its kinds bytes. */
#define K_INT 'i'         /* integer text: a JSON number as printed */
#define K_TEXT 's'        /* a JSON string of the text */
#define K_BOOL 'b'        /* t / f */
#define K_TIMESTAMP 't'   /* the first blank becomes a T */
#define K_TIMESTAMPTZ 'z' /* ... and a +00 offset becomes a Z */
#define K_PYTHON 'p'      /* the converter, then dumps */
#define K_JSON 'j'        /* json/jsonb text, written as it is (a JSON null: see json_null) */
#define K_DROPPED 'x'     /* left out of the row (a transform drops it; never a key column) */
#define K_HASH_HEX 'h'    /* the hash transform: HMAC-SHA-256 of the text, in hex */
#define K_HASH_BASE64 'H' /* ... in base64 */
#define K_BYTEA 'B'       /* bytea printed as hex (\x...): its bytes in base64 */
#define K_FLOAT 'f'       /* float4/float8 in fixed notation: its digits as orjson writes them */
#define K_ARRAY 'a'       /* a one-dimensional array; its param is its elements' kind */
/* Kafka Connect's encodings of the Debezium format (connect_values.py); a column's param
   is the scale or the fraction digits its type modifier gives. */
#define K_DECIMAL 'D'          /* numeric(p, s): Connect Decimal, the value at param digits */
#define K_VARIABLE_DECIMAL 'V' /* numeric: VariableScaleDecimal {"scale":..,"value":..} */
#define K_ZONED_TIMESTAMP 'Z'  /* timestamptz: ISO 8601 in UTC with param fraction digits */
#define K_MICRO_TIMESTAMP 'M'  /* timestamp: microseconds since the epoch */
#define K_MILLI_TIMESTAMP 'm'  /* ... milliseconds */
#define K_DATE 'd'             /* date: days since the epoch */
#define K_MICRO_TIME 'U'       /* time: microseconds of the day */
#define K_MILLI_TIME 'u'       /* ... milliseconds */

typedef struct {
    char *data;
    Py_ssize_t len, cap;
    char small[2048];
} Buf;

static int buf_grow(Buf *b, Py_ssize_t more) {
    Py_ssize_t need = b->len + more;
    if (need <= b->cap)
        return 0;
    Py_ssize_t cap = b->cap * 2 > need ? b->cap * 2 : need;
    char *data;
    if (b->data == b->small) {
        data = PyMem_Malloc(cap);
        if (data != NULL)
            memcpy(data, b->small, b->len);
    } else {
        data = PyMem_Realloc(b->data, cap);
    }
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static inline int buf_put(Buf *b, const char *s, Py_ssize_t n) {
    if (b->len + n > b->cap && buf_grow(b, n) < 0)
        return -1;
    memcpy(b->data + b->len, s, n);
    b->len += n;
    return 0;
}

static inline int buf_byte(Buf *b, char c) {
    if (b->len + 1 > b->cap && buf_grow(b, 1) < 0)
        return -1;
    b->data[b->len++] = c;
    return 0;
}

static void buf_free(Buf *b) {
    if (b->data != b->small)
        PyMem_Free(b->data);
}

static const char HEX[] = "0123456789abcdef";

/* Text is scanned eight bytes at a time: nearly every byte of a long text needs nothing done
   to it, and a byte at a time such a text was half of a wide change's cost to the publisher
   (a 40-column row with 6 kB of text: 6.4 us a change in `bench/profile_publisher.py
   --workload wide`, 3.2 us eight at a time). memcpy is the portable unaligned load (the
   compiler makes it one load). */
#define BYTES_1 0x0101010101010101ULL
#define BYTES_80 0x8080808080808080ULL

static inline uint64_t load8(const char *s) {
    uint64_t word;
    memcpy(&word, s, 8);
    return word;
}

/* Whether a byte of word is below n (n <= 0x80). Exact as a yes or no: a byte at or above n
   borrows nothing, so the lowest byte flagged is a byte below n. */
static inline uint64_t byte_below(uint64_t word, unsigned n) {
    return (word - BYTES_1 * n) & ~word & BYTES_80;
}

/* Whether a byte of word is c. */
static inline uint64_t byte_is(uint64_t word, unsigned char c) {
    return byte_below(word ^ (BYTES_1 * c), 1);
}

/* Whether all of s[0:n] is ASCII. */
static int all_ascii(const char *s, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8)
        if (load8(s + i) & BYTES_80)
            return 0;
    for (; i < n; i++)
        if (s[i] & 0x80)
            return 0;
    return 1;
}

/* How many bytes from the start of s[0:n], in whole words, JSON takes as they are (no ", \
   or control character). */
static Py_ssize_t plain_words(const char *s, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t word = load8(s + i);
        if (byte_below(word, 0x20) | byte_is(word, '"') | byte_is(word, '\\'))
            break;
    }
    return i;
}

/* A JSON string of s[0:n] as orjson escapes it: ", \ and control characters only. With
   `t_for_blank`, the first blank is written as T; `suffix` is appended inside the quotes. */
static int put_string(Buf *b, const char *s, Py_ssize_t n, int t_for_blank, const char *suffix) {
    /* At most six bytes per input byte, plus quotes and suffix. */
    if (buf_grow(b, 6 * n + 8) < 0)
        return -1;
    char *out = b->data + b->len;
    *out++ = '"';
    for (Py_ssize_t i = 0; i < n;) {
        /* Whole plain words at once, then the word that stopped them a byte at a time (in a
           timestamp, whose first blank becomes T, one byte at a time up to that blank). */
        Py_ssize_t end = i + 1;
        if (!t_for_blank) {
            Py_ssize_t plain = plain_words(s + i, n - i);
            memcpy(out, s + i, plain);
            out += plain;
            i += plain;
            end = n - i > 8 ? i + 8 : n;
        }
        for (; i < end; i++) {
            unsigned char c = (unsigned char)s[i];
            if (c >= 0x20 && c != '"' && c != '\\') {
                if (c == ' ' && t_for_blank) {
                    c = 'T';
                    t_for_blank = 0;
                }
                *out++ = (char)c;
                continue;
            }
            *out++ = '\\';
            switch (c) {
            case '"': *out++ = '"'; break;
            case '\\': *out++ = '\\'; break;
            case '\b': *out++ = 'b'; break;
            case '\t': *out++ = 't'; break;
            case '\n': *out++ = 'n'; break;
            case '\f': *out++ = 'f'; break;
            case '\r': *out++ = 'r'; break;
            default:
                *out++ = 'u';
                *out++ = '0';
                *out++ = '0';
                *out++ = HEX[c >> 4];
                *out++ = HEX[c & 15];
            }
        }
    }
    while (*suffix)
        *out++ = *suffix++;
    *out++ = '"';
    b->len = out - b->data;
    return 0;
}

/* A float in fixed notation (-?D+(.D+)?) as orjson writes the double it reads as: the same
   digits, ".0" after an integer. Only texts that are the shortest decimal of their double,
   whatever printed them: no leading zero, no zero ending the fraction, at most 15
   significant digits (a double keeps 15: no shorter decimal reads as the same double), and
   from 1e-4 to below 1e15, where both PostgreSQL and orjson print fixed notation. Anything
   else (exponents, NaN, Infinity, 16 or 17 digits) goes to the converter: 0. */
static int put_float(Buf *b, const char *s, Py_ssize_t n) {
    Py_ssize_t i = (n > 0 && s[0] == '-') ? 1 : 0, start = i;
    for (; i < n && s[i] >= '0' && s[i] <= '9'; i++)
        ;
    Py_ssize_t whole = i - start, fraction = 0, zeros = 0;
    if (whole == 0 || whole > 15 || (whole > 1 && s[start] == '0'))
        return 0;
    if (i < n) {
        if (s[i] != '.' || i + 1 == n || s[n - 1] == '0')
            return 0;
        for (Py_ssize_t j = i + 1; j < n; j++)
            if (s[j] < '0' || s[j] > '9')
                return 0;
        fraction = n - i - 1;
        if (whole == 1 && s[start] == '0') /* 0.000123: the zeros after the point lead */
            for (whole = 0; s[i + 1 + zeros] == '0'; zeros++)
                ;
        if (zeros > 3 || whole + fraction - zeros > 15)
            return 0;
    }
    if (buf_put(b, s, n) < 0)
        return -1;
    return (i == n && buf_put(b, ".0", 2) < 0) ? -1 : 1;
}

/* Integer text as PostgreSQL prints it: 0 or -?[1-9][0-9]*. Anything else goes to int(). */
static int canonical_integer(const char *s, Py_ssize_t n) {
    Py_ssize_t i = (n > 0 && s[0] == '-') ? 1 : 0;
    if (i == n || (s[i] == '0' && n > 1))
        return 0;
    for (; i < n; i++)
        if (s[i] < '0' || s[i] > '9')
            return 0;
    return 1;
}

typedef struct {
    PyObject_HEAD
    Py_ssize_t ncols, nkeys;
    char *kinds;
    const char **names; /* '"name":' per column */
    Py_ssize_t *name_lens;
    Py_ssize_t *key_idx;
    PyObject *holder;     /* the tuple that owns the names' bytes and the kinds */
    PyObject *key_head, *key_tail; /* bytes written around the key object */
    PyObject *placeholders; /* per column, the JSON of an unchanged TOAST value; or NULL */
    int whole_old_key; /* an old key tuple's row is every column (the others null) */
    PyObject *converters; /* tuple of callables */
    PyObject *dumps;
    HmacKey hash_key; /* of the hash kinds, when has_hash_key */
    int has_hash_key;
    int *params; /* per column, the scale or fraction digits of the Connect kinds */
} RowPlan;

static void plan_dealloc(RowPlan *self) {
    PyMem_Free(self->kinds);
    PyMem_Free(self->names);
    PyMem_Free(self->name_lens);
    PyMem_Free(self->key_idx);
    PyMem_Free(self->params);
    Py_XDECREF(self->holder);
    Py_XDECREF(self->key_head);
    Py_XDECREF(self->placeholders);
    Py_XDECREF(self->key_tail);
    Py_XDECREF(self->converters);
    Py_XDECREF(self->dumps);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* RowPlan(names: tuple[bytes], kinds: bytes, key_idx: tuple[int], converters, dumps,
   key_head=b"", key_tail=b"", whole_old_key=False, placeholders=None): names are the
   columns' '"name":' pieces; the key object is written between key_head and key_tail; with
   whole_old_key, a delete's old key tuple is written with every column (pgoutput sends the
   others as nulls), else with its key columns alone; placeholders, a tuple of bytes per
   column, is the JSON written for an unchanged TOAST value (without it such a row is left
   to the caller); hash_key, the key of the columns of the hash kinds (without it their
   converters are called); params, a tuple of ints per column, the scale or fraction digits
   of the Connect kinds (0 without it). */
static int plan_init(RowPlan *self, PyObject *args, PyObject *kwds) {
    PyObject *names, *kinds, *key_idx, *converters, *dumps;
    PyObject *key_head = NULL, *key_tail = NULL, *placeholders = Py_None, *hash_key = Py_None;
    PyObject *params = Py_None;
    int whole_old_key = 0;
    if (!PyArg_ParseTuple(args, "O!SO!O!O|SSpOOO:RowPlan", &PyTuple_Type, &names, &kinds,
                          &PyTuple_Type, &key_idx, &PyTuple_Type, &converters, &dumps, &key_head,
                          &key_tail, &whole_old_key, &placeholders, &hash_key, &params))
        return -1;
    if (hash_key != Py_None) {
        if (!PyBytes_Check(hash_key)) {
            PyErr_SetString(PyExc_TypeError, "hash_key must be bytes or None");
            return -1;
        }
        hmac_key(&self->hash_key, (const unsigned char *)PyBytes_AS_STRING(hash_key),
                 (size_t)PyBytes_GET_SIZE(hash_key));
        self->has_hash_key = 1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(names);
    if (PyBytes_GET_SIZE(kinds) != n || PyTuple_GET_SIZE(converters) != n) {
        PyErr_SetString(PyExc_ValueError, "names, kinds and converters differ in length");
        return -1;
    }
    if (self->kinds != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "RowPlan is initialised once");
        return -1;
    }
    self->ncols = n;
    self->nkeys = PyTuple_GET_SIZE(key_idx);
    self->kinds = PyMem_Malloc(n + 1);
    self->names = PyMem_Malloc((n + 1) * sizeof(char *));
    self->name_lens = PyMem_Malloc((n + 1) * sizeof(Py_ssize_t));
    self->key_idx = PyMem_Malloc((self->nkeys + 1) * sizeof(Py_ssize_t));
    self->params = PyMem_Calloc(n + 1, sizeof(int));
    if (!self->kinds || !self->names || !self->name_lens || !self->key_idx || !self->params) {
        PyErr_NoMemory();
        return -1;
    }
    if (params != Py_None) {
        if (!PyTuple_Check(params) || PyTuple_GET_SIZE(params) != n) {
            PyErr_SetString(PyExc_ValueError, "params: a tuple of ints per column");
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            long v = PyLong_AsLong(PyTuple_GET_ITEM(params, i));
            if (v == -1 && PyErr_Occurred())
                return -1;
            if (v < 0 || v > 1000) {
                PyErr_SetString(PyExc_ValueError, "params: 0 to 1000");
                return -1;
            }
            self->params[i] = (int)v;
        }
    }
    memcpy(self->kinds, PyBytes_AS_STRING(kinds), n);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        if (!PyBytes_Check(name)) {
            PyErr_SetString(PyExc_TypeError, "names must be bytes");
            return -1;
        }
        self->names[i] = PyBytes_AS_STRING(name);
        self->name_lens[i] = PyBytes_GET_SIZE(name);
        if (!PyCallable_Check(PyTuple_GET_ITEM(converters, i))) {
            PyErr_SetString(PyExc_TypeError, "converters must be callable");
            return -1;
        }
    }
    for (Py_ssize_t k = 0; k < self->nkeys; k++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(key_idx, k));
        if (i == -1 && PyErr_Occurred())
            return -1;
        if (i < 0 || i >= n) {
            PyErr_SetString(PyExc_ValueError, "key index out of range");
            return -1;
        }
        self->key_idx[k] = i;
    }
    self->holder = PyTuple_Pack(2, names, kinds);
    if (self->holder == NULL)
        return -1;
    self->key_head = key_head != NULL ? Py_NewRef(key_head) : PyBytes_FromStringAndSize("", 0);
    self->key_tail = key_tail != NULL ? Py_NewRef(key_tail) : PyBytes_FromStringAndSize("", 0);
    if (self->key_head == NULL || self->key_tail == NULL)
        return -1;
    self->whole_old_key = whole_old_key;
    if (placeholders != Py_None) {
        if (!PyTuple_Check(placeholders) || PyTuple_GET_SIZE(placeholders) != n) {
            PyErr_SetString(PyExc_ValueError, "placeholders: a tuple of bytes per column");
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            if (!PyBytes_Check(PyTuple_GET_ITEM(placeholders, i))) {
                PyErr_SetString(PyExc_TypeError, "placeholders must be bytes");
                return -1;
            }
        self->placeholders = Py_NewRef(placeholders);
    }
    Py_INCREF(converters);
    self->converters = converters;
    Py_INCREF(dumps);
    self->dumps = dumps;
    return 0;
}

/* One column's value as emit() sees it: its text (s == NULL for NULL) and, when the caller
   has one, the str it came from (for the column's Python converter); or, with raw, the
   JSON to write as it is (an unchanged TOAST value's placeholder). */
typedef struct {
    const char *s;
    Py_ssize_t n;
    PyObject *text;
    int raw;
} Col;

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/* raw[0:n] in base64 (the standard alphabet, padded) written at out; returns the end. */
static char *base64_at(char *out, const unsigned char *raw, size_t n) {
    size_t i = 0;
    for (; i + 3 <= n; i += 3) {
        unsigned v = (unsigned)raw[i] << 16 | (unsigned)raw[i + 1] << 8 | raw[i + 2];
        *out++ = B64[v >> 18];
        *out++ = B64[(v >> 12) & 63];
        *out++ = B64[(v >> 6) & 63];
        *out++ = B64[v & 63];
    }
    if (i < n) {
        unsigned v = (unsigned)raw[i] << 16 | (i + 1 < n ? (unsigned)raw[i + 1] << 8 : 0);
        *out++ = B64[v >> 18];
        *out++ = B64[(v >> 12) & 63];
        *out++ = i + 1 < n ? B64[(v >> 6) & 63] : '=';
        *out++ = '=';
    }
    return out;
}

/* The hash transform's JSON string of text s[0:n]: its HMAC-SHA-256 in hex, or in base64
   (the standard alphabet, padded), as masking.py writes it. */
static int put_hash(Buf *b, const HmacKey *key, const char *s, Py_ssize_t n, int base64) {
    unsigned char mac[32];
    hmac_sha256(key, (const unsigned char *)s, (size_t)n, mac);
    if (buf_grow(b, 66) < 0)
        return -1;
    char *out = b->data + b->len;
    *out++ = '"';
    if (base64) {
        out = base64_at(out, mac, sizeof(mac));
    } else {
        for (int i = 0; i < 32; i++) {
            *out++ = HEX[mac[i] >> 4];
            *out++ = HEX[mac[i] & 15];
        }
    }
    *out++ = '"';
    b->len = out - b->data;
    return 0;
}

static int hex_digit(char c) {
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* bytea as PostgreSQL prints it in hex (\x then two digits a byte): the JSON string of its
   bytes in base64, 1; 0 for anything else (bytea_output=escape: the converter's). */
static int put_bytea(Buf *b, const char *s, Py_ssize_t n) {
    if (n < 2 || s[0] != '\\' || s[1] != 'x' || (n - 2) % 2 != 0)
        return 0;
    Py_ssize_t size = (n - 2) / 2;
    /* The bytes go where their base64 will end, which starts no later than they do. */
    if (buf_grow(b, (size + 2) / 3 * 4 + 2 + size) < 0)
        return -1;
    unsigned char *raw = (unsigned char *)b->data + b->len + (size + 2) / 3 * 4 + 2;
    for (Py_ssize_t k = 0; k < size; k++) {
        int hi = hex_digit(s[2 + 2 * k]), lo = hex_digit(s[3 + 2 * k]);
        if (hi < 0 || lo < 0)
            return 0;
        raw[k] = (unsigned char)(hi << 4 | lo);
    }
    char *out = b->data + b->len;
    *out++ = '"';
    /* base64 writes 4 bytes per 3 read, in order: never past the bytes it has yet to read
       (they sit after the whole output). */
    out = base64_at(out, raw, (size_t)size);
    *out++ = '"';
    b->len = out - b->data;
    return 1;
}

/* s[0:n], all decimal digits, as a number into *out: 1; 0 otherwise. */
static int read_digits(const char *s, Py_ssize_t n, long long *out) {
    long long v = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9')
            return 0;
        v = v * 10 + (s[i] - '0');
    }
    *out = v;
    return 1;
}

#define US_PER_DAY 86400000000LL

/* Days since 1970-01-01 of a proleptic Gregorian date (connect_values._days_from_civil). */
static long long days_from_civil(long long y, long long m, long long d) {
    y -= m <= 2;
    long long era = (y >= 0 ? y : y - 399) / 400;
    long long yoe = y - era * 400;
    long long doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    return era * 146097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719468;
}

/* 'YYYY-MM-DD', a year of 1 to 9999: its days since the epoch, 1; 0 for anything else (BC,
   years past 9999, infinity: the converter's). */
static int read_date(const char *s, Py_ssize_t n, long long *days) {
    long long y, m, d;
    if (n != 10 || s[4] != '-' || s[7] != '-' || !read_digits(s, 4, &y) ||
        !read_digits(s + 5, 2, &m) || !read_digits(s + 8, 2, &d) || y < 1 || m < 1 || m > 12 ||
        d < 1 || d > 31)
        return 0;
    *days = days_from_civil(y, m, d);
    return 1;
}

/* 'HH:MM:SS[.f]', one to six fraction digits: microseconds of the day, 1; 0 otherwise. */
static int read_clock(const char *s, Py_ssize_t n, long long *micros) {
    long long h, mi, sec, frac = 0;
    if (n < 8 || s[2] != ':' || s[5] != ':' || !read_digits(s, 2, &h) ||
        !read_digits(s + 3, 2, &mi) || !read_digits(s + 6, 2, &sec))
        return 0;
    if (n > 8) {
        Py_ssize_t digits = n - 9;
        if (s[8] != '.' || digits < 1 || digits > 6 || !read_digits(s + 9, digits, &frac))
            return 0;
        for (Py_ssize_t k = digits; k < 6; k++)
            frac *= 10;
    }
    *micros = ((h * 60 + mi) * 60 + sec) * 1000000 + frac;
    return 1;
}

/* 'YYYY-MM-DD HH:MM:SS[.f]': microseconds since the epoch, 1; 0 otherwise. */
static int read_timestamp(const char *s, Py_ssize_t n, long long *micros) {
    long long days, clock;
    if (n < 19 || s[10] != ' ' || !read_date(s, 10, &days) || !read_clock(s + 11, n - 11, &clock))
        return 0;
    *micros = days * US_PER_DAY + clock;
    return 1;
}

static long long floor_div(long long a, long long b) {
    return a >= 0 ? a / b : -((-a + b - 1) / b);
}

/* A non-negative integer (an LSN, a position in the transaction, a time) in decimal,
   digits[start:]: printed once, written into as many records and places as take it; also
   the digits of a value's integer (put_int). */
typedef struct {
    char digits[24];
    int start;
} Number;

static void set_number(Number *number, unsigned long long v) {
    int at = (int)sizeof(number->digits);
    do {
        number->digits[--at] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    number->start = at;
}

static int put_number(Buf *b, const Number *number) {
    return buf_put(b, number->digits + number->start,
                   (Py_ssize_t)sizeof(number->digits) - number->start);
}

/* A signed integer in decimal. Digits are written by hand here and below: snprintf's format
   parsing was 8% of the publisher thread in the Debezium format's `wide` workload (six
   timestamptz columns a row). */
static int put_int(Buf *b, long long v) {
    Number number;
    set_number(&number, v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v);
    return (v < 0 && buf_byte(b, '-') < 0) ? -1 : put_number(b, &number);
}

/* v (0 <= v < 10^width) as width digits, zero-padded, at out. */
static void write_padded(char *out, long long v, int width) {
    for (int i = width - 1; i >= 0; i--) {
        out[i] = (char)('0' + v % 10);
        v /= 10;
    }
}

/* timestamptz 'YYYY-MM-DD HH:MM:SS[.f]+HH[:MM[:SS]]' moved to UTC, as the JSON string
   'YYYY-MM-DDTHH:MM:SS[.f]Z' with `width` fraction digits (none: Java's minimal fraction),
   1; 0 for anything else, or a year outside 1-9999 in UTC (the converter's). */
static int put_zoned_timestamp(Buf *b, const char *s, Py_ssize_t n, int width) {
    Py_ssize_t at = 19;
    while (at < n && s[at] != '+' && s[at] != '-')
        at++;
    long long micros, oh, om = 0, os = 0;
    Py_ssize_t off = n - at;
    if (at == n || !read_timestamp(s, at, &micros) || !read_digits(s + at + 1, 2, &oh) ||
        (off != 3 && off != 6 && off != 9) ||
        (off >= 6 && (s[at + 3] != ':' || !read_digits(s + at + 4, 2, &om))) ||
        (off == 9 && (s[at + 6] != ':' || !read_digits(s + at + 7, 2, &os))))
        return 0;
    long long offset = (oh * 3600 + om * 60 + os) * 1000000;
    micros -= s[at] == '-' ? -offset : offset;
    long long days = floor_div(micros, US_PER_DAY), of_day = micros - days * US_PER_DAY;
    /* connect_values._civil_from_days */
    days += 719468;
    long long era = (days >= 0 ? days : days - 146096) / 146097;
    long long doe = days - era * 146097;
    long long yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    long long doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    long long mp = (5 * doy + 2) / 153;
    long long day = doy - (153 * mp + 2) / 5 + 1, month = mp + (mp < 10 ? 3 : -9);
    long long year = yoe + era * 400 + (month <= 2);
    if (year < 1 || year > 9999)
        return 0;
    long long frac = of_day % 1000000, secs = of_day / 1000000;
    char out[40] = "\"YYYY-MM-DDTHH:MM:SS";
    int len = 20;
    write_padded(out + 1, year, 4);
    write_padded(out + 6, month, 2);
    write_padded(out + 9, day, 2);
    write_padded(out + 12, secs / 3600, 2);
    write_padded(out + 15, secs / 60 % 60, 2);
    write_padded(out + 18, secs % 60, 2);
    if (width > 0 || frac != 0) {
        char digits[6];
        write_padded(digits, frac, 6);
        int keep = width;
        if (keep == 0) /* the minimal fraction */
            for (keep = 6; digits[keep - 1] == '0'; keep--)
                ;
        if (keep > 6)
            keep = 6;
        out[len++] = '.';
        memcpy(out + len, digits, keep);
        len += keep;
    }
    out[len++] = 'Z';
    out[len++] = '"';
    return buf_put(b, out, len) < 0 ? -1 : 1;
}

/* numeric text -?D+[.D+] of at most 38 digits: its digits as an integer with `scale`
   fraction digits (fixed), or with the fraction's trailing zeros gone (*scale set: the
   variable scale); 1, or 0 for anything else (NaN, Infinity, more fraction digits than a
   fixed scale, longer numbers: the converter's). */
static int read_decimal(const char *s, Py_ssize_t n, int *scale, int variable, int *negative,
                        unsigned __int128 *unscaled) {
    Py_ssize_t dot = -1;
    *negative = n > 0 && s[0] == '-';
    Py_ssize_t i = *negative;
    if (i == n)
        return 0;
    Py_ssize_t end = n;
    for (Py_ssize_t k = i; k < n; k++)
        if (s[k] == '.') {
            if (dot >= 0)
                return 0;
            dot = k;
        } else if (s[k] < '0' || s[k] > '9') {
            return 0;
        }
    if (dot == i || dot == n - 1)
        return 0;
    Py_ssize_t frac = dot < 0 ? 0 : n - dot - 1;
    if (variable) {
        while (frac > 0 && s[dot + frac] == '0')
            frac--;
        end = dot < 0 ? n : dot + 1 + frac;
        *scale = (int)frac;
    } else if (frac > *scale) {
        return 0;
    }
    /* 38 digits fit in 127 bits. */
    Py_ssize_t ndigits = (end - i) - (dot >= 0 && dot < end) + (variable ? 0 : *scale - frac);
    if (ndigits > 38)
        return 0;
    unsigned __int128 v = 0;
    for (Py_ssize_t k = i; k < end; k++)
        if (k != dot)
            v = v * 10 + (unsigned)(s[k] - '0');
    for (Py_ssize_t k = frac; !variable && k < *scale; k++)
        v *= 10;
    *unscaled = v;
    return 1;
}

/* An integer as a JSON string of Java's BigInteger.toByteArray() (minimal two's complement,
   big-endian) in base64: how a Connect Decimal travels in JSON. */
static int put_unscaled(Buf *b, int negative, unsigned __int128 magnitude) {
    unsigned __int128 v = negative ? -magnitude : magnitude; /* two's complement */
    unsigned __int128 m = negative && magnitude ? ~v : v;
    int bits = 0;
    while (m) {
        bits++;
        m >>= 1;
    }
    int size = bits / 8 + 1;
    unsigned char raw[17];
    for (int k = size - 1; k >= 0; k--) {
        raw[k] = (unsigned char)v;
        v >>= 8;
    }
    if (buf_grow(b, 2 + (size + 2) / 3 * 4) < 0)
        return -1;
    char *out = b->data + b->len;
    *out++ = '"';
    out = base64_at(out, raw, (size_t)size);
    *out++ = '"';
    b->len = out - b->data;
    return 0;
}

/* A Connect kind's value of text s[0:n]: 1 written, 0 when the text is not one this reads
   (the converter's), -1 on error. */
static int put_connect(Buf *b, char kind, int param, const char *s, Py_ssize_t n) {
    long long v;
    int negative, scale = param;
    unsigned __int128 unscaled;
    switch (kind) {
    case K_DECIMAL:
        if (!read_decimal(s, n, &scale, 0, &negative, &unscaled))
            return 0;
        return put_unscaled(b, negative, unscaled) < 0 ? -1 : 1;
    case K_VARIABLE_DECIMAL:
        if (!read_decimal(s, n, &scale, 1, &negative, &unscaled))
            return 0;
        if (buf_put(b, "{\"scale\":", 9) < 0 || put_int(b, scale) < 0 ||
            buf_put(b, ",\"value\":", 9) < 0 || put_unscaled(b, negative, unscaled) < 0)
            return -1;
        return buf_byte(b, '}') < 0 ? -1 : 1;
    case K_ZONED_TIMESTAMP:
        return put_zoned_timestamp(b, s, n, param);
    case K_MICRO_TIMESTAMP:
    case K_MILLI_TIMESTAMP:
        if (!read_timestamp(s, n, &v))
            return 0;
        return put_int(b, kind == K_MILLI_TIMESTAMP ? floor_div(v, 1000) : v) < 0 ? -1 : 1;
    case K_DATE:
        if (!read_date(s, n, &v))
            return 0;
        return put_int(b, v) < 0 ? -1 : 1;
    case K_MICRO_TIME:
    case K_MILLI_TIME:
        if (!read_clock(s, n, &v))
            return 0;
        return put_int(b, kind == K_MILLI_TIME ? v / 1000 : v) < 0 ? -1 : 1;
    }
    return 0;
}

/* Text s[0:n] of a kind that needs nothing of the plan (param: the kind's scale, width or
   element kind) as JSON appended to b: 1 written, 0 when the kind does not read this text
   (b as it was: the converter's), -1 on error. */
static int put_kind(Buf *b, char kind, int param, const char *s, Py_ssize_t n);

/* A one-dimensional array as array_out prints it ({1,NULL,3}, {a,"b c"}) whose elements
   are of kind `element`: the JSON array of them, 1. 0 (b as it was) for what the converter
   must read: bounds ([0:1]={...}), nested arrays, backslash escapes, an empty or malformed
   element, an element the kind does not read. NULL unquoted is null, "NULL" a string. */
static int put_array(Buf *b, char element, const char *s, Py_ssize_t n) {
    if (n < 2 || s[0] != '{' || s[n - 1] != '}')
        return 0;
    Py_ssize_t start = b->len, i = 1, end = n - 1;
    if (buf_byte(b, '[') < 0)
        return -1;
    while (i < end) {
        const char *e = s + i;
        Py_ssize_t j = i;
        int quoted = s[i] == '"', rc;
        if (quoted) {
            for (j = i + 1; j < end && s[j] != '"' && s[j] != '\\'; j++)
                ;
            if (j == end || s[j] != '"')
                goto converter;
            rc = put_kind(b, element, 0, e + 1, j - i - 1);
            j++;
        } else {
            for (; j < end && s[j] != ',' && s[j] != '"' && s[j] != '\\' && s[j] != '{' &&
                   s[j] != '}';
                 j++)
                ;
            if (j == i)
                goto converter;
            rc = (j - i == 4 && memcmp(e, "NULL", 4) == 0) ? (buf_put(b, "null", 4) < 0 ? -1 : 1)
                                                           : put_kind(b, element, 0, e, j - i);
        }
        if (rc < 0)
            return -1;
        if (rc == 0 || (j < end && (s[j] != ',' || j + 1 == end)))
            goto converter;
        i = j + 1;
        if (j < end && buf_byte(b, ',') < 0)
            return -1;
    }
    return buf_byte(b, ']') < 0 ? -1 : 1;
converter:
    b->len = start;
    return 0;
}

static int put_kind(Buf *b, char kind, int param, const char *s, Py_ssize_t n) {
    switch (kind) {
    case K_TEXT:
        return put_string(b, s, n, 0, "") < 0 ? -1 : 1;
    case K_INT:
        return canonical_integer(s, n) ? (buf_put(b, s, n) < 0 ? -1 : 1) : 0;
    case K_BOOL:
        if (n == 1 && s[0] == 't')
            return buf_put(b, "true", 4) < 0 ? -1 : 1;
        if (n == 1 && s[0] == 'f')
            return buf_put(b, "false", 5) < 0 ? -1 : 1;
        return 0;
    case K_TIMESTAMP:
        return put_string(b, s, n, 1, "") < 0 ? -1 : 1;
    case K_JSON:
        return buf_put(b, s, n) < 0 ? -1 : 1;
    case K_TIMESTAMPTZ:
        if (n >= 3 && memcmp(s + n - 3, "+00", 3) == 0)
            return put_string(b, s, n - 3, 1, "Z") < 0 ? -1 : 1;
        return 0;
    case K_BYTEA:
        return put_bytea(b, s, n);
    case K_FLOAT:
        return put_float(b, s, n);
    case K_ARRAY:
        return put_array(b, (char)param, s, n);
    default:
        return put_connect(b, kind, param, s, n);
    }
}

/* The value of column i: its JSON text appended to b. */
static int put_value(RowPlan *self, Buf *b, Py_ssize_t i, const Col *col) {
    const char *s = col->s;
    Py_ssize_t n = col->n;
    if (s == NULL)
        return buf_put(b, "null", 4);
    if (col->raw)
        return buf_put(b, s, n);
    char kind = self->kinds[i];
    int rc;
    if (kind != K_HASH_HEX && kind != K_HASH_BASE64)
        rc = put_kind(b, kind, self->params[i], s, n);
    else if (self->has_hash_key)
        rc = put_hash(b, &self->hash_key, s, n, kind == K_HASH_BASE64) < 0 ? -1 : 1;
    else
        rc = 0;
    if (rc != 0)
        return rc < 0 ? -1 : 0;
    PyObject *text = col->text;
    if (text == NULL) {
        text = PyUnicode_DecodeUTF8(s, n, NULL);
        if (text == NULL)
            return -1;
    } else {
        Py_INCREF(text);
    }
    PyObject *converted = PyObject_CallOneArg(PyTuple_GET_ITEM(self->converters, i), text);
    Py_DECREF(text);
    if (converted == NULL)
        return -1;
    PyObject *json = PyObject_CallOneArg(self->dumps, converted);
    Py_DECREF(converted);
    if (json == NULL)
        return -1;
    rc = PyBytes_Check(json) ? buf_put(b, PyBytes_AS_STRING(json), PyBytes_GET_SIZE(json))
                             : (PyErr_SetString(PyExc_TypeError, "dumps must return bytes"), -1);
    Py_DECREF(json);
    return rc;
}

/* The row's JSON object appended to b: every column of cols, or with key_only its key
   columns alone; where each column's value starts and ends goes to spans (may be NULL). */
static int write_row(RowPlan *self, Buf *b, const Col *cols, int key_only,
                     Py_ssize_t (*spans)[2]) {
    if (buf_byte(b, '{') < 0)
        return -1;
    Py_ssize_t nwritten = key_only ? self->nkeys : self->ncols;
    int first = 1;
    for (Py_ssize_t j = 0; j < nwritten; j++) {
        Py_ssize_t i = key_only ? self->key_idx[j] : j;
        if (self->kinds[i] == K_DROPPED)
            continue;
        if ((!first && buf_byte(b, ',') < 0) || buf_put(b, self->names[i], self->name_lens[i]) < 0)
            return -1;
        first = 0;
        if (spans != NULL)
            spans[i][0] = b->len;
        if (put_value(self, b, i, &cols[i]) < 0)
            return -1;
        if (spans != NULL)
            spans[i][1] = b->len;
    }
    return buf_byte(b, '}');
}

/* pieces[j] appended to b. */
static int put_piece(Buf *b, PyObject *pieces, Py_ssize_t j) {
    PyObject *piece = PyTuple_GET_ITEM(pieces, j);
    return buf_put(b, PyBytes_AS_STRING(piece), PyBytes_GET_SIZE(piece));
}

/* *value: pieces[0], the before row (when there is one) and pieces[1], the row, then the
   next piece, then numbers[i] each followed by the next piece; *key: the key object of the
   row, or None when the table has no key. cols (and before) hold ncols columns; with
   key_only the row is the key columns alone (a delete's old key, which is how the Python
   path writes it). 0, or -1 with an exception set. */
static int emit(RowPlan *self, const Col *before, const Col *cols, PyObject *pieces,
                const Number *const *numbers, Py_ssize_t nnumbers, int key_only,
                PyObject **value, PyObject **key) {
    Buf b = {.len = 0, .cap = sizeof(b.small)};
    b.data = b.small;
    /* Where each column's value starts and ends in b, for the key. */
    Py_ssize_t spans_small[64][2];
    Py_ssize_t(*spans)[2] = spans_small;
    int rc = -1;
    if (self->ncols > 64) {
        spans = PyMem_Malloc(self->ncols * sizeof(*spans));
        if (spans == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    Py_ssize_t at = 0; /* the next piece */
    if (put_piece(&b, pieces, at++) < 0)
        goto done;
    if (before != NULL && (write_row(self, &b, before, 0, NULL) < 0 || put_piece(&b, pieces, at++) < 0))
        goto done;
    if (write_row(self, &b, cols, key_only, spans) < 0 || put_piece(&b, pieces, at++) < 0)
        goto done;
    for (Py_ssize_t j = 0; j < nnumbers; j++)
        if (put_number(&b, numbers[j]) < 0 || put_piece(&b, pieces, at++) < 0)
            goto done;
    Py_ssize_t value_len = b.len;
    if (self->nkeys > 0) {
        /* The key object goes after the value in the same buffer. */
        if (buf_put(&b, PyBytes_AS_STRING(self->key_head), PyBytes_GET_SIZE(self->key_head)) < 0 ||
            buf_byte(&b, '{') < 0)
            goto done;
        for (Py_ssize_t k = 0; k < self->nkeys; k++) {
            Py_ssize_t i = self->key_idx[k];
            if ((k > 0 && buf_byte(&b, ',') < 0) ||
                buf_put(&b, self->names[i], self->name_lens[i]) < 0 ||
                buf_grow(&b, spans[i][1] - spans[i][0]) < 0)
                goto done;
            memcpy(b.data + b.len, b.data + spans[i][0], spans[i][1] - spans[i][0]);
            b.len += spans[i][1] - spans[i][0];
        }
        if (buf_byte(&b, '}') < 0 ||
            buf_put(&b, PyBytes_AS_STRING(self->key_tail), PyBytes_GET_SIZE(self->key_tail)) < 0)
            goto done;
        *key = PyBytes_FromStringAndSize(b.data + value_len, b.len - value_len);
        if (*key == NULL)
            goto done;
    } else {
        *key = Py_NewRef(Py_None);
    }
    *value = PyBytes_FromStringAndSize(b.data, value_len);
    if (*value == NULL) {
        Py_CLEAR(*key);
        goto done;
    }
    rc = 0;
done:
    if (spans != spans_small)
        PyMem_Free(spans);
    buf_free(&b);
    return rc;
}

#define MAX_NUMBERS 16

/* pieces as emit() needs them (a tuple of bytes, two more than the numbers), and numbers, a
   tuple of non-negative ints, into out (MAX_NUMBERS at most); their count, or -1. */
static Py_ssize_t check_frame(PyObject *pieces, PyObject *numbers, Number *out) {
    if (!PyTuple_Check(pieces) || !PyTuple_Check(numbers)) {
        PyErr_SetString(PyExc_TypeError, "pieces and numbers must be tuples");
        return -1;
    }
    Py_ssize_t npieces = PyTuple_GET_SIZE(pieces), nnumbers = PyTuple_GET_SIZE(numbers);
    if (npieces != nnumbers + 2 || nnumbers > MAX_NUMBERS) {
        PyErr_SetString(PyExc_ValueError, "pieces must be two more than numbers, at most 16");
        return -1;
    }
    for (Py_ssize_t j = 0; j < npieces; j++)
        if (!PyBytes_Check(PyTuple_GET_ITEM(pieces, j))) {
            PyErr_SetString(PyExc_TypeError, "pieces must be bytes");
            return -1;
        }
    for (Py_ssize_t j = 0; j < nnumbers; j++) {
        unsigned long long v = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(numbers, j));
        if (v == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
        set_number(&out[j], v);
    }
    return nnumbers;
}

/* Whether a json/jsonb column holds a JSON null (json keeps the blanks around it): the
   record then names it in "json_nulls", which only the Python path writes, so a row with
   one is not built here. */
static int has_json_null(RowPlan *self, const Col *cols) {
    for (Py_ssize_t i = 0; i < self->ncols; i++) {
        if (self->kinds[i] != K_JSON || cols[i].s == NULL || cols[i].raw)
            continue;
        const char *s = cols[i].s, *end = s + cols[i].n;
        while (s < end && (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r'))
            s++;
        while (end > s && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\n' || end[-1] == '\r'))
            end--;
        if (end - s == 4 && memcmp(s, "null", 4) == 0)
            return 1;
    }
    return 0;
}

/* Room for ncols columns: on the stack for the usual table, else on the heap. */
static Col *cols_for(RowPlan *self, Col *small, Py_ssize_t nsmall) {
    if (self->ncols <= nsmall)
        return small;
    Col *cols = PyMem_Calloc(self->ncols, sizeof(Col));
    if (cols == NULL)
        PyErr_NoMemory();
    return cols;
}

/* record(values, pieces, numbers) -> (record value, key JSON or None): the row framed; None
   for a row with a JSON null in a json/jsonb column (see has_json_null). */
static PyObject *plan_record(RowPlan *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "record(values, pieces: tuple, numbers: tuple)");
        return NULL;
    }
    Number values[MAX_NUMBERS];
    const Number *numbers[MAX_NUMBERS];
    Py_ssize_t nnumbers = check_frame(args[1], args[2], values);
    if (nnumbers < 0)
        return NULL;
    for (Py_ssize_t j = 0; j < nnumbers; j++)
        numbers[j] = &values[j];
    PyObject *seq = PySequence_Fast(args[0], "values must be a list or tuple");
    if (seq == NULL)
        return NULL;
    PyObject *result = NULL;
    Col small[64];
    Col *cols = NULL;
    if (PySequence_Fast_GET_SIZE(seq) < self->ncols) {
        PyErr_Format(PyExc_ValueError, "%zd values for %zd columns", PySequence_Fast_GET_SIZE(seq),
                     self->ncols);
        goto done;
    }
    cols = cols_for(self, small, 64);
    if (cols == NULL)
        goto done;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < self->ncols; i++) {
        PyObject *item = items[i];
        cols[i].text = NULL;
        cols[i].s = NULL;
        cols[i].raw = 0;
        if (item == Py_None)
            continue;
        if (!PyUnicode_CheckExact(item)) {
            PyErr_Format(PyExc_TypeError, "column %zd: text or None expected, got %.100s", i,
                         Py_TYPE(item)->tp_name);
            goto done;
        }
        cols[i].s = PyUnicode_AsUTF8AndSize(item, &cols[i].n);
        if (cols[i].s == NULL)
            goto done;
        cols[i].text = item;
    }
    if (has_json_null(self, cols)) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *value, *key;
    if (emit(self, NULL, cols, args[1], numbers, nnumbers, 0, &value, &key) == 0) {
        result = PyTuple_Pack(2, value, key);
        Py_DECREF(value);
        Py_DECREF(key);
    }
done:
    if (cols != small)
        PyMem_Free(cols);
    Py_DECREF(seq);
    return result;
}

/* One TupleData of td read in place into cols (ncols columns, each set): 1; 0 when it holds
   anything but text, NULL and (with placeholders) unchanged TOAST values, another column
   count, or text that is not UTF-8. *read counts the columns whose text (if any) the
   caller now owns, also when it returns 0. */
static int read_tuple(RowPlan *self, TupleData *td, Col *cols, Py_ssize_t *read) {
    *read = 0;
    if (tupledata_count(td) != self->ncols)
        return 0;
    for (; *read < self->ncols; (*read)++) {
        Col *col = &cols[*read];
        col->s = NULL;
        col->text = NULL;
        col->raw = 0;
        int kind = tupledata_next(td, &col->s, &col->n);
        if (kind == 'n')
            continue;
        if (kind == 'u' && self->placeholders != NULL) {
            PyObject *placeholder = PyTuple_GET_ITEM(self->placeholders, *read);
            col->s = PyBytes_AS_STRING(placeholder);
            col->n = PyBytes_GET_SIZE(placeholder);
            col->raw = 1;
            continue;
        }
        if (kind != 't')
            return 0;
        if (!all_ascii(col->s, col->n)) {
            /* Decoding proves it is UTF-8, and the str's UTF-8 is these bytes. */
            col->text = PyUnicode_DecodeUTF8(col->s, col->n, NULL);
            if (col->text == NULL) {
                PyErr_Clear();
                return 0;
            }
        }
    }
    return 1;
}

/* The record of the pgoutput TupleData at pos in buf[0:len], which must run to the end, read
   in place (no str per column), into *value and *key: 1; 0 when read_tuple does not take a
   row (the caller decodes the message, which says what is wrong); -1 with an exception set.
   With two_rows, pos holds an old row, then 'N' and the new one (an update under REPLICA
   IDENTITY FULL): the record's before row is the old one, and an unchanged TOAST value of
   the new row is the old row's value, as the Python path takes it. */
static int build_tuple(RowPlan *self, const unsigned char *buf, Py_ssize_t len, Py_ssize_t pos,
                       PyObject *pieces, const Number *const *numbers, Py_ssize_t nnumbers,
                       int key_only, int two_rows, PyObject **value, PyObject **key) {
    TupleData td = {.buf = buf, .len = len, .pos = pos};
    int rc = 0;
    Col small[2][64];
    Col *old = NULL, *cols = cols_for(self, small[0], 64);
    Py_ssize_t old_read = 0, read = 0;
    if (cols == NULL)
        return -1;
    if (two_rows) {
        old = cols_for(self, small[1], 64);
        if (old == NULL) {
            rc = -1;
            goto done;
        }
        if (read_tuple(self, &td, old, &old_read) != 1 || td.pos >= td.len || buf[td.pos] != 'N')
            goto done;
        td.pos++;
    }
    if (read_tuple(self, &td, cols, &read) != 1 || td.pos != td.len)
        goto done;
    if (two_rows) {
        for (Py_ssize_t i = 0; i < self->ncols; i++)
            if (cols[i].raw && old[i].s != NULL && !old[i].raw) {
                cols[i] = old[i];
                Py_XINCREF(cols[i].text);
            }
        /* A changed key makes three records (delete, tombstone, update): the decoder's
           path, which compares the keys' JSON. */
        for (Py_ssize_t k = 0; k < self->nkeys; k++) {
            const Col *a = &old[self->key_idx[k]], *b = &cols[self->key_idx[k]];
            if ((a->s == NULL) != (b->s == NULL) ||
                (a->s != NULL && (a->n != b->n || memcmp(a->s, b->s, a->n) != 0)))
                goto done;
        }
    }
    if ((old != NULL && has_json_null(self, old)) || has_json_null(self, cols))
        goto done;
    rc = emit(self, old, cols, pieces, numbers, nnumbers, key_only, value, key) < 0 ? -1 : 1;
done:
    for (Py_ssize_t i = 0; i < read; i++)
        Py_XDECREF(cols[i].text);
    for (Py_ssize_t i = 0; i < old_read; i++)
        Py_XDECREF(old[i].text);
    if (cols != small[0])
        PyMem_Free(cols);
    if (old != NULL && old != small[1])
        PyMem_Free(old);
    return rc;
}

/* Which of a run's changes payload is, when its row is read in place: the pieces of its
   record (from kinds: insert, update, delete), whether its row is the key alone, whether a
   tombstone follows its record. NULL for anything else (another message, another relation,
   an update with an old tuple, a delete without a key): the decoder's path takes it. */
static PyObject *change_frame(RowPlan *self, PyObject *payload, Py_ssize_t at,
                              const unsigned char relid[4], PyObject *kinds, int *key_only,
                              int *tombstone, int *two_rows) {
    if (!PyBytes_CheckExact(payload) || PyBytes_GET_SIZE(payload) < at + 5)
        return NULL;
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(payload);
    if (memcmp(p + at, relid, 4) != 0)
        return NULL;
    *key_only = *tombstone = *two_rows = 0;
    switch (p[0]) {
    case 'I':
        return p[at + 4] == 'N' ? PyTuple_GET_ITEM(kinds, 0) : NULL;
    case 'U':
        if (p[at + 4] == 'N')
            return PyTuple_GET_ITEM(kinds, 1);
        /* The whole old row (REPLICA IDENTITY FULL) is the before row (unless the key
           changed: see build_tuple); an old key means the key changed, which makes three
           records: the decoder's path. */
        *two_rows = 1;
        return p[at + 4] == 'O' ? PyTuple_GET_ITEM(kinds, 3) : NULL;
    case 'D':
        if (self->nkeys == 0 || (p[at + 4] != 'K' && p[at + 4] != 'O'))
            return NULL;
        *key_only = p[at + 4] == 'K' && !self->whole_old_key;
        *tombstone = 1;
        return PyTuple_GET_ITEM(kinds, 2);
    }
    return NULL;
}

/* The (lsn, payload) pair the spool holds: its payload, or NULL. */
static PyObject *spooled(PyObject *item, unsigned long long *lsn) {
    if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 2)
        return NULL;
    *lsn = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(item, 0));
    if (*lsn == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return NULL;
    }
    return PyTuple_GET_ITEM(item, 1);
}

static int append_record(PyObject *records, PyObject *topic, PyObject *key, PyObject *value,
                         PyObject *headers) {
    PyObject *record = PyTuple_Pack(4, topic, key, value, headers);
    /* A topic, a key and a value make no cycle: untracked, as _runs.c's entries, so the
       collector does not walk the records waiting for the sink. Headers are a list. */
    if (record != NULL && headers == Py_None)
        PyObject_GC_UnTrack(record);
    int rc = record == NULL ? -1 : PyList_Append(records, record);
    Py_XDECREF(record);
    return rc;
}

static PyMethodDef plan_methods[] = {
    {"record", (PyCFunction)(void (*)(void))plan_record, METH_FASTCALL,
     "record(values, pieces, numbers) -> (value, key JSON or None), or None for a row with "
     "a JSON null in a json column: pieces[0], the row, pieces[1], then each number "
     "followed by the next piece"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RowPlanType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "services.bridge.records._rowjson.RowPlan",
    .tp_basicsize = sizeof(RowPlan),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "How one relation version's rows become JSON (see catalog.row_plan)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)plan_init,
    .tp_dealloc = (destructor)plan_dealloc,
    .tp_methods = plan_methods,
};

/* Whether kinds holds the pieces of an insert's, an update's and a delete's record
   (2 + nnumbers bytes pieces each) and of an update's with its old row (one more). */
static int kinds_fit(PyObject *kinds, Py_ssize_t nnumbers) {
    if (!PyTuple_CheckExact(kinds) || PyTuple_GET_SIZE(kinds) != 4)
        return 0;
    for (Py_ssize_t k = 0; k < 4; k++) {
        Py_ssize_t npieces = nnumbers + (k == 3 ? 3 : 2);
        PyObject *pieces = PyTuple_GET_ITEM(kinds, k);
        if (!PyTuple_Check(pieces) || PyTuple_GET_SIZE(pieces) != npieces)
            return 0;
        for (Py_ssize_t j = 0; j < npieces; j++)
            if (!PyBytes_Check(PyTuple_GET_ITEM(pieces, j)))
                return 0;
    }
    return 1;
}

/* What a run shares: where the numbers come from (the record's lsn, total and per-table
   order, then the transaction's trailing numbers) and which goes where (slots). */
typedef struct {
    Number from[MAX_NUMBERS];
    const Number *numbers[MAX_NUMBERS];
    Py_ssize_t nnumbers;
    Py_ssize_t at, max_bytes, limit;
    int tombstones; /* whether a delete's record is followed by its tombstone */
    PyObject *items, *headers, *records;
} Runs;

/* The records of a run of row changes to one relation, appended to runs->records as the
   builder's loop would make them one by one (a delete's record followed by its tombstone,
   if runs->tombstones):
   from (*lsn, *payload) on, and on with the items the iterator gives while they are
   changes to the same relation this plan reads in place (see change_frame), up to limit
   records. On return *item is the item taken from the iterator that the run stopped at
   (NULL: none, the iterator ended or the limit was reached), and (*lsn, *payload) its
   change; with nothing appended, the change it started with. -1 on an error. */
static int run_of(RowPlan *plan, Runs *runs, PyObject *kinds, PyObject *topic,
                  unsigned long long *lsn_io, PyObject **payload_io, PyObject **item_io,
                  unsigned long long *total_io, unsigned long long *order_io) {
    /* The loop works on local copies (as the one-run call it replaced did) and writes them
       back on the way out. */
    unsigned long long lsn = *lsn_io, total = *total_io, order = *order_io;
    PyObject *payload = *payload_io, *item = *item_io, *records = runs->records;
    PyObject *items = runs->items, *headers = runs->headers;
    Number *from = runs->from;
    const Number **numbers = runs->numbers;
    Py_ssize_t at = runs->at, nnumbers = runs->nnumbers, max_bytes = runs->max_bytes;
    Py_ssize_t limit = runs->limit;
    int rc = 0;
    unsigned char relid[4];
    memcpy(relid, PyBytes_AS_STRING(payload) + at, 4);
    int key_only, tombstone, two_rows;
    PyObject *pieces =
        change_frame(plan, payload, at, relid, kinds, &key_only, &tombstone, &two_rows);
    while (pieces != NULL) {
        set_number(&from[0], lsn);
        set_number(&from[1], total + 1);
        set_number(&from[2], order + 1);
        PyObject *value, *key;
        int built = build_tuple(plan, (const unsigned char *)PyBytes_AS_STRING(payload),
                                PyBytes_GET_SIZE(payload), at + 5, pieces, numbers, nnumbers,
                                key_only, two_rows, &value, &key);
        if (built < 0) {
            rc = -1;
            break;
        }
        if (built == 0 || PyBytes_GET_SIZE(value) > max_bytes) {
            if (built) {
                Py_DECREF(value);
                Py_DECREF(key);
            }
            break;
        }
        rc = append_record(records, topic, key, value, headers);
        if (rc == 0 && tombstone && runs->tombstones)
            rc = append_record(records, topic, key, Py_None, headers);
        Py_DECREF(value);
        Py_DECREF(key);
        if (rc < 0)
            break;
        total++;
        order++;
        Py_CLEAR(item);
        if (PyList_GET_SIZE(records) >= limit)
            break;
        item = PyIter_Next(items);
        if (item == NULL) {
            rc = PyErr_Occurred() ? -1 : 0;
            break;
        }
        payload = spooled(item, &lsn);
        pieces = payload == NULL ? NULL
                                 : change_frame(plan, payload, at, relid, kinds, &key_only,
                                                &tombstone, &two_rows);
    }
    *lsn_io = lsn;
    *total_io = total;
    *order_io = order;
    *payload_io = payload;
    *item_io = item;
    return rc;
}

/* The relation (info, plan, kinds, topic) of plans that reads payload's row change in
   place: the one its relation oid (at payload[at]) names, if it is still the catalogue's
   (relations[oid] is its info). NULL without an error where there is none; a TypeError
   for an entry of another shape. */
static PyObject *plan_of(PyObject *payload, Py_ssize_t at, PyObject *plans, PyObject *relations,
                         Py_ssize_t nnumbers) {
    if (payload == NULL || !PyBytes_CheckExact(payload) || PyBytes_GET_SIZE(payload) < at + 5)
        return NULL;
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(payload) + at;
    PyObject *oid = PyLong_FromUnsignedLong(((unsigned long)p[0] << 24) | (p[1] << 16) |
                                            (p[2] << 8) | p[3]);
    if (oid == NULL)
        return NULL;
    PyObject *entry = PyDict_GetItemWithError(plans, oid);
    PyObject *info = entry == NULL ? NULL : PyDict_GetItemWithError(relations, oid);
    Py_DECREF(oid);
    if (info == NULL)
        return NULL;
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 4 ||
        !PyObject_TypeCheck(PyTuple_GET_ITEM(entry, 1), &RowPlanType) ||
        !kinds_fit(PyTuple_GET_ITEM(entry, 2), nnumbers) ||
        !PyUnicode_CheckExact(PyTuple_GET_ITEM(entry, 3))) {
        PyErr_SetString(PyExc_TypeError, "runs: a plan is (info, RowPlan, four tuples of "
                                         "2 + len(slots) pieces (3 + for the fourth), topic)");
        return NULL;
    }
    return PyTuple_GET_ITEM(entry, 0) == info ? entry : NULL;
}

/* runs(items, lsn, payload, at, plans, relations, per_table, total, headers, max_bytes, limit,
   trailing, slots, tombstones) -> (records, total, leftover): the change records of a
   transaction's row changes from (lsn, payload) on, run after run (a run: consecutive
   changes to one relation, see run_of), without a Python frame per row or per run. plans
   maps a relation oid to (info, plan, kinds, topic): the relation version (it must still
   be relations[oid], the catalogue's), its RowPlan, the pieces of its records and their
   topic. per_table maps a topic to its records' data_collection_order so far, and is kept
   up to date.
   A record's numbers are picked by slots, each byte an index into (lsn, total + 1, order +
   1, *trailing): the record's own and the transaction's, so that the pieces between them
   may be the same for every transaction. kinds holds the pieces of an insert's, an
   update's and a delete's record (2 + len(slots) each), and of an update's with its old
   row (one more, between the rows). The runs stop at a change no plan reads in place (a
   relation without a plan, another message, an update of the key, a record over
   max_bytes) or after limit records. leftover is the item taken from the iterator where
   they stopped, which the caller handles itself, or None; with no records, the caller's
   own (lsn, payload) is what it handles. tombstones: whether a delete's record is followed
   by a tombstone (the key and a null value). */
static PyObject *transaction_runs(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    static const char usage[] =
        "runs(items, lsn: int, payload: bytes, at: int, plans: dict, relations: dict, "
        "per_table: dict, total: int, headers, max_bytes: int, limit: int, trailing: tuple of "
        "ints, slots: bytes, tombstones: bool)";
    if (nargs != 14 || !PyIter_Check(args[0]) || !PyBytes_CheckExact(args[2]) ||
        !PyDict_CheckExact(args[4]) || !PyDict_CheckExact(args[5]) ||
        !PyDict_CheckExact(args[6]) || !PyTuple_Check(args[11]) ||
        PyTuple_GET_SIZE(args[11]) > MAX_NUMBERS - 3 || !PyBytes_Check(args[12]) ||
        PyBytes_GET_SIZE(args[12]) > MAX_NUMBERS) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    Runs runs;
    Py_ssize_t nfrom = 3 + PyTuple_GET_SIZE(args[11]);
    for (Py_ssize_t j = 3; j < nfrom; j++) {
        unsigned long long v = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(args[11], j - 3));
        if (v == (unsigned long long)-1 && PyErr_Occurred())
            return NULL;
        set_number(&runs.from[j], v);
    }
    const unsigned char *slots = (const unsigned char *)PyBytes_AS_STRING(args[12]);
    runs.nnumbers = PyBytes_GET_SIZE(args[12]);
    for (Py_ssize_t j = 0; j < runs.nnumbers; j++) {
        if (slots[j] >= nfrom) {
            PyErr_SetString(PyExc_ValueError, "runs: a slot past the numbers");
            return NULL;
        }
        runs.numbers[j] = &runs.from[slots[j]];
    }
    PyObject *payload = args[2], *plans = args[4], *relations = args[5], *per_table = args[6];
    runs.items = args[0];
    runs.headers = args[8];
    runs.tombstones = PyObject_IsTrue(args[13]);
    if (runs.tombstones < 0)
        return NULL;
    unsigned long long lsn = PyLong_AsUnsignedLongLong(args[1]);
    runs.at = PyLong_AsSsize_t(args[3]);
    unsigned long long total = PyLong_AsUnsignedLongLong(args[7]);
    runs.max_bytes = PyLong_AsSsize_t(args[9]);
    runs.limit = PyLong_AsSsize_t(args[10]);
    if (PyErr_Occurred())
        return NULL;
    if (runs.at < 1) {
        PyErr_SetString(PyExc_ValueError, "runs: at must be 1 or more");
        return NULL;
    }
    runs.records = PyList_New(0);
    if (runs.records == NULL)
        return NULL;
    PyObject *item = NULL; /* the item payload came from, once it came from the iterator */
    for (;;) {
        PyObject *entry = plan_of(payload, runs.at, plans, relations, runs.nnumbers);
        if (entry == NULL) {
            if (PyErr_Occurred())
                goto error;
            break;
        }
        PyObject *topic = PyTuple_GET_ITEM(entry, 3);
        PyObject *so_far = PyDict_GetItemWithError(per_table, topic);
        if (so_far == NULL && PyErr_Occurred())
            goto error;
        unsigned long long order = so_far == NULL ? 0 : PyLong_AsUnsignedLongLong(so_far);
        if (order == (unsigned long long)-1 && PyErr_Occurred())
            goto error;
        /* The entry is the plans dict's: held while its run may call back into Python. */
        Py_INCREF(entry);
        Py_ssize_t before = PyList_GET_SIZE(runs.records);
        int rc = run_of((RowPlan *)PyTuple_GET_ITEM(entry, 1), &runs, PyTuple_GET_ITEM(entry, 2),
                        topic, &lsn, &payload, &item, &total, &order);
        int built = PyList_GET_SIZE(runs.records) > before;
        if (rc == 0 && built) {
            PyObject *count = PyLong_FromUnsignedLongLong(order);
            rc = count == NULL ? -1 : PyDict_SetItem(per_table, topic, count);
            Py_XDECREF(count);
        }
        Py_DECREF(entry);
        if (rc < 0)
            goto error;
        /* Nothing built: the change is one this relation's plan leaves to the decoder. */
        if (!built || item == NULL)
            break;
    }
    /* item, if any, is the leftover: taken from the iterator but not built. */
    return Py_BuildValue("(NKN)", runs.records, total, item != NULL ? item : Py_NewRef(Py_None));
error:
    Py_XDECREF(item);
    Py_DECREF(runs.records);
    return NULL;
}

/* accelerate_sha256(on: bool) -> bool: the hash kinds' SHA-256 with the CPU's SHA
   extensions (the default where it has them) or with the portable code; whether the
   extensions are now in use. For the tests, which hold both to Python's hmac. */
static PyObject *accelerate_sha256(PyObject *module, PyObject *on) {
    int flag = PyObject_IsTrue(on);
    if (flag < 0)
        return NULL;
    return PyBool_FromLong(sha256_accelerate(flag));
}

static PyMethodDef module_methods[] = {
    {"runs", (PyCFunction)(void (*)(void))transaction_runs, METH_FASTCALL,
     "runs(items, lsn, payload, at, plans, relations, per_table, total, headers, max_bytes, "
     "limit, trailing, slots, tombstones) -> (records, total, leftover): the records of a "
     "transaction's row changes, run after run"},
    {"accelerate_sha256", (PyCFunction)accelerate_sha256, METH_O,
     "accelerate_sha256(on) -> whether the CPU's SHA extensions are in use"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "services.bridge.records._rowjson",
    .m_doc = "Rows' text values to JSON, compiled: the default record format's hot path",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__rowjson(void) {
    sha256_accelerate(1);
    if (PyType_Ready(&RowPlanType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RowPlanType);
    if (PyModule_AddObject(m, "RowPlan", (PyObject *)&RowPlanType) < 0) {
        Py_DECREF(&RowPlanType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
