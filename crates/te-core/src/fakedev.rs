//! `fakedev`: a fake device runtime, so every device-memory path runs without a GPU.
//!
//! It is a fake: its "device memory" is host memory behind addresses the host cannot
//! dereference (non-canonical x86-64 addresses, `0x7e…`), so any code that touches a
//! device address directly instead of going through the runtime's copies faults at
//! once. Copies run on the runtime's own thread and complete through their callbacks,
//! as a real runtime's asynchronous copies do. It has two devices.
//!
//! What it cannot prove: DMA behaviour, a real driver's alignment or pinning rules,
//! copy bandwidth, or anything about GPUDirect.

use std::collections::BTreeMap;
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};

use crate::device::{CopyDone, DeviceCopy, DeviceRuntime, PointerInfo};
use crate::error::{Error, ErrorKind, Result};

/// The runtime's name.
pub const NAME: &str = "fakedev";

const DEVICES: u32 = 2;
const BASE: u64 = 0x7e00_0000_0000_0000;

fn device_base(ordinal: u32) -> u64 {
    BASE + (u64::from(ordinal) << 44)
}

type Arena = Arc<Mutex<Vec<u8>>>;

struct Job {
    copy: DeviceCopy,
    arena: Arena,
    offset: usize,
    done: CopyDone,
}

// SAFETY: the job's host pointer is covered by the `copy` contract (valid and owned by
// the copy until `done` runs).
unsafe impl Send for Job {}

/// The fake runtime.
#[derive(Debug)]
pub struct FakeDev {
    allocs: Mutex<(BTreeMap<u64, Arena>, [u64; DEVICES as usize])>,
    jobs: Mutex<Sender<Job>>,
}

fn create() -> Result<Arc<dyn DeviceRuntime>> {
    let (tx, rx) = mpsc::channel::<Job>();
    std::thread::Builder::new()
        .name("te-fakedev".into())
        .spawn(move || {
            for job in rx {
                let arena = job.arena.lock().unwrap_or_else(|p| p.into_inner());
                match job.copy {
                    // SAFETY: the submitter guarantees the host range (the `copy`
                    // contract); the arena range was checked in `copy`.
                    DeviceCopy::ToDevice { host, len, .. } => unsafe {
                        std::ptr::copy_nonoverlapping(
                            host,
                            arena.as_ptr().add(job.offset) as *mut u8,
                            len,
                        )
                    },
                    // SAFETY: as above.
                    DeviceCopy::ToHost { host, len, .. } => unsafe {
                        std::ptr::copy_nonoverlapping(arena.as_ptr().add(job.offset), host, len)
                    },
                }
                drop(arena);
                (job.done)(Ok(()));
            }
        })
        .map_err(|e| {
            Error::new(ErrorKind::Io, "cannot start the fakedev copy thread").with_source(e)
        })?;
    let next = std::array::from_fn(|i| device_base(i as u32));
    Ok(Arc::new(FakeDev {
        allocs: Mutex::new((BTreeMap::new(), next)),
        jobs: Mutex::new(tx),
    }))
}

crate::register_runtime!(
    NAME,
    "a fake device for tests: host memory behind addresses the host cannot dereference",
    create
);

impl FakeDev {
    fn find(&self, addr: u64) -> Option<(u64, Arena)> {
        let allocs = self.allocs.lock().unwrap_or_else(|p| p.into_inner());
        let (&base, arena) = allocs.0.range(..=addr).next_back()?;
        let len = arena.lock().unwrap_or_else(|p| p.into_inner()).len() as u64;
        (addr < base + len).then(|| (base, arena.clone()))
    }
}

fn not_device(addr: u64) -> Error {
    Error::new(
        ErrorKind::InvalidRequest,
        format!("{addr:#x} is not fakedev device memory (allocate it with the fakedev runtime)"),
    )
}

impl DeviceRuntime for FakeDev {
    fn name(&self) -> &str {
        NAME
    }

    fn device_count(&self) -> Result<u32> {
        Ok(DEVICES)
    }

    fn pointer_info(&self, addr: u64) -> Result<PointerInfo> {
        let (base, arena) = self.find(addr).ok_or_else(|| not_device(addr))?;
        let len = arena.lock().unwrap_or_else(|p| p.into_inner()).len() as u64;
        Ok(PointerInfo {
            ordinal: ((base - BASE) >> 44) as u32,
            base,
            len,
        })
    }

    fn alloc(&self, ordinal: u32, len: usize) -> Result<u64> {
        if ordinal >= DEVICES {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                format!("fakedev has devices 0..{DEVICES}, not {ordinal}"),
            ));
        }
        if len == 0 {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                "cannot allocate zero bytes",
            ));
        }
        let mut allocs = self.allocs.lock().unwrap_or_else(|p| p.into_inner());
        let addr = allocs.1[ordinal as usize];
        allocs.1[ordinal as usize] = addr + (len as u64).next_multiple_of(4096);
        allocs.0.insert(addr, Arc::new(Mutex::new(vec![0; len])));
        Ok(addr)
    }

    fn free(&self, _ordinal: u32, addr: u64) -> Result<()> {
        let mut allocs = self.allocs.lock().unwrap_or_else(|p| p.into_inner());
        allocs
            .0
            .remove(&addr)
            .map(|_| ())
            .ok_or_else(|| not_device(addr))
    }

    fn alloc_pinned(&self, len: usize) -> Result<*mut u8> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096).map_err(|_| {
            Error::new(
                ErrorKind::InvalidRequest,
                format!("cannot allocate {len} pinned bytes"),
            )
        })?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            return Err(Error::new(
                ErrorKind::Io,
                "out of memory for pinned buffers",
            ));
        }
        Ok(p)
    }

    unsafe fn free_pinned(&self, ptr: *mut u8, len: usize) {
        if let Ok(layout) = std::alloc::Layout::from_size_align(len.max(1), 4096) {
            // SAFETY: the caller passes a pointer from `alloc_pinned(len)`.
            unsafe { std::alloc::dealloc(ptr, layout) };
        }
    }

    unsafe fn copy(&self, copy: DeviceCopy, done: CopyDone) -> Result<()> {
        let (device, len) = match copy {
            DeviceCopy::ToDevice { device, len, .. } | DeviceCopy::ToHost { device, len, .. } => {
                (device, len)
            }
        };
        let (base, arena) = self.find(device).ok_or_else(|| not_device(device))?;
        let offset = (device - base) as usize;
        let size = arena.lock().unwrap_or_else(|p| p.into_inner()).len();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::new(
                ErrorKind::OutOfBounds,
                format!("a copy of {len} bytes at {device:#x} runs past its {size}-byte fakedev allocation"),
            ));
        }
        let job = Job {
            copy,
            arena,
            offset,
            done,
        };
        self.jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(job)
            .map_err(|_| Error::new(ErrorKind::Unavailable, "the fakedev copy thread is gone"))
    }
}
