//! [`Buffer`]: memory the engine allocates and registers for its user, on the host or
//! on a device.

use std::alloc::Layout;
use std::mem::ManuallyDrop;
use std::sync::Arc;

use crate::desc::{Access, MemoryDesc, MemoryKind, RegionId};
use crate::device::{self, DeviceCopy, DeviceRuntime};
use crate::engine::{Engine, Registration};
use crate::error::{Error, ErrorKind, Result};

enum Mem {
    Host {
        ptr: *mut u8,
        layout: Layout,
    },
    Device {
        runtime: Arc<dyn DeviceRuntime>,
        ordinal: u32,
        addr: u64,
    },
}

/// Zeroed memory allocated for the engine's user and registered with the engine;
/// deregistered, then freed, when dropped.
///
/// `read` and `write` copy in and out (through the device runtime for device memory);
/// no reference into the memory is ever handed out, since peers may write it at any time.
pub struct Buffer {
    reg: ManuallyDrop<Registration>,
    mem: Mem,
}

// SAFETY: the buffer owns its allocation; access goes through `read`/`write`, which
// copy with raw pointers or the runtime, so sharing it between threads creates no
// references that could alias the backend's concurrent access.
unsafe impl Send for Buffer {}
// SAFETY: as above.
unsafe impl Sync for Buffer {}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("region", self.reg.region())
            .finish()
    }
}

impl Engine {
    /// Allocates `len` zeroed, page-aligned bytes of host memory and registers them.
    ///
    /// # Errors
    /// As [`Engine::register`]; `InvalidRequest` for zero length.
    pub fn alloc(&self, name: &str, len: usize, access: Access) -> Result<Buffer> {
        self.alloc_on(&MemoryKind::Host, name, len, access)
    }

    /// Allocates `len` zeroed bytes of memory of `kind` (host, or a device through its
    /// runtime) and registers them.
    ///
    /// # Errors
    /// As [`Engine::alloc`]; `Unsupported` or `Unavailable` if the device runtime is
    /// unknown or cannot run here.
    pub fn alloc_on(
        &self,
        kind: &MemoryKind,
        name: &str,
        len: usize,
        access: Access,
    ) -> Result<Buffer> {
        // SAFETY: the buffer owns the memory and keeps it until its registration is
        // deregistered (it drops the registration first).
        Buffer::new(kind, name, len, access, |desc| unsafe {
            self.register(desc)
        })
    }
}

impl Buffer {
    pub(crate) fn new(
        kind: &MemoryKind,
        name: &str,
        len: usize,
        access: Access,
        register: impl FnOnce(MemoryDesc) -> Result<Registration>,
    ) -> Result<Buffer> {
        if len == 0 {
            return Err(
                Error::new(ErrorKind::InvalidRequest, "a buffer must not be empty")
                    .with_operation("alloc"),
            );
        }
        let mem = match kind {
            MemoryKind::Auto => {
                return Err(Error::new(
                    ErrorKind::InvalidRequest,
                    "`auto` says what existing memory is; to allocate, name `host` or a device (`cuda:0`)",
                )
                .with_operation("alloc"))
            }
            MemoryKind::Host => {
                let layout = Layout::from_size_align(len, 4096).map_err(|_| {
                    Error::new(
                        ErrorKind::InvalidRequest,
                        format!("cannot allocate {len} bytes"),
                    )
                    .with_operation("alloc")
                })?;
                // SAFETY: the layout has a non-zero size.
                let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
                if ptr.is_null() {
                    return Err(Error::new(
                        ErrorKind::Io,
                        format!("out of memory allocating {len} bytes"),
                    )
                    .with_operation("alloc"));
                }
                Mem::Host { ptr, layout }
            }
            MemoryKind::Device { runtime, ordinal } => {
                let runtime = device::runtime(runtime).map_err(|e| e.with_operation("alloc"))?;
                let addr = runtime
                    .alloc(*ordinal, len)
                    .map_err(|e| e.with_operation("alloc"))?;
                Mem::Device {
                    runtime,
                    ordinal: *ordinal,
                    addr,
                }
            }
        };
        let addr = match &mem {
            Mem::Host { ptr, .. } => *ptr as u64,
            Mem::Device { addr, .. } => *addr,
        };
        let desc = MemoryDesc {
            name: name.to_string(),
            addr,
            len: len as u64,
            kind: kind.clone(),
            access,
        };
        match register(desc) {
            Ok(reg) => Ok(Buffer {
                reg: ManuallyDrop::new(reg),
                mem,
            }),
            Err(e) => {
                free(mem);
                Err(e)
            }
        }
    }

    /// The region's id, for requests.
    pub fn id(&self) -> RegionId {
        self.reg.id()
    }

    /// The registration.
    pub fn registration(&self) -> &Registration {
        &self.reg
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.reg.region().len as usize
    }

    /// Always false: buffers are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The start address: a host pointer for host memory, a device address (not to be
    /// dereferenced by the host) for device memory.
    pub fn as_ptr(&self) -> *mut u8 {
        self.reg.region().addr as *mut u8
    }

    fn range(&self, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_some_and(|e| e <= self.len()) {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::OutOfBounds,
                format!(
                    "range {offset}+{len} is outside the {}-byte buffer",
                    self.len()
                ),
            ))
        }
    }

    /// Copies `data` into the buffer at `offset`.
    ///
    /// # Errors
    /// `OutOfBounds` if it does not fit; the device runtime's error for device memory.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.range(offset, data.len())?;
        match &self.mem {
            // SAFETY: the range is inside the allocation; `data` cannot overlap it, since
            // no reference into the buffer is ever handed out.
            Mem::Host { ptr, .. } => unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), ptr.add(offset), data.len())
            },
            Mem::Device {
                runtime,
                ordinal,
                addr,
            } => {
                let copy = DeviceCopy::ToDevice {
                    ordinal: *ordinal,
                    device: addr + offset as u64,
                    host: data.as_ptr(),
                    len: data.len(),
                };
                // SAFETY: `data` is borrowed until the copy has completed (`copy_sync`
                // returns only then), and the device range is inside this buffer's
                // allocation.
                unsafe { runtime.copy_sync(copy)? }
            }
        }
        Ok(())
    }

    /// Copies bytes at `offset` out into `out`.
    ///
    /// # Errors
    /// `OutOfBounds` if the range does not fit; the device runtime's error.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.range(offset, out.len())?;
        match &self.mem {
            // SAFETY: as in `write`.
            Mem::Host { ptr, .. } => unsafe {
                std::ptr::copy_nonoverlapping(ptr.add(offset), out.as_mut_ptr(), out.len())
            },
            Mem::Device {
                runtime,
                ordinal,
                addr,
            } => {
                let copy = DeviceCopy::ToHost {
                    ordinal: *ordinal,
                    device: addr + offset as u64,
                    host: out.as_mut_ptr(),
                    len: out.len(),
                };
                // SAFETY: `out` is borrowed mutably until the copy has completed.
                unsafe { runtime.copy_sync(copy)? }
            }
        }
        Ok(())
    }

    /// A copy of the whole buffer.
    ///
    /// # Errors
    /// The device runtime's error for device memory.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0; self.len()];
        self.read(0, &mut v)?;
        Ok(v)
    }
}

fn free(mem: Mem) {
    match mem {
        // SAFETY: allocated in `Buffer::new` with this layout and no longer registered.
        Mem::Host { ptr, layout } => unsafe { std::alloc::dealloc(ptr, layout) },
        Mem::Device {
            runtime,
            ordinal,
            addr,
        } => {
            if let Err(e) = runtime.free(ordinal, addr) {
                tracing::warn!(error = %e, "freeing device memory failed");
            }
        }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: taken exactly once, here; `self.reg` is not used afterwards.
        let reg = unsafe { ManuallyDrop::take(&mut self.reg) };
        let (id, len) = (reg.id(), reg.region().len);
        let mem = std::mem::replace(
            &mut self.mem,
            Mem::Host {
                ptr: std::ptr::null_mut(),
                layout: Layout::new::<u8>(),
            },
        );
        // Deregistering first guarantees the backend no longer touches the memory when
        // it is freed; if the backend cannot promise that, the memory is never freed.
        if let Err(e) = reg.deregister() {
            tracing::error!(region = %id, bytes = len, error = %e, "deregistration failed: the buffer's memory is quarantined (leaked) so that no late transfer lands in freed memory");
            std::mem::forget(mem);
            return;
        }
        if let Mem::Host { ptr, .. } = &mem {
            if ptr.is_null() {
                return;
            }
        }
        free(mem);
    }
}
