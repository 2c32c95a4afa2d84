//! Device runtimes: the seam between te and an accelerator's memory (CUDA, MLU, …).
//!
//! A runtime is found by name — the `RUNTIME` of a `RUNTIME:ORDINAL` memory kind —
//! through the same kind of registry as backends: each runtime registers itself with
//! [`register_runtime!`](crate::register_runtime), and nothing lists them. A runtime
//! answers where a device pointer lives, allocates device and pinned host memory, and
//! copies between the two asynchronously, reporting completion through a callback, so
//! a backend that cannot touch device memory stages it through pinned host buffers.
//!
//! Runtimes are probed before use; a missing driver or library is an error that says
//! so, never a panic. One instance per runtime serves the whole process.

use crate::sync::Mutex;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};

use crate::desc::MemoryKind;
use crate::error::{Error, ErrorKind, Result};

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod fakedev;

/// Where a device address lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PointerInfo {
    /// The device's ordinal.
    pub ordinal: u32,
    /// The start of the allocation holding the address.
    pub base: u64,
    /// The allocation's length in bytes.
    pub len: u64,
}

/// A copy between device memory and host memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceCopy {
    /// Host bytes at `host` to device address `device`.
    ToDevice {
        /// Device ordinal.
        ordinal: u32,
        /// Destination device address.
        device: u64,
        /// Source host address.
        host: *const u8,
        /// Bytes.
        len: usize,
    },
    /// Device bytes at `device` to host address `host`.
    ToHost {
        /// Device ordinal.
        ordinal: u32,
        /// Source device address.
        device: u64,
        /// Destination host address.
        host: *mut u8,
        /// Bytes.
        len: usize,
    },
    /// Device bytes to device bytes, on one device or between two of this runtime.
    DeviceToDevice {
        /// Source device ordinal.
        src_ordinal: u32,
        /// Source device address.
        src: u64,
        /// Destination device ordinal.
        dst_ordinal: u32,
        /// Destination device address.
        dst: u64,
        /// Bytes.
        len: usize,
    },
}

impl DeviceCopy {
    /// The device the copy runs on (its queue), and its direction: 0 host → device,
    /// 1 device → host, 2 device → device.
    pub fn queue(&self) -> (u32, usize) {
        match *self {
            DeviceCopy::ToDevice { ordinal, .. } => (ordinal, 0),
            DeviceCopy::ToHost { ordinal, .. } => (ordinal, 1),
            DeviceCopy::DeviceToDevice { src_ordinal, .. } => (src_ordinal, 2),
        }
    }

    /// Bytes copied.
    pub fn len(&self) -> usize {
        match *self {
            DeviceCopy::ToDevice { len, .. }
            | DeviceCopy::ToHost { len, .. }
            | DeviceCopy::DeviceToDevice { len, .. } => len,
        }
    }

    /// Whether it copies nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// SAFETY: a `DeviceCopy` is a description of memory the submitter guarantees live and
// unaliased until the copy completes (see `DeviceRuntime::copy`); the pointers are
// only dereferenced by the runtime.
unsafe impl Send for DeviceCopy {}

/// What runs when a copy completes.
pub type CopyDone = Box<dyn FnOnce(Result<()>) + Send>;

/// What a runtime's copies have cost its devices since it started, as the runtime
/// counts them: how many driver calls submitted copies, how many copies (ranges) those
/// calls carried, how many times a completion was waited for, and the bytes moved.
/// A batched call or a kernel launch that moves a whole group is one call; a loop of
/// single-copy calls is one call per copy. `te bench --json` reports the difference
/// over a point, per batch, so a regression in batching shows without a device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyStats {
    /// Driver calls (or fake launches) that submitted copies.
    pub calls: u64,
    /// Copies (source, destination, length) submitted.
    pub copies: u64,
    /// Synchronisations: waits for a group's (or a single copy's) completion.
    pub syncs: u64,
    /// Bytes copied.
    pub bytes: u64,
}

impl CopyStats {
    /// What was counted between `before` and `self`.
    pub fn since(&self, before: &CopyStats) -> CopyStats {
        CopyStats {
            calls: self.calls.saturating_sub(before.calls),
            copies: self.copies.saturating_sub(before.copies),
            syncs: self.syncs.saturating_sub(before.syncs),
            bytes: self.bytes.saturating_sub(before.bytes),
        }
    }

    fn add(&mut self, o: &CopyStats) {
        self.calls += o.calls;
        self.copies += o.copies;
        self.syncs += o.syncs;
        self.bytes += o.bytes;
    }
}

/// The counters behind [`CopyStats`], for a runtime to keep: atomics, so any thread
/// that submits or waits counts without a lock.
#[derive(Debug, Default)]
pub struct CopyCounters {
    calls: AtomicU64,
    copies: AtomicU64,
    syncs: AtomicU64,
    bytes: AtomicU64,
}

impl CopyCounters {
    /// One driver call that submitted `copies` copies of `bytes` bytes in all.
    pub fn call(&self, copies: usize, bytes: u64) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.copies.fetch_add(copies as u64, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// One synchronisation.
    pub fn sync(&self) {
        self.syncs.fetch_add(1, Ordering::Relaxed);
    }

    /// The counts so far.
    pub fn get(&self) -> CopyStats {
        CopyStats {
            calls: self.calls.load(Ordering::Relaxed),
            copies: self.copies.load(Ordering::Relaxed),
            syncs: self.syncs.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
        }
    }
}

/// Device memory exported for another process of this host ([`DeviceRuntime::ipc_export`]).
#[derive(Debug)]
pub struct IpcExport {
    /// The runtime's handle, as bytes that travel to the peer (CUDA: the 64-byte IPC
    /// memory handle); empty where the handle is the descriptor alone.
    pub handle: Vec<u8>,
    /// A descriptor to pass to the peer over a Unix socket (fakedev: the memfd), where
    /// the runtime's handles are descriptors.
    pub fd: Option<std::os::fd::OwnedFd>,
    /// The device the allocation is on.
    pub ordinal: u32,
    /// The allocation's base address in this process.
    pub base: u64,
    /// The allocation's length: what the peer may map.
    pub len: u64,
}

/// One accelerator runtime.
pub trait DeviceRuntime: Send + Sync + fmt::Debug + 'static {
    /// The runtime's name (`cuda`, `mlu`, `fakedev`).
    fn name(&self) -> &str;

    /// Number of devices.
    ///
    /// # Errors
    /// The runtime's error.
    fn device_count(&self) -> Result<u32>;

    /// Where `addr` lives: which device, and the allocation around it.
    ///
    /// # Errors
    /// `InvalidRequest` if `addr` is not device memory of this runtime.
    fn pointer_info(&self, addr: u64) -> Result<PointerInfo>;

    /// Allocates `len` bytes on device `ordinal`.
    ///
    /// # Errors
    /// `InvalidRequest` for a bad ordinal; the runtime's error if memory is short.
    fn alloc(&self, ordinal: u32, len: usize) -> Result<u64>;

    /// Frees memory from [`DeviceRuntime::alloc`].
    ///
    /// # Errors
    /// `InvalidRequest` if `addr` is not an allocation's start.
    fn free(&self, ordinal: u32, addr: u64) -> Result<()>;

    /// Allocates `len` bytes of page-locked host memory that copies can use directly.
    ///
    /// # Errors
    /// The runtime's error.
    fn alloc_pinned(&self, len: usize) -> Result<*mut u8>;

    /// Frees memory from [`DeviceRuntime::alloc_pinned`].
    ///
    /// # Safety
    /// `ptr` came from `alloc_pinned(len)` of this runtime and is not used afterwards.
    unsafe fn free_pinned(&self, ptr: *mut u8, len: usize);

    /// Starts a copy; `done` runs exactly once, from a runtime thread, when it completes.
    ///
    /// # Safety
    /// The host range must be valid (readable for `ToDevice`, writable for `ToHost`)
    /// and not accessed by anyone else until `done` runs; the device ranges must lie in
    /// live allocations.
    ///
    /// # Errors
    /// If the copy cannot start; `done` is then not run. `Unsupported` for a kind of
    /// copy the runtime does not do (device to device between two devices).
    unsafe fn copy(&self, copy: DeviceCopy, done: CopyDone) -> Result<()>;

    /// Starts `copies` as one group: the copies of each device and direction are
    /// submitted to that device's queue for the direction with one driver call where
    /// the runtime has one (a batched copy, a list-copy kernel), without waiting, and
    /// `done` runs once, from a runtime thread, when all have completed — one
    /// synchronisation per queue for the group, not one per copy. The first failure is
    /// the group's result, and a failure fails the whole group: the caller must treat
    /// every destination of a failed group as unspecified. Groups are not ordered with
    /// one another, and the copies of one group must not overlap. The default runs each
    /// copy through [`DeviceRuntime::copy`] and counts them in.
    ///
    /// # Safety
    /// As [`DeviceRuntime::copy`], for every copy of the group.
    ///
    /// # Errors
    /// If the first copy cannot start; `done` is then not run. A later copy that
    /// cannot start fails the group through `done`, once the others have completed.
    unsafe fn copy_group(&self, copies: &[DeviceCopy], done: CopyDone) -> Result<()> {
        let Some((first, rest)) = copies.split_first() else {
            done(Ok(()));
            return Ok(());
        };
        let group = Group::new(copies.len(), done);
        let g = group.clone();
        // SAFETY: forwarded from the caller.
        unsafe { self.copy(*first, Box::new(move |r| g.arrive(r)))? };
        for c in rest {
            let g = group.clone();
            // SAFETY: forwarded from the caller.
            if let Err(e) = unsafe { self.copy(*c, Box::new(move |r| g.arrive(r))) } {
                group.arrive(Err(e));
            }
        }
        Ok(())
    }

    /// Runs `copies` as one group, like [`DeviceRuntime::copy_group`], and returns once
    /// they have completed, with the group's result: for a small group whose caller
    /// has nothing else to do meanwhile, so that no runtime thread has to wake the
    /// caller. A runtime that can wait on the calling thread (CUDA: the group's event,
    /// which sleeps in the driver) does; the default waits for `copy_group`'s
    /// completion on a channel.
    ///
    /// # Safety
    /// As [`DeviceRuntime::copy`], for every copy of the group.
    ///
    /// # Errors
    /// The group's error.
    unsafe fn copy_group_wait(&self, copies: &[DeviceCopy]) -> Result<()> {
        // SAFETY: forwarded from the caller, who is blocked here until the group ends.
        waited(|done| unsafe { self.copy_group(copies, done) })
    }

    /// Exports the allocation that holds `addr` so that another process of this host
    /// can map it ([`DeviceRuntime::ipc_import`]): CUDA's IPC memory handle, fakedev's
    /// memfd. The export names the whole allocation (its base and length here).
    ///
    /// # Errors
    /// `Unsupported` where the runtime cannot share memory between processes (the
    /// default), `InvalidRequest` if `addr` is not this runtime's device memory, or the
    /// runtime's error (memory from an allocator whose memory cannot be exported).
    fn ipc_export(&self, addr: u64) -> Result<IpcExport> {
        let _ = addr;
        Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "the {} runtime cannot share memory with another process",
                self.name()
            ),
        ))
    }

    /// Maps, on this process's device `ordinal`, an allocation another process of this
    /// host exported, and returns its base address here (valid for the export's `len`
    /// bytes) until [`DeviceRuntime::ipc_close`]. `fd` is the descriptor that came with
    /// the export, where the runtime's handles are descriptors.
    ///
    /// # Errors
    /// `Unsupported` (the default), `InvalidRequest` for a malformed handle, or the
    /// runtime's error (the exporter is gone, or the handle is not for this device).
    fn ipc_import(
        &self,
        ordinal: u32,
        handle: &[u8],
        fd: Option<std::os::fd::OwnedFd>,
        len: u64,
    ) -> Result<u64> {
        let _ = (ordinal, handle, fd, len);
        Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "the {} runtime cannot map another process's memory",
                self.name()
            ),
        ))
    }

    /// Unmaps what [`DeviceRuntime::ipc_import`] returned. Copies into or out of it must
    /// have completed.
    ///
    /// # Errors
    /// `InvalidRequest` if `addr` is not an imported base; the runtime's error.
    fn ipc_close(&self, addr: u64) -> Result<()> {
        let _ = addr;
        Err(Error::new(
            ErrorKind::Unsupported,
            format!("the {} runtime imports no memory", self.name()),
        ))
    }

    /// A name of device `ordinal` that every process of this host gives the same
    /// device, whatever devices each may see (CUDA: its PCI address, as
    /// `CUDA_VISIBLE_DEVICES` renumbers devices per process); `None` where the runtime
    /// has none.
    fn device_id(&self, ordinal: u32) -> Option<String> {
        let _ = ordinal;
        None
    }

    /// The ordinal by which this process knows the device named `id`
    /// ([`DeviceRuntime::device_id`]); `None` if it does not see that device.
    fn ordinal_of(&self, id: &str) -> Option<u32> {
        let count = self.device_count().unwrap_or(0);
        (0..count).find(|&o| self.device_id(o).as_deref() == Some(id))
    }

    /// What the runtime's copies have cost its devices so far ([`CopyStats`]); zeros
    /// for a runtime that does not count.
    fn stats(&self) -> CopyStats {
        CopyStats::default()
    }

    /// How a group of copies reaches the device, for `te info`: which driver call
    /// carries a group of each direction, and why where it falls back.
    fn copy_path(&self) -> String {
        "one driver call per copy, one synchronisation per group".into()
    }
}

fn dropped() -> Error {
    Error::new(
        ErrorKind::Backend,
        "the device runtime dropped a copy without completing it",
    )
}

/// What the device runtimes started in this process have counted so far, summed
/// ([`DeviceRuntime::stats`]); runtimes not started count nothing and are not started.
pub fn stats() -> CopyStats {
    let started: Vec<Arc<dyn DeviceRuntime>> = INSTANCES
        .lock()
        .as_ref()
        .map(|i| {
            i.values()
                .filter_map(|r| r.as_ref().ok().cloned())
                .collect()
        })
        .unwrap_or_default();
    let mut sum = CopyStats::default();
    for rt in started {
        sum.add(&rt.stats());
    }
    sum
}

/// A countdown over a group of copies: the last to arrive runs `done` with the first
/// error, if any.
pub struct Group {
    left: std::sync::atomic::AtomicUsize,
    error: std::sync::OnceLock<Error>,
    done: Mutex<Option<CopyDone>>,
}

impl fmt::Debug for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Group").field("left", &self.left).finish()
    }
}

impl Group {
    /// A countdown of `n` parts ending in `done`.
    pub fn new(n: usize, done: CopyDone) -> Arc<Group> {
        Arc::new(Group {
            left: std::sync::atomic::AtomicUsize::new(n),
            error: std::sync::OnceLock::new(),
            done: Mutex::new(Some(done)),
        })
    }

    /// One part ended with `r`.
    pub fn arrive(&self, r: Result<()>) {
        if let Err(e) = r {
            let _ = self.error.set(e);
        }
        if self.left.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
            let done = self.done.lock().take();
            if let Some(done) = done {
                done(match self.error.get() {
                    Some(e) => Err(e.clone()),
                    None => Ok(()),
                });
            }
        }
    }
}

impl dyn DeviceRuntime {
    /// Copies and waits until the copy has completed.
    ///
    /// There is no timeout on purpose: until the runtime reports the copy complete it
    /// holds pointers into both ranges, so returning earlier would leave it writing
    /// into memory the caller believes is its own again. Runtimes complete every copy
    /// they accept (a failed copy completes with its error).
    ///
    /// # Safety
    /// As [`DeviceRuntime::copy`].
    ///
    /// # Errors
    /// The copy's error.
    pub unsafe fn copy_sync(&self, copy: DeviceCopy) -> Result<()> {
        // SAFETY: forwarded from the caller, who is blocked here until the copy ends.
        waited(|done| unsafe { self.copy(copy, done) })
    }
}

/// Starts copies with `start`, handing it their completion, and waits for their
/// result on this thread.
fn waited(start: impl FnOnce(CopyDone) -> Result<()>) -> Result<()> {
    let (tx, rx) = mpsc::sync_channel(1);
    start(Box::new(move |r| {
        let _ = tx.send(r);
    }))?;
    rx.recv().unwrap_or_else(|_| Err(dropped()))
}

/// A compiled-in device runtime, submitted by [`register_runtime!`](crate::register_runtime).
#[derive(Debug)]
pub struct RuntimeFactory {
    /// The runtime's name.
    pub name: &'static str,
    /// What it is, for `te info`.
    pub description: &'static str,
    /// Creates the process's instance from its `[runtimes.NAME]` table (empty if the
    /// configuration has none); an error says why the runtime is unavailable.
    pub create: fn(&toml::Table) -> Result<Arc<dyn DeviceRuntime>>,
    /// The driver libraries (sonames) without which no memory of this runtime can
    /// exist in the process: [`owner`] starts a runtime to ask about an address only
    /// if one of them is loaded already. Empty: asked only once started.
    pub loaded_with: &'static [&'static str],
    /// Checks a `[runtimes.NAME]` table without starting the runtime (`te check`),
    /// refusing what `create` would; `None`: a runtime that does not say.
    pub check: Option<fn(&toml::Table) -> Result<()>>,
}

inventory::collect!(RuntimeFactory);

/// Registers a device runtime: `te_core::register_runtime!(NAME, "description", create)`,
/// or with `loaded_with = ["libdriver.so.1"]` (see [`RuntimeFactory::loaded_with`]),
/// and then, optionally, `check = check_fn` (see [`RuntimeFactory::check`]).
#[macro_export]
macro_rules! register_runtime {
    ($name:expr, $description:expr, $create:path) => {
        $crate::register_runtime!($name, $description, $create, loaded_with = []);
    };
    ($name:expr, $description:expr, $create:path, loaded_with = [$($lib:expr),*]) => {
        $crate::__register_runtime!($name, $description, $create, [$($lib),*], None);
    };
    ($name:expr, $description:expr, $create:path, loaded_with = [$($lib:expr),*], check = $check:path) => {
        $crate::__register_runtime!($name, $description, $create, [$($lib),*], Some($check));
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __register_runtime {
    ($name:expr, $description:expr, $create:path, [$($lib:expr),*], $check:expr) => {
        $crate::inventory::submit! {
            $crate::device::RuntimeFactory {
                name: $name,
                description: $description,
                create: $create,
                loaded_with: &[$($lib),*],
                check: $check,
            }
        }
    };
}

/// Checks the `[runtimes.NAME]` table of runtime `name` without starting it, as far as
/// the runtime says how; `None` where no runtime of that name is compiled in (a
/// plugin's may still come).
///
/// # Errors
/// `ConfigInvalid` from the runtime's check, naming the key.
pub fn check_table(name: &str, table: &toml::Table) -> Option<Result<()>> {
    let f = inventory::iter::<RuntimeFactory>().find(|f| f.name == name)?;
    Some(f.check.map_or(Ok(()), |check| check(table)))
}

type Instances = HashMap<&'static str, Result<Arc<dyn DeviceRuntime>>>;
static INSTANCES: Mutex<Option<Instances>> = Mutex::new(None);
static TABLES: Mutex<Option<HashMap<String, toml::Table>>> = Mutex::new(None);

/// Sets the `[runtimes.NAME]` tables runtimes are created with. Runtimes serve the
/// whole process and are created on first use, so a table counts only if it arrives
/// before; a different table for a runtime already running is reported and ignored.
pub fn configure(tables: &std::collections::BTreeMap<String, toml::Table>) {
    // Never both locks at once: `runtime` takes them the other way round.
    let running: Vec<&'static str> = INSTANCES
        .lock()
        .as_ref()
        .map(|i| i.keys().copied().collect())
        .unwrap_or_default();
    let mut t = TABLES.lock();
    let t = t.get_or_insert_with(HashMap::new);
    for (name, table) in tables {
        let started = running.contains(&name.as_str());
        if started && t.get(name) != Some(table) {
            tracing::warn!(runtime = %name, "the runtime already runs with another [runtimes] table; this one is ignored (runtimes serve the whole process)");
            continue;
        }
        t.insert(name.clone(), table.clone());
    }
}

/// The process's instance of runtime `name`, created on first use.
///
/// # Errors
/// `Unsupported` for an unknown name (listing the known ones); `Unavailable` with the
/// reason if the runtime cannot run here.
pub fn runtime(name: &str) -> Result<Arc<dyn DeviceRuntime>> {
    let Some(f) = inventory::iter::<RuntimeFactory>().find(|f| f.name == name) else {
        let mut known: Vec<&str> = inventory::iter::<RuntimeFactory>()
            .map(|f| f.name)
            .collect();
        known.sort_unstable();
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "no device runtime named `{name}` in this build; known: host, {}",
                known.join(", ")
            ),
        ));
    };
    let mut instances = INSTANCES.lock();
    instances
        .get_or_insert_with(HashMap::new)
        .entry(f.name)
        .or_insert_with(|| {
            let table = TABLES
                .lock()
                .as_ref()
                .and_then(|t| t.get(f.name).cloned())
                .unwrap_or_default();
            std::panic::catch_unwind(|| (f.create)(&table)).unwrap_or_else(|_| {
                Err(Error::new(
                    ErrorKind::Unavailable,
                    format!("the {name} runtime panicked while starting"),
                ))
            })
        })
        .clone()
}

/// The runtime and device of memory of `kind`: `None` for host memory.
///
/// # Errors
/// As [`runtime`]; `InvalidRequest` for `auto`, which only a registration resolves (a
/// backend never sees it).
pub fn of(kind: &MemoryKind) -> Result<Option<(Arc<dyn DeviceRuntime>, u32)>> {
    match kind {
        MemoryKind::Host => Ok(None),
        MemoryKind::Device {
            runtime: name,
            ordinal,
        } => Ok(Some((runtime(name)?, *ordinal))),
        MemoryKind::Auto => Err(unresolved()),
    }
}

/// The error for memory still named `auto` where a registration should have resolved it.
pub fn unresolved() -> Error {
    Error::new(
        ErrorKind::InvalidRequest,
        "memory of kind `auto` reached a backend unresolved; the engine resolves it when registering",
    )
}

/// The device runtime that owns `addr`, and where: asked of every runtime compiled in
/// that runs in this process, in name order. A runtime not started yet is started to
/// ask only if its driver library is loaded (by te or by anyone else, such as PyTorch):
/// without it no memory of that runtime can exist, and a process that uses none pays
/// nothing (no driver loaded, no device context made). `None`: no runtime claims it,
/// so it is host memory as far as te can tell.
pub fn owner(addr: u64) -> Option<(&'static str, PointerInfo)> {
    let mut factories: Vec<&RuntimeFactory> = inventory::iter::<RuntimeFactory>().collect();
    factories.sort_unstable_by_key(|f| f.name);
    factories.into_iter().find_map(|f| {
        let started = INSTANCES
            .lock()
            .as_ref()
            .is_some_and(|i| i.contains_key(f.name));
        if !started && !f.loaded_with.iter().any(|lib| loaded(lib)) {
            return None;
        }
        let info = runtime(f.name).ok()?.pointer_info(addr).ok()?;
        Some((f.name, info))
    })
}

/// Whether the shared library `soname` is loaded in this process (it is not loaded
/// by asking).
fn loaded(soname: &str) -> bool {
    let Ok(name) = std::ffi::CString::new(soname) else {
        return false;
    };
    // SAFETY: `name` is a valid C string; RTLD_NOLOAD only looks the library up.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return false;
    }
    // SAFETY: `handle` came from the successful dlopen above, which took a reference.
    unsafe { libc::dlclose(handle) };
    true
}

/// Every runtime compiled in, with its description and whether it can run here.
pub fn runtimes() -> Vec<(&'static str, &'static str, Result<()>)> {
    let mut all: Vec<_> = inventory::iter::<RuntimeFactory>()
        .map(|f| (f.name, f.description, runtime(f.name).map(|_| ())))
        .collect();
    all.sort_by_key(|r| r.0);
    all
}
