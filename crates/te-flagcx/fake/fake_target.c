/*
 * The target side of the FAKE shim: te_flagcx_start_server listens on loopback TCP,
 * a thread accepts connections, and one thread per connection answers the handshake
 * with the engine's region table and serves reads and writes, checking every remote
 * range against the engine's registrations and their rights before touching memory.
 */
#include "fake_shim_internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int reply(int fd, int32_t status, const char *msg, unsigned limit) {
  reply_header h = {status, (uint32_t)strlen(msg)};
  if (send_all(fd, &h, sizeof h, limit) != 0)
    return -1;
  return send_all(fd, msg, h.msglen, limit);
}

static int serve_handshake(te_flagcx_engine *e, int fd) {
  hello h;
  if (recv_all(fd, &h, sizeof h, 0) != 0 || h.magic != FAKE_MAGIC ||
      h.version != FAKE_WIRE_VERSION)
    return -1;
  pthread_mutex_lock(&e->lock);
  uint32_t n = 0;
  wire_range *table = calloc(e->nregions ? e->nregions : 1, sizeof *table);
  for (size_t i = 0; table && i < e->nregions; i++) {
    if (e->regions[i].dying)
      continue;
    table[n].addr = e->regions[i].addr;
    table[n].len = e->regions[i].len;
    n++;
  }
  pthread_mutex_unlock(&e->lock);
  if (!table)
    return -1;
  int rc = send_all(fd, &n, sizeof n, 0) == 0 &&
                   send_all(fd, table, (uint64_t)n * sizeof *table, 0) == 0
               ? 0
               : -1;
  free(table);
  return rc;
}

/* Serves one request; -1 ends the connection. The regions it touches are pinned while
   its bytes move, with the engine's lock released: registering and deregistering
   other regions never waits for a peer, and deregistering one of its regions waits
   at most the transfer timeout, after which a stalled peer's connection ends. */
static int serve_request(te_flagcx_engine *e, int fd) {
  unsigned limit = e->transfer_timeout_ms;
  request_header h;
  /* Waiting for the next request is idle time, not a stalled transfer. */
  if (recv_all(fd, &h, sizeof h, 0) != 0 || h.magic != FAKE_MAGIC ||
      (h.op != TE_FLAGCX_OP_READ && h.op != TE_FLAGCX_OP_WRITE) ||
      h.count == 0 || h.count > FAKE_MAX_DESCS_ON_WIRE)
    return -1;
  wire_range *ranges = malloc((size_t)h.count * sizeof *ranges);
  uint64_t *pinned = malloc((size_t)h.count * sizeof *pinned);
  if (!ranges || !pinned ||
      recv_all(fd, ranges, (uint64_t)h.count * sizeof *ranges, limit) != 0) {
    free(ranges);
    free(pinned);
    return -1;
  }
  int rc = 0;
  char msg[256] = "";
  uint32_t need = h.op == TE_FLAGCX_OP_WRITE ? TE_FLAGCX_ACCESS_REMOTE_WRITE
                                             : TE_FLAGCX_ACCESS_REMOTE_READ;
  pthread_mutex_lock(&e->lock);
  uint32_t bad = h.count, npinned = 0;
  int status = TE_FLAGCX_OK;
  for (uint32_t i = 0; i < h.count && bad == h.count; i++) {
    region *allowed = NULL;
    int registered = 0;
    for (size_t r = 0; r < e->nregions && !allowed; r++) {
      if (!e->regions[r].dying &&
          contains(&e->regions[r], ranges[i].addr, ranges[i].len)) {
        registered = 1;
        if (e->regions[r].access & need)
          allowed = &e->regions[r];
      }
    }
    if (allowed) {
      allowed->pins++;
      pinned[npinned++] = allowed->mr;
    } else {
      bad = i;
      status = registered ? TE_FLAGCX_E_ACCESS : TE_FLAGCX_E_NOT_REGISTERED;
    }
  }
  if (bad != h.count) {
    unpin_mrs(e, pinned, npinned);
    if (status == TE_FLAGCX_E_ACCESS)
      snprintf(msg, sizeof msg,
               "the target's registration holding 0x%llx+%llu does not allow "
               "remote %s",
               (unsigned long long)ranges[bad].addr,
               (unsigned long long)ranges[bad].len,
               h.op == TE_FLAGCX_OP_WRITE ? "WRITE" : "READ");
    else
      snprintf(msg, sizeof msg,
               "the target has no registration containing 0x%llx+%llu "
               "(deregistered since the initiator connected?)",
               (unsigned long long)ranges[bad].addr,
               (unsigned long long)ranges[bad].len);
    pthread_mutex_unlock(&e->lock);
    if (h.op == TE_FLAGCX_OP_WRITE && drain(fd, h.total, limit) != 0)
      rc = -1;
    else
      rc = reply(fd, status, msg, limit);
    free(ranges);
    free(pinned);
    return rc;
  }
  pthread_mutex_unlock(&e->lock);
  if (h.op == TE_FLAGCX_OP_WRITE) {
    for (uint32_t i = 0; i < h.count && rc == 0; i++)
      rc = recv_all(fd, (void *)(uintptr_t)ranges[i].addr, ranges[i].len, limit);
    if (rc == 0)
      rc = reply(fd, TE_FLAGCX_OK, "", limit);
  } else {
    rc = reply(fd, TE_FLAGCX_OK, "", limit);
    for (uint32_t i = 0; i < h.count && rc == 0; i++)
      rc = send_all(fd, (const void *)(uintptr_t)ranges[i].addr, ranges[i].len,
                    limit);
  }
  pthread_mutex_lock(&e->lock);
  unpin_mrs(e, pinned, npinned);
  pthread_mutex_unlock(&e->lock);
  free(ranges);
  free(pinned);
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
