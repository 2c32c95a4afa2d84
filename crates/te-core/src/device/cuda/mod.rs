//! The `cuda` device runtime, on the CUDA driver API through cudarc with dynamic
//! loading: nothing of CUDA is needed to build, and `libcuda.so` is looked for only
//! when the runtime is first used.
//!
//! Bindings: cudarc's `cuda-12080` feature. Symbols are resolved one by one on first
//! call, so any driver that exports the few te uses (`cuInit`, `cuDeviceGet*`,
//! `cuDevicePrimaryCtxRetain`, `cuCtxPushCurrent`, `cuMemAlloc_v2`, `cuMemFree_v2`,
//! `cuMemHostAlloc`, `cuMemFreeHost`, `cuMemcpy*Async`, `cuModuleLoadData`,
//! `cuLaunchKernel`, `cuPointerGetAttribute`, `cuMemGetAddressRange_v2`, and for
//! sharing memory `cuIpcGetMemHandle`, `cuIpcOpenMemHandle_v2`, `cuIpcCloseMemHandle`,
//! and for VMM allocations `cuMemRetainAllocationHandle`, `cuMemExportToShareableHandle`,
//! `cuMemImportFromShareableHandle`, `cuMemAddressReserve`, `cuMemMap`,
//! `cuMemSetAccess`, `cuMemUnmap`, `cuMemAddressFree`, `cuMemRelease`) works: CUDA 12
//! drivers do. `cuMemcpyBatchAsync` (CUDA 12.8) is looked up by te itself when the
//! runtime starts, so an older driver falls back instead of failing (`te info` says
//! which).
//!
//! The library's presence is probed before any call (cudarc panics where it is
//! missing), and every driver call runs under `catch_unwind`, so a missing driver or
//! symbol is an `Unavailable` error, never a panic.
//!
//! Copies are asynchronous and submitted in groups. Each device has a stream per
//! direction (host → device, device → host, device → device); the caller's thread
//! submits a group's copies of one direction with one driver call where it can:
//!
//! - **device → device on one GPU**: te's list-copy kernel (`copy_list.ptx`, loaded
//!   with `cuModuleLoadData` on the device's first use, JIT-compiled by the driver), one
//!   launch over a table of (source, destination, length) in mapped pinned memory;
//! - **device → host and host → device, host ranges packed end to end** (te-tcp's
//!   staging): the same kernel gathers the device ranges into a device buffer of the
//!   stream's, then one copy moves it to the host (or one copy and a scatter the other
//!   way): two calls, whatever the number of ranges;
//! - **other host ↔ device groups**: one `cuMemcpyBatchAsync`, or, where the driver
//!   lacks it, a loop of `cuMemcpy*Async`;
//! - between two GPUs: a loop of `cuMemcpyPeerAsync`.
//!
//! One event (`CU_EVENT_BLOCKING_SYNC`) is recorded after the group's calls. A waiter
//! thread per stream blocks in `cuEventSynchronize` — the driver puts it to sleep,
//! nothing spins — and runs the group's completion; or, for
//! [`DeviceRuntime::copy_group_wait`], the calling thread waits for the event itself,
//! which saves the waiter's wake-up and the one it would give the caller. So a group
//! costs one synchronisation, and the two directions never wait for each other.
//!
//! Contexts: a device's primary context (and its streams, waiters, kernel and device
//! buffers) is set up the first time te uses that device, not when the runtime starts,
//! so `te info` or an engine that never touches a GPU retains none; and every driver
//! call pushes it and pops it again (`cuCtxPushCurrent` / `cuCtxPopCurrent`), so the
//! calling thread's current context — a framework's own — is the same after the call
//! as before.
//!
//! Sharing with another process of the host: [`DeviceRuntime::ipc_export`] gives the
//! legacy IPC memory handle (`cuIpcGetMemHandle`, 64 bytes) of the allocation around an
//! address, and [`DeviceRuntime::ipc_import`] opens one in a device's primary context
//! (`cuIpcOpenMemHandle_v2`, peer access enabled lazily) until
//! [`DeviceRuntime::ipc_close`]. The driver's rules hold: only `cuMemAlloc`-style
//! allocations have such handles; a process cannot open its own handles; opening a
//! handle twice in one context gives the same address (te counts the opens, and each
//! needs its close); and the exporter must not free the memory before the importer has
//! closed it. Where legacy IPC refuses an allocation, te tries the VMM path (`vmm`):
//! an allocation from `cuMemCreate` created exportable as a POSIX descriptor travels as
//! that descriptor (an empty handle with the descriptor beside it), and the importer
//! maps it into an address range of its own (`cuMemImportFromShareableHandle`,
//! `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`) until `ipc_close` unmaps it.
//! Memory-pool memory (`cudaMallocAsync`) is shared by neither. Imported memory is
//! device memory of the importing device like any other: the copy paths take its
//! address as they are.
//!
//! Options (`[runtimes.cuda]`): `batch_call = true` (false: a loop of single copies even
//! where the driver has the batched call), `kernel = true` (false: no list-copy kernel,
//! so device-to-device groups go through the batched call and nothing is gathered),
//! `gather = true` (false: packed host ranges go through the batched call too). The
//! switches exist to compare the paths on a GPU (`scripts/gpu-bench.sh`). `vmm = false`
//! (true: the memory te allocates itself — `te bench`, `te serve`, the Python
//! `alloc` helpers — comes from `cuMemCreate`, exportable as a descriptor, as
//! PyTorch's expandable segments make it; to exercise the VMM path).

use crate::signals::SpawnMasked as _;
use crate::sync::Mutex;
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys};
use serde::Deserialize;

use crate::device::{
    CopyCounters, CopyDone, CopyStats, DeviceCopy, DeviceRuntime, Group, IpcExport, PointerInfo,
};
use crate::error::{Error, ErrorKind, Result};

mod batch;
mod kernel;
mod vmm;

use batch::BatchCall;
use kernel::{Kernel, Table};

/// The runtime's name.
pub const NAME: &str = "cuda";

/// The `[runtimes.cuda]` table: which of the batched paths to use (all, by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CudaConfig {
    /// Submit a host ↔ device group with one `cuMemcpyBatchAsync` where the driver has
    /// it; false: a loop of single copies.
    pub batch_call: bool,
    /// Load te's list-copy kernel for device-to-device groups and gathered staging.
    pub kernel: bool,
    /// Gather (scatter) a group whose host ranges are packed end to end through a
    /// device buffer with the kernel and one copy.
    pub gather: bool,
    /// Allocate te's own device memory with `cuMemCreate` (exportable as a POSIX
    /// descriptor, as PyTorch's expandable segments do) instead of `cuMemAlloc`.
    pub vmm: bool,
}

impl Default for CudaConfig {
    fn default() -> Self {
        CudaConfig {
            batch_call: true,
            kernel: true,
            gather: true,
            vmm: false,
        }
    }
}

/// Bytes of each device's gather buffer per direction: a group of packed host ranges
/// larger than this goes through the batched call instead.
const GATHER_BYTES: usize = 8 << 20;

/// A driver handle (context, stream, event); these are process-wide and usable from
/// any thread.
#[derive(Debug, Clone, Copy)]
struct Handle<T>(T);

// SAFETY: CUDA contexts, streams and events may be used from any thread; the handles
// are only passed to the driver.
unsafe impl<T> Send for Handle<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Handle<T> {}

type Ctx = Handle<sys::CUcontext>;

/// A group's part on one stream, waiting for its event.
struct Waiting {
    event: Handle<sys::CUevent>,
    /// The first error met while enqueueing (the copies before it still run).
    error: Option<Error>,
    /// The kernel's table, given back once the event has completed.
    table: Option<Table>,
    done: CopyDone,
}

impl std::fmt::Debug for Waiting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Waiting")
    }
}

/// One device, set up on first use: its context, a stream per direction, a waiter
/// thread per stream, and where loaded the list-copy kernel with its gather buffers.
#[derive(Debug)]
struct Device {
    ordinal: u32,
    ctx: Ctx,
    streams: [Handle<sys::CUstream>; 3],
    waiters: [Mutex<Sender<Waiting>>; 3],
    events: Arc<Mutex<Vec<Handle<sys::CUevent>>>>,
    kernel: Option<Kernel>,
    /// Device buffers for gathered device → host (index 1) and scattered host → device
    /// (index 0) groups; each used only on its direction's stream, so in stream order.
    scratch: [Option<Scratch>; 2],
}

/// A gather buffer and the lock that keeps a group's two calls on it together: the
/// stream runs them in the order they were enqueued, so two threads enqueueing groups
/// at once must not interleave (one group's copy would move the other's bytes).
#[derive(Debug)]
struct Scratch {
    buf: u64,
    enqueue: Mutex<()>,
}

/// The CUDA runtime.
#[derive(Debug)]
pub struct Cuda {
    devices: Vec<OnceLock<std::result::Result<Arc<Device>, Error>>>,
    config: CudaConfig,
    /// `cuMemcpyBatchAsync` where the driver has it and `batch_call` is on; cleared if
    /// the driver refuses a valid group (see `Cuda::batched`).
    batch: Option<BatchCall>,
    batch_refused: AtomicBool,
    /// Why the kernel did not load on a device, if it did not.
    kernel_problem: Mutex<Option<String>>,
    counters: CopyCounters,
    /// Memory opened with `ipc_import`, by its address here.
    imports: Mutex<HashMap<u64, Import>>,
    /// Memory `alloc` made with `cuMemCreate` (`vmm = true`): its length.
    vmm_allocs: Mutex<HashMap<u64, usize>>,
}

/// A peer's allocation opened here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Import {
    ordinal: u32,
    /// Opens not closed yet: the driver gives a legacy handle's second open the same
    /// address.
    opens: usize,
    /// A VMM allocation's mapping (opened once per import).
    mapped: Option<vmm::Mapped>,
}

/// Runs `f` with `ctx` current on this thread, and restores what was current before.
fn with_ctx<T>(ctx: Ctx, f: impl FnOnce() -> Result<T>) -> Result<T> {
    // SAFETY: a primary context retained when its device was set up, never released.
    driver("push context", || unsafe {
        sys::cuCtxPushCurrent_v2(ctx.0).result()
    })?;
    let out = f();
    let mut popped: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: pops the context pushed above; `popped` is a valid out-parameter.
    if let Err(e) = driver("pop context", || unsafe {
        sys::cuCtxPopCurrent_v2(&mut popped).result()
    }) {
        tracing::warn!(error = %e, "restoring the caller's CUDA context failed");
    }
    out
}

impl Device {
    fn start(
        ordinal: u32,
        config: CudaConfig,
        problem: &Mutex<Option<String>>,
    ) -> Result<Arc<Device>> {
        let dev = driver("get device", || result::device::get(ordinal as i32))?;
        // SAFETY: `dev` is a valid device handle from the driver.
        let ctx = Handle(driver("retain primary context", || unsafe {
            result::primary_ctx::retain(dev)
        })?);
        let streams = with_ctx(ctx, || {
            let mut out = [Handle(std::ptr::null_mut()); 3];
            for s in &mut out {
                // SAFETY: a context is current; `s.0` is a valid out-parameter.
                // 1 = CU_STREAM_NON_BLOCKING: no implicit sync with the legacy stream.
                driver("create stream", || unsafe {
                    sys::cuStreamCreate(&mut s.0, 1).result()
                })?;
            }
            Ok(out)
        })?;
        // The kernel and its buffers are an optimisation: without them, groups take
        // the batched call (or the loop), and `te info` says why.
        let kernel = if config.kernel {
            match with_ctx(ctx, || Kernel::load(ordinal)) {
                Ok(k) => Some(k),
                Err(e) => {
                    tracing::warn!(cuda = ordinal, error = %e, "te's list-copy kernel did not load; device-to-device groups use the batched call");
                    *problem.lock() = Some(format!("cuda:{ordinal}: {e}"));
                    None
                }
            }
        } else {
            None
        };
        let mut scratch = [None, None];
        if kernel.is_some() && config.gather {
            for s in &mut scratch {
                // SAFETY: a context is current inside `with_ctx`.
                match with_ctx(ctx, || {
                    driver("allocate a gather buffer", || unsafe {
                        result::malloc_sync(GATHER_BYTES)
                    })
                }) {
                    Ok(buf) => {
                        *s = Some(Scratch {
                            buf,
                            enqueue: Mutex::new(()),
                        })
                    }
                    Err(e) => {
                        tracing::warn!(cuda = ordinal, error = %e, "no gather buffer: packed staging uses the batched call");
                    }
                }
            }
        }
        let events = Arc::new(Mutex::new(Vec::new()));
        let tables = kernel.as_ref().map(Kernel::tables);
        let mut waiters = Vec::new();
        for dir in 0..3 {
            let (tx, rx) = mpsc::channel::<Waiting>();
            let pool = events.clone();
            let tables = tables.clone();
            std::thread::Builder::new()
                .name(format!("te-cuda-{ordinal}-{dir}"))
                .spawn_masked(move || wait_loop(ctx, rx, &pool, tables.as_deref()))
                .map_err(|e| {
                    Error::new(ErrorKind::Io, "cannot start a CUDA waiter thread").with_source(e)
                })?;
            waiters.push(Mutex::new(tx));
        }
        let waiters: [Mutex<Sender<Waiting>>; 3] = waiters
            .try_into()
            .map_err(|_| Error::new(ErrorKind::Backend, "three waiters"))?;
        Ok(Arc::new(Device {
            ordinal,
            ctx,
            streams,
            waiters,
            events,
            kernel,
            scratch,
        }))
    }

    /// An event from the pool, or a new one (with a context current).
    fn event(&self) -> Result<Handle<sys::CUevent>> {
        if let Some(e) = self.events.lock().pop() {
            return Ok(e);
        }
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: a context is current; `ev` is a valid out-parameter. 1 | 2 =
        // CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING: a waiter sleeps, and no
        // timing is recorded.
        driver("create event", || unsafe {
            sys::cuEventCreate(&mut ev, 1 | 2).result()
        })?;
        Ok(Handle(ev))
    }
}

/// Waits for `event` (with its device's context current, sleeping in the driver).
fn synchronize(ctx: Ctx, event: Handle<sys::CUevent>) -> Result<()> {
    with_ctx(ctx, || {
        // SAFETY: an event recorded on this device's stream and not yet reused.
        driver("wait for copies", || unsafe {
            sys::cuEventSynchronize(event.0).result()
        })
    })
}

/// A waiter thread: sleeps in the driver until each group's event, then completes it.
fn wait_loop(
    ctx: Ctx,
    rx: mpsc::Receiver<Waiting>,
    pool: &Mutex<Vec<Handle<sys::CUevent>>>,
    tables: Option<&Mutex<Vec<Table>>>,
) {
    for w in rx {
        let r = synchronize(ctx, w.event);
        pool.lock().push(w.event);
        if let (Some(t), Some(tables)) = (w.table, tables) {
            tables.lock().push(t);
        }
        (w.done)(match w.error {
            Some(e) => Err(e),
            None => r,
        });
    }
}

fn driver<T>(
    what: &str,
    f: impl FnOnce() -> std::result::Result<T, result::DriverError>,
) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Error::new(
            ErrorKind::Backend,
            format!("CUDA {what} failed: {e}"),
        )),
        Err(_) => Err(Error::new(
            ErrorKind::Unavailable,
            format!("CUDA {what}: the driver library lacks a symbol te needs (driver too old?)"),
        )),
    }
}

/// The configuration a `[runtimes.cuda]` table gives.
fn config(table: &toml::Table) -> Result<CudaConfig> {
    CudaConfig::deserialize(table.clone()).map_err(|e| {
        Error::new(
            ErrorKind::ConfigInvalid,
            format!("[runtimes.cuda]: {}", e.message()),
        )
    })
}

fn check(table: &toml::Table) -> Result<()> {
    config(table).map(drop)
}

fn create(table: &toml::Table) -> Result<Arc<dyn DeviceRuntime>> {
    let config = config(table)?;
    // SAFETY: only tries to open the library by its usual names.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::new(
            ErrorKind::Unavailable,
            "libcuda.so not found: no NVIDIA driver on this machine (or it is not on the library path)",
        ));
    }
    driver("init", result::init)?;
    let count = driver("device count", result::device::get_count)?;
    if count <= 0 {
        return Err(Error::new(
            ErrorKind::Unavailable,
            "the NVIDIA driver reports no CUDA devices",
        ));
    }
    let batch = if config.batch_call {
        BatchCall::find()
    } else {
        None
    };
    Ok(Arc::new(Cuda {
        devices: (0..count).map(|_| OnceLock::new()).collect(),
        config,
        batch,
        batch_refused: AtomicBool::new(false),
        kernel_problem: Mutex::new(None),
        counters: CopyCounters::default(),
        imports: Mutex::new(HashMap::new()),
        vmm_allocs: Mutex::new(HashMap::new()),
    }))
}

/// The error of driver call `what` that returned `code`.
fn failed(what: &str, code: sys::CUresult) -> Error {
    Error::new(ErrorKind::Backend, format!("CUDA {what} failed: {code:?}"))
}

/// A 32-bit pointer attribute of `addr` (memory type, managed flag, device ordinal),
/// or `None` where the driver has none to give (not CUDA memory).
fn attribute(addr: u64, attr: sys::CUpointer_attribute) -> Option<i32> {
    let mut v: i32 = -1;
    // SAFETY: `v` is a valid out-parameter of the 4 bytes these attributes write.
    let r = driver("pointer attribute", || unsafe {
        sys::cuPointerGetAttribute((&mut v as *mut i32).cast(), attr, addr).result()
    });
    r.ok().map(|()| v)
}

crate::register_runtime!(
    NAME,
    "NVIDIA GPUs through the CUDA driver (loaded at run time)",
    create,
    loaded_with = ["libcuda.so.1", "libcuda.so"],
    check = check
);

/// A group's copies of one device (set up) and direction.
type Part = (Arc<Device>, usize, Vec<DeviceCopy>);

/// One (source, destination, length) of a group, as the driver takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Range {
    src: u64,
    dst: u64,
    len: usize,
}

fn range(c: &DeviceCopy) -> Range {
    match *c {
        DeviceCopy::ToDevice {
            device, host, len, ..
        } => Range {
            src: host as u64,
            dst: device,
            len,
        },
        DeviceCopy::ToHost {
            device, host, len, ..
        } => Range {
            src: device,
            dst: host as u64,
            len,
        },
        DeviceCopy::DeviceToDevice { src, dst, len, .. } => Range { src, dst, len },
    }
}

/// Whether the host ends of `ranges` (`dst` where `to_host`, else `src`) follow one
/// another end to end, as staging packs them: then one copy moves them all.
fn packed(ranges: &[Range], to_host: bool) -> bool {
    let host = |r: &Range| if to_host { r.dst } else { r.src };
    ranges
        .windows(2)
        .all(|w| host(&w[0]).checked_add(w[0].len as u64) == Some(host(&w[1])))
}

impl Cuda {
    /// Device `ordinal`, set up on first use.
    fn device(&self, ordinal: u32) -> Result<Arc<Device>> {
        let slot = self.devices.get(ordinal as usize).ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidRequest,
                format!(
                    "there is no cuda:{ordinal} (this machine has {} devices)",
                    self.devices.len()
                ),
            )
        })?;
        slot.get_or_init(|| Device::start(ordinal, self.config, &self.kernel_problem))
            .clone()
    }

    /// Runs `f` with device `ordinal`'s context current, restoring the caller's.
    fn with<T>(&self, ordinal: u32, f: impl FnOnce() -> Result<T>) -> Result<T> {
        with_ctx(self.device(ordinal)?.ctx, f)
    }

    /// The batched call, unless the driver lacks it or refused it.
    fn batched(&self) -> Option<&BatchCall> {
        self.batch
            .as_ref()
            .filter(|_| !self.batch_refused.load(Ordering::Relaxed))
    }

    /// Enqueues one part of a group (copies of one device and direction) on its stream
    /// and records an event after it: the event, the first error, and the kernel table
    /// to give back once the event has completed.
    ///
    /// # Safety
    /// As [`DeviceRuntime::copy`], for every copy.
    unsafe fn enqueue(
        &self,
        dev: &Device,
        dir: usize,
        copies: &[DeviceCopy],
    ) -> Result<(Handle<sys::CUevent>, Option<Error>, Option<Table>)> {
        let stream = dev.streams[dir];
        with_ctx(dev.ctx, || {
            // SAFETY: forwarded from the caller.
            let (table, error) = unsafe { self.submit(dev, dir, copies, stream) };
            let event = match dev.event() {
                Ok(e) => e,
                Err(e) => {
                    self.drain(stream);
                    if let (Some(t), Some(k)) = (table, &dev.kernel) {
                        k.give_back(t);
                    }
                    return Err(e);
                }
            };
            // SAFETY: a context is current; the event and stream are this device's.
            if let Err(e) = driver("record event", || unsafe {
                sys::cuEventRecord(event.0, stream.0).result()
            }) {
                self.drain(stream);
                Cuda::release(dev, event, table);
                return Err(e);
            }
            Ok((event, error, table))
        })
    }

    /// Waits for everything on `stream` (its context current): where no event could
    /// be recorded, so that nothing enqueued still touches the memory when the group
    /// is reported done.
    fn drain(&self, stream: Handle<sys::CUstream>) {
        // SAFETY: a context is current; the stream is this device's.
        let _ = driver("wait for the stream", || unsafe {
            sys::cuStreamSynchronize(stream.0).result()
        });
        self.counters.sync();
    }

    /// Submits one part with as few driver calls as its shape allows (see the module
    /// docs); returns the kernel table in use, if any, and the first error.
    ///
    /// # Safety
    /// As [`DeviceRuntime::copy`], for every copy; `dev`'s context is current.
    unsafe fn submit(
        &self,
        dev: &Device,
        dir: usize,
        copies: &[DeviceCopy],
        stream: Handle<sys::CUstream>,
    ) -> (Option<Table>, Option<Error>) {
        let ranges: Vec<Range> = copies.iter().map(range).collect();
        let total: usize = ranges.iter().map(|r| r.len).sum();
        let one_device = copies.iter().all(|c| match *c {
            DeviceCopy::DeviceToDevice {
                src_ordinal,
                dst_ordinal,
                ..
            } => src_ordinal == dst_ordinal,
            _ => true,
        });
        if ranges.len() == 1 || !one_device {
            // SAFETY: forwarded from the caller.
            return (None, unsafe { self.each(copies, stream) }.err());
        }
        if let Some(k) = &dev.kernel {
            if dir == 2 {
                // SAFETY: forwarded from the caller; the ranges are on this device.
                let r = unsafe { k.launch(&ranges, stream.0) };
                return self.launched(r, copies, stream);
            }
            let scratch = dev.scratch[dir].as_ref();
            if let Some(s) = scratch.filter(|_| total <= GATHER_BYTES && packed(&ranges, dir == 1))
            {
                let _together = s.enqueue.lock();
                // SAFETY: forwarded from the caller; `s.buf` is this direction's gather
                // buffer, used on this stream only, and the lock keeps this group's
                // calls on it next to each other in the stream's order.
                return unsafe { self.gathered(k, s.buf, dir, &ranges, total, stream) };
            }
        }
        if let Some(b) = self.batched() {
            // SAFETY: forwarded from the caller.
            match unsafe { b.call(&ranges, dir, dev.ordinal, stream.0) } {
                Ok(()) => {
                    self.counters.call(ranges.len(), total as u64);
                    return (None, None);
                }
                Err(e) => {
                    // A driver that refuses a group the loop then moves lacks a working
                    // batched call: stop using it, and say so once.
                    // SAFETY: forwarded from the caller.
                    let r = unsafe { self.each(copies, stream) };
                    if r.is_ok() && !self.batch_refused.swap(true, Ordering::Relaxed) {
                        tracing::warn!(error = %e, "cuMemcpyBatchAsync refused a group that single copies moved; te uses single copies from now on");
                    }
                    return (None, r.err());
                }
            }
        }
        // SAFETY: forwarded from the caller.
        (None, unsafe { self.each(copies, stream) }.err())
    }

    /// The kernel's launch result as `submit` returns it: a launch that failed before
    /// enqueueing anything falls back to the batched call or the loop.
    fn launched(
        &self,
        r: std::result::Result<Table, (Option<Table>, Error)>,
        copies: &[DeviceCopy],
        stream: Handle<sys::CUstream>,
    ) -> (Option<Table>, Option<Error>) {
        match r {
            Ok(t) => {
                self.counters
                    .call(copies.len(), copies.iter().map(|c| c.len() as u64).sum());
                (Some(t), None)
            }
            Err((table, e)) => {
                tracing::debug!(error = %e, "the list-copy kernel did not launch; copying one by one");
                // SAFETY: the caller of `submit` guarantees the copies.
                (table, unsafe { self.each(copies, stream) }.err())
            }
        }
    }

    /// A packed group through the gather buffer: device → host gathers the device
    /// ranges into `buf` with the kernel and copies `buf` to the host in one copy;
    /// host → device copies the host bytes into `buf` and scatters them with the kernel.
    ///
    /// # Safety
    /// As [`DeviceRuntime::copy`]; `buf` holds `total` bytes and is used only on
    /// `stream`.
    unsafe fn gathered(
        &self,
        k: &Kernel,
        buf: u64,
        dir: usize,
        ranges: &[Range],
        total: usize,
        stream: Handle<sys::CUstream>,
    ) -> (Option<Table>, Option<Error>) {
        let to_host = dir == 1;
        let mut at = buf;
        let inner: Vec<Range> = ranges
            .iter()
            .map(|r| {
                let piece = at;
                at += r.len as u64;
                if to_host {
                    Range {
                        src: r.src,
                        dst: piece,
                        len: r.len,
                    }
                } else {
                    Range {
                        src: piece,
                        dst: r.dst,
                        len: r.len,
                    }
                }
            })
            .collect();
        let host = if to_host {
            ranges[0].dst
        } else {
            ranges[0].src
        };
        let whole = || {
            // SAFETY: the host range is the group's packed host ranges, valid per the
            // caller; `buf` holds `total` bytes.
            if to_host {
                driver("copy the gathered bytes to the host", || unsafe {
                    sys::cuMemcpyDtoHAsync_v2(host as *mut _, buf, total, stream.0).result()
                })
            } else {
                driver("copy the packed bytes to the device", || unsafe {
                    sys::cuMemcpyHtoDAsync_v2(buf, host as *const _, total, stream.0).result()
                })
            }
        };
        if !to_host {
            if let Err(e) = whole() {
                return (None, Some(e));
            }
            self.counters.call(1, total as u64);
        }
        // SAFETY: every range lies in `buf` or in device memory the caller guarantees.
        let table = match unsafe { k.launch(&inner, stream.0) } {
            Ok(t) => {
                self.counters.call(inner.len(), total as u64);
                t
            }
            Err((t, e)) => return (t, Some(e)),
        };
        if to_host {
            if let Err(e) = whole() {
                return (Some(table), Some(e));
            }
            self.counters.call(1, total as u64);
        }
        (Some(table), None)
    }

    /// Enqueues each copy with its own call (its device's context current).
    ///
    /// # Safety
    /// As [`DeviceRuntime::copy`].
    unsafe fn each(&self, copies: &[DeviceCopy], stream: Handle<sys::CUstream>) -> Result<()> {
        for c in copies {
            // SAFETY: forwarded from the caller.
            unsafe { self.start_copy(*c, stream) }?;
            self.counters.call(1, c.len() as u64);
        }
        Ok(())
    }

    /// Enqueues one copy on `stream` (its device's context current).
    ///
    /// # Safety
    /// As [`DeviceRuntime::copy`].
    unsafe fn start_copy(&self, c: DeviceCopy, stream: Handle<sys::CUstream>) -> Result<()> {
        match c {
            // SAFETY (all arms): the caller guarantees the ranges until the group's
            // event has completed, which is when `done` runs.
            DeviceCopy::ToDevice {
                device, host, len, ..
            } => driver("copy to device", || unsafe {
                sys::cuMemcpyHtoDAsync_v2(device, host.cast(), len, stream.0).result()
            }),
            DeviceCopy::ToHost {
                device, host, len, ..
            } => driver("copy to host", || unsafe {
                sys::cuMemcpyDtoHAsync_v2(host.cast(), device, len, stream.0).result()
            }),
            DeviceCopy::DeviceToDevice {
                src_ordinal,
                src,
                dst_ordinal,
                dst,
                len,
            } if src_ordinal == dst_ordinal => driver("copy on the device", || unsafe {
                sys::cuMemcpyDtoDAsync_v2(dst, src, len, stream.0).result()
            }),
            DeviceCopy::DeviceToDevice {
                src_ordinal,
                src,
                dst_ordinal,
                dst,
                len,
            } => {
                let (sctx, dctx) = (self.device(src_ordinal)?.ctx, self.device(dst_ordinal)?.ctx);
                driver("copy between devices", || unsafe {
                    sys::cuMemcpyPeerAsync(dst, dctx.0, src, sctx.0, len, stream.0).result()
                })
            }
        }
    }

    /// A group's parts: one per device and direction, with the device set up.
    fn parts(&self, copies: &[DeviceCopy]) -> Result<Vec<Part>> {
        let mut parts: Vec<Part> = Vec::new();
        for c in copies {
            let (ordinal, dir) = c.queue();
            match parts
                .iter_mut()
                .find(|p| p.0.ordinal == ordinal && p.1 == dir)
            {
                Some(p) => p.2.push(*c),
                None => parts.push((self.device(ordinal)?, dir, vec![*c])),
            }
        }
        Ok(parts)
    }

    /// Gives a part's event and table back to their device's pools.
    fn release(dev: &Device, event: Handle<sys::CUevent>, table: Option<Table>) {
        dev.events.lock().push(event);
        if let (Some(t), Some(k)) = (table, &dev.kernel) {
            k.give_back(t);
        }
    }
}

impl DeviceRuntime for Cuda {
    fn name(&self) -> &str {
        NAME
    }

    fn device_count(&self) -> Result<u32> {
        Ok(self.devices.len() as u32)
    }

    fn pointer_info(&self, addr: u64) -> Result<PointerInfo> {
        let not_cuda = || {
            Error::new(
                ErrorKind::InvalidRequest,
                format!("{addr:#x} is not CUDA device memory"),
            )
        };
        let ordinal = self.with(0, || {
            // Device memory only: pinned or registered host memory also has an ordinal
            // (its context's), and managed memory is host-accessible; both are host
            // memory to te.
            use sys::CUpointer_attribute as A;
            let kind = attribute(addr, A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE);
            let managed = attribute(addr, A::CU_POINTER_ATTRIBUTE_IS_MANAGED);
            let ordinal = attribute(addr, A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL);
            match (kind, managed, ordinal) {
                (Some(k), Some(0), Some(o))
                    if k == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as i32 && o >= 0 =>
                {
                    Ok(o as u32)
                }
                _ => Err(not_cuda()),
            }
        })?;
        self.with(ordinal, || {
            let (mut base, mut len) = (0, 0usize);
            // SAFETY: valid out-parameters.
            driver("address range", || unsafe {
                sys::cuMemGetAddressRange_v2(&mut base, &mut len, addr).result()
            })?;
            Ok(PointerInfo {
                ordinal,
                base,
                len: len as u64,
            })
        })
    }

    fn alloc(&self, ordinal: u32, len: usize) -> Result<u64> {
        if self.config.vmm {
            let (addr, len) = self.with(ordinal, || vmm::alloc(ordinal, len))?;
            self.vmm_allocs.lock().insert(addr, len);
            return Ok(addr);
        }
        // SAFETY: a context is current inside `with`.
        self.with(ordinal, || {
            driver("allocate", || unsafe { result::malloc_sync(len) })
        })
    }

    fn free(&self, ordinal: u32, addr: u64) -> Result<()> {
        if self.imports.lock().contains_key(&addr) {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                format!("{addr:#x} is CUDA memory imported from another process: close it with ipc_close, not free"),
            ));
        }
        let made = self.vmm_allocs.lock().remove(&addr);
        if let Some(len) = made {
            return self.with(ordinal, || vmm::free(addr, len));
        }
        // SAFETY: the caller passes an address from `alloc`.
        self.with(ordinal, || {
            driver("free", || unsafe { result::free_sync(addr) })
        })
    }

    fn alloc_pinned(&self, len: usize) -> Result<*mut u8> {
        self.with(0, || {
            // SAFETY: a context is current; 1 = CU_MEMHOSTALLOC_PORTABLE, so every
            // context sees the memory as pinned.
            driver("allocate pinned memory", || unsafe {
                result::malloc_host(len, 1)
            })
            .map(|p| p.cast())
        })
    }

    unsafe fn free_pinned(&self, ptr: *mut u8, _len: usize) {
        let r = self.with(0, || {
            // SAFETY: the caller passes a pointer from `alloc_pinned`.
            driver("free pinned memory", || unsafe {
                result::free_host(ptr.cast())
            })
        });
        if let Err(e) = r {
            tracing::warn!(error = %e, "freeing pinned memory failed");
        }
    }

    fn device_id(&self, ordinal: u32) -> Option<String> {
        self.device(ordinal).ok()?;
        driver("read a device's PCI address", || {
            let dev = result::device::get(ordinal as i32)?;
            use sys::CUdevice_attribute as A;
            // SAFETY: a valid device and attributes; each value is a plain int.
            let attr = |a| unsafe { result::device::get_attribute(dev, a) };
            Ok(format!(
                "{:04x}:{:02x}:{:02x}.0",
                attr(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
                attr(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
                attr(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
            ))
        })
        .ok()
    }

    fn ipc_export(&self, addr: u64) -> Result<IpcExport> {
        let info = self.pointer_info(addr)?;
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: `handle` is a valid out-parameter; `info.base` is the start of a
        // device allocation (the driver checks that it can be exported).
        let code = self.with(info.ordinal, || {
            driver("get an IPC memory handle", || unsafe {
                Ok(sys::cuIpcGetMemHandle(&mut handle, info.base))
            })
        })?;
        if code != sys::CUresult::CUDA_SUCCESS {
            // Not `cuMemAlloc` memory (the driver says invalid or unsupported, by
            // version): a VMM allocation travels as a descriptor, and the error of
            // anything else names both refusals.
            let fd = self.with(info.ordinal, || vmm::export(info.base, info.ordinal, code))?;
            return Ok(IpcExport {
                handle: Vec::new(),
                fd: Some(fd),
                ordinal: info.ordinal,
                base: info.base,
                len: info.len,
            });
        }
        Ok(IpcExport {
            handle: handle.reserved.iter().map(|&b| b as u8).collect(),
            fd: None,
            ordinal: info.ordinal,
            base: info.base,
            len: info.len,
        })
    }

    fn ipc_import(
        &self,
        ordinal: u32,
        handle: &[u8],
        fd: Option<OwnedFd>,
        len: u64,
    ) -> Result<u64> {
        if let (true, Some(fd)) = (handle.is_empty(), &fd) {
            self.device(ordinal)?;
            let (addr, mapped) = self.with(ordinal, || vmm::import(fd, ordinal, len))?;
            let import = Import {
                ordinal,
                opens: 1,
                mapped: Some(mapped),
            };
            self.imports.lock().insert(addr, import);
            return Ok(addr);
        }
        let bytes: &[u8; 64] = handle.try_into().map_err(|_| {
            Error::new(
                ErrorKind::InvalidRequest,
                format!(
                    "a CUDA IPC memory handle has 64 bytes, not {} (a VMM allocation comes as no handle with its descriptor)",
                    handle.len()
                ),
            )
        })?;
        let handle = sys::CUipcMemHandle {
            reserved: bytes.map(|b| b as std::ffi::c_char),
        };
        let mut addr: sys::CUdeviceptr = 0;
        // SAFETY: `addr` is a valid out-parameter; the handle is passed by value and
        // the driver checks it. 1 = CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.
        let code = self.with(ordinal, || {
            driver("open an IPC memory handle", || unsafe {
                Ok(sys::cuIpcOpenMemHandle_v2(&mut addr, handle, 1))
            })
        })?;
        use sys::CUresult as R;
        match code {
            R::CUDA_SUCCESS => {}
            R::CUDA_ERROR_INVALID_CONTEXT => {
                return Err(Error::new(
                    ErrorKind::Backend,
                    format!("CUDA cannot open this IPC memory handle on cuda:{ordinal} ({code:?}): the usual cause is a handle exported by this same process, which CUDA refuses (use the memory directly)"),
                ));
            }
            _ => return Err(failed("cuIpcOpenMemHandle", code)),
        }
        let mut imports = self.imports.lock();
        let import = imports.entry(addr).or_insert(Import {
            ordinal,
            opens: 0,
            mapped: None,
        });
        import.opens += 1;
        drop(imports);
        // The mapping is the whole exported allocation: refuse a length past it.
        if let Ok(info) = self.pointer_info(addr) {
            if info.len < len {
                let _ = self.ipc_close(addr);
                return Err(Error::new(
                    ErrorKind::InvalidRequest,
                    format!(
                        "cannot import {len} bytes: the exported allocation has {}",
                        info.len
                    ),
                ));
            }
        }
        Ok(addr)
    }

    fn ipc_close(&self, addr: u64) -> Result<()> {
        let mut imports = self.imports.lock();
        let Some(&Import {
            ordinal,
            opens,
            mapped,
        }) = imports.get(&addr)
        else {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                format!("{addr:#x} is not CUDA memory opened with ipc_import"),
            ));
        };
        if let Some(mapped) = mapped {
            imports.remove(&addr);
            drop(imports);
            return self.with(ordinal, || {
                vmm::unmap(addr, mapped);
                Ok(())
            });
        }
        // SAFETY: `addr` came from `cuIpcOpenMemHandle_v2` in this device's context
        // and is open (counted above); the caller's copies on it have completed.
        self.with(ordinal, || {
            driver("close an IPC memory handle", || unsafe {
                sys::cuIpcCloseMemHandle(addr).result()
            })
        })?;
        if opens > 1 {
            imports.insert(
                addr,
                Import {
                    ordinal,
                    opens: opens - 1,
                    mapped: None,
                },
            );
        } else {
            imports.remove(&addr);
        }
        Ok(())
    }

    unsafe fn copy(&self, copy: DeviceCopy, done: CopyDone) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.copy_group(&[copy], done) }
    }

    unsafe fn copy_group(&self, copies: &[DeviceCopy], done: CopyDone) -> Result<()> {
        // One part per device and direction; each is one or two driver calls where the
        // shape allows, and synchronises once.
        let parts = self.parts(copies)?;
        if parts.is_empty() {
            done(Ok(()));
            return Ok(());
        }
        let group = Group::new(parts.len(), done);
        for (dev, dir, part) in parts {
            let g = group.clone();
            // SAFETY: forwarded from the caller.
            match unsafe { self.enqueue(&dev, dir, &part) } {
                Ok((event, error, table)) => {
                    let w = Waiting {
                        event,
                        error,
                        table,
                        done: Box::new(move |r| g.arrive(r)),
                    };
                    if let Err(mpsc::SendError(w)) = dev.waiters[dir].lock().send(w) {
                        // No waiter: wait here, so nothing enqueued outlives `done`.
                        let _ = synchronize(dev.ctx, w.event);
                        (w.done)(Err(Error::new(
                            ErrorKind::Unavailable,
                            "a CUDA waiter thread is gone",
                        )));
                    }
                }
                Err(e) => g.arrive(Err(e)),
            }
        }
        Ok(())
    }

    unsafe fn copy_group_wait(&self, copies: &[DeviceCopy]) -> Result<()> {
        // Every part is enqueued first, so they run at once; then this thread sleeps
        // in the driver on each part's event: no waiter thread wakes it.
        let mut first = Ok(());
        let mut waiting = Vec::new();
        for (dev, dir, part) in self.parts(copies)? {
            // SAFETY: forwarded from the caller, who is blocked here until the end.
            match unsafe { self.enqueue(&dev, dir, &part) } {
                Ok((event, error, table)) => {
                    if let Some(e) = error {
                        first = first.and(Err(e));
                    }
                    waiting.push((dev, event, table));
                }
                Err(e) => first = first.and(Err(e)),
            }
        }
        for (dev, event, table) in waiting {
            let r = synchronize(dev.ctx, event);
            self.counters.sync();
            Cuda::release(&dev, event, table);
            first = first.and(r);
        }
        first
    }

    fn stats(&self) -> CopyStats {
        self.counters.get()
    }

    fn copy_path(&self) -> String {
        let host = match (&self.batch, self.batch_refused.load(Ordering::Relaxed)) {
            (Some(b), false) => format!("one {} per group", b.name()),
            (Some(_), true) => {
                "a loop of cuMemcpyAsync (the driver refused cuMemcpyBatchAsync)".into()
            }
            (None, _) if !self.config.batch_call => {
                "a loop of cuMemcpyAsync (batch_call = false)".into()
            }
            (None, _) => {
                "a loop of cuMemcpyAsync (the driver lacks cuMemcpyBatchAsync, CUDA 12.8)".into()
            }
        };
        let kernel = match (self.config.kernel, self.kernel_problem.lock().clone()) {
            (false, _) => "device↔device: as host↔device (kernel = false)".to_string(),
            (true, Some(p)) => format!("device↔device: as host↔device (the list-copy kernel did not load: {p})"),
            (true, None) => "device↔device on one GPU: one launch of te's list-copy kernel (PTX, loaded on a device's first use)".to_string(),
        };
        let gather = if self.config.kernel && self.config.gather {
            "; packed staging: the kernel gathers (scatters) through a device buffer, then one copy"
        } else {
            ""
        };
        format!("host↔device: {host}; {kernel}{gather}; one event per group")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_the_runtime_is_unavailable_with_a_reason_not_a_panic() {
        // SAFETY: only probes for the library.
        if unsafe { sys::is_culib_present() } {
            return; // A machine with a driver: covered by the ignored GPU test.
        }
        let e = crate::device::runtime(NAME).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        assert!(e.to_string().contains("libcuda.so not found"), "{e}");
    }

    #[test]
    fn only_host_ranges_that_follow_one_another_are_packed() {
        let r = |src, dst, len| Range { src, dst, len };
        assert!(packed(
            &[r(0x100, 10, 16), r(0x900, 26, 8), r(0x10, 34, 1)],
            true
        ));
        assert!(!packed(&[r(0x100, 10, 16), r(0x900, 27, 8)], true));
        assert!(packed(&[r(10, 0x100, 16), r(26, 0x10, 8)], false));
        assert!(!packed(&[r(10, 0x100, 16), r(26, 0x10, 8)], true));
    }

    /// A runtime with no devices, built without the driver: for the checks that come
    /// before any driver call.
    fn without_devices() -> Cuda {
        Cuda {
            devices: Vec::new(),
            config: CudaConfig::default(),
            batch: None,
            batch_refused: AtomicBool::new(false),
            kernel_problem: Mutex::new(None),
            counters: CopyCounters::default(),
            imports: Mutex::new(HashMap::new()),
            vmm_allocs: Mutex::new(HashMap::new()),
        }
    }

    #[test]
    fn an_ipc_handle_that_is_not_64_bytes_is_refused_before_the_driver() {
        let rt = without_devices();
        for len in [0, 63, 65] {
            // An empty handle is a VMM export only with its descriptor.
            let e = rt.ipc_import(0, &vec![0; len], None, 4096).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidRequest);
            assert!(e.to_string().contains("64 bytes"), "{e}");
        }
    }

    #[test]
    fn only_imported_memory_is_closed_and_it_is_not_freed() {
        let rt = without_devices();
        let e = rt.ipc_close(0x7000_0000).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidRequest);
        let legacy = Import {
            ordinal: 0,
            opens: 1,
            mapped: None,
        };
        rt.imports.lock().insert(0x7000_0000, legacy);
        let e = rt.free(0, 0x7000_0000).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidRequest);
        assert!(e.to_string().contains("ipc_close"), "{e}");
    }

    #[test]
    fn vmm_allocation_is_off_unless_asked_for() {
        assert!(!CudaConfig::default().vmm);
        let table: toml::Table = "vmm = true".parse().unwrap();
        assert!(CudaConfig::deserialize(table).unwrap().vmm);
    }

    #[test]
    fn a_bad_table_is_refused_naming_the_key() {
        let table: toml::Table = "gahter = true".parse().unwrap();
        let e = CudaConfig::deserialize(table).unwrap_err();
        assert!(e.to_string().contains("gahter"), "{e}");
    }
}
