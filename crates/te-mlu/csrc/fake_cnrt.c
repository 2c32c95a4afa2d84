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
 *   An allocation's handle is given once: a second cnrtAcquireMemHandle for it fails
 *   with cnrtErrorOpsNotPermitted (CNRT's habit, the code is the fake's choice).
 *   Whether a new allocation at a freed base gets the freed one's handle value is
 *   unknown of real CNRT: te_fake_cnrt_handles_by_base(1) makes handles name the
 *   base, so it does (fake_cnrt_ipc.c).
 * - A mapping of an IPC handle is an allocation of the importer's: at a fresh address
 *   (after every earlier one on its MLU, with a gap), and cnrtPointerGetAttributes
 *   answers for any address in it with the mapped allocation's base and size, as
 *   CUDA's pointer queries do for IPC mappings (unconfirmed of real CNRT).
 * - cnrtMalloc reuses the address range of a freed allocation, so a new allocation
 *   may start where a freed one started.
 * - A queue may be given a depth (te_fake_cnrt_queue_depth(n), or
 *   TE_FAKE_CNRT_QUEUE_DEPTH=n at load time; none by default): one holding n copies not
 *   yet run refuses another with cnrtErrorBusy until cnrtQueueSync (or a cnrtQueueQuery
 *   that finds their delay passed) has run them, and counts the refusal
 *   (te_fake_cnrt_counter("busy")). What it cannot prove: whether real CNRT ever
 *   refuses an enqueue on a full queue at all (a driver may block in the call until
 *   there is room, as CUDA's does), how deep its queues are, and with which code it
 *   refuses (cnrtErrorBusy, "the device or resource is busy", is the header's nearest
 *   description, not an observation; cnrtErrorQueue or cnrtErrorNoMem are as likely).
 *   te's handling is tested against this model only.
 * - Errors can be injected per function name: te_fake_cnrt_inject(name, code, count),
 *   or TE_FAKE_CNRT_INJECT="cnrtMalloc:100100:1,cnrtQueueSync:1:2" at load time.
 *
 * Build variants (for te's binding tests): -DFAKE_V602 reports version 6.0.2 and
 * exports only cnrtMemcpyAsync (no _V2/_V3, as the 6.0.2 header); -DFAKE_NO_IPC_MAP
 * leaves out cnrtMapMemHandle.
 *
 * This file holds the library's state, its load-time settings, error injection and
 * the fake-only controls for tests (te_fake_cnrt_*); devices, memory, copies and IPC
 * handles have a file each, listed in fake_cnrt_internal.h.
 */
#include "fake_cnrt_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct inject {
  char name[64];
  int code;
  int count;
};

FAKE_HIDDEN pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
FAKE_HIDDEN struct alloc *g_allocs;
FAKE_HIDDEN size_t g_n, g_cap;
FAKE_HIDDEN uint64_t g_next[MAX_DEVICES];
static struct inject g_inject[32];
FAKE_HIDDEN int g_version[3] = {6, 14, 1};
FAKE_HIDDEN int g_devices = 2;
FAKE_HIDDEN uint64_t g_delay_ns = 1000000;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
FAKE_HIDDEN __thread int t_device;
/* Per device: the schedule flag, and whether it has been used (flag frozen). */
FAKE_HIDDEN unsigned g_flag[MAX_DEVICES];
FAKE_HIDDEN int g_active[MAX_DEVICES];
FAKE_HIDDEN size_t g_depth;
/* Counters for tests (te_fake_cnrt_counter). */
FAKE_HIDDEN uint64_t g_spin_ns, g_syncs, g_copies, g_maps, g_unmaps, g_busy;

uint64_t now_ns(void) {
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
  s = getenv("TE_FAKE_CNRT_QUEUE_DEPTH");
  if (s) g_depth = (size_t)strtoull(s, NULL, 10);
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
cnrtRet_t injected(const char *name) {
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

/* Fake-only: from now on, a queue holding `depth` copies not yet run refuses another
 * with cnrtErrorBusy until cnrtQueueSync (or a cnrtQueueQuery that finds their delay
 * passed) has run them; 0 (the default) takes any number. */
EXPORT void te_fake_cnrt_queue_depth(size_t depth) {
  pthread_once(&g_once, init);
  __atomic_store_n(&g_depth, depth, __ATOMIC_RELAXED);
}

/* Fake-only: a counter for tests: "spin_ns" (time cnrtQueueSync spent busy waiting),
 * "syncs" (cnrtQueueSync calls), "copies" (asynchronous copies enqueued), "busy"
 * (copies a full queue refused with cnrtErrorBusy), "maps" and "unmaps" (IPC handles
 * mapped by cnrtMapMemHandle, and unmapped again). */
EXPORT uint64_t te_fake_cnrt_counter(const char *name) {
  if (!name) return 0;
  if (strcmp(name, "spin_ns") == 0) return __atomic_load_n(&g_spin_ns, __ATOMIC_RELAXED);
  if (strcmp(name, "syncs") == 0) return __atomic_load_n(&g_syncs, __ATOMIC_RELAXED);
  if (strcmp(name, "copies") == 0) return __atomic_load_n(&g_copies, __ATOMIC_RELAXED);
  if (strcmp(name, "busy") == 0) return __atomic_load_n(&g_busy, __ATOMIC_RELAXED);
  if (strcmp(name, "maps") == 0) return __atomic_load_n(&g_maps, __ATOMIC_RELAXED);
  if (strcmp(name, "unmaps") == 0) return __atomic_load_n(&g_unmaps, __ATOMIC_RELAXED);
  return 0;
}

/* Fake-only: live allocations (cnrtMalloc'ed and mapped), for leak checks. */
EXPORT size_t te_fake_cnrt_live_allocations(void) {
  pthread_mutex_lock(&g_lock);
  size_t n = g_n;
  pthread_mutex_unlock(&g_lock);
  return n;
}
