/*
 * fake_cnrt_internal.h: what the files of the FAKE libcnrt share: the CNRT types and
 * values it exports functions over (docs/mlu-abi.md), its allocations and queues, the
 * process-wide state, and the helpers one file defines for another. Only functions
 * marked EXPORT leave the library; everything declared here is FAKE_HIDDEN (and the
 * build compiles with -fvisibility=hidden besides).
 *
 *   fake_cnrt.c         the state, load-time settings, error injection, test controls
 *   fake_cnrt_device.c  version, devices and their flags, error names
 *   fake_cnrt_memory.c  allocations: the table, cnrtMalloc/cnrtFree, pointer queries
 *   fake_cnrt_copy.c    synchronous copies, queues and the copies queued on them
 *   fake_cnrt_ipc.c     IPC handles, served across processes by a fake driver
 */
#ifndef TE_FAKE_CNRT_INTERNAL_H
#define TE_FAKE_CNRT_INTERNAL_H

#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define EXPORT __attribute__((visibility("default")))
#define FAKE_HIDDEN __attribute__((visibility("hidden")))

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
  cnrtErrorOpsNotPermitted = 100051,
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
  uint64_t span;  /* the address range it holds, its size rounded up plus a gap */
  int acquired;   /* cnrtAcquireMemHandle has given out its handle */
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

/* Defined in fake_cnrt.c. */
extern FAKE_HIDDEN pthread_mutex_t g_lock;
extern FAKE_HIDDEN struct alloc *g_allocs;
extern FAKE_HIDDEN size_t g_n, g_cap;
extern FAKE_HIDDEN uint64_t g_next[MAX_DEVICES];
extern FAKE_HIDDEN int g_version[3];
extern FAKE_HIDDEN int g_devices;
extern FAKE_HIDDEN uint64_t g_delay_ns;
extern FAKE_HIDDEN __thread int t_device;
/* Per device: the schedule flag, and whether it has been used (flag frozen). */
extern FAKE_HIDDEN unsigned g_flag[MAX_DEVICES];
extern FAKE_HIDDEN int g_active[MAX_DEVICES];
/* The most copies a queue holds not yet run (0: no limit); see te_fake_cnrt_queue_depth. */
extern FAKE_HIDDEN size_t g_depth;
/* Counters for tests (te_fake_cnrt_counter). */
extern FAKE_HIDDEN uint64_t g_spin_ns, g_syncs, g_copies, g_maps, g_unmaps, g_busy;

/* fake_cnrt.c */
FAKE_HIDDEN uint64_t now_ns(void);
FAKE_HIDDEN cnrtRet_t injected(const char *name);

#define INJECT(name)                      \
  do {                                    \
    cnrtRet_t _r = injected(name);        \
    if (_r != cnrtSuccess) return _r;     \
  } while (0)

/* fake_cnrt_memory.c; find and insert want g_lock held. */
FAKE_HIDDEN struct alloc *find(uint64_t addr, size_t len);
FAKE_HIDDEN int is_device(uint64_t addr);
FAKE_HIDDEN uint64_t insert(size_t size, char *host, int ordinal, int fd, int mapped, uint32_t serial);
FAKE_HIDDEN cnrtRet_t release(void *ptr, int mapped);

#endif
