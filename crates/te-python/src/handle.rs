//! `te.Handle`: a submitted batch, to poll, wait on, await or cancel.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use te::{TransferHandle, TransferStatus};

use crate::errors::to_py;

/// How long `wait` first waits in te's own way, which may read a same-host answer on
/// this thread instead of being woken by the thread that would; it then sleeps until
/// woken (`crate::wait`), where Ctrl-C reaches it. Ctrl-C waits at most this long.
const DRIVE: Duration = Duration::from_millis(100);

/// A submitted batch. `done()` polls without blocking, `wait(timeout)` blocks with the
/// GIL released, `await handle` suspends a coroutine, `cancel()` asks the batch to stop.
#[pyclass(module = "te._te", name = "Handle", frozen)]
pub(crate) struct PyHandle {
    pub(crate) handle: TransferHandle,
}

impl PyHandle {
    fn result(&self) -> PyResult<bool> {
        match self.handle.status() {
            TransferStatus::Pending => Ok(false),
            TransferStatus::Done => Ok(true),
            TransferStatus::Failed(e) => Err(to_py(e)),
        }
    }
}

#[pymethods]
impl PyHandle {
    /// Whether the batch has resolved (completed, failed, timed out or was cancelled and
    /// released). Never blocks; a scheduler calls it once per step.
    fn done(&self) -> bool {
        self.handle.is_done()
    }

    /// `"pending"`, `"done"` or `"failed"`.
    fn status(&self) -> &'static str {
        match self.handle.status() {
            TransferStatus::Pending => "pending",
            TransferStatus::Done => "done",
            TransferStatus::Failed(_) => "failed",
        }
    }

    /// What the batch did, once it has ended (else `None`): a dict with `requests`,
    /// `bytes`, `start_time` (seconds since the epoch, when it was submitted),
    /// `post_us` (submission until the backend had taken it) and `duration_us`
    /// (submission until the end), as te measured them; and where the backend times
    /// them (else `None`), `queued_us` (taken until its first byte went out), `wire_us`
    /// (on the fabric) and `device_us` (device copies).
    fn telemetry<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(t) = self.handle.telemetry() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("requests", t.requests)?;
        d.set_item("bytes", t.bytes)?;
        let start = t.started_at.duration_since(std::time::UNIX_EPOCH);
        d.set_item("start_time", start.map_or(0.0, |s| s.as_secs_f64()))?;
        d.set_item("post_us", t.post.as_secs_f64() * 1e6)?;
        d.set_item("duration_us", t.duration.as_secs_f64() * 1e6)?;
        let us = |d: Option<std::time::Duration>| d.map(|d| d.as_secs_f64() * 1e6);
        d.set_item("queued_us", us(t.queued))?;
        d.set_item("wire_us", us(t.wire))?;
        d.set_item("device_us", us(t.device))?;
        Ok(Some(d))
    }

    /// The batch's error as an exception object, or `None` (pending or done).
    fn error(&self, py: Python<'_>) -> Option<PyObject> {
        match self.handle.status() {
            TransferStatus::Failed(e) => Some(to_py(e).into_value(py).into_any()),
            _ => None,
        }
    }

    /// Waits for the batch with the GIL released: `True` once it completed, `False` if
    /// it is still in flight after `timeout` seconds (`None`: until it resolves; the
    /// batch's own deadline bounds that). Raises the batch's error if it failed, and
    /// `KeyboardInterrupt` on Ctrl-C.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let timeout = crate::args::timeout(timeout)?;
        // A deadline saturates: a timeout past the clock's range is no limit.
        let end = timeout.map(te_core::Deadline::after);
        let first = end.map_or(DRIVE, |end| end.remaining().min(DRIVE));
        let handle = &self.handle;
        if py.allow_threads(|| handle.wait_timeout(first).is_some()) {
            return self.result();
        }
        py.check_signals()?;
        let mut handle = self.handle.clone();
        match crate::wait::block_on(py, end, |cx| Pin::new(&mut handle).poll(cx))? {
            Some(_) => self.result(),
            None => Ok(false),
        }
    }

    /// Asks the batch to stop; it resolves with `te.CancelledError` once the backend has
    /// released its memory (a batch already complete is not affected).
    fn cancel(&self) {
        self.handle.cancel();
    }

    /// Calls `callback()` from te's notifier thread once the batch resolves (what
    /// `await` builds on; exceptions it raises are reported as unraisable).
    fn _on_done(&self, callback: PyObject) -> PyResult<()> {
        crate::notifier::on_done(self.handle.clone(), callback)
    }

    fn __await__<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let coro = py.import("te._aio")?.getattr("wait")?.call1((slf,))?;
        coro.call_method0("__await__")
    }

    fn __repr__(&self) -> String {
        format!("<te.Handle {}>", self.status())
    }
}
