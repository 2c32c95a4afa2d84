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

use std::collections::HashMap;
use std::fmt;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use crate::error::{Error, ErrorKind, Result};

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
}

// SAFETY: a `DeviceCopy` is a description of memory the submitter guarantees live and
// unaliased until the copy completes (see `DeviceRuntime::copy`); the pointers are
// only dereferenced by the runtime.
unsafe impl Send for DeviceCopy {}

/// What runs when a copy completes.
pub type CopyDone = Box<dyn FnOnce(Result<()>) + Send>;

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
    /// and not accessed by anyone else until `done` runs; the device range must lie in
    /// a live allocation.
    ///
    /// # Errors
    /// If the copy cannot start; `done` is then not run.
    unsafe fn copy(&self, copy: DeviceCopy, done: CopyDone) -> Result<()>;
}

impl dyn DeviceRuntime {
    /// Copies and waits, at most `timeout`.
    ///
    /// # Safety
    /// As [`DeviceRuntime::copy`].
    ///
    /// # Errors
    /// The copy's error, or `Timeout`.
    pub unsafe fn copy_sync(&self, copy: DeviceCopy, timeout: Duration) -> Result<()> {
        let (tx, rx) = mpsc::sync_channel(1);
        // SAFETY: forwarded from the caller.
        unsafe {
            self.copy(
                copy,
                Box::new(move |r| {
                    let _ = tx.send(r);
                }),
            )?
        };
        rx.recv_timeout(timeout).unwrap_or_else(|_| {
            Err(Error::new(
                ErrorKind::Timeout,
                "a device copy did not complete in time",
            ))
        })
    }
}

/// A compiled-in device runtime, submitted by [`register_runtime!`](crate::register_runtime).
#[derive(Debug)]
pub struct RuntimeFactory {
    /// The runtime's name.
    pub name: &'static str,
    /// What it is, for `te info`.
    pub description: &'static str,
    /// Creates the process's instance; an error says why the runtime is unavailable.
    pub create: fn() -> Result<Arc<dyn DeviceRuntime>>,
}

inventory::collect!(RuntimeFactory);

/// Registers a device runtime: `te_core::register_runtime!(NAME, "description", create);`
#[macro_export]
macro_rules! register_runtime {
    ($name:expr, $description:expr, $create:path) => {
        $crate::inventory::submit! {
            $crate::device::RuntimeFactory { name: $name, description: $description, create: $create }
        }
    };
}

type Instances = HashMap<&'static str, Result<Arc<dyn DeviceRuntime>>>;
static INSTANCES: Mutex<Option<Instances>> = Mutex::new(None);

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
    let mut instances = INSTANCES.lock().unwrap_or_else(|p| p.into_inner());
    instances
        .get_or_insert_with(HashMap::new)
        .entry(f.name)
        .or_insert_with(|| {
            std::panic::catch_unwind(f.create).unwrap_or_else(|_| {
                Err(Error::new(
                    ErrorKind::Unavailable,
                    format!("the {name} runtime panicked while starting"),
                ))
            })
        })
        .clone()
}

/// Every runtime compiled in, with its description and whether it can run here.
pub fn runtimes() -> Vec<(&'static str, &'static str, Result<()>)> {
    let mut all: Vec<_> = inventory::iter::<RuntimeFactory>()
        .map(|f| (f.name, f.description, runtime(f.name).map(|_| ())))
        .collect();
    all.sort_by_key(|r| r.0);
    all
}
