/* The floor of handing records to librdkafka from C, for bench/produce_floor.py --c.

   The same records, transactions and producer settings as the Python ways of that bench,
   handed over with librdkafka's public rd_kafka_producev (headers included) by a program
   that owns its producer: what an extension owning its librdkafka producer could reach at
   best, per record. Built by produce_floor.py against librdkafka's public header (Debian's
   librdkafka-dev) and the librdkafka that confluent-kafka's wheel bundles, so the library
   is the one the bridge runs.

   Arguments: TOPIC RECORDS BATCH VALUE_FILE, then "c:name=value" for each producer
   setting and "h:name=value" for each header on every record. Keys are {"id":N}, as the
   Python ways make them. Prints "seconds cpu_seconds handing_over_seconds version": the
   wall time of the transactions, this process's CPU (librdkafka's threads included), the
   time spent in the produce calls and the librdkafka version that ran. */
#include <librdkafka/rdkafka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#define MAX_HEADERS 16

typedef struct {
    const char *name;
    const char *value;
    size_t size;
} Header;

static double process_cpu(void) {
    struct rusage usage;
    getrusage(RUSAGE_SELF, &usage);
    return usage.ru_utime.tv_sec + usage.ru_stime.tv_sec +
           (usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
}

static double clock_s(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void fail(const char *what, const char *why) {
    fprintf(stderr, "produce_floor.c: %s: %s\n", what, why);
    exit(1);
}

static void check(const char *what, rd_kafka_error_t *error) {
    if (error != NULL)
        fail(what, rd_kafka_error_string(error));
}

static char *read_file(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        fail("cannot open the value file", path);
    fseek(f, 0, SEEK_END);
    *size = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    char *bytes = malloc(*size ? *size : 1);
    if (bytes == NULL || fread(bytes, 1, *size, f) != *size)
        fail("cannot read the value file", path);
    fclose(f);
    return bytes;
}

/* One record with its headers; a full queue is waited out as the Python ways do. */
static void produce(rd_kafka_t *rk, const char *topic, const char *key, size_t key_size,
                    const char *value, size_t value_size, const Header *headers, int n_headers) {
    rd_kafka_vu_t vus[4 + MAX_HEADERS];
    int n = 0;
    vus[n].vtype = RD_KAFKA_VTYPE_TOPIC;
    vus[n++].u.cstr = topic;
    vus[n].vtype = RD_KAFKA_VTYPE_MSGFLAGS;
    vus[n++].u.i = RD_KAFKA_MSG_F_COPY;
    vus[n].vtype = RD_KAFKA_VTYPE_KEY;
    vus[n].u.mem.ptr = (void *)key;
    vus[n++].u.mem.size = key_size;
    vus[n].vtype = RD_KAFKA_VTYPE_VALUE;
    vus[n].u.mem.ptr = (void *)value;
    vus[n++].u.mem.size = value_size;
    for (int h = 0; h < n_headers; h++, n++) {
        vus[n].vtype = RD_KAFKA_VTYPE_HEADER;
        vus[n].u.header.name = headers[h].name;
        vus[n].u.header.val = headers[h].value;
        vus[n].u.header.size = (ssize_t)headers[h].size;
    }
    for (;;) {
        rd_kafka_error_t *error = rd_kafka_produceva(rk, vus, (size_t)n);
        if (error == NULL)
            return;
        if (rd_kafka_error_code(error) != RD_KAFKA_RESP_ERR__QUEUE_FULL)
            fail("produce", rd_kafka_error_string(error));
        rd_kafka_error_destroy(error);
        rd_kafka_poll(rk, 50);
    }
}

int main(int argc, char **argv) {
    if (argc < 5)
        fail("usage", "TOPIC RECORDS BATCH VALUE_FILE [c:name=value] [h:name=value]");
    const char *topic = argv[1];
    long records = atol(argv[2]), batch = atol(argv[3]);
    size_t value_size;
    char *value = read_file(argv[4], &value_size);
    char reason[512];
    rd_kafka_conf_t *conf = rd_kafka_conf_new();
    Header headers[MAX_HEADERS];
    int n_headers = 0;
    for (int i = 5; i < argc; i++) {
        char *pair = argv[i], *equals = strchr(pair, '=');
        if (equals == NULL || pair[1] != ':')
            fail("not c:name=value or h:name=value", pair);
        *equals = '\0';
        if (pair[0] == 'c') {
            if (rd_kafka_conf_set(conf, pair + 2, equals + 1, reason, sizeof reason))
                fail(pair + 2, reason);
        } else if (n_headers < MAX_HEADERS) {
            headers[n_headers++] = (Header){pair + 2, equals + 1, strlen(equals + 1)};
        }
    }
    rd_kafka_t *rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, reason, sizeof reason);
    if (rk == NULL)
        fail("cannot make the producer", reason);
    check("init_transactions", rd_kafka_init_transactions(rk, 60000));

    double cpu_began = process_cpu(), began = clock_s(CLOCK_MONOTONIC), inside = 0;
    for (long first = 0; first < records; first += batch) {
        check("begin_transaction", rd_kafka_begin_transaction(rk));
        double called = clock_s(CLOCK_MONOTONIC);
        for (long i = first; i < first + batch && i < records; i++) {
            char key[32];
            int key_size = snprintf(key, sizeof key, "{\"id\":%ld}", i);
            produce(rk, topic, key, (size_t)key_size, value, value_size, headers, n_headers);
        }
        inside += clock_s(CLOCK_MONOTONIC) - called;
        check("commit_transaction", rd_kafka_commit_transaction(rk, 60000));
    }
    printf("%.6f %.6f %.6f %s\n", clock_s(CLOCK_MONOTONIC) - began, process_cpu() - cpu_began,
           inside, rd_kafka_version_str());
    rd_kafka_destroy(rk);
    free(value);
    return 0;
}
