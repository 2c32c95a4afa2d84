//! te errors as Python exceptions.
//!
//! The exception classes live in `te/errors.py` (so `te.TimeoutError` can also be a
//! builtin `TimeoutError`); this module looks the class up by the error's kind and
//! raises it with the error's one-line message and `.kind` set. If the package is not
//! importable (the extension loaded on its own), a `RuntimeError` carries the message.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use te::{Error, ErrorKind};

/// Every error kind's name, in code order: what `te.errors` builds its classes from.
#[pyfunction]
pub(crate) fn error_kinds() -> Vec<&'static str> {
    // Unknown codes map to `Backend`, whose own code differs from theirs.
    (1..=255)
        .map(ErrorKind::from_code)
        .enumerate()
        .filter(|(i, k)| k.code() as usize == i + 1)
        .map(|(_, k)| k.as_str())
        .collect()
}

/// The Python exception for a te error.
pub(crate) fn to_py(e: Error) -> PyErr {
    Python::with_gil(|py| {
        let message = e.to_string();
        let kind = e.kind().as_str();
        let raised = (|| -> PyResult<PyErr> {
            let module = py.import("te.errors")?;
            let class = module.getattr("class_for")?.call1((kind,))?;
            let exc = class.call1((message.clone(),))?;
            exc.setattr("kind", kind)?;
            exc.setattr("operation", e.operation())?;
            Ok(PyErr::from_value(exc))
        })();
        raised.unwrap_or_else(|_| PyRuntimeError::new_err(format!("{kind}: {message}")))
    })
}

/// A te error of `kind` raised by the binding itself (bad arguments that are the
/// engine's business rather than Python's types).
pub(crate) fn te_err(kind: ErrorKind, operation: &'static str, message: String) -> PyErr {
    to_py(Error::new(kind, message).with_operation(operation))
}

/// `Result<T, te::Error>` → `PyResult<T>`.
pub(crate) trait IntoPy<T> {
    /// Maps the error into its Python exception.
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for te::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
