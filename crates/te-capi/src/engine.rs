//! Engines, registrations, peers, and submitting batches.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use te_core::sync::{Condvar, Mutex};

use te_facade::{
    Access, BlockOptions, Config, Engine, Error, ErrorKind, KvLayout, MemoryDesc, MemoryKind, Op,
    Peer, RegionId, Registration, Result, TransferOptions, TransferRequest,
};

use crate::args::{call_timeout, free_box, obj, slice, text, Out};
use crate::batch::TeBatch;
use crate::error::{bad_argument, guard, TE_OK};

/// Peers may READ the region (`TE_ACCESS_REMOTE_READ`).
const ACCESS_REMOTE_READ: u32 = 1;
/// Peers may WRITE the region (`TE_ACCESS_REMOTE_WRITE`).
const ACCESS_REMOTE_WRITE: u32 = 2;
/// `te_request.op` of a READ (`TE_OP_READ`).
const OP_READ: u32 = 0;
/// `te_request.op` of a WRITE (`TE_OP_WRITE`).
const OP_WRITE: u32 = 1;

/// `te_engine`: an engine and the registrations C made on it (C holds region ids,
/// not `Registration` values).
pub struct TeEngine {
    // Declared first so that it drops first: the registrations are deregistered while
    // the engine still runs.
    regions: Mutex<HashMap<u64, Slot>>,
    /// Signalled when a deregistration ends.
    released: Condvar,
    pub(crate) engine: Engine,
}

/// A region registered through C, by where its deregistration stands. A region is
/// answered `NotRegistered` only once te is done with its memory: a caller may take
/// that answer as leave to free it.
enum Slot {
    Registered(Registration),
    /// A call is deregistering it (another waits for that call's end).
    Releasing,
    /// Its deregistration failed: te may still touch the memory, which must never be
    /// freed; asked again, te says so again.
    Failed(Error),
}

impl std::fmt::Debug for TeEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TeEngine")
            .field("engine", &self.engine)
            .finish()
    }
}

/// `te_peer`: a connected peer.
#[derive(Debug)]
pub struct TePeer(Peer);

/// `te_request`: one copy of a batch, as C lays it out.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct TeRequest {
    /// `TE_OP_READ` or `TE_OP_WRITE`.
    pub op: u32,
    /// Must be 0.
    pub reserved: u32,
    /// The local region's id.
    pub local: u64,
    /// Byte offset into the local region.
    pub local_offset: u64,
    /// The peer's region's id.
    pub remote: u64,
    /// Byte offset into the peer's region.
    pub remote_offset: u64,
    /// Bytes to copy.
    pub len: u64,
}

fn finish_new(config: &Config, out: Out<*mut TeEngine>) -> Result<c_int> {
    let engine = Engine::from_config(config)?;
    let boxed = Box::new(TeEngine {
        regions: Mutex::new(HashMap::new()),
        released: Condvar::new(),
        engine,
    });
    out.set(Box::into_raw(boxed));
    Ok(TE_OK)
}

/// `int te_engine_new(const char *config_toml, te_engine **out)`.
///
/// # Safety
/// As documented in te.h: `config_toml` NULL or a NUL-terminated string, `out` valid
/// for a write.
#[no_mangle]
pub unsafe extern "C" fn te_engine_new(
    config_toml: *const c_char,
    out: *mut *mut TeEngine,
) -> c_int {
    const OP: &str = "te_engine_new";
    guard(OP, || {
        // SAFETY: te.h asks for a pointer valid for a write.
        let out = unsafe { Out::new(out, OP, "out") }?;
        let config = if config_toml.is_null() {
            Config::defaults()
        } else {
            // SAFETY: te.h asks for a NUL-terminated string.
            let toml = unsafe { text(config_toml, OP, "config_toml") }?;
            Config::from_toml(toml, "te_engine_new", Path::new("."))?
        };
        finish_new(&config, out)
    })
}

/// `int te_engine_from_file(const char *path, te_engine **out)`.
///
/// # Safety
/// As documented in te.h: `path` a NUL-terminated string, `out` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn te_engine_from_file(
    path: *const c_char,
    out: *mut *mut TeEngine,
) -> c_int {
    const OP: &str = "te_engine_from_file";
    guard(OP, || {
        // SAFETY: te.h asks for a pointer valid for a write.
        let out = unsafe { Out::new(out, OP, "out") }?;
        // SAFETY: te.h asks for a NUL-terminated string.
        let path = unsafe { text(path, OP, "path") }?;
        finish_new(&Config::load(Path::new(path))?, out)
    })
}

/// `void te_engine_free(te_engine *)`.
///
/// # Safety
/// `engine` is NULL or an engine from `te_engine_new` not freed yet, used by no other
/// thread during or after the call.
#[no_mangle]
pub unsafe extern "C" fn te_engine_free(engine: *mut TeEngine) {
    // SAFETY: NULL or the box `te_engine_new` leaked, by the contract above.
    unsafe { free_box(engine, "te_engine_free") }
}

/// `int te_engine_address(const te_engine *, char *buf, size_t len)`.
///
/// # Safety
/// `engine` a live engine; `buf` valid for `len` bytes of writes.
#[no_mangle]
pub unsafe extern "C" fn te_engine_address(
    engine: *const TeEngine,
    buf: *mut c_char,
    len: usize,
) -> c_int {
    const OP: &str = "te_engine_address";
    guard(OP, || {
        // SAFETY: te.h asks for a live engine.
        let engine = unsafe { obj(engine, OP, "engine") }?;
        let address = engine.engine.address().to_string();
        // SAFETY: te.h asks for `buf` valid for `len` bytes of writes.
        unsafe { write_c_string(OP, "the address", &address, buf, len) }
    })
}

/// `int te_engine_metrics(const te_engine *, char *buf, size_t len, size_t *needed)`.
///
/// # Safety
/// `engine` a live engine; `buf` valid for `len` bytes of writes; `needed` NULL or
/// valid for one write.
#[no_mangle]
pub unsafe extern "C" fn te_engine_metrics(
    engine: *const TeEngine,
    buf: *mut c_char,
    len: usize,
    needed: *mut usize,
) -> c_int {
    const OP: &str = "te_engine_metrics";
    guard(OP, || {
        // SAFETY: te.h asks for a live engine.
        let engine = unsafe { obj(engine, OP, "engine") }?;
        // SAFETY: te.h asks for `needed` NULL or valid for one write.
        let needed = unsafe { Out::optional(needed, OP, "needed") }?;
        let json = serde_json::to_string(&engine.engine.metrics())
            .map_err(|e| bad_argument(OP, format!("the metrics do not encode: {e}")))?;
        if let Some(needed) = needed {
            needed.set(json.len() + 1);
        }
        // SAFETY: te.h asks for `buf` valid for `len` bytes of writes.
        unsafe { write_c_string(OP, "the metrics", &json, buf, len) }
    })
}

/// Copies `s` and a NUL into `buf`, or refuses a buffer too small for them.
///
/// # Safety
/// `buf` is NULL or valid for `len` bytes of writes.
unsafe fn write_c_string(
    op: &'static str,
    what: &str,
    s: &str,
    buf: *mut c_char,
    len: usize,
) -> Result<c_int> {
    if buf.is_null() {
        return Err(bad_argument(op, "`buf` is NULL"));
    }
    if len < s.len() + 1 {
        return Err(bad_argument(
            op,
            format!("`buf` holds {len} bytes; {what} needs {}", s.len() + 1),
        ));
    }
    // SAFETY: `buf` is valid for `len` bytes (the caller's promise), and `len` exceeds
    // the string's length, so the copy and its NUL fit; a Rust string cannot overlap
    // C's buffer.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), s.len());
        buf.add(s.len()).write(0);
    }
    Ok(TE_OK)
}

fn access_of(bits: u32, operation: &'static str) -> Result<Access> {
    if bits & !(ACCESS_REMOTE_READ | ACCESS_REMOTE_WRITE) != 0 {
        return Err(bad_argument(
            operation,
            format!("unknown access bits {bits:#x}"),
        ));
    }
    Ok(Access {
        remote_read: bits & ACCESS_REMOTE_READ != 0,
        remote_write: bits & ACCESS_REMOTE_WRITE != 0,
    })
}

/// `int te_engine_register(te_engine *, const char *name, void *addr, size_t len,
/// const char *memory, uint32_t access, uint64_t *region)`.
///
/// # Safety
/// As `Engine::register`: the memory stays valid, and may be read and written by te,
/// until `te_engine_deregister` returns `TE_OK` for it (or the engine is freed); the
/// strings NUL-terminated; `region` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn te_engine_register(
    engine: *mut TeEngine,
    name: *const c_char,
    addr: *mut c_void,
    len: usize,
    memory: *const c_char,
    access: u32,
    region: *mut u64,
) -> c_int {
    const OP: &str = "te_engine_register";
    guard(OP, || {
        // SAFETY: te.h asks for a live engine, strings and an out-parameter.
        let (engine, name, region) = unsafe {
            (
                obj(engine, OP, "engine")?,
                if name.is_null() {
                    ""
                } else {
                    text(name, OP, "name")?
                },
                Out::new(region, OP, "region")?,
            )
        };
        let kind: MemoryKind = if memory.is_null() {
            MemoryKind::Host
        } else {
            // SAFETY: te.h asks for a NUL-terminated string.
            unsafe { text(memory, OP, "memory") }?.parse()?
        };
        let desc = MemoryDesc {
            name: name.to_string(),
            addr: addr as u64,
            len: len as u64,
            kind,
            access: access_of(access, OP)?,
        };
        // SAFETY: the caller keeps the memory valid and accepts te's accesses until the
        // registration is deregistered (te.h states it, as Engine::register asks).
        let registration = unsafe { engine.engine.register(desc) }?;
        let id = registration.id().0;
        engine
            .regions
            .lock()
            .insert(id, Slot::Registered(registration));
        region.set(id);
        Ok(TE_OK)
    })
}

/// `int te_engine_deregister(te_engine *, uint64_t region)`.
///
/// # Safety
/// `engine` a live engine.
#[no_mangle]
pub unsafe extern "C" fn te_engine_deregister(engine: *mut TeEngine, region: u64) -> c_int {
    const OP: &str = "te_engine_deregister";
    guard(OP, || {
        // SAFETY: te.h asks for a live engine.
        let engine = unsafe { obj(engine, OP, "engine") }?;
        let registration = {
            let mut regions = engine.regions.lock();
            let mut waited = false;
            loop {
                match regions.get(&region) {
                    Some(Slot::Registered(_)) => {
                        if let Some(Slot::Registered(r)) = regions.insert(region, Slot::Releasing) {
                            break r;
                        }
                    }
                    Some(Slot::Releasing) => {
                        regions = engine.released.wait(regions);
                        waited = true;
                    }
                    Some(Slot::Failed(e)) => {
                        return Err(Error::new(
                            e.kind(),
                            format!("region {region}'s deregistration failed before ({e}); te may still touch its memory: never free it"),
                        ));
                    }
                    // Deregistered by the call this one waited for.
                    None if waited => return Ok(TE_OK),
                    None => {
                        return Err(Error::new(
                            ErrorKind::NotRegistered,
                            format!("region {region} was not registered through this engine, or is deregistered"),
                        ))
                    }
                }
            }
        };
        // A panic leaves the memory's fate unknown: it counts as a failure.
        let result =
            catch_unwind(AssertUnwindSafe(|| registration.deregister())).unwrap_or_else(|_| {
                Err(Error::new(
                    ErrorKind::Backend,
                    "deregistering panicked; te may still touch the memory: never free it",
                ))
            });
        let mut regions = engine.regions.lock();
        match &result {
            Ok(()) => regions.remove(&region),
            Err(e) => regions.insert(region, Slot::Failed(e.clone())),
        };
        engine.released.notify_all();
        result.map(|()| TE_OK)
    })
}

/// `int te_engine_connect(te_engine *, const char *address, uint64_t timeout_ms,
/// te_peer **out)`.
///
/// # Safety
/// `engine` a live engine, `address` NUL-terminated, `out` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn te_engine_connect(
    engine: *mut TeEngine,
    address: *const c_char,
    timeout_ms: u64,
    out: *mut *mut TePeer,
) -> c_int {
    const OP: &str = "te_engine_connect";
    guard(OP, || {
        // SAFETY: te.h asks for a live engine, a string and an out-parameter.
        let (engine, address, out) = unsafe {
            (
                obj(engine, OP, "engine")?,
                text(address, OP, "address")?,
                Out::new(out, OP, "out")?,
            )
        };
        let peer = match call_timeout(timeout_ms) {
            Some(t) => engine.engine.connect_with(address, t)?,
            None => engine.engine.connect(address)?,
        };
        out.set(Box::into_raw(Box::new(TePeer(peer))));
        Ok(TE_OK)
    })
}

/// `void te_peer_free(te_peer *)`.
///
/// # Safety
/// `peer` NULL or a peer from `te_engine_connect` not freed yet.
#[no_mangle]
pub unsafe extern "C" fn te_peer_free(peer: *mut TePeer) {
    // SAFETY: NULL or the box `te_engine_connect` leaked, by the contract above.
    unsafe { free_box(peer, "te_peer_free") }
}

/// `int te_peer_region(const te_peer *, const char *name, uint64_t *region,
/// uint64_t *len)`.
///
/// # Safety
/// `peer` live, `name` NUL-terminated, `region` valid for a write, `len` NULL or valid
/// for a write.
#[no_mangle]
pub unsafe extern "C" fn te_peer_region(
    peer: *const TePeer,
    name: *const c_char,
    region: *mut u64,
    len: *mut u64,
) -> c_int {
    const OP: &str = "te_peer_region";
    guard(OP, || {
        // SAFETY: te.h asks for a live peer, a string and out-parameters (`len` may
        // be NULL).
        let (peer, name, region, len) = unsafe {
            (
                obj(peer, OP, "peer")?,
                text(name, OP, "name")?,
                Out::new(region, OP, "region")?,
                Out::optional(len, OP, "len")?,
            )
        };
        let desc = peer.0.region(name).ok_or_else(|| {
            Error::new(
                ErrorKind::NotRegistered,
                format!(
                    "the peer at {} has no remotely accessible region named `{name}`",
                    peer.0.addr()
                ),
            )
        })?;
        region.set(desc.id.0);
        if let Some(len) = len {
            len.set(desc.len);
        }
        Ok(TE_OK)
    })
}

/// The notification argument pair: none when `notify` is NULL.
///
/// # Safety
/// `notify` NULL or valid for `len` bytes.
unsafe fn notification(
    notify: *const c_void,
    len: usize,
    operation: &'static str,
) -> Result<Option<Vec<u8>>> {
    if notify.is_null() && len == 0 {
        return Ok(None);
    }
    // SAFETY: by the contract above.
    Ok(Some(
        unsafe { slice(notify.cast::<u8>(), len, operation, "notify") }?.to_vec(),
    ))
}

fn request(r: &TeRequest, operation: &'static str) -> Result<TransferRequest> {
    let op = match r.op {
        OP_READ => Op::Read,
        OP_WRITE => Op::Write,
        other => {
            return Err(bad_argument(
                operation,
                format!("unknown op {other}; use TE_OP_READ or TE_OP_WRITE"),
            ))
        }
    };
    if r.reserved != 0 {
        return Err(bad_argument(operation, "te_request.reserved must be 0"));
    }
    Ok(TransferRequest {
        op,
        local: RegionId(r.local),
        local_offset: r.local_offset,
        remote: RegionId(r.remote),
        remote_offset: r.remote_offset,
        len: r.len,
    })
}

/// `int te_engine_transfer(te_engine *, const te_peer *, const te_request *requests,
/// size_t count, uint64_t timeout_ms, const void *notify, size_t notify_len,
/// te_batch **out)`.
///
/// # Safety
/// `engine` and `peer` live; `requests` valid for `count` elements; `notify` NULL or
/// valid for `notify_len` bytes; `out` valid for a write.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn te_engine_transfer(
    engine: *mut TeEngine,
    peer: *const TePeer,
    requests: *const TeRequest,
    count: usize,
    timeout_ms: u64,
    notify: *const c_void,
    notify_len: usize,
    out: *mut *mut TeBatch,
) -> c_int {
    const OP: &str = "te_engine_transfer";
    guard(OP, || {
        // SAFETY: te.h states each pointer's contract, as above.
        let (engine, peer, requests, notify, out) = unsafe {
            (
                obj(engine, OP, "engine")?,
                obj(peer, OP, "peer")?,
                slice(requests, count, OP, "requests")?,
                notification(notify, notify_len, OP)?,
                Out::new(out, OP, "out")?,
            )
        };
        let requests = requests
            .iter()
            .map(|r| request(r, OP))
            .collect::<Result<Vec<_>>>()?;
        let options = TransferOptions {
            timeout: call_timeout(timeout_ms),
            notify,
        };
        let handle = engine.engine.transfer_with(&peer.0, &requests, &options)?;
        out.set(TeBatch::boxed(handle));
        Ok(TE_OK)
    })
}

/// `int te_engine_register_layout(te_engine *, const char *layout_json)`.
///
/// # Safety
/// `engine` live, `layout_json` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn te_engine_register_layout(
    engine: *mut TeEngine,
    layout_json: *const c_char,
) -> c_int {
    const OP: &str = "te_engine_register_layout";
    guard(OP, || {
        // SAFETY: te.h asks for a live engine and a string.
        let (engine, json) = unsafe {
            (
                obj(engine, OP, "engine")?,
                text(layout_json, OP, "layout_json")?,
            )
        };
        let layout: KvLayout = serde_json::from_str(json)
            .map_err(|e| bad_argument(OP, format!("`layout_json` is not a KV layout: {e}")))?;
        engine.engine.register_layout(layout)?;
        Ok(TE_OK)
    })
}

/// `int te_engine_deregister_layout(te_engine *, const char *name)`.
///
/// # Safety
/// `engine` live, `name` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn te_engine_deregister_layout(
    engine: *mut TeEngine,
    name: *const c_char,
) -> c_int {
    const OP: &str = "te_engine_deregister_layout";
    guard(OP, || {
        // SAFETY: te.h asks for a live engine and a string.
        let (engine, name) = unsafe { (obj(engine, OP, "engine")?, text(name, OP, "name")?) };
        engine.engine.deregister_layout(name)?;
        Ok(TE_OK)
    })
}

/// The shared body of `te_engine_push_blocks` and `te_engine_pull_blocks`.
///
/// # Safety
/// As either function.
#[allow(clippy::too_many_arguments)]
unsafe fn blocks(
    op: Op,
    engine: *mut TeEngine,
    peer: *const TePeer,
    layout: *const c_char,
    remote_ids: *const u64,
    local_ids: *const u64,
    count: usize,
    timeout_ms: u64,
    notify: *const c_void,
    notify_len: usize,
    out: *mut *mut TeBatch,
) -> c_int {
    let operation = match op {
        Op::Read => "te_engine_pull_blocks",
        Op::Write => "te_engine_push_blocks",
    };
    guard(operation, || {
        // SAFETY: te.h states each pointer's contract.
        let (engine, peer, layout, remote_ids, local_ids, notify, out) = unsafe {
            (
                obj(engine, operation, "engine")?,
                obj(peer, operation, "peer")?,
                text(layout, operation, "layout")?,
                slice(remote_ids, count, operation, "remote_ids")?,
                slice(local_ids, count, operation, "local_ids")?,
                notification(notify, notify_len, operation)?,
                Out::new(out, operation, "out")?,
            )
        };
        let options = BlockOptions {
            transfer: TransferOptions {
                timeout: call_timeout(timeout_ms),
                notify,
            },
            ..BlockOptions::default()
        };
        let handle = match op {
            Op::Read => engine
                .engine
                .pull_blocks(&peer.0, layout, remote_ids, local_ids, &options)?,
            Op::Write => engine
                .engine
                .push_blocks(&peer.0, layout, remote_ids, local_ids, &options)?,
        };
        out.set(TeBatch::boxed(handle));
        Ok(TE_OK)
    })
}

/// `int te_engine_push_blocks(te_engine *, const te_peer *, const char *layout,
/// const uint64_t *remote_ids, const uint64_t *local_ids, size_t count,
/// uint64_t timeout_ms, const void *notify, size_t notify_len, te_batch **out)`.
///
/// # Safety
/// `engine`, `peer` live; `layout` NUL-terminated; the id arrays valid for `count`
/// elements; `notify` NULL or valid for `notify_len` bytes; `out` valid for a write.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn te_engine_push_blocks(
    engine: *mut TeEngine,
    peer: *const TePeer,
    layout: *const c_char,
    remote_ids: *const u64,
    local_ids: *const u64,
    count: usize,
    timeout_ms: u64,
    notify: *const c_void,
    notify_len: usize,
    out: *mut *mut TeBatch,
) -> c_int {
    // SAFETY: the same contract, passed on.
    unsafe {
        blocks(
            Op::Write,
            engine,
            peer,
            layout,
            remote_ids,
            local_ids,
            count,
            timeout_ms,
            notify,
            notify_len,
            out,
        )
    }
}

/// `int te_engine_pull_blocks(…)`, the same arguments as `te_engine_push_blocks`.
///
/// # Safety
/// As `te_engine_push_blocks`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn te_engine_pull_blocks(
    engine: *mut TeEngine,
    peer: *const TePeer,
    layout: *const c_char,
    remote_ids: *const u64,
    local_ids: *const u64,
    count: usize,
    timeout_ms: u64,
    notify: *const c_void,
    notify_len: usize,
    out: *mut *mut TeBatch,
) -> c_int {
    // SAFETY: the same contract, passed on.
    unsafe {
        blocks(
            Op::Read,
            engine,
            peer,
            layout,
            remote_ids,
            local_ids,
            count,
            timeout_ms,
            notify,
            notify_len,
            out,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{te_batch_free, te_batch_wait};
    use crate::error::status_of;
    use crate::testing::{last, Pair};
    use std::time::{Duration, Instant};

    #[test]
    fn a_region_is_never_reported_free_while_a_batch_still_uses_it() {
        // The batch holds `b`'s region for at least a second; two calls deregister it.
        // An answer that lets the caller free the memory (TE_OK, or NOT_REGISTERED)
        // must not come before then.
        let start = Instant::now();
        let pair = Pair::stub("1s");
        let batch = pair.submit();
        let (engine, region) = (pair.b as usize, pair.write.local);
        let deregister = move || {
            // SAFETY: the engine outlives both calls (joined below, freed after).
            let rc = unsafe { te_engine_deregister(engine as *mut TeEngine, region) };
            (rc, start.elapsed(), last())
        };
        let first = std::thread::spawn(deregister);
        std::thread::sleep(Duration::from_millis(100));
        let second = deregister();
        let first = first.join().unwrap();
        for (rc, after, message) in [first, second] {
            if rc == TE_OK || rc == status_of(ErrorKind::NotRegistered) {
                assert!(
                    after >= Duration::from_secs(1),
                    "status {rc} after {after:?}, before the batch let go: {message}"
                );
            }
            // One call deregistered the region, the other waited for it.
            assert_eq!(rc, TE_OK, "{message}");
        }
        let (rc, _, message) = deregister();
        assert_eq!(rc, status_of(ErrorKind::NotRegistered), "{message}");
        // SAFETY: a live batch, freed once.
        unsafe {
            assert_eq!(te_batch_wait(batch, 10_000), TE_OK, "{}", last());
            te_batch_free(batch);
        }
    }

    #[test]
    fn a_region_whose_deregistration_failed_is_never_reported_free() {
        let pair = Pair::stub("0s");
        // SAFETY: a live engine of the pair.
        let engine = unsafe { &*pair.b };
        // What a failed deregistration leaves (no backend here fails one on purpose).
        let failed = Error::new(ErrorKind::Backend, "the NIC did not let go");
        engine.regions.lock().insert(7, Slot::Failed(failed));
        for _ in 0..2 {
            // SAFETY: as above.
            let rc = unsafe { te_engine_deregister(pair.b, 7) };
            let message = last();
            assert_eq!(rc, status_of(ErrorKind::Backend), "{message}");
            assert!(
                message.contains("did not let go") && message.contains("never free"),
                "{message}"
            );
        }
    }
    #[test]
    fn a_misaligned_out_parameter_is_refused_before_any_is_written() {
        let pair = Pair::stub("0s");
        let mut words = [u64::MAX; 3];
        let region: *mut u64 = &mut words[0];
        // SAFETY: one byte into `words`: valid for a write, but not aligned for a u64.
        let misaligned = unsafe { words.as_mut_ptr().cast::<u8>().add(9) }.cast::<u64>();
        // SAFETY: a live peer, a string, and pointers into `words`.
        let rc = unsafe { te_peer_region(pair.peer, c"dst".as_ptr(), region, misaligned) };
        assert_eq!(rc, status_of(ErrorKind::InvalidRequest), "{}", last());
        assert!(last().contains("`len` is misaligned"), "{}", last());
        assert_eq!(
            words[0],
            u64::MAX,
            "`region` was written by a call that failed"
        );

        let mut buf = [0 as c_char; 8];
        let mut needed = [usize::MAX; 2];
        // SAFETY: as above, for a usize.
        let misaligned = unsafe { needed.as_mut_ptr().cast::<u8>().add(1) }.cast::<usize>();
        // SAFETY: a live engine, a buffer of 8 bytes, a misaligned out-parameter.
        let rc = unsafe { te_engine_metrics(pair.a, buf.as_mut_ptr(), buf.len(), misaligned) };
        assert_eq!(rc, status_of(ErrorKind::InvalidRequest), "{}", last());
        assert!(last().contains("`needed` is misaligned"), "{}", last());
        assert_eq!(needed, [usize::MAX; 2], "a misaligned `needed` was written");
    }
}
