/*
 * te_flagcx_shim.h: the C ABI between te's FlagCX backend (crates/te-flagcx) and a
 * FlagCX point-to-point engine.
 *
 * FlagCX's P2P engine (flagcx_p2p.h) is a C++ API: mangled names, std::vector
 * parameters, and a completion query that returns only "finished", even when slices
 * failed. This header is the small C surface te needs, implemented twice:
 *
 *   te_flagcx_shim.cc   over flagcx_p2p.h, built by build.rs when FLAGCX_HOME is set;
 *   ../fake/            a FAKE for tests: moves bytes between processes over loopback
 *                       TCP, with error injection. It is not FlagCX.
 *
 * The Rust backend loads an implementation at run time (dlopen) and resolves every
 * symbol below once; a missing symbol makes the backend unavailable, naming it.
 *
 * Conventions
 * - Functions returning int return TE_FLAGCX_OK (0) or a negative TE_FLAGCX_E_* code.
 *   After a failure, te_flagcx_last_error() gives a one-line message on the same thread.
 * - Every function may be called from any thread, concurrently, except that an engine
 *   or connection must not be destroyed while another call uses it.
 */
#ifndef TE_FLAGCX_SHIM_H
#define TE_FLAGCX_SHIM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The ABI version this header describes; te_flagcx_shim_abi() must return it. */
#define TE_FLAGCX_SHIM_ABI 5

/* Status codes. */
#define TE_FLAGCX_OK 0
/* te_flagcx_query only: the transfer has not finished. */
#define TE_FLAGCX_PENDING 1
/* An argument is malformed (null pointer, zero length, descriptor over the limit). */
#define TE_FLAGCX_E_INVALID (-1)
/* The peer cannot be reached, or the connection to it broke. */
#define TE_FLAGCX_E_UNREACHABLE (-2)
/* A local memory handle or a remote range is not (or no longer) registered. */
#define TE_FLAGCX_E_NOT_REGISTERED (-3)
/* A remote range is not in the connection's region table: the table is a snapshot
   taken at connect time and the peer has registered (or re-registered) since.
   Connecting again takes a fresh snapshot. */
#define TE_FLAGCX_E_STALE (-4)
/* The memory kind or operation is not supported by this implementation. */
#define TE_FLAGCX_E_UNSUPPORTED (-5)
/* The transfer failed after it was posted: it finished with failed slices (some of
   its bytes never arrived), or the remote side refused it. */
#define TE_FLAGCX_E_TRANSFER (-6)
/* Anything else: the library under the shim failed, out of memory. */
#define TE_FLAGCX_E_INTERNAL (-7)
/* The target refused the transfer: the registration holding the remote range does not
   allow this remote access (a WRITE into memory not remotely writable, a READ from
   memory not remotely readable). */
#define TE_FLAGCX_E_ACCESS (-8)

/* Remote rights of a registration (te_flagcx_register's `access`); 0: local use
   only. */
#define TE_FLAGCX_ACCESS_REMOTE_READ 1u  /* peers may READ from it */
#define TE_FLAGCX_ACCESS_REMOTE_WRITE 2u /* peers may WRITE into it */

/* Operations. */
#define TE_FLAGCX_OP_READ 0  /* remote -> local */
#define TE_FLAGCX_OP_WRITE 1 /* local -> remote */

typedef struct te_flagcx_engine te_flagcx_engine;
typedef struct te_flagcx_conn te_flagcx_conn;
typedef struct te_flagcx_attempt te_flagcx_attempt;

/* One contiguous copy. len must be 1..=te_flagcx_max_desc_len(engine). */
typedef struct te_flagcx_desc {
  uint64_t local_mr;    /* handle from te_flagcx_register on this engine */
  uint64_t local_addr;  /* inside that registration */
  uint64_t remote_addr; /* absolute address in the peer's address space */
  uint64_t len;         /* bytes */
} te_flagcx_desc;

/* TE_FLAGCX_SHIM_ABI of the implementation. */
uint32_t te_flagcx_shim_abi(void);

/* A human-readable name and version of the implementation (static storage). */
const char *te_flagcx_shim_version(void);

/* The message of the last failed call on this thread (thread-local storage, valid
   until the next call on this thread); "" if none. */
const char *te_flagcx_last_error(void);

/* Creates an engine. `options` is a comma-separated list of key=value pairs that the
   implementation interprets (may be "" or NULL); an unknown key is TE_FLAGCX_E_INVALID. */
int te_flagcx_engine_create(const char *options, te_flagcx_engine **out);

/* Destroys an engine: its server, its connections' transfers are abandoned. */
void te_flagcx_engine_destroy(te_flagcx_engine *engine);

/* Starts accepting connections from peers. Idempotent. */
int te_flagcx_start_server(te_flagcx_engine *engine);

/* The string a peer passes to te_flagcx_connect to reach this engine ("host:port"),
   valid until the engine is destroyed; NULL (with last_error set) before
   te_flagcx_start_server succeeded. */
const char *te_flagcx_endpoint(te_flagcx_engine *engine);

/* The largest `len` of one descriptor. Callers split larger copies. */
uint64_t te_flagcx_max_desc_len(te_flagcx_engine *engine);

/* The memory runtimes register accepts, comma-separated ("host,cuda"); static or
   engine-lifetime storage. */
const char *te_flagcx_memory_kinds(te_flagcx_engine *engine);

/* Registers [addr, addr+len) of memory kind `memory` ("host", "cuda:0", ...) for
   local use and for the remote rights in `access` (TE_FLAGCX_ACCESS_* flags, 0 for
   local use only); writes its handle to *mr_out. Peers must get no other access to
   the memory: an implementation that cannot restrict remote access to `access`
   refuses the registration (TE_FLAGCX_E_UNSUPPORTED, saying why) rather than expose
   the memory; an unknown flag is TE_FLAGCX_E_INVALID. */
int te_flagcx_register(te_flagcx_engine *engine, uint64_t addr, uint64_t len,
                       const char *memory, uint32_t access, uint64_t *mr_out);

/* Forgets a registration. It does not wait for transfers: the caller first waits
   until every transfer it posted on the memory has been reported finished by
   te_flagcx_query (FlagCX's flagcxP2pEngineMrDestroy deregisters at once; a transfer
   still using the memory then fails). */
int te_flagcx_deregister(te_flagcx_engine *engine, uint64_t mr);

/* Creates an attempt: what one connection attempt's te_flagcx_connect calls are
   given, so that they can be cancelled on their own (te_flagcx_attempt_cancel). An
   attempt belongs to its engine and is destroyed before it. */
int te_flagcx_attempt_create(te_flagcx_engine *engine, te_flagcx_attempt **out);

/* Cancels an attempt: every te_flagcx_connect given it, in progress or later, returns
   TE_FLAGCX_E_UNREACHABLE ("cancelled") at once. Idempotent; may be called from any
   thread while a te_flagcx_connect uses the attempt. Where the library under the shim
   cannot interrupt its connect, the connect still returns at once and what keeps
   running is the implementation's to release (see the implementation). */
void te_flagcx_attempt_cancel(te_flagcx_attempt *attempt);

/* Destroys an attempt, once no te_flagcx_connect and no te_flagcx_attempt_cancel uses
   it. */
void te_flagcx_attempt_destroy(te_flagcx_attempt *attempt);

/* Opens a new connection to the engine at `endpoint` and takes a snapshot of the
   peer's registered regions. Each call opens a new connection. Returns within about
   `timeout_ms` whatever the peer does: a peer that does not complete the handshake by
   then is TE_FLAGCX_E_UNREACHABLE ("timed out"). Returns TE_FLAGCX_E_UNREACHABLE at
   once after te_flagcx_cancel_connects, or once `attempt` (from
   te_flagcx_attempt_create on this engine; not NULL) was cancelled. */
int te_flagcx_connect(te_flagcx_engine *engine, const char *endpoint,
                      uint32_t timeout_ms, te_flagcx_attempt *attempt,
                      te_flagcx_conn **out);

/* Makes every te_flagcx_connect of this engine in progress, and every later one,
   return TE_FLAGCX_E_UNREACHABLE at once, so that the threads connecting can be
   joined before the engine is destroyed. Open connections are not touched. */
void te_flagcx_cancel_connects(te_flagcx_engine *engine);

/* Closes a connection. Transfers still pending on it are abandoned: their ids must not
   be queried any more. te reports a batch cancelled once this returned for its
   connection, so an implementation must stop its transfers touching local memory
   before returning where the library under it allows (the fake does: it joins the
   connection's worker; over FlagCX, flagcxP2pEngineConnDestroy decides). */
void te_flagcx_disconnect(te_flagcx_conn *conn);

/* Posts `count` descriptors of one operation as one transfer; writes its id to
   *xfer_out. Does not wait for the data. On failure nothing was posted. Allocates
   nothing per call where the library under it lets it (see the implementation). */
int te_flagcx_post(te_flagcx_conn *conn, int op, const te_flagcx_desc *descs,
                   uint32_t count, uint64_t *xfer_out);

/* The state of a transfer: TE_FLAGCX_PENDING, TE_FLAGCX_OK (every byte arrived), or
   a negative code with last_error set: TE_FLAGCX_E_TRANSFER when it finished with
   failed slices. TE_FLAGCX_OK is never returned for a transfer whose outcome the
   implementation cannot see. Once it returned anything but TE_FLAGCX_PENDING the id is
   released and must not be queried again (implementations may reuse it). */
int te_flagcx_query(te_flagcx_conn *conn, uint64_t xfer);

/* Progress events, for a completion thread that blocks instead of polling.
   te_flagcx_events returns a counter that grows whenever a transfer of this engine may
   have changed state, and on te_flagcx_wake. te_flagcx_wait blocks until the counter
   differs from `seen` or `timeout_us` passed; it may return sooner. An implementation
   over a library with no blocking wait returns at once, after yielding the CPU, so
   its caller polls while transfers are in flight (the real shim over FlagCX does). */
uint64_t te_flagcx_events(te_flagcx_engine *engine);
void te_flagcx_wait(te_flagcx_engine *engine, uint64_t seen, uint32_t timeout_us);
void te_flagcx_wake(te_flagcx_engine *engine);

#ifdef __cplusplus
}
#endif

#endif /* TE_FLAGCX_SHIM_H */
