//! The engine: what users hold.
//!
//! It resolves the backend, serves the control plane, keeps registrations and peers,
//! checks every request against both sides' descriptors before anything is posted, and
//! turns backend completions into [`TransferHandle`]s.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use crate::backend::{Completion, TransferBackend};
use crate::batch::{BatchState, Timer, TransferHandle};
use crate::buffer::Buffer;
use crate::config::{Config, EngineConfig};
use crate::control::{self, Handler, Msg, Notice, Server};
use crate::desc::{
    Access, BackendInfo, MemoryDesc, MemoryKind, Op, PeerId, RegionDesc, RegionId, SegmentDesc,
    TransferRequest,
};
use crate::error::{Error, ErrorKind, Result};
use crate::kv::{self, KvLayout, KvSelection};
use crate::notify::{Inbox, Job, Notification, Notifier};
use crate::registry::{Origin, Registry};

/// Per-batch options.
#[derive(Debug, Clone, Default)]
pub struct TransferOptions {
    /// The batch's deadline, from submission; the engine's `default_timeout` if `None`.
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
/// Dropping it stops the control plane; batches still in flight fail with
/// `Cancelled` or complete, and never hang their waiters past their deadline.
pub struct Engine {
    inner: Arc<Inner>,
    server: Option<Server>,
}

struct Inner {
    config: EngineConfig,
    backend: Arc<dyn TransferBackend>,
    origin: Origin,
    epoch: u64,
    next_region: AtomicU64,
    regions: RwLock<HashMap<RegionId, RegionDesc>>,
    layouts: RwLock<HashMap<String, KvLayout>>,
    peers: Mutex<HashMap<String, Peer>>,
    inbox: Inbox,
    timer: Timer,
    notifier: Notifier,
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
        let name = &config.engine.backend;
        let entry = registry.get(name)?;
        let backend = entry.create(&config.backend_context(name))?;
        Engine::with_backend(config.engine.clone(), backend, entry.origin().clone())
    }

    /// Builds an engine around a backend instance.
    ///
    /// # Errors
    /// `Io` if the control plane cannot listen or threads cannot start.
    pub fn with_backend(
        config: EngineConfig,
        backend: Arc<dyn TransferBackend>,
        origin: Origin,
    ) -> Result<Engine> {
        let inner = Arc::new(Inner {
            inbox: Inbox::new(config.notification_queue),
            backend,
            origin,
            epoch: new_epoch(),
            next_region: AtomicU64::new(1),
            regions: RwLock::new(HashMap::new()),
            layouts: RwLock::new(HashMap::new()),
            peers: Mutex::new(HashMap::new()),
            timer: Timer::start()?,
            notifier: Notifier::start()?,
            config,
        });
        let handler: Weak<dyn Handler> = Arc::downgrade(&inner) as Weak<dyn Handler>;
        let server = Server::start(&inner.config.listen, handler)?;
        tracing::info!(
            engine = %inner.config.name,
            backend = %inner.backend.info().name,
            address = %server.addr(),
            "engine started"
        );
        Ok(Engine {
            inner,
            server: Some(server),
        })
    }

    /// The engine's name.
    pub fn name(&self) -> &str {
        &self.inner.config.name
    }

    /// The control-plane address peers pass to [`Engine::connect`].
    pub fn address(&self) -> SocketAddr {
        match &self.server {
            Some(s) => s.addr(),
            None => SocketAddr::from(([0, 0, 0, 0], 0)),
        }
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

    /// Registers caller-owned memory. Deregistered when the [`Registration`] drops.
    ///
    /// # Safety
    /// `desc.addr .. desc.addr + desc.len` must be memory of `desc.kind` that stays
    /// valid until the returned registration is dropped, and the caller must accept
    /// that the backend reads it and (for local READ destinations and remotely writable
    /// regions) writes it at any time until then.
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

    /// Connects to the engine whose control plane listens at `addr` (`host:port`).
    /// Cached: a second call returns the same peer until a failure or a restart
    /// invalidates it.
    ///
    /// # Errors
    /// `PeerUnreachable` if nothing answers before the default timeout; `Unsupported`
    /// if the peer runs another backend; `Protocol` if it is not a te engine.
    pub fn connect(&self, addr: &str) -> Result<Peer> {
        let deadline = Instant::now() + self.inner.config.default_timeout;
        self.inner.connect(addr, deadline)
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
    /// batch completes at once (after its notification, if any).
    ///
    /// # Errors
    /// `InvalidRequest`, `NotRegistered`, `OutOfBounds` or `Unsupported` for a request
    /// that does not fit; `PeerRestarted` if the peer restarted since `peer` was
    /// obtained (connect again and look its regions up anew); the backend's error if it
    /// refuses the batch as a whole.
    pub fn transfer_with(
        &self,
        peer: &Peer,
        requests: &[TransferRequest],
        options: &TransferOptions,
    ) -> Result<TransferHandle> {
        let timeout = options.timeout.unwrap_or(self.inner.config.default_timeout);
        let deadline = Instant::now() + timeout;
        let peer = self.inner.current(peer, deadline)?;
        self.inner.check(&peer, requests, deadline)?;
        Ok(self
            .inner
            .submit(&peer, requests, timeout, deadline, options.notify.clone()))
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
    /// fetch from now on). Every slot must lie inside a region registered here.
    ///
    /// # Errors
    /// `InvalidRequest` for a malformed layout or a name already registered;
    /// `NotRegistered` for a slot in an unknown region; `OutOfBounds` for a slot that
    /// does not fit its region.
    pub fn register_layout(&self, layout: KvLayout) -> Result<()> {
        layout
            .validate()
            .map_err(|e| e.with_operation("register layout"))?;
        let regions = self.inner.regions.read().unwrap_or_else(|p| p.into_inner());
        for g in &layout.groups {
            for s in &g.slots {
                let at = || {
                    format!(
                        "layout `{}` group `{}` slot `{}`",
                        layout.name, g.name, s.name
                    )
                };
                let Some(r) = regions.get(&s.region) else {
                    return Err(Error::new(
                        ErrorKind::NotRegistered,
                        format!("{}: region {} is not registered here", at(), s.region),
                    )
                    .with_operation("register layout"));
                };
                if !fits(s.offset, s.blocks * s.bytes_per_block, r.len) {
                    return Err(Error::new(
                        ErrorKind::OutOfBounds,
                        format!("{}: {} blocks of {} bytes from offset {} do not fit region {} of {} bytes", at(), s.blocks, s.bytes_per_block, s.offset, s.region, r.len),
                    )
                    .with_operation("register layout"));
                }
            }
        }
        drop(regions);
        let mut layouts = self
            .inner
            .layouts
            .write()
            .unwrap_or_else(|p| p.into_inner());
        if layouts.contains_key(&layout.name) {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                format!("a layout named `{}` is already registered", layout.name),
            )
            .with_operation("register layout"));
        }
        layouts.insert(layout.name.clone(), layout);
        Ok(())
    }

    /// Withdraws a layout.
    ///
    /// # Errors
    /// `NotRegistered` if no layout has that name.
    pub fn deregister_layout(&self, name: &str) -> Result<KvLayout> {
        self.inner
            .layouts
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::NotRegistered,
                    format!("no layout named `{name}`"),
                )
                .with_operation("deregister layout")
            })
    }

    /// READs blocks `remote_ids` of the peer's layout `layout` into blocks `local_ids`
    /// of the local layout of the same name (pairwise), merging runs of consecutive
    /// ids into single requests.
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
        let local = self
            .inner
            .layouts
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(layout)
            .cloned()
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::NotRegistered,
                    format!("no local layout named `{layout}`; register it first"),
                )
                .with_operation(operation)
            })?;
        let mut remote = peer.segment().layout(layout).cloned();
        if remote.is_none() {
            let deadline = Instant::now()
                + options
                    .transfer
                    .timeout
                    .unwrap_or(self.inner.config.default_timeout);
            self.inner.refresh(peer, deadline)?;
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
        self.transfer_with(peer, &requests, &options.transfer)
    }

    /// The next received notification, waiting at most `timeout`.
    pub fn recv_notification(&self, timeout: Duration) -> Option<Notification> {
        self.inner.inbox.pop(timeout)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.server.take();
        let peers: Vec<Peer> = self
            .inner
            .peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
            .map(|(_, p)| p)
            .collect();
        for p in peers {
            p.inner.valid.store(false, Ordering::Release);
            let _ = self.inner.backend.disconnect(p.inner.backend_id);
        }
    }
}

fn new_epoch() -> u64 {
    loop {
        let e: u64 = rand::random();
        if e != 0 {
            return e;
        }
    }
}

impl Handler for Inner {
    fn segment(&self) -> SegmentDesc {
        Inner::segment(self)
    }

    fn notify(&self, n: Notice) -> Result<()> {
        if n.to_epoch != self.epoch {
            return Err(Error::new(
                ErrorKind::PeerRestarted,
                "this engine restarted since the sender connected; the notification belongs to its previous life",
            ));
        }
        self.inbox.push(Notification {
            from: n.from_engine,
            from_epoch: n.from_epoch,
            message: n.message,
        })
    }
}

impl Inner {
    fn segment(&self) -> SegmentDesc {
        let mut regions: Vec<RegionDesc> = self
            .regions
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|r| r.access.remote_read || r.access.remote_write)
            .cloned()
            .collect();
        regions.sort_by_key(|r| r.id);
        let mut layouts: Vec<KvLayout> = self
            .layouts
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        layouts.sort_by(|a, b| a.name.cmp(&b.name));
        SegmentDesc {
            engine: self.config.name.clone(),
            epoch: self.epoch,
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
        self.regions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, region.clone());
        Ok(Registration {
            engine: self.clone(),
            region,
        })
    }

    fn connect(&self, addr: &str, deadline: Instant) -> Result<Peer> {
        if let Some(p) = self
            .peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(addr)
        {
            if p.inner.valid.load(Ordering::Acquire) {
                return Ok(p.clone());
            }
        }
        let segment = self.handshake(addr, deadline)?;
        let backend_id = self
            .backend
            .connect(&segment)
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
        let old = self
            .peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(addr.to_string(), peer.clone());
        if let Some(old) = old {
            old.inner.valid.store(false, Ordering::Release);
            if old.inner.backend_id != backend_id {
                let _ = self.backend.disconnect(old.inner.backend_id);
            }
        }
        Ok(peer)
    }

    fn handshake(&self, addr: &str, deadline: Instant) -> Result<SegmentDesc> {
        let segment = match control::call(addr, &Msg::GetSegment, deadline)
            .map_err(|e| e.with_operation("connect"))?
        {
            Msg::Segment(s) => s,
            Msg::Error(e) => return Err(e.with_operation("connect")),
            _ => {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    "the peer answered the handshake with something else",
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
        for local in self
            .layouts
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
        {
            if let Some(remote) = segment.layout(&local.name) {
                local
                    .check_compatible(remote)
                    .map_err(|e| e.with_operation("connect").with_context("peer", addr))?;
            }
        }
        Ok(segment)
    }

    /// The live version of `peer`: itself if valid, else a fresh connection to the same
    /// address, provided the peer has not restarted.
    fn current(&self, peer: &Peer, deadline: Instant) -> Result<Peer> {
        if peer.inner.valid.load(Ordering::Acquire) {
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
    fn refresh(&self, peer: &Peer, deadline: Instant) -> Result<()> {
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
        self.backend.connect(&segment)?;
        *peer
            .inner
            .segment
            .write()
            .unwrap_or_else(|p| p.into_inner()) = Arc::new(segment);
        Ok(())
    }

    fn check(&self, peer: &Peer, requests: &[TransferRequest], deadline: Instant) -> Result<()> {
        let mut segment = peer.segment();
        if requests.iter().any(|r| segment.region(r.remote).is_none()) {
            self.refresh(peer, deadline)?;
            segment = peer.segment();
        }
        let caps = &self.backend.info().capabilities;
        let local = self.regions.read().unwrap_or_else(|p| p.into_inner());
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
            if !fits(r.local_offset, r.len, l.len) {
                return fail(
                    ErrorKind::OutOfBounds,
                    format!(
                        "local range {}+{} is outside region {} of {} bytes",
                        r.local_offset, r.len, r.local, l.len
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
        }
        Ok(())
    }

    fn submit(
        self: &Arc<Self>,
        peer: &Peer,
        requests: &[TransferRequest],
        timeout: Duration,
        deadline: Instant,
        notify: Option<Vec<u8>>,
    ) -> TransferHandle {
        let state = BatchState::new(deadline);
        self.timer.add(&state);
        let handle = TransferHandle::new(state.clone());
        let finisher = Finisher {
            state,
            peer: peer.clone(),
            notify: notify.map(|message| (Arc::downgrade(self), message)),
        };
        if requests.is_empty() {
            finisher.finish(Ok(()));
            return handle;
        }
        // The batch ends when both the backend's completion and `submit`'s return are
        // in, so an error returned by `submit` is never masked by the dropped completion.
        let join = Arc::new(Mutex::new(Join::default()));
        let (j, f) = (join.clone(), Arc::new(Mutex::new(Some(finisher))));
        let f2 = f.clone();
        let done = Completion::new(timeout, move |r, dropped| {
            let r = if dropped {
                Err(r
                    .err()
                    .unwrap_or_else(|| Error::new(ErrorKind::Cancelled, "dropped")))
            } else {
                r
            };
            Join::arrive(&j, &f2, Some(r), None);
        });
        let submitted = self.backend.submit(peer.inner.backend_id, requests, done);
        Join::arrive(
            &join,
            &f,
            None,
            Some(submitted.map_err(|e| e.with_operation("transfer"))),
        );
        handle
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
            let mut j = join.lock().unwrap_or_else(|p| p.into_inner());
            if completed.is_some() {
                j.completed = completed;
            }
            if submitted.is_some() {
                j.submitted = submitted;
            }
            match (&j.submitted, &j.completed) {
                (Some(Err(e)), _) => Err(e.clone()),
                (Some(Ok(())), Some(r)) => r.clone(),
                _ => return,
            }
        };
        if let Some(f) = finisher.lock().unwrap_or_else(|p| p.into_inner()).take() {
            f.finish(result);
        }
    }
}

/// What happens when a batch's data part is over: peer bookkeeping, then either the
/// notification or the final result.
struct Finisher {
    state: Arc<BatchState>,
    peer: Peer,
    notify: Option<(Weak<Inner>, Vec<u8>)>,
}

impl Finisher {
    fn finish(self, result: Result<()>) {
        if let Err(e) = &result {
            if matches!(
                e.kind(),
                ErrorKind::PeerUnreachable | ErrorKind::PeerRestarted
            ) {
                self.peer.inner.valid.store(false, Ordering::Release);
            }
        }
        match (result, self.notify) {
            (Ok(()), Some((engine, message))) => match engine.upgrade() {
                Some(engine) => engine.notifier.send(Job {
                    addr: self.peer.inner.addr.clone(),
                    notice: Notice {
                        to_epoch: self.peer.inner.epoch,
                        from_engine: engine.config.name.clone(),
                        from_epoch: engine.epoch,
                        message,
                    },
                    state: self.state,
                }),
                None => {
                    self.state.finish(Err(Error::new(
                        ErrorKind::Cancelled,
                        "the engine shut down before the notification was sent",
                    )));
                }
            },
            (result, _) => {
                self.state.finish(result);
            }
        }
    }
}

fn fits(offset: u64, len: u64, region_len: u64) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= region_len)
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
        self.inner
            .segment
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The peer's first region registered under `name`.
    pub fn region(&self, name: &str) -> Option<RegionDesc> {
        self.segment().region_named(name).cloned()
    }

    /// The peer's KV-cache layout named `name`, as last fetched.
    pub fn kv_layout(&self, name: &str) -> Option<KvLayout> {
        self.segment().layout(name).cloned()
    }

    /// False once a failure or a restart invalidated it; the engine reconnects on next use.
    pub fn is_valid(&self) -> bool {
        self.inner.valid.load(Ordering::Acquire)
    }
}

/// Registered memory; deregistered when dropped.
pub struct Registration {
    engine: Arc<Inner>,
    region: RegionDesc,
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
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.engine
            .regions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.region.id);
        if let Err(e) = self.engine.backend.deregister(self.region.id) {
            tracing::warn!(region = %self.region.id, error = %e, "deregister failed");
        }
    }
}
