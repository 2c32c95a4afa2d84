//! `listcopy`, a device runtime of the test binary that includes this file: `fakedev`
//! (its memory, copies and IPC sharing), except that it counts the device-to-device
//! groups started and those whose copies overlap one another (a list-copy kernel runs
//! a group's copies at once, so overlap in a group is undefined), and runs each
//! group's copies last to first, as a kernel's threads may finish them.
//!
//! Included by `#[path]` where wanted (not from `common`), so that only those binaries
//! have the runtime. Its counters are process-wide: one test at a time reads them.

#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use te_core::device::{CopyDone, DeviceCopy, DeviceRuntime, IpcExport, PointerInfo};
use te_core::Result;

/// The runtime's name.
pub(crate) const NAME: &str = "listcopy";

/// Device-to-device groups started, and those of them with overlapping copies.
static GROUPS: AtomicU64 = AtomicU64::new(0);
static OVERLAPPING: AtomicU64 = AtomicU64::new(0);

/// How long each device-to-device group takes at least, in milliseconds.
static GROUP_DELAY_MS: AtomicU64 = AtomicU64::new(0);

/// Makes each device-to-device group take at least `ms` milliseconds (0: no delay).
pub(crate) fn set_group_delay(ms: u64) {
    GROUP_DELAY_MS.store(ms, Ordering::SeqCst);
}

/// The groups started so far, and how many of them held overlapping copies.
pub(crate) fn groups() -> (u64, u64) {
    (
        GROUPS.load(Ordering::SeqCst),
        OVERLAPPING.load(Ordering::SeqCst),
    )
}

#[derive(Debug)]
struct ListCopy;

fn create(_: &te_core::config::Table) -> Result<Arc<dyn DeviceRuntime>> {
    Ok(Arc::new(ListCopy))
}

/// The process's fakedev runtime, looked up on first use (not while `create` runs,
/// inside te-core's lookup).
fn fakedev() -> &'static Arc<dyn DeviceRuntime> {
    static FAKEDEV: OnceLock<Arc<dyn DeviceRuntime>> = OnceLock::new();
    FAKEDEV
        .get_or_init(|| te_core::device::runtime(te_core::device::fakedev::NAME).expect("fakedev"))
}

te_core::register_runtime!(NAME, "fakedev, copying a group's copies in reverse", create);

/// Whether `[a, a + n)` and `[b, b + m)` share a byte.
fn meet(a: u64, n: usize, b: u64, m: usize) -> bool {
    a < b + m as u64 && b < a + n as u64
}

impl DeviceRuntime for ListCopy {
    fn name(&self) -> &str {
        NAME
    }
    fn device_count(&self) -> Result<u32> {
        fakedev().device_count()
    }
    fn pointer_info(&self, addr: u64) -> Result<PointerInfo> {
        fakedev().pointer_info(addr)
    }
    fn alloc(&self, ordinal: u32, len: usize) -> Result<u64> {
        fakedev().alloc(ordinal, len)
    }
    fn free(&self, ordinal: u32, addr: u64) -> Result<()> {
        fakedev().free(ordinal, addr)
    }
    fn alloc_pinned(&self, len: usize) -> Result<*mut u8> {
        fakedev().alloc_pinned(len)
    }
    unsafe fn free_pinned(&self, ptr: *mut u8, len: usize) {
        // SAFETY: forwarded from the caller.
        unsafe { fakedev().free_pinned(ptr, len) }
    }
    unsafe fn copy(&self, copy: DeviceCopy, done: CopyDone) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { fakedev().copy(copy, done) }
    }
    unsafe fn copy_group(&self, copies: &[DeviceCopy], done: CopyDone) -> Result<()> {
        let d2d: Vec<(u64, u64, usize)> = copies
            .iter()
            .filter_map(|c| match *c {
                DeviceCopy::DeviceToDevice { src, dst, len, .. } => Some((src, dst, len)),
                _ => None,
            })
            .collect();
        if !d2d.is_empty() {
            GROUPS.fetch_add(1, Ordering::SeqCst);
            let delay = GROUP_DELAY_MS.load(Ordering::SeqCst);
            std::thread::sleep(std::time::Duration::from_millis(delay));
        }
        // A destination that meets any copy's source or destination (its own source
        // included), all in one address space here.
        let overlap = d2d.iter().enumerate().any(|(i, &(_, d, n))| {
            d2d.iter()
                .enumerate()
                .any(|(j, &(s, d2, m))| meet(d, n, s, m) || (i != j && meet(d, n, d2, m)))
        });
        if overlap {
            OVERLAPPING.fetch_add(1, Ordering::SeqCst);
        }
        let reversed: Vec<DeviceCopy> = copies.iter().rev().copied().collect();
        // SAFETY: forwarded from the caller; a group's copies are not ordered.
        unsafe { fakedev().copy_group(&reversed, done) }
    }
    fn ipc_export(&self, addr: u64) -> Result<IpcExport> {
        fakedev().ipc_export(addr)
    }
    fn ipc_import(
        &self,
        ordinal: u32,
        handle: &[u8],
        fd: Option<std::os::fd::OwnedFd>,
        len: u64,
    ) -> Result<u64> {
        fakedev().ipc_import(ordinal, handle, fd, len)
    }
    fn ipc_close(&self, addr: u64) -> Result<()> {
        fakedev().ipc_close(addr)
    }
    fn device_id(&self, ordinal: u32) -> Option<String> {
        fakedev().device_id(ordinal)
    }
    fn ordinal_of(&self, id: &str) -> Option<u32> {
        fakedev().ordinal_of(id)
    }
}

/// `len` bytes of `listcopy` device 0, freed on drop.
pub(crate) struct Mem {
    rt: Arc<dyn DeviceRuntime>,
    /// Where they are.
    pub(crate) addr: u64,
    len: usize,
}

impl Mem {
    pub(crate) fn new(len: usize) -> Mem {
        let rt = te_core::device::runtime(NAME).expect("the listcopy runtime");
        let addr = rt.alloc(0, len).expect("alloc");
        Mem { rt, addr, len }
    }

    fn copy(&self, c: DeviceCopy) {
        // SAFETY: the host side outlives the synchronous copy; both sides are in range.
        unsafe { self.rt.copy_sync(c) }.expect("copy");
    }

    /// Overwrites the memory from its start with `v`.
    pub(crate) fn fill(&self, v: &[u8]) {
        assert!(v.len() <= self.len);
        self.copy(DeviceCopy::ToDevice {
            ordinal: 0,
            device: self.addr,
            host: v.as_ptr(),
            len: v.len(),
        });
    }

    /// The memory's bytes.
    pub(crate) fn read(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        self.copy(DeviceCopy::ToHost {
            ordinal: 0,
            device: self.addr,
            host: v.as_mut_ptr(),
            len: v.len(),
        });
        v
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        let _ = self.rt.free(0, self.addr);
    }
}
