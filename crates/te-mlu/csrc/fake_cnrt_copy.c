/*
 * The FAKE libcnrt's copies: resolving and checking both sides, cnrtMemcpy, queues,
 * the asynchronous copies queued on them, and synchronizing or querying a queue, which
 * runs the copies whose delay has passed and waits the way the device flag says.
 */
#include "fake_cnrt_internal.h"

#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Resolves one side of a copy to a host pointer; device addresses must lie in a live
 * allocation, host addresses are taken as they are. The caller holds g_lock. */
static cnrtRet_t resolve(uint64_t addr, size_t len, int want_device, char **out) {
  if (is_device(addr)) {
    if (want_device == 0) return cnrtErrorArgsInvalid;
    struct alloc *a = find(addr, len);
    if (!a) return cnrtErrorArgsInvalid;
    *out = a->host + (addr - a->dev);
    return cnrtSuccess;
  }
  if (want_device == 1) return cnrtErrorArgsInvalid;
  if (addr == 0) return cnrtErrorArgsInvalid;
  *out = (char *)addr;
  return cnrtSuccess;
}

/* want: 1 device, 0 host, -1 either. */
static cnrtRet_t sides(int dir, int *dst, int *src) {
  switch (dir) {
    case cnrtMemcpyHostToDev: *src = 0; *dst = 1; return cnrtSuccess;
    case cnrtMemcpyDevToDev:
    case cnrtMemcpyPeerToPeer: *src = 1; *dst = 1; return cnrtSuccess;
    case cnrtMemcpyDevToHost: *src = 1; *dst = 0; return cnrtSuccess;
    case cnrtMemcpyHostToHost: *src = 0; *dst = 0; return cnrtSuccess;
    case cnrtMemcpyNoDirection: *src = -1; *dst = -1; return cnrtSuccess;
    default: return cnrtErrorMemcpyDirectionInvalid;
  }
}

static cnrtRet_t prepare(void *dst, void *src, size_t bytes, int dir, char **d, char **s) {
  int wd, ws;
  cnrtRet_t r = sides(dir, &wd, &ws);
  if (r != cnrtSuccess) return r;
  if (bytes == 0) return cnrtErrorArgsInvalid;
  pthread_mutex_lock(&g_lock);
  r = resolve((uint64_t)dst, bytes, wd, d);
  if (r == cnrtSuccess) r = resolve((uint64_t)src, bytes, ws, s);
  pthread_mutex_unlock(&g_lock);
  return r;
}

EXPORT cnrtRet_t cnrtMemcpy(void *dst, void *src, size_t bytes, int dir) {
  INJECT("cnrtMemcpy");
  char *d, *s;
  cnrtRet_t r = prepare(dst, src, bytes, dir, &d, &s);
  if (r != cnrtSuccess) return r;
  memmove(d, s, bytes);
  return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtQueueCreate(struct queue **q) {
  INJECT("cnrtQueueCreate");
  if (!q) return cnrtErrorArgsInvalid;
  struct queue *n = calloc(1, sizeof *n);
  if (!n) return cnrtErrorSysNoMem;
  pthread_mutex_init(&n->lock, NULL);
  n->device = t_device;
  pthread_mutex_lock(&g_lock);
  g_active[t_device] = 1;
  pthread_mutex_unlock(&g_lock);
  *q = n;
  return cnrtSuccess;
}

static cnrtRet_t enqueue(struct queue *q, char *d, const char *s, size_t len) {
  if (!q) return cnrtErrorArgsInvalid; /* te never uses the default queue */
  if (q->device != t_device) return cnrtErrorDevice;
  pthread_mutex_lock(&q->lock);
  size_t depth = __atomic_load_n(&g_depth, __ATOMIC_RELAXED);
  if (depth > 0 && q->n >= depth) {
    /* Full: refused until a sync or a query has run what it holds. */
    pthread_mutex_unlock(&q->lock);
    __atomic_add_fetch(&g_busy, 1, __ATOMIC_RELAXED);
    return cnrtErrorBusy;
  }
  __atomic_add_fetch(&g_copies, 1, __ATOMIC_RELAXED);
  if (q->n == q->cap) {
    size_t cap = q->cap ? q->cap * 2 : 16;
    struct op *n = realloc(q->ops, cap * sizeof *n);
    if (!n) {
      pthread_mutex_unlock(&q->lock);
      return cnrtErrorSysNoMem;
    }
    q->ops = n;
    q->cap = cap;
  }
  uint64_t ready = now_ns() + g_delay_ns;
  if (q->n > 0 && q->ops[q->n - 1].ready_ns > ready) ready = q->ops[q->n - 1].ready_ns;
  q->ops[q->n++] = (struct op){d, s, len, ready};
  pthread_mutex_unlock(&q->lock);
  return cnrtSuccess;
}

static cnrtRet_t memcpy_async(void *dst, void *src, size_t bytes, struct queue *q, int dir) {
  if (q && q->device != t_device) return cnrtErrorDevice;
  char *d, *s;
  cnrtRet_t r = prepare(dst, src, bytes, dir, &d, &s);
  if (r != cnrtSuccess) return r;
  return enqueue(q, d, s, bytes);
}

#ifndef FAKE_V602
EXPORT cnrtRet_t cnrtMemcpyAsync_V3(void *dst, void *src, size_t bytes, struct queue *q, int dir) {
  INJECT("cnrtMemcpyAsync_V3");
  return memcpy_async(dst, src, bytes, q, dir);
}

EXPORT cnrtRet_t cnrtMemcpyAsync_V2(void *dst, void *src, size_t bytes, struct queue *q, int dir) {
  INJECT("cnrtMemcpyAsync_V2");
  return memcpy_async(dst, src, bytes, q, dir);
}
#endif

EXPORT cnrtRet_t cnrtMemcpyAsync(void *dst, void *src, size_t bytes, struct queue *q, int dir) {
  INJECT("cnrtMemcpyAsync");
  return memcpy_async(dst, src, bytes, q, dir);
}

EXPORT cnrtRet_t cnrtMemcpyPeerAsync(void *dst, int dst_dev, void *src, int src_dev, size_t bytes,
                                     struct queue *q) {
  INJECT("cnrtMemcpyPeerAsync");
  if (dst_dev < 0 || dst_dev >= g_devices || src_dev < 0 || src_dev >= g_devices)
    return cnrtErrorDeviceInvalid;
  return memcpy_async(dst, src, bytes, q, cnrtMemcpyPeerToPeer);
}

/* Waits until `ready_ns` the way `device`'s flag says: asleep with
 * cnrtDeviceScheduleBlock, busy (and counted) otherwise. */
static void wait_until(int device, uint64_t ready_ns) {
  pthread_mutex_lock(&g_lock);
  unsigned flag = g_flag[device];
  pthread_mutex_unlock(&g_lock);
  uint64_t now = now_ns();
  if (ready_ns <= now) return;
  if (flag == cnrtDeviceScheduleBlock) {
    struct timespec ts = {(time_t)((ready_ns - now) / 1000000000ULL),
                          (long)((ready_ns - now) % 1000000000ULL)};
    nanosleep(&ts, NULL);
    return;
  }
  uint64_t start = now;
  while (now < ready_ns) {
    if (flag == cnrtDeviceScheduleYield) sched_yield();
    now = now_ns();
  }
  __atomic_add_fetch(&g_spin_ns, now - start, __ATOMIC_RELAXED);
}

/* Runs the ops whose time has come (all of them if `all`); returns how many remain. */
static size_t run_ops(struct queue *q, int all) {
  pthread_mutex_lock(&q->lock);
  size_t done = 0;
  while (done < q->n) {
    struct op *o = &q->ops[done];
    if (!all && o->ready_ns > now_ns()) break;
    if (all) wait_until(q->device, o->ready_ns);
    memmove(o->dst, o->src, o->len);
    done++;
  }
  memmove(q->ops, q->ops + done, (q->n - done) * sizeof *q->ops);
  q->n -= done;
  size_t left = q->n;
  pthread_mutex_unlock(&q->lock);
  return left;
}

EXPORT cnrtRet_t cnrtQueueSync(struct queue *q) {
  INJECT("cnrtQueueSync");
  if (!q) return cnrtErrorArgsInvalid;
  __atomic_add_fetch(&g_syncs, 1, __ATOMIC_RELAXED);
  run_ops(q, 1);
  return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtQueueQuery(struct queue *q) {
  INJECT("cnrtQueueQuery");
  if (!q) return cnrtErrorArgsInvalid;
  return run_ops(q, 0) == 0 ? cnrtSuccess : cnrtErrorBusy;
}

EXPORT cnrtRet_t cnrtQueueDestroy(struct queue *q) {
  INJECT("cnrtQueueDestroy");
  if (!q) return cnrtErrorArgsInvalid;
  run_ops(q, 1);
  pthread_mutex_destroy(&q->lock);
  free(q->ops);
  free(q);
  return cnrtSuccess;
}
