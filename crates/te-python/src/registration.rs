//! `te._te.Registration`: registered memory, deregistered on request or when collected,
//! and kept in its engine's map of local addresses until then.

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use std::task::Poll;
use te::{RegionDesc, Registration};
use te_core::sync::Mutex;

use crate::addrs::AddrMap;
use crate::errors::to_py;
use crate::wait::{self, Latch};

/// Registered memory; deregistered by `deregister()`, or when it is garbage-collected
/// (then errors are only logged).
#[pyclass(module = "te._te", name = "Registration", frozen)]
pub(crate) struct PyRegistration {
    state: Mutex<State>,
    /// Thrown when a deregistration under way has its outcome.
    settled: Latch,
    region: RegionDesc,
    addrs: AddrMap,
    keep: Mutex<Option<Keep>>,
}

/// Where a registration stands.
enum State {
    /// Registered.
    Live(Registration),
    /// A `deregister()` is under way; other callers wait for its outcome.
    Leaving,
    /// Deregistered (`None`), or the error its deregistration failed with: te may
    /// still touch the memory.
    Gone(Option<te::Error>),
}

/// What a registration holds until te no longer touches its memory.
#[expect(dead_code, reason = "held for what dropping it does, never read")]
pub(crate) enum Keep {
    /// An object the memory belongs to (`register(…, keep=obj)`), held alive.
    Object(PyObject),
    /// A buffer export of the object (`register_buffer`): while it is held, CPython
    /// refuses to resize a `bytearray` or release a `memoryview`, so the bytes stay
    /// where they were registered. Released with the GIL (PyO3 takes it on drop).
    Export(PyBuffer<u8>),
}

#[pymethods]
impl PyRegistration {
    /// The region's id (what requests and layouts name).
    #[getter]
    fn id(&self) -> u64 {
        self.region.id.0
    }

    /// Start address.
    #[getter]
    fn addr(&self) -> u64 {
        self.region.addr
    }

    /// Length in bytes.
    #[getter]
    fn len(&self) -> u64 {
        self.region.len
    }

    /// The name it was registered under.
    #[getter]
    fn name(&self) -> String {
        self.region.name.clone()
    }

    /// Where the bytes live (`host`, `cuda:0`, …).
    #[getter]
    fn device(&self) -> String {
        self.region.kind.to_string()
    }

    /// Deregisters: waits for batches using the region, then makes the backend forget
    /// it. Afterwards te touches the memory no more. A call while another is under
    /// way waits for that one (GIL released) and reports its outcome, as later calls
    /// do. If it raises, te may still touch the memory, so the object it belongs to is
    /// never freed.
    fn deregister(&self, py: Python<'_>) -> PyResult<()> {
        let reg = {
            let mut state = self.state.lock();
            match std::mem::replace(&mut *state, State::Leaving) {
                State::Live(reg) => reg,
                other => {
                    *state = other;
                    drop(state);
                    return self.outcome(py);
                }
            }
        };
        self.forget();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            py.allow_threads(|| reg.deregister())
        }));
        let error = match &result {
            Ok(r) => r.as_ref().err().cloned(),
            Err(_) => Some(te::Error::new(
                te::ErrorKind::Backend,
                "te failed inside this region's deregistration (a panic; see the log): te may still touch its memory",
            )),
        };
        if error.is_some() {
            // te may still touch the memory: never free what it belongs to.
            if let Some(keep) = self.keep.lock().take() {
                std::mem::forget(keep);
            }
        } else {
            self.keep.lock().take();
        }
        // Callers waiting for this outcome learn it, even when te panicked.
        *self.state.lock() = State::Gone(error);
        self.settled.set();
        match result {
            Ok(r) => r.map_err(to_py),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (_t=None, _v=None, _tb=None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        _t: Option<PyObject>,
        _v: Option<PyObject>,
        _tb: Option<PyObject>,
    ) -> PyResult<()> {
        self.deregister(py)
    }

    fn __repr__(&self) -> String {
        format!(
            "<te.Registration id={} {} bytes at {:#x} on {}>",
            self.region.id, self.region.len, self.region.addr, self.region.kind
        )
    }
}

impl PyRegistration {
    /// Wraps `reg`, entering it in `addrs`; `keep` is held until deregistration.
    pub(crate) fn new(addrs: &AddrMap, reg: Registration, keep: Option<Keep>) -> Self {
        let region = reg.region().clone();
        let mut map = addrs.write();
        map.entry(region.addr)
            .or_default()
            .push((region.len, region.id));
        PyRegistration {
            state: Mutex::new(State::Live(reg)),
            settled: Latch::default(),
            region,
            addrs: addrs.clone(),
            keep: Mutex::new(keep),
        }
    }

    /// The outcome of the deregistration that began first, once it has one; waits for
    /// it with the GIL released, and raises `KeyboardInterrupt` on Ctrl-C meanwhile.
    fn outcome(&self, py: Python<'_>) -> PyResult<()> {
        let settled = wait::block_on(py, None, |cx| {
            // Watch first: an outcome set after the look below wakes this wait.
            self.settled.poll_set(cx);
            match &*self.state.lock() {
                State::Gone(error) => Poll::Ready(error.clone()),
                State::Live(_) | State::Leaving => Poll::Pending,
            }
        })?;
        match settled.flatten() {
            None => Ok(()),
            Some(e) => Err(to_py(e)),
        }
    }

    fn forget(&self) {
        let mut map = self.addrs.write();
        if let Some(v) = map.get_mut(&self.region.addr) {
            v.retain(|(_, id)| *id != self.region.id);
            if v.is_empty() {
                map.remove(&self.region.addr);
            }
        }
    }
}

impl Drop for PyRegistration {
    fn drop(&mut self) {
        let State::Live(reg) = std::mem::replace(&mut *self.state.lock(), State::Gone(None)) else {
            return;
        };
        self.forget();
        // Collected with the GIL held; deregistration may wait for batches.
        let result = Python::with_gil(|py| py.allow_threads(|| reg.deregister()));
        if result.is_err() {
            // te may still touch the memory: never free what it belongs to.
            if let Some(keep) = self.keep.lock().take() {
                std::mem::forget(keep);
            }
        }
    }
}
