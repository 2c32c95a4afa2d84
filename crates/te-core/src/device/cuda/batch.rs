//! `cuMemcpyBatchAsync`: a group of host ↔ device copies in one driver call (CUDA 12.8).
//!
//! te looks the symbol up in the loaded driver itself rather than through cudarc's
//! binding, which panics on a driver without it: an older driver is a fallback (a loop
//! of single copies), not an error. CUDA 13 added `cuMemcpyBatchAsync_v2` (the same
//! without `failIdx`) and kept the 12.8 symbol; the newest one present is used. The
//! attribute structure is declared here, checked against cudarc's declaration in a test.

use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::driver::sys;

use crate::error::{Error, ErrorKind, Result};

use super::Range;

/// `CUmemLocation`: where an operand lives (a hint the driver uses for managed memory).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct Location {
    /// `CUmemLocationType`: 1 a device, 2 the host.
    kind: u32,
    /// The device's ordinal (ignored for the host).
    id: i32,
}

/// `CUmemcpyAttributes`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct Attributes {
    /// `CUmemcpySrcAccessOrder`: 1 = `CU_MEMCPY_SRC_ACCESS_ORDER_STREAM`, the source is
    /// read in stream order, as any async copy's.
    src_access_order: u32,
    src_loc_hint: Location,
    dst_loc_hint: Location,
    flags: u32,
}

const LOCATION_DEVICE: u32 = 1;
const LOCATION_HOST: u32 = 2;
const ACCESS_ORDER_STREAM: u32 = 1;

type V1 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut Attributes,
    *mut usize,
    usize,
    *mut usize,
    sys::CUstream,
) -> sys::CUresult;
type V2 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut Attributes,
    *mut usize,
    usize,
    sys::CUstream,
) -> sys::CUresult;

/// The driver's batched copy, as found.
#[derive(Debug, Clone, Copy)]
pub(super) enum BatchCall {
    /// `cuMemcpyBatchAsync` (CUDA 12.8).
    V1(V1),
    /// `cuMemcpyBatchAsync_v2` (CUDA 13).
    V2(V2),
}

impl BatchCall {
    /// The batched call of the loaded driver, if it has one.
    pub(super) fn find() -> Option<BatchCall> {
        catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: the runtime checked the library is present before; the symbols'
            // types are the driver's signatures for these names.
            let lib = unsafe { sys::culib() };
            // SAFETY: as above.
            if let Ok(f) = unsafe { lib.get::<V2>(b"cuMemcpyBatchAsync_v2\0") } {
                return Some(BatchCall::V2(*f));
            }
            // SAFETY: as above.
            unsafe { lib.get::<V1>(b"cuMemcpyBatchAsync\0") }
                .ok()
                .map(|f| BatchCall::V1(*f))
        }))
        .ok()
        .flatten()
    }

    /// The symbol's name, for `te info`.
    pub(super) fn name(&self) -> &'static str {
        match self {
            BatchCall::V1(_) => "cuMemcpyBatchAsync",
            BatchCall::V2(_) => "cuMemcpyBatchAsync_v2",
        }
    }

    /// Enqueues `ranges` (direction `dir`: 0 host → device, 1 device → host, 2 device
    /// → device, all on device `ordinal`) on `stream` with one call.
    ///
    /// # Safety
    /// Every range is valid for the copy until the stream has passed it; a context of
    /// `stream`'s device is current.
    ///
    /// # Errors
    /// The driver's refusal (nothing of the group is known to be enqueued then).
    pub(super) unsafe fn call(
        &self,
        ranges: &[Range],
        dir: usize,
        ordinal: u32,
        stream: sys::CUstream,
    ) -> Result<()> {
        let device = Location {
            kind: LOCATION_DEVICE,
            id: ordinal as i32,
        };
        let host = Location {
            kind: LOCATION_HOST,
            id: 0,
        };
        let (src, dst) = match dir {
            0 => (host, device),
            1 => (device, host),
            _ => (device, device),
        };
        let mut attrs = [Attributes {
            src_access_order: ACCESS_ORDER_STREAM,
            src_loc_hint: src,
            dst_loc_hint: dst,
            flags: 0,
        }];
        let mut idxs = [0usize];
        let mut dsts: Vec<u64> = ranges.iter().map(|r| r.dst).collect();
        let mut srcs: Vec<u64> = ranges.iter().map(|r| r.src).collect();
        let mut sizes: Vec<usize> = ranges.iter().map(|r| r.len).collect();
        let mut fail = usize::MAX;
        let n = ranges.len();
        // SAFETY: the arrays hold `n` entries each and live through the call, which
        // reads them before it returns; one attribute applies from copy 0 on.
        let r = unsafe {
            match self {
                BatchCall::V1(f) => f(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    n,
                    attrs.as_mut_ptr(),
                    idxs.as_mut_ptr(),
                    1,
                    &mut fail,
                    stream,
                ),
                BatchCall::V2(f) => f(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    n,
                    attrs.as_mut_ptr(),
                    idxs.as_mut_ptr(),
                    1,
                    stream,
                ),
            }
        };
        if r == sys::CUresult::CUDA_SUCCESS {
            return Ok(());
        }
        let at = if fail == usize::MAX {
            String::new()
        } else {
            format!(" at copy {fail} of {n}")
        };
        Err(Error::new(
            ErrorKind::Backend,
            format!("CUDA {} failed{at}: {r:?}", self.name()),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn the_attribute_layout_is_the_driver_headers() {
        assert_eq!(
            size_of::<Attributes>(),
            size_of::<sys::CUmemcpyAttributes>()
        );
        assert_eq!(
            offset_of!(Attributes, src_loc_hint),
            offset_of!(sys::CUmemcpyAttributes, srcLocHint)
        );
        assert_eq!(
            offset_of!(Attributes, dst_loc_hint),
            offset_of!(sys::CUmemcpyAttributes, dstLocHint)
        );
        assert_eq!(
            offset_of!(Attributes, flags),
            offset_of!(sys::CUmemcpyAttributes, flags)
        );
        assert_eq!(size_of::<Location>(), size_of::<sys::CUmemLocation>());
        assert_eq!(
            sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST as u32,
            LOCATION_HOST
        );
        assert_eq!(
            sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as u32,
            LOCATION_DEVICE
        );
        assert_eq!(
            sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM as u32,
            ACCESS_ORDER_STREAM
        );
    }
}
