//! The `cuda` device runtime, on the CUDA driver API through cudarc with dynamic
//! loading: nothing of CUDA is needed to build, and `libcuda.so` is looked for only
//! when the runtime is first used.
//!
//! Bindings: cudarc's `cuda-12080` feature. Symbols are resolved one by one on first
//! call, so any driver that exports the few te uses (`cuInit`, `cuDeviceGet*`,
//! `cuDevicePrimaryCtxRetain`, `cuCtxSetCurrent`, `cuMemAlloc_v2`, `cuMemFree_v2`,
//! `cuMemHostAlloc`, `cuMemFreeHost`, `cuMemcpyHtoD_v2`, `cuMemcpyDtoH_v2`,
//! `cuPointerGetAttribute`, `cuMemGetAddressRange_v2`) works: CUDA 12 drivers do.
//!
//! The library's presence is probed before any call (cudarc panics where it is
//! missing), and every driver call runs under `catch_unwind`, so a missing driver or
//! symbol is an `Unavailable` error, never a panic. Copies run on the runtime's own
//! thread with the driver's synchronous copies, from pinned memory where the caller
//! stages through [`DeviceRuntime::alloc_pinned`]; the caller's thread never waits on
//! the driver.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys};

use crate::device::{CopyDone, DeviceCopy, DeviceRuntime, PointerInfo};
use crate::error::{Error, ErrorKind, Result};

/// The runtime's name.
pub const NAME: &str = "cuda";

/// A primary context handle; contexts are process-wide and usable from any thread.
#[derive(Debug, Clone, Copy)]
struct Ctx(sys::CUcontext);

// SAFETY: CUDA contexts may be made current on any thread; the handle is only passed
// to `cuCtxSetCurrent`.
unsafe impl Send for Ctx {}
// SAFETY: as above.
unsafe impl Sync for Ctx {}

/// The CUDA runtime.
#[derive(Debug)]
pub struct Cuda {
    contexts: Vec<Ctx>,
    jobs: Mutex<Sender<(DeviceCopy, CopyDone)>>,
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

fn create() -> Result<Arc<dyn DeviceRuntime>> {
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
    let mut contexts = Vec::new();
    for i in 0..count {
        let dev = driver("get device", || result::device::get(i))?;
        // SAFETY: `dev` is a valid device handle from the driver.
        let ctx = driver("retain primary context", || unsafe {
            result::primary_ctx::retain(dev)
        })?;
        contexts.push(Ctx(ctx));
    }
    let (tx, rx) = mpsc::channel::<(DeviceCopy, CopyDone)>();
    let ctxs = contexts.clone();
    std::thread::Builder::new()
        .name("te-cuda-copy".into())
        .spawn(move || {
            for (copy, done) in rx {
                done(run_copy(&ctxs, copy));
            }
        })
        .map_err(|e| {
            Error::new(ErrorKind::Io, "cannot start the CUDA copy thread").with_source(e)
        })?;
    Ok(Arc::new(Cuda {
        contexts,
        jobs: Mutex::new(tx),
    }))
}

crate::register_runtime!(
    NAME,
    "NVIDIA GPUs through the CUDA driver (loaded at run time)",
    create
);

fn current(ctxs: &[Ctx], ordinal: u32) -> Result<()> {
    let ctx = ctxs.get(ordinal as usize).ok_or_else(|| {
        Error::new(
            ErrorKind::InvalidRequest,
            format!(
                "there is no cuda:{ordinal} (this machine has {} devices)",
                ctxs.len()
            ),
        )
    })?;
    // SAFETY: a primary context retained at start and never released.
    driver("set context", || unsafe { result::ctx::set_current(ctx.0) })
}

fn run_copy(ctxs: &[Ctx], copy: DeviceCopy) -> Result<()> {
    match copy {
        DeviceCopy::ToDevice {
            ordinal,
            device,
            host,
            len,
        } => {
            current(ctxs, ordinal)?;
            // SAFETY: the submitter guarantees `host..host+len` readable until `done`
            // runs (the `copy` contract) and the device range inside an allocation.
            driver("copy to device", || unsafe {
                result::memcpy_htod_sync(device, std::slice::from_raw_parts(host, len))
            })
        }
        DeviceCopy::ToHost {
            ordinal,
            device,
            host,
            len,
        } => {
            current(ctxs, ordinal)?;
            // SAFETY: as above, with the host range writable.
            driver("copy to host", || unsafe {
                result::memcpy_dtoh_sync(std::slice::from_raw_parts_mut(host, len), device)
            })
        }
    }
}

impl DeviceRuntime for Cuda {
    fn name(&self) -> &str {
        NAME
    }

    fn device_count(&self) -> Result<u32> {
        Ok(self.contexts.len() as u32)
    }

    fn pointer_info(&self, addr: u64) -> Result<PointerInfo> {
        current(&self.contexts, 0)?;
        let mut ordinal: i32 = -1;
        // SAFETY: `ordinal` is a valid out-parameter of the size the attribute writes.
        let r = driver("pointer attribute", || unsafe {
            sys::cuPointerGetAttribute(
                (&mut ordinal as *mut i32).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                addr,
            )
            .result()
        });
        if r.is_err() || ordinal < 0 {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                format!("{addr:#x} is not CUDA device memory"),
            ));
        }
        current(&self.contexts, ordinal as u32)?;
        let (mut base, mut len) = (0, 0usize);
        // SAFETY: valid out-parameters.
        driver("address range", || unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut len, addr).result()
        })?;
        Ok(PointerInfo {
            ordinal: ordinal as u32,
            base,
            len: len as u64,
        })
    }

    fn alloc(&self, ordinal: u32, len: usize) -> Result<u64> {
        current(&self.contexts, ordinal)?;
        // SAFETY: a context is current.
        driver("allocate", || unsafe { result::malloc_sync(len) })
    }

    fn free(&self, ordinal: u32, addr: u64) -> Result<()> {
        current(&self.contexts, ordinal)?;
        // SAFETY: the caller passes an address from `alloc`.
        driver("free", || unsafe { result::free_sync(addr) })
    }

    fn alloc_pinned(&self, len: usize) -> Result<*mut u8> {
        current(&self.contexts, 0)?;
        // SAFETY: a context is current; 1 = CU_MEMHOSTALLOC_PORTABLE, so every context
        // sees the memory as pinned.
        driver("allocate pinned memory", || unsafe {
            result::malloc_host(len, 1)
        })
        .map(|p| p.cast())
    }

    unsafe fn free_pinned(&self, ptr: *mut u8, _len: usize) {
        // SAFETY: the caller passes a pointer from `alloc_pinned`.
        if let Err(e) = driver("free pinned memory", || unsafe {
            result::free_host(ptr.cast())
        }) {
            tracing::warn!(error = %e, "freeing pinned memory failed");
        }
    }

    unsafe fn copy(&self, copy: DeviceCopy, done: CopyDone) -> Result<()> {
        self.jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send((copy, done))
            .map_err(|_| Error::new(ErrorKind::Unavailable, "the CUDA copy thread is gone"))
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
}
