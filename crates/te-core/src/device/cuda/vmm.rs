//! CUDA virtual memory management (VMM): memory from `cuMemCreate`, shared between
//! processes of one host as a POSIX file descriptor.
//!
//! Legacy IPC (`cuIpcGetMemHandle`) covers only `cuMemAlloc` memory. Allocators built
//! on `cuMemCreate` and `cuMemMap` (PyTorch's expandable segments, vLLM's sleep-mode
//! allocator, NCCL's) need the VMM path instead: the exporter retains the allocation's
//! handle and exports it as a descriptor, which travels over the same-host channel's
//! Unix socket; the importer imports the handle, reserves an address range, maps the
//! handle there and grants its device access. Only allocations created with
//! `requestedHandleTypes` including `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` can be
//! exported; the driver refuses the others and te says so.
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
            format!("the VMM allocation at {base:#x} on cuda:{ordinal} cannot be exported as a file descriptor ({code:?}): create it with requestedHandleTypes including CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (PyTorch: expandable segments with IPC handles enabled)"),
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
    let addr = map(mapped, device(ordinal))?;
    Ok((addr, mapped))
}

/// Where device `ordinal`'s memory is.
fn device(ordinal: u32) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal as std::ffi::c_int,
    }
}

/// Maps `mapped`'s handle over a fresh address range with read and write access for
/// the device at `location`. On failure the handle is released too.
fn map(mapped: Mapped, location: sys::CUmemLocation) -> Result<u64> {
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
        let access = sys::CUmemAccessDesc {
            location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range was mapped above; one valid descriptor.
        driver("grant access to an allocation", || unsafe {
            sys::cuMemSetAccess(addr, len, &access, 1).result()
        })
    });
    if let Err(e) = done {
        unmap(addr, mapped);
        return Err(e);
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
    let location = device(ordinal);
    // SAFETY: all zeros is a valid CUmemAllocationProp (every enum field has a 0
    // variant, the pointer is null) and the usual starting point: no flags, no Windows
    // metadata.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = FD;
    prop.location = location;
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
    let len = len.max(1).next_multiple_of(granularity.max(1));
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: valid out-parameter and properties.
    driver("create an allocation", || unsafe {
        sys::cuMemCreate(&mut handle, len, &prop, 0).result()
    })?;
    let addr = map(Mapped { handle, len }, location)?;
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
    // SAFETY: as above.
    driver("free an address range", || unsafe {
        sys::cuMemAddressFree(addr, len).result()
    })
}
