//! The engine: what users hold.
//!
//! It resolves the backend, serves the control plane, keeps registrations and peers,
//! checks every request against both sides' descriptors and pins the batch's local
//! regions before anything is posted, and turns backend completions into
//! [`TransferHandle`]s. One deadline is drawn per call and covers everything under it.

use crate::sync::{Mutex, RwLock};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::backend::{random_nonzero, BatchId, Completion, TransferBackend};
use crate::batch::{Abort, BatchState, Timer, TransferHandle};
use crate::config::{Config, EngineConfig};
use crate::control::HookSlot;
use crate::control::{self, wire, ControlPlane, Handler, Identity, Kind, Settings};
use crate::desc::{
    Access, BackendInfo, MemoryDesc, MemoryKind, Op, PeerId, RegionDesc, RegionId, SegmentDesc,
    TransferRequest,
};
use crate::error::{Error, ErrorKind, Result};
use crate::hook::ControlHook;
use crate::inbox::{Mailbox, Next, Notification, PeerEvent};
use crate::kit::fits;
use crate::kv::{self, KvLayout, KvSelection};
use crate::metadata::{self, EngineEntry, MetadataStore};
use crate::metrics::{BatchMeter, Counters, Metrics, PeerCounters};
use crate::region::{Pins, Region};
use crate::registry::{Origin, Registry};
use crate::time::Deadline;

/// Per-batch options.
#[derive(Debug, Clone, Default)]
pub struct TransferOptions {
    /// The batch's deadline, from the call; the engine's `default_timeout` if `None`.
    /// It covers everything the call does: refreshing the peer's descriptor, the
    /// transfer, and the notification.
    pub timeout: Option<Duration>,
    /// A message delivered to the peer after the batch's data is visible there.
    pub notify: Option<Vec<u8>>,
}

/// A transfer engine: one backend, one control plane, its registrations and peers.
///
/// Dropping it stops the control plane and disconnects its peers; batches still in
/// flight fail (with `Cancelled` or `PeerUnreachable`) once their backend has released
/// them, or complete; then every region still registered is deregistered and the
/// backend stops (its listener with it). Registrations and buffers may outlive it:
/// their deregistration then reports how the engine's ended.
pub struct Engine {
    inner: Arc<Inner>,
    control: Option<ControlPlane>,
    exporter: Option<exporter::Exporter>,
}

/// A KV layout as registered: the caller's version (for planning local requests) and
/// the published one, whose slots are views registered as regions of their own.
struct LayoutEntry {
    /// Shared, so a block transfer plans against it without copying it.
    local: Arc<KvLayout>,
    published: KvLayout,
    /// `(parent, view)` for every slot.
    views: Vec<(RegionId, RegionId)>,
}

struct Inner {
    config: EngineConfig,
    backend: Arc<dyn TransferBackend>,
    origin: Origin,
    epoch: u64,
    next_region: AtomicU64,
    next_batch: AtomicU64,
    regions: RwLock<HashMap<RegionId, Arc<Region>>>,
    layouts: RwLock<HashMap<String, LayoutEntry>>,
    /// The slot views of layouts being withdrawn or undone, with their parent regions:
    /// out of `layouts` already, so a deregistration of a parent waits for them here.
    /// A view whose deregistration failed stays for good: its parent's deregistration
    /// fails too, since the backend may still touch the parent's memory through it.
    withdrawing: Mutex<Vec<(RegionId, Arc<Region>)>>,
    peers: Mutex<HashMap<String, Peer>>,
    inbox: Mailbox<Notification>,
    timer: Timer,
    control: Arc<control::Shared>,
    store: Arc<dyn MetadataStore>,
    metrics: Arc<Counters>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("name", &self.inner.config.name)
            .field("backend", &self.inner.backend.info().name)
            .field("address", &self.address())
            .field("epoch", &self.inner.epoch)
            .finish()
    }
}

impl Engine {
    /// Builds an engine from a configuration: finds the backend in the registry
    /// (built-in backends and the configured plugin directories), creates it with its
    /// own table, and starts the control plane.
    ///
    /// # Errors
    /// `ConfigInvalid` for a value of the `[engine]` table out of range (as
    /// [`Config::from_toml`] refuses it in a file), an unknown backend (listing the
    /// available ones) or a bad backend table; `Unavailable` if the backend cannot run
    /// here (with the probe's reason) or its plugin file was refused (with the loader's
    /// reason: what to rebuild); `Io` if the control plane cannot listen.
    pub fn from_config(config: &Config) -> Result<Engine> {
        let registry = Registry::discover(&config.engine.plugin_dirs);
        Engine::with_registry(config, &registry)
    }

    /// As [`Engine::from_config`], with a registry already discovered.
    ///
    /// # Errors
    /// As [`Engine::from_config`].
    pub fn with_registry(config: &Config, registry: &Registry) -> Result<Engine> {
        config.validate()?;
        crate::device::configure(&config.runtimes);
        let name = &config.engine.backend;
        let entry = registry.get(name)?;
        let mut ctx = config.backend_context(name);
        ctx.epoch = random_nonzero();
        let hook = Arc::new(HookSlot::default());
        ctx.hook = ControlHook::new(hook.clone());
        let backend = entry.create(&ctx)?;
        Engine::build(
            config.engine.clone(),
            backend,
            entry.origin().clone(),
            ctx.epoch,
            hook,
        )
    }

    /// Builds an engine around a backend instance created with epoch `epoch` in its
    /// [`BackendContext`](crate::BackendContext) (0: the engine draws one).
    ///
    /// # Errors
    /// `ConfigInvalid` for a value of `config` out of range (see
    /// [`EngineConfig::validate`]); `Io` if the control plane cannot listen or threads
    /// cannot start.
    pub fn with_backend(
        config: EngineConfig,
        backend: Arc<dyn TransferBackend>,
        origin: Origin,
        epoch: u64,
    ) -> Result<Engine> {
        config.validate()?;
        Engine::build(
            config,
            backend,
            origin,
            epoch,
            Arc::new(HookSlot::default()),
        )
    }

    fn build(
        config: EngineConfig,
        backend: Arc<dyn TransferBackend>,
        origin: Origin,
        epoch: u64,
        hook: Arc<HookSlot>,
    ) -> Result<Engine> {
        let epoch = if epoch == 0 { random_nonzero() } else { epoch };
        let settings = Settings::new(&config, epoch);
        let plane = ControlPlane::start(
            settings,
            &config.listen,
            config.advertise.as_deref(),
            hook.clone(),
        )?;
        hook.attach(Arc::downgrade(&plane.shared()));
        let store = metadata::open(&config)?;
        let inner = Arc::new(Inner {
            inbox: Mailbox::new(),
            backend,
            origin,
            epoch,
            // Region ids start at a random point, so an id from an engine's previous
            // life never names a region of this one.
            next_region: AtomicU64::new(random_nonzero() >> 2),
            next_batch: AtomicU64::new(1),
            regions: RwLock::new(HashMap::new()),
            layouts: RwLock::new(HashMap::new()),
            withdrawing: Mutex::new(Vec::new()),
            peers: Mutex::new(HashMap::new()),
            timer: Timer::start()?,
            control: plane.shared(),
            store,
            metrics: Arc::default(),
            config,
        });
        let handler: Weak<dyn Handler> = Arc::downgrade(&inner) as Weak<dyn Handler>;
        plane.set_handler(handler);
        let weak = Arc::downgrade(&inner);
        inner.store.on_stale(Box::new(move |old| {
            if let Some(inner) = weak.upgrade() {
                inner.forget(&old.address);
            }
        }));
        let entry = EngineEntry {
            name: inner.config.name.clone(),
            epoch,
            address: inner.control.address().to_string(),
            backend: inner.backend.info().name.clone(),
        };
        inner
            .store
            .publish(&entry, inner.deadline(None))
            .map_err(|e| e.with_operation("publish engine"))?;
        tracing::info!(
            engine = %inner.config.name,
            backend = %inner.backend.info().name,
            address = %inner.control.address(),
            "engine started"
        );
        let exporter = match &inner.config.metrics_listen {
            Some(listen) => {
                let weak = Arc::downgrade(&inner);
                let snapshot: exporter::Snapshot =
                    Arc::new(move || weak.upgrade().map(|i| i.metrics()));
                Some(exporter::Exporter::start(listen, snapshot)?)
            }
            None => None,
        };
        Ok(Engine {
            inner,
            control: Some(plane),
            exporter,
        })
    }

    /// The engine's name.
    pub fn name(&self) -> &str {
        &self.inner.config.name
    }

    /// The control-plane address peers pass to [`Engine::connect`].
    pub fn address(&self) -> SocketAddr {
        self.inner.control.address()
    }

    /// Random at every start; peers use it to notice a restart.
    pub fn epoch(&self) -> u64 {
        self.inner.epoch
    }

    /// The backend's name, version and capabilities.
    pub fn backend_info(&self) -> &BackendInfo {
        self.inner.backend.info()
    }

    /// Where the backend came from.
    pub fn backend_origin(&self) -> &Origin {
        &self.inner.origin
    }

    /// The engine's configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    /// The descriptor peers receive in the handshake.
    pub fn segment(&self) -> SegmentDesc {
        self.inner.segment()
    }

    /// Registers caller-owned memory. Deregistered when the [`Registration`] drops (or
    /// by [`Registration::deregister`], which reports failure).
    ///
    /// # Safety
    /// `desc.addr .. desc.addr + desc.len` must be memory of `desc.kind` that stays
    /// valid until the registration is deregistered, and the caller must accept that
    /// the backend reads it and (for local READ destinations and remotely writable
    /// regions) writes it at any time until then. If deregistration fails, the memory
    /// must never be freed (see [`Registration::deregister`]).
    ///
    /// # Errors
    /// `InvalidRequest` for a null address, zero length or overflowing range;
    /// `Unsupported` for a memory kind the backend cannot move; the backend's error if
    /// it refuses the memory.
    pub unsafe fn register(&self, desc: MemoryDesc) -> Result<Registration> {
        self.inner.register(desc)
    }

    /// Connects to the engine whose control plane listens at `addr` (`host:port`, or
    /// an engine's name with an etcd metadata store), within the engine's default
    /// timeout. Cached: a second call returns the same peer until a failure, a
    /// restart or the peer's departure (it said goodbye) invalidates it. A peer belongs
    /// to the engine that connected it: another engine refuses it.
    ///
    /// # Errors
    /// As [`Engine::connect_with`].
    pub fn connect(&self, addr: &str) -> Result<Peer> {
        self.connect_with(addr, self.inner.config.default_timeout)
    }

    /// Connects to the engine at `addr`; name resolution, the handshake and the
    /// backend's connection all happen within `timeout`.
    ///
    /// # Errors
    /// `PeerUnreachable` if nothing answers; `Timeout` once `timeout` has passed;
    /// `Unsupported` if the peer runs another backend; `Protocol` if it is not a te
    /// engine.
    pub fn connect_with(&self, addr: &str, timeout: Duration) -> Result<Peer> {
        self.inner.connect(addr, Deadline::after(timeout))
    }

    /// Fetches `peer`'s descriptor again, within `timeout`: regions and KV layouts it
    /// registered since `connect` become reachable through [`Peer::region`]. (A batch
    /// naming a region the engine does not know does this by itself.)
    ///
    /// # Errors
    /// `PeerRestarted` if the peer restarted (connect again); `PeerUnreachable` if
    /// nothing answers; `Timeout` once `timeout` has passed; `InvalidRequest` for a peer
    /// another engine connected.
    pub fn refresh(&self, peer: &Peer, timeout: Duration) -> Result<()> {
        self.inner
            .refresh(peer, Deadline::after(timeout))
            .map_err(|e| e.with_operation("refresh"))
    }

    /// Submits a batch with the default timeout and no notification.
    ///
    /// # Errors
    /// As [`Engine::transfer_with`].
    pub fn transfer(&self, peer: &Peer, requests: &[TransferRequest]) -> Result<TransferHandle> {
        self.transfer_with(peer, requests, &TransferOptions::default())
    }

    /// Submits a batch. Every request is checked against the local registrations and
    /// the peer's descriptor first; nothing is posted unless all of them pass. An empty
    /// batch completes at once (after its notification, if any). The local regions the
    /// batch names stay registered until the batch is released.
    ///
    /// # Errors
    /// `InvalidRequest`, `NotRegistered`, `OutOfBounds` or `Unsupported` for a request
    /// that does not fit; `InvalidRequest` for a peer another engine connected;
    /// `PeerRestarted` if the peer restarted since `peer` was obtained (connect again
    /// and look its regions up anew); `PeerUnreachable` for a peer that left; `Timeout` if the deadline
    /// passed while refreshing the peer's descriptor; the backend's error if it refuses
    /// the batch as a whole.
    pub fn transfer_with(
        &self,
        peer: &Peer,
        requests: &[TransferRequest],
        options: &TransferOptions,
    ) -> Result<TransferHandle> {
        let deadline = self.inner.deadline(options.timeout);
        self.inner
            .transfer(peer, requests, deadline, options.notify.clone())
    }

    /// Sends `message` to the peer on its own (an empty batch with a notification).
    ///
    /// # Errors
    /// As [`Engine::transfer_with`].
    pub fn notify(&self, peer: &Peer, message: Vec<u8>) -> Result<TransferHandle> {
        let options = TransferOptions {
            notify: Some(message),
            ..TransferOptions::default()
        };
        self.transfer_with(peer, &[], &options)
    }

    /// A snapshot of what this engine has done: batches and their outcomes, bytes
    /// and requests per direction and per peer, batch latency, registered memory and
    /// notifications (docs/metrics.md explains each). Cheap enough to call often.
    pub fn metrics(&self) -> Metrics {
        self.inner.metrics()
    }

    /// How bytes to `peer` travel, in the backend's words, where it has more than one
    /// way (te-tcp: `socket`, `in-process device copies (host memory over the socket)`, `same-host channel …`);
    /// `None` where the backend has one way, no longer knows the peer, or the peer was
    /// connected by another engine.
    pub fn path_to(&self, peer: &Peer) -> Option<String> {
        self.inner.mine(peer, "path_to").ok()?;
        self.inner.backend.path_to(peer.inner.backend_id)
    }

    /// Where the metrics endpoint listens (`[engine] metrics_listen`), if it runs.
    pub fn metrics_address(&self) -> Option<SocketAddr> {
        self.exporter.as_ref().map(exporter::Exporter::address)
    }

    /// The next received notification, waiting at most `timeout`.
    pub fn recv_notification(&self, timeout: Duration) -> Option<Notification> {
        self.inner.inbox.pop(timeout)
    }

    /// Every notification received and not yet read, without waiting.
    pub fn try_recv_notifications(&self) -> Vec<Notification> {
        self.inner.inbox.drain()
    }

    /// The next notification, as a future (for async callers).
    pub fn next_notification(&self) -> Next<'_, Notification> {
        self.inner.inbox.next()
    }

    /// The next peer event (a peer lost, restarted or gone), waiting at most `timeout`.
    pub fn recv_event(&self, timeout: Duration) -> Option<PeerEvent> {
        self.inner.control.events.pop(timeout)
    }

    /// Every peer event not yet read, without waiting. At most the last 4,096 are
    /// kept; [`Engine::events_dropped`] counts older ones that were dropped.
    pub fn try_recv_events(&self) -> Vec<PeerEvent> {
        self.inner.control.events.drain()
    }

    /// The next peer event, as a future.
    pub fn next_event(&self) -> Next<'_, PeerEvent> {
        self.inner.control.events.next()
    }

    /// Peer events dropped unread because too many were queued.
    pub fn events_dropped(&self) -> u64 {
        self.inner.control.events.dropped()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Out of the directory first, goodbye to every peer next, then the backend
        // lets them go.
        let bound = self
            .inner
            .config
            .default_timeout
            .min(Duration::from_secs(2));
        self.inner.store.withdraw(Deadline::after(bound));
        self.exporter.take();
        self.control.take();
        let peers: Vec<Peer> = self.inner.peers.lock().drain().map(|(_, p)| p).collect();
        let deadline = self.inner.deadline(None);
        for p in peers {
            p.inner.valid.store(false, Ordering::Release);
            let _ = self.inner.backend.disconnect(p.inner.backend_id, deadline);
        }
        // Last, every region still registered is deregistered (a registration that
        // outlives its engine learns how), so the backend, which only registrations
        // reach besides the engine, goes with it: its listener stops serving and no
        // request of a peer lands after the engine closed.
        // A fresh deadline: the disconnects may have used up the first.
        let deadline = self.inner.deadline(None);
        // Layouts first: their slots are regions of their own, withdrawn with them.
        let layouts: Vec<String> = self.inner.layouts.read().keys().cloned().collect();
        for name in layouts {
            match self.inner.withdraw_layout(&name, deadline) {
                // Withdrawn meanwhile by another thread.
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::NotRegistered => {}
                Err(e) => {
                    tracing::warn!(layout = %name, error = %e, "withdrawing a layout at engine close failed")
                }
            }
        }
        let ids: Vec<RegionId> = self.inner.regions.read().keys().copied().collect();
        for id in ids {
            match self.inner.release_region(id, deadline) {
                Ok(()) => {}
                // Deregistered meanwhile by its registration.
                Err(e) if e.kind() == ErrorKind::NotRegistered => {}
                Err(e) => {
                    tracing::error!(region = %id, error = %e, "deregistration at engine close failed: the backend may still touch this memory; it must never be freed")
                }
            }
        }
    }
}

impl Handler for Inner {
    fn segment(&self) -> SegmentDesc {
        Inner::segment(self)
    }

    fn notify(&self, from: &Identity, to_epoch: u64, message: Vec<u8>) -> Result<()> {
        let kept = self.keep_notification(from, to_epoch, message);
        let counter = match kept {
            Ok(()) => &self.metrics.notifications_received,
            Err(_) => &self.metrics.notifications_refused,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        kept
    }

    fn peer_gone(&self, name: &str, epoch: u64) {
        self.let_go(name, epoch);
    }
}

impl Inner {
    /// Puts a notification from an authenticated peer in the inbox, within its budget.
    fn keep_notification(&self, from: &Identity, to_epoch: u64, message: Vec<u8>) -> Result<()> {
        if to_epoch != self.epoch {
            return Err(Error::new(
                ErrorKind::PeerRestarted,
                "this engine restarted since the sender connected; the notification belongs to its previous life",
            ));
        }
        // Charged at what it holds, not only its message: a flood of empty
        // notifications is bounded by the same budget.
        let size = std::mem::size_of::<Notification>()
            + from.name.len()
            + from.address.len()
            + message.len();
        // One sender (by name) holds at most a quarter of the budget, or one largest
        // notification with what it is charged besides its message: a flood from one
        // peer leaves room for the others.
        let budget = self.config.notification_bytes as usize;
        let overhead = size - message.len();
        let share = (budget / 4).max(self.config.notification_max as usize + overhead);
        let sender = std::hash::BuildHasher::hash_one(
            &std::hash::BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default(),
            &from.name,
        );
        self.inbox.push_within(
            Notification {
                from: from.name.clone(),
                from_epoch: from.epoch,
                from_address: from.address.clone(),
                received: std::time::SystemTime::now(),
                message,
            },
            size,
            (budget, share),
            sender,
        )
    }
}

impl Inner {
    /// Whether a cached peer can be used as it is: not invalidated by a failure, and
    /// its session (its liveness) still up.
    fn live(&self, peer: &Peer) -> bool {
        if !peer.inner.valid.load(Ordering::Acquire) {
            return false;
        }
        if self.control.session_alive(&peer.inner.addr) {
            return true;
        }
        peer.inner.valid.store(false, Ordering::Release);
        false
    }

    fn deadline(&self, timeout: Option<Duration>) -> Deadline {
        Deadline::after(timeout.unwrap_or(self.config.default_timeout))
    }

    fn segment(&self) -> SegmentDesc {
        let mut regions: Vec<RegionDesc> = self
            .regions
            .read()
            .values()
            .filter(|r| r.desc.access.remote_read || r.desc.access.remote_write)
            .map(|r| r.desc.clone())
            .collect();
        regions.sort_by_key(|r| r.id);
        let mut layouts: Vec<KvLayout> = self
            .layouts
            .read()
            .values()
            .map(|l| l.published.clone())
            .collect();
        layouts.sort_by(|a, b| a.name.cmp(&b.name));
        SegmentDesc {
            engine: self.config.name.clone(),
            epoch: self.epoch,
            address: self.control.address().to_string(),
            backend: self.backend.info().name.clone(),
            endpoint: self.backend.endpoint(),
            regions,
            layouts,
        }
    }
}

mod exporter;
mod layouts;
mod peers;
mod regions;
mod submit;

impl Inner {
    /// The counters' snapshot, with the peers this engine holds.
    fn metrics(&self) -> Metrics {
        let peers = self
            .peers
            .lock()
            .values()
            .map(|p| {
                let name = p.inner.segment.read().engine.clone();
                p.inner.metrics.snapshot(&p.inner.addr, &name)
            })
            .collect();
        let mut m = self.metrics.snapshot(peers);
        self.control.counters.fill(&mut m);
        m.backend = self.backend.gauges();
        m
    }
}

pub use layouts::BlockOptions;
pub use peers::Peer;
pub use regions::Registration;
