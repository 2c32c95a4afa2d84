//! CUDA memory for the NIC: DMA-BUF export through the driver
//! (`cuMemGetHandleForAddressRange`, loaded at run time through cudarc), with plain
//! `ibv_reg_mr` (nvidia-peermem) as the fallback the backend tries next.

use te_core::{Error, ErrorKind, Result};

/// The page-aligned span a DMA-BUF export needs around `addr..addr+len`: (aligned base,
/// aligned length, offset of `addr` within it). The driver exports whole pages only.
pub(crate) fn page_span(addr: u64, len: u64, page: u64) -> (u64, u64, u64) {
    let base = addr & !(page - 1);
    let end = (addr + len).div_ceil(page) * page;
    (base, end - base, addr - base)
}

/// An exported DMA-BUF and where the registered range starts within it.
#[derive(Debug)]
pub(crate) struct DmaBuf {
    pub(crate) fd: std::os::fd::OwnedFd,
    pub(crate) offset: u64,
}

/// Checks that `addr..addr+len` is CUDA memory of device `ordinal`.
///
/// # Errors
/// `Unavailable` without a driver; `InvalidRequest` if the range is not one allocation
/// of that device.
pub(crate) fn check_pointer(ordinal: u32, addr: u64, len: u64) -> Result<()> {
    let rt = te_core::device::runtime("cuda").map_err(|e| {
        Error::new(
            e.kind(),
            format!(
                "cannot register cuda:{ordinal} memory for RDMA: {}",
                e.message()
            ),
        )
    })?;
    let info = rt.pointer_info(addr)?;
    if info.ordinal != ordinal || addr + len > info.base + info.len {
        return Err(Error::new(
            ErrorKind::InvalidRequest,
            format!(
                "{addr:#x}+{len} is not within one allocation of cuda:{ordinal} (it lies on cuda:{} in {:#x}+{})",
                info.ordinal, info.base, info.len
            ),
        ));
    }
    Ok(())
}

/// Exports `addr..addr+len` of device `ordinal` as a DMA-BUF.
///
/// # Errors
/// `Unavailable` without a driver or with one lacking the call; `Backend` if the driver
/// refuses (no DMA-BUF support: kernel or driver too old, or the memory kind).
pub(crate) fn export_dmabuf(ordinal: u32, addr: u64, len: u64) -> Result<DmaBuf> {
    use cudarc::driver::{result, sys};
    use std::os::fd::FromRawFd;
    use std::panic::{catch_unwind, AssertUnwindSafe};

    // SAFETY: only tries to open the library by its usual names.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::new(
            ErrorKind::Unavailable,
            "libcuda.so not found: no NVIDIA driver on this machine",
        ));
    }
    // SAFETY: sysconf has no preconditions.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    let (base, span, offset) = page_span(addr, len, page);
    let call = || -> std::result::Result<i32, result::DriverError> {
        result::init()?;
        let dev = result::device::get(ordinal as i32)?;
        // SAFETY: a valid device; the primary context is retained for the process's
        // life (te-core's runtime holds it too), so making it current is sound.
        unsafe {
            let ctx = result::primary_ctx::retain(dev)?;
            result::ctx::set_current(ctx)?;
        }
        let mut fd: i32 = -1;
        // SAFETY: `fd` is a valid out-parameter of the size the DMA-BUF handle type
        // writes; the range was checked to lie in one allocation by `check_pointer`.
        unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut i32).cast(),
                base,
                span as usize,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
            .result()?;
        }
        Ok(fd)
    };
    match catch_unwind(AssertUnwindSafe(call)) {
        Ok(Ok(fd)) if fd >= 0 => Ok(DmaBuf {
            // SAFETY: the driver handed us a new file descriptor we now own.
            fd: unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) },
            offset,
        }),
        Ok(Ok(fd)) => Err(Error::new(
            ErrorKind::Backend,
            format!("cuMemGetHandleForAddressRange returned fd {fd}"),
        )),
        Ok(Err(e)) => Err(Error::new(
            ErrorKind::Backend,
            format!("DMA-BUF export of cuda:{ordinal} {addr:#x}+{len} failed: {e}"),
        )),
        Err(_) => Err(Error::new(
            ErrorKind::Unavailable,
            "the NVIDIA driver lacks cuMemGetHandleForAddressRange (CUDA 11.7 or later is needed for DMA-BUF)",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dmabuf_span_covers_whole_pages_around_the_range() {
        assert_eq!(page_span(0x10000, 0x1000, 0x1000), (0x10000, 0x1000, 0));
        assert_eq!(page_span(0x10010, 0x10, 0x1000), (0x10000, 0x1000, 0x10));
        assert_eq!(page_span(0x10ff0, 0x20, 0x1000), (0x10000, 0x2000, 0xff0));
    }

    #[test]
    fn without_a_driver_cuda_memory_is_refused_with_a_reason_not_a_panic() {
        // SAFETY: only probes for the library.
        if unsafe { cudarc::driver::sys::is_culib_present() } {
            return; // A GPU machine: covered by the ignored GPU test.
        }
        let e = check_pointer(0, 0x1000, 16).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        assert!(e.to_string().contains("cuda:0"), "{e}");
        assert!(e.to_string().contains("libcuda.so"), "{e}");
        let e = export_dmabuf(0, 0x1000, 16).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable);
    }

    /// Needs an NVIDIA GPU: `cargo test -p te-rdma -- --ignored gpu`. Registers device
    /// memory with the driver and exports it as a DMA-BUF, the last step before
    /// `ibv_reg_dmabuf_mr` (which needs a NIC).
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_device_memory_exports_as_a_dmabuf() {
        let rt = te_core::device::runtime("cuda").expect("a CUDA driver");
        let len = 4 << 20;
        let addr = rt.alloc(0, len).expect("cuMemAlloc");
        check_pointer(0, addr + 4096, 65536).expect("inside the allocation");
        let e = check_pointer(0, addr, len as u64 + 1).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{e}");
        let buf = export_dmabuf(0, addr + 100, 65536).expect("DMA-BUF export");
        assert_eq!(buf.offset, 100);
        // SAFETY: `stat` is plain data; all-zero is a valid value.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat on a descriptor we own, into a valid stat.
        assert_eq!(
            unsafe { libc::fstat(std::os::fd::AsRawFd::as_raw_fd(&buf.fd), &mut st) },
            0
        );
        drop(buf);
        rt.free(0, addr).expect("cuMemFree");
    }
}
