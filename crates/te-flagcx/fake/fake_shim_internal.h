/*
 * fake_shim_internal.h: what the files of the FAKE FlagCX shim share: the engine and
 * its registered regions, the wire structs of the loopback TCP protocol, and the
 * helpers one file defines for another. Nothing here is exported from the library:
 * every function and variable below is declared with FAKE_HIDDEN.
 *
 *   fake_shim.c    the ABI's version and error functions, and the test counters
 *   fake_engine.c  the engine: options, registrations, events
 *   fake_wire.c    blocking socket helpers both sides use
 *   fake_target.c  the target side: listening, and serving requests on its memory
 *   fake_conn.c    the initiator side: connections, posted transfers, queries
 */
#ifndef TE_FLAGCX_FAKE_SHIM_INTERNAL_H
#define TE_FLAGCX_FAKE_SHIM_INTERNAL_H

#define _GNU_SOURCE
#include "../shim/te_flagcx_shim.h"

#include <pthread.h>
#include <stdint.h>

#define FAKE_HIDDEN __attribute__((visibility("hidden")))

#define FAKE_MAGIC 0x54454658u /* "TEFX" */
#define FAKE_WIRE_VERSION 1u
#define FAKE_MAX_REGIONS_ON_WIRE 65536u
#define FAKE_MAX_DESCS_ON_WIRE (1u << 20)

/* ---------------------------------------------------------------- errors, counters */

/* fake_shim.c: the message te_flagcx_last_error returns, per thread. */
extern FAKE_HIDDEN __thread char last_error[512];

/* fake_shim.c: process-wide counters read by te_flagcx_fake_counter. */
extern FAKE_HIDDEN uint64_t counter_posts, counter_descs, counter_connects,
    counter_misuse, counter_attempts;

/* fake_shim.c: sets last_error from fmt and returns code. */
FAKE_HIDDEN int fail(int code, const char *fmt, ...);

/* ---------------------------------------------------------------- regions */

typedef struct region {
  uint64_t mr, addr, len;
  uint32_t access; /* TE_FLAGCX_ACCESS_* flags: what peers may do */
  uint32_t pins;   /* transfers moving bytes in it right now */
  int dying;       /* being deregistered: no new pins, gone once pins are 0 */
} region;

/* fake_engine.c: whether [addr, addr+len) lies inside r. */
FAKE_HIDDEN int contains(const region *r, uint64_t addr, uint64_t len);

/* ---------------------------------------------------------------- engine */

typedef struct server_conn {
  int fd;
  pthread_t thread;
  struct server_conn *next;
} server_conn;

struct te_flagcx_engine {
  /* Guards regions, briefly: a transfer pins the regions it moves bytes in and lets
     go of the lock before any socket I/O; deregistration waits on `unpinned` until
     its region's pins are 0. */
  pthread_mutex_t lock;
  pthread_cond_t unpinned;
  region *regions;
  size_t nregions, cap;
  uint64_t next_mr;

  char host[64];
  uint64_t max_desc;
  unsigned delay_ms, fail_every, stale_every, connect_delay_ms, transfer_timeout_ms,
      attempt_delay_ms;
  int fail_connect;
  uint64_t posts;

  pthread_mutex_t srv_lock;
  int listen_fd;
  int serving, stopping;
  pthread_t accept_thread;
  server_conn *served;
  char endpoint[96];

  /* te_flagcx_cancel_connects writes a byte here, never read: the read end stays
     readable, and every connect polls it beside its socket. */
  int cancel_pipe[2];

  pthread_mutex_t ev_lock; /* guards events */
  pthread_cond_t ev_cond;
  uint64_t events;
};

/* fake_engine.c */
FAKE_HIDDEN void init_monotonic_cond(pthread_cond_t *cond);
FAKE_HIDDEN void bump_events(te_flagcx_engine *e);
FAKE_HIDDEN int parse_uint(const char *key, const char *value, uint64_t *out);

/* The live (not dying) region with handle mr; e->lock held. */
FAKE_HIDDEN region *find_mr(te_flagcx_engine *e, uint64_t mr);
/* Pins the local region of each of the count descriptors, each checked to cover its
   descriptor; TE_FLAGCX_OK, or an error status with msg filled and nothing pinned. */
FAKE_HIDDEN int pin_local(te_flagcx_engine *e, const te_flagcx_desc *descs,
                          uint32_t count, char *msg, size_t cap);
/* Drops one pin of each region with these handles (dying or not); e->lock held. */
FAKE_HIDDEN void unpin_mrs(te_flagcx_engine *e, const uint64_t *mrs,
                           uint32_t count);
/* Undoes pin_local. */
FAKE_HIDDEN void unpin_local(te_flagcx_engine *e, const te_flagcx_desc *descs,
                             uint32_t count);

/* ---------------------------------------------------------------- wire */

/* fake_wire.c: 0, or -1 when the socket failed or closed, or (timeout_ms > 0) when
   it moved no byte for timeout_ms (errno ETIMEDOUT), like a queue pair whose retries
   ran out. timeout_ms 0 waits for ever. */
FAKE_HIDDEN int send_all(int fd, const void *buf, uint64_t len, unsigned timeout_ms);
FAKE_HIDDEN int recv_all(int fd, void *buf, uint64_t len, unsigned timeout_ms);
FAKE_HIDDEN int drain(int fd, uint64_t len, unsigned timeout_ms);
FAKE_HIDDEN void tune(int fd);

/* Wire structs travel in native byte order: the fake connects processes of one host. */
typedef struct hello {
  uint32_t magic, version;
} hello;

typedef struct request_header {
  uint32_t magic, op, count, reserved;
  uint64_t total;
} request_header;

typedef struct wire_range {
  uint64_t addr, len;
} wire_range;

typedef struct reply_header {
  int32_t status;
  uint32_t msglen;
} reply_header;

#endif
