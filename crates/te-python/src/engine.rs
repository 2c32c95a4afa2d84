//! `te._te.Engine`: registration, connection, transfers, layouts and notifications.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;
use te_core::sync::{Condvar, Mutex};

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use te::{
    BlockOptions, Engine, ErrorKind, KvGroup, KvLayout, KvSelection, KvSlot, MemoryDesc,
    MemoryKind, Op, RegionId, TransferOptions, TransferRequest,
};

use crate::addrs::{find, local_region, remote_regions, AddrMap};
use crate::args;
use crate::errors::{te_err, IntoPy};
use crate::handle::PyHandle;
use crate::peer::PyPeer;
use crate::registration::{Keep, PyRegistration};
use crate::wait::Latch;

/// A layout slot from Python: `(name, region id, offset, bytes per block, blocks)`.
type SlotSpec = (String, u64, u64, u64, u64);

/// A transfer engine: one backend, one control plane, its registrations and peers.
#[pyclass(module = "te._te", name = "Engine", subclass, frozen)]
pub(crate) struct PyEngine {
    /// The engine, until `close()`; methods clone it for their call.
    engine: Mutex<Option<Arc<Engine>>>,
    /// Notified (under `engine`'s lock) when a method lets go of its clone: `close()`
    /// waits for them.
    released: Condvar,
    /// Thrown by `close()`: a `recv_notification` waiting on another thread ends.
    closing: Latch,
    addrs: AddrMap,
}

/// A method's reference to the engine. `close()` waits for it to go; if `close()` gave
/// up waiting it is the last one, and the engine closes when it goes: outside the GIL,
/// as `close()` itself does.
struct EngineRef<'a> {
    engine: std::mem::ManuallyDrop<Arc<Engine>>,
    owner: &'a PyEngine,
}

impl std::ops::Deref for EngineRef<'_> {
    type Target = Engine;
    fn deref(&self) -> &Engine {
        &self.engine
    }
}

impl Drop for EngineRef<'_> {
    fn drop(&mut self) {
        // SAFETY: taken once, here, and `self.engine` is not used again.
        let engine = unsafe { std::mem::ManuallyDrop::take(&mut self.engine) };
        if let Some(last) = Arc::into_inner(engine) {
            Python::with_gil(|py| py.allow_threads(move || drop(last)));
        }
        let _slot = self.owner.engine.lock();
        self.owner.released.notify_all();
    }
}

/// The error of a call on a closed engine.
fn closed() -> PyErr {
    te_err(
        ErrorKind::Cancelled,
        "engine",
        "the engine is closed; create a new one".into(),
    )
}

impl Drop for PyEngine {
    fn drop(&mut self) {
        // Collected with the GIL held (an engine never closed); its close may wait for
        // batches and deregistrations.
        if let Some(engine) = self.engine.lock().take() {
            Python::with_gil(|py| py.allow_threads(move || drop(engine)));
        }
    }
}

impl PyEngine {
    fn get(&self) -> PyResult<EngineRef<'_>> {
        let engine = self.engine.lock().clone().ok_or_else(closed)?;
        Ok(EngineRef {
            engine: std::mem::ManuallyDrop::new(engine),
            owner: self,
        })
    }

    fn options(notify: Option<Vec<u8>>, timeout: Option<f64>) -> PyResult<TransferOptions> {
        Ok(TransferOptions {
            timeout: args::timeout(timeout)?,
            notify,
        })
    }

    /// Registers `nbytes` at `ptr` and wraps the registration with what it holds.
    ///
    /// # Safety
    /// `ptr .. ptr + nbytes` is `kind` memory that stays valid until the registration
    /// is deregistered (`keep`, held until then, is what it belongs to).
    #[allow(clippy::too_many_arguments)]
    unsafe fn register_kept(
        &self,
        py: Python<'_>,
        ptr: u64,
        nbytes: u64,
        kind: MemoryKind,
        name: &str,
        access: &str,
        keep: Option<Keep>,
    ) -> PyResult<PyRegistration> {
        let engine = self.get()?;
        let desc = MemoryDesc {
            name: name.to_string(),
            addr: ptr,
            len: nbytes,
            kind,
            access: args::access(access)?,
        };
        // SAFETY: the memory outlives the registration, by this function's contract.
        let reg = py
            .allow_threads(|| unsafe { engine.register(desc) })
            .py_err()?;
        Ok(PyRegistration::new(&self.addrs, reg, keep))
    }

    #[allow(clippy::too_many_arguments)]
    fn blocks(
        &self,
        py: Python<'_>,
        op: Op,
        peer: &PyPeer,
        layout: &str,
        local_ids: &Bound<'_, PyAny>,
        remote_ids: &Bound<'_, PyAny>,
        notify: Option<Vec<u8>>,
        timeout: Option<f64>,
        layers: Option<Vec<String>>,
        slots: Option<Vec<String>>,
    ) -> PyResult<PyHandle> {
        let engine = self.get()?;
        let local = args::ids(local_ids, "local_ids")?;
        let remote = args::ids(remote_ids, "remote_ids")?;
        let options = BlockOptions {
            selection: KvSelection {
                groups: layers,
                slots,
            },
            transfer: Self::options(notify, timeout)?,
        };
        let peer = &peer.peer;
        py.allow_threads(|| match op {
            Op::Read => engine.pull_blocks(peer, layout, &remote, &local, &options),
            Op::Write => engine.push_blocks(peer, layout, &remote, &local, &options),
        })
        .py_err()
        .map(|handle| PyHandle { handle })
    }
}

#[pymethods]
impl PyEngine {
    /// Starts an engine. `config` is `None` (the file named by `$TE_CONFIG`, else the
    /// defaults: the stub backend), a path to a TOML file, or a dict with the file's
    /// tables (`{"engine": {"backend": "tcp"}}`).
    #[new]
    #[pyo3(signature = (config=None))]
    fn new(py: Python<'_>, config: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let config = args::config(config)?;
        let engine = py.allow_threads(|| Engine::from_config(&config)).py_err()?;
        Ok(PyEngine {
            engine: Mutex::new(Some(Arc::new(engine))),
            released: Condvar::new(),
            closing: Latch::default(),
            addrs: Arc::default(),
        })
    }

    /// The control-plane address peers pass to `connect` (`"ip:port"`).
    #[getter]
    fn address(&self) -> PyResult<String> {
        Ok(self.get()?.address().to_string())
    }

    /// The engine's name, as peers see it.
    #[getter]
    fn name(&self) -> PyResult<String> {
        Ok(self.get()?.name().to_string())
    }

    /// Random at every start; peers notice a restart by it.
    #[getter]
    fn epoch(&self) -> PyResult<u64> {
        Ok(self.get()?.epoch())
    }

    /// The backend's registry name (`tcp`, `rdma`, `stub`, …).
    #[getter]
    fn backend(&self) -> PyResult<String> {
        Ok(self.get()?.backend_info().name.to_string())
    }

    /// Stops the engine (control plane, peers, backend); its batches fail or complete
    /// first, and registrations still open are deregistered (their `deregister` then
    /// reports how that went). Calls in flight on other threads are waited for (GIL
    /// released): a `recv_notification` stops waiting and raises `te.CancelledError`,
    /// the others return within their timeouts. Raises `te.TimeoutError` if some are
    /// still running after the engine's `default_timeout`; the engine then stops when
    /// the last of them returns.
    /// Further calls raise `te.CancelledError`. Called by `with te.Engine() as e:`.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let Some(engine) = self.engine.lock().take() else {
            return Ok(());
        };
        self.closing.set();
        let bound = engine.config().default_timeout;
        // Stopping the engine joins its threads: not under the GIL.
        let stopped = py.allow_threads(|| {
            let end = te_core::Deadline::after(bound);
            let mut slot = self.engine.lock();
            while Arc::strong_count(&engine) > 1 {
                let left = end.remaining();
                if left.is_zero() {
                    break;
                }
                slot = self.released.wait_timeout(slot, left).0;
            }
            drop(slot);
            Arc::into_inner(engine).map(drop).is_some()
        });
        if stopped {
            return Ok(());
        }
        Err(te_err(
            ErrorKind::Timeout,
            "close",
            format!(
                "calls on other threads still used the engine after {bound:?}; it stops when the last of them returns"
            ),
        ))
    }

    /// Registers `nbytes` of memory at address `ptr` (an int) on `device` (`"host"`,
    /// `"cuda:0"`, …) under `name`, with `access` for peers (`"rw"`, `"r"`, `"w"`,
    /// `"local"`). The memory must stay valid until the returned registration is
    /// deregistered; `keep` is held alive until then.
    #[pyo3(signature = (ptr, nbytes, device="host", name="", access="rw", keep=None))]
    #[allow(clippy::too_many_arguments)]
    fn register(
        &self,
        py: Python<'_>,
        ptr: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
        device: &str,
        name: &str,
        access: &str,
        keep: Option<PyObject>,
    ) -> PyResult<PyRegistration> {
        let ptr = args::uint(ptr, "ptr")?;
        let nbytes = args::uint(nbytes, "nbytes")?;
        let kind = args::device(device)?;
        // SAFETY: the caller vouches that `ptr .. ptr + nbytes` is memory of `device`
        // that outlives the registration (the documented contract of this method);
        // `keep` (a buffer or tensor the memory belongs to) is held until deregistration.
        unsafe { self.register_kept(py, ptr, nbytes, kind, name, access, keep.map(Keep::Object)) }
    }

    /// Registers the memory of a writable, C-contiguous buffer-protocol object (a
    /// `bytearray`, a numpy array of any item type, a writable `memoryview`) as its
    /// bytes, and holds a buffer export of
    /// it until deregistration: the object stays alive, and CPython refuses to resize
    /// or release it (`BufferError`) while te may touch its bytes.
    #[pyo3(signature = (obj, name="", access="rw"))]
    fn register_buffer(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        name: &str,
        access: &str,
    ) -> PyResult<PyRegistration> {
        let buf = match PyBuffer::<u8>::get(obj) {
            Ok(b) => b,
            // Items of another type (a float array): its bytes, through a byte view of
            // it, whose export holds an export of the object itself.
            Err(_) => py
                .import("builtins")?
                .getattr("memoryview")?
                .call1((obj,))
                .and_then(|view| view.call_method1("cast", ("B",)))
                .and_then(|bytes| PyBuffer::<u8>::get(&bytes))
                .map_err(|e| {
                    PyTypeError::new_err(format!(
                        "register_buffer needs a C-contiguous object with the buffer protocol (bytearray, numpy array, memoryview): {e}"
                    ))
                })?,
        };
        if buf.readonly() {
            return Err(PyTypeError::new_err(
                "the buffer is read-only (bytes?); register writable memory such as a bytearray",
            ));
        }
        if !buf.is_c_contiguous() {
            return Err(PyValueError::new_err("the buffer is not C-contiguous"));
        }
        let ptr = buf.buf_ptr() as u64;
        let len = buf.len_bytes() as u64;
        // SAFETY: `ptr .. ptr + len` is the buffer's memory, and the export `buf` that
        // pins it there (no resize, no release) is held until deregistration.
        unsafe {
            self.register_kept(
                py,
                ptr,
                len,
                MemoryKind::Host,
                name,
                access,
                Some(Keep::Export(buf)),
            )
        }
    }

    /// Connects to the engine at `addr` (`"host:port"`) within `timeout` seconds
    /// (default: the engine's `default_timeout`). Cached per address.
    #[pyo3(signature = (addr, timeout=None))]
    fn connect(&self, py: Python<'_>, addr: &str, timeout: Option<f64>) -> PyResult<PyPeer> {
        let engine = self.get()?;
        let timeout = args::timeout(timeout)?;
        let peer = py
            .allow_threads(|| match timeout {
                Some(t) => engine.connect_with(addr, t),
                None => engine.connect(addr),
            })
            .py_err()?;
        Ok(PyPeer { peer })
    }

    /// Submits requests to `peer`: a list of `(local_region, local_offset,
    /// remote_region, remote_offset, length)` tuples or an N×5 integer array, all
    /// `op` (`"write"` or `"read"`). `notify` (bytes) reaches the peer after the data.
    #[pyo3(signature = (peer, requests, op="write", notify=None, timeout=None))]
    fn transfer(
        &self,
        py: Python<'_>,
        peer: &PyPeer,
        requests: &Bound<'_, PyAny>,
        op: &str,
        notify: Option<Vec<u8>>,
        timeout: Option<f64>,
    ) -> PyResult<PyHandle> {
        let engine = self.get()?;
        let requests = args::requests(requests, args::op(op)?)?;
        let options = Self::options(notify, timeout)?;
        let peer = &peer.peer;
        py.allow_threads(|| engine.transfer_with(peer, &requests, &options))
            .py_err()
            .map(|handle| PyHandle { handle })
    }

    /// Submits requests named by raw addresses, as Mooncake's callers do: local
    /// `buffers[i]` (inside memory registered through this object) and the peer's
    /// `peer_addrs[i]` (inside a region the peer registered), `lengths[i]` bytes each.
    /// An address outside every registration raises `te.OutOfBoundsError` and nothing
    /// is submitted.
    #[pyo3(signature = (peer, op, buffers, peer_addrs, lengths, notify=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn transfer_addrs(
        &self,
        py: Python<'_>,
        peer: &PyPeer,
        op: &str,
        buffers: &Bound<'_, PyAny>,
        peer_addrs: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        notify: Option<Vec<u8>>,
        timeout: Option<f64>,
    ) -> PyResult<PyHandle> {
        let engine = self.get()?;
        let op = args::op(op)?;
        let buffers = args::ids(buffers, "buffers")?;
        let remote = args::ids(peer_addrs, "peer_buffer_addresses")?;
        let lengths = args::ids(lengths, "lengths")?;
        if buffers.len() != remote.len() || buffers.len() != lengths.len() {
            return Err(PyValueError::new_err(format!(
                "buffers ({}), peer addresses ({}) and lengths ({}) differ in length",
                buffers.len(),
                remote.len(),
                lengths.len()
            )));
        }
        let options = Self::options(notify, timeout)?;
        let peer = &peer.peer;
        let mut requests = Vec::with_capacity(buffers.len());
        let map = self.addrs.read();
        for (i, ((&local, &len), &addr)) in buffers.iter().zip(&lengths).zip(&remote).enumerate() {
            let (local, local_offset) = local_region(&map, local, len).ok_or_else(|| {
                te_err(
                    ErrorKind::NotRegistered,
                    "transfer",
                    format!(
                        "request {i}: local address {local:#x} (+{len} bytes) is not inside memory registered with this engine"
                    ),
                )
            })?;
            requests.push(TransferRequest {
                op,
                local,
                local_offset,
                remote: RegionId(0),
                remote_offset: addr,
                len,
            });
        }
        drop(map);
        py.allow_threads(|| {
            // One deadline covers a descriptor refresh and the batch, as in te-core.
            let started = Instant::now();
            let budget = options.timeout.unwrap_or(engine.config().default_timeout);
            let mut options = options;
            let mut regions = remote_regions(peer);
            if requests.iter().any(|r| find(&regions, r.remote_offset, r.len).is_none()) {
                engine.refresh(peer, budget)?;
                regions = remote_regions(peer);
                options.timeout = Some(budget.saturating_sub(started.elapsed()));
            }
            for (i, r) in requests.iter_mut().enumerate() {
                let (id, offset) = find(&regions, r.remote_offset, r.len).ok_or_else(|| {
                    te::Error::new(
                        ErrorKind::OutOfBounds,
                        format!(
                            "request {i}: peer address {:#x} (+{} bytes) is not inside any region the peer registered",
                            r.remote_offset, r.len
                        ),
                    )
                    .with_operation("transfer")
                })?;
                r.remote = id;
                r.remote_offset = offset;
            }
            engine.transfer_with(peer, &requests, &options)
        })
        .py_err()
        .map(|handle| PyHandle { handle })
    }

    /// Sends `message` to `peer` on its own.
    #[pyo3(signature = (peer, message, timeout=None))]
    fn notify(
        &self,
        py: Python<'_>,
        peer: &PyPeer,
        message: Vec<u8>,
        timeout: Option<f64>,
    ) -> PyResult<PyHandle> {
        let engine = self.get()?;
        let options = Self::options(Some(message), timeout)?;
        let peer = &peer.peer;
        py.allow_threads(|| engine.transfer_with(peer, &[], &options))
            .py_err()
            .map(|handle| PyHandle { handle })
    }

    /// Registers and publishes a KV-cache layout: `groups` is a list of `(group_name,
    /// [(slot_name, region_id, offset, bytes_per_block, blocks), …])`. `access`
    /// (default: each region's own) is what peers may do to the slots.
    #[pyo3(signature = (name, groups, access=None))]
    fn register_layout(
        &self,
        py: Python<'_>,
        name: String,
        groups: Vec<(String, Vec<SlotSpec>)>,
        access: Option<&str>,
    ) -> PyResult<()> {
        let engine = self.get()?;
        let layout = KvLayout {
            name,
            groups: groups
                .into_iter()
                .map(|(name, slots)| KvGroup {
                    name,
                    slots: slots
                        .into_iter()
                        .map(|(name, region, offset, bytes_per_block, blocks)| KvSlot {
                            name,
                            region: RegionId(region),
                            offset,
                            bytes_per_block,
                            blocks,
                        })
                        .collect(),
                })
                .collect(),
        };
        let access = access.map(args::access).transpose()?;
        py.allow_threads(|| match access {
            Some(a) => engine.register_layout_with(layout, a),
            None => engine.register_layout(layout),
        })
        .py_err()
    }

    /// Withdraws a layout (waiting for transfers on its slots).
    fn deregister_layout(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        let engine = self.get()?;
        py.allow_threads(|| engine.deregister_layout(name).map(drop))
            .py_err()
    }

    /// WRITEs blocks `local_ids` of the local layout `layout` into blocks `remote_ids`
    /// of the peer's (pairwise; lists, numpy arrays or int64 tensors). `layers` and
    /// `slots` select groups and slots (all by default).
    #[pyo3(signature = (peer, layout, local_ids, remote_ids, notify=None, timeout=None, layers=None, slots=None))]
    #[allow(clippy::too_many_arguments)]
    fn push_blocks(
        &self,
        py: Python<'_>,
        peer: &PyPeer,
        layout: &str,
        local_ids: &Bound<'_, PyAny>,
        remote_ids: &Bound<'_, PyAny>,
        notify: Option<Vec<u8>>,
        timeout: Option<f64>,
        layers: Option<Vec<String>>,
        slots: Option<Vec<String>>,
    ) -> PyResult<PyHandle> {
        self.blocks(
            py,
            Op::Write,
            peer,
            layout,
            local_ids,
            remote_ids,
            notify,
            timeout,
            layers,
            slots,
        )
    }

    /// READs blocks `remote_ids` of the peer's layout `layout` into blocks `local_ids`
    /// of the local one; as `push_blocks` otherwise.
    #[pyo3(signature = (peer, layout, local_ids, remote_ids, notify=None, timeout=None, layers=None, slots=None))]
    #[allow(clippy::too_many_arguments)]
    fn pull_blocks(
        &self,
        py: Python<'_>,
        peer: &PyPeer,
        layout: &str,
        local_ids: &Bound<'_, PyAny>,
        remote_ids: &Bound<'_, PyAny>,
        notify: Option<Vec<u8>>,
        timeout: Option<f64>,
        layers: Option<Vec<String>>,
        slots: Option<Vec<String>>,
    ) -> PyResult<PyHandle> {
        self.blocks(
            py,
            Op::Read,
            peer,
            layout,
            local_ids,
            remote_ids,
            notify,
            timeout,
            layers,
            slots,
        )
    }

    /// Drains received notifications without waiting: `{sender name: [message, …]}`,
    /// each sender's messages in arrival order.
    fn get_notifications<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let engine = self.get()?;
        let out = PyDict::new(py);
        for n in engine.try_recv_notifications() {
            let msg = PyBytes::new(py, &n.message);
            match out.get_item(&n.from)? {
                Some(list) => list.downcast::<PyList>()?.append(msg)?,
                None => out.set_item(&n.from, PyList::new(py, [msg])?)?,
            }
        }
        Ok(out)
    }

    /// Waits (GIL released) up to `timeout` seconds for one notification: `(sender
    /// name, sender address, message)`, or `None`. Raises `te.CancelledError` if
    /// another thread closes the engine meanwhile, `KeyboardInterrupt` on Ctrl-C.
    #[pyo3(signature = (timeout=0.0))]
    fn recv_notification(
        &self,
        py: Python<'_>,
        timeout: f64,
    ) -> PyResult<Option<(String, String, Py<PyBytes>)>> {
        let engine = self.get()?;
        let t = args::timeout(Some(timeout))?.unwrap_or_default();
        let mut next = engine.next_notification();
        let n = crate::wait::block_on(py, Some(te_core::Deadline::after(t)), |cx| {
            // `close()` waits for this call to return.
            if self.closing.poll_set(cx) {
                return Poll::Ready(None);
            }
            Pin::new(&mut next).poll(cx).map(Some)
        })?;
        let n = match n {
            Some(None) => return Err(closed()),
            Some(Some(n)) => Some(n),
            None => None,
        };
        Ok(n.map(|n| {
            (
                n.from,
                n.from_address,
                PyBytes::new(py, &n.message).unbind(),
            )
        }))
    }

    /// How bytes to `peer` travel, in the backend's words (te-tcp: `"socket"`,
    /// `"in-process device copies (host memory over the socket)"`, `"same-host channel (cross-memory attach)"`, …),
    /// or `None` where the backend has one way.
    fn path_to(&self, peer: &PyPeer) -> PyResult<Option<String>> {
        Ok(self.get()?.path_to(&peer.peer))
    }

    /// What this engine has done, as a dict: batches and their outcomes, bytes and
    /// requests per direction and per peer, the latency histogram, registered memory
    /// and notifications (docs/metrics.md explains each key).
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let m = self.get()?.metrics();
        let json = serde_json::to_string(&m)
            .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))?;
        py.import("json")?.call_method1("loads", (json,))
    }

    /// Drains peer events without waiting: dicts with `kind` (`"lost"`, `"restarted"`,
    /// `"left"`, `"torn_write"`), `name`, `address`, `epoch`, `previous_epoch`, and for
    /// a torn write `torn` = (region id, start, end).
    fn get_peer_events<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let engine = self.get()?;
        engine
            .try_recv_events()
            .into_iter()
            .map(|e| {
                let d = PyDict::new(py);
                let kind = match e.kind {
                    te::PeerEventKind::Lost => "lost",
                    te::PeerEventKind::Restarted => "restarted",
                    te::PeerEventKind::Left => "left",
                    te::PeerEventKind::TornWrite => "torn_write",
                };
                d.set_item("kind", kind)?;
                if let Some(t) = e.torn {
                    d.set_item("torn", (t.region.0, t.start, t.end))?;
                }
                d.set_item("name", e.name)?;
                d.set_item("address", e.address)?;
                d.set_item("epoch", e.epoch)?;
                d.set_item("previous_epoch", e.previous_epoch)?;
                Ok(d)
            })
            .collect()
    }

    fn __repr__(&self) -> String {
        match self.engine.lock().as_ref() {
            Some(e) => format!(
                "<te.Engine {} backend={} address={}>",
                e.name(),
                e.backend_info().name,
                e.address()
            ),
            None => "<te.Engine closed>".to_string(),
        }
    }
}
