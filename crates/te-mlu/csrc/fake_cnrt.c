/*
 * A FAKE libcnrt for te's tests. It is not Cambricon's library and proves nothing
 * about real hardware; see docs/mlu.md ("What the fake cannot prove").
 *
 * It exports the CNRT (>= 6.x) symbols te binds, with the signatures, enum values and
 * struct layouts listed in docs/mlu-abi.md, and behaves enough like the real library
 * that te's logic is exercised:
 *
 * - "Device memory" is a memfd per allocation, mapped into the process, but the
 *   addresses handed out are non-canonical (0x7d...): the host faults on any direct
 *   dereference, so only the library's copies can reach the bytes.
 * - Asynchronous copies are queued and run only when the queue is synchronized
 *   (cnrtQueueSync) or queried (cnrtQueueQuery) after their delay has passed
 *   (TE_FAKE_CNRT_COPY_DELAY_US, default 1000 us).
 * - A queue belongs to the device current when it was created; enqueueing a copy on
 *   it while another device is current fails with cnrtErrorDevice ("current resource
 *   is not from the current device").
 * - cnrtQueueSync waits the way the device flag says (cnrtSetDeviceFlag, per device):
 *   blocked in the kernel with cnrtDeviceScheduleBlock, otherwise busy (spin, yield,
 *   auto, and the default), and the time spent busy is counted
 *   (te_fake_cnrt_counter("spin_ns")). The flag can be set only before the device is
 *   used (an allocation or a queue on it): then cnrtErrorSetOnActiveProcess.
 * - IPC handles (cnrtAcquireMemHandle / cnrtMapMemHandle) work across processes,
 *   PID namespaces included, as the real driver's do: the exporter serves its
 *   allocations' memfds on an abstract Unix socket named in the handle, and the
 *   importer receives the descriptor with SCM_RIGHTS. Nothing goes through /proc.
 * - Errors can be injected per function name: te_fake_cnrt_inject(name, code, count),
 *   or TE_FAKE_CNRT_INJECT="cnrtMalloc:100100:1,cnrtQueueSync:1:2" at load time.
 *
 * Build variants (for te's binding tests): -DFAKE_V602 reports version 6.0.2 and
 * exports only cnrtMemcpyAsync (no _V2/_V3, as the 6.0.2 header); -DFAKE_NO_IPC_MAP
 * leaves out cnrtMapMemHandle.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <stddef.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef int cnrtRet_t;
enum {
  cnrtSuccess = 0,
  cnrtErrorNotReady = 1,
  cnrtErrorNoDevice = 100004,
  cnrtErrorDeviceInvalid = 100005,
  cnrtErrorArgsInvalid = 100006,
  cnrtErrorSys = 100007,
  cnrtErrorSysNoMem = 100010,
  cnrtErrorInvalidResourceHandle = 100014,
  cnrtErrorNotSupport = 100050,
  cnrtErrorQueue = 100060,
  cnrtErrorNoMem = 100100,
  cnrtErrorSetOnActiveProcess = 632002,
  cnrtErrorDevice = 632006,
  cnrtErrorMemcpyDirectionInvalid = 632013,
  cnrtErrorBusy = 632014,
  cnrtErrorCndrvFuncCall = 632015,
  cnrtErrorUnknown = 999991,
};

enum {
  cnrtMemcpyHostToDev = 0,
  cnrtMemcpyDevToDev = 1,
  cnrtMemcpyDevToHost = 2,
  cnrtMemcpyHostToHost = 3,
  cnrtMemcpyPeerToPeer = 4,
  cnrtMemcpyNoDirection = 5,
};

enum { cnrtMemTypeUnregistered = 0, cnrtMemTypeHost = 1, cnrtMemTypeDevice = 2 };

enum {
  cnrtDeviceScheduleSpin = 0,
  cnrtDeviceScheduleBlock = 1,
  cnrtDeviceScheduleYield = 2,
  cnrtDeviceScheduleAuto = 3,
};

typedef struct {
  int type;
  int device;
  size_t size;
  void *devicePointer;
  void *hostPointer;
  int cacheMode;
  void *deviceBasePointer;
} cnrtPointerAttributes_t;

#define BASE 0x7d00000000000000ULL
#define MAX_DEVICES 16

struct alloc {
  uint64_t dev;   /* the fake device address */
  size_t size;
  char *host;     /* where the bytes really are, in this process */
  int ordinal;
  int fd;
  int mapped;     /* 1: mapped from an IPC handle; 0: from cnrtMalloc */
  uint32_t serial;
};

struct op {
  char *dst;
  const char *src;
  size_t len;
  uint64_t ready_ns;
};

struct queue {
  pthread_mutex_t lock;
  struct op *ops;
  size_t n, cap;
  int device;
};

struct inject {
  char name[64];
  int code;
  int count;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct alloc *g_allocs;
static size_t g_n, g_cap;
static uint64_t g_next[MAX_DEVICES];
static uint32_t g_serial;
static struct inject g_inject[32];
static int g_version[3] = {6, 14, 1};
static int g_devices = 2;
static uint64_t g_delay_ns = 1000000;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static __thread int t_device;
/* Per device: the schedule flag, and whether it has been used (flag frozen). */
static unsigned g_flag[MAX_DEVICES];
static int g_active[MAX_DEVICES];
/* Counters for tests (te_fake_cnrt_counter). */
static uint64_t g_spin_ns, g_syncs, g_copies;

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static void add_inject(const char *name, int code, int count) {
  for (int i = 0; i < 32; i++) {
    if (g_inject[i].count == 0 || strcmp(g_inject[i].name, name) == 0) {
      snprintf(g_inject[i].name, sizeof g_inject[i].name, "%s", name);
      g_inject[i].code = code;
      g_inject[i].count = count;
      return;
    }
  }
}

static void init(void) {
  const char *s = getenv("TE_FAKE_CNRT_DEVICES");
  if (s && atoi(s) >= 0 && atoi(s) <= MAX_DEVICES) g_devices = atoi(s);
  s = getenv("TE_FAKE_CNRT_COPY_DELAY_US");
  if (s) g_delay_ns = (uint64_t)strtoull(s, NULL, 10) * 1000ULL;
#ifdef FAKE_V602
  g_version[0] = 6;
  g_version[1] = 0;
  g_version[2] = 2;
#endif
  for (int i = 0; i < MAX_DEVICES; i++) g_next[i] = BASE + ((uint64_t)i << 40);
  s = getenv("TE_FAKE_CNRT_INJECT");
  if (s) {
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", s);
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
      char name[64];
      int code, count;
      if (sscanf(tok, "%63[^:]:%d:%d", name, &code, &count) == 3) add_inject(name, code, count);
    }
  }
}

/* Returns the injected error for `name`, or cnrtSuccess. */
static cnrtRet_t injected(const char *name) {
  pthread_once(&g_once, init);
  cnrtRet_t r = cnrtSuccess;
  pthread_mutex_lock(&g_lock);
  for (int i = 0; i < 32; i++) {
    if (g_inject[i].count > 0 && strcmp(g_inject[i].name, name) == 0) {
      g_inject[i].count--;
      r = g_inject[i].code;
      break;
    }
  }
  pthread_mutex_unlock(&g_lock);
  return r;
}

#define INJECT(name)                      \
  do {                                    \
    cnrtRet_t _r = injected(name);        \
    if (_r != cnrtSuccess) return _r;     \
  } while (0)

/* Fake-only: the next `count` calls of `name` return `code`. */
EXPORT void te_fake_cnrt_inject(const char *name, int code, int count) {
  pthread_once(&g_once, init);
  pthread_mutex_lock(&g_lock);
  add_inject(name, code, count);
  pthread_mutex_unlock(&g_lock);
}

/* Fake-only: the version cnrtGetLibVersion reports from now on. */
EXPORT void te_fake_cnrt_set_version(int major, int minor, int patch) {
  pthread_once(&g_once, init);
  g_version[0] = major;
  g_version[1] = minor;
  g_version[2] = patch;
}

/* Fake-only: a counter for tests: "spin_ns" (time cnrtQueueSync spent busy waiting),
 * "syncs" (cnrtQueueSync calls), "copies" (asynchronous copies enqueued). */
EXPORT uint64_t te_fake_cnrt_counter(const char *name) {
  if (!name) return 0;
  if (strcmp(name, "spin_ns") == 0) return __atomic_load_n(&g_spin_ns, __ATOMIC_RELAXED);
  if (strcmp(name, "syncs") == 0) return __atomic_load_n(&g_syncs, __ATOMIC_RELAXED);
  if (strcmp(name, "copies") == 0) return __atomic_load_n(&g_copies, __ATOMIC_RELAXED);
  return 0;
}

/* Fake-only: live allocations (cnrtMalloc'ed and mapped), for leak checks. */
EXPORT size_t te_fake_cnrt_live_allocations(void) {
  pthread_mutex_lock(&g_lock);
  size_t n = g_n;
  pthread_mutex_unlock(&g_lock);
  return n;
}

/* Finds the allocation holding [addr, addr+len); the caller holds g_lock. */
static struct alloc *find(uint64_t addr, size_t len) {
  for (size_t i = 0; i < g_n; i++) {
    struct alloc *a = &g_allocs[i];
    if (addr >= a->dev && addr - a->dev < a->size) {
      if (len > a->size - (addr - a->dev)) return NULL;
      return a;
    }
  }
  return NULL;
}

static int is_device(uint64_t addr) { return addr >= BASE && addr < BASE + ((uint64_t)MAX_DEVICES << 40); }

static uint64_t insert(size_t size, char *host, int ordinal, int fd, int mapped, uint32_t serial) {
  if (g_n == g_cap) {
    size_t cap = g_cap ? g_cap * 2 : 64;
    struct alloc *n = realloc(g_allocs, cap * sizeof *n);
    if (!n) return 0;
    g_allocs = n;
    g_cap = cap;
  }
  uint64_t dev = g_next[ordinal];
  /* A gap after each allocation, so a copy that runs past its end is refused. */
  g_next[ordinal] += ((size + 0xfffff) & ~(uint64_t)0xfffff) + 0x100000;
  g_allocs[g_n++] = (struct alloc){dev, size, host, ordinal, fd, mapped, serial};
  return dev;
}

static void remove_at(size_t i) {
  g_allocs[i] = g_allocs[--g_n];
}

EXPORT cnrtRet_t cnrtGetLibVersion(int *major, int *minor, int *patch) {
  INJECT("cnrtGetLibVersion");
  if (!major || !minor || !patch) return cnrtErrorArgsInvalid;
  *major = g_version[0];
  *minor = g_version[1];
  *patch = g_version[2];
  return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtGetDeviceCount(unsigned int *count) {
  INJECT("cnrtGetDeviceCount");
  if (!count) return cnrtErrorArgsInvalid;
  *count = (unsigned int)g_devices;
  return g_devices > 0 ? cnrtSuccess : cnrtErrorNoDevice;
}

EXPORT cnrtRet_t cnrtSetDevice(int ordinal) {
  INJECT("cnrtSetDevice");
  if (ordinal < 0 || ordinal >= g_devices) return cnrtErrorDeviceInvalid;
  t_device = ordinal;
  return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtGetDevice(int *ordinal) {
  INJECT("cnrtGetDevice");
  if (!ordinal) return cnrtErrorArgsInvalid;
  *ordinal = t_device;
  return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtSetDeviceFlag(uint32_t flags) {
  INJECT("cnrtSetDeviceFlag");
  if (flags > cnrtDeviceScheduleAuto) return cnrtErrorArgsInvalid;
  pthread_mutex_lock(&g_lock);
  cnrtRet_t r = cnrtSuccess;
  if (g_active[t_device])
    r = cnrtErrorSetOnActiveProcess;
  else
    g_flag[t_device] = flags;
  pthread_mutex_unlock(&g_lock);
  return r;
}

EXPORT cnrtRet_t cnrtGetDeviceFlag(uint32_t *flags) {
  INJECT("cnrtGetDeviceFlag");
  if (!flags) return cnrtErrorArgsInvalid;
  pthread_mutex_lock(&g_lock);
  *flags = g_flag[t_device];
  pthread_mutex_unlock(&g_lock);
  return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtMalloc(void **ptr, size_t bytes) {
  INJECT("cnrtMalloc");
  if (!ptr || bytes == 0) return cnrtErrorArgsInvalid;
  pthread_mutex_lock(&g_lock);
  uint32_t serial = ++g_serial;
  pthread_mutex_unlock(&g_lock);
  char name[64];
  snprintf(name, sizeof name, "te-fake-cnrt-%u", serial);
  int fd = (int)syscall(SYS_memfd_create, name, 1 /* MFD_CLOEXEC */);
  if (fd < 0) return cnrtErrorSysNoMem;
  if (ftruncate(fd, (off_t)bytes) != 0) {
    close(fd);
    return cnrtErrorNoMem;
  }
  char *host = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (host == MAP_FAILED) {
    close(fd);
    return cnrtErrorNoMem;
  }
  pthread_mutex_lock(&g_lock);
  uint64_t dev = insert(bytes, host, t_device, fd, 0, serial);
  g_active[t_device] = 1;
  pthread_mutex_unlock(&g_lock);
  if (!dev) {
    munmap(host, bytes);
    close(fd);
    return cnrtErrorSysNoMem;
  }
  *ptr = (void *)dev;
  return cnrtSuccess;
}

static cnrtRet_t release(void *ptr, int mapped) {
  if (!ptr) return cnrtSuccess;
  pthread_mutex_lock(&g_lock);
  for (size_t i = 0; i < g_n; i++) {
    struct alloc a = g_allocs[i];
    if (a.dev == (uint64_t)ptr && a.mapped == mapped) {
      remove_at(i);
      pthread_mutex_unlock(&g_lock);
      munmap(a.host, a.size);
      close(a.fd);
      return cnrtSuccess;
    }
  }
  pthread_mutex_unlock(&g_lock);
  return cnrtErrorArgsInvalid;
}

EXPORT cnrtRet_t cnrtFree(void *ptr) {
  INJECT("cnrtFree");
  return release(ptr, 0);
}

EXPORT cnrtRet_t cnrtHostMalloc(void **ptr, size_t bytes) {
  INJECT("cnrtHostMalloc");
  if (!ptr || bytes == 0) return cnrtErrorArgsInvalid;
  void *p = NULL;
  if (posix_memalign(&p, 4096, bytes) != 0) return cnrtErrorSysNoMem;
  memset(p, 0, bytes);
  *ptr = p;
  return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtFreeHost(void *ptr) {
  INJECT("cnrtFreeHost");
  free(ptr);
  return cnrtSuccess;
}

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
  __atomic_add_fetch(&g_copies, 1, __ATOMIC_RELAXED);
  pthread_mutex_lock(&q->lock);
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

EXPORT cnrtRet_t cnrtPointerGetAttributes(cnrtPointerAttributes_t *attr, const void *ptr) {
  INJECT("cnrtPointerGetAttributes");
  if (!attr) return cnrtErrorArgsInvalid;
  memset(attr, 0, sizeof *attr);
  attr->device = -1;
  pthread_mutex_lock(&g_lock);
  struct alloc *a = is_device((uint64_t)ptr) ? find((uint64_t)ptr, 1) : NULL;
  if (a) {
    attr->type = cnrtMemTypeDevice;
    attr->device = a->ordinal;
    attr->size = a->size;
    attr->devicePointer = (void *)ptr;
    attr->deviceBasePointer = (void *)a->dev;
  } else {
    attr->type = cnrtMemTypeUnregistered;
  }
  pthread_mutex_unlock(&g_lock);
  return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtGetPeerAccessibility(unsigned int *can, int ordinal, int peer) {
  INJECT("cnrtGetPeerAccessibility");
  if (!can) return cnrtErrorArgsInvalid;
  if (ordinal < 0 || ordinal >= g_devices || peer < 0 || peer >= g_devices)
    return cnrtErrorDeviceInvalid;
  *can = 1;
  return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtDeviceGetPCIBusId(char *bus, int len, int device) {
  INJECT("cnrtDeviceGetPCIBusId");
  if (!bus || len <= 0) return cnrtErrorArgsInvalid;
  if (device < 0 || device >= g_devices) return cnrtErrorDeviceInvalid;
  snprintf(bus, (size_t)len, "0000:%02x:00.0", 0x1a + device);
  return cnrtSuccess;
}

/* The fake driver: each exporting process serves its allocations' memfds on an
 * abstract Unix socket, "te-fake-cnrt-TOKEN", TOKEN random per process. Abstract
 * sockets belong to the network namespace, so this works across PID namespaces, where
 * /proc/PID/fd of the exporter cannot be reached. */
static pthread_once_t g_driver_once = PTHREAD_ONCE_INIT;
static uint32_t g_token;
static int g_driver_up;

struct map_request {
  uint32_t fd, check;
};

static socklen_t driver_addr(uint32_t token, struct sockaddr_un *a) {
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "te-fake-cnrt-%08x", token);
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* Sends `status`, with descriptor `fd` attached when it is not -1. */
static void send_fd(int sock, int32_t status, int fd) {
  char space[CMSG_SPACE(sizeof(int))];
  memset(space, 0, sizeof space);
  struct iovec iov = {&status, sizeof status};
  struct msghdr m = {0};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  if (fd >= 0) {
    m.msg_control = space;
    m.msg_controllen = sizeof space;
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  (void)sendmsg(sock, &m, MSG_NOSIGNAL);
}

static void *driver_thread(void *arg) {
  int lfd = (int)(intptr_t)arg;
  for (;;) {
    int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (c < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      return NULL;
    }
    struct map_request req;
    int fd = -1;
    if (recv(c, &req, sizeof req, MSG_WAITALL) == (ssize_t)sizeof req) {
      pthread_mutex_lock(&g_lock);
      for (size_t i = 0; i < g_n; i++) {
        struct alloc *a = &g_allocs[i];
        if (!a->mapped && a->fd == (int)req.fd && (a->serial & 0xff) == req.check) {
          fd = dup(a->fd);
          break;
        }
      }
      pthread_mutex_unlock(&g_lock);
    }
    send_fd(c, fd >= 0 ? cnrtSuccess : cnrtErrorInvalidResourceHandle, fd);
    if (fd >= 0) close(fd);
    close(c);
  }
}

static void driver_start(void) {
  if (getrandom(&g_token, sizeof g_token, 0) != (ssize_t)sizeof g_token)
    g_token = (uint32_t)now_ns() ^ (uint32_t)getpid();
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  struct sockaddr_un a;
  socklen_t len = driver_addr(g_token, &a);
  pthread_t t;
  if (bind(fd, (struct sockaddr *)&a, len) != 0 || listen(fd, 64) != 0 ||
      pthread_create(&t, NULL, driver_thread, (void *)(intptr_t)fd) != 0) {
    close(fd);
    return;
  }
  pthread_detach(t);
  g_driver_up = 1;
}

/* Handle layout (8 bytes, the size of cnrtIpcMemHandle): driver token (32) | fd (20) |
 * ordinal (4) | serial check (8). */
EXPORT cnrtRet_t cnrtAcquireMemHandle(void **handle, void *ptr) {
  INJECT("cnrtAcquireMemHandle");
  if (!handle) return cnrtErrorArgsInvalid;
  pthread_once(&g_driver_once, driver_start);
  if (!g_driver_up) return cnrtErrorSys;
  pthread_mutex_lock(&g_lock);
  struct alloc *a = is_device((uint64_t)ptr) ? find((uint64_t)ptr, 1) : NULL;
  if (!a || a->mapped || a->dev != (uint64_t)ptr || a->fd >= (1 << 20)) {
    pthread_mutex_unlock(&g_lock);
    return cnrtErrorArgsInvalid;
  }
  uint64_t h = ((uint64_t)g_token << 32) | ((uint64_t)a->fd << 12) |
               ((uint64_t)(a->ordinal & 0xf) << 8) | (a->serial & 0xff);
  pthread_mutex_unlock(&g_lock);
  *handle = (void *)h;
  return cnrtSuccess;
}

#ifndef FAKE_NO_IPC_MAP
/* Asks the exporter's fake driver for the allocation's descriptor. */
static int fetch_fd(uint32_t token, uint32_t fd, uint32_t check) {
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return -1;
  struct timeval tv = {5, 0};
  setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  struct sockaddr_un a;
  socklen_t len = driver_addr(token, &a);
  struct map_request req = {fd, check};
  int32_t status = cnrtErrorInvalidResourceHandle;
  char space[CMSG_SPACE(sizeof(int))];
  struct iovec iov = {&status, sizeof status};
  struct msghdr m = {0};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = space;
  m.msg_controllen = sizeof space;
  int got = -1;
  if (connect(s, (struct sockaddr *)&a, len) == 0 &&
      send(s, &req, sizeof req, MSG_NOSIGNAL) == (ssize_t)sizeof req &&
      recvmsg(s, &m, MSG_CMSG_CLOEXEC) == (ssize_t)sizeof status && status == cnrtSuccess) {
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    if (c && c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
      memcpy(&got, CMSG_DATA(c), sizeof got);
  }
  close(s);
  return got;
}

EXPORT cnrtRet_t cnrtMapMemHandle(void **ptr, void *handle, int flags) {
  INJECT("cnrtMapMemHandle");
  if (!ptr || flags != 0) return cnrtErrorArgsInvalid;
  uint64_t h = (uint64_t)handle;
  uint32_t token = (uint32_t)(h >> 32), fd = (uint32_t)((h >> 12) & 0xfffff);
  int ordinal = (int)((h >> 8) & 0xf);
  uint32_t check = (uint32_t)(h & 0xff);
  int nfd = fetch_fd(token, fd, check);
  if (nfd < 0) return cnrtErrorInvalidResourceHandle;
  struct stat st;
  if (fstat(nfd, &st) != 0 || st.st_size <= 0) {
    close(nfd);
    return cnrtErrorInvalidResourceHandle;
  }
  char *host = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, nfd, 0);
  if (host == MAP_FAILED) {
    close(nfd);
    return cnrtErrorNoMem;
  }
  pthread_mutex_lock(&g_lock);
  uint64_t dev = insert((size_t)st.st_size, host, ordinal, nfd, 1, check);
  pthread_mutex_unlock(&g_lock);
  if (!dev) {
    munmap(host, (size_t)st.st_size);
    close(nfd);
    return cnrtErrorSysNoMem;
  }
  *ptr = (void *)dev;
  return cnrtSuccess;
}
#endif

EXPORT cnrtRet_t cnrtUnMapMemHandle(void *ptr) {
  INJECT("cnrtUnMapMemHandle");
  return release(ptr, 1);
}

EXPORT const char *cnrtGetErrorName(cnrtRet_t e) {
  switch (e) {
    case cnrtSuccess: return "cnrtSuccess";
    case cnrtErrorNotReady: return "cnrtErrorNotReady";
    case cnrtErrorNoDevice: return "cnrtErrorNoDevice";
    case cnrtErrorDeviceInvalid: return "cnrtErrorDeviceInvalid";
    case cnrtErrorArgsInvalid: return "cnrtErrorArgsInvalid";
    case cnrtErrorSysNoMem: return "cnrtErrorSysNoMem";
    case cnrtErrorInvalidResourceHandle: return "cnrtErrorInvalidResourceHandle";
    case cnrtErrorNotSupport: return "cnrtErrorNotSupport";
    case cnrtErrorQueue: return "cnrtErrorQueue";
    case cnrtErrorNoMem: return "cnrtErrorNoMem";
    case cnrtErrorMemcpyDirectionInvalid: return "cnrtErrorMemcpyDirectionInvalid";
    case cnrtErrorBusy: return "cnrtErrorBusy";
    case cnrtErrorCndrvFuncCall: return "cnrtErrorCndrvFuncCall";
    case cnrtErrorSetOnActiveProcess: return "cnrtErrorSetOnActiveProcess";
    case cnrtErrorDevice: return "cnrtErrorDevice";
    default: return "cnrtErrorUnknown";
  }
}

EXPORT const char *cnrtGetErrorStr(cnrtRet_t e) {
  switch (e) {
    case cnrtSuccess: return "no error (fake libcnrt)";
    case cnrtErrorNotReady: return "the device or resource is busy now (fake libcnrt)";
    case cnrtErrorNoDevice: return "no MLU device found (fake libcnrt)";
    case cnrtErrorDeviceInvalid: return "invalid device ordinal (fake libcnrt)";
    case cnrtErrorArgsInvalid: return "invalid argument (fake libcnrt)";
    case cnrtErrorSysNoMem: return "insufficient host memory (fake libcnrt)";
    case cnrtErrorInvalidResourceHandle: return "invalid resource handle (fake libcnrt)";
    case cnrtErrorNoMem: return "insufficient MLU device memory (fake libcnrt)";
    case cnrtErrorBusy: return "the queue is busy (fake libcnrt)";
    case cnrtErrorSetOnActiveProcess:
      return "the device flag cannot change once the device is in use (fake libcnrt)";
    case cnrtErrorDevice: return "current resource is not from the current device (fake libcnrt)";
    default: return "unknown error (fake libcnrt)";
  }
}
