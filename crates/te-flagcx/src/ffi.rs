//! The shim's C ABI (`shim/te_flagcx_shim.h`), loaded at run time with `libloading`.
//!
//! Every symbol is resolved once, when the library is first loaded, into a [`Shim`]
//! table of plain function pointers. Libraries are loaded once per path and never
//! unloaded, so the pointers stay valid for the life of the process.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use te_core::sync::{Mutex, RwLock};

use te_core::{Error, ErrorKind};

/// The ABI version this crate speaks (`TE_FLAGCX_SHIM_ABI`).
pub(crate) const ABI: u32 = 5;

pub(crate) const OK: c_int = 0;
pub(crate) const PENDING: c_int = 1;
pub(crate) const E_INVALID: c_int = -1;
pub(crate) const E_UNREACHABLE: c_int = -2;
pub(crate) const E_NOT_REGISTERED: c_int = -3;
pub(crate) const E_STALE: c_int = -4;
pub(crate) const E_UNSUPPORTED: c_int = -5;
pub(crate) const E_TRANSFER: c_int = -6;
pub(crate) const E_ACCESS: c_int = -8;

/// `TE_FLAGCX_ACCESS_REMOTE_READ`: peers may READ from the registration.
pub(crate) const ACCESS_REMOTE_READ: u32 = 1;
/// `TE_FLAGCX_ACCESS_REMOTE_WRITE`: peers may WRITE into the registration.
pub(crate) const ACCESS_REMOTE_WRITE: u32 = 2;

pub(crate) const OP_READ: c_int = 0;
pub(crate) const OP_WRITE: c_int = 1;

/// `te_flagcx_engine`, opaque.
#[repr(C)]
pub(crate) struct RawEngine {
    _private: [u8; 0],
}

/// `te_flagcx_conn`, opaque.
#[repr(C)]
pub(crate) struct RawConn {
    _private: [u8; 0],
}

/// `te_flagcx_attempt`, opaque.
#[repr(C)]
pub(crate) struct RawAttempt {
    _private: [u8; 0],
}

/// `te_flagcx_desc`: one contiguous copy.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Desc {
    pub(crate) local_mr: u64,
    pub(crate) local_addr: u64,
    pub(crate) remote_addr: u64,
    pub(crate) len: u64,
}

/// Why a shim could not be loaded or a call failed (converted into `te_core::Error`).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ShimError {
    #[error("cannot load the FlagCX shim {path}: {source}")]
    Load {
        path: PathBuf,
        source: libloading::Error,
    },
    #[error("the FlagCX shim {path} lacks symbol `{symbol}` (not a te FlagCX shim, or built from another te_flagcx_shim.h)")]
    Symbol {
        path: PathBuf,
        symbol: &'static str,
        source: libloading::Error,
    },
    #[error("the FlagCX shim {path} speaks ABI {found}; this te speaks {ABI}; rebuild the shim from this te's shim/te_flagcx_shim.h")]
    Abi { path: PathBuf, found: u32 },
    #[error("{call}: {message}")]
    Call {
        call: &'static str,
        code: c_int,
        message: String,
    },
}

impl ShimError {
    /// The `te_core` kind of a shim status code.
    pub(crate) fn kind_of(code: c_int) -> ErrorKind {
        match code {
            E_INVALID | E_ACCESS => ErrorKind::InvalidRequest,
            E_UNREACHABLE => ErrorKind::PeerUnreachable,
            E_NOT_REGISTERED | E_STALE => ErrorKind::NotRegistered,
            E_UNSUPPORTED => ErrorKind::Unsupported,
            _ => ErrorKind::Backend,
        }
    }

    /// The status code of a failed call, if it was one.
    pub(crate) fn code(&self) -> Option<c_int> {
        match self {
            ShimError::Call { code, .. } => Some(*code),
            _ => None,
        }
    }
}

impl From<ShimError> for Error {
    fn from(e: ShimError) -> Error {
        match &e {
            ShimError::Call { code, message, .. } => {
                let what = match *code {
                    E_STALE => format!("{message} (stale registration: the connection will be renewed; retry the batch)"),
                    E_TRANSFER => format!("the transfer failed: {message}"),
                    E_ACCESS => format!("the target refused the transfer: {message}"),
                    _ => message.clone(),
                };
                Error::new(ShimError::kind_of(*code), what).with_context("shim_status", code)
            }
            _ => Error::new(ErrorKind::Unavailable, e.to_string()),
        }
    }
}

type FnAbi = unsafe extern "C" fn() -> u32;
type FnStr = unsafe extern "C" fn() -> *const c_char;
type FnEngineCreate = unsafe extern "C" fn(*const c_char, *mut *mut RawEngine) -> c_int;
type FnEngine = unsafe extern "C" fn(*mut RawEngine) -> c_int;
type FnEngineVoid = unsafe extern "C" fn(*mut RawEngine);
type FnEngineStr = unsafe extern "C" fn(*mut RawEngine) -> *const c_char;
type FnEngineU64 = unsafe extern "C" fn(*mut RawEngine) -> u64;
type FnRegister =
    unsafe extern "C" fn(*mut RawEngine, u64, u64, *const c_char, u32, *mut u64) -> c_int;
type FnDeregister = unsafe extern "C" fn(*mut RawEngine, u64) -> c_int;
type FnAttemptCreate = unsafe extern "C" fn(*mut RawEngine, *mut *mut RawAttempt) -> c_int;
type FnAttempt = unsafe extern "C" fn(*mut RawAttempt);
type FnConnect = unsafe extern "C" fn(
    *mut RawEngine,
    *const c_char,
    u32,
    *mut RawAttempt,
    *mut *mut RawConn,
) -> c_int;
type FnDisconnect = unsafe extern "C" fn(*mut RawConn);
type FnPost = unsafe extern "C" fn(*mut RawConn, c_int, *const Desc, u32, *mut u64) -> c_int;
type FnQuery = unsafe extern "C" fn(*mut RawConn, u64) -> c_int;
type FnWait = unsafe extern "C" fn(*mut RawEngine, u64, u32);

/// A loaded shim: its path, its version string and every entry point.
pub(crate) struct Shim {
    pub(crate) path: PathBuf,
    pub(crate) version: String,
    last_error: FnStr,
    engine_create: FnEngineCreate,
    engine_destroy: FnEngineVoid,
    start_server: FnEngine,
    endpoint: FnEngineStr,
    max_desc_len: FnEngineU64,
    memory_kinds: FnEngineStr,
    register: FnRegister,
    deregister: FnDeregister,
    attempt_create: FnAttemptCreate,
    attempt_cancel: FnAttempt,
    attempt_destroy: FnAttempt,
    connect: FnConnect,
    cancel_connects: FnEngineVoid,
    disconnect: FnDisconnect,
    post: FnPost,
    query: FnQuery,
    events: FnEngineU64,
    wait: FnWait,
    wake: FnEngineVoid,
    _lib: libloading::Library,
}

impl std::fmt::Debug for Shim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shim")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish()
    }
}

/// Shims loaded in this process, by the path they were asked for.
static LOADED: Mutex<Option<HashMap<PathBuf, Arc<Shim>>>> = Mutex::new(None);

/// Loads the shim at `path` (once per path per process) and resolves every symbol.
pub(crate) fn load(path: &Path) -> Result<Arc<Shim>, ShimError> {
    let mut loaded = LOADED.lock();
    let table = loaded.get_or_insert_with(HashMap::new);
    if let Some(shim) = table.get(path) {
        return Ok(shim.clone());
    }
    let shim = Arc::new(Shim::open(path)?);
    table.insert(path.to_path_buf(), shim.clone());
    Ok(shim)
}

fn sym<T: Copy>(
    lib: &libloading::Library,
    path: &Path,
    name: &'static str,
) -> Result<T, ShimError> {
    let cname = format!("{name}\0");
    // SAFETY: `T` is the function pointer type `te_flagcx_shim.h` declares for `name`;
    // the pointer is copied out and used only while the library stays loaded, which is
    // forever (the `Shim` owning the library is never dropped: see `LOADED`).
    unsafe { lib.get::<T>(cname.as_bytes()) }
        .map(|s| *s)
        .map_err(|source| ShimError::Symbol {
            path: path.to_path_buf(),
            symbol: name,
            source,
        })
}

impl Shim {
    fn open(path: &Path) -> Result<Shim, ShimError> {
        // SAFETY: loading runs the library's initializers. The library is one the
        // operator named as a te FlagCX shim (configuration, TE_FLAGCX_SHIM, or the one
        // this crate's build produced); its ABI version is checked before any other call.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|source| ShimError::Load {
            path: path.to_path_buf(),
            source,
        })?;
        let abi: FnAbi = sym(&lib, path, "te_flagcx_shim_abi")?;
        // SAFETY: the ABI query takes no arguments and only returns a constant.
        let found = unsafe { abi() };
        if found != ABI {
            return Err(ShimError::Abi {
                path: path.to_path_buf(),
                found,
            });
        }
        let version: FnStr = sym(&lib, path, "te_flagcx_shim_version")?;
        // SAFETY: the header promises a NUL-terminated string in static storage.
        let version = unsafe { cstr(version()) };
        Ok(Shim {
            path: path.to_path_buf(),
            version,
            last_error: sym(&lib, path, "te_flagcx_last_error")?,
            engine_create: sym(&lib, path, "te_flagcx_engine_create")?,
            engine_destroy: sym(&lib, path, "te_flagcx_engine_destroy")?,
            start_server: sym(&lib, path, "te_flagcx_start_server")?,
            endpoint: sym(&lib, path, "te_flagcx_endpoint")?,
            max_desc_len: sym(&lib, path, "te_flagcx_max_desc_len")?,
            memory_kinds: sym(&lib, path, "te_flagcx_memory_kinds")?,
            register: sym(&lib, path, "te_flagcx_register")?,
            deregister: sym(&lib, path, "te_flagcx_deregister")?,
            attempt_create: sym(&lib, path, "te_flagcx_attempt_create")?,
            attempt_cancel: sym(&lib, path, "te_flagcx_attempt_cancel")?,
            attempt_destroy: sym(&lib, path, "te_flagcx_attempt_destroy")?,
            connect: sym(&lib, path, "te_flagcx_connect")?,
            cancel_connects: sym(&lib, path, "te_flagcx_cancel_connects")?,
            disconnect: sym(&lib, path, "te_flagcx_disconnect")?,
            post: sym(&lib, path, "te_flagcx_post")?,
            query: sym(&lib, path, "te_flagcx_query")?,
            events: sym(&lib, path, "te_flagcx_events")?,
            wait: sym(&lib, path, "te_flagcx_wait")?,
            wake: sym(&lib, path, "te_flagcx_wake")?,
            _lib: lib,
        })
    }

    /// The error of a failed call, with the shim's last-error text of this thread.
    fn error(&self, call: &'static str, code: c_int) -> ShimError {
        // SAFETY: the header promises a thread-local NUL-terminated string (or null).
        let mut message = unsafe { cstr((self.last_error)()) };
        if message.is_empty() {
            message = format!("failed with status {code} and no message");
        }
        ShimError::Call {
            call,
            code,
            message,
        }
    }

    fn check(&self, call: &'static str, code: c_int) -> Result<(), ShimError> {
        if code == OK {
            Ok(())
        } else {
            Err(self.error(call, code))
        }
    }
}

/// Copies a C string the shim returned; empty for null.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string that stays valid during the call.
unsafe fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the caller guarantees a valid NUL-terminated string.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn c_string(call: &'static str, s: &str) -> Result<CString, ShimError> {
    CString::new(s).map_err(|_| ShimError::Call {
        call,
        code: E_INVALID,
        message: format!("`{s}` contains a NUL byte"),
    })
}

/// An engine of a loaded shim; destroyed when the last reference goes.
pub(crate) struct Engine {
    shim: Arc<Shim>,
    raw: *mut RawEngine,
}

// SAFETY: the shim's functions may be called from any thread concurrently (the
// header's contract); `raw` is only destroyed in `Drop`, when no other reference exists.
unsafe impl Send for Engine {}
// SAFETY: as above.
unsafe impl Sync for Engine {}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("shim", &self.shim.path)
            .finish()
    }
}

impl Engine {
    /// Creates an engine with the shim's `options` and starts its server.
    pub(crate) fn create(shim: Arc<Shim>, options: &str) -> Result<Engine, ShimError> {
        let options = c_string("te_flagcx_engine_create", options)?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `options` is a valid C string and `raw` a valid out pointer.
        let code = unsafe { (shim.engine_create)(options.as_ptr(), &mut raw) };
        shim.check("te_flagcx_engine_create", code)?;
        let engine = Engine { shim, raw };
        // SAFETY: `raw` is the live engine just created.
        let code = unsafe { (engine.shim.start_server)(engine.raw) };
        engine.shim.check("te_flagcx_start_server", code)?;
        Ok(engine)
    }

    pub(crate) fn shim(&self) -> &Shim {
        &self.shim
    }

    /// The endpoint string peers connect to.
    pub(crate) fn endpoint(&self) -> Result<String, ShimError> {
        // SAFETY: `raw` is live; the string lives as long as the engine and is copied.
        let p = unsafe { (self.shim.endpoint)(self.raw) };
        if p.is_null() {
            return Err(self.shim.error("te_flagcx_endpoint", E_INVALID));
        }
        // SAFETY: non-null, NUL-terminated, valid for the engine's life.
        Ok(unsafe { cstr(p) })
    }

    /// The largest length of one descriptor.
    pub(crate) fn max_desc_len(&self) -> u64 {
        // SAFETY: `raw` is live.
        unsafe { (self.shim.max_desc_len)(self.raw) }
    }

    /// The memory runtimes the shim registers.
    pub(crate) fn memory_kinds(&self) -> Vec<String> {
        // SAFETY: `raw` is live; the string is static or engine-lifetime, and copied.
        let kinds = unsafe { cstr((self.shim.memory_kinds)(self.raw)) };
        kinds
            .split(',')
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .map(str::to_string)
            .collect()
    }

    /// Registers memory with the remote rights `access` (`ACCESS_*` flags, 0 for local
    /// use only); returns the shim's handle.
    pub(crate) fn register(
        &self,
        addr: u64,
        len: u64,
        memory: &str,
        access: u32,
    ) -> Result<u64, ShimError> {
        let memory = c_string("te_flagcx_register", memory)?;
        let mut mr = 0;
        // SAFETY: `raw` is live, `memory` a valid C string, `mr` a valid out pointer.
        // The caller (te's engine) guarantees the memory stays valid until deregistered.
        let code =
            unsafe { (self.shim.register)(self.raw, addr, len, memory.as_ptr(), access, &mut mr) };
        self.shim.check("te_flagcx_register", code)?;
        Ok(mr)
    }

    /// Deregisters a handle. It does not wait for transfers: the caller waits first
    /// until every transfer it posted on the memory has finished.
    pub(crate) fn deregister(&self, mr: u64) -> Result<(), ShimError> {
        // SAFETY: `raw` is live.
        let code = unsafe { (self.shim.deregister)(self.raw, mr) };
        self.shim.check("te_flagcx_deregister", code)
    }
}

impl Engine {
    /// The engine's progress event counter (see `te_flagcx_events`).
    pub(crate) fn events(&self) -> u64 {
        // SAFETY: `raw` is live.
        unsafe { (self.shim.events)(self.raw) }
    }

    /// Blocks until the event counter differs from `seen`, or `timeout` passed; may
    /// return sooner (the real shim returns at once: FlagCX has no blocking wait).
    pub(crate) fn wait(&self, seen: u64, timeout: std::time::Duration) {
        let us = u32::try_from(timeout.as_micros()).unwrap_or(u32::MAX);
        // SAFETY: `raw` is live; the call only waits.
        unsafe { (self.shim.wait)(self.raw, seen, us) }
    }

    /// Bumps the event counter, waking a thread in [`Engine::wait`].
    pub(crate) fn wake(&self) {
        // SAFETY: `raw` is live.
        unsafe { (self.shim.wake)(self.raw) }
    }

    /// Makes every [`Conn::open`] of this engine in progress, and every later one,
    /// fail at once, so that the threads connecting can be joined (for one attempt
    /// alone, see [`Attempt::cancel`]).
    pub(crate) fn cancel_connects(&self) {
        // SAFETY: `raw` is live.
        unsafe { (self.shim.cancel_connects)(self.raw) }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // SAFETY: the last reference is gone (connections hold an `Arc<Engine>`), so no
        // other call uses `raw`.
        unsafe { (self.shim.engine_destroy)(self.raw) }
    }
}

/// One connection attempt's cancel (`te_flagcx_attempt`): what its [`Conn::open`] is
/// given, so that [`Attempt::cancel`] can stop it alone. Destroyed when the last
/// reference goes, which is after every open given it returned.
pub(crate) struct Attempt {
    engine: Arc<Engine>,
    raw: *mut RawAttempt,
}

// SAFETY: the shim's functions may be called from any thread, and
// `te_flagcx_attempt_cancel` concurrently with a connect using the attempt (the header's
// contract); `raw` is only destroyed in `Drop`, when no other reference exists.
unsafe impl Send for Attempt {}
// SAFETY: as above.
unsafe impl Sync for Attempt {}

impl std::fmt::Debug for Attempt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attempt").finish_non_exhaustive()
    }
}

impl Attempt {
    /// A new attempt of `engine`.
    pub(crate) fn new(engine: Arc<Engine>) -> Result<Attempt, ShimError> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: the engine is live and `raw` a valid out pointer.
        let code = unsafe { (engine.shim.attempt_create)(engine.raw, &mut raw) };
        engine.shim.check("te_flagcx_attempt_create", code)?;
        Ok(Attempt { engine, raw })
    }

    /// Makes the [`Conn::open`] given this attempt, in progress or later, fail at once.
    /// Idempotent.
    pub(crate) fn cancel(&self) {
        // SAFETY: `raw` is live (destroyed only in `Drop`); the shim allows a cancel
        // from any thread while a connect uses the attempt.
        unsafe { (self.engine.shim.attempt_cancel)(self.raw) }
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        // SAFETY: the last reference is gone, so no open uses the attempt (each borrows
        // it for its call) and no cancel runs; the engine it belongs to is alive (held
        // by `self.engine`).
        unsafe { (self.engine.shim.attempt_destroy)(self.raw) }
    }
}

/// A connection of an engine; closed by [`Conn::close`] or when the last reference goes.
pub(crate) struct Conn {
    engine: Arc<Engine>,
    /// Null once closed. Posts and queries hold the read lock across their shim call,
    /// so closing waits for them and none starts on a closed connection.
    raw: RwLock<*mut RawConn>,
    peer: String,
}

// SAFETY: as for `Engine`: shim calls are thread-safe, and `raw` is only closed under
// the write lock, which no post or query holds.
unsafe impl Send for Conn {}
// SAFETY: as above.
unsafe impl Sync for Conn {}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn").field("peer", &self.peer).finish()
    }
}

impl Conn {
    /// Opens a new connection to `endpoint` on the engine of `attempt`, with a fresh
    /// snapshot of its regions; gives up after about `timeout`, rounded up to whole
    /// milliseconds so that it never gives up before it (or at once after
    /// [`Attempt::cancel`] or [`Engine::cancel_connects`]).
    pub(crate) fn open(
        attempt: &Attempt,
        endpoint: &str,
        timeout: std::time::Duration,
    ) -> Result<Conn, ShimError> {
        let engine = &attempt.engine;
        let ep = c_string("te_flagcx_connect", endpoint)?;
        let ms = u32::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(u32::MAX);
        let mut raw = std::ptr::null_mut();
        // SAFETY: the engine is live, `ep` a valid C string, the attempt is live (the
        // borrow outlasts the call) and the engine's own, `raw` a valid out pointer.
        let code =
            unsafe { (engine.shim.connect)(engine.raw, ep.as_ptr(), ms, attempt.raw, &mut raw) };
        engine.shim.check("te_flagcx_connect", code)?;
        Ok(Conn {
            engine: engine.clone(),
            raw: RwLock::new(raw),
            peer: endpoint.to_string(),
        })
    }

    /// The endpoint it was opened to.
    pub(crate) fn peer(&self) -> &str {
        &self.peer
    }

    fn closed(&self, call: &'static str) -> ShimError {
        ShimError::Call {
            call,
            code: E_UNREACHABLE,
            message: format!(
                "the FlagCX connection to {} was closed; its transfers were abandoned",
                self.peer
            ),
        }
    }

    /// Posts descriptors of one operation; returns the transfer id.
    pub(crate) fn post(&self, op: c_int, descs: &[Desc]) -> Result<u64, ShimError> {
        let count = u32::try_from(descs.len()).map_err(|_| ShimError::Call {
            call: "te_flagcx_post",
            code: E_INVALID,
            message: format!("{} descriptors in one batch are too many", descs.len()),
        })?;
        let raw = self.raw.read();
        if raw.is_null() {
            return Err(self.closed("te_flagcx_post"));
        }
        let mut xfer = 0;
        // SAFETY: the connection is live (not closed, and the read lock keeps it so);
        // `descs` points to `count` initialized descriptors that outlive the call (the
        // shim copies what it keeps); the memory they name is registered, and te's
        // engine keeps it valid until deregistered.
        let code = unsafe { (self.engine.shim.post)(*raw, op, descs.as_ptr(), count, &mut xfer) };
        self.engine.shim.check("te_flagcx_post", code)?;
        Ok(xfer)
    }

    /// `Ok(true)` once the transfer finished with every byte delivered, `Ok(false)`
    /// while pending, an error (`E_TRANSFER` for failed slices, `E_UNREACHABLE` once
    /// the connection was closed) otherwise. After anything but `Ok(false)` the id is
    /// released and must not be queried again.
    pub(crate) fn query(&self, xfer: u64) -> Result<bool, ShimError> {
        let raw = self.raw.read();
        if raw.is_null() {
            return Err(self.closed("te_flagcx_query"));
        }
        // SAFETY: the connection is live (the read lock keeps it so); the caller
        // queries each id until it finishes and never again.
        let code = unsafe { (self.engine.shim.query)(*raw, xfer) };
        match code {
            PENDING => Ok(false),
            OK => Ok(true),
            code => Err(self.engine.shim.error("te_flagcx_query", code)),
        }
    }

    /// Closes the connection now, whoever else holds it: once this returns, no
    /// transfer posted on it touches memory any more (the shim's disconnect ends its
    /// transfers, see `te_flagcx_disconnect`), and later posts and queries fail with
    /// `E_UNREACHABLE`. Idempotent.
    pub(crate) fn close(&self) {
        let mut raw = self.raw.write();
        if raw.is_null() {
            return;
        }
        // SAFETY: the write lock excludes every post and query; transfers still pending
        // on it are never queried on the shim again (the null pointer stops them).
        unsafe { (self.engine.shim.disconnect)(*raw) };
        *raw = std::ptr::null_mut();
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.close();
    }
}
