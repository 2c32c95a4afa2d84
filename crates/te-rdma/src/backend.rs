//! The RDMA backend's `TransferBackend`: devices, peers, submission, and shutdown.
//! Registrations are in `regions`, the data path in `path`, the devices' threads in
//! `device`, the connect exchange (over the engine's control-plane hook) and the
//! background repair in `connect`.
//!
//! **Batches.** `submit` turns a batch into slices ([`Job`]s) sharing one
//! [`BatchState`](crate::completion::BatchState) (module `completion`), which completes the
//! batch's `Completion` once every slice is accounted for. The slices hold the batch;
//! the table of batches in flight ([`InFlight`]) holds it weakly, by the engine's id,
//! so that the engine's `abort` reaches it: its waiting slices are dropped unposted and
//! it completes when its posted ones are back (see `path`).

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;
use te_core::kit::thread::SpawnMasked as _;
use te_core::peer_table::PeerTable;
use te_core::sync::{Condvar, Mutex};

use te_core::{
    BackendInfo, BatchId, Capabilities, Completion, ControlHook, Deadline, Error, ErrorKind,
    MemoryDesc, PeerId, RegionId, Result, SegmentDesc, TransferBackend, TransferRequest,
};

use crate::completion::InFlight;
use crate::config::{RdmaConfig, MAX_SLICE};
use crate::connect::{self, Served};
use crate::device;
use crate::endpoint::{self, DeviceInfo, Endpoint};
use crate::errors::config_error;
use crate::ffi;
use crate::path::{self, Job};
use crate::plan;
use crate::regions::{Pin, Regions, RemoteRegion};
use crate::state::Shared;
use crate::topology;

/// The RDMA backend.
pub struct RdmaBackend {
    pub(crate) info: BackendInfo,
    pub(crate) shared: Arc<Shared>,
    endpoint: Vec<u8>,
    stop: Vec<OwnedFd>,
    device_threads: Mutex<Vec<JoinHandle<()>>>,
    repair_thread: Mutex<Option<JoinHandle<()>>>,
    /// The control plane of a backend created outside an engine; dropped after the rest.
    own_control: Option<te_core::StandaloneControl>,
}

impl std::fmt::Debug for RdmaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaBackend")
            .field("devices", &self.shared.devices)
            .field("instance", &self.shared.instance)
            .finish_non_exhaustive()
    }
}

pub(crate) fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn_masked(f)
        .map_err(|e| {
            Error::new(ErrorKind::Io, format!("cannot start thread {name}")).with_source(e)
        })
}

/// Says whether the backend can run here: libibverbs loads and lists devices.
///
/// # Errors
/// `Unavailable` with the reason.
pub(crate) fn probe() -> Result<()> {
    let v = ffi::verbs()?;
    ffi::device_names(v).map(|_| ())
}

/// The memory runtimes this build can register.
fn memory_kinds() -> Vec<String> {
    let mut kinds = vec!["host".to_string()];
    if cfg!(feature = "cuda") && te_core::device::runtime("cuda").is_ok() {
        kinds.push("cuda".to_string());
    }
    kinds
}

fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    use std::os::fd::FromRawFd;
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(Error::new(ErrorKind::Io, "pipe2 failed").with_source(ffi::last_os_error()));
    }
    // SAFETY: two new descriptors we own.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

impl RdmaBackend {
    /// [`RdmaBackend::with_epoch`] with a random epoch: a backend outside an engine.
    ///
    /// # Errors
    /// As [`RdmaBackend::with_hook`].
    pub fn new(config: RdmaConfig) -> Result<RdmaBackend> {
        RdmaBackend::with_epoch(config, te_core::random_nonzero())
    }

    /// [`RdmaBackend::with_hook`] without a control plane: it connects only to backends
    /// of its own process created the same way (their exchange is a direct call), and
    /// nothing outside the process can connect to it.
    ///
    /// # Errors
    /// As [`RdmaBackend::with_hook`].
    pub fn with_epoch(config: RdmaConfig, epoch: u64) -> Result<RdmaBackend> {
        RdmaBackend::with_hook(config, epoch, ControlHook::default())
    }

    /// Opens the devices and starts their completion and event threads and the repair
    /// thread, and serves the connect exchange on `hook` (the engine's control plane,
    /// from its `BackendContext`). `epoch` (non-zero; the engine's) is the instance id
    /// the backend names itself with to peers, so that a restarted engine is a new
    /// peer to them; a target checks it against the epoch the control plane
    /// authenticated.
    ///
    /// # Errors
    /// `Unavailable` without libibverbs, devices or an active port (the reason says
    /// which); `ConfigInvalid` for bad options or a zero epoch; `InvalidRequest` if
    /// the hook serves another handler already.
    pub fn with_hook(config: RdmaConfig, epoch: u64, hook: ControlHook) -> Result<RdmaBackend> {
        if epoch == 0 {
            return Err(config_error(
                "the epoch (instance id) must not be zero".into(),
            ));
        }
        te_core::BackendConfig::validate(&config)?;
        let v = ffi::verbs()?;
        let devices = device::open_devices(v, &config)?;
        for (kind, nics) in &config.nic_affinity {
            if let Some(n) = nics.iter().find(|n| !devices.iter().any(|d| &&d.name == n)) {
                return Err(config_error(format!(
                    "nic_affinity for {kind} names {n:?}, which is not among the devices in use ({})",
                    devices.iter().map(|d| d.name.as_str()).collect::<Vec<_>>().join(", ")
                )));
            }
        }
        for (key, value) in [("listen", &config.listen), ("advertise", &config.advertise)] {
            if value.is_some() {
                tracing::warn!(
                    "[backends.rdma] {key} is deprecated and ignored: the connect exchange runs on the engine's control plane ([engine] listen, advertise)"
                );
            }
        }
        let instance = epoch;
        let endpoint = endpoint::encode_endpoint(&Endpoint {
            instance,
            devices: devices
                .iter()
                .map(|d| DeviceInfo {
                    name: d.name.clone(),
                    link_layer: d.link_layer,
                    roce: d.roce(),
                })
                .collect(),
        });
        let sys = std::path::Path::new("/sys");
        let nic_places = devices
            .iter()
            .map(|d| topology::nic_place(sys, &d.name))
            .collect();
        let shared = Arc::new(Shared {
            config,
            instance,
            devices,
            nic_places,
            regions: Regions::new("rdma"),
            in_flight: Arc::new(InFlight::default()),
            peers: PeerTable::new(crate::NAME),
            by_instance: Mutex::new(HashMap::new()),
            next_tag: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            hook: hook.clone(),
            next_set: AtomicU64::new(1),
            served: Mutex::new(Served::default()),
            threads: Mutex::new(Vec::new()),
            repairs: Mutex::new(VecDeque::new()),
            repair_wake: Condvar::new(),
        });
        let mut stop = Vec::new();
        let mut device_threads = Vec::new();
        for d in &shared.devices {
            let (rd, wr) = pipe()?;
            let rd = Arc::new(rd);
            let (dev, r) = (d.clone(), rd.clone());
            device_threads.push(spawn(&format!("te-rdma-cq-{}", d.name), move || {
                device::completion_loop(&dev, &r)
            })?);
            let (dev, weak) = (d.clone(), Arc::downgrade(&shared));
            device_threads.push(spawn(&format!("te-rdma-ev-{}", d.name), move || {
                device::event_loop(&dev, &weak, &rd)
            })?);
            stop.push(wr);
        }
        let weak = Arc::downgrade(&shared);
        let repair_thread = spawn("te-rdma-repair", move || connect::repair_loop(&weak))?;
        let backend = RdmaBackend {
            info: BackendInfo {
                name: crate::NAME.to_string(),
                version: env!("CARGO_PKG_VERSION").to_string(),
                capabilities: Capabilities {
                    memory: memory_kinds(),
                    read: true,
                    write: true,
                    cross_process: true,
                    same_host_only: false,
                    max_request_size: u64::MAX,
                    // The nic enforces each region's key: its range and rights.
                    checks_at_target: true,
                },
            },
            shared,
            endpoint,
            stop,
            device_threads: Mutex::new(device_threads),
            repair_thread: Mutex::new(Some(repair_thread)),
            own_control: None,
        };
        if hook.is_connected() {
            hook.serve(Arc::new(connect::Target(Arc::downgrade(&backend.shared))))?;
        } else {
            connect::list_local(&backend.shared);
        }
        Ok(backend)
    }

    /// A backend outside an engine, on a control plane of its own (`control`, started
    /// with `epoch`), also listed among the backends of this process that reach each
    /// other directly.
    pub(crate) fn outside_engine(
        config: RdmaConfig,
        epoch: u64,
        control: te_core::StandaloneControl,
    ) -> Result<RdmaBackend> {
        let mut b = RdmaBackend::with_hook(config, epoch, control.hook())?;
        b.own_control = Some(control);
        connect::list_local(&b.shared);
        Ok(b)
    }
}

impl TransferBackend for RdmaBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn endpoint(&self) -> Vec<u8> {
        self.endpoint.clone()
    }
    fn register(&self, id: RegionId, mem: &MemoryDesc) -> Result<Vec<u8>> {
        self.register_region(id, mem)
    }

    fn deregister(&self, id: RegionId, deadline: Deadline) -> Result<()> {
        self.deregister_region(id, deadline)
    }

    fn connect(&self, segment: &SegmentDesc, deadline: Deadline) -> Result<PeerId> {
        let ep = endpoint::decode_endpoint(&segment.endpoint)?;
        // The data path adds offsets the engine checked to these addresses unchecked.
        segment.check_regions()?;
        let regions = segment
            .regions
            .iter()
            .map(|r| {
                let rkeys = endpoint::decode_key(&r.key, ep.devices.len())?;
                Ok((
                    r.id,
                    Arc::new(RemoteRegion {
                        addr: r.addr,
                        rkeys,
                    }),
                ))
            })
            .collect::<Result<HashMap<_, _>>>()?;
        let known = self.shared.by_instance.lock().get(&ep.instance).copied();
        // Looked up once: the set this connect keeps, or replaces. A second look could
        // find the set a repair put in its place meanwhile, healthy, and replace that.
        let seen = known.and_then(|id| self.shared.peer(id));
        if let Some(peer) = &seen {
            // One instance has one endpoint and one address for its whole life: a
            // descriptor that names it with others is not that peer, and must neither
            // reach its paths nor replace its regions.
            if peer.endpoint != ep || peer.address != segment.address {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    format!(
                        "the descriptor names rdma instance {:#x}, connected at {} with {} devices, but comes from {} with {}: a forged or corrupt descriptor",
                        ep.instance,
                        peer.address,
                        peer.endpoint.devices.len(),
                        segment.address,
                        ep.devices.len()
                    ),
                ));
            }
            if !peer.dead.load(Ordering::Acquire) && !peer.healthy().is_empty() {
                *peer.regions.write() = regions;
                return Ok(peer.id);
            }
        }
        // `seen` is the set this connect replaces, if any: another connect or a repair
        // that replaced it first wins (below).
        // No lock is held while the exchange runs.
        let id = known.unwrap_or_else(|| self.shared.peers.next_id());
        let peer = self.shared.establish(&ep, &segment.address, id, deadline)?;
        *peer.regions.write() = regions;
        let (old, won) = {
            // Both tables at once, so that the set looked at is the set replaced: a
            // repair puts its rebuilt set in under the peer table's lock.
            let mut by = self.shared.by_instance.lock();
            let mut peers = self.shared.peers.write();
            let current = by
                .get(&ep.instance)
                .and_then(|other| Some((*other, peers.get(other)?.clone())));
            match current {
                // A concurrent connect to this instance finished first: one peer each.
                Some((other, _)) if Some(other) != known => (None, Some(other)),
                // Two connects (or a connect and a repair) replacing one set: the
                // first's new set stays.
                Some((other, p))
                    if !p.dead.load(Ordering::Acquire)
                        && !seen.as_ref().is_some_and(|s| Arc::ptr_eq(s, &p)) =>
                {
                    (None, Some(other))
                }
                _ => {
                    by.insert(ep.instance, id);
                    (peers.insert(id, peer.clone()), None)
                }
            }
        };
        if let Some(other) = won {
            peer.kill("a concurrent connect to the peer finished first".into());
            path::retire(&peer, deadline.instant());
            self.shared.release(&peer, deadline);
            return Ok(other);
        }
        if let Some(old) = old {
            // Its QPs go to ERR first; what they held is flushed back before it fails.
            old.kill("replaced by a new connection after its QPs failed".into());
            // Work the old set still has posted completes (flushed) after this returns
            // if its QPs are slow to flush; its regions stay pinned until then.
            path::retire(&old, deadline.instant());
            self.shared.release(&old, deadline);
        }
        Ok(id)
    }

    fn disconnect(&self, peer: PeerId, deadline: Deadline) -> Result<()> {
        let old = self.shared.peers.remove(peer)?;
        self.shared.by_instance.lock().retain(|_, id| *id != peer);
        old.kill("disconnected".into());
        let flushed = path::retire(&old, deadline.instant());
        self.shared.release(&old, deadline);
        if !flushed {
            return Err(Error::new(
                ErrorKind::Timeout,
                "the peer's QPs did not flush their work requests by the deadline; their batches fail and their regions stay pinned until they do",
            ));
        }
        Ok(())
    }

    fn submit(&self, peer: PeerId, batch: &[TransferRequest], done: Completion) -> Result<()> {
        if done.remaining().is_zero() {
            return Err(Error::new(
                ErrorKind::Timeout,
                "the batch's deadline passed before it was posted",
            ));
        }
        // Its healthy paths, or those of the set that replaced it since the lookup.
        let (peer, healthy) = self.shared.usable(self.shared.peers.get(peer)?);
        if peer.dead.load(Ordering::Acquire) {
            return Err(Error::new(
                ErrorKind::PeerUnreachable,
                peer.why.lock().clone(),
            ));
        }
        let usable: Vec<&Arc<path::Path>> = healthy.iter().collect();
        if usable.is_empty() {
            let why = peer.why.lock().clone();
            return Err(Error::new(
                ErrorKind::PeerUnreachable,
                if why.is_empty() {
                    "every QP to the peer failed; they are being rebuilt in the background"
                        .to_string()
                } else {
                    why
                },
            ));
        }
        // The engine checked each request against these regions (bounds, rights); here
        // each distinct local region is pinned once, and each slice holds a clone.
        let remote_regions = peer.regions.read();
        let mut pinned: Vec<Pin> = Vec::new();
        let mut resolved = Vec::with_capacity(batch.len());
        for (i, r) in batch.iter().enumerate() {
            let local = match pinned.iter().position(|p| p.id == r.local) {
                Some(at) => at,
                None => {
                    let p = self
                        .shared
                        .regions
                        .pin(r.local)
                        .map_err(|e| e.with_context("request", i))?;
                    pinned.push(p);
                    pinned.len() - 1
                }
            };
            let remote = remote_regions.get(&r.remote).ok_or_else(|| {
                Error::new(
                    ErrorKind::NotRegistered,
                    format!("the peer has no region {}", r.remote),
                )
                .with_context("request", i)
            })?;
            resolved.push((local, remote.clone()));
        }
        drop(remote_regions);
        let slice = self.shared.config.slice_size.min(MAX_SLICE);
        let count = plan::slice_count(batch.iter().map(|r| r.len), slice);
        if count == 0 {
            done.complete(Ok(()));
            return Ok(());
        }
        let state = self.shared.in_flight.start(count as usize, done);
        let mut per_path: HashMap<u64, (Arc<path::Path>, Vec<Job>)> = HashMap::new();
        for (r, (local, remote)) in batch.iter().zip(&resolved) {
            let local = &pinned[*local];
            // Slices of a device's memory go to the NICs nearest to it, if healthy.
            let near: Vec<&Arc<path::Path>> = usable
                .iter()
                .copied()
                .filter(|p| local.data.nics.is_empty() || local.data.nics.contains(&p.device.index))
                .collect();
            let paths = if near.is_empty() { &usable } else { &near };
            let n = plan::slice_count([r.len], slice);
            let start = peer.next.fetch_add(n as usize, Ordering::Relaxed);
            for s in plan::plan([r.len], slice, paths.len(), start) {
                let p = paths[s.path];
                per_path
                    .entry(p.tag)
                    .or_insert_with(|| (p.clone(), Vec::new()))
                    .1
                    .push(Job {
                        batch: state.clone(),
                        op: r.op,
                        local: local.clone(),
                        local_addr: local.addr + r.local_offset + s.offset,
                        remote: remote.clone(),
                        remote_addr: remote.addr + r.remote_offset + s.offset,
                        len: s.len as u32,
                        attempts: 0,
                        moves: 0,
                    });
            }
        }
        // Each slice holds its own pin now; a deregistration either came first (and
        // the pin above failed) or waits for them.
        drop((pinned, resolved));
        for (_, (path, jobs)) in per_path {
            path::post(&path, jobs);
        }
        Ok(())
    }

    fn abort(&self, peer: PeerId, batch: BatchId) {
        let stopped = self.shared.in_flight.abort(batch, || {
            Error::new(ErrorKind::Cancelled, "the engine aborted the batch")
        });
        if stopped.is_empty() {
            return; // Completed already, or never submitted here.
        }
        // Its waiting slices leave the queues now; the posted ones complete as the NICs
        // complete them (or flush them), and the last one completes the batch.
        if let Some(p) = self.shared.peer(peer) {
            for path in &p.paths {
                path::drop_stopped(path);
            }
        }
    }
}
impl Drop for RdmaBackend {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        connect::unlist_local(self.shared.instance);
        // The repair thread first, so that it adds no peer after they are drained. It
        // reads `closed` under its queue's lock: taking that lock once here means it
        // either saw the flag or already waits, and is woken.
        drop(self.shared.repairs.lock());
        self.shared.repair_wake.notify_all();
        if let Some(t) = self.repair_thread.lock().take() {
            let _ = t.join();
        }
        // The QPs this backend holds as a target go; their initiators see their work
        // fail (as when this process exits).
        let served = std::mem::take(&mut *self.shared.served.lock());
        drop(served);
        let peers = self.shared.peers.drain();
        // Every peer's QPs go to ERR and their flush completions are taken (the
        // completion threads still run) before the threads stop, for `connect_timeout`
        // at most; whatever has not flushed by then is dropped with its QP, which the
        // NIC stops using.
        let wait = self.shared.config.connect_timeout;
        let deadline = Instant::now() + wait;
        for p in &peers {
            p.kill("the rdma backend is closing".into());
            path::retire(p, deadline);
        }
        // The targets are told, within `connect_timeout` for them all (if the control
        // plane still runs: inside an engine it stopped first, and they learn of it from
        // its goodbye and the epoch).
        let released = Deadline::after(wait);
        for p in &peers {
            self.shared.release(p, released);
        }
        for w in &self.stop {
            // SAFETY: writing one byte from a valid buffer to our own pipe.
            unsafe { libc::write(w.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
        }
        for t in self.device_threads.lock().drain(..) {
            let _ = t.join();
        }
        for t in self.shared.threads.lock().drain(..) {
            let _ = t.join();
        }
        for d in &self.shared.devices {
            d.paths.write().clear();
        }
        // The MRs go before the devices that made them: `Shared` drops its devices
        // first, and closing a device does not deregister what it still holds.
        self.shared.regions.clear();
    }
}
