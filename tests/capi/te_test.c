/* The C API's end-to-end test (run by tests/capi/run.sh):
 *   te_test              every test below
 *   te_test target       a target engine for the two-process tests: prints "PID ADDRESS",
 *                        waits for the notification "check", verifies what was written
 *                        into its region `dst`, exits 0 if every byte is right.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "te.h"

_Static_assert(sizeof(te_request) == 48, "te_request layout (checked from Rust too)");
_Static_assert(sizeof(te_peer_event) == 560, "te_peer_event layout (checked from Rust too)");

static const char *TCP = "[engine]\nbackend = \"tcp\"\ndefault_timeout = \"10s\"\n";
static const char *STUB = "[engine]\nbackend = \"stub\"\ndefault_timeout = \"10s\"\n";
enum { LEN = 4 << 20, CHUNK = 1 << 20 };

#define FAIL(...)                                                                  \
    do {                                                                           \
        fprintf(stderr, "%s:%d: ", __FILE__, __LINE__);                           \
        fprintf(stderr, __VA_ARGS__);                                              \
        fprintf(stderr, "\n");                                                     \
        exit(1);                                                                   \
    } while (0)

/* A call that must succeed. */
#define OK(call)                                                                   \
    do {                                                                           \
        int rc_ = (call);                                                          \
        if (rc_ != TE_OK)                                                          \
            FAIL("%s = %d (%s): %s", #call, rc_, te_status_name(rc_), te_last_error()); \
    } while (0)

/* A call that must fail with `want`, with a message. */
#define FAILS(want, call)                                                          \
    do {                                                                           \
        int rc_ = (call);                                                          \
        if (rc_ != (want) || te_last_error()[0] == '\0')                           \
            FAIL("%s = %d (%s), wanted %s: %s", #call, rc_, te_status_name(rc_),   \
                 te_status_name(want), te_last_error());                           \
    } while (0)

static uint8_t pattern(size_t i, unsigned seed) {
    return (uint8_t)(i * 131u + seed + (i >> 12));
}

static void fill(uint8_t *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) p[i] = pattern(i, seed);
}

/* The first index where `p` differs from the pattern, or n. */
static size_t mismatch(const uint8_t *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != pattern(i, seed)) return i;
    return n;
}

static int64_t now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static te_engine *engine(const char *config) {
    te_engine *e = NULL;
    OK(te_engine_new(config, &e));
    return e;
}

static void address_of(const te_engine *e, char *buf) { OK(te_engine_address(e, buf, 64)); }

/* ---- the target process ------------------------------------------------------------ */

static int target(void) {
    te_engine *e = engine(TCP);
    uint8_t *dst = calloc(1, LEN), *src = malloc(LEN);
    fill(src, LEN, 2);
    uint64_t rdst, rsrc;
    OK(te_engine_register(e, "dst", dst, LEN, "host", TE_ACCESS_REMOTE_WRITE, &rdst));
    OK(te_engine_register(e, "src", src, LEN, NULL, TE_ACCESS_REMOTE_READ, &rsrc));
    char address[64];
    address_of(e, address);
    printf("%d %s\n", (int)getpid(), address);
    fflush(stdout);
    te_notification *n = NULL;
    OK(te_engine_recv_notification(e, 30000, &n));
    size_t len = 0;
    const uint8_t *data = te_notification_data(n, &len);
    if (len != 5 || memcmp(data, "check", 5) != 0) FAIL("unexpected notification");
    te_notification_free(n);
    size_t bad = mismatch(dst, LEN, 1);
    if (bad != LEN) FAIL("target: byte %zu of %d differs from what was written", bad, LEN);
    OK(te_engine_deregister(e, rdst));
    OK(te_engine_deregister(e, rsrc));
    te_engine_free(e);
    free(dst);
    free(src);
    return 0;
}

/* Starts `self target`; its pid and address from its first line. */
/* Stops `pid` and waits (at most 2 s) until every thread of it has stopped: `kill`
 * returns before a running thread is stopped, and one that is not yet could still
 * answer a request sent right after. */
static void stop_process(int pid) {
    kill(pid, SIGSTOP);
    char dir[64];
    snprintf(dir, sizeof dir, "/proc/%d/task", pid);
    for (int tries = 0; tries < 2000; tries++) {
        DIR *d = opendir(dir);
        if (d == NULL) return;
        int running = 0;
        struct dirent *t;
        while ((t = readdir(d)) != NULL) {
            if (t->d_name[0] == '.') continue;
            char path[384], buf[512];
            snprintf(path, sizeof path, "%s/%s/stat", dir, t->d_name);
            FILE *f = fopen(path, "r");
            if (f == NULL) continue;
            size_t n = fread(buf, 1, sizeof buf - 1, f);
            fclose(f);
            buf[n] = 0;
            char *close = strrchr(buf, ')');
            if (close != NULL && close[1] == ' ' && close[2] != 'T' && close[2] != 't') running++;
        }
        closedir(d);
        if (running == 0) return;
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
    FAIL("process %d did not stop within 2 s of SIGSTOP", pid);
}

static FILE *start_target(const char *self, int *pid, char *address) {
    char command[4096];
    snprintf(command, sizeof command, "exec '%s' target", self);
    FILE *f = popen(command, "r");
    if (f == NULL || fscanf(f, "%d %63s", pid, address) != 2) FAIL("target did not start");
    return f;
}

/* ---- tests ------------------------------------------------------------------------- */

static void bad_configurations_are_reported_with_their_message(void) {
    te_engine *e = (te_engine *)&e; /* must stay untouched on failure */
    te_engine *const untouched = e;
    FAILS(TE_ERR_CONFIG_INVALID, te_engine_new("[engine]\nbackend = \"nope\"\n", &e));
    if (e != untouched) FAIL("te_engine_new wrote *out on failure");
    if (!strstr(te_last_error(), "nope") || !strstr(te_last_error(), "tcp") ||
        !strstr(te_last_error(), "stub"))
        FAIL("the message names neither the backend nor the available ones: %s", te_last_error());
    FAILS(TE_ERR_CONFIG_INVALID, te_engine_new("[engine\n", &e));
    FAILS(TE_ERR_CONFIG_INVALID, te_engine_new("[engine]\nbakend = \"tcp\"\n", &e));
    if (!strstr(te_last_error(), "bakend")) FAIL("unknown key not named: %s", te_last_error());
    FAILS(TE_ERR_CONFIG_INVALID, te_engine_from_file("/nonexistent/te.toml", &e));
    if (strcmp(te_status_name(TE_ERR_CONFIG_INVALID), "ConfigInvalid") != 0) FAIL("status name");
}

static void null_and_bad_arguments_are_errors(void) {
    char buf[64];
    FAILS(TE_ERR_INVALID_REQUEST, te_engine_new(NULL, NULL));
    if (!strstr(te_last_error(), "out")) FAIL("argument not named: %s", te_last_error());
    FAILS(TE_ERR_INVALID_REQUEST, te_engine_address(NULL, buf, sizeof buf));
    FAILS(TE_ERR_INVALID_REQUEST, te_batch_wait(NULL, 0));
    te_engine *e = engine(NULL);
    FAILS(TE_ERR_INVALID_REQUEST, te_engine_address(e, buf, 4));
    FAILS(TE_ERR_INVALID_REQUEST, te_engine_connect(e, NULL, 0, NULL));
    uint64_t id;
    FAILS(TE_ERR_INVALID_REQUEST, te_engine_register(e, "x", buf, sizeof buf, NULL, 8, &id));
    FAILS(TE_ERR_INVALID_REQUEST, te_engine_register(e, "x", buf, 0, NULL, 0, &id));
    FAILS(TE_ERR_UNSUPPORTED, te_engine_register(e, "x", buf, sizeof buf, "nodev:0", 0, &id));
    FAILS(TE_ERR_NOT_REGISTERED, te_engine_deregister(e, 12345));
    /* The metrics as JSON: a small buffer says how large a buffer they need. */
    size_t needed = 0;
    char small[8];
    FAILS(TE_ERR_INVALID_REQUEST, te_engine_metrics(e, small, sizeof small, &needed));
    if (needed < 64) FAIL("the metrics need %zu bytes?", needed);
    char *json = malloc(needed);
    OK(te_engine_metrics(e, json, needed, NULL));
    if (!strstr(json, "\"batches_submitted\":0")) FAIL("metrics: %s", json);
    free(json);
    /* "auto" asks the device runtimes; host memory stays host memory. */
    OK(te_engine_register(e, "auto", buf, sizeof buf, "auto", 0, &id));
    OK(te_engine_deregister(e, id));
    te_engine_free(e);
    te_engine_free(NULL);
    te_peer_free(NULL);
    te_batch_free(NULL);
    te_notification_free(NULL);
}

/* Two processes over TCP: WRITE 4 MiB in four requests, READ 4 MiB back, every byte
 * checked on both sides. */
static void two_processes_move_every_byte(const char *self) {
    int pid;
    char address[64];
    FILE *child = start_target(self, &pid, address);
    te_engine *e = engine(TCP);
    uint8_t *src = malloc(LEN), *back = calloc(1, LEN);
    fill(src, LEN, 1);
    uint64_t lsrc, lback, rdst, rsrc, len;
    OK(te_engine_register(e, "src", src, LEN, NULL, 0, &lsrc));
    OK(te_engine_register(e, "back", back, LEN, NULL, 0, &lback));
    te_peer *peer = NULL;
    OK(te_engine_connect(e, address, 5000, &peer));
    OK(te_peer_region(peer, "dst", &rdst, &len));
    if (len != LEN) FAIL("dst has %llu bytes", (unsigned long long)len);
    OK(te_peer_region(peer, "src", &rsrc, NULL));
    FAILS(TE_ERR_NOT_REGISTERED, te_peer_region(peer, "nope", &rsrc, NULL));

    te_request w[LEN / CHUNK];
    for (int i = 0; i < LEN / CHUNK; i++)
        w[i] = (te_request){TE_OP_WRITE, 0, lsrc, (uint64_t)i * CHUNK, rdst, (uint64_t)i * CHUNK, CHUNK};
    te_batch *b = NULL;
    OK(te_engine_transfer(e, peer, w, LEN / CHUNK, 0, NULL, 0, &b));
    OK(te_batch_wait(b, -1));
    OK(te_batch_status(b));
    te_batch_free(b);

    te_request r = {TE_OP_READ, 0, lback, 0, rsrc, 0, LEN};
    OK(te_engine_transfer(e, peer, &r, 1, 10000, NULL, 0, &b));
    OK(te_batch_wait(b, 10000));
    te_batch_free(b);
    size_t bad = mismatch(back, LEN, 2);
    if (bad != LEN) FAIL("READ: byte %zu differs", bad);

    /* The target checks its bytes when this arrives, and exits 0 if all are right. */
    OK(te_engine_transfer(e, peer, NULL, 0, 0, "check", 5, &b));
    OK(te_batch_wait(b, -1));
    te_batch_free(b);
    int status = pclose(child);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) FAIL("the target failed (%d)", status);
    te_peer_free(peer);
    OK(te_engine_deregister(e, lsrc));
    OK(te_engine_deregister(e, lback));
    te_engine_free(e);
    free(src);
    free(back);
}

/* A peer killed after connecting: a batch to it fails within its deadline, and so does
 * connecting to it again. */
static void a_dead_peer_is_reported_within_the_deadline(const char *self) {
    int pid;
    char address[64];
    FILE *child = start_target(self, &pid, address);
    te_engine *e = engine(TCP);
    uint8_t *src = calloc(1, CHUNK);
    uint64_t lsrc, rdst;
    OK(te_engine_register(e, "src", src, CHUNK, NULL, 0, &lsrc));
    te_peer *peer = NULL;
    OK(te_engine_connect(e, address, 5000, &peer));
    OK(te_peer_region(peer, "dst", &rdst, NULL));
    kill(pid, SIGKILL);
    pclose(child);

    int64_t start = now_ms();
    te_request w = {TE_OP_WRITE, 0, lsrc, 0, rdst, 0, CHUNK};
    te_batch *b = NULL;
    int rc = te_engine_transfer(e, peer, &w, 1, 2000, NULL, 0, &b);
    if (rc == TE_OK) {
        rc = te_batch_wait(b, 10000);
        te_batch_free(b);
    }
    int64_t took = now_ms() - start;
    if (rc >= 0 || took > 2000 + 1500)
        FAIL("a batch to a dead peer: %d (%s) after %lld ms", rc, te_status_name(rc), (long long)took);
    printf("  dead peer, batch: %s after %lld ms: %s\n", te_status_name(rc), (long long)took, te_last_error());

    te_peer *again = NULL;
    start = now_ms();
    rc = te_engine_connect(e, address, 1000, &again);
    took = now_ms() - start;
    if (rc >= 0 || took > 1000 + 1500)
        FAIL("connecting to a dead peer: %d after %lld ms", rc, (long long)took);
    printf("  dead peer, connect: %s after %lld ms\n", te_status_name(rc), (long long)took);
    te_peer_free(peer);
    te_engine_free(e);
    free(src);
}

/* A peer that hangs (stopped, its connections open): a batch to it fails within its
 * deadline. Its handle resolves once the backend released the batch's memory, which
 * te-tcp does when a socket operation on the hung peer times out (`io_timeout`, 10 s by
 * default, so 500 ms here): the failure is PeerUnreachable at io_timeout or Timeout at
 * the deadline, whichever comes first. */
static const char *TCP_SHORT_IO = "[engine]\nbackend = \"tcp\"\n[backends.tcp]\nio_timeout = \"500ms\"\n";

static void a_hung_peer_is_reported_within_the_deadline(const char *self) {
    int pid;
    char address[64];
    FILE *child = start_target(self, &pid, address);
    te_engine *e = engine(TCP_SHORT_IO);
    uint8_t *src = calloc(1, CHUNK);
    uint64_t lsrc, rdst;
    OK(te_engine_register(e, "src", src, CHUNK, NULL, 0, &lsrc));
    te_peer *peer = NULL;
    OK(te_engine_connect(e, address, 5000, &peer));
    OK(te_peer_region(peer, "dst", &rdst, NULL));
    stop_process(pid);

    int64_t start = now_ms();
    te_request w = {TE_OP_WRITE, 0, lsrc, 0, rdst, 0, CHUNK};
    te_batch *b = NULL;
    OK(te_engine_transfer(e, peer, &w, 1, 2000, NULL, 0, &b));
    if (te_batch_status(b) != TE_PENDING) FAIL("a batch to a stopped peer resolved at once");
    int rc = te_batch_wait(b, -1);
    int64_t took = now_ms() - start;
    if ((rc != TE_ERR_TIMEOUT && rc != TE_ERR_PEER_UNREACHABLE) || took < 400 || took > 2000 + 1000)
        FAIL("a batch to a hung peer: %d (%s) after %lld ms: %s", rc, te_status_name(rc),
             (long long)took, te_last_error());
    printf("  hung peer, batch: %s after %lld ms: %s\n", te_status_name(rc), (long long)took, te_last_error());
    te_batch_free(b);
    kill(pid, SIGKILL);
    kill(pid, SIGCONT);
    pclose(child);
    te_peer_free(peer);
    te_engine_free(e);
    free(src);
}

/* Something that accepts TCP connections and never answers: connect times out at its
 * deadline, not before and not much after. */
static void a_silent_peer_times_out_at_the_deadline(void) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof a;
    if (bind(s, (struct sockaddr *)&a, sizeof a) || listen(s, 16) ||
        getsockname(s, (struct sockaddr *)&a, &alen))
        FAIL("cannot listen");
    char address[64];
    snprintf(address, sizeof address, "127.0.0.1:%d", ntohs(a.sin_port));
    te_engine *e = engine(TCP);
    te_peer *peer = NULL;
    int64_t start = now_ms();
    int rc = te_engine_connect(e, address, 700, &peer);
    int64_t took = now_ms() - start;
    if (rc != TE_ERR_TIMEOUT || took < 600 || took > 700 + 1500)
        FAIL("silent peer: %d (%s) after %lld ms: %s", rc, te_status_name(rc), (long long)took,
             te_last_error());
    te_engine_free(e);
    close(s);
}

/* What a completion callback saw: how often it ran, the status, te_last_error() in it. */
struct done {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int calls, status;
    char error[256];
};

static void on_complete(void *user, int status) {
    struct done *d = user;
    pthread_mutex_lock(&d->lock);
    d->calls++;
    d->status = status;
    snprintf(d->error, sizeof d->error, "%s", te_last_error());
    pthread_cond_signal(&d->cond);
    pthread_mutex_unlock(&d->lock);
}

/* Waits (at most 10 s) for the callback's first call. */
static void wait_done(struct done *d) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 10;
    pthread_mutex_lock(&d->lock);
    while (d->calls == 0)
        if (pthread_cond_timedwait(&d->cond, &d->lock, &until)) FAIL("no completion callback");
    pthread_mutex_unlock(&d->lock);
}

/* Two engines of this process: callbacks, event fds, cancel, bounds, notifications,
 * KV blocks, peer events. */
static void one_process(void) {
    te_engine *a = engine(TCP), *b = engine(TCP);
    char aaddr[64], baddr[64];
    address_of(a, aaddr);
    address_of(b, baddr);
    uint8_t *kv = calloc(1, LEN), *src = malloc(LEN);
    fill(src, LEN, 3);
    uint64_t rkv, lsrc, remote;
    OK(te_engine_register(a, "kv", kv, LEN, NULL, TE_ACCESS_REMOTE_READ | TE_ACCESS_REMOTE_WRITE, &rkv));
    OK(te_engine_register(b, "src", src, LEN, NULL, 0, &lsrc));
    te_peer *peer = NULL;
    OK(te_engine_connect(b, aaddr, 0, &peer));
    OK(te_peer_region(peer, "kv", &remote, NULL));

    /* A completion callback, called once, from te's thread or this one. */
    struct done d = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 99, ""};
    te_request w = {TE_OP_WRITE, 0, lsrc, 0, remote, 0, LEN};
    te_batch *batch = NULL;
    OK(te_engine_transfer(b, peer, &w, 1, 0, NULL, 0, &batch));
    OK(te_batch_on_complete(batch, on_complete, &d));
    te_batch_free(batch); /* the callback still comes */
    wait_done(&d);
    if (d.status != TE_OK || d.calls != 1) FAIL("callback: status %d, %d calls", d.status, d.calls);
    if (mismatch(kv, LEN, 3) != LEN) FAIL("callback batch: bytes differ");

    /* An event fd that becomes readable when the batch resolves. */
    memset(kv, 0, LEN);
    OK(te_engine_transfer(b, peer, &w, 1, 0, NULL, 0, &batch));
    int fd = -1;
    OK(te_batch_eventfd(batch, &fd));
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 10000) != 1) FAIL("the event fd did not become readable");
    OK(te_batch_status(batch));
    close(fd);
    te_batch_free(batch);
    if (mismatch(kv, LEN, 3) != LEN) FAIL("eventfd batch: bytes differ");

    /* Cancel: the batch resolves, done or cancelled. */
    OK(te_engine_transfer(b, peer, &w, 1, 0, NULL, 0, &batch));
    OK(te_batch_cancel(batch));
    int rc = te_batch_wait(batch, -1);
    if (rc != TE_OK && rc != TE_ERR_CANCELLED) FAIL("cancelled batch: %s", te_status_name(rc));
    te_batch_free(batch);

    /* Requests outside a region are refused before anything moves. */
    te_request outside = {TE_OP_WRITE, 0, lsrc, 0, remote, 1, LEN};
    batch = NULL;
    FAILS(TE_ERR_OUT_OF_BOUNDS, te_engine_transfer(b, peer, &outside, 1, 0, NULL, 0, &batch));
    if (batch != NULL) FAIL("a refused batch was returned");
    te_request badop = {7, 0, lsrc, 0, remote, 0, 1};
    FAILS(TE_ERR_INVALID_REQUEST, te_engine_transfer(b, peer, &badop, 1, 0, NULL, 0, &batch));

    /* A notification, with its sender. */
    OK(te_engine_transfer(b, peer, NULL, 0, 0, "hello", 5, &batch));
    OK(te_batch_wait(batch, -1));
    te_batch_free(batch);
    te_notification *n = NULL;
    OK(te_engine_recv_notification(a, 5000, &n));
    size_t len = 0;
    const uint8_t *data = te_notification_data(n, &len);
    const char *from = NULL;
    const char *sender = te_notification_sender(n, &from);
    if (len != 5 || memcmp(data, "hello", 5) || strcmp(from, baddr) || sender[0] == '\0')
        FAIL("notification: %zu bytes from %s (%s)", len, from, sender);
    te_notification_free(n);
    if (te_engine_recv_notification(a, 0, &n) != TE_PENDING) FAIL("a second notification");

    /* KV layouts: blocks pushed and pulled by id, runs merged. */
    enum { BLOCK = 4096, BLOCKS = 16 };
    char json[512];
    const char *shape = "{\"name\": \"kv\", \"groups\": [{\"name\": \"layer0\", \"slots\": ["
                        "{\"name\": \"key\", \"region\": %llu, \"offset\": 0, \"bytes_per_block\": %d, \"blocks\": %d},"
                        "{\"name\": \"value\", \"region\": %llu, \"offset\": %d, \"bytes_per_block\": %d, \"blocks\": %d}]}]}";
    snprintf(json, sizeof json, shape, (unsigned long long)rkv, BLOCK, BLOCKS, (unsigned long long)rkv,
             BLOCK * BLOCKS, BLOCK, BLOCKS);
    OK(te_engine_register_layout(a, json));
    snprintf(json, sizeof json, shape, (unsigned long long)lsrc, BLOCK, BLOCKS, (unsigned long long)lsrc,
             BLOCK * BLOCKS, BLOCK, BLOCKS);
    OK(te_engine_register_layout(b, json));
    FAILS(TE_ERR_INVALID_REQUEST, te_engine_register_layout(b, "{\"name\": 1}"));
    memset(kv, 0, LEN);
    uint64_t remote_ids[] = {1, 2, 5}, local_ids[] = {0, 1, 2};
    OK(te_engine_push_blocks(b, peer, "kv", remote_ids, local_ids, 3, 0, NULL, 0, &batch));
    OK(te_batch_wait(batch, -1));
    te_batch_free(batch);
    for (int s = 0; s < 2; s++)
        for (int i = 0; i < 3; i++) {
            size_t at = (size_t)s * BLOCK * BLOCKS;
            if (memcmp(kv + at + remote_ids[i] * BLOCK, src + at + local_ids[i] * BLOCK, BLOCK))
                FAIL("push_blocks: slot %d block %d differs", s, i);
        }
    memset(src, 0, LEN);
    OK(te_engine_pull_blocks(b, peer, "kv", remote_ids, local_ids, 3, 0, NULL, 0, &batch));
    OK(te_batch_wait(batch, -1));
    te_batch_free(batch);
    if (memcmp(src, kv + BLOCK, 2 * BLOCK) || memcmp(src + 2 * BLOCK, kv + 5 * BLOCK, BLOCK))
        FAIL("pull_blocks: bytes differ");
    OK(te_engine_deregister_layout(b, "kv"));
    OK(te_engine_deregister_layout(a, "kv"));
    FAILS(TE_ERR_NOT_REGISTERED, te_engine_deregister_layout(a, "kv"));

    /* A peer with a session that shuts down is an event on the other side. */
    te_peer_free(peer);
    OK(te_engine_deregister(b, lsrc));
    te_engine_free(b);
    te_peer_event ev;
    OK(te_engine_recv_event(a, 10000, &ev));
    if ((ev.kind != TE_PEER_LEFT && ev.kind != TE_PEER_LOST) || strcmp(ev.address, baddr))
        FAIL("peer event: kind %d from %s", ev.kind, ev.address);
    OK(te_engine_deregister(a, rkv));
    te_engine_free(a);
    free(kv);
    free(src);
}

struct worker {
    te_engine *engine;
    te_peer *peer;
    uint64_t local, remote, offset;
    int failed;
};

static void *work(void *arg) {
    struct worker *w = arg;
    for (int i = 0; i < 20 && !w->failed; i++) {
        te_request r = {TE_OP_WRITE, 0, w->local, w->offset, w->remote, w->offset, CHUNK / 4};
        te_batch *b = NULL;
        if (te_engine_transfer(w->engine, w->peer, &r, 1, 0, NULL, 0, &b) != TE_OK ||
            te_batch_wait(b, -1) != TE_OK)
            w->failed = 1;
        te_batch_free(b);
        /* Each thread's last error is its own. */
        char mine[32];
        snprintf(mine, sizeof mine, "no-such-region-%llu", (unsigned long long)w->offset);
        uint64_t id;
        if (te_peer_region(w->peer, mine, &id, NULL) != TE_ERR_NOT_REGISTERED ||
            !strstr(te_last_error(), mine))
            w->failed = 2;
    }
    return NULL;
}

/* Four threads share one engine and one peer, each moving its own quarter. */
static void threads_share_an_engine(void) {
    te_engine *a = engine(TCP), *b = engine(TCP);
    char aaddr[64];
    address_of(a, aaddr);
    uint8_t *dst = calloc(1, CHUNK), *src = malloc(CHUNK);
    fill(src, CHUNK, 4);
    uint64_t rdst, lsrc, remote;
    OK(te_engine_register(a, "dst", dst, CHUNK, NULL, TE_ACCESS_REMOTE_WRITE, &rdst));
    OK(te_engine_register(b, "src", src, CHUNK, NULL, 0, &lsrc));
    te_peer *peer = NULL;
    OK(te_engine_connect(b, aaddr, 0, &peer));
    OK(te_peer_region(peer, "dst", &remote, NULL));
    pthread_t t[4];
    struct worker w[4];
    for (int i = 0; i < 4; i++) {
        w[i] = (struct worker){b, peer, lsrc, remote, (uint64_t)i * (CHUNK / 4), 0};
        pthread_create(&t[i], NULL, work, &w[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(t[i], NULL);
        if (w[i].failed) FAIL("thread %d failed (%d)", i, w[i].failed);
    }
    if (mismatch(dst, CHUNK, 4) != CHUNK) FAIL("threads: bytes differ");
    te_peer_free(peer);
    te_engine_free(b);
    te_engine_free(a);
    free(dst);
    free(src);
}

/* Two engines of this process, `b` connected to `a`: `a` registers `dst` (LEN bytes,
 * zeroed, peers may read and write it), `b` registers `src` (LEN bytes of pattern 5). */
struct pair {
    te_engine *a, *b;
    te_peer *peer;
    uint8_t *dst, *src;
    uint64_t rdst, lsrc, remote;
};

static void pair_up(struct pair *p, const char *config) {
    p->a = engine(config);
    p->b = engine(config);
    char address[64];
    address_of(p->a, address);
    p->dst = calloc(1, LEN);
    p->src = malloc(LEN);
    fill(p->src, LEN, 5);
    OK(te_engine_register(p->a, "dst", p->dst, LEN, NULL,
                          TE_ACCESS_REMOTE_READ | TE_ACCESS_REMOTE_WRITE, &p->rdst));
    OK(te_engine_register(p->b, "src", p->src, LEN, NULL, 0, &p->lsrc));
    OK(te_engine_connect(p->b, address, 0, &p->peer));
    OK(te_peer_region(p->peer, "dst", &p->remote, NULL));
}

/* Frees what pair_up made; an engine already freed is NULL. */
static void pair_free(struct pair *p) {
    te_peer_free(p->peer);
    te_engine_free(p->b);
    te_engine_free(p->a);
    free(p->dst);
    free(p->src);
}

/* Requests, lengths, strings and enum values no call can take are refused, the
 * argument named where it is one of the call's arrays; huge timeouts are no limit. */
static void bad_requests_are_refused(void) {
    struct pair p;
    pair_up(&p, STUB);
    te_request w = {TE_OP_WRITE, 0, p.lsrc, 0, p.remote, 0, 16};
    te_batch *batch = NULL;
    uint64_t id, ids[1] = {0};
    /* A count or length no array can have (more than the address space) is never read. */
    FAILS(TE_ERR_INVALID_REQUEST,
          te_engine_transfer(p.b, p.peer, &w, SIZE_MAX / sizeof w, 0, NULL, 0, &batch));
    if (!strstr(te_last_error(), "requests")) FAIL("argument not named: %s", te_last_error());
    FAILS(TE_ERR_INVALID_REQUEST, te_engine_transfer(p.b, p.peer, NULL, 0, 0, "hi", SIZE_MAX, &batch));
    if (!strstr(te_last_error(), "notify")) FAIL("argument not named: %s", te_last_error());
    FAILS(TE_ERR_INVALID_REQUEST, te_engine_push_blocks(p.b, p.peer, "kv", ids, ids,
                                                        SIZE_MAX / sizeof ids[0], 0, NULL, 0, &batch));
    if (!strstr(te_last_error(), "_ids")) FAIL("argument not named: %s", te_last_error());
    char bad[] = {'k', (char)0xff, (char)0xfe, 0};
    FAILS(TE_ERR_INVALID_REQUEST, te_engine_register(p.a, bad, p.dst, 16, NULL, 0, &id));
    FAILS(TE_ERR_INVALID_REQUEST, te_engine_register(p.a, "x", p.dst, 16, "host", 0x80, &id));
    if (te_engine_register(p.a, "x", p.dst, 16, "gpu:-1", 0, &id) >= 0) FAIL("memory gpu:-1");
    if (te_engine_register(p.a, "x", (void *)(uintptr_t)-8, 64, NULL, 0, &id) >= 0)
        FAIL("a region that wraps was registered");
    te_request reserved = {TE_OP_WRITE, 1, p.lsrc, 0, p.remote, 0, 16};
    FAILS(TE_ERR_INVALID_REQUEST, te_engine_transfer(p.b, p.peer, &reserved, 1, 0, NULL, 0, &batch));
    te_request far = {TE_OP_WRITE, 0, p.lsrc, UINT64_MAX, p.remote, 0, 16};
    if (te_engine_transfer(p.b, p.peer, &far, 1, 0, NULL, 0, &batch) >= 0) FAIL("offset UINT64_MAX");
    te_request wrap = {TE_OP_WRITE, 0, p.lsrc, 8, p.remote, UINT64_MAX - 4, 16};
    if (te_engine_transfer(p.b, p.peer, &wrap, 1, 0, NULL, 0, &batch) >= 0)
        FAIL("a remote offset that wraps");
    OK(te_engine_transfer(p.b, p.peer, &w, 1, UINT64_MAX, NULL, 0, &batch));
    OK(te_batch_wait(batch, INT64_MAX));
    te_batch_free(batch);
    OK(te_engine_transfer(p.b, p.peer, NULL, 0, UINT64_MAX, "x", 1, &batch));
    OK(te_batch_wait(batch, INT64_MAX));
    te_batch_free(batch);
    te_notification *n = NULL;
    OK(te_engine_recv_notification(p.a, INT64_MAX, &n));
    te_notification_free(n);
    pair_free(&p);
}

/* A completion callback may submit the next batch (a pipeline): eight in a row. */
struct chain {
    struct done done;
    struct pair *p;
    int left;
};

static void next_link(void *user, int status);

static int submit_link(struct chain *c) {
    te_request w = {TE_OP_WRITE, 0, c->p->lsrc, 0, c->p->remote, 0, LEN};
    te_batch *b = NULL;
    int rc = te_engine_transfer(c->p->b, c->p->peer, &w, 1, 0, NULL, 0, &b);
    if (rc != TE_OK) return rc;
    rc = te_batch_on_complete(b, next_link, c);
    te_batch_free(b);
    return rc;
}

/* Runs after the batch submitted last: only one link at a time touches `c`, and none
 * after it reports the end. */
static void next_link(void *user, int status) {
    struct chain *c = user;
    int more = status == TE_OK && --c->left > 0;
    int rc = more ? submit_link(c) : status;
    if (!more || rc != TE_OK) on_complete(&c->done, rc);
}

static void callbacks_may_submit_the_next_batch(const char *config) {
    struct pair p;
    pair_up(&p, config);
    struct chain c = {{PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 99, ""}, &p, 8};
    OK(submit_link(&c));
    wait_done(&c.done);
    if (c.done.status != TE_OK) FAIL("chain (%d left): %s", c.left, c.done.error);
    if (mismatch(p.dst, LEN, 5) != LEN) FAIL("chain: bytes differ");
    pair_free(&p);
}

/* A failed batch's message is readable (te_last_error) inside its callback. */
static void a_failed_batch_has_its_message_in_the_callback(void) {
    struct pair p;
    pair_up(&p, TCP);
    te_request w = {TE_OP_WRITE, 0, p.lsrc, 0, p.remote, 0, LEN};
    for (int i = 0; i < 20; i++) {
        te_batch *b = NULL;
        OK(te_engine_transfer(p.b, p.peer, &w, 1, 0, NULL, 0, &b));
        OK(te_batch_cancel(b));
        struct done d = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 99, ""};
        OK(te_batch_on_complete(b, on_complete, &d));
        wait_done(&d);
        te_batch_free(b);
        if (d.status < 0 && d.error[0] == '\0')
            FAIL("callback got %s, and te_last_error() was empty in it", te_status_name(d.status));
    }
    pair_free(&p);
}

/* A batch and a peer handle outlive their engine: the batch resolves, a late callback
 * comes once with the same status, the peer answers with an error. */
static void handles_outlive_their_engine(void) {
    struct pair p;
    pair_up(&p, TCP);
    te_request w = {TE_OP_WRITE, 0, p.lsrc, 0, p.remote, 0, LEN};
    te_batch *batch = NULL;
    OK(te_engine_transfer(p.b, p.peer, &w, 1, 0, NULL, 0, &batch));
    te_engine_free(p.b);
    p.b = NULL;
    int rc = te_batch_wait(batch, 15000);
    if (rc == TE_PENDING) FAIL("a batch of a freed engine is still pending after 15 s");
    struct done d = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 99, ""};
    OK(te_batch_on_complete(batch, on_complete, &d));
    wait_done(&d);
    if (d.calls != 1 || d.status != rc) FAIL("late callback: %d calls, status %d (wait said %d)", d.calls, d.status, rc);
    uint64_t id = 0;
    rc = te_peer_region(p.peer, "dst", &id, NULL);
    if (rc != TE_OK && rc >= 0) FAIL("te_peer_region after the engine's free = %d", rc);
    te_batch_free(batch);
    pair_free(&p);
}

/* An engine from a configuration file. */
static void an_engine_comes_from_a_file(void) {
    char path[] = "/tmp/te-capi-XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0 || write(fd, TCP, strlen(TCP)) != (ssize_t)strlen(TCP)) FAIL("cannot write %s", path);
    close(fd);
    te_engine *e = NULL;
    OK(te_engine_from_file(path, &e));
    unlink(path);
    char address[64];
    address_of(e, address);
    te_engine_free(e);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "target") == 0) return target();
    if (te_abi_version() != TE_ABI_VERSION) FAIL("library ABI %u, header %u", te_abi_version(), TE_ABI_VERSION);
    printf("te %s, C ABI %u\n", te_version(), te_abi_version());
#define RUN(t) (printf("%s\n", #t), fflush(stdout), t)
    RUN(bad_configurations_are_reported_with_their_message());
    RUN(null_and_bad_arguments_are_errors());
    RUN(bad_requests_are_refused());
    RUN(two_processes_move_every_byte(argv[0]));
    RUN(a_dead_peer_is_reported_within_the_deadline(argv[0]));
    RUN(a_hung_peer_is_reported_within_the_deadline(argv[0]));
    RUN(a_silent_peer_times_out_at_the_deadline());
    RUN(one_process());
    RUN(threads_share_an_engine());
    RUN(an_engine_comes_from_a_file());
    RUN(callbacks_may_submit_the_next_batch(TCP));
    RUN(callbacks_may_submit_the_next_batch(STUB));
    RUN(a_failed_batch_has_its_message_in_the_callback());
    RUN(handles_outlive_their_engine());
    printf("C tests: ok\n");
    return 0;
}
