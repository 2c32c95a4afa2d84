/*
 * The FAKE libcnrt's IPC handles: cnrtAcquireMemHandle names an allocation and this
 * process's fake driver, which serves its memfd on an abstract Unix socket (once per
 * allocation: a second acquire is refused with cnrtErrorOpsNotPermitted);
 * cnrtMapMemHandle asks that driver for the descriptor and maps it;
 * cnrtUnMapMemHandle releases the mapping.
 *
 * Whether real CNRT gives a new allocation at a freed base the handle value the freed
 * one had is unknown, so the exporter says which it does (te_fake_cnrt_handles_by_base):
 * by default a handle names the allocation itself, and a new allocation at the same
 * base gets another value; by base, a handle names the base address, so the new
 * allocation gets the freed one's value again, and mapping it maps whatever
 * allocation is at that base then.
 */
#include "fake_cnrt_internal.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

/* The fake driver: each exporting process serves its allocations' memfds on an
 * abstract Unix socket, "te-fake-cnrt-TOKEN", TOKEN random per process. Abstract
 * sockets belong to the network namespace, so this works across PID namespaces, where
 * /proc/PID/fd of the exporter cannot be reached. */
static pthread_once_t g_driver_once = PTHREAD_ONCE_INIT;
static uint32_t g_token;
static int g_driver_up;
/* 1: handles name the allocation's base, not the allocation (te_fake_cnrt_handles_by_base). */
static int g_by_base;

/* The fd field of a handle that names a base: this flag and the base's 1 MiB step on
 * its MLU. */
#define BY_BASE (1u << 19)

struct map_request {
  uint32_t fd, check, ordinal;
};

/* Fake-only: from now on, cnrtAcquireMemHandle gives handles that name the
 * allocation's base (on) or the allocation (off, the default). */
EXPORT void te_fake_cnrt_handles_by_base(int on) {
  __atomic_store_n(&g_by_base, on != 0, __ATOMIC_SEQ_CST);
}

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
      uint64_t base = BASE + ((uint64_t)(req.ordinal & 0xf) << 40) +
                      ((uint64_t)(req.fd & ~BY_BASE) << 20);
      for (size_t i = 0; i < g_n; i++) {
        struct alloc *a = &g_allocs[i];
        int named = (req.fd & BY_BASE) ? a->dev == base
                                       : a->fd == (int)req.fd && (a->serial & 0xff) == req.check;
        if (!a->mapped && named) {
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
 * ordinal (4) | serial check (8); by base, the fd field is BY_BASE | the base's 1 MiB
 * step on its MLU, and the check is 0. */
EXPORT cnrtRet_t cnrtAcquireMemHandle(void **handle, void *ptr) {
  INJECT("cnrtAcquireMemHandle");
  if (!handle) return cnrtErrorArgsInvalid;
  pthread_once(&g_driver_once, driver_start);
  if (!g_driver_up) return cnrtErrorSys;
  pthread_mutex_lock(&g_lock);
  struct alloc *a = is_device((uint64_t)ptr) ? find((uint64_t)ptr, 1) : NULL;
  uint64_t step = a ? (a->dev - BASE - ((uint64_t)a->ordinal << 40)) >> 20 : 0;
  if (!a || a->mapped || a->dev != (uint64_t)ptr || a->fd >= (int)BY_BASE || step >= BY_BASE) {
    pthread_mutex_unlock(&g_lock);
    return cnrtErrorArgsInvalid;
  }
  /* CNRT (drivers up to 6.2 at least) gives an allocation's handle once: a second
   * acquire for the same allocation is refused. A new allocation at the same base,
   * after cnrtFree, gets its own handle. */
  if (a->acquired) {
    pthread_mutex_unlock(&g_lock);
    return cnrtErrorOpsNotPermitted;
  }
  a->acquired = 1;
  int by_base = __atomic_load_n(&g_by_base, __ATOMIC_SEQ_CST);
  uint64_t field = by_base ? (BY_BASE | step) : (uint64_t)a->fd;
  uint64_t h = ((uint64_t)g_token << 32) | (field << 12) | ((uint64_t)(a->ordinal & 0xf) << 8) |
               (by_base ? 0 : (a->serial & 0xff));
  pthread_mutex_unlock(&g_lock);
  *handle = (void *)h;
  return cnrtSuccess;
}

#ifndef FAKE_NO_IPC_MAP
/* Asks the exporter's fake driver for the allocation's descriptor. */
static int fetch_fd(uint32_t token, uint32_t fd, uint32_t check, uint32_t ordinal) {
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) return -1;
  struct timeval tv = {5, 0};
  setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  struct sockaddr_un a;
  socklen_t len = driver_addr(token, &a);
  struct map_request req = {fd, check, ordinal};
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
  int nfd = fetch_fd(token, fd, check, (uint32_t)ordinal);
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
  __atomic_add_fetch(&g_maps, 1, __ATOMIC_RELAXED);
  *ptr = (void *)dev;
  return cnrtSuccess;
}
#endif

EXPORT cnrtRet_t cnrtUnMapMemHandle(void *ptr) {
  INJECT("cnrtUnMapMemHandle");
  cnrtRet_t r = release(ptr, 1);
  if (r == cnrtSuccess) __atomic_add_fetch(&g_unmaps, 1, __ATOMIC_RELAXED);
  return r;
}
