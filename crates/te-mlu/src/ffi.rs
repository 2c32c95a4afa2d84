//! The CNRT symbols te uses, loaded at run time, all resolved once into one table.
//!
//! Every name, enum value and struct layout here is listed, with the header it was read
//! from, in `docs/mlu-abi.md`; change both together. The library is looked for in this
//! order: the file `TE_MLU_CNRT_LIB` names (only that file, when the variable is set),
//! `$NEUWARE_HOME/lib64/libcnrt.so`, then `libcnrt.so` on the system search path. A
//! missing library or symbol, or a CNRT older than 6, is an `Unavailable` error that
//! names it; nothing here panics.
//!
//! The exported names are bound, not the header's macro spellings: CNRT 6.14 exports
//! `cnrtMemcpyAsync_V3`, `cnrtMemcpyAsync_V2` and `cnrtMemcpyAsync` (all with one
//! signature), CNRT 6.0 only `cnrtMemcpyAsync`; the newest one present is used.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use libloading::Library;
use te_core::{Error, ErrorKind, Result};

/// `cnrtRet_t`.
pub(crate) type Ret = c_int;
/// `cnrtQueue_t`: an opaque queue handle.
pub(crate) type Queue = *mut c_void;

/// `cnrtRet_t` values te tells apart (cnrt.h 6.14.1).
pub(crate) mod code {
    use super::Ret;
    pub(crate) const SUCCESS: Ret = 0;
    pub(crate) const NOT_READY: Ret = 1;
    pub(crate) const BUSY: Ret = 632014;
    pub(crate) const NO_DEVICE: Ret = 100004;
    pub(crate) const DEVICE_INVALID: Ret = 100005;
    /// `cnrtErrorOpsNotPermitted`: taken as CNRT's refusal of a second IPC handle for
    /// one allocation (the code is unconfirmed, see docs/mlu-abi.md).
    pub(crate) const OPS_NOT_PERMITTED: Ret = 100051;

    /// The header's names of the codes te may report, for messages.
    pub(crate) fn name(code: Ret) -> &'static str {
        match code {
            0 => "cnrtSuccess",
            1 => "cnrtErrorNotReady",
            100002 => "cnrtErrorInit",
            100004 => "cnrtErrorNoDevice",
            100005 => "cnrtErrorDeviceInvalid",
            100006 => "cnrtErrorArgsInvalid",
            100007 => "cnrtErrorSys",
            100010 => "cnrtErrorSysNoMem",
            100014 => "cnrtErrorInvalidResourceHandle",
            100015 => "cnrtErrorIllegalState",
            100050 => "cnrtErrorNotSupport",
            100051 => "cnrtErrorOpsNotPermitted",
            100060 => "cnrtErrorQueue",
            100100 => "cnrtErrorNoMem",
            632002 => "cnrtErrorSetOnActiveProcess",
            632006 => "cnrtErrorDevice",
            632013 => "cnrtErrorMemcpyDirectionInvalid",
            632014 => "cnrtErrorBusy",
            632015 => "cnrtErrorCndrvFuncCall",
            632019 => "cnrtErrorNoCnrtContext",
            999991 => "cnrtErrorUnknown",
            _ => "an unlisted cnrtRet_t",
        }
    }
}

/// `cnrtMemTransDir_t` values (cnrt.h 6.0.2 and 6.14.1).
pub(crate) mod dir {
    pub(crate) const HOST_TO_DEV: super::c_int = 0;
    pub(crate) const DEV_TO_DEV: super::c_int = 1;
    pub(crate) const DEV_TO_HOST: super::c_int = 2;
}

/// `cnrtDeviceFlags_t` values (cnrt.h 6.0.2 and 6.14.1).
pub(crate) mod flag {
    /// `cnrtDeviceScheduleSpin`: the CPU spins while it waits for the device.
    pub(crate) const SPIN: u32 = 0;
    /// `cnrtDeviceScheduleBlock`: the waiting thread blocks.
    pub(crate) const BLOCK: u32 = 1;
    /// `cnrtDeviceScheduleYield`: the waiting thread yields.
    pub(crate) const YIELD: u32 = 2;
    /// `cnrtDeviceScheduleAuto`: spin or block, as CNRT decides.
    pub(crate) const AUTO: u32 = 3;

    /// The header's name of a flag, for messages.
    pub(crate) fn name(f: u32) -> &'static str {
        match f {
            SPIN => "cnrtDeviceScheduleSpin",
            BLOCK => "cnrtDeviceScheduleBlock",
            YIELD => "cnrtDeviceScheduleYield",
            AUTO => "cnrtDeviceScheduleAuto",
            _ => "an unlisted cnrtDeviceFlags_t",
        }
    }
}

/// `cnrtMemTypeDevice` of `cnrtMemType_t`.
pub(crate) const MEM_TYPE_DEVICE: c_int = 2;

/// `cnrtPointerAttributes_t` (same layout in cnrt.h 6.0.2 and 6.14.1).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct PointerAttributes {
    /// `cnrtMemType_t type`.
    pub(crate) kind: c_int,
    /// `int device`.
    pub(crate) device: c_int,
    /// `size_t size`: the allocation's size.
    pub(crate) size: usize,
    /// `void *devicePointer`.
    pub(crate) device_pointer: *mut c_void,
    /// `void *hostPointer`.
    pub(crate) host_pointer: *mut c_void,
    /// `cnrtUvaCacheMode_t cacheMode`.
    pub(crate) cache_mode: c_int,
    /// `void *deviceBasePointer`: the allocation's start.
    pub(crate) device_base_pointer: *mut c_void,
}

/// `cnrtIpcMemHandle` is `void *`: its 8 bytes are what travels to the peer.
pub(crate) type IpcHandle = [u8; 8];

type FnVersion = unsafe extern "C" fn(*mut c_int, *mut c_int, *mut c_int) -> Ret;
type FnCount = unsafe extern "C" fn(*mut c_uint) -> Ret;
type FnSetDevice = unsafe extern "C" fn(c_int) -> Ret;
type FnGetDevice = unsafe extern "C" fn(*mut c_int) -> Ret;
type FnSetFlag = unsafe extern "C" fn(u32) -> Ret;
type FnGetFlag = unsafe extern "C" fn(*mut u32) -> Ret;
type FnMalloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> Ret;
type FnFree = unsafe extern "C" fn(*mut c_void) -> Ret;
type FnMemcpy = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int) -> Ret;
type FnMemcpyAsync = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, Queue, c_int) -> Ret;
type FnMemcpyPeerAsync =
    unsafe extern "C" fn(*mut c_void, c_int, *mut c_void, c_int, usize, Queue) -> Ret;
type FnQueueCreate = unsafe extern "C" fn(*mut Queue) -> Ret;
type FnQueue = unsafe extern "C" fn(Queue) -> Ret;
type FnPointer = unsafe extern "C" fn(*mut PointerAttributes, *const c_void) -> Ret;
type FnErrorStr = unsafe extern "C" fn(Ret) -> *const c_char;
type FnPeer = unsafe extern "C" fn(*mut c_uint, c_int, c_int) -> Ret;
type FnAcquire = unsafe extern "C" fn(*mut *mut c_void, *mut c_void) -> Ret;
type FnMap = unsafe extern "C" fn(*mut *mut c_void, *mut c_void, c_int) -> Ret;
type FnBusId = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> Ret;

/// The loaded library and every symbol te calls.
pub(crate) struct Cnrt {
    path: String,
    version: (i32, i32, i32),
    memcpy_async_name: &'static str,
    get_device_count: FnCount,
    set_device: FnSetDevice,
    get_device: FnGetDevice,
    set_device_flag: FnSetFlag,
    get_device_flag: FnGetFlag,
    malloc: FnMalloc,
    free: FnFree,
    host_malloc: FnMalloc,
    free_host: FnFree,
    memcpy: FnMemcpy,
    memcpy_async: FnMemcpyAsync,
    memcpy_peer_async: FnMemcpyPeerAsync,
    queue_create: FnQueueCreate,
    queue_destroy: FnQueue,
    queue_sync: FnQueue,
    queue_query: FnQueue,
    pointer_get_attributes: FnPointer,
    get_error_str: FnErrorStr,
    get_peer_accessibility: FnPeer,
    acquire_mem_handle: FnAcquire,
    map_mem_handle: FnMap,
    unmap_mem_handle: FnFree,
    device_get_pci_bus_id: FnBusId,
    // Last: the function pointers above are valid only while the library is loaded.
    _lib: Library,
}

impl std::fmt::Debug for Cnrt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cnrt")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("memcpy_async", &self.memcpy_async_name)
            .finish()
    }
}

fn unavailable(m: String) -> Error {
    Error::new(ErrorKind::Unavailable, m).with_operation("load CNRT")
}

/// The minimum CNRT major version te binds.
pub(crate) const MIN_MAJOR: i32 = 6;

static CNRT: OnceLock<Result<Arc<Cnrt>>> = OnceLock::new();

/// The process's CNRT, loaded on first use (and never unloaded).
///
/// # Errors
/// `Unavailable`, naming what is missing.
pub(crate) fn cnrt() -> Result<Arc<Cnrt>> {
    CNRT.get_or_init(|| Cnrt::find().map(Arc::new)).clone()
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

impl Cnrt {
    /// Finds and loads the library in the documented order.
    fn find() -> Result<Cnrt> {
        if let Some(path) = env("TE_MLU_CNRT_LIB") {
            return Cnrt::open(Path::new(&path))
                .map_err(|e| unavailable(format!("TE_MLU_CNRT_LIB={path}: {}", e.message())));
        }
        #[cfg(test)]
        if !crate::tests::FAKE.is_empty() {
            return Cnrt::open(Path::new(crate::tests::FAKE));
        }
        let mut tried = Vec::new();
        match env("NEUWARE_HOME") {
            Some(home) => {
                let p = PathBuf::from(&home).join("lib64").join("libcnrt.so");
                if p.exists() {
                    return Cnrt::open(&p);
                }
                tried.push(format!("{} (absent)", p.display()));
            }
            None => tried.push("$NEUWARE_HOME/lib64 (NEUWARE_HOME is not set)".into()),
        }
        match Cnrt::open(Path::new("libcnrt.so")) {
            Ok(c) => Ok(c),
            Err(e) if e.message().contains("lacks") || e.message().contains("CNRT ") => Err(e),
            Err(_) => {
                tried.push("libcnrt.so on the system library path".into());
                Err(unavailable(format!(
                    "libcnrt.so not found (tried {}); install Cambricon Neuware, set NEUWARE_HOME, or point TE_MLU_CNRT_LIB at the library",
                    tried.join(", ")
                )))
            }
        }
    }

    /// Loads the library at `path` (a bare file name uses the system search path),
    /// resolves every symbol and checks the version.
    ///
    /// # Errors
    /// `Unavailable`: the file cannot be loaded, a symbol is missing, or CNRT < 6.
    pub(crate) fn open(path: &Path) -> Result<Cnrt> {
        let shown = path.display().to_string();
        // SAFETY: loading a shared library runs its initialisers; libcnrt's are what
        // any CNRT program runs. The library is kept loaded for the table's life.
        let lib = unsafe { Library::new(path) }
            .map_err(|e| unavailable(format!("cannot load {shown}: {e}")))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol's type is the prototype from the CNRT header listed
                // in docs/mlu-abi.md; the pointer is used only while `lib` is loaded.
                unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map(|s: libloading::Symbol<'_, _>| *s)
                    .map_err(|_| {
                        unavailable(format!(
                            "{shown} lacks the symbol {} that te needs (CNRT too old, or not libcnrt)",
                            $name
                        ))
                    })?
            };
        }
        let get_lib_version: FnVersion = sym!("cnrtGetLibVersion");
        let (mut major, mut minor, mut patch) = (0, 0, 0);
        // SAFETY: three valid out-parameters.
        let r = unsafe { get_lib_version(&mut major, &mut minor, &mut patch) };
        if r != code::SUCCESS {
            return Err(unavailable(format!(
                "{shown}: cnrtGetLibVersion failed with {} ({r})",
                code::name(r)
            )));
        }
        if major < MIN_MAJOR {
            return Err(unavailable(format!(
                "{shown} is CNRT {major}.{minor}.{patch}; te needs CNRT {MIN_MAJOR}.x or newer (Neuware with CNToolkit 3.x)"
            )));
        }
        let (memcpy_async, memcpy_async_name) = {
            let mut found = None;
            for name in [
                "cnrtMemcpyAsync_V3",
                "cnrtMemcpyAsync_V2",
                "cnrtMemcpyAsync",
            ] {
                let c = format!("{name}\0");
                // SAFETY: as in `sym!`: all three share the prototype of cnrt.h 6.14.1.
                if let Ok(s) = unsafe { lib.get::<FnMemcpyAsync>(c.as_bytes()) } {
                    found = Some((*s, name));
                    break;
                }
            }
            found.ok_or_else(|| {
                unavailable(format!(
                    "{shown} lacks cnrtMemcpyAsync_V3, cnrtMemcpyAsync_V2 and cnrtMemcpyAsync"
                ))
            })?
        };
        Ok(Cnrt {
            version: (major, minor, patch),
            memcpy_async_name,
            memcpy_async,
            get_device_count: sym!("cnrtGetDeviceCount"),
            set_device: sym!("cnrtSetDevice"),
            get_device: sym!("cnrtGetDevice"),
            set_device_flag: sym!("cnrtSetDeviceFlag"),
            get_device_flag: sym!("cnrtGetDeviceFlag"),
            malloc: sym!("cnrtMalloc"),
            free: sym!("cnrtFree"),
            host_malloc: sym!("cnrtHostMalloc"),
            free_host: sym!("cnrtFreeHost"),
            memcpy: sym!("cnrtMemcpy"),
            memcpy_peer_async: sym!("cnrtMemcpyPeerAsync"),
            queue_create: sym!("cnrtQueueCreate"),
            queue_destroy: sym!("cnrtQueueDestroy"),
            queue_sync: sym!("cnrtQueueSync"),
            queue_query: sym!("cnrtQueueQuery"),
            pointer_get_attributes: sym!("cnrtPointerGetAttributes"),
            get_error_str: sym!("cnrtGetErrorStr"),
            get_peer_accessibility: sym!("cnrtGetPeerAccessibility"),
            acquire_mem_handle: sym!("cnrtAcquireMemHandle"),
            map_mem_handle: sym!("cnrtMapMemHandle"),
            unmap_mem_handle: sym!("cnrtUnMapMemHandle"),
            device_get_pci_bus_id: sym!("cnrtDeviceGetPCIBusId"),
            path: shown,
            _lib: lib,
        })
    }

    /// Where the library was loaded from.
    pub(crate) fn path(&self) -> &str {
        &self.path
    }

    /// `cnrtGetLibVersion`'s answer.
    pub(crate) fn version(&self) -> (i32, i32, i32) {
        self.version
    }

    /// The asynchronous copy symbol bound (`cnrtMemcpyAsync_V3`, …).
    pub(crate) fn memcpy_async_name(&self) -> &'static str {
        self.memcpy_async_name
    }

    /// Turns a return code into a te error naming the call, the code and CNRT's text.
    pub(crate) fn check(&self, call: &'static str, r: Ret) -> Result<()> {
        if r == code::SUCCESS {
            return Ok(());
        }
        // SAFETY: cnrtGetErrorStr takes any code and returns a static string or null.
        let text = unsafe { (self.get_error_str)(r) };
        let text = if text.is_null() {
            String::new()
        } else {
            // SAFETY: a non-null result is a NUL-terminated static string.
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned()
        };
        let (kind, hint) = match r {
            code::NO_DEVICE | code::DEVICE_INVALID => (ErrorKind::InvalidRequest, ""),
            code::BUSY => (
                ErrorKind::Busy,
                " (the MLU or its queue is busy: retry later)",
            ),
            _ => (ErrorKind::Backend, ""),
        };
        Err(Error::new(
            kind,
            format!("{call} failed: {} ({r}): {text}{hint}", code::name(r)),
        )
        .with_context("cnrt", call))
    }

    /// Enqueues a copy on `queue` with `enqueue`. Where CNRT refuses it as busy (the
    /// queue is full), waits for the queue (`cnrtQueueSync`, which runs what it holds)
    /// and tries once more: a queue is never given more than CNRT takes, however many
    /// copies a batch has. Busy again, on an empty queue, is the copy's error (`Busy`).
    ///
    /// The current device must be the queue's.
    pub(crate) fn enqueue_or_wait(
        &self,
        queue: Queue,
        mut enqueue: impl FnMut() -> Result<()>,
    ) -> Result<()> {
        match enqueue() {
            Err(e) if e.kind() == ErrorKind::Busy => {
                self.queue_sync(queue)?;
                enqueue()
            }
            r => r,
        }
    }

    /// `cnrtGetDeviceCount`.
    pub(crate) fn device_count(&self) -> Result<u32> {
        let mut n: c_uint = 0;
        // SAFETY: a valid out-parameter.
        let r = unsafe { (self.get_device_count)(&mut n) };
        if r == code::NO_DEVICE {
            return Ok(0);
        }
        self.check("cnrtGetDeviceCount", r)?;
        Ok(n)
    }

    /// Runs `f` with `ordinal` as the calling thread's current device, then restores
    /// the device that was current before (CNRT keeps one per host thread).
    pub(crate) fn with_device<T>(&self, ordinal: u32, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let mut before: c_int = 0;
        // SAFETY: a valid out-parameter.
        self.check("cnrtGetDevice", unsafe { (self.get_device)(&mut before) })?;
        let ordinal = c_int::try_from(ordinal)
            .map_err(|_| Error::new(ErrorKind::InvalidRequest, format!("no MLU {ordinal}")))?;
        if before != ordinal {
            // SAFETY: plain call; a bad ordinal is refused by CNRT.
            self.check("cnrtSetDevice", unsafe { (self.set_device)(ordinal) })?;
        }
        let out = f();
        if before != ordinal {
            // SAFETY: restores a device CNRT reported as current.
            let _ = unsafe { (self.set_device)(before) };
        }
        out
    }

    /// `cnrtSetDevice`, for threads te owns.
    pub(crate) fn set_device(&self, ordinal: u32) -> Result<()> {
        // SAFETY: plain call; a bad ordinal is refused by CNRT.
        self.check("cnrtSetDevice", unsafe {
            (self.set_device)(ordinal as c_int)
        })
    }

    /// `cnrtSetDeviceFlag` for the current device: how a thread waiting for it (in
    /// `cnrtQueueSync`) waits. CNRT accepts it only before the device is in use.
    pub(crate) fn set_device_flag(&self, flag: u32) -> Result<()> {
        // SAFETY: plain call; CNRT checks the value.
        self.check("cnrtSetDeviceFlag", unsafe { (self.set_device_flag)(flag) })
    }

    /// `cnrtGetDeviceFlag` for the current device.
    pub(crate) fn device_flag(&self) -> Result<u32> {
        let mut f = 0u32;
        // SAFETY: a valid out-parameter.
        self.check("cnrtGetDeviceFlag", unsafe {
            (self.get_device_flag)(&mut f)
        })?;
        Ok(f)
    }

    /// `cnrtMalloc` on the current device.
    pub(crate) fn malloc(&self, len: usize) -> Result<u64> {
        let mut p = std::ptr::null_mut();
        // SAFETY: a valid out-parameter.
        self.check("cnrtMalloc", unsafe { (self.malloc)(&mut p, len) })?;
        Ok(p as u64)
    }

    /// `cnrtFree`.
    pub(crate) fn free(&self, addr: u64) -> Result<()> {
        // SAFETY: CNRT checks that the address is an allocation of its own.
        self.check("cnrtFree", unsafe { (self.free)(addr as *mut c_void) })
    }

    /// `cnrtHostMalloc`: page-locked host memory.
    pub(crate) fn host_malloc(&self, len: usize) -> Result<*mut u8> {
        let mut p = std::ptr::null_mut();
        // SAFETY: a valid out-parameter.
        self.check("cnrtHostMalloc", unsafe { (self.host_malloc)(&mut p, len) })?;
        Ok(p.cast())
    }

    /// `cnrtFreeHost`.
    ///
    /// # Safety
    /// `ptr` came from [`Cnrt::host_malloc`] and is not used afterwards.
    pub(crate) unsafe fn free_host(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: forwarded from the caller.
        self.check("cnrtFreeHost", unsafe { (self.free_host)(ptr.cast()) })
    }

    /// `cnrtMemcpy`: a synchronous copy (unused on the data path).
    ///
    /// # Safety
    /// Both ranges are valid for `len` bytes in the direction `dir` says.
    #[allow(dead_code)]
    pub(crate) unsafe fn memcpy(&self, dst: u64, src: u64, len: usize, dir: c_int) -> Result<()> {
        // SAFETY: forwarded from the caller.
        self.check("cnrtMemcpy", unsafe {
            (self.memcpy)(dst as *mut c_void, src as *mut c_void, len, dir)
        })
    }

    /// The bound `cnrtMemcpyAsync*`: enqueues a copy on `queue`.
    ///
    /// # Safety
    /// Both ranges stay valid, and the destination untouched by others, until the
    /// queue is synchronized.
    pub(crate) unsafe fn memcpy_async(
        &self,
        dst: u64,
        src: u64,
        len: usize,
        queue: Queue,
        dir: c_int,
    ) -> Result<()> {
        // SAFETY: forwarded from the caller.
        let r =
            unsafe { (self.memcpy_async)(dst as *mut c_void, src as *mut c_void, len, queue, dir) };
        self.check(self.memcpy_async_name, r)
    }

    /// `cnrtMemcpyPeerAsync`: a copy between two devices over MLU-Link.
    ///
    /// # Safety
    /// As [`Cnrt::memcpy_async`].
    pub(crate) unsafe fn memcpy_peer_async(
        &self,
        dst: u64,
        dst_dev: u32,
        src: u64,
        src_dev: u32,
        len: usize,
        queue: Queue,
    ) -> Result<()> {
        // SAFETY: forwarded from the caller.
        let r = unsafe {
            (self.memcpy_peer_async)(
                dst as *mut c_void,
                dst_dev as c_int,
                src as *mut c_void,
                src_dev as c_int,
                len,
                queue,
            )
        };
        self.check("cnrtMemcpyPeerAsync", r)
    }

    /// `cnrtQueueCreate` on the current device.
    pub(crate) fn queue_create(&self) -> Result<Queue> {
        let mut q = std::ptr::null_mut();
        // SAFETY: a valid out-parameter.
        self.check("cnrtQueueCreate", unsafe { (self.queue_create)(&mut q) })?;
        Ok(q)
    }

    /// `cnrtQueueDestroy` (it waits for nothing; CNRT releases the queue when idle).
    pub(crate) fn queue_destroy(&self, q: Queue) -> Result<()> {
        // SAFETY: `q` came from `queue_create` and is not used afterwards.
        self.check("cnrtQueueDestroy", unsafe { (self.queue_destroy)(q) })
    }

    /// `cnrtQueueSync`: waits (in CNRT, not here) until the queue is empty; it blocks
    /// rather than spins only on a device whose flag is `cnrtDeviceScheduleBlock`.
    pub(crate) fn queue_sync(&self, q: Queue) -> Result<()> {
        // SAFETY: `q` came from `queue_create`.
        self.check("cnrtQueueSync", unsafe { (self.queue_sync)(q) })
    }

    /// `cnrtQueueQuery`: `true` if the queue is empty, `false` while work remains
    /// (`cnrtErrorNotReady` or `cnrtErrorBusy`; the 6.14 header documents the latter).
    pub(crate) fn queue_query(&self, q: Queue) -> Result<bool> {
        // SAFETY: `q` came from `queue_create`.
        match unsafe { (self.queue_query)(q) } {
            code::SUCCESS => Ok(true),
            code::NOT_READY | code::BUSY => Ok(false),
            r => self.check("cnrtQueueQuery", r).map(|()| false),
        }
    }

    /// `cnrtPointerGetAttributes`.
    pub(crate) fn pointer_attributes(&self, addr: u64) -> Result<PointerAttributes> {
        let mut a = PointerAttributes {
            kind: 0,
            device: -1,
            size: 0,
            device_pointer: std::ptr::null_mut(),
            host_pointer: std::ptr::null_mut(),
            cache_mode: 0,
            device_base_pointer: std::ptr::null_mut(),
        };
        // SAFETY: `a` has the layout of cnrtPointerAttributes_t; the pointer is only
        // looked up, never dereferenced.
        self.check("cnrtPointerGetAttributes", unsafe {
            (self.pointer_get_attributes)(&mut a, addr as *const c_void)
        })?;
        Ok(a)
    }

    /// `cnrtGetPeerAccessibility`.
    pub(crate) fn peer_accessible(&self, ordinal: u32, peer: u32) -> Result<bool> {
        let mut can: c_uint = 0;
        // SAFETY: a valid out-parameter.
        self.check("cnrtGetPeerAccessibility", unsafe {
            (self.get_peer_accessibility)(&mut can, ordinal as c_int, peer as c_int)
        })?;
        Ok(can == 1)
    }

    /// `cnrtAcquireMemHandle` for an allocation's base address; `Ok(None)` where CNRT
    /// refuses because it gave this allocation's handle out already.
    pub(crate) fn acquire_mem_handle(&self, base: u64) -> Result<Option<IpcHandle>> {
        let mut h = std::ptr::null_mut();
        // SAFETY: a valid out-parameter; CNRT checks the address.
        match unsafe { (self.acquire_mem_handle)(&mut h, base as *mut c_void) } {
            code::OPS_NOT_PERMITTED => Ok(None),
            r => self
                .check("cnrtAcquireMemHandle", r)
                .map(|()| Some((h as u64).to_ne_bytes())),
        }
    }

    /// `cnrtMapMemHandle` into the current device: the mapped allocation's address here.
    pub(crate) fn map_mem_handle(&self, handle: IpcHandle) -> Result<u64> {
        let mut p = std::ptr::null_mut();
        // SAFETY: a valid out-parameter; the handle is an opaque value CNRT checks;
        // flags must be 0.
        self.check("cnrtMapMemHandle", unsafe {
            (self.map_mem_handle)(&mut p, u64::from_ne_bytes(handle) as *mut c_void, 0)
        })?;
        Ok(p as u64)
    }

    /// `cnrtUnMapMemHandle`.
    pub(crate) fn unmap_mem_handle(&self, addr: u64) -> Result<()> {
        // SAFETY: `addr` came from `map_mem_handle` and no copy uses it any more.
        self.check("cnrtUnMapMemHandle", unsafe {
            (self.unmap_mem_handle)(addr as *mut c_void)
        })
    }

    /// `cnrtDeviceGetPCIBusId`: `domain:bus:device.function`.
    pub(crate) fn pci_bus_id(&self, ordinal: u32) -> Result<String> {
        let mut buf = [0 as c_char; 64];
        // SAFETY: the buffer is 64 bytes and its length is passed.
        self.check("cnrtDeviceGetPCIBusId", unsafe {
            (self.device_get_pci_bus_id)(buf.as_mut_ptr(), buf.len() as c_int, ordinal as c_int)
        })?;
        buf[63] = 0;
        // SAFETY: NUL-terminated (forced above).
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }
}
