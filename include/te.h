/*
 * te.h — the C API of te, a transfer engine for disaggregated LLM inference.
 *
 * Link with libte.so (`-lte`) or libte.a, both built by `cargo build --release` into
 * target/release. With the static library, link it whole
 * (`-Wl,--whole-archive -lte -Wl,--no-whole-archive`) plus `-lpthread -ldl -lm -lrt -lgcc_s`:
 * backends register themselves from constructors that the linker would otherwise
 * drop, and an engine would then find no backend.
 *
 * Conventions:
 * - Every function that can fail returns an `int`: TE_OK (0), TE_PENDING (1, not an
 *   error: not yet), or a negative te_status, minus the code of an error kind of te's
 *   one ErrorKind table. On a negative status, te_last_error() returns the message
 *   (what failed, why, and what to do) for the calling thread.
 * - Handles (te_engine, te_peer, te_batch, te_notification) are opaque. A function
 *   that creates one writes it to its `out` argument only on success; the caller owns
 *   it and gives it back with its _free function (NULL is accepted there).
 * - A NULL or invalid argument is reported as TE_ERR_INVALID_REQUEST naming the
 *   argument. Pointers to freed handles cannot be detected: do not pass them.
 * - Timeouts: `uint64_t timeout_ms` of a call that starts work is its deadline, 0 for
 *   the engine's `default_timeout`; `int64_t timeout_ms` of a wait is how long to
 *   block, 0 for not at all and negative for without limit. Waits block on condition
 *   variables; nothing spins.
 * - Every function is thread-safe; handles may be shared between threads, except that
 *   a handle must not be freed while another thread uses it.
 * - No Rust panic crosses into C: an internal panic is returned as TE_ERR_BACKEND
 *   with a message saying so.
 */
#ifndef TE_H
#define TE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* BEGIN GENERATED (cargo test -p te-capi checks it; TE_BLESS=1 rewrites it) */
/** The version of the C ABI this header describes; `te_abi_version()` returns
    the library's. */
#define TE_ABI_VERSION 1u

/** What a te call returns: `TE_OK`, `TE_PENDING` (not an error), or minus the code
    of an error kind in te's `ErrorKind` table. */
typedef enum te_status {
    /** Success. */
    TE_OK = 0,
    /** Not yet: a batch still in flight, nothing received in time. */
    TE_PENDING = 1,
    /** A configuration file or value is malformed, names an unknown key, or is inconsistent. */
    TE_ERR_CONFIG_INVALID = -1,
    /** A backend, plugin or device runtime is not available on this machine. */
    TE_ERR_UNAVAILABLE = -2,
    /** The backend or engine cannot do what was asked (a memory kind, an operation). */
    TE_ERR_UNSUPPORTED = -3,
    /** A request is malformed: zero length, unknown region, missing rights. */
    TE_ERR_INVALID_REQUEST = -4,
    /** A request reaches outside a registered region. */
    TE_ERR_OUT_OF_BOUNDS = -5,
    /** The memory or region was never registered, or has been deregistered. */
    TE_ERR_NOT_REGISTERED = -6,
    /** The peer could not be reached, or its connection broke. */
    TE_ERR_PEER_UNREACHABLE = -7,
    /** The peer restarted: its descriptors belong to a previous life. */
    TE_ERR_PEER_RESTARTED = -8,
    /** The deadline passed before the operation completed. */
    TE_ERR_TIMEOUT = -9,
    /** The operation was abandoned (the engine or backend shut down). */
    TE_ERR_CANCELLED = -10,
    /** A peer sent bytes that do not follow the protocol. */
    TE_ERR_PROTOCOL = -11,
    /** The backend or the vendor library under it failed. */
    TE_ERR_BACKEND = -12,
    /** An operating-system call failed. */
    TE_ERR_IO = -13,
    /** A bounded queue is full; retry later or read what is queued. */
    TE_ERR_BUSY = -14,
    /** The peer failed to prove a shared secret (auth_token). */
    TE_ERR_UNAUTHORIZED = -15,
} te_status;
/* END GENERATED */

/** An engine: one backend, one control plane, its registrations and peers. */
typedef struct te_engine te_engine;
/** A connected peer engine (its descriptor: regions and KV layouts). */
typedef struct te_peer te_peer;
/** A submitted batch of transfers. */
typedef struct te_batch te_batch;
/** A notification received from a peer. */
typedef struct te_notification te_notification;

/** Peers may READ a registered region. */
#define TE_ACCESS_REMOTE_READ 1u
/** Peers may WRITE a registered region. */
#define TE_ACCESS_REMOTE_WRITE 2u

/** te_request.op: READ the peer's bytes into local memory. */
#define TE_OP_READ 0u
/** te_request.op: WRITE local bytes into the peer's memory. */
#define TE_OP_WRITE 1u

/** One contiguous copy between a local region and a peer's region. */
typedef struct te_request {
    /** TE_OP_READ or TE_OP_WRITE. */
    uint32_t op;
    /** Must be 0. */
    uint32_t reserved;
    /** The local region (from te_engine_register). */
    uint64_t local;
    /** Byte offset into the local region. */
    uint64_t local_offset;
    /** The peer's region (from te_peer_region). */
    uint64_t remote;
    /** Byte offset into the peer's region. */
    uint64_t remote_offset;
    /** Bytes to copy; not 0. */
    uint64_t len;
} te_request;

/** te_peer_event.kind: the peer's session broke without a goodbye (it died). */
#define TE_PEER_LOST 1
/** te_peer_event.kind: the peer came back with a new epoch. */
#define TE_PEER_RESTARTED 2
/** te_peer_event.kind: the peer closed its session on purpose. */
#define TE_PEER_LEFT 3
/** te_peer_event.kind: the peer's data connection broke in the middle of a WRITE into
 *  this engine's memory; torn_region, torn_start and torn_end name the bytes that may
 *  now hold part old, part new data. */
#define TE_PEER_TORN_WRITE 4

/** What happened to a peer that had a session with this engine. */
typedef struct te_peer_event {
    /** TE_PEER_LOST, TE_PEER_RESTARTED, TE_PEER_LEFT or TE_PEER_TORN_WRITE. */
    int32_t kind;
    /** Always 0. */
    uint32_t reserved;
    /** The peer's epoch (the new one, for TE_PEER_RESTARTED). */
    uint64_t epoch;
    /** Its epoch before a restart; 0 otherwise. */
    uint64_t previous_epoch;
    /** The peer's engine name, NUL-terminated (cut at 255 bytes). */
    char name[256];
    /** The peer's control-plane address, NUL-terminated (cut at 255 bytes). */
    char address[256];
    /** For TE_PEER_TORN_WRITE: the region, and the first and one-past-the-last byte
     *  (from the region's start) that may be torn; 0 otherwise. */
    uint64_t torn_region;
    uint64_t torn_start;
    uint64_t torn_end;
} te_peer_event;

/* ---- version and errors ---------------------------------------------------------- */

/** The library's ABI version; compare it with TE_ABI_VERSION before anything else. */
uint32_t te_abi_version(void);

/** te's version ("0.1.0"); a static string. */
const char *te_version(void);

/**
 * The message of the last call on this thread that returned a negative status.
 * Never NULL (empty if none failed yet); valid until the next te call on this thread.
 * On a thread that is exiting (a C++ thread_local's destructor calling te), once the
 * thread's storage is gone, a static message saying the message was lost.
 */
const char *te_last_error(void);

/** The name of a status ("Ok", "Pending", "ConfigInvalid", …, or "Unknown"); static. */
const char *te_status_name(int status);

/* ---- engines ----------------------------------------------------------------------- */

/**
 * Creates an engine from TOML text (the format of plugins.toml; relative plugin
 * directories are taken from the current directory), or from the defaults (the stub
 * backend) if `config_toml` is NULL. An unknown backend is TE_ERR_CONFIG_INVALID with
 * a message listing the available ones; a backend that cannot run here is
 * TE_ERR_UNAVAILABLE with the reason.
 */
int te_engine_new(const char *config_toml, te_engine **out);

/** As te_engine_new, from a configuration file. */
int te_engine_from_file(const char *path, te_engine **out);

/**
 * Stops the engine's control plane and disconnects its peers; batches in flight fail
 * once released. Deregisters the regions still registered (their memory must stay
 * valid until this returns). Do not call it from a te callback. NULL is ignored.
 */
void te_engine_free(te_engine *engine);

/**
 * Writes the engine's control-plane address ("host:port", what peers pass to
 * te_engine_connect), NUL-terminated, into `buf` of `len` bytes. 64 bytes always
 * suffice; a smaller buffer that cannot hold it is TE_ERR_INVALID_REQUEST.
 */
int te_engine_address(const te_engine *engine, char *buf, size_t len);

/**
 * Writes what the engine has done — batches and their outcomes, bytes and requests per
 * direction and per peer, the latency histogram, registered memory, notifications —
 * as one JSON object (the keys of docs/metrics.md), NUL-terminated, into `buf` of
 * `len` bytes, and the bytes that takes (NUL included) into `*needed` unless NULL. A
 * buffer too small is TE_ERR_INVALID_REQUEST, with `*needed` set: call again with one
 * that large.
 */
int te_engine_metrics(const te_engine *engine, char *buf, size_t len, size_t *needed);

/* ---- memory ---------------------------------------------------------------------- */

/**
 * Registers caller-owned memory `addr .. addr + len` under `name` (may be NULL; peers
 * look regions up by it), writing its region id to `*region`. `memory` is "host"
 * (or NULL), a device ("cuda:0", "mlu:1"), or "auto": te asks its device runtimes
 * which device owns `addr`, host if none does. Device memory registered as "host", or
 * as another device than its owner, is refused (TE_ERR_INVALID_REQUEST, naming the
 * owner). `access` is 0 (local use only) or TE_ACCESS_REMOTE_READ |
 * TE_ACCESS_REMOTE_WRITE bits.
 *
 * The memory must stay valid until te_engine_deregister returns TE_OK for it (or
 * te_engine_free returns); te reads and writes it at any time until then. If
 * deregistration fails, never free the memory.
 */
int te_engine_register(te_engine *engine, const char *name, void *addr, size_t len,
                       const char *memory, uint32_t access, uint64_t *region);

/**
 * Deregisters a region: waits up to the engine's default_timeout for batches using
 * it, then cancels them. TE_OK means te touches the memory no more. A call for a
 * region another call is deregistering waits for that call and returns TE_OK once it
 * succeeded. A region whose deregistration failed keeps returning that error: never
 * free its memory. TE_ERR_NOT_REGISTERED only for a region te no longer touches.
 */
int te_engine_deregister(te_engine *engine, uint64_t region);

/* ---- peers ----------------------------------------------------------------------- */

/**
 * Connects to the engine whose control plane is at `address` ("host:port", or an
 * engine name with an etcd metadata store): the handshake and the backend's
 * connection within `timeout_ms` (0: the default). Cached: connecting again returns
 * the same peer until a failure or a restart. TE_ERR_PEER_UNREACHABLE if nothing
 * answers, TE_ERR_TIMEOUT at the deadline.
 */
int te_engine_connect(te_engine *engine, const char *address, uint64_t timeout_ms,
                      te_peer **out);

/** Frees a peer handle (the connection stays cached in the engine). NULL is ignored. */
void te_peer_free(te_peer *peer);

/**
 * Looks up the peer's remotely accessible region `name`: its id in `*region` and its
 * length in `*len` (`len` may be NULL). TE_ERR_NOT_REGISTERED if it has none.
 */
int te_peer_region(const te_peer *peer, const char *name, uint64_t *region,
                   uint64_t *len);

/* ---- batches --------------------------------------------------------------------- */

/**
 * Submits `count` requests to `peer` as one batch with one deadline (`timeout_ms`,
 * 0: the default). If `notify` is not NULL, its `notify_len` bytes are delivered to the
 * peer after the batch's data is visible there (`count` may be 0 to send only the
 * message). Every request is checked first; nothing moves unless all pass
 * (TE_ERR_OUT_OF_BOUNDS, TE_ERR_NOT_REGISTERED, TE_ERR_INVALID_REQUEST, …).
 */
int te_engine_transfer(te_engine *engine, const te_peer *peer, const te_request *requests,
                       size_t count, uint64_t timeout_ms, const void *notify,
                       size_t notify_len, te_batch **out);

/**
 * Blocks until the batch resolves or `timeout_ms` passes (negative: no limit).
 * TE_OK: every byte moved. TE_PENDING: still in flight. Negative: the batch failed
 * (TE_ERR_TIMEOUT at its deadline, TE_ERR_CANCELLED, TE_ERR_PEER_UNREACHABLE, …);
 * once a batch resolved, none of its memory is touched any more. A batch is reported
 * resolved (here, by te_batch_status and by its event fds) only once every callback
 * registered with te_batch_on_complete before then has returned; a callback asking
 * about its own batch sees it resolved.
 */
int te_batch_wait(const te_batch *batch, int64_t timeout_ms);

/** As te_batch_wait without blocking. */
int te_batch_status(const te_batch *batch);

/**
 * Asks to stop the batch and returns at once; the batch then resolves with
 * TE_ERR_CANCELLED once the backend released it. No effect on a resolved batch.
 */
int te_batch_cancel(const te_batch *batch);

/**
 * Calls `callback(user, status)` exactly once when the batch resolves: on one of te's
 * threads, or on this one before returning if it already has (with the tcp backend's
 * `caller_reads = true`, also on an application thread blocked in te_batch_wait).
 * `status` is what te_batch_wait would return, and te_last_error() inside the callback
 * has the message. The callback must not block long, throw a C++ exception (the
 * process aborts) nor free the engine; `user` must be usable from any thread. Freeing
 * the batch handle does not stop the callback. A callback registered after the batch
 * was reported resolved runs on this thread before this returns. Callbacks of batches
 * that te_engine_free fails run while it runs: they must not use that engine.
 */
int te_batch_on_complete(const te_batch *batch, void (*callback)(void *user, int status),
                         void *user);

/**
 * Creates an eventfd (non-blocking, close-on-exec) in `*fd` that becomes readable when
 * the batch resolves, for poll/epoll loops; then read the result with
 * te_batch_status. The caller closes it, but only after it became readable.
 * TE_ERR_IO if no eventfd can be made.
 */
int te_batch_eventfd(const te_batch *batch, int *fd);

/** Frees the handle; the batch goes on (cancel it first to stop it). NULL is ignored. */
void te_batch_free(te_batch *batch);

/* ---- notifications and peer events ------------------------------------------------- */

/**
 * The next notification a peer sent (in `*out`), waiting at most `timeout_ms`
 * (negative: no limit). TE_PENDING if none arrived in time.
 */
int te_engine_recv_notification(te_engine *engine, int64_t timeout_ms,
                                te_notification **out);

/**
 * The notification's bytes and their number in `*len`; valid until it is freed. NULL
 * (the message in te_last_error) for a NULL argument.
 */
const uint8_t *te_notification_data(const te_notification *notification, size_t *len);

/**
 * The sending engine's name; its control-plane address (to te_engine_connect back) in
 * `*address` unless NULL. Valid until the notification is freed. NULL (the message in
 * te_last_error) for a NULL notification.
 */
const char *te_notification_sender(const te_notification *notification,
                                   const char **address);

/** Frees a notification. NULL is ignored. */
void te_notification_free(te_notification *notification);

/**
 * The next peer event (a peer with a session to this engine lost, restarted or gone)
 * in `*out`, waiting at most `timeout_ms` (negative: no limit). TE_PENDING if none.
 */
int te_engine_recv_event(te_engine *engine, int64_t timeout_ms, te_peer_event *out);

/* ---- KV-cache layouts -------------------------------------------------------------- */

/**
 * Registers a KV-cache layout and publishes it to peers. `layout_json` is
 * {"name": "kv", "groups": [{"name": "layer0", "slots": [{"name": "key", "region": ID,
 * "offset": 0, "bytes_per_block": 4096, "blocks": 64}, …]}, …]}, each slot inside a
 * region registered on this engine. TE_ERR_INVALID_REQUEST for JSON that is not such a
 * layout, or a slot outside its region.
 */
int te_engine_register_layout(te_engine *engine, const char *layout_json);

/**
 * Withdraws a layout (waiting for transfers on its slots). TE_ERR_NOT_REGISTERED for
 * an unknown layout.
 */
int te_engine_deregister_layout(te_engine *engine, const char *name);

/**
 * WRITEs blocks `local_ids[i]` of the local layout `layout` into blocks
 * `remote_ids[i]` of the peer's layout of the same name, merging runs of consecutive
 * ids; deadline and notification as te_engine_transfer. TE_ERR_NOT_REGISTERED for a
 * layout unknown here.
 */
int te_engine_push_blocks(te_engine *engine, const te_peer *peer, const char *layout,
                          const uint64_t *remote_ids, const uint64_t *local_ids,
                          size_t count, uint64_t timeout_ms, const void *notify,
                          size_t notify_len, te_batch **out);

/** READs blocks `remote_ids[i]` of the peer's layout into blocks `local_ids[i]`. */
int te_engine_pull_blocks(te_engine *engine, const te_peer *peer, const char *layout,
                          const uint64_t *remote_ids, const uint64_t *local_ids,
                          size_t count, uint64_t timeout_ms, const void *notify,
                          size_t notify_len, te_batch **out);

#ifdef __cplusplus
}
#endif

#endif /* TE_H */
