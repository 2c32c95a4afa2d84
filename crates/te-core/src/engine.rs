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

use crate::backend::{random_nonzero, BatchId, Completion, Deadline, TransferBackend};
use crate::batch::{Abort, BatchState, Timer, TransferHandle};
use crate::buffer::Buffer;
use crate::config::{Config, EngineConfig};
use crate::control::{self, wire, ControlPlane, Handler, Identity, Kind, Settings};
use crate::desc::{
    Access, BackendInfo, MemoryDesc, MemoryKind, Op, PeerId, RegionDesc, RegionId, SegmentDesc,
    TransferRequest,
};
use crate::error::{Error, ErrorKind, Result};
use crate::hook::{ControlHook, HookSlot, HookTarget};
use crate::inbox::{Mailbox, Next, Notification, PeerEvent};
use crate::kv::{self, KvLayout, KvSelection};
use crate::metadata::{self, EngineEntry, MetadataStore};
use crate::region::{fits, Pins, Region};
use crate::registry::{Origin, Registry};

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

/// Options of [`Engine::pull_blocks`] and [`Engine::push_blocks`].
#[derive(Debug, Clone, Default)]
pub struct BlockOptions {
    /// Which groups and slots move; all by default.
    pub selection: KvSelection,
    /// Deadline and notification, as for any batch.
    pub transfer: TransferOptions,
}

/// A transfer engine: one backend, one control plane, its registrations and peers.
///
/// Dropping it stops the control plane and disconnects its peers; batches still in
/// flight fail (with `Cancelled` or `PeerUnreachable`) once their backend has released
/// them, or complete. Registrations and buffers keep what they need of the engine and
/// may outlive it.
pub struct Engine {
    inner: Arc<Inner>,
    control: Option<ControlPlane>,
}

/// A KV layout as registered: the caller's version (for planning local requests) and
/// the published one, whose slots are views registered as regions of their own.
struct LayoutEntry {
    local: KvLayout,
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
    peers: Mutex<HashMap<String, Peer>>,
    inbox: Mailbox<Notification>,
    timer: Timer,
    control: Arc<control::Shared>,
    store: Arc<dyn MetadataStore>,
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
    /// `ConfigInvalid` for an unknown backend (listing the available ones) or a bad
    /// backend table; `Unavailable` if the backend cannot run here (with the probe's
    /// reason); `Io` if the control plane cannot listen.
    pub fn from_config(config: &Config) -> Result<Engine> {
        let registry = Registry::discover(&config.engine.plugin_dirs);
        Engine::with_registry(config, &registry)
    }

    /// As [`Engine::from_config`], with a registry already discovered.
    ///
    /// # Errors
    /// As [`Engine::from_config`].
    pub fn with_registry(config: &Config, registry: &Registry) -> Result<Engine> {
        crate::device::configure(&config.runtimes);
        let name = &config.engine.backend;
        let entry = registry.get(name)?;
        let mut ctx = config.backend_context(name);
        ctx.epoch = random_nonzero();
        let hook = Arc::new(HookSlot::default());
        ctx.hook = ControlHook::new(HookTarget::Engine(hook.clone()));
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
    /// `Io` if the control plane cannot listen or threads cannot start.
    pub fn with_backend(
        config: EngineConfig,
        backend: Arc<dyn TransferBackend>,
        origin: Origin,
        epoch: u64,
    ) -> Result<Engine> {
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
        let settings = Settings {
            name: config.name.clone(),
            epoch,
            token: config.auth_token.clone().map(String::into_bytes),
            heartbeat: config.heartbeat,
            handshake_timeout: config.handshake_timeout,
            max_pending: config.max_pending,
            max_pending_per_source: config.max_pending_per_source,
            max_sessions: config.max_sessions,
            max_sessions_per_source: config.max_sessions_per_source,
            notification_max: config.notification_max as usize,
            versions: control::VERSIONS,
        };
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
            peers: Mutex::new(HashMap::new()),
            timer: Timer::start()?,
            control: plane.shared(),
            store,
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
        Ok(Engine {
            inner,
            control: Some(plane),
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

    /// Allocates `len` zeroed, page-aligned bytes of host memory and registers them.
    ///
    /// # Errors
    /// As [`Engine::register`]; `InvalidRequest` for zero length.
    pub fn alloc(&self, name: &str, len: usize, access: Access) -> Result<Buffer> {
        self.alloc_on(&MemoryKind::Host, name, len, access)
    }

    /// Allocates `len` zeroed bytes of memory of `kind` (host, or a device through its
    /// runtime) and registers them.
    ///
    /// # Errors
    /// As [`Engine::alloc`]; `Unsupported` or `Unavailable` if the device runtime is
    /// unknown or cannot run here.
    pub fn alloc_on(
        &self,
        kind: &MemoryKind,
        name: &str,
        len: usize,
        access: Access,
    ) -> Result<Buffer> {
        Buffer::new(kind, name, len, access, |desc| self.inner.register(desc))
    }

    /// Connects to the engine whose control plane listens at `addr` (`host:port`, or
    /// an engine's name with an etcd metadata store), within the engine's default
    /// timeout. Cached: a second call returns the same peer
    /// until a failure or a restart invalidates it.
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
    /// that does not fit; `PeerRestarted` if the peer restarted since `peer` was
    /// obtained (connect again and look its regions up anew); `Timeout` if the deadline
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

    /// Registers a KV-cache layout and publishes it to peers (in the descriptor they
    /// fetch from now on). Every slot must lie inside a region registered here. Each
    /// slot is also registered as a region of its own (a view, with its region's
    /// access), and peers address the slot through it, so the receiving side refuses a
    /// block transfer that reaches outside its slot, not only outside the region.
    ///
    /// # Errors
    /// `InvalidRequest` for a malformed layout or a name already registered;
    /// `NotRegistered` for a slot in an unknown region; `OutOfBounds` for a slot that
    /// does not fit its region; the backend's error if it refuses a slot's view.
    pub fn register_layout(&self, layout: KvLayout) -> Result<()> {
        self.inner.register_layout(layout, None)
    }

    /// As [`Engine::register_layout`], with the slots' views published with `access`
    /// instead of their regions' (so a framework can keep its allocation local and
    /// expose only the slots).
    ///
    /// # Errors
    /// As [`Engine::register_layout`].
    pub fn register_layout_with(&self, layout: KvLayout, access: Access) -> Result<()> {
        self.inner.register_layout(layout, Some(access))
    }

    /// Withdraws a layout, and deregisters its slots' views (waiting for transfers on
    /// them, as any deregistration does).
    ///
    /// # Errors
    /// `NotRegistered` if no layout has that name; a view's deregistration error.
    pub fn deregister_layout(&self, name: &str) -> Result<KvLayout> {
        let deadline = self.inner.deadline(None);
        self.inner.withdraw_layout(name, deadline)
    }

    /// READs blocks `remote_ids` of the peer's layout `layout` into blocks `local_ids`
    /// of the local layout of the same name (pairwise), merging runs of consecutive
    /// ids into single requests. One deadline covers refreshing the peer's descriptor
    /// and the batch.
    ///
    /// # Errors
    /// As [`kv::plan`] for the block lists; `NotRegistered` if either side has no such
    /// layout; as [`Engine::transfer_with`] for the requests.
    pub fn pull_blocks(
        &self,
        peer: &Peer,
        layout: &str,
        remote_ids: &[u64],
        local_ids: &[u64],
        options: &BlockOptions,
    ) -> Result<TransferHandle> {
        self.blocks(Op::Read, peer, layout, remote_ids, local_ids, options)
    }

    /// WRITEs blocks `local_ids` of the local layout `layout` into blocks `remote_ids`
    /// of the peer's layout of the same name (pairwise).
    ///
    /// # Errors
    /// As [`Engine::pull_blocks`].
    pub fn push_blocks(
        &self,
        peer: &Peer,
        layout: &str,
        remote_ids: &[u64],
        local_ids: &[u64],
        options: &BlockOptions,
    ) -> Result<TransferHandle> {
        self.blocks(Op::Write, peer, layout, remote_ids, local_ids, options)
    }

    fn blocks(
        &self,
        op: Op,
        peer: &Peer,
        layout: &str,
        remote_ids: &[u64],
        local_ids: &[u64],
        options: &BlockOptions,
    ) -> Result<TransferHandle> {
        let operation = match op {
            Op::Read => "pull blocks",
            Op::Write => "push blocks",
        };
        let deadline = self.inner.deadline(options.transfer.timeout);
        let local = self
            .inner
            .layouts
            .read()
            .get(layout)
            .map(|l| l.local.clone())
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::NotRegistered,
                    format!("no local layout named `{layout}`; register it first"),
                )
                .with_operation(operation)
            })?;
        let peer = self.inner.current(peer, deadline)?;
        let mut remote = peer.segment().layout(layout).cloned();
        if remote.is_none() {
            self.inner.refresh(&peer, deadline)?;
            remote = peer.segment().layout(layout).cloned();
        }
        let remote = remote.ok_or_else(|| {
            Error::new(
                ErrorKind::NotRegistered,
                format!("the peer has no layout named `{layout}`"),
            )
            .with_operation(operation)
        })?;
        let requests = kv::plan(
            op,
            &local,
            &remote,
            remote_ids,
            local_ids,
            &options.selection,
        )
        .map_err(|e| e.with_operation(operation))?;
        self.inner
            .transfer(&peer, &requests, deadline, options.transfer.notify.clone())
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
        self.control.take();
        let peers: Vec<Peer> = self.inner.peers.lock().drain().map(|(_, p)| p).collect();
        let deadline = self.inner.deadline(None);
        for p in peers {
            p.inner.valid.store(false, Ordering::Release);
            let _ = self.inner.backend.disconnect(p.inner.backend_id, deadline);
        }
    }
}

impl Handler for Inner {
    fn segment(&self) -> SegmentDesc {
        Inner::segment(self)
    }

    fn notify(&self, from: &Identity, to_epoch: u64, message: Vec<u8>) -> Result<()> {
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
        self.inbox.push_within(
            Notification {
                from: from.name.clone(),
                from_epoch: from.epoch,
                from_address: from.address.clone(),
                received: std::time::SystemTime::now(),
                message,
            },
            size,
            self.config.notification_bytes as usize,
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

    fn register(self: &Arc<Self>, desc: MemoryDesc) -> Result<Registration> {
        let bad =
            |m: String| Err(Error::new(ErrorKind::InvalidRequest, m).with_operation("register"));
        if desc.len == 0 {
            return bad(format!("region `{}` has zero length", desc.name));
        }
        if desc.addr == 0 {
            return bad(format!("region `{}` has a null address", desc.name));
        }
        if desc.addr.checked_add(desc.len).is_none() {
            return bad(format!(
                "region `{}` wraps around the address space",
                desc.name
            ));
        }
        let caps = &self.backend.info().capabilities;
        if !caps.memory.iter().any(|m| m == desc.kind.runtime()) {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "backend `{}` cannot move {} memory (it moves: {})",
                    self.backend.info().name,
                    desc.kind,
                    caps.memory.join(", ")
                ),
            )
            .with_operation("register"));
        }
        if let MemoryKind::Device { runtime, ordinal } = &desc.kind {
            let info = crate::device::runtime(runtime)
                .and_then(|rt| rt.pointer_info(desc.addr))
                .map_err(|e| e.with_operation("register"))?;
            let inside = desc
                .addr
                .checked_add(desc.len)
                .is_some_and(|end| end <= info.base + info.len);
            if info.ordinal != *ordinal || !inside {
                return bad(format!(
                    "region `{}` ({:#x}+{}) is not inside one allocation of {}: the address belongs to {runtime}:{} ({:#x}+{})",
                    desc.name, desc.addr, desc.len, desc.kind, info.ordinal, info.base, info.len
                ));
            }
        }
        let region = self.add_region(desc)?;
        Ok(Registration {
            engine: self.clone(),
            region,
            done: false,
        })
    }

    /// Registers `desc` with the backend under a fresh id and enters it in the table.
    fn add_region(&self, desc: MemoryDesc) -> Result<RegionDesc> {
        let id = RegionId(self.next_region.fetch_add(1, Ordering::Relaxed));
        let key = self
            .backend
            .register(id, &desc)
            .map_err(|e| e.with_operation("register"))?;
        let region = RegionDesc {
            id,
            name: desc.name,
            addr: desc.addr,
            len: desc.len,
            kind: desc.kind,
            access: desc.access,
            key,
        };
        self.regions.write().insert(id, Region::new(region.clone()));
        Ok(region)
    }

    /// Deregisters region `id`: no new batch can name it; batches pinning it are waited
    /// for until `deadline`, then aborted and waited for until they are released (the
    /// memory contract outranks the clock); then the backend forgets it. Layouts built
    /// on it are withdrawn first.
    fn release_region(&self, id: RegionId, deadline: Deadline) -> Result<()> {
        let built_on: Vec<String> = self
            .layouts
            .read()
            .iter()
            .filter(|(_, l)| l.views.iter().any(|(parent, _)| *parent == id))
            .map(|(name, _)| name.clone())
            .collect();
        for name in built_on {
            if let Err(e) = self.withdraw_layout(&name, deadline) {
                tracing::warn!(layout = %name, error = %e, "withdrawing a layout failed");
            }
        }
        let Some(region) = self.regions.write().remove(&id) else {
            return Err(Error::new(
                ErrorKind::NotRegistered,
                format!("region {id} is not registered (or was deregistered already)"),
            )
            .with_operation("deregister"));
        };
        if !region.wait_unpinned(Some(deadline.instant())) {
            let pinned = region.pinned();
            tracing::warn!(region = %id, batches = pinned.len(), "deregistering a region with batches in flight: aborting them");
            for b in pinned {
                b.request_abort(Abort::Deregister);
            }
            region.wait_unpinned(None);
        }
        self.backend
            .deregister(id, deadline)
            .map_err(|e| e.with_operation("deregister").with_context("region", id))
    }

    fn register_layout(&self, layout: KvLayout, access: Option<Access>) -> Result<()> {
        let fail = |e: Error| Err(e.with_operation("register layout"));
        if let Err(e) = layout.validate() {
            return fail(e);
        }
        if self.layouts.read().contains_key(&layout.name) {
            return fail(Error::new(
                ErrorKind::InvalidRequest,
                format!("a layout named `{}` is already registered", layout.name),
            ));
        }
        let mut entry = LayoutEntry {
            published: layout.clone(),
            local: layout,
            views: Vec::new(),
        };
        let deadline = self.deadline(None);
        let undo = |entry: &LayoutEntry, e: Error| {
            for (_, view) in &entry.views {
                let _ = self.release_region(*view, deadline);
            }
            fail(e)
        };
        let name = entry.local.name.clone();
        for gi in 0..entry.local.groups.len() {
            for si in 0..entry.local.groups[gi].slots.len() {
                let (g, s) = (&entry.local.groups[gi], &entry.local.groups[gi].slots[si]);
                let at = format!("layout `{name}` group `{}` slot `{}`", g.name, s.name);
                let parent = self.regions.read().get(&s.region).map(|r| r.desc.clone());
                let Some(parent) = parent else {
                    let e = Error::new(
                        ErrorKind::NotRegistered,
                        format!("{at}: region {} is not registered here", s.region),
                    );
                    return undo(&entry, e);
                };
                let len = s.blocks * s.bytes_per_block;
                if !fits(s.offset, len, parent.len) {
                    let e = Error::new(
                        ErrorKind::OutOfBounds,
                        format!("{at}: {} blocks of {} bytes from offset {} do not fit region {} of {} bytes", s.blocks, s.bytes_per_block, s.offset, s.region, parent.len),
                    );
                    return undo(&entry, e);
                }
                let view = MemoryDesc {
                    name: format!("{name}/{}/{}", g.name, s.name),
                    addr: parent.addr + s.offset,
                    len,
                    kind: parent.kind.clone(),
                    access: access.unwrap_or(parent.access),
                };
                match self.add_region(view) {
                    Ok(v) => {
                        entry.views.push((parent.id, v.id));
                        let published = &mut entry.published.groups[gi].slots[si];
                        published.region = v.id;
                        published.offset = 0;
                    }
                    Err(e) => return undo(&entry, e),
                }
            }
        }
        let mut layouts = self.layouts.write();
        if layouts.contains_key(&name) {
            drop(layouts);
            let e = Error::new(
                ErrorKind::InvalidRequest,
                format!("a layout named `{name}` is already registered"),
            );
            return undo(&entry, e);
        }
        layouts.insert(name, entry);
        Ok(())
    }

    fn withdraw_layout(&self, name: &str, deadline: Deadline) -> Result<KvLayout> {
        let entry = self.layouts.write().remove(name).ok_or_else(|| {
            Error::new(
                ErrorKind::NotRegistered,
                format!("no layout named `{name}`"),
            )
            .with_operation("deregister layout")
        })?;
        let mut first_error = None;
        for (_, view) in &entry.views {
            if let Err(e) = self.release_region(*view, deadline) {
                tracing::error!(region = %view, error = %e, "a layout slot's view could not be deregistered");
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            Some(e) => Err(e.with_operation("deregister layout")),
            None => Ok(entry.local),
        }
    }

    /// The address of `peer`: itself if it is `host:port`, else the address the
    /// metadata store has for that name.
    fn resolve(&self, peer: &str, deadline: Deadline) -> Result<String> {
        if metadata::is_address(peer) || self.config.metadata == "p2p" {
            return Ok(peer.to_string());
        }
        match self.store.resolve(peer, deadline) {
            Ok(Some(entry)) => Ok(entry.address),
            Ok(None) => Err(Error::new(
                ErrorKind::PeerUnreachable,
                format!(
                    "no engine named `{peer}` in {}; is it running? (`te peers` lists the engines there)",
                    self.store.describe()
                ),
            )),
            Err(e) => Err(e),
        }
        .map_err(|e| e.with_operation("connect").with_context("peer", peer))
    }

    /// Invalidates the cached peers at `address` (their store entry went stale).
    fn forget(&self, address: &str) {
        for p in self.peers.lock().values() {
            if p.inner.addr == address {
                p.inner.valid.store(false, Ordering::Release);
            }
        }
    }

    fn connect(&self, addr: &str, deadline: Deadline) -> Result<Peer> {
        let addr = &self.resolve(addr, deadline)?;
        if let Some(p) = self.peers.lock().get(addr) {
            if self.live(p) {
                return Ok(p.clone());
            }
        }
        let segment = self.handshake(addr, deadline)?;
        let backend_id = self
            .backend
            .connect(&segment, deadline)
            .map_err(|e| e.with_operation("connect").with_context("peer", addr))?;
        let peer = Peer {
            inner: Arc::new(PeerInner {
                addr: addr.to_string(),
                epoch: segment.epoch,
                segment: RwLock::new(Arc::new(segment)),
                backend_id,
                valid: AtomicBool::new(true),
            }),
        };
        let old = self.peers.lock().insert(addr.to_string(), peer.clone());
        if let Some(old) = old {
            old.inner.valid.store(false, Ordering::Release);
            if old.inner.backend_id != backend_id {
                let _ = self.backend.disconnect(old.inner.backend_id, deadline);
            }
        }
        Ok(peer)
    }

    fn handshake(&self, addr: &str, deadline: Deadline) -> Result<SegmentDesc> {
        let segment: SegmentDesc = match self
            .control
            .call(addr, Kind::GetSegment, Vec::new(), deadline)
            .map_err(|e| e.with_operation("connect").with_context("peer", addr))?
        {
            (Kind::Segment, body) => wire::decode(&body, "segment descriptor")
                .map_err(|e| e.with_operation("connect").with_context("peer", addr))?,
            (other, _) => {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    format!("the peer answered the handshake with {other:?}"),
                )
                .with_operation("connect")
                .with_context("peer", addr))
            }
        };
        let ours = &self.backend.info().name;
        if &segment.backend != ours {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "the peer runs backend `{}` and this engine runs `{ours}`; both sides must use the same backend",
                    segment.backend
                ),
            )
            .with_operation("connect")
            .with_context("peer", addr));
        }
        for local in self.layouts.read().values() {
            if let Some(remote) = segment.layout(&local.local.name) {
                local
                    .local
                    .check_compatible(remote)
                    .map_err(|e| e.with_operation("connect").with_context("peer", addr))?;
            }
        }
        Ok(segment)
    }

    /// The live version of `peer`: itself if valid, else a fresh connection to the same
    /// address, provided the peer has not restarted.
    fn current(&self, peer: &Peer, deadline: Deadline) -> Result<Peer> {
        if self.live(peer) {
            return Ok(peer.clone());
        }
        let fresh = self.connect(&peer.inner.addr, deadline)?;
        if fresh.inner.epoch != peer.inner.epoch {
            return Err(Error::new(
                ErrorKind::PeerRestarted,
                "the peer restarted; its regions belong to its previous life: connect again and look them up anew",
            )
            .with_operation("transfer")
            .with_context("peer", &peer.inner.addr));
        }
        Ok(fresh)
    }

    /// Fetches the peer's descriptor again (it registered new regions).
    fn refresh(&self, peer: &Peer, deadline: Deadline) -> Result<()> {
        let segment = self.handshake(&peer.inner.addr, deadline)?;
        if segment.epoch != peer.inner.epoch {
            peer.inner.valid.store(false, Ordering::Release);
            return Err(Error::new(
                ErrorKind::PeerRestarted,
                "the peer restarted; connect again",
            )
            .with_operation("transfer")
            .with_context("peer", &peer.inner.addr));
        }
        self.backend.connect(&segment, deadline)?;
        *peer.inner.segment.write() = Arc::new(segment);
        Ok(())
    }

    /// Checks every request and pins the batch's local regions; nothing is pinned
    /// unless every request passes.
    fn check(
        &self,
        peer: &Peer,
        requests: &[TransferRequest],
        state: &Arc<BatchState>,
    ) -> Result<Pins> {
        let mut segment = peer.segment();
        if requests.iter().any(|r| segment.region(r.remote).is_none()) {
            self.refresh(peer, state.deadline())?;
            segment = peer.segment();
        }
        let caps = &self.backend.info().capabilities;
        let local = self.regions.read();
        let mut pinned: Vec<Arc<Region>> = Vec::new();
        for (i, r) in requests.iter().enumerate() {
            let fail = |kind: ErrorKind, m: String| {
                Err(Error::new(kind, m)
                    .with_operation("transfer")
                    .with_context("request", i))
            };
            if r.len == 0 {
                return fail(ErrorKind::InvalidRequest, "zero-length request".into());
            }
            if r.len > caps.max_request_size {
                return fail(
                    ErrorKind::Unsupported,
                    format!(
                        "{} bytes exceed the backend's largest request ({}); split it",
                        r.len, caps.max_request_size
                    ),
                );
            }
            let (allowed, right) = match r.op {
                Op::Read => (caps.read, "remotely readable"),
                Op::Write => (caps.write, "remotely writable"),
            };
            if !allowed {
                return fail(
                    ErrorKind::Unsupported,
                    format!("backend `{}` cannot {}", self.backend.info().name, r.op),
                );
            }
            let Some(l) = local.get(&r.local) else {
                return fail(
                    ErrorKind::NotRegistered,
                    format!(
                        "local region {} is not registered (or was deregistered)",
                        r.local
                    ),
                );
            };
            if !fits(r.local_offset, r.len, l.desc.len) {
                return fail(
                    ErrorKind::OutOfBounds,
                    format!(
                        "local range {}+{} is outside region {} of {} bytes",
                        r.local_offset, r.len, r.local, l.desc.len
                    ),
                );
            }
            let Some(rem) = segment.region(r.remote) else {
                return fail(
                    ErrorKind::NotRegistered,
                    format!(
                        "the peer has no region {} (never registered, or deregistered)",
                        r.remote
                    ),
                );
            };
            let ok = match r.op {
                Op::Read => rem.access.remote_read,
                Op::Write => rem.access.remote_write,
            };
            if !ok {
                return fail(
                    ErrorKind::InvalidRequest,
                    format!(
                        "the peer's region {} (`{}`) is not {right}",
                        r.remote, rem.name
                    ),
                );
            }
            if !fits(r.remote_offset, r.len, rem.len) {
                return fail(
                    ErrorKind::OutOfBounds,
                    format!(
                        "remote range {}+{} is outside the peer's region {} of {} bytes",
                        r.remote_offset, r.len, r.remote, rem.len
                    ),
                );
            }
            if !pinned.iter().any(|p| p.desc.id == r.local) {
                pinned.push(l.clone());
            }
        }
        // Pinned under the table's read lock: a deregistration either removed the
        // region before this check (which then failed) or waits for this batch.
        Ok(Pins::new(state, pinned))
    }

    fn transfer(
        &self,
        peer: &Peer,
        requests: &[TransferRequest],
        deadline: Deadline,
        notify: Option<Vec<u8>>,
    ) -> Result<TransferHandle> {
        let state = BatchState::new(
            BatchId(self.next_batch.fetch_add(1, Ordering::Relaxed)),
            deadline,
        );
        let peer = self.current(peer, deadline)?;
        let pins = self.check(&peer, requests, &state)?;
        self.timer.add(&state);
        let handle = TransferHandle::new(state.clone());
        let finisher = Finisher {
            state: state.clone(),
            pins,
            peer: peer.clone(),
            notify: notify.map(|message| {
                (
                    self.control.clone(),
                    wire::Notice {
                        to_epoch: peer.inner.epoch,
                        message,
                    },
                )
            }),
        };
        if requests.is_empty() {
            finisher.finish(Ok(()));
            return Ok(handle);
        }
        // The batch ends when both the backend's completion and `submit`'s return are
        // in, so an error returned by `submit` is never masked by the dropped completion.
        // The pins go with the finisher: they are released once the backend has
        // released the batch, right after its result is set.
        let join = Arc::new(Mutex::new(Join::default()));
        let (j, f) = (join.clone(), Arc::new(Mutex::new(Some(finisher))));
        let f2 = f.clone();
        let done = Completion::build(
            state.id(),
            deadline,
            state.abort_flag(),
            Box::new(move |r, dropped| {
                let r = if dropped {
                    Err(r
                        .err()
                        .unwrap_or_else(|| Error::new(ErrorKind::Cancelled, "dropped")))
                } else {
                    r
                };
                Join::arrive(&j, &f2, Some(r), None);
            }),
        );
        let backend_id = peer.inner.backend_id;
        let submitted = self.backend.submit(backend_id, requests, done);
        let ok = submitted.is_ok();
        Join::arrive(
            &join,
            &f,
            None,
            Some(submitted.map_err(|e| e.with_operation("transfer"))),
        );
        if ok {
            let backend = Arc::downgrade(&self.backend);
            let batch = state.id();
            state.set_hook(Arc::new(move || {
                if let Some(b) = backend.upgrade() {
                    b.abort(backend_id, batch);
                }
            }));
        }
        Ok(handle)
    }
}

#[derive(Default)]
struct Join {
    completed: Option<Result<()>>,
    submitted: Option<Result<()>>,
}

impl Join {
    fn arrive(
        join: &Mutex<Join>,
        finisher: &Mutex<Option<Finisher>>,
        completed: Option<Result<()>>,
        submitted: Option<Result<()>>,
    ) {
        let result = {
            let mut j = join.lock();
            if completed.is_some() {
                j.completed = completed;
            }
            if submitted.is_some() {
                j.submitted = submitted;
            }
            match (&j.submitted, &j.completed) {
                (Some(Err(e)), Some(_)) => Err(e.clone()),
                (Some(Ok(())), Some(r)) => r.clone(),
                _ => return,
            }
        };
        if let Some(f) = finisher.lock().take() {
            f.finish(result);
        }
    }
}

/// What happens when the backend has released a batch: peer bookkeeping, then either
/// the notification or the final result. It runs on whichever thread completed the
/// batch (often the backend's own), so it holds nothing that could make it the last
/// owner of the engine or the backend.
struct Finisher {
    state: Arc<BatchState>,
    /// The batch's pins on its local regions: dropped after its result is set (or,
    /// with a notification, once it is only the notification that is left).
    pins: Pins,
    peer: Peer,
    notify: Option<(Arc<control::Shared>, wire::Notice)>,
}

impl Finisher {
    fn finish(self, result: Result<()>) {
        // An abort (deadline, cancel, deregistration) decides the result once the
        // backend has released the batch, whatever the backend reported.
        let result = match self.state.aborted() {
            Some(why) => Err(why.error()),
            None => result,
        };
        if let Err(e) = &result {
            if matches!(
                e.kind(),
                ErrorKind::PeerUnreachable | ErrorKind::PeerRestarted
            ) {
                self.peer.inner.valid.store(false, Ordering::Release);
            }
        }
        match (result, self.notify) {
            (Ok(()), Some((control, notice))) => {
                if let Some(why) = self.state.enter_notify() {
                    self.state.finish(Err(why.error()));
                    return;
                }
                drop(self.pins);
                // Queued on the peer's session, pipelined with others; its answer (or
                // the batch's deadline, whichever comes first) ends the batch.
                let state = self.state.clone();
                control.send(
                    &self.peer.inner.addr,
                    Kind::Notify,
                    wire::encode(&notice),
                    self.state.deadline(),
                    Box::new(move |r| {
                        state.finish(r.map(|_| ()).map_err(|e| e.with_operation("notify")));
                    }),
                );
            }
            (result, _) => {
                self.state.finish(result);
                drop(self.pins);
            }
        }
    }
}

/// A connected peer: its descriptor and the backend's connection to it.
#[derive(Clone)]
pub struct Peer {
    inner: Arc<PeerInner>,
}

struct PeerInner {
    addr: String,
    epoch: u64,
    segment: RwLock<Arc<SegmentDesc>>,
    backend_id: PeerId,
    valid: AtomicBool,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("addr", &self.inner.addr)
            .field("epoch", &self.inner.epoch)
            .field("valid", &self.is_valid())
            .finish()
    }
}

impl Peer {
    /// The control-plane address it was reached at.
    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    /// The peer's epoch when connected.
    pub fn epoch(&self) -> u64 {
        self.inner.epoch
    }

    /// The peer's descriptor, as last fetched.
    pub fn segment(&self) -> Arc<SegmentDesc> {
        self.inner.segment.read().clone()
    }

    /// The peer's first region registered under `name`.
    pub fn region(&self, name: &str) -> Option<RegionDesc> {
        self.segment().region_named(name).cloned()
    }

    /// The peer's KV-cache layout named `name`, as last fetched. Its slots name the
    /// peer's views of them (regions of their own), at offset 0.
    pub fn kv_layout(&self, name: &str) -> Option<KvLayout> {
        self.segment().layout(name).cloned()
    }

    /// False once a failure or a restart invalidated it; the engine reconnects on next use.
    pub fn is_valid(&self) -> bool {
        self.inner.valid.load(Ordering::Acquire)
    }
}

/// Registered memory; deregistered when dropped, or by [`Registration::deregister`].
///
/// Deregistration waits for the batches in flight on the region (up to the engine's
/// default timeout), then aborts them and waits until their backend has released them,
/// and only then asks the backend to forget the region: once it has returned, nothing
/// of te touches the memory.
pub struct Registration {
    engine: Arc<Inner>,
    region: RegionDesc,
    done: bool,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("region", &self.region)
            .finish()
    }
}

impl Registration {
    /// The region's id, for requests.
    pub fn id(&self) -> RegionId {
        self.region.id
    }

    /// The region as peers see it.
    pub fn region(&self) -> &RegionDesc {
        &self.region
    }

    /// Deregisters the region and says whether the backend let go of it.
    ///
    /// # Errors
    /// The backend's error if it could not promise that nothing touches the memory
    /// any more. The memory is then *quarantined*: its owner must never free or reuse
    /// it (te's own buffers leak it on purpose, and say so in the log).
    pub fn deregister(mut self) -> Result<()> {
        self.done = true;
        self.engine
            .release_region(self.region.id, self.engine.deadline(None))
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if let Err(e) = self
            .engine
            .release_region(self.region.id, self.engine.deadline(None))
        {
            tracing::error!(
                region = %self.region.id,
                error = %e,
                "deregistration failed: the backend may still touch this memory; it must never be freed"
            );
        }
    }
}
