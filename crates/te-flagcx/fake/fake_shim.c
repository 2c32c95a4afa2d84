/*
 * A FAKE implementation of te_flagcx_shim.h, for tests. It is not FlagCX.
 *
 * It keeps FlagCX's P2P engine's shape where te's backend depends on it:
 * - a connection carries a snapshot of the peer's registered regions, taken at
 *   connect time; a remote range outside the snapshot is refused as stale;
 * - a descriptor has a size limit (option max_desc), so the backend must split;
 * - completion is queried, and a transfer id is released once it reported done;
 * - a failed slice is "done": a transfer with failed slices finishes like any other,
 *   with a failed-slice count, as FlagCX's transfer task does, and the status comes
 *   from te_flagcx_status.h, the mapping the real shim uses.
 *
 * Bytes really move between processes: each engine listens on a loopback TCP port,
 * a connection is a TCP stream served by one thread on each side, and the target
 * checks every remote range against its own registrations before touching memory.
 *
 * Options (engine_create, comma-separated key=value):
 *   host=127.0.0.1   address to listen on (IPv4)
 *   max_desc=N       per-descriptor size limit in bytes (default 1 GiB)
 *   delay_ms=N       a transfer moves its bytes N ms after it was posted, then
 *                    reports done
 *   fail_every=N     every Nth post of this engine finishes with a failed slice: its
 *                    last descriptor's bytes never move, the others do
 *   stale_every=N    every Nth post of this engine fails as a stale registration
 *   fail_connect=1   every connect of this engine fails as unreachable
 *   connect_delay_ms=N  every connect of this engine takes N ms more (a slow
 *                    handshake)
 *
 * te_flagcx_events / te_flagcx_wait block for real: each finished transfer bumps the
 * engine's event counter and wakes waiters.
 *
 * te_flagcx_fake_counter(name) reads process-wide counters for tests: "posts",
 * "descs", "connects", and "misuse" (queries of unknown or released transfer ids).
 */
#define _GNU_SOURCE
#include "../shim/te_flagcx_shim.h"
#include "../shim/te_flagcx_status.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define FAKE_MAGIC 0x54454658u /* "TEFX" */
#define FAKE_WIRE_VERSION 1u
#define FAKE_MAX_REGIONS_ON_WIRE 65536u
#define FAKE_MAX_DESCS_ON_WIRE (1u << 20)

static __thread char last_error[512];

static uint64_t counter_posts, counter_descs, counter_connects, counter_misuse;

static int fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return code;
}

/* ---------------------------------------------------------------- regions */

typedef struct region {
  uint64_t mr, addr, len;
} region;

static int contains(const region *r, uint64_t addr, uint64_t len) {
  return addr >= r->addr && len <= r->len && addr - r->addr <= r->len - len;
}

/* ---------------------------------------------------------------- engine */

typedef struct server_conn {
  int fd;
  pthread_t thread;
  struct server_conn *next;
} server_conn;

struct te_flagcx_engine {
  pthread_rwlock_t lock; /* guards regions; held by anyone touching their memory */
  region *regions;
  size_t nregions, cap;
  uint64_t next_mr;

  char host[64];
  uint64_t max_desc;
  unsigned delay_ms, fail_every, stale_every, connect_delay_ms;
  int fail_connect;
  uint64_t posts;

  pthread_mutex_t srv_lock;
  int listen_fd;
  int serving, stopping;
  pthread_t accept_thread;
  server_conn *served;
  char endpoint[96];

  pthread_mutex_t ev_lock; /* guards events */
  pthread_cond_t ev_cond;
  uint64_t events;
};

static void init_monotonic_cond(pthread_cond_t *cond) {
  pthread_condattr_t attr;
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_cond_init(cond, &attr);
  pthread_condattr_destroy(&attr);
}

static void bump_events(te_flagcx_engine *e) {
  pthread_mutex_lock(&e->ev_lock);
  e->events++;
  pthread_cond_broadcast(&e->ev_cond);
  pthread_mutex_unlock(&e->ev_lock);
}

/* ---------------------------------------------------------------- sockets */

static int send_all(int fd, const void *buf, uint64_t len) {
  const char *p = buf;
  while (len > 0) {
    size_t chunk = len > (1u << 30) ? (1u << 30) : (size_t)len;
    ssize_t n = send(fd, p, chunk, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    p += n;
    len -= (uint64_t)n;
  }
  return 0;
}

static int recv_all(int fd, void *buf, uint64_t len) {
  char *p = buf;
  while (len > 0) {
    size_t chunk = len > (1u << 30) ? (1u << 30) : (size_t)len;
    ssize_t n = recv(fd, p, chunk, 0);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    p += n;
    len -= (uint64_t)n;
  }
  return 0;
}

static int drain(int fd, uint64_t len) {
  char scratch[65536];
  while (len > 0) {
    uint64_t n = len > sizeof scratch ? sizeof scratch : len;
    if (recv_all(fd, scratch, n) != 0)
      return -1;
    len -= n;
  }
  return 0;
}

static void tune(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* Wire structs travel in native byte order: the fake connects processes of one host. */
typedef struct hello {
  uint32_t magic, version;
} hello;

typedef struct request_header {
  uint32_t magic, op, count, reserved;
  uint64_t total;
} request_header;

typedef struct wire_range {
  uint64_t addr, len;
} wire_range;

typedef struct reply_header {
  int32_t status;
  uint32_t msglen;
} reply_header;

/* ---------------------------------------------------------------- target side */

static int reply(int fd, int32_t status, const char *msg) {
  reply_header h = {status, (uint32_t)strlen(msg)};
  if (send_all(fd, &h, sizeof h) != 0)
    return -1;
  return send_all(fd, msg, h.msglen);
}

static int serve_handshake(te_flagcx_engine *e, int fd) {
  hello h;
  if (recv_all(fd, &h, sizeof h) != 0 || h.magic != FAKE_MAGIC ||
      h.version != FAKE_WIRE_VERSION)
    return -1;
  pthread_rwlock_rdlock(&e->lock);
  uint32_t n = (uint32_t)e->nregions;
  wire_range *table = calloc(n ? n : 1, sizeof *table);
  for (uint32_t i = 0; table && i < n; i++) {
    table[i].addr = e->regions[i].addr;
    table[i].len = e->regions[i].len;
  }
  pthread_rwlock_unlock(&e->lock);
  if (!table)
    return -1;
  int rc = send_all(fd, &n, sizeof n) == 0 &&
                   send_all(fd, table, (uint64_t)n * sizeof *table) == 0
               ? 0
               : -1;
  free(table);
  return rc;
}

/* Serves one request; -1 ends the connection. */
static int serve_request(te_flagcx_engine *e, int fd) {
  request_header h;
  if (recv_all(fd, &h, sizeof h) != 0 || h.magic != FAKE_MAGIC ||
      h.count == 0 || h.count > FAKE_MAX_DESCS_ON_WIRE)
    return -1;
  wire_range *ranges = malloc((size_t)h.count * sizeof *ranges);
  if (!ranges)
    return -1;
  if (recv_all(fd, ranges, (uint64_t)h.count * sizeof *ranges) != 0) {
    free(ranges);
    return -1;
  }
  int rc = 0;
  char msg[256] = "";
  pthread_rwlock_rdlock(&e->lock);
  uint32_t bad = h.count;
  for (uint32_t i = 0; i < h.count && bad == h.count; i++) {
    int ok = 0;
    for (size_t r = 0; r < e->nregions && !ok; r++)
      ok = contains(&e->regions[r], ranges[i].addr, ranges[i].len);
    if (!ok)
      bad = i;
  }
  if (bad != h.count) {
    snprintf(msg, sizeof msg,
             "the target has no registration containing 0x%llx+%llu "
             "(deregistered since the initiator connected?)",
             (unsigned long long)ranges[bad].addr,
             (unsigned long long)ranges[bad].len);
    pthread_rwlock_unlock(&e->lock);
    if (h.op == TE_FLAGCX_OP_WRITE && drain(fd, h.total) != 0)
      rc = -1;
    else
      rc = reply(fd, TE_FLAGCX_E_NOT_REGISTERED, msg);
    free(ranges);
    return rc;
  }
  if (h.op == TE_FLAGCX_OP_WRITE) {
    for (uint32_t i = 0; i < h.count && rc == 0; i++)
      rc = recv_all(fd, (void *)(uintptr_t)ranges[i].addr, ranges[i].len);
    if (rc == 0)
      rc = reply(fd, TE_FLAGCX_OK, "");
  } else {
    rc = reply(fd, TE_FLAGCX_OK, "");
    for (uint32_t i = 0; i < h.count && rc == 0; i++)
      rc = send_all(fd, (const void *)(uintptr_t)ranges[i].addr, ranges[i].len);
  }
  pthread_rwlock_unlock(&e->lock);
  free(ranges);
  return rc;
}

typedef struct serve_args {
  te_flagcx_engine *engine;
  int fd;
} serve_args;

static void *serve_thread(void *arg) {
  serve_args a = *(serve_args *)arg;
  free(arg);
  if (serve_handshake(a.engine, a.fd) == 0)
    while (serve_request(a.engine, a.fd) == 0) {
    }
  shutdown(a.fd, SHUT_RDWR);
  return NULL;
}

static void *accept_thread(void *arg) {
  te_flagcx_engine *e = arg;
  for (;;) {
    int fd = accept(e->listen_fd, NULL, NULL);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED)
        continue;
      return NULL;
    }
    tune(fd);
    pthread_mutex_lock(&e->srv_lock);
    server_conn *sc = calloc(1, sizeof *sc);
    serve_args *args = malloc(sizeof *args);
    if (e->stopping || !sc || !args) {
      pthread_mutex_unlock(&e->srv_lock);
      free(sc);
      free(args);
      close(fd);
      if (e->stopping)
        return NULL;
      continue;
    }
    args->engine = e;
    args->fd = fd;
    sc->fd = fd;
    if (pthread_create(&sc->thread, NULL, serve_thread, args) != 0) {
      pthread_mutex_unlock(&e->srv_lock);
      free(sc);
      free(args);
      close(fd);
      continue;
    }
    sc->next = e->served;
    e->served = sc;
    pthread_mutex_unlock(&e->srv_lock);
  }
}

/* ---------------------------------------------------------------- initiator side */

enum { INJECT_NONE, INJECT_FAIL, INJECT_STALE };

typedef struct job {
  uint64_t id;
  int op, inject;
  uint32_t count;
  te_flagcx_desc *descs;
  struct timespec due;
  struct job *next;
} job;

typedef struct xfer {
  uint64_t id;
  int status;
  char msg[256];
} xfer;

struct te_flagcx_conn {
  te_flagcx_engine *engine;
  int fd;
  char peer[96];
  wire_range *snapshot;
  uint32_t nsnapshot;

  pthread_mutex_t lock;
  pthread_cond_t cond;
  job *head, *tail;
  xfer *xfers;
  size_t nxfers, capxfers;
  uint64_t next_id;
  int stop, broken;
  pthread_t worker;
};

static void set_status(te_flagcx_conn *c, uint64_t id, int status,
                       const char *msg) {
  pthread_mutex_lock(&c->lock);
  for (size_t i = 0; i < c->nxfers; i++) {
    if (c->xfers[i].id == id) {
      c->xfers[i].status = status;
      snprintf(c->xfers[i].msg, sizeof c->xfers[i].msg, "%s", msg);
      break;
    }
  }
  pthread_mutex_unlock(&c->lock);
}

static int local_ok(te_flagcx_engine *e, const te_flagcx_desc *d) {
  for (size_t r = 0; r < e->nregions; r++)
    if (e->regions[r].mr == d->local_mr)
      return contains(&e->regions[r], d->local_addr, d->len);
  return 0;
}

/* The status of a job whose descriptors after the first `moved` failed, through the
   mapping the real shim uses. */
static int finished(te_flagcx_conn *c, const job *j, uint32_t moved, char *msg,
                    size_t cap) {
  uint64_t failed = j->count - moved;
  int status = te_flagcx_status(1, failed);
  if (status != TE_FLAGCX_OK)
    snprintf(msg, cap,
             "the transfer to %s finished with %llu failed slice(s) of %u: some of "
             "its bytes did not arrive (injected by fake shim option fail_every=%u)",
             c->peer, (unsigned long long)failed, j->count, c->engine->fail_every);
  return status;
}

/* Runs a job over the connection; returns a status and fills msg. A job with an
   injected failure moves every descriptor but its last, and finishes with one failed
   slice. */
static int run_job(te_flagcx_conn *c, job *j, char *msg, size_t cap) {
  uint32_t moved = j->count;
  if (j->inject == INJECT_FAIL)
    moved--;
  if (j->inject == INJECT_STALE) {
    snprintf(msg, cap,
             "injected stale registration: the peer's region table changed since "
             "connect (fake shim option stale_every=%u)",
             c->engine->stale_every);
    return TE_FLAGCX_E_STALE;
  }
  if (__atomic_load_n(&c->broken, __ATOMIC_ACQUIRE)) {
    snprintf(msg, cap, "the connection to %s is broken", c->peer);
    return TE_FLAGCX_E_UNREACHABLE;
  }
  te_flagcx_engine *e = c->engine;
  pthread_rwlock_rdlock(&e->lock);
  for (uint32_t i = 0; i < j->count; i++) {
    if (!local_ok(e, &j->descs[i])) {
      pthread_rwlock_unlock(&e->lock);
      snprintf(msg, cap,
               "local memory handle %llu does not cover 0x%llx+%llu "
               "(deregistered while the transfer was queued?)",
               (unsigned long long)j->descs[i].local_mr,
               (unsigned long long)j->descs[i].local_addr,
               (unsigned long long)j->descs[i].len);
      return TE_FLAGCX_E_NOT_REGISTERED;
    }
  }
  if (moved == 0) {
    pthread_rwlock_unlock(&e->lock);
    return finished(c, j, moved, msg, cap);
  }
  request_header h = {FAKE_MAGIC, (uint32_t)j->op, moved, 0, 0};
  wire_range *ranges = malloc((size_t)moved * sizeof *ranges);
  if (!ranges) {
    pthread_rwlock_unlock(&e->lock);
    snprintf(msg, cap, "out of memory");
    return TE_FLAGCX_E_INTERNAL;
  }
  for (uint32_t i = 0; i < moved; i++) {
    ranges[i].addr = j->descs[i].remote_addr;
    ranges[i].len = j->descs[i].len;
    h.total += j->descs[i].len;
  }
  int io = send_all(c->fd, &h, sizeof h) == 0 &&
                   send_all(c->fd, ranges, (uint64_t)moved * sizeof *ranges) == 0
               ? 0
               : -1;
  free(ranges);
  if (io == 0 && j->op == TE_FLAGCX_OP_WRITE)
    for (uint32_t i = 0; i < moved && io == 0; i++)
      io = send_all(c->fd, (const void *)(uintptr_t)j->descs[i].local_addr,
                    j->descs[i].len);
  reply_header r;
  if (io == 0)
    io = recv_all(c->fd, &r, sizeof r);
  int status = TE_FLAGCX_OK;
  if (io == 0 && r.status != TE_FLAGCX_OK) {
    char text[256] = "";
    uint32_t keep = r.msglen < sizeof text - 1 ? r.msglen : sizeof text - 1;
    io = recv_all(c->fd, text, keep);
    if (io == 0 && r.msglen > keep)
      io = drain(c->fd, r.msglen - keep);
    snprintf(msg, cap, "%s", text);
    status = r.status;
  } else if (io == 0) {
    io = drain(c->fd, r.msglen);
    if (j->op == TE_FLAGCX_OP_READ)
      for (uint32_t i = 0; i < moved && io == 0; i++)
        io = recv_all(c->fd, (void *)(uintptr_t)j->descs[i].local_addr,
                      j->descs[i].len);
  }
  pthread_rwlock_unlock(&e->lock);
  if (io != 0) {
    __atomic_store_n(&c->broken, 1, __ATOMIC_RELEASE);
    snprintf(msg, cap, "the connection to %s broke mid-transfer: %s", c->peer,
             strerror(errno ? errno : ECONNRESET));
    return TE_FLAGCX_E_UNREACHABLE;
  }
  return status == TE_FLAGCX_OK ? finished(c, j, moved, msg, cap) : status;
}

static int due_passed(const struct timespec *due) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return now.tv_sec > due->tv_sec ||
         (now.tv_sec == due->tv_sec && now.tv_nsec >= due->tv_nsec);
}

/* Runs jobs in order, each no sooner than its due time, like a NIC working through
   its queue; every finished job bumps the engine's event counter. */
static void *worker_thread(void *arg) {
  te_flagcx_conn *c = arg;
  pthread_mutex_lock(&c->lock);
  for (;;) {
    while (!c->head && !c->stop)
      pthread_cond_wait(&c->cond, &c->lock);
    while (!c->stop && c->head && !due_passed(&c->head->due))
      pthread_cond_timedwait(&c->cond, &c->lock, &c->head->due);
    if (c->stop)
      break;
    if (!c->head || !due_passed(&c->head->due))
      continue;
    job *j = c->head;
    c->head = j->next;
    if (!c->head)
      c->tail = NULL;
    pthread_mutex_unlock(&c->lock);
    char msg[256] = "";
    int status = run_job(c, j, msg, sizeof msg);
    set_status(c, j->id, status, msg);
    free(j->descs);
    free(j);
    bump_events(c->engine);
    pthread_mutex_lock(&c->lock);
  }
  pthread_mutex_unlock(&c->lock);
  return NULL;
}

/* ---------------------------------------------------------------- the ABI */

uint32_t te_flagcx_shim_abi(void) { return TE_FLAGCX_SHIM_ABI; }

const char *te_flagcx_shim_version(void) {
  return "te-flagcx FAKE shim 2 (loopback TCP; not FlagCX)";
}

const char *te_flagcx_last_error(void) { return last_error; }

static int parse_uint(const char *key, const char *value, uint64_t *out) {
  char *end = NULL;
  errno = 0;
  unsigned long long v = strtoull(value, &end, 10);
  if (errno || !end || *end || !*value || value[0] == '-')
    return fail(TE_FLAGCX_E_INVALID,
                "fake shim option %s=%s is not a non-negative integer", key,
                value);
  *out = v;
  return TE_FLAGCX_OK;
}

static int parse_options(te_flagcx_engine *e, const char *options) {
  if (!options)
    return TE_FLAGCX_OK;
  char *copy = strdup(options);
  if (!copy)
    return fail(TE_FLAGCX_E_INTERNAL, "out of memory");
  int rc = TE_FLAGCX_OK;
  char *save = NULL;
  for (char *item = strtok_r(copy, ",", &save); item && rc == TE_FLAGCX_OK;
       item = strtok_r(NULL, ",", &save)) {
    while (*item == ' ')
      item++;
    if (!*item)
      continue;
    char *eq = strchr(item, '=');
    if (!eq) {
      rc = fail(TE_FLAGCX_E_INVALID, "fake shim option `%s` is not key=value",
                item);
      break;
    }
    *eq = 0;
    const char *key = item, *value = eq + 1;
    uint64_t v = 0;
    if (strcmp(key, "host") == 0) {
      struct in_addr a;
      if (inet_pton(AF_INET, value, &a) != 1 || strlen(value) >= sizeof e->host)
        rc = fail(TE_FLAGCX_E_INVALID,
                  "fake shim option host=%s is not an IPv4 address", value);
      else
        snprintf(e->host, sizeof e->host, "%s", value);
    } else if (strcmp(key, "max_desc") == 0) {
      rc = parse_uint(key, value, &v);
      if (rc == TE_FLAGCX_OK && v == 0)
        rc = fail(TE_FLAGCX_E_INVALID, "fake shim option max_desc must be > 0");
      e->max_desc = v;
    } else if (strcmp(key, "delay_ms") == 0) {
      rc = parse_uint(key, value, &v);
      e->delay_ms = (unsigned)v;
    } else if (strcmp(key, "fail_every") == 0) {
      rc = parse_uint(key, value, &v);
      e->fail_every = (unsigned)v;
    } else if (strcmp(key, "stale_every") == 0) {
      rc = parse_uint(key, value, &v);
      e->stale_every = (unsigned)v;
    } else if (strcmp(key, "connect_delay_ms") == 0) {
      rc = parse_uint(key, value, &v);
      e->connect_delay_ms = (unsigned)v;
    } else if (strcmp(key, "fail_connect") == 0) {
      rc = parse_uint(key, value, &v);
      e->fail_connect = v != 0;
    } else {
      rc = fail(TE_FLAGCX_E_INVALID,
                "unknown fake shim option `%s` (known: host, max_desc, delay_ms, "
                "fail_every, stale_every, fail_connect, connect_delay_ms)",
                key);
    }
  }
  free(copy);
  return rc;
}

int te_flagcx_engine_create(const char *options, te_flagcx_engine **out) {
  if (!out)
    return fail(TE_FLAGCX_E_INVALID, "engine_create: null out pointer");
  te_flagcx_engine *e = calloc(1, sizeof *e);
  if (!e)
    return fail(TE_FLAGCX_E_INTERNAL, "out of memory");
  snprintf(e->host, sizeof e->host, "127.0.0.1");
  e->max_desc = 1ull << 30;
  e->next_mr = 1;
  e->listen_fd = -1;
  int rc = parse_options(e, options);
  if (rc != TE_FLAGCX_OK) {
    free(e);
    return rc;
  }
  pthread_rwlock_init(&e->lock, NULL);
  pthread_mutex_init(&e->srv_lock, NULL);
  pthread_mutex_init(&e->ev_lock, NULL);
  init_monotonic_cond(&e->ev_cond);
  *out = e;
  return TE_FLAGCX_OK;
}

int te_flagcx_start_server(te_flagcx_engine *e) {
  if (!e)
    return fail(TE_FLAGCX_E_INVALID, "start_server: null engine");
  pthread_mutex_lock(&e->srv_lock);
  if (e->serving) {
    pthread_mutex_unlock(&e->srv_lock);
    return TE_FLAGCX_OK;
  }
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  inet_pton(AF_INET, e->host, &a.sin_addr);
  socklen_t alen = sizeof a;
  if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
      listen(fd, 128) != 0 || getsockname(fd, (struct sockaddr *)&a, &alen) != 0) {
    int err = errno;
    if (fd >= 0)
      close(fd);
    pthread_mutex_unlock(&e->srv_lock);
    return fail(TE_FLAGCX_E_INTERNAL, "cannot listen on %s: %s", e->host,
                strerror(err));
  }
  e->listen_fd = fd;
  snprintf(e->endpoint, sizeof e->endpoint, "%s:%u", e->host,
           (unsigned)ntohs(a.sin_port));
  if (pthread_create(&e->accept_thread, NULL, accept_thread, e) != 0) {
    close(fd);
    e->listen_fd = -1;
    pthread_mutex_unlock(&e->srv_lock);
    return fail(TE_FLAGCX_E_INTERNAL, "cannot start the accept thread");
  }
  e->serving = 1;
  pthread_mutex_unlock(&e->srv_lock);
  return TE_FLAGCX_OK;
}

void te_flagcx_engine_destroy(te_flagcx_engine *e) {
  if (!e)
    return;
  pthread_mutex_lock(&e->srv_lock);
  e->stopping = 1;
  int serving = e->serving;
  if (serving)
    shutdown(e->listen_fd, SHUT_RDWR);
  for (server_conn *s = e->served; s; s = s->next)
    shutdown(s->fd, SHUT_RDWR);
  pthread_mutex_unlock(&e->srv_lock);
  if (serving) {
    pthread_join(e->accept_thread, NULL);
    close(e->listen_fd);
  }
  for (server_conn *s = e->served; s;) {
    server_conn *next = s->next;
    pthread_join(s->thread, NULL);
    close(s->fd);
    free(s);
    s = next;
  }
  pthread_rwlock_destroy(&e->lock);
  pthread_mutex_destroy(&e->srv_lock);
  pthread_mutex_destroy(&e->ev_lock);
  pthread_cond_destroy(&e->ev_cond);
  free(e->regions);
  free(e);
}

const char *te_flagcx_endpoint(te_flagcx_engine *e) {
  if (!e || !e->serving) {
    fail(TE_FLAGCX_E_INVALID, "the engine has no endpoint before start_server");
    return NULL;
  }
  return e->endpoint;
}

uint64_t te_flagcx_max_desc_len(te_flagcx_engine *e) {
  return e ? e->max_desc : 0;
}

const char *te_flagcx_memory_kinds(te_flagcx_engine *e) {
  (void)e;
  return "host";
}

int te_flagcx_register(te_flagcx_engine *e, uint64_t addr, uint64_t len,
                       const char *memory, uint64_t *mr_out) {
  if (!e || !mr_out || addr == 0 || len == 0 || addr + len < addr)
    return fail(TE_FLAGCX_E_INVALID, "register: null engine or empty range");
  if (!memory || strcmp(memory, "host") != 0)
    return fail(TE_FLAGCX_E_UNSUPPORTED,
                "the fake shim registers host memory only, not `%s`",
                memory ? memory : "(null)");
  pthread_rwlock_wrlock(&e->lock);
  if (e->nregions == e->cap) {
    size_t cap = e->cap ? e->cap * 2 : 16;
    region *grown = realloc(e->regions, cap * sizeof *grown);
    if (!grown) {
      pthread_rwlock_unlock(&e->lock);
      return fail(TE_FLAGCX_E_INTERNAL, "out of memory");
    }
    e->regions = grown;
    e->cap = cap;
  }
  region r = {e->next_mr++, addr, len};
  e->regions[e->nregions++] = r;
  pthread_rwlock_unlock(&e->lock);
  *mr_out = r.mr;
  return TE_FLAGCX_OK;
}

int te_flagcx_deregister(te_flagcx_engine *e, uint64_t mr) {
  if (!e)
    return fail(TE_FLAGCX_E_INVALID, "deregister: null engine");
  /* Like FlagCX's MrDestroy, this does not wait for transfers still queued on the
     memory: they fail when their turn comes. The write lock only keeps the fake from
     deregistering under a job that is moving bytes right now. */
  pthread_rwlock_wrlock(&e->lock);
  for (size_t i = 0; i < e->nregions; i++) {
    if (e->regions[i].mr == mr) {
      e->regions[i] = e->regions[--e->nregions];
      pthread_rwlock_unlock(&e->lock);
      return TE_FLAGCX_OK;
    }
  }
  pthread_rwlock_unlock(&e->lock);
  return fail(TE_FLAGCX_E_NOT_REGISTERED, "memory handle %llu is not registered",
              (unsigned long long)mr);
}

int te_flagcx_connect(te_flagcx_engine *e, const char *endpoint,
                      te_flagcx_conn **out) {
  if (!e || !endpoint || !out)
    return fail(TE_FLAGCX_E_INVALID, "connect: null argument");
  __atomic_add_fetch(&counter_connects, 1, __ATOMIC_RELAXED);
  if (e->connect_delay_ms) {
    struct timespec ts = {(time_t)(e->connect_delay_ms / 1000),
                          (long)(e->connect_delay_ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
  }
  if (e->fail_connect)
    return fail(TE_FLAGCX_E_UNREACHABLE,
                "injected connect failure to %s (fake shim option fail_connect)",
                endpoint);
  const char *colon = strrchr(endpoint, ':');
  char host[64];
  if (!colon || (size_t)(colon - endpoint) >= sizeof host)
    return fail(TE_FLAGCX_E_INVALID, "endpoint `%s` is not host:port", endpoint);
  memcpy(host, endpoint, (size_t)(colon - endpoint));
  host[colon - endpoint] = 0;
  uint64_t port = 0;
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  if (parse_uint("port", colon + 1, &port) != TE_FLAGCX_OK || port == 0 ||
      port > 65535 || inet_pton(AF_INET, host, &a.sin_addr) != 1)
    return fail(TE_FLAGCX_E_INVALID, "endpoint `%s` is not IPv4-host:port",
                endpoint);
  a.sin_port = htons((uint16_t)port);
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return fail(TE_FLAGCX_E_INTERNAL, "socket: %s", strerror(errno));
  struct timeval tv = {5, 0};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
    int err = errno;
    close(fd);
    return fail(TE_FLAGCX_E_UNREACHABLE, "cannot connect to %s: %s", endpoint,
                strerror(err));
  }
  tv.tv_sec = 0;
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  tune(fd);
  hello h = {FAKE_MAGIC, FAKE_WIRE_VERSION};
  uint32_t n = 0;
  wire_range *snapshot = NULL;
  if (send_all(fd, &h, sizeof h) != 0 || recv_all(fd, &n, sizeof n) != 0 ||
      n > FAKE_MAX_REGIONS_ON_WIRE ||
      !(snapshot = calloc(n ? n : 1, sizeof *snapshot)) ||
      recv_all(fd, snapshot, (uint64_t)n * sizeof *snapshot) != 0) {
    close(fd);
    free(snapshot);
    return fail(TE_FLAGCX_E_UNREACHABLE,
                "the handshake with %s failed (not a te fake shim?)", endpoint);
  }
  te_flagcx_conn *c = calloc(1, sizeof *c);
  if (!c) {
    close(fd);
    free(snapshot);
    return fail(TE_FLAGCX_E_INTERNAL, "out of memory");
  }
  c->engine = e;
  c->fd = fd;
  snprintf(c->peer, sizeof c->peer, "%s", endpoint);
  c->snapshot = snapshot;
  c->nsnapshot = n;
  c->next_id = 1;
  pthread_mutex_init(&c->lock, NULL);
  init_monotonic_cond(&c->cond);
  if (pthread_create(&c->worker, NULL, worker_thread, c) != 0) {
    close(fd);
    free(snapshot);
    free(c);
    return fail(TE_FLAGCX_E_INTERNAL, "cannot start the connection's thread");
  }
  *out = c;
  return TE_FLAGCX_OK;
}

void te_flagcx_disconnect(te_flagcx_conn *c) {
  if (!c)
    return;
  pthread_mutex_lock(&c->lock);
  c->stop = 1;
  pthread_cond_broadcast(&c->cond);
  pthread_mutex_unlock(&c->lock);
  shutdown(c->fd, SHUT_RDWR);
  pthread_join(c->worker, NULL);
  for (job *j = c->head; j;) {
    job *next = j->next;
    free(j->descs);
    free(j);
    j = next;
  }
  close(c->fd);
  pthread_mutex_destroy(&c->lock);
  pthread_cond_destroy(&c->cond);
  free(c->xfers);
  free(c->snapshot);
  free(c);
}

static int in_snapshot(const te_flagcx_conn *c, uint64_t addr, uint64_t len) {
  for (uint32_t i = 0; i < c->nsnapshot; i++) {
    region r = {0, c->snapshot[i].addr, c->snapshot[i].len};
    if (contains(&r, addr, len))
      return 1;
  }
  return 0;
}

int te_flagcx_post(te_flagcx_conn *c, int op, const te_flagcx_desc *descs,
                   uint32_t count, uint64_t *xfer_out) {
  if (!c || !descs || count == 0 || !xfer_out)
    return fail(TE_FLAGCX_E_INVALID, "post: null argument or no descriptors");
  if (op != TE_FLAGCX_OP_READ && op != TE_FLAGCX_OP_WRITE)
    return fail(TE_FLAGCX_E_INVALID, "post: unknown operation %d", op);
  te_flagcx_engine *e = c->engine;
  for (uint32_t i = 0; i < count; i++) {
    const te_flagcx_desc *d = &descs[i];
    if (d->len == 0 || d->len > e->max_desc)
      return fail(TE_FLAGCX_E_INVALID,
                  "descriptor %u has %llu bytes; the per-descriptor limit is %llu "
                  "(split larger copies)",
                  i, (unsigned long long)d->len, (unsigned long long)e->max_desc);
    if (!in_snapshot(c, d->remote_addr, d->len))
      return fail(TE_FLAGCX_E_STALE,
                  "remote range 0x%llx+%llu is not in the region table taken when "
                  "connecting to %s (registered since? connect again)",
                  (unsigned long long)d->remote_addr, (unsigned long long)d->len,
                  c->peer);
  }
  pthread_rwlock_rdlock(&e->lock);
  for (uint32_t i = 0; i < count; i++) {
    if (!local_ok(e, &descs[i])) {
      pthread_rwlock_unlock(&e->lock);
      return fail(TE_FLAGCX_E_NOT_REGISTERED,
                  "descriptor %u: local memory handle %llu does not cover 0x%llx+%llu",
                  i, (unsigned long long)descs[i].local_mr,
                  (unsigned long long)descs[i].local_addr,
                  (unsigned long long)descs[i].len);
    }
  }
  pthread_rwlock_unlock(&e->lock);
  job *j = calloc(1, sizeof *j);
  te_flagcx_desc *copy = malloc((size_t)count * sizeof *copy);
  if (!j || !copy) {
    free(j);
    free(copy);
    return fail(TE_FLAGCX_E_INTERNAL, "out of memory");
  }
  memcpy(copy, descs, (size_t)count * sizeof *copy);
  j->op = op;
  j->count = count;
  j->descs = copy;
  uint64_t n = __atomic_add_fetch(&e->posts, 1, __ATOMIC_RELAXED);
  if (e->fail_every && n % e->fail_every == 0)
    j->inject = INJECT_FAIL;
  else if (e->stale_every && n % e->stale_every == 0)
    j->inject = INJECT_STALE;

  struct timespec *due = &j->due;
  clock_gettime(CLOCK_MONOTONIC, due);
  due->tv_sec += e->delay_ms / 1000;
  due->tv_nsec += (long)(e->delay_ms % 1000) * 1000000L;
  if (due->tv_nsec >= 1000000000L) {
    due->tv_sec++;
    due->tv_nsec -= 1000000000L;
  }

  pthread_mutex_lock(&c->lock);
  if (__atomic_load_n(&c->broken, __ATOMIC_ACQUIRE)) {
    pthread_mutex_unlock(&c->lock);
    free(copy);
    free(j);
    return fail(TE_FLAGCX_E_UNREACHABLE, "the connection to %s is broken",
                c->peer);
  }
  if (c->nxfers == c->capxfers) {
    size_t cap = c->capxfers ? c->capxfers * 2 : 64;
    xfer *grown = realloc(c->xfers, cap * sizeof *grown);
    if (!grown) {
      pthread_mutex_unlock(&c->lock);
      free(copy);
      free(j);
      return fail(TE_FLAGCX_E_INTERNAL, "out of memory");
    }
    c->xfers = grown;
    c->capxfers = cap;
  }
  uint64_t id = j->id = c->next_id++;
  xfer *x = &c->xfers[c->nxfers++];
  memset(x, 0, sizeof *x);
  x->id = j->id;
  x->status = TE_FLAGCX_PENDING;
  if (c->tail)
    c->tail->next = j;
  else
    c->head = j;
  c->tail = j;
  pthread_cond_signal(&c->cond);
  pthread_mutex_unlock(&c->lock);
  __atomic_add_fetch(&counter_posts, 1, __ATOMIC_RELAXED);
  __atomic_add_fetch(&counter_descs, count, __ATOMIC_RELAXED);
  /* Not j->id: the worker may have run and freed the job already. */
  *xfer_out = id;
  return TE_FLAGCX_OK;
}

int te_flagcx_query(te_flagcx_conn *c, uint64_t id) {
  if (!c)
    return fail(TE_FLAGCX_E_INVALID, "query: null connection");
  pthread_mutex_lock(&c->lock);
  for (size_t i = 0; i < c->nxfers; i++) {
    xfer *x = &c->xfers[i];
    if (x->id != id)
      continue;
    if (x->status == TE_FLAGCX_PENDING) {
      pthread_mutex_unlock(&c->lock);
      return TE_FLAGCX_PENDING;
    }
    int status = x->status;
    if (status != TE_FLAGCX_OK)
      snprintf(last_error, sizeof last_error, "%s", x->msg);
    *x = c->xfers[--c->nxfers];
    pthread_mutex_unlock(&c->lock);
    return status;
  }
  pthread_mutex_unlock(&c->lock);
  __atomic_add_fetch(&counter_misuse, 1, __ATOMIC_RELAXED);
  return fail(TE_FLAGCX_E_INVALID,
              "transfer %llu is unknown (never posted, or queried after it finished)",
              (unsigned long long)id);
}

uint64_t te_flagcx_events(te_flagcx_engine *e) {
  if (!e)
    return 0;
  pthread_mutex_lock(&e->ev_lock);
  uint64_t n = e->events;
  pthread_mutex_unlock(&e->ev_lock);
  return n;
}

void te_flagcx_wait(te_flagcx_engine *e, uint64_t seen, uint32_t timeout_us) {
  if (!e)
    return;
  struct timespec until;
  clock_gettime(CLOCK_MONOTONIC, &until);
  until.tv_sec += timeout_us / 1000000u;
  until.tv_nsec += (long)(timeout_us % 1000000u) * 1000L;
  if (until.tv_nsec >= 1000000000L) {
    until.tv_sec++;
    until.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&e->ev_lock);
  while (e->events == seen &&
         pthread_cond_timedwait(&e->ev_cond, &e->ev_lock, &until) != ETIMEDOUT) {
  }
  pthread_mutex_unlock(&e->ev_lock);
}

void te_flagcx_wake(te_flagcx_engine *e) {
  if (e)
    bump_events(e);
}

/* Fake-only: process-wide counters for tests. */
uint64_t te_flagcx_fake_counter(const char *name) {
  if (!name)
    return 0;
  if (strcmp(name, "posts") == 0)
    return __atomic_load_n(&counter_posts, __ATOMIC_RELAXED);
  if (strcmp(name, "descs") == 0)
    return __atomic_load_n(&counter_descs, __ATOMIC_RELAXED);
  if (strcmp(name, "connects") == 0)
    return __atomic_load_n(&counter_connects, __ATOMIC_RELAXED);
  if (strcmp(name, "misuse") == 0)
    return __atomic_load_n(&counter_misuse, __ATOMIC_RELAXED);
  return 0;
}
