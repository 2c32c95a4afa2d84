/*
 * The initiator side of the FAKE shim: a connection (its handshake and snapshot of
 * the peer's regions), posting transfers, the thread that runs them in order against
 * the peer's target side, and querying how they finished.
 */
#include "fake_shim_internal.h"
#include "../shim/te_flagcx_status.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

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
  region *r = find_mr(e, d->local_mr);
  return r && contains(r, d->local_addr, d->len);
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

/* Moves a job's bytes with its local regions pinned, none of the engine's locks held:
   every socket call gives up once the peer took or sent nothing for the engine's
   transfer_timeout_ms, which breaks the connection, like a queue pair whose retries
   ran out. */
static int move_job(te_flagcx_conn *c, job *j, uint32_t moved, char *msg,
                    size_t cap) {
  unsigned limit = c->engine->transfer_timeout_ms;
  request_header h = {FAKE_MAGIC, (uint32_t)j->op, moved, 0, 0};
  wire_range *ranges = malloc((size_t)moved * sizeof *ranges);
  if (!ranges) {
    snprintf(msg, cap, "out of memory");
    return TE_FLAGCX_E_INTERNAL;
  }
  for (uint32_t i = 0; i < moved; i++) {
    ranges[i].addr = j->descs[i].remote_addr;
    ranges[i].len = j->descs[i].len;
    h.total += j->descs[i].len;
  }
  int io = send_all(c->fd, &h, sizeof h, limit) == 0 &&
                   send_all(c->fd, ranges, (uint64_t)moved * sizeof *ranges,
                            limit) == 0
               ? 0
               : -1;
  free(ranges);
  if (io == 0 && j->op == TE_FLAGCX_OP_WRITE)
    for (uint32_t i = 0; i < moved && io == 0; i++)
      io = send_all(c->fd, (const void *)(uintptr_t)j->descs[i].local_addr,
                    j->descs[i].len, limit);
  reply_header r;
  if (io == 0)
    io = recv_all(c->fd, &r, sizeof r, limit);
  int status = TE_FLAGCX_OK;
  if (io == 0 && r.status != TE_FLAGCX_OK) {
    char text[256] = "";
    uint32_t keep = r.msglen < sizeof text - 1 ? r.msglen : sizeof text - 1;
    io = recv_all(c->fd, text, keep, limit);
    if (io == 0 && r.msglen > keep)
      io = drain(c->fd, r.msglen - keep, limit);
    snprintf(msg, cap, "%s", text);
    status = r.status;
  } else if (io == 0) {
    io = drain(c->fd, r.msglen, limit);
    if (j->op == TE_FLAGCX_OP_READ)
      for (uint32_t i = 0; i < moved && io == 0; i++)
        io = recv_all(c->fd, (void *)(uintptr_t)j->descs[i].local_addr,
                      j->descs[i].len, limit);
  }
  if (io != 0) {
    int err = errno ? errno : ECONNRESET;
    /* Mid-message: the stream cannot carry another transfer. */
    __atomic_store_n(&c->broken, 1, __ATOMIC_RELEASE);
    shutdown(c->fd, SHUT_RDWR);
    if (err == ETIMEDOUT)
      snprintf(msg, cap,
               "no progress for %u ms on the transfer to %s: the peer stalled "
               "(transfer_timeout_ms, a queue pair's retry limit); connection "
               "broken",
               limit, c->peer);
    else
      snprintf(msg, cap, "the connection to %s broke mid-transfer: %s", c->peer,
               strerror(err));
    return TE_FLAGCX_E_UNREACHABLE;
  }
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
  /* The local regions stay registered while their bytes move (a deregistration
     waits for the pins); the engine's lock is not held across the socket. */
  int status = pin_local(c->engine, j->descs, j->count, msg, cap);
  if (status != TE_FLAGCX_OK)
    return status;
  if (moved > 0)
    status = move_job(c, j, moved, msg, cap);
  unpin_local(c->engine, j->descs, j->count);
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

/* ---------------------------------------------------------------- connecting */

/* One connection attempt's cancel: an eventfd, readable once cancelled, that every
   connect given the attempt polls beside its socket. */
struct te_flagcx_attempt {
  int fd;
};

int te_flagcx_attempt_create(te_flagcx_engine *e, te_flagcx_attempt **out) {
  if (!e || !out)
    return fail(TE_FLAGCX_E_INVALID, "attempt_create: null argument");
  if (e->attempt_delay_ms) {
    struct timespec slow = {e->attempt_delay_ms / 1000,
                            (long)(e->attempt_delay_ms % 1000) * 1000000L};
    while (nanosleep(&slow, &slow) != 0 && errno == EINTR) {
    }
  }
  te_flagcx_attempt *a = calloc(1, sizeof *a);
  if (!a)
    return fail(TE_FLAGCX_E_INTERNAL, "out of memory");
  a->fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (a->fd < 0) {
    int err = errno;
    free(a);
    return fail(TE_FLAGCX_E_INTERNAL, "eventfd: %s", strerror(err));
  }
  __atomic_add_fetch(&counter_attempts, 1, __ATOMIC_RELAXED);
  *out = a;
  return TE_FLAGCX_OK;
}

void te_flagcx_attempt_cancel(te_flagcx_attempt *a) {
  if (!a)
    return;
  uint64_t one = 1;
  /* The counter only has to be non-zero; a full one (never reached) is fine. */
  while (write(a->fd, &one, sizeof one) < 0 && errno == EINTR) {
  }
}

void te_flagcx_attempt_destroy(te_flagcx_attempt *a) {
  if (!a)
    return;
  close(a->fd);
  free(a);
  __atomic_sub_fetch(&counter_attempts, 1, __ATOMIC_RELAXED);
}

enum {
  STEP_OK = 0,
  STEP_TIMEOUT = 1,
  STEP_CANCELLED = 2, /* the engine's connects were cancelled */
  STEP_DROPPED = 3,   /* this connect's attempt was cancelled */
  STEP_FAILED = -1
};

/* Milliseconds to the deadline, rounded up: 0 only once it passed, so a connect never
   gives up before its timeout. */
static long ms_left(const struct timespec *deadline) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  long long ns = (long long)(deadline->tv_sec - now.tv_sec) * 1000000000LL +
                 (deadline->tv_nsec - now.tv_nsec);
  return ns <= 0 ? 0 : (long)((ns + 999999LL) / 1000000LL);
}

/* Waits until fd has `events` (fd -1: only for the time), the deadline passed, the
   engine's connects were cancelled, or the attempt was. */
static int wait_step(te_flagcx_engine *e, te_flagcx_attempt *a, int fd,
                     short events, const struct timespec *deadline) {
  for (;;) {
    struct pollfd p[3] = {
        {e->cancel_pipe[0], POLLIN, 0}, {a->fd, POLLIN, 0}, {fd, events, 0}};
    long left = ms_left(deadline);
    int n = poll(p, fd >= 0 ? 3 : 2, (int)(left > 60000 ? 60000 : left));
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      return STEP_FAILED;
    if (p[0].revents)
      return STEP_CANCELLED;
    if (p[1].revents)
      return STEP_DROPPED;
    if (fd >= 0 && p[2].revents)
      return STEP_OK;
    if (ms_left(deadline) == 0)
      return fd >= 0 ? STEP_TIMEOUT : STEP_OK;
  }
}

/* Sends or receives exactly len bytes on a non-blocking socket, by the deadline. */
static int io_step(te_flagcx_engine *e, te_flagcx_attempt *a, int fd, void *buf,
                   uint64_t len, int sending, const struct timespec *deadline) {
  char *p = buf;
  while (len > 0) {
    ssize_t n = sending ? send(fd, p, len, MSG_NOSIGNAL) : recv(fd, p, len, 0);
    if (n > 0) {
      p += n;
      len -= (uint64_t)n;
      continue;
    }
    if (n == 0)
      return STEP_FAILED;
    if (errno == EINTR)
      continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      return STEP_FAILED;
    int w = wait_step(e, a, fd, sending ? POLLOUT : POLLIN, deadline);
    if (w != STEP_OK)
      return w;
  }
  return STEP_OK;
}

static int step_failed(int step, const char *endpoint, uint32_t timeout_ms,
                       const char *what) {
  if (step == STEP_CANCELLED)
    return fail(TE_FLAGCX_E_UNREACHABLE,
                "connecting to %s was cancelled: the engine is closing", endpoint);
  if (step == STEP_DROPPED)
    return fail(TE_FLAGCX_E_UNREACHABLE,
                "connecting to %s was cancelled: its attempt was given up",
                endpoint);
  if (step == STEP_TIMEOUT)
    return fail(TE_FLAGCX_E_UNREACHABLE,
                "connecting to %s timed out after %u ms %s (is the peer alive and "
                "a te fake shim?)",
                endpoint, timeout_ms, what);
  return fail(TE_FLAGCX_E_UNREACHABLE, "%s with %s failed: %s", what, endpoint,
              strerror(errno ? errno : ECONNRESET));
}

int te_flagcx_connect(te_flagcx_engine *e, const char *endpoint,
                      uint32_t timeout_ms, te_flagcx_attempt *attempt,
                      te_flagcx_conn **out) {
  if (!e || !endpoint || !attempt || !out)
    return fail(TE_FLAGCX_E_INVALID, "connect: null argument");
  __atomic_add_fetch(&counter_connects, 1, __ATOMIC_RELAXED);
  struct timespec deadline;
  clock_gettime(CLOCK_MONOTONIC, &deadline);
  /* Cancelled before it began: it returns at once, whatever the peer would do. */
  int early = wait_step(e, attempt, -1, 0, &deadline);
  if (early != STEP_OK)
    return step_failed(early, endpoint, timeout_ms, "before it began");
  deadline.tv_sec += timeout_ms / 1000;
  deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
  if (deadline.tv_nsec >= 1000000000L) {
    deadline.tv_sec++;
    deadline.tv_nsec -= 1000000000L;
  }
  if (e->connect_delay_ms) {
    /* A slow handshake: as slow as configured, but never past the deadline. */
    struct timespec slow;
    clock_gettime(CLOCK_MONOTONIC, &slow);
    slow.tv_sec += e->connect_delay_ms / 1000;
    slow.tv_nsec += (long)(e->connect_delay_ms % 1000) * 1000000L;
    if (slow.tv_nsec >= 1000000000L) {
      slow.tv_sec++;
      slow.tv_nsec -= 1000000000L;
    }
    int late = slow.tv_sec > deadline.tv_sec ||
               (slow.tv_sec == deadline.tv_sec && slow.tv_nsec > deadline.tv_nsec);
    int w = wait_step(e, attempt, -1, 0, late ? &deadline : &slow);
    if (w == STEP_OK && late)
      w = STEP_TIMEOUT;
    if (w != STEP_OK)
      return step_failed(w, endpoint, timeout_ms, "in the handshake");
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
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0)
    return fail(TE_FLAGCX_E_INTERNAL, "socket: %s", strerror(errno));
  int step = STEP_OK;
  if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
    if (errno != EINPROGRESS) {
      int err = errno;
      close(fd);
      return fail(TE_FLAGCX_E_UNREACHABLE, "cannot connect to %s: %s", endpoint,
                  strerror(err));
    }
    step = wait_step(e, attempt, fd, POLLOUT, &deadline);
    int err = 0;
    socklen_t elen = sizeof err;
    if (step == STEP_OK &&
        (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen) != 0 || err != 0)) {
      close(fd);
      return fail(TE_FLAGCX_E_UNREACHABLE, "cannot connect to %s: %s", endpoint,
                  strerror(err ? err : errno));
    }
    if (step != STEP_OK) {
      close(fd);
      return step_failed(step, endpoint, timeout_ms, "reaching it");
    }
  }
  tune(fd);
  hello h = {FAKE_MAGIC, FAKE_WIRE_VERSION};
  uint32_t n = 0;
  wire_range *snapshot = NULL;
  step = io_step(e, attempt, fd, &h, sizeof h, 1, &deadline);
  if (step == STEP_OK)
    step = io_step(e, attempt, fd, &n, sizeof n, 0, &deadline);
  if (step == STEP_OK && n > FAKE_MAX_REGIONS_ON_WIRE) {
    close(fd);
    return fail(TE_FLAGCX_E_UNREACHABLE,
                "the handshake with %s announced %u regions (not a te fake shim?)",
                endpoint, n);
  }
  if (step == STEP_OK && !(snapshot = calloc(n ? n : 1, sizeof *snapshot))) {
    close(fd);
    return fail(TE_FLAGCX_E_INTERNAL, "out of memory");
  }
  if (step == STEP_OK)
    step = io_step(e, attempt, fd, snapshot, (uint64_t)n * sizeof *snapshot, 0,
                   &deadline);
  if (step != STEP_OK) {
    close(fd);
    free(snapshot);
    return step_failed(step, endpoint, timeout_ms, "in the handshake");
  }
  /* The connection's worker uses blocking I/O. */
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    int err = errno;
    close(fd);
    free(snapshot);
    return fail(TE_FLAGCX_E_INTERNAL, "fcntl: %s", strerror(err));
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
    region r = {.addr = c->snapshot[i].addr, .len = c->snapshot[i].len};
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
  pthread_mutex_lock(&e->lock);
  for (uint32_t i = 0; i < count; i++) {
    if (!local_ok(e, &descs[i])) {
      pthread_mutex_unlock(&e->lock);
      return fail(TE_FLAGCX_E_NOT_REGISTERED,
                  "descriptor %u: local memory handle %llu does not cover 0x%llx+%llu",
                  i, (unsigned long long)descs[i].local_mr,
                  (unsigned long long)descs[i].local_addr,
                  (unsigned long long)descs[i].len);
    }
  }
  pthread_mutex_unlock(&e->lock);
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
