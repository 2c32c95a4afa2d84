/*
 * The FAKE shim's engine: its options (the injected faults among them), creating and
 * destroying it, its registered regions, and the event counter that te_flagcx_events
 * and te_flagcx_wait read.
 */
#include "fake_shim_internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------------- regions */

int contains(const region *r, uint64_t addr, uint64_t len) {
  return addr >= r->addr && len <= r->len && addr - r->addr <= r->len - len;
}

region *find_mr(te_flagcx_engine *e, uint64_t mr) {
  for (size_t i = 0; i < e->nregions; i++)
    if (e->regions[i].mr == mr && !e->regions[i].dying)
      return &e->regions[i];
  return NULL;
}

/* The region with handle mr, dying or not; e->lock held. */
static region *find_any_mr(te_flagcx_engine *e, uint64_t mr) {
  for (size_t i = 0; i < e->nregions; i++)
    if (e->regions[i].mr == mr)
      return &e->regions[i];
  return NULL;
}

void unpin_mrs(te_flagcx_engine *e, const uint64_t *mrs, uint32_t count) {
  int wake = 0;
  for (uint32_t i = 0; i < count; i++) {
    region *r = find_any_mr(e, mrs[i]);
    if (r && r->pins > 0 && --r->pins == 0)
      wake = 1;
  }
  if (wake)
    pthread_cond_broadcast(&e->unpinned);
}

static void unpin_some(te_flagcx_engine *e, const te_flagcx_desc *descs,
                       uint32_t count) {
  int wake = 0;
  for (uint32_t i = 0; i < count; i++) {
    region *r = find_any_mr(e, descs[i].local_mr);
    if (r && r->pins > 0 && --r->pins == 0)
      wake = 1;
  }
  if (wake)
    pthread_cond_broadcast(&e->unpinned);
}

int pin_local(te_flagcx_engine *e, const te_flagcx_desc *descs, uint32_t count,
              char *msg, size_t cap) {
  pthread_mutex_lock(&e->lock);
  for (uint32_t i = 0; i < count; i++) {
    region *r = find_mr(e, descs[i].local_mr);
    if (!r || !contains(r, descs[i].local_addr, descs[i].len)) {
      unpin_some(e, descs, i);
      pthread_mutex_unlock(&e->lock);
      snprintf(msg, cap,
               "local memory handle %llu does not cover 0x%llx+%llu "
               "(deregistered while the transfer was queued?)",
               (unsigned long long)descs[i].local_mr,
               (unsigned long long)descs[i].local_addr,
               (unsigned long long)descs[i].len);
      return TE_FLAGCX_E_NOT_REGISTERED;
    }
    r->pins++;
  }
  pthread_mutex_unlock(&e->lock);
  return TE_FLAGCX_OK;
}

void unpin_local(te_flagcx_engine *e, const te_flagcx_desc *descs,
                 uint32_t count) {
  pthread_mutex_lock(&e->lock);
  unpin_some(e, descs, count);
  pthread_mutex_unlock(&e->lock);
}

/* ---------------------------------------------------------------- engine */

void init_monotonic_cond(pthread_cond_t *cond) {
  pthread_condattr_t attr;
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_cond_init(cond, &attr);
  pthread_condattr_destroy(&attr);
}

void bump_events(te_flagcx_engine *e) {
  pthread_mutex_lock(&e->ev_lock);
  e->events++;
  pthread_cond_broadcast(&e->ev_cond);
  pthread_mutex_unlock(&e->ev_lock);
}

/* ---------------------------------------------------------------- options */

int parse_uint(const char *key, const char *value, uint64_t *out) {
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
    } else if (strcmp(key, "attempt_delay_ms") == 0) {
      rc = parse_uint(key, value, &v);
      e->attempt_delay_ms = (unsigned)v;
    } else if (strcmp(key, "transfer_timeout_ms") == 0) {
      rc = parse_uint(key, value, &v);
      if (rc == TE_FLAGCX_OK && (v == 0 || v > 3600000))
        rc = fail(TE_FLAGCX_E_INVALID,
                  "fake shim option transfer_timeout_ms must be 1..=3600000");
      e->transfer_timeout_ms = (unsigned)v;
    } else if (strcmp(key, "fail_connect") == 0) {
      rc = parse_uint(key, value, &v);
      e->fail_connect = v != 0;
    } else {
      rc = fail(TE_FLAGCX_E_INVALID,
                "unknown fake shim option `%s` (known: host, max_desc, delay_ms, "
                "fail_every, stale_every, fail_connect, connect_delay_ms, "
                "attempt_delay_ms, transfer_timeout_ms)",
                key);
    }
  }
  free(copy);
  return rc;
}

/* ---------------------------------------------------------------- the ABI */

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
  e->transfer_timeout_ms = 5000;
  int rc = parse_options(e, options);
  if (rc != TE_FLAGCX_OK) {
    free(e);
    return rc;
  }
  if (pipe2(e->cancel_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    int err = errno;
    free(e);
    return fail(TE_FLAGCX_E_INTERNAL, "pipe: %s", strerror(err));
  }
  pthread_mutex_init(&e->lock, NULL);
  init_monotonic_cond(&e->unpinned);
  pthread_mutex_init(&e->srv_lock, NULL);
  pthread_mutex_init(&e->ev_lock, NULL);
  init_monotonic_cond(&e->ev_cond);
  *out = e;
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
  pthread_mutex_destroy(&e->lock);
  pthread_cond_destroy(&e->unpinned);
  pthread_mutex_destroy(&e->srv_lock);
  pthread_mutex_destroy(&e->ev_lock);
  pthread_cond_destroy(&e->ev_cond);
  close(e->cancel_pipe[0]);
  close(e->cancel_pipe[1]);
  free(e->regions);
  free(e);
}

void te_flagcx_cancel_connects(te_flagcx_engine *e) {
  if (!e)
    return;
  char one = 1;
  /* The pipe holds far more than the one byte that matters; a full pipe is fine. */
  while (write(e->cancel_pipe[1], &one, 1) < 0 && errno == EINTR) {
  }
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
                       const char *memory, uint32_t access, uint64_t *mr_out) {
  if (!e || !mr_out || addr == 0 || len == 0 || addr + len < addr)
    return fail(TE_FLAGCX_E_INVALID, "register: null engine or empty range");
  if (access & ~(TE_FLAGCX_ACCESS_REMOTE_READ | TE_FLAGCX_ACCESS_REMOTE_WRITE))
    return fail(TE_FLAGCX_E_INVALID, "register: unknown access flags 0x%x",
                (unsigned)access);
  if (!memory || strcmp(memory, "host") != 0)
    return fail(TE_FLAGCX_E_UNSUPPORTED,
                "the fake shim registers host memory only, not `%s`",
                memory ? memory : "(null)");
  pthread_mutex_lock(&e->lock);
  if (e->nregions == e->cap) {
    size_t cap = e->cap ? e->cap * 2 : 16;
    region *grown = realloc(e->regions, cap * sizeof *grown);
    if (!grown) {
      pthread_mutex_unlock(&e->lock);
      return fail(TE_FLAGCX_E_INTERNAL, "out of memory");
    }
    e->regions = grown;
    e->cap = cap;
  }
  region r = {e->next_mr++, addr, len, access, 0, 0};
  e->regions[e->nregions++] = r;
  pthread_mutex_unlock(&e->lock);
  *mr_out = r.mr;
  return TE_FLAGCX_OK;
}

int te_flagcx_deregister(te_flagcx_engine *e, uint64_t mr) {
  if (!e)
    return fail(TE_FLAGCX_E_INVALID, "deregister: null engine");
  /* Like FlagCX's MrDestroy, this does not wait for transfers still queued on the
     memory: they fail when their turn comes. It waits only for those moving bytes in
     it right now (its pins), which a transfer timeout bounds; other regions are
     registered and deregistered meanwhile. */
  pthread_mutex_lock(&e->lock);
  region *r = find_mr(e, mr);
  if (r) {
    r->dying = 1;
    /* The array may move while waiting (a registration grows it): look again. */
    while ((r = find_any_mr(e, mr)) && r->pins > 0)
      pthread_cond_wait(&e->unpinned, &e->lock);
    for (size_t i = 0; i < e->nregions; i++) {
      if (e->regions[i].mr == mr) {
        e->regions[i] = e->regions[--e->nregions];
        break;
      }
    }
    pthread_mutex_unlock(&e->lock);
    return TE_FLAGCX_OK;
  }
  pthread_mutex_unlock(&e->lock);
  return fail(TE_FLAGCX_E_NOT_REGISTERED, "memory handle %llu is not registered",
              (unsigned long long)mr);
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
