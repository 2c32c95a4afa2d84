//! te for Python: the native extension module `te._te`.
//!
//! The `te` package (python/te) wraps these classes: `te.Engine` adds tensor and
//! KV-cache registration on top of [`engine::PyEngine`], and `te.mooncake` offers
//! Mooncake's `TransferEngine` calls over it. Every call that can block releases the
//! GIL; every te error becomes an exception of the `te.Error` family (see
//! [`errors`]); nothing panics into the interpreter.

#![deny(missing_docs, unsafe_op_in_unsafe_fn)]

mod addrs;
mod args;
mod engine;
mod errors;
mod handle;
mod notifier;
mod peer;
mod registration;
mod testing;
mod wait;

use pyo3::prelude::*;

/// The module `te._te`.
#[pymodule]
fn _te(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<engine::PyEngine>()?;
    m.add_class::<peer::PyPeer>()?;
    m.add_class::<registration::PyRegistration>()?;
    m.add_class::<handle::PyHandle>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(errors::error_kinds, m)?)?;
    m.add_function(wrap_pyfunction!(testing::fakedev_alloc, m)?)?;
    m.add_function(wrap_pyfunction!(testing::fakedev_free, m)?)?;
    m.add_function(wrap_pyfunction!(testing::fakedev_write, m)?)?;
    m.add_function(wrap_pyfunction!(testing::fakedev_read, m)?)?;
    Ok(())
}
