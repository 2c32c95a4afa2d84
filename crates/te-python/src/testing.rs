//! Memory of te's fake device (`fakedev`), for tests of code that registers device
//! memory without saying where it lives: `te.testing` wraps these. fakedev memory is
//! host memory behind addresses the host cannot dereference, so it is reached only
//! through these calls (and te's transfers).

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use te::backend::device::{DeviceCopy, DeviceRuntime};

use te::ErrorKind;

use crate::errors::{te_err, IntoPy};

fn fakedev() -> PyResult<Arc<dyn DeviceRuntime>> {
    te::backend::device::runtime("fakedev").py_err()
}

/// Allocates `nbytes` of fake device memory on device `ordinal`; returns its address.
#[pyfunction]
#[pyo3(signature = (nbytes, ordinal=0))]
pub(crate) fn fakedev_alloc(py: Python<'_>, nbytes: usize, ordinal: u32) -> PyResult<u64> {
    py.allow_threads(|| fakedev()?.alloc(ordinal, nbytes).py_err())
}

/// Frees memory from `fakedev_alloc` (its start address).
#[pyfunction]
pub(crate) fn fakedev_free(py: Python<'_>, ptr: u64) -> PyResult<()> {
    py.allow_threads(|| {
        let rt = fakedev()?;
        let info = rt.pointer_info(ptr).py_err()?;
        rt.free(info.ordinal, ptr).py_err()
    })
}

/// Copies between fake device memory at `ptr` and host memory, waiting until done.
///
/// # Safety
/// The host range `make` names is valid for the copy's direction and untouched by
/// anyone else until this returns (the copy has completed by then).
unsafe fn copy(ptr: u64, make: impl FnOnce(u32) -> DeviceCopy) -> PyResult<()> {
    let rt = fakedev()?;
    let info = rt.pointer_info(ptr).py_err()?;
    // SAFETY: the host range is the caller's promise; fakedev refuses a device range
    // outside its allocation.
    unsafe { rt.copy_sync(make(info.ordinal)) }.py_err()
}

/// Copies `data` to fake device memory at `ptr`.
#[pyfunction]
pub(crate) fn fakedev_write(py: Python<'_>, ptr: u64, data: Vec<u8>) -> PyResult<()> {
    py.allow_threads(|| {
        let to_device = |ordinal| DeviceCopy::ToDevice {
            ordinal,
            device: ptr,
            host: data.as_ptr(),
            len: data.len(),
        };
        // SAFETY: `data` is readable and only read until the copy returns.
        unsafe { copy(ptr, to_device) }
    })
}

/// Copies `nbytes` of fake device memory at `ptr` into a new `bytes`. A range past
/// the end of its allocation is refused before any host memory is allocated for it.
#[pyfunction]
pub(crate) fn fakedev_read(py: Python<'_>, ptr: u64, nbytes: usize) -> PyResult<Py<PyBytes>> {
    let info = fakedev()?.pointer_info(ptr).py_err()?;
    if !te::backend::kit::fits(ptr.wrapping_sub(info.base), nbytes as u64, info.len) {
        return Err(te_err(
            ErrorKind::OutOfBounds,
            "fakedev read",
            format!(
                "a read of {nbytes} bytes at {ptr:#x} runs past its {}-byte fakedev allocation",
                info.len
            ),
        ));
    }
    let mut out = vec![0u8; nbytes];
    // An address, so the closure can cross to the thread that runs without the GIL.
    let host = out.as_mut_ptr() as usize;
    py.allow_threads(|| {
        let to_host = |ordinal| DeviceCopy::ToHost {
            ordinal,
            device: ptr,
            host: host as *mut u8,
            len: nbytes,
        };
        // SAFETY: `out` is writable and untouched until the copy returns.
        unsafe { copy(ptr, to_host) }
    })?;
    Ok(PyBytes::new(py, &out).unbind())
}
