/*
 * The FAKE libcnrt's memory: the table of allocations (cnrtMalloc'ed and mapped from
 * IPC handles) at fake device addresses, cnrtMalloc/cnrtFree, host allocations, and
 * cnrtPointerGetAttributes.
 *
 * Like a real device allocator, cnrtMalloc reuses the address range of a freed
 * allocation (the most recently freed one on the device that fits), so a new
 * allocation can start at the base of one just freed: whatever a program keeps by
 * base address outlives the allocation it was about. Mappings of IPC handles always
 * get fresh addresses, and cnrtPointerGetAttributes reports them as it reports
 * cnrtMalloc'ed ones: device memory, with the allocation's base and size.
 */
#include "fake_cnrt_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

static uint32_t g_serial;

/* Finds the allocation holding [addr, addr+len); the caller holds g_lock. */
struct alloc *find(uint64_t addr, size_t len) {
  for (size_t i = 0; i < g_n; i++) {
    struct alloc *a = &g_allocs[i];
    if (addr >= a->dev && addr - a->dev < a->size) {
      if (len > a->size - (addr - a->dev)) return NULL;
      return a;
    }
  }
  return NULL;
}

int is_device(uint64_t addr) { return addr >= BASE && addr < BASE + ((uint64_t)MAX_DEVICES << 40); }

/* Address ranges of freed cnrtMalloc allocations, for reuse; g_lock guards them. */
struct range {
  uint64_t dev, span;
  int ordinal;
};
static struct range *g_free;
static size_t g_free_n, g_free_cap;

/* Takes the most recently freed range of `ordinal` that holds `span` bytes, or 0. */
static uint64_t reuse(int ordinal, uint64_t *span) {
  for (size_t i = g_free_n; i-- > 0;) {
    struct range r = g_free[i];
    if (r.ordinal == ordinal && r.span >= *span) {
      g_free[i] = g_free[--g_free_n];
      *span = r.span;
      return r.dev;
    }
  }
  return 0;
}

uint64_t insert(size_t size, char *host, int ordinal, int fd, int mapped, uint32_t serial) {
  if (g_n == g_cap) {
    size_t cap = g_cap ? g_cap * 2 : 64;
    struct alloc *n = realloc(g_allocs, cap * sizeof *n);
    if (!n) return 0;
    g_allocs = n;
    g_cap = cap;
  }
  /* A gap after each allocation, so a copy that runs past its end is refused. */
  uint64_t span = ((size + 0xfffff) & ~(uint64_t)0xfffff) + 0x100000;
  uint64_t dev = mapped ? 0 : reuse(ordinal, &span);
  if (!dev) {
    dev = g_next[ordinal];
    g_next[ordinal] += span;
  }
  g_allocs[g_n++] = (struct alloc){dev, size, host, ordinal, fd, mapped, serial, span, 0};
  return dev;
}

/* Removes allocation `i`; a cnrtMalloc'ed one's range may be handed out again. */
static void remove_at(size_t i) {
  struct alloc a = g_allocs[i];
  g_allocs[i] = g_allocs[--g_n];
  if (a.mapped) return;
  if (g_free_n == g_free_cap) {
    size_t cap = g_free_cap ? g_free_cap * 2 : 64;
    struct range *n = realloc(g_free, cap * sizeof *n);
    if (!n) return; /* the range is never reused: harmless */
    g_free = n;
    g_free_cap = cap;
  }
  g_free[g_free_n++] = (struct range){a.dev, a.span, a.ordinal};
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

cnrtRet_t release(void *ptr, int mapped) {
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
