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
 * - IPC handles (cnrtAcquireMemHandle / cnrtMapMemHandle) work across processes of
 *   one user: the handle names the exporter's pid and memfd, which the importer opens
 *   through /proc/PID/fd.
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
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
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
  cnrtErrorSysNoMem = 100010,
  cnrtErrorInvalidResourceHandle = 100014,
  cnrtErrorNotSupport = 100050,
  cnrtErrorQueue = 100060,
  cnrtErrorNoMem = 100100,
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
  *q = n;
  return cnrtSuccess;
}

static cnrtRet_t enqueue(struct queue *q, char *d, const char *s, size_t len) {
  if (!q) return cnrtErrorArgsInvalid; /* te never uses the default queue */
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

/* Runs the ops whose time has come (all of them if `all`); returns how many remain. */
static size_t run_ops(struct queue *q, int all) {
  pthread_mutex_lock(&q->lock);
  size_t done = 0;
  while (done < q->n) {
    struct op *o = &q->ops[done];
    if (!all && o->ready_ns > now_ns()) break;
    if (all) {
      uint64_t now = now_ns();
      if (o->ready_ns > now) {
        struct timespec ts = {(time_t)((o->ready_ns - now) / 1000000000ULL),
                              (long)((o->ready_ns - now) % 1000000000ULL)};
        nanosleep(&ts, NULL);
      }
    }
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

/* Handle layout (8 bytes, the size of cnrtIpcMemHandle): pid (32) | fd (20) |
 * ordinal (4) | serial check (8). */
EXPORT cnrtRet_t cnrtAcquireMemHandle(void **handle, void *ptr) {
  INJECT("cnrtAcquireMemHandle");
  if (!handle) return cnrtErrorArgsInvalid;
  pthread_mutex_lock(&g_lock);
  struct alloc *a = is_device((uint64_t)ptr) ? find((uint64_t)ptr, 1) : NULL;
  if (!a || a->mapped || a->dev != (uint64_t)ptr || a->fd >= (1 << 20)) {
    pthread_mutex_unlock(&g_lock);
    return cnrtErrorArgsInvalid;
  }
  uint64_t h = ((uint64_t)(uint32_t)getpid() << 32) | ((uint64_t)a->fd << 12) |
               ((uint64_t)(a->ordinal & 0xf) << 8) | (a->serial & 0xff);
  pthread_mutex_unlock(&g_lock);
  *handle = (void *)h;
  return cnrtSuccess;
}

#ifndef FAKE_NO_IPC_MAP
EXPORT cnrtRet_t cnrtMapMemHandle(void **ptr, void *handle, int flags) {
  INJECT("cnrtMapMemHandle");
  if (!ptr || flags != 0) return cnrtErrorArgsInvalid;
  uint64_t h = (uint64_t)handle;
  unsigned pid = (unsigned)(h >> 32), fd = (unsigned)((h >> 12) & 0xfffff);
  int ordinal = (int)((h >> 8) & 0xf);
  unsigned check = (unsigned)(h & 0xff);
  char path[64], link[128];
  snprintf(path, sizeof path, "/proc/%u/fd/%u", pid, fd);
  ssize_t n = readlink(path, link, sizeof link - 1);
  if (n <= 0) return cnrtErrorInvalidResourceHandle;
  link[n] = 0;
  unsigned serial = 0;
  if (sscanf(link, "/memfd:te-fake-cnrt-%u", &serial) != 1 || (serial & 0xff) != check)
    return cnrtErrorInvalidResourceHandle;
  int nfd = open(path, O_RDWR | O_CLOEXEC);
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
  uint64_t dev = insert((size_t)st.st_size, host, ordinal, nfd, 1, serial);
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
    default: return "unknown error (fake libcnrt)";
  }
}
