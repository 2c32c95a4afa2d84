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
//! symbol is an `Unavailable` error, never a panic.
//!
//! Copies are asynchronous. Each device has a stream per direction (host → device,
//! device → host, device → device); a group of copies is enqueued on its stream with
//! `cuMemcpy*Async` by the caller's thread, without waiting, and one event
//! (`CU_EVENT_BLOCKING_SYNC`) is recorded after it. A waiter thread per stream blocks in
//! `cuEventSynchronize` — the driver puts it to sleep, nothing spins — and runs the
//! group's completion. So a group of copies costs one synchronisation, and the two
//! directions never wait for each other. Device-to-device copies between two devices
//! use `cuMemcpyPeerAsync`.
//!
//! Contexts: a device's primary context (and its streams and waiters) is set up the
//! first time te uses that device, not when the runtime starts, so `te info` or an
//! engine that never touches a GPU retains none; and every driver call pushes it and
//! pops it again (`cuCtxPushCurrent` / `cuCtxPopCurrent`), so the calling thread's
//! current context — a framework's own — is the same after the call as before.

use crate::sync::Mutex;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys};

use crate::device::{CopyDone, DeviceCopy, DeviceRuntime, Group, PointerInfo};
use crate::error::{Error, ErrorKind, Result};

/// The runtime's name.
pub const NAME: &str = "cuda";

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
    done: CopyDone,
}

/// One device, set up on first use: its context, a stream per direction, and a waiter
/// thread per stream.
#[derive(Debug)]
struct Device {
    ctx: Ctx,
    streams: [Handle<sys::CUstream>; 3],
    waiters: [Mutex<Sender<Waiting>>; 3],
    events: Arc<Mutex<Vec<Handle<sys::CUevent>>>>,
}

impl std::fmt::Debug for Waiting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Waiting")
    }
}

/// The CUDA runtime.
#[derive(Debug)]
pub struct Cuda {
    devices: Vec<OnceLock<std::result::Result<Arc<Device>, Error>>>,
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
    fn start(ordinal: u32) -> Result<Arc<Device>> {
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
        let events = Arc::new(Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for dir in 0..3 {
            let (tx, rx) = mpsc::channel::<Waiting>();
            let pool = events.clone();
            std::thread::Builder::new()
                .name(format!("te-cuda-{ordinal}-{dir}"))
                .spawn(move || wait_loop(ctx, rx, &pool))
                .map_err(|e| {
                    Error::new(ErrorKind::Io, "cannot start a CUDA waiter thread").with_source(e)
                })?;
            waiters.push(Mutex::new(tx));
        }
        let waiters: [Mutex<Sender<Waiting>>; 3] = waiters
            .try_into()
            .map_err(|_| Error::new(ErrorKind::Backend, "three waiters"))?;
        Ok(Arc::new(Device {
            ctx,
            streams,
            waiters,
            events,
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

/// A waiter thread: sleeps in the driver until each group's event, then completes it.
fn wait_loop(ctx: Ctx, rx: mpsc::Receiver<Waiting>, pool: &Mutex<Vec<Handle<sys::CUevent>>>) {
    for w in rx {
        let r = with_ctx(ctx, || {
            // SAFETY: an event recorded on this device's stream and not yet reused.
            driver("wait for copies", || unsafe {
                sys::cuEventSynchronize(w.event.0).result()
            })
        });
        pool.lock().push(w.event);
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

fn create(_table: &toml::Table) -> Result<Arc<dyn DeviceRuntime>> {
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
    Ok(Arc::new(Cuda {
        devices: (0..count).map(|_| OnceLock::new()).collect(),
    }))
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
    loaded_with = ["libcuda.so.1", "libcuda.so"]
);

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
        slot.get_or_init(|| Device::start(ordinal)).clone()
    }

    /// Runs `f` with device `ordinal`'s context current, restoring the caller's.
    fn with<T>(&self, ordinal: u32, f: impl FnOnce() -> Result<T>) -> Result<T> {
        with_ctx(self.device(ordinal)?.ctx, f)
    }

    /// Enqueues one part of a group (copies of one device and direction) and hands its
    /// event to the stream's waiter.
    ///
    /// # Safety
    /// As [`DeviceRuntime::copy`], for every copy.
    unsafe fn enqueue(&self, ordinal: u32, dir: usize, copies: &[DeviceCopy], done: CopyDone) {
        let dev = match self.device(ordinal) {
            Ok(d) => d,
            Err(e) => return done(Err(e)),
        };
        let stream = dev.streams[dir];
        let r = with_ctx(dev.ctx, || {
            let mut error = None;
            for c in copies {
                // SAFETY: forwarded from the caller.
                if let Err(e) = unsafe { self.start_copy(*c, stream) } {
                    error = Some(e);
                    break;
                }
            }
            let event = dev.event()?;
            // SAFETY: a context is current; the event and stream are this device's.
            driver("record event", || unsafe {
                sys::cuEventRecord(event.0, stream.0).result()
            })?;
            Ok((event, error))
        });
        match r {
            Ok((event, error)) => {
                let sent = dev.waiters[dir].lock().send(Waiting { event, error, done });
                if let Err(mpsc::SendError(w)) = sent {
                    (w.done)(Err(Error::new(
                        ErrorKind::Unavailable,
                        "a CUDA waiter thread is gone",
                    )));
                }
            }
            // No event: wait for the stream here, so that nothing enqueued can still
            // touch the memory when `done` runs.
            Err(e) => {
                let _ = with_ctx(dev.ctx, || {
                    // SAFETY: a context is current; the stream is this device's.
                    driver("wait for the stream", || unsafe {
                        sys::cuStreamSynchronize(stream.0).result()
                    })
                });
                done(Err(e));
            }
        }
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
        // SAFETY: a context is current inside `with`.
        self.with(ordinal, || {
            driver("allocate", || unsafe { result::malloc_sync(len) })
        })
    }

    fn free(&self, ordinal: u32, addr: u64) -> Result<()> {
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

    unsafe fn copy(&self, copy: DeviceCopy, done: CopyDone) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { self.copy_group(&[copy], done) }
    }

    unsafe fn copy_group(&self, copies: &[DeviceCopy], done: CopyDone) -> Result<()> {
        // One part per device and direction; each synchronises once.
        let mut parts: Vec<((u32, usize), Vec<DeviceCopy>)> = Vec::new();
        for c in copies {
            let key = c.queue();
            self.device(key.0)?;
            match parts.iter_mut().find(|p| p.0 == key) {
                Some(p) => p.1.push(*c),
                None => parts.push((key, vec![*c])),
            }
        }
        if parts.is_empty() {
            done(Ok(()));
            return Ok(());
        }
        let group = Group::new(parts.len(), done);
        for ((ordinal, dir), part) in parts {
            let g = group.clone();
            // SAFETY: forwarded from the caller.
            unsafe { self.enqueue(ordinal, dir, &part, Box::new(move |r| g.arrive(r))) };
        }
        Ok(())
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
