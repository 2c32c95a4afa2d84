//! `te._te.Peer`: a connected peer, and the regions and layouts it published.

use pyo3::prelude::*;
use pyo3::types::PyDict;
use te::{Peer, RegionDesc};

/// A connected peer.
#[pyclass(module = "te._te", name = "Peer", frozen)]
pub(crate) struct PyPeer {
    pub(crate) peer: Peer,
}

#[pymethods]
impl PyPeer {
    /// The control-plane address it was reached at.
    #[getter]
    fn address(&self) -> String {
        self.peer.addr().to_string()
    }

    /// The peer engine's name.
    #[getter]
    fn name(&self) -> String {
        self.peer.segment().engine.clone()
    }

    /// The peer's epoch when connected.
    #[getter]
    fn epoch(&self) -> u64 {
        self.peer.epoch()
    }

    /// False once a failure or restart invalidated it (the engine reconnects on use).
    #[getter]
    fn valid(&self) -> bool {
        self.peer.is_valid()
    }

    /// The regions the peer published, as last fetched: dicts with `id`, `name`,
    /// `addr`, `len`, `device`, `access`.
    fn regions<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.peer
            .segment()
            .regions
            .iter()
            .map(|r| region_dict(py, r))
            .collect()
    }

    /// The id of the peer's first region named `name`, or `None`.
    fn region(&self, name: &str) -> Option<u64> {
        self.peer.region(name).map(|r| r.id.0)
    }

    /// The names of the peer's KV-cache layouts, as last fetched.
    fn layouts(&self) -> Vec<String> {
        self.peer
            .segment()
            .layouts
            .iter()
            .map(|l| l.name.clone())
            .collect()
    }

    fn __repr__(&self) -> String {
        format!("<te.Peer {} at {}>", self.name(), self.address())
    }
}

fn region_dict<'py>(py: Python<'py>, r: &RegionDesc) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("id", r.id.0)?;
    d.set_item("name", &r.name)?;
    d.set_item("addr", r.addr)?;
    d.set_item("len", r.len)?;
    d.set_item("device", r.kind.to_string())?;
    d.set_item("access", r.access.to_string())?;
    Ok(d)
}
