//! CUDA virtual memory management (VMM): memory from `cuMemCreate`, shared between
//! processes of one host as a POSIX file descriptor.
//!
//! Legacy IPC (`cuIpcGetMemHandle`) covers only `cuMemAlloc` memory. Allocators built
//! on `cuMemCreate` and `cuMemMap` (PyTorch's expandable segments, vLLM's sleep-mode
//! allocator, NCCL's) need the VMM path instead: the exporter retains the allocation's
//! handle and exports it as a descriptor, which travels over the same-host channel's
//! Unix socket; the importer imports the handle, reserves an address range, maps the
//! handle there and grants its device (and that device's peers) access. Only
//! allocations created with `requestedHandleTypes` including
//! `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` can be exported; the driver refuses the
//! others and te says so. Memory-pool memory (`cudaMallocAsync`) is refused before its
//! pool's allocation could be exported in its place. An allocation is mapped whole, from
//! its start, as PyTorch's, vLLM's and NCCL's allocators map theirs: the driver cannot
//! say at which offset an exporter mapped it.
//!
//! Every function here expects the device's context to be current (`Cuda::with`).

use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use cudarc::driver::sys;

use super::{driver, failed};
use crate::error::{Error, ErrorKind, Result};

/// A peer's allocation mapped here: what `unmap` needs to undo it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Mapped {
    handle: sys::CUmemGenericAllocationHandle,
    len: usize,
}

const FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

/// Exports the VMM allocation mapped at `base` (the start of its mapping, as
/// `cuMemGetAddressRange` gives it) as a descriptor; `Unsupported` where the memory
/// is not a VMM allocation or was not created exportable as one.
pub(super) fn export(base: u64, ordinal: u32, legacy: sys::CUresult) -> Result<OwnedFd> {
    // Memory-pool memory (`cudaMallocAsync`) is carved out of the pool's own VMM
    // allocations: retaining "its" handle would export the whole pool chunk, mapped
    // elsewhere than the sub-allocation the caller registered.
    let mut pool: *mut c_void = std::ptr::null_mut();
    // SAFETY: this attribute writes a `CUmemoryPool`, a pointer, into `pool`.
    let pooled = driver("read a pointer's memory pool", || unsafe {
        sys::cuPointerGetAttribute(
            (&mut pool as *mut *mut c_void).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
            base,
        )
        .result()
    })
    .is_ok()
        && !pool.is_null();
    if pooled {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!("the allocation at {base:#x} on cuda:{ordinal} is memory-pool memory (cudaMallocAsync), which cannot be shared with another process: legacy CUDA IPC refused it ({legacy:?}); allocate shared memory with cudaMalloc or cuMemCreate"),
        ));
    }
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: a valid out-parameter; the driver checks the address.
    let code = driver("retain an allocation handle", || unsafe {
        Ok(sys::cuMemRetainAllocationHandle(
            &mut handle,
            base as *mut c_void,
        ))
    })?;
    if code != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!("the allocation at {base:#x} on cuda:{ordinal} cannot be shared with another process: legacy CUDA IPC refused it (cuIpcGetMemHandle: {legacy:?}) and it is not a VMM allocation either (cuMemRetainAllocationHandle: {code:?}); memory-pool allocations (cudaMallocAsync) cannot be shared"),
        ));
    }
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: `fd` is the out-parameter a POSIX descriptor export writes; `handle` was
    // retained above and is released right after.
    let code = driver("export an allocation handle", || unsafe {
        Ok(sys::cuMemExportToShareableHandle(
            (&mut fd as *mut std::ffi::c_int).cast(),
            handle,
            FD,
            0,
        ))
    });
    // SAFETY: releases the reference `cuMemRetainAllocationHandle` took; the mapping
    // keeps the allocation alive.
    let _ = driver("release an allocation handle", || unsafe {
        sys::cuMemRelease(handle).result()
    });
    match code? {
        sys::CUresult::CUDA_SUCCESS if fd >= 0 => {
            // SAFETY: the driver created `fd` for us; nothing else owns it.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        }
        code => Err(Error::new(
            ErrorKind::Unsupported,
            format!("the VMM allocation at {base:#x} on cuda:{ordinal} cannot be exported as a file descriptor ({code:?}): its allocator must create it with requestedHandleTypes including CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (PyTorch's expandable segments do unless IPC handles are off or fabric handles were chosen)"),
        )),
    }
}

/// Maps the allocation `fd` names, `len` bytes, with read and write access for device
/// `ordinal`; returns its address here.
pub(super) fn import(fd: &OwnedFd, ordinal: u32, len: u64) -> Result<(u64, Mapped)> {
    let len = usize::try_from(len).map_err(|_| {
        Error::new(
            ErrorKind::InvalidRequest,
            format!("a {len}-byte allocation does not fit this process"),
        )
    })?;
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: a valid out-parameter; for POSIX descriptors the driver takes the
    // descriptor's value in the pointer argument, and dups what it keeps.
    let code = driver("import an allocation handle", || unsafe {
        Ok(sys::cuMemImportFromShareableHandle(
            &mut handle,
            fd.as_raw_fd() as isize as *mut c_void,
            FD,
        ))
    })?;
    if code != sys::CUresult::CUDA_SUCCESS {
        return Err(failed("cuMemImportFromShareableHandle", code));
    }
    let mapped = Mapped { handle, len };
    let addr = map(mapped, ordinal)?;
    Ok((addr, mapped))
}

/// Read and write access for device `id`.
fn read_write(id: std::ffi::c_int) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// The other devices of this process that can reach device `ordinal`'s memory as
/// peers. VMM memory is reachable only by the devices its mapping grants (enabling
/// peer access between contexts does not cover it), and a copy between two GPUs'
/// memory runs on either one.
fn peers_of(ordinal: u32) -> Vec<sys::CUmemAccessDesc> {
    let mut count: std::ffi::c_int = 0;
    let mut owner: sys::CUdevice = 0;
    // SAFETY: valid out-parameters.
    let known = driver("count devices", || unsafe {
        sys::cuDeviceGetCount(&mut count).result()?;
        sys::cuDeviceGet(&mut owner, ordinal as std::ffi::c_int).result()
    });
    if known.is_err() {
        return Vec::new();
    }
    (0..count)
        .filter(|&d| d != ordinal as std::ffi::c_int)
        .filter(|&d| {
            let (mut dev, mut can): (sys::CUdevice, std::ffi::c_int) = (0, 0);
            // SAFETY: valid out-parameters and devices.
            driver("ask about peer access", || unsafe {
                sys::cuDeviceGet(&mut dev, d).result()?;
                sys::cuDeviceCanAccessPeer(&mut can, dev, owner).result()
            })
            .is_ok()
                && can == 1
        })
        .map(read_write)
        .collect()
}

/// Maps `mapped`'s handle over a fresh address range with read and write access for
/// device `ordinal` (which holds the memory) and, where they can have it, its peers.
/// On failure the handle is released too.
fn map(mapped: Mapped, ordinal: u32) -> Result<u64> {
    let Mapped { handle, len } = mapped;
    let mut addr: sys::CUdeviceptr = 0;
    // SAFETY: a valid out-parameter; default alignment, no fixed address.
    let reserved = driver("reserve an address range", || unsafe {
        sys::cuMemAddressReserve(&mut addr, len, 0, 0, 0).result()
    });
    if let Err(e) = reserved {
        release(handle);
        return Err(e);
    }
    // SAFETY: maps the handle over the range just reserved, from its start.
    let done = driver("map an allocation", || unsafe {
        sys::cuMemMap(addr, len, 0, handle, 0).result()
    })
    .and_then(|()| {
        let access = read_write(ordinal as std::ffi::c_int);
        // SAFETY: the range was mapped above; one valid descriptor.
        driver("grant access to an allocation", || unsafe {
            sys::cuMemSetAccess(addr, len, &access, 1).result()
        })
    });
    if let Err(e) = done {
        unmap(addr, mapped);
        return Err(e);
    }
    let peers = peers_of(ordinal);
    if !peers.is_empty() {
        // SAFETY: the range is mapped; `peers` holds `peers.len()` valid descriptors.
        let granted = driver("grant peers access to an allocation", || unsafe {
            sys::cuMemSetAccess(addr, len, peers.as_ptr(), peers.len()).result()
        });
        if let Err(e) = granted {
            // The memory still works from its own device; a copy from another GPU
            // then fails with the driver's error.
            tracing::warn!(error = %e, ordinal, "peer devices were not granted access to a VMM mapping");
        }
    }
    Ok(addr)
}

/// Undoes `import` (or a `map` that failed part way): unmaps the range, frees the
/// reservation, releases the handle. Copies on it must have completed.
pub(super) fn unmap(addr: u64, mapped: Mapped) {
    // SAFETY: `addr` is the reservation `map` made for `mapped.len` bytes; an unmap of
    // a range never mapped (`cuMemMap` failed) fails harmlessly.
    let _ = driver("unmap an imported allocation", || unsafe {
        sys::cuMemUnmap(addr, mapped.len).result()
    });
    // SAFETY: as above.
    let _ = driver("free an address range", || unsafe {
        sys::cuMemAddressFree(addr, mapped.len).result()
    });
    release(mapped.handle);
}

fn release(handle: sys::CUmemGenericAllocationHandle) {
    // SAFETY: a handle this process holds a reference to, released once.
    let _ = driver("release an allocation handle", || unsafe {
        sys::cuMemRelease(handle).result()
    });
}

/// Allocates `len` bytes (rounded up to the device's granularity) on device `ordinal`
/// with `cuMemCreate`, exportable as a descriptor, mapped with read and write access:
/// memory as PyTorch's expandable segments make it. Returns its address and length.
pub(super) fn alloc(ordinal: u32, len: usize) -> Result<(u64, usize)> {
    // SAFETY: all zeros is a valid CUmemAllocationProp (every enum field has a 0
    // variant, the pointer is null) and the usual starting point: no flags, no Windows
    // metadata.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = FD;
    prop.location = sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal as std::ffi::c_int,
    };
    // Registrable for GPUDirect RDMA (te-rdma) where the device supports it for VMM
    // memory, as PyTorch and NCCL ask for it.
    let mut rdma: std::ffi::c_int = 0;
    // SAFETY: valid out-parameters and attribute.
    let _ = driver("read a device attribute", || unsafe {
        let mut dev: sys::CUdevice = 0;
        sys::cuDeviceGet(&mut dev, ordinal as std::ffi::c_int).result()?;
        sys::cuDeviceGetAttribute(
            &mut rdma,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
            dev,
        )
        .result()
    });
    prop.allocFlags.gpuDirectRDMACapable = u8::from(rdma == 1);
    let mut granularity = 0usize;
    // SAFETY: valid out-parameter and properties.
    driver("read the allocation granularity", || unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
        .result()
    })?;
    let len = len
        .max(1)
        .checked_next_multiple_of(granularity.max(1))
        .ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidRequest,
                format!("{len} bytes cannot be rounded up to the allocation granularity"),
            )
        })?;
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: valid out-parameter and properties.
    driver("create an allocation", || unsafe {
        sys::cuMemCreate(&mut handle, len, &prop, 0).result()
    })?;
    let addr = map(Mapped { handle, len }, ordinal)?;
    // The mapping holds the allocation from here: `free` has nothing to release but
    // the mapping.
    release(handle);
    Ok((addr, len))
}

/// Frees what `alloc` returned.
pub(super) fn free(addr: u64, len: usize) -> Result<()> {
    // SAFETY: `addr`+`len` is a range `alloc` mapped and reserved; the caller's copies
    // on it have completed. Unmapping drops the allocation's last reference.
    driver("unmap an allocation", || unsafe {
        sys::cuMemUnmap(addr, len).result()
    })?;
    // SAFETY: as above. (A range still mapped keeps its reservation: it leaks.)
    driver("free an address range", || unsafe {
        sys::cuMemAddressFree(addr, len).result()
    })
}
