//! The `mlu` device runtime: Cambricon MLU memory for every te backend.
//!
//! It answers where an MLU address lives (`cnrtPointerGetAttributes`), allocates device
//! memory (`cnrtMalloc`) and page-locked host memory (`cnrtHostMalloc`), and copies
//! between the two on its own thread. That thread takes every copy waiting for it (up
//! to [`GROUP`]), enqueues each on its device's queue with the bound `cnrtMemcpyAsync*`
//! (making that device current first: a queue belongs to the device it was created
//! on), then waits once per queue used: `cnrtQueueQuery`, and if copies remain,
//! `cnrtQueueSync`. A copy CNRT refuses as busy (its queue is full) waits for the
//! queue and is tried once more; refused again, it fails as `Busy`. At start the runtime sets every device's flag to
//! `cnrtDeviceScheduleBlock`, so that wait sleeps in CNRT instead of spinning a core;
//! where CNRT refuses (the application used the device first) it says so in a warning.
//! The caller's thread never waits on CNRT.
//!
//! Calls that depend on the current device save and restore the calling thread's
//! device, so an application using CNRT on the same thread keeps its setting.

use std::collections::HashMap;
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, OnceLock};
use te_core::kit::thread::SpawnMasked as _;
use te_core::sync::Mutex;

use te_core::device::{CopyDone, DeviceCopy, DeviceRuntime, PointerInfo};
use te_core::{Error, ErrorKind, Result};

use crate::ffi::{self, dir, flag, Cnrt, IpcHandle, Queue, MEM_TYPE_DEVICE};

/// The runtime's name: memory kinds `mlu:N`.
pub const RUNTIME: &str = "mlu";

/// The most copies the copy thread enqueues before it waits for them.
pub(crate) const GROUP: usize = 64;

type Job = (DeviceCopy, CopyDone);

/// The process's MLU runtime.
#[derive(Debug)]
pub struct MluRuntime {
    cnrt: Arc<Cnrt>,
    devices: u32,
    /// Whether every device's flag is `cnrtDeviceScheduleBlock`.
    blocking: bool,
    jobs: Mutex<Sender<Job>>,
    /// IPC handles by allocation base: CNRT refuses a second acquire for one
    /// allocation.
    handles: Mutex<HashMap<u64, Export>>,
}

/// An allocation's IPC handle, and how many of te's registrations use it. While one
/// does, the allocation cannot have been freed (memory must stay allocated until it is
/// deregistered); with none, it may have been, and another made at its base.
#[derive(Debug, Clone, Copy)]
struct Export {
    handle: IpcHandle,
    /// te's number for this allocation's export, random and new with every handle
    /// CNRT gives: peers tell allocations apart by it, whatever handle values CNRT
    /// gives (a new allocation at a freed base may get the freed one's).
    generation: u64,
    ordinal: u32,
    len: u64,
    users: usize,
}

static INSTANCE: OnceLock<Result<Arc<MluRuntime>>> = OnceLock::new();

/// The process's instance, started on first use.
///
/// # Errors
/// `Unavailable` if CNRT cannot be loaded or reports no MLU.
pub fn instance() -> Result<Arc<MluRuntime>> {
    INSTANCE.get_or_init(MluRuntime::start).clone()
}

/// The runtime takes no options: a `[runtimes.mlu]` table with any key is refused
/// (rather than ignored).
fn check(table: &te_core::config::Table) -> Result<()> {
    match table.keys().next() {
        None => Ok(()),
        Some(key) => Err(te_core::Error::new(
            te_core::ErrorKind::ConfigInvalid,
            format!("[runtimes.mlu]: unknown key `{key}`: the mlu runtime takes no options"),
        )),
    }
}

fn create(table: &te_core::config::Table) -> Result<Arc<dyn DeviceRuntime>> {
    check(table)?;
    instance().map(|r| r as Arc<dyn DeviceRuntime>)
}

te_core::register_runtime!(
    RUNTIME,
    "Cambricon MLUs through CNRT (libcnrt.so, loaded at run time)",
    create,
    loaded_with = ["libcnrt.so"],
    check = check
);

/// The copy thread's queues (used only there), and its buffers for a group.
struct Queues {
    cnrt: Arc<Cnrt>,
    by_device: HashMap<u32, Queue>,
    /// Per copy of the group: the device it was enqueued on, or why not.
    placed: Vec<Result<Option<u32>>>,
    /// Per device used by the group: how waiting for its queue went.
    used: Vec<(u32, Result<()>)>,
}

impl Queues {
    fn get(&mut self, ordinal: u32) -> Result<Queue> {
        if let Some(q) = self.by_device.get(&ordinal) {
            return Ok(*q);
        }
        let q = self.cnrt.queue_create()?;
        self.by_device.insert(ordinal, q);
        Ok(q)
    }

    /// Waits for everything on `ordinal`'s queue; a queue that failed is replaced, so
    /// one failed copy does not poison the next.
    fn finish(&mut self, ordinal: u32) -> Result<()> {
        let Some(&q) = self.by_device.get(&ordinal) else {
            return Ok(());
        };
        let r = self
            .cnrt
            .set_device(ordinal)
            .and_then(|()| match self.cnrt.queue_query(q) {
                Ok(true) => Ok(()),
                Ok(false) => self.cnrt.queue_sync(q),
                Err(e) => Err(e),
            });
        if r.is_err() {
            self.by_device.remove(&ordinal);
            let _ = self.cnrt.queue_sync(q);
            let _ = self.cnrt.queue_destroy(q);
        }
        r
    }

    /// Enqueues one copy on its device's queue, with that device current. `Ok(None)`
    /// for an empty copy, `Ok(Some(ordinal))` once enqueued.
    fn enqueue(&mut self, copy: &DeviceCopy) -> Result<Option<u32>> {
        let (ordinal, dst, src, len, d) = match *copy {
            DeviceCopy::ToDevice {
                ordinal,
                device,
                host,
                len,
            } => (ordinal, device, host as u64, len, dir::HOST_TO_DEV),
            DeviceCopy::ToHost {
                ordinal,
                device,
                host,
                len,
            } => (ordinal, host as u64, device, len, dir::DEV_TO_HOST),
            DeviceCopy::DeviceToDevice {
                src_ordinal,
                src,
                dst_ordinal,
                dst,
                len,
            } if src_ordinal == dst_ordinal => (src_ordinal, dst, src, len, dir::DEV_TO_DEV),
            DeviceCopy::DeviceToDevice { .. } => {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    "the mlu runtime copies device to device within one MLU only; the mlu backend moves data between MLUs",
                ))
            }
        };
        if len == 0 {
            return Ok(None);
        }
        self.cnrt.set_device(ordinal)?;
        let q = self.get(ordinal)?;
        // SAFETY: the submitter guarantees both ranges until `done` runs (the
        // `DeviceRuntime::copy` contract), and the group's queues are synchronized
        // before any `done` runs.
        self.cnrt
            .enqueue_or_wait(q, || unsafe { self.cnrt.memcpy_async(dst, src, len, q, d) })?;
        Ok(Some(ordinal))
    }

    /// Enqueues a group of copies, waits once per queue used, then reports each.
    fn run(&mut self, group: &mut Vec<Job>) {
        for (copy, _) in group.iter() {
            let r = self.enqueue(copy);
            if let Ok(Some(ordinal)) = r {
                if !self.used.iter().any(|(o, _)| *o == ordinal) {
                    self.used.push((ordinal, Ok(())));
                }
            }
            self.placed.push(r);
        }
        let mut used = std::mem::take(&mut self.used);
        for (ordinal, result) in used.iter_mut() {
            *result = self.finish(*ordinal);
        }
        for ((_, done), r) in group.drain(..).zip(self.placed.drain(..)) {
            let r = match r {
                Ok(None) => Ok(()),
                Ok(Some(ordinal)) => used
                    .iter()
                    .find(|(o, _)| *o == ordinal)
                    .map_or(Ok(()), |(_, r)| r.clone()),
                Err(e) => Err(e),
            };
            done(r.map_err(|e| e.with_operation("MLU copy")));
        }
        used.clear();
        self.used = used;
    }
}

/// Sets `cnrtDeviceScheduleBlock` on every device; false (with a warning) where CNRT
/// refuses and the flag in force is another.
fn block_on_sync(cnrt: &Cnrt, devices: u32) -> bool {
    let mut all = true;
    for d in 0..devices {
        let set = cnrt.with_device(d, || cnrt.set_device_flag(flag::BLOCK));
        if set.is_ok() {
            continue;
        }
        let now = cnrt.with_device(d, || cnrt.device_flag());
        if matches!(now, Ok(f) if f == flag::BLOCK) {
            continue;
        }
        all = false;
        tracing::warn!(
            mlu = d,
            refused = %set.err().map(|e| e.to_string()).unwrap_or_default(),
            flag = now.map(flag::name).unwrap_or("unknown"),
            "CNRT would not set cnrtDeviceScheduleBlock (the device was in use before te started its runtime): waiting for MLU copies will spin a CPU core; call cnrtSetDeviceFlag(cnrtDeviceScheduleBlock) for each device before the application's first CNRT call"
        );
    }
    all
}

impl MluRuntime {
    fn start() -> Result<Arc<MluRuntime>> {
        let cnrt = ffi::cnrt()?;
        let devices = cnrt
            .device_count()
            .map_err(|e| Error::new(ErrorKind::Unavailable, e.to_string()))?;
        if devices == 0 {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!(
                    "CNRT ({}) reports no MLU devices (check the driver and MLU_VISIBLE_DEVICES)",
                    cnrt.path()
                ),
            ));
        }
        let blocking = block_on_sync(&cnrt, devices);
        let (tx, rx) = mpsc::channel::<Job>();
        let c = cnrt.clone();
        std::thread::Builder::new()
            .name("te-mlu-copy".into())
            .spawn_masked(move || {
                let mut queues = Queues {
                    cnrt: c,
                    by_device: HashMap::new(),
                    placed: Vec::with_capacity(GROUP),
                    used: Vec::new(),
                };
                let mut group = Vec::with_capacity(GROUP);
                while let Ok(first) = rx.recv() {
                    group.push(first);
                    while group.len() < GROUP {
                        match rx.try_recv() {
                            Ok(job) => group.push(job),
                            Err(_) => break,
                        }
                    }
                    queues.run(&mut group);
                }
            })
            .map_err(|e| {
                Error::new(ErrorKind::Io, "cannot start the MLU copy thread").with_source(e)
            })?;
        tracing::info!(
            library = cnrt.path(),
            version = ?cnrt.version(),
            memcpy_async = cnrt.memcpy_async_name(),
            devices,
            blocking,
            "mlu runtime started"
        );
        Ok(Arc::new(MluRuntime {
            cnrt,
            devices,
            blocking,
            jobs: Mutex::new(tx),
            handles: Mutex::new(HashMap::new()),
        }))
    }

    pub(crate) fn cnrt(&self) -> &Arc<Cnrt> {
        &self.cnrt
    }

    /// Whether waiting for copies blocks on every device (`cnrtDeviceScheduleBlock` is
    /// in force), rather than spinning a core in CNRT.
    pub fn blocking_sync(&self) -> bool {
        self.blocking
    }

    fn ordinal_ok(&self, ordinal: u32) -> Result<()> {
        if ordinal < self.devices {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::InvalidRequest,
                format!(
                    "there is no mlu:{ordinal}: this process sees {} MLUs",
                    self.devices
                ),
            ))
        }
    }

    /// The IPC handle of the allocation `info` describes, and its export's
    /// generation, for one more registration; [`MluRuntime::release_handle`] says when
    /// that registration is gone.
    ///
    /// While a registration holds the allocation, its handle is the one kept. Without
    /// one, the application may have freed the allocation and made another at its
    /// base, so CNRT is asked again: a handle it gives is the current allocation's; a
    /// refusal because it gave this allocation's handle out already means the
    /// allocation is the one whose handle te kept (same base, MLU and size), which is
    /// served again. A handle CNRT gives gets a new generation, one served again keeps
    /// its own: the generation names the allocation even where CNRT gives a new
    /// allocation the handle value of a freed one.
    ///
    /// # Errors
    /// CNRT's error from `cnrtAcquireMemHandle`; `InvalidRequest` if the allocation
    /// changed while registered, or CNRT gave its handle to someone else than te.
    pub(crate) fn export(&self, info: &PointerInfo) -> Result<(IpcHandle, u64)> {
        let mut handles = self.handles.lock();
        let same = |e: &Export| e.ordinal == info.ordinal && e.len == info.len;
        if let Some(e) = handles.get_mut(&info.base).filter(|e| e.users > 0) {
            if !same(e) {
                return Err(Error::new(
                    ErrorKind::InvalidRequest,
                    format!("the MLU allocation at {:#x} is not the one registered there before ({} bytes on mlu:{}, now {} bytes on mlu:{}), though that registration is still live: memory must stay allocated until it is deregistered", info.base, e.len, e.ordinal, info.len, info.ordinal),
                ));
            }
            e.users += 1;
            return Ok((e.handle, e.generation));
        }
        let acquired = self
            .cnrt
            .with_device(info.ordinal, || self.cnrt.acquire_mem_handle(info.base))?;
        let (handle, generation) = match (acquired, handles.get(&info.base)) {
            (Some(h), _) => (h, te_core::random_nonzero()),
            (None, Some(e)) if same(e) => (e.handle, e.generation),
            (None, _) => {
                return Err(Error::new(
                    ErrorKind::InvalidRequest,
                    format!("CNRT refuses an IPC handle for the MLU allocation at {:#x}: it gave that allocation's handle out already, and not to te (CNRT gives one per allocation); register memory whose IPC handle the application has not acquired itself", info.base),
                ))
            }
        };
        handles.insert(
            info.base,
            Export {
                handle,
                generation,
                ordinal: info.ordinal,
                len: info.len,
                users: 1,
            },
        );
        Ok((handle, generation))
    }

    /// A registration that [`MluRuntime::export`] served `handle` for the allocation
    /// at `base` is gone. The handle is kept, to be served again only where CNRT says
    /// the allocation is still the same one.
    pub(crate) fn release_handle(&self, base: u64, handle: IpcHandle) {
        if let Some(e) = self.handles.lock().get_mut(&base) {
            if e.handle == handle {
                e.users = e.users.saturating_sub(1);
            }
        }
    }

    /// Maps a peer's IPC handle; the memory is on local device `ordinal`.
    pub(crate) fn map(&self, ordinal: u32, handle: IpcHandle) -> Result<u64> {
        self.cnrt
            .with_device(ordinal, || self.cnrt.map_mem_handle(handle))
    }

    /// How many bytes of the peer's allocation that [`MluRuntime::map`] mapped at
    /// `addr` lie from `addr` to its end, as CNRT reports them for the mapped address
    /// (`cnrtPointerGetAttributes`: the allocation's base and size). This, not what
    /// the allocation's owner claims, bounds what te reaches through the mapping.
    ///
    /// # Errors
    /// `Unsupported` if CNRT does not report `addr` as MLU memory inside an
    /// allocation of known size.
    pub(crate) fn mapped_len(&self, addr: u64) -> Result<u64> {
        let attrs = self.cnrt.pointer_attributes(addr);
        let end = match &attrs {
            Ok(a) if a.kind == MEM_TYPE_DEVICE && a.size > 0 => {
                let base = if a.device_base_pointer.is_null() {
                    addr
                } else {
                    a.device_base_pointer as u64
                };
                base.checked_add(a.size as u64)
                    .filter(|&end| base <= addr && addr < end)
            }
            _ => None,
        };
        end.map(|end| end - addr).ok_or_else(|| {
            let said = match attrs {
                Ok(a) => format!(
                    "cnrtPointerGetAttributes says type {}, {} bytes from base {:#x}",
                    a.kind, a.size, a.device_base_pointer as u64
                ),
                Err(e) => e.to_string(),
            };
            Error::new(
                ErrorKind::Unsupported,
                format!("CNRT does not say how large the peer's MLU allocation mapped at {addr:#x} is ({said}), so te cannot keep copies through that mapping inside the allocation, and makes none"),
            )
        })
    }

    /// Undoes [`MluRuntime::map`].
    pub(crate) fn unmap(&self, ordinal: u32, addr: u64) -> Result<()> {
        self.cnrt
            .with_device(ordinal, || self.cnrt.unmap_mem_handle(addr))
    }
}

fn not_mlu(addr: u64) -> Error {
    Error::new(
        ErrorKind::InvalidRequest,
        format!("{addr:#x} is not MLU device memory (allocate it with cnrtMalloc or Engine::alloc_on(mlu:N))"),
    )
}

impl DeviceRuntime for MluRuntime {
    fn name(&self) -> &str {
        RUNTIME
    }

    fn device_count(&self) -> Result<u32> {
        Ok(self.devices)
    }

    fn pointer_info(&self, addr: u64) -> Result<PointerInfo> {
        let a = self
            .cnrt
            .pointer_attributes(addr)
            .map_err(|_| not_mlu(addr))?;
        if a.kind != MEM_TYPE_DEVICE || a.device < 0 || a.size == 0 {
            return Err(not_mlu(addr));
        }
        let base = if a.device_base_pointer.is_null() {
            addr
        } else {
            a.device_base_pointer as u64
        };
        Ok(PointerInfo {
            ordinal: a.device as u32,
            base,
            len: a.size as u64,
        })
    }

    fn alloc(&self, ordinal: u32, len: usize) -> Result<u64> {
        self.ordinal_ok(ordinal)?;
        if len == 0 {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                "cannot allocate zero bytes",
            ));
        }
        self.cnrt
            .with_device(ordinal, || self.cnrt.malloc(len))
            .map_err(|e| e.with_context("mlu", ordinal).with_context("bytes", len))
    }

    fn free(&self, ordinal: u32, addr: u64) -> Result<()> {
        self.handles.lock().remove(&addr);
        self.cnrt.with_device(ordinal, || self.cnrt.free(addr))
    }

    fn alloc_pinned(&self, len: usize) -> Result<*mut u8> {
        self.cnrt.host_malloc(len.max(1))
    }

    unsafe fn free_pinned(&self, ptr: *mut u8, _len: usize) {
        // SAFETY: the caller passes a pointer from `alloc_pinned`, unused afterwards.
        if let Err(e) = unsafe { self.cnrt.free_host(ptr) } {
            tracing::warn!(error = %e, "freeing pinned memory failed");
        }
    }

    unsafe fn copy(&self, copy: DeviceCopy, done: CopyDone) -> Result<()> {
        let ordinal = copy.queue().0;
        self.ordinal_ok(ordinal)?;
        self.jobs
            .lock()
            .send((copy, done))
            .map_err(|_| Error::new(ErrorKind::Unavailable, "the MLU copy thread is gone"))
    }
}
