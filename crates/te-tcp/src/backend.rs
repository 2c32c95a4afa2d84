//! The TCP backend's `TransferBackend`: the endpoint, registrations, peers and their
//! connection pools, and how a batch's frames (cut by `plan`) are spread over them.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use te_core::peer_table::PeerTable;
use te_core::sync::{Mutex, RwLock};

use te_core::{
    BackendContext, BackendInfo, BatchId, Capabilities, Completion, Deadline, Error, ErrorKind,
    MemoryDesc, PeerId, RegionId, Result, SegmentDesc, TransferBackend, TransferRequest,
};

use crate::completion::Batch;
use crate::config::TcpConfig;
use crate::endpoint::{decode_endpoint, encode_endpoint};
use crate::errors::config_error;
use crate::initiator::conn::Conn;
use crate::initiator::plan::plan;
use crate::initiator::slice::Slice;
use crate::peers::{PeerConns, PeerPath};
use crate::regions::{Pin, Regions};
use crate::samehost::{Channel, Frame, Range};
use crate::stage::Dev;
use crate::state::Shared;

/// The TCP backend.
#[derive(Debug)]
pub struct TcpBackend {
    info: BackendInfo,
    shared: Arc<Shared>,
    endpoint: Vec<u8>,
    peers: PeerTable<Arc<PeerConns>>,
    by_endpoint: Mutex<HashMap<Vec<u8>, PeerId>>,
    /// This host's boot id, where same-host peers are taken (`local_ipc`).
    boot_id: Option<[u8; 16]>,
    /// The listener for same-host peers' channels.
    samehost: Option<crate::samehost::Server>,
}

impl TcpBackend {
    /// Binds the data listener and starts accepting peers; `ctx` gives the engine's
    /// identity.
    ///
    /// # Errors
    /// `ConfigInvalid` for invalid options or an address that cannot be advertised;
    /// `Io` if the listener cannot bind or te-tcp's I/O threads cannot start.
    pub fn new(mut config: TcpConfig, ctx: &BackendContext) -> Result<TcpBackend> {
        te_core::BackendConfig::validate(&config)?;
        // The engine's token protects the data connections too; the backend's own key
        // is an older spelling of the same thing.
        match (&config.auth_token, &ctx.auth_token) {
            (Some(own), Some(engine)) if own != engine => {
                return Err(config_error(
                    "auth_token differs from [engine] auth_token; set it once, in [engine]"
                        .into(),
                ))
            }
            (Some(_), None) => tracing::warn!(
                "[backends.tcp] auth_token is deprecated: set [engine] auth_token, which also protects the control plane"
            ),
            _ => {}
        }
        config.auth_token = config.auth_token.take().or_else(|| ctx.auth_token.clone());
        // Unset, the data listener follows the engine's control plane: the same host
        // (port 0) and the same advertised host, so an engine that listens on its NIC
        // is reachable for data too without a second setting.
        let listen = match &config.listen {
            Some(listen) => listen.clone(),
            None => {
                if config.advertise.is_none() {
                    config.advertise = ctx.advertise.clone();
                }
                format!("{}:0", ctx.listen_host.as_deref().unwrap_or("127.0.0.1"))
            }
        };
        let listener = TcpListener::bind(&listen).map_err(|e| {
            Error::new(
                ErrorKind::Io,
                format!("cannot listen on {listen} for tcp data"),
            )
            .with_operation("create backend")
            .with_source(e)
        })?;
        let bound = listener.local_addr().map_err(|e| {
            Error::new(ErrorKind::Io, "the data listener has no address").with_source(e)
        })?;
        let advertised = te_core::kit::net::advertised(
            "[backends.tcp] data listener",
            bound,
            &listen,
            config.advertise.as_deref(),
        )
        .map_err(|e| e.with_operation("create backend"))?;
        // The engine's epoch names this backend to peers, so a restarted engine is a
        // new instance that refuses connections meant for its previous life.
        let instance = ctx.epoch_or_random();
        let shared = Arc::new(Shared {
            config,
            instance,
            regions: Regions::new("tcp"),
            closed: AtomicBool::new(false),
            closing: tokio::sync::Notify::new(),
            serving: Mutex::new(HashMap::new()),
            next_serving: AtomicU64::new(0),
            pending: Arc::default(),
            accept_errors: AtomicU64::new(0),
            torn_writes: AtomicU64::new(0),
            hook: ctx.hook.clone(),
            tasks: Arc::default(),
            staging: Arc::default(),
            watch: Arc::default(),
            nonces: Default::default(),
            imports: Default::default(),
            channel_bytes: AtomicU64::new(0),
        });
        let watch = shared.watch.clone();
        shared.tasks.spawn(async move { watch.run().await })?;
        if let Err(e) = shared
            .tasks
            .spawn(crate::target::serve::accept_loop(shared.clone(), listener))
        {
            shared.watch.close();
            return Err(e);
        }
        // Same-host peers: a target that holds its requests (`debug_delay`, for tests)
        // serves every frame over the socket.
        let mut boot_id = None;
        let mut samehost = None;
        if shared.config.local_ipc && shared.config.debug_delay.is_zero() {
            match (
                te_core::local::boot_id(),
                crate::samehost::Server::start(&shared),
            ) {
                (Some(id), Ok(server)) => {
                    boot_id = Some(id);
                    samehost = Some(server);
                }
                (None, _) => tracing::info!("no boot id: peers on this host use the socket"),
                (_, Err(e)) => tracing::warn!(error = %e, "peers on this host use the socket"),
            }
        }
        let endpoint = encode_endpoint(advertised, instance, boot_id);
        crate::initiator::local::publish(&shared, &endpoint);
        Ok(TcpBackend {
            info: BackendInfo {
                name: crate::NAME.to_string(),
                version: env!("CARGO_PKG_VERSION").to_string(),
                capabilities: Capabilities {
                    // Device memory is staged through pinned host buffers.
                    memory: Capabilities::host_and_runtimes(),
                    read: true,
                    write: true,
                    cross_process: true,
                    same_host_only: false,
                    max_request_size: u64::MAX,
                    // The target checks every frame before a byte lands.
                    checks_at_target: true,
                },
            },
            endpoint,
            shared,
            peers: PeerTable::new(crate::NAME),
            by_endpoint: Mutex::new(HashMap::new()),
            boot_id,
            samehost,
        })
    }

    /// How frames to `peer` travel.
    ///
    /// # Errors
    /// `NotConnected` for an unknown peer.
    pub fn peer_path(&self, peer: PeerId) -> Result<PeerPath> {
        let pc = self.peers.get(peer)?;
        if pc.local.is_some() {
            return Ok(PeerPath::InProcess);
        }
        let ch = pc.channels.lock().first().cloned().filter(|c| c.is_alive());
        Ok(match ch {
            Some(c) => PeerPath::SameHost {
                cross_memory_attach: c.cma,
            },
            None => PeerPath::Socket,
        })
    }

    /// The address peers connect their data connections to.
    pub fn data_addr(&self) -> SocketAddr {
        decode_endpoint(&self.endpoint)
            .map(|e| e.addr)
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)))
    }

    #[cfg(test)]
    pub(crate) fn shared(&self) -> &Shared {
        &self.shared
    }

    /// The connections to `peer` not known to be broken.
    #[cfg(test)]
    pub(crate) fn live_connections(&self, peer: PeerId) -> usize {
        self.peers.get(peer).map_or(0, |pc| {
            pc.conns.read().iter().filter(|c| !c.is_dead()).count()
        })
    }

    /// The options in force.
    pub fn config(&self) -> &TcpConfig {
        &self.shared.config
    }

    /// Opens connections to `peer` until it has `connections_per_peer` live ones.
    fn fill_pool(&self, peer: &PeerConns, deadline: Deadline) -> Result<()> {
        let want = self.shared.config.connections_per_peer;
        let live = peer.conns.read().iter().filter(|c| !c.is_dead()).count();
        let mut fresh = Vec::new();
        let mut first_error = None;
        for _ in live..want {
            match Conn::open(
                peer.addr,
                peer.instance,
                &self.shared.config,
                &self.shared.tasks,
                &self.shared.staging,
                deadline,
            ) {
                Ok(c) => fresh.push(c),
                Err(e) => {
                    first_error = Some(e);
                    break;
                }
            }
        }
        for c in &fresh {
            peer.slice.fetch_min(c.max_payload(), Ordering::AcqRel);
        }
        let mut conns = peer.conns.write();
        conns.retain(|c| !c.is_dead());
        for c in fresh {
            if conns.len() < want {
                conns.push(c);
            } else {
                c.kill(Error::new(ErrorKind::Cancelled, "a spare data connection"));
            }
        }
        match first_error {
            Some(e) if conns.is_empty() => Err(e),
            Some(e) if e.kind() != ErrorKind::PeerUnreachable => Err(e),
            Some(e) => {
                tracing::warn!(peer = %peer.addr, error = %e, live = conns.len(), "fewer data connections than configured");
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Opens same-host channels to `peer`, one per data connection, if it advertises
    /// this host: presenting a nonce from a data connection's handshake proves it is the
    /// process we authenticated. Where that fails, the peer is served over the socket,
    /// as any peer. A broken channel closes them all (the first one's mappings go with
    /// it) and fresh ones open with the nonces of fresh connections.
    fn open_channel(&self, peer: &PeerConns, deadline: Deadline) {
        if !peer.same_boot {
            return;
        }
        let need = {
            let mut chs = peer.channels.lock();
            if chs.iter().any(|c| !c.is_alive()) {
                chs.clear();
            }
            peer.conns.read().len().saturating_sub(chs.len())
        };
        let limit = deadline
            .left("connect")
            .map_or(self.shared.config.connect_timeout, |l| {
                l.min(self.shared.config.connect_timeout)
            });
        // Opened with no lock held: a channel's hello may take up to `limit`, and
        // submits and deregistrations to this peer take the channel list.
        let mut opened = Vec::new();
        while opened.len() < need {
            let nonce = peer.conns.read().iter().find_map(|c| c.take_challenge());
            let Some(nonce) = nonce else { break };
            match Channel::open(
                peer.instance,
                nonce,
                limit,
                &peer.exports,
                self.shared.config.caller_reads,
            ) {
                Ok(c) => opened.push(c),
                Err(e) => {
                    tracing::info!(peer = %peer.addr, error = %e, "the peer advertises this host but opened no channel; frames go over the socket");
                    break;
                }
            }
        }
        if opened.is_empty() {
            return;
        }
        let mut chs = peer.channels.lock();
        if chs.is_empty() {
            tracing::info!(peer = %peer.addr, cross_memory_attach = opened[0].cma, "same-host peer: frames move without the socket");
        }
        // A concurrent connect may have opened some meanwhile: the spare ones close.
        let want = peer.conns.read().len();
        for c in opened {
            if chs.len() < want {
                chs.push(c);
            }
        }
    }

    /// Pins each local region of `batch` once. The engine checked every request
    /// against the same regions (range, zero length); this only holds them open.
    fn pin_locals(&self, batch: &[TransferRequest]) -> Result<Vec<Pin>> {
        let mut pins: Vec<Pin> = Vec::new();
        for r in batch {
            // Requests come grouped by region: the last pin is the likely one.
            if pins.last().is_none_or(|p| p.id != r.local) && !pins.iter().any(|p| p.id == r.local)
            {
                pins.push(self.shared.regions.pin(r.local)?);
            }
        }
        Ok(pins)
    }
}

impl TransferBackend for TcpBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn endpoint(&self) -> Vec<u8> {
        self.endpoint.clone()
    }

    fn register(&self, id: RegionId, mem: &MemoryDesc) -> Result<Vec<u8>> {
        // Device memory is staged through pinned host buffers by its runtime.
        let device = te_core::device::of(&mem.kind)?;
        if usize::try_from(mem.addr.saturating_add(mem.len)).is_err() {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                "the region does not fit in this process's address space",
            ));
        }
        self.shared
            .regions
            .insert(id, mem.addr, mem.len, mem.access, device);
        Ok(Vec::new())
    }

    fn deregister(&self, id: RegionId, deadline: Deadline) -> Result<()> {
        let _ = self.shared.regions.retire(id, deadline.instant())?;
        // No batch uses it any more: same-host peers that mapped it unmap it, and the
        // deregistration returns once they say so (the caller may free the memory
        // then), or fails at its deadline.
        let mut asked = Vec::new();
        for pc in self.peers.all() {
            let keys = pc.exports.lock().forget(id);
            if keys.is_empty() {
                continue;
            }
            // Not under the list's lock: an unshare that finds the socket broken fails
            // its channel, which completes batches (and their callbacks) at once.
            let channels: Vec<_> = pc.channels.lock().clone();
            for ch in channels {
                for &k in &keys {
                    ch.unshare(k);
                }
                asked.push((ch.link(), keys.clone()));
            }
        }
        let mut result = Ok(());
        for (link, keys) in asked {
            if let Err(e) = link.unshared(&keys, deadline) {
                result = result.and(Err(e));
            }
        }
        result
    }

    fn connect(&self, peer: &SegmentDesc, deadline: Deadline) -> Result<PeerId> {
        let ep = decode_endpoint(&peer.endpoint)?;
        let kinds: HashMap<RegionId, Option<String>> = peer
            .regions
            .iter()
            .map(|r| {
                let kind = match &r.kind {
                    te_core::MemoryKind::Device { runtime, .. } => Some(runtime.clone()),
                    _ => None,
                };
                (r.id, kind)
            })
            .collect();
        let existing = self.by_endpoint.lock().get(&peer.endpoint).copied();
        if let Some(id) = existing {
            if let Ok(pc) = self.peers.get(id) {
                self.fill_pool(&pc, deadline)?;
                *pc.kinds.write() = kinds;
                self.open_channel(&pc, deadline);
                return Ok(id);
            }
        }
        // A backend of this process is never reached through a channel: its device
        // frames are device copies (`local_copies`) or go over the socket.
        let in_process = crate::initiator::local::find(&peer.endpoint);
        let pc = Arc::new(PeerConns {
            addr: ep.addr,
            instance: ep.instance,
            conns: RwLock::new(Vec::new()),
            slice: AtomicU64::new(self.shared.config.slice_size),
            same_boot: self.boot_id.is_some() && ep.boot_id == self.boot_id && in_process.is_none(),
            local: in_process.filter(|_| self.shared.config.local_copies),
            kinds: RwLock::new(kinds),
            channels: Mutex::new(Vec::new()),
            exports: Arc::default(),
        });
        self.fill_pool(&pc, deadline)?;
        self.open_channel(&pc, deadline);
        let mut by = self.by_endpoint.lock();
        let mut peers = self.peers.write();
        if let Some(&id) = by.get(&peer.endpoint) {
            if peers.contains_key(&id) {
                // A concurrent connect won: keep its pool, close this one.
                for c in pc.conns.read().iter() {
                    c.kill(Error::new(ErrorKind::Cancelled, "a spare data connection"));
                }
                return Ok(id);
            }
        }
        let id = self.peers.next_id();
        by.insert(peer.endpoint.clone(), id);
        peers.insert(id, pc);
        Ok(id)
    }

    fn disconnect(&self, peer: PeerId, _deadline: Deadline) -> Result<()> {
        let pc = self.peers.remove(peer)?;
        self.by_endpoint.lock().retain(|_, id| *id != peer);
        for c in pc.conns.read().iter() {
            c.kill(Error::new(
                ErrorKind::Cancelled,
                format!("the peer at {} was disconnected", pc.addr),
            ));
        }
        Ok(())
    }

    fn submit(&self, peer: PeerId, batch: &[TransferRequest], done: Completion) -> Result<()> {
        let pc = self.peers.get(peer)?;
        let conns: Vec<Arc<Conn>> = pc
            .conns
            .read()
            .iter()
            .filter(|c| !c.is_dead())
            .cloned()
            .collect();
        if conns.is_empty() {
            return Err(Error::new(
                ErrorKind::PeerUnreachable,
                format!(
                    "every data connection to {} is broken; connect again",
                    pc.addr
                ),
            ));
        }
        if batch.is_empty() {
            done.complete(Ok(()));
            return Ok(());
        }
        // Every slice fits the frame limit the peer announced and our own buffers.
        let slice = pc.slice.load(Ordering::Acquire);
        let pins = self.pin_locals(batch)?;
        let mut last = 0;
        let bases: Vec<(usize, Option<&Dev>)> = batch
            .iter()
            .map(|r| {
                if pins.get(last).is_none_or(|p| p.region().id != r.local) {
                    last = pins
                        .iter()
                        .position(|p| p.region().id == r.local)
                        .unwrap_or(last);
                }
                pins.get(last)
                    .filter(|p| p.region().id == r.local)
                    .map_or((0, None), |p| {
                        (p.region().addr as usize, p.region().data.as_ref())
                    })
            })
            .collect();
        let n = conns.len();
        let frames = plan(batch, &bases, slice);
        let b = Arc::new(Batch::new(frames.len(), done, pins));

        // Start on the least loaded connection, the lowest on a tie: a lone small batch
        // then always finds the same warm connection and threads, while concurrent
        // batches and the frames of a large one still spread over the whole pool.
        let start = (0..n).min_by_key(|&k| conns[k].load()).unwrap_or(0);
        let mut per_conn: Vec<Vec<Slice>> = (0..n).map(|_| Vec::new()).collect();
        // A target that holds its requests (`debug_delay`, for tests) serves them all
        // over the socket, so the delay applies to every frame.
        let local = (pc.local.as_ref())
            .and_then(std::sync::Weak::upgrade)
            .filter(|t| t.is_open() && t.config.debug_delay.is_zero());
        let mut i = 0;
        let mut copies = crate::initiator::local::Local::default();
        let channels: Vec<Arc<Channel>> = {
            let chs = pc.channels.lock();
            if chs.iter().all(|c| c.is_alive()) {
                chs.clone()
            } else {
                Vec::new()
            }
        };
        self.shared.watch.add(&b, &conns, &channels);
        // The batch's device request goes to the least busy channel, the lowest on a tie:
        // a lone stream of batches keeps one warm channel (and target thread), while
        // concurrent batches spread over the target's threads.
        let channel = channels.iter().min_by_key(|c| c.waiting());
        // Device frames on the first channel, as one request; host frames spread.
        let mut on_channel: Vec<Frame> = Vec::new();
        let mut host_frames: Vec<Vec<Frame>> = channels.iter().map(|_| Vec::new()).collect();
        let mut next_host = 0usize;
        let mut keys: HashMap<RegionId, Option<u64>> = HashMap::new();
        // The batch's local regions, to find each device frame's allocation.
        let held = b.hold().unwrap_or_default();
        for f in frames {
            let mut slice = f.into_slice(&b);
            if let Some(target) = local.as_deref().filter(|_| slice.device.is_some()) {
                match copies.add(target, slice) {
                    Ok(()) => continue,
                    Err(s) => slice = s,
                }
            }
            if let Some(ch) = channel {
                let host = slice.device.is_none();
                match channel_frame(ch, &pc, &held, &mut keys, slice) {
                    Ok(frame) if host => {
                        host_frames[next_host % channels.len()].push(frame);
                        next_host += 1;
                        continue;
                    }
                    Ok(frame) => {
                        on_channel.push(frame);
                        continue;
                    }
                    Err(s) => slice = s,
                }
            }
            per_conn[start.wrapping_add(i) % n].push(slice);
            i += 1;
        }
        // Every local frame of the batch in one group per runtime.
        copies.start();
        if let Some(ch) = channel {
            if !on_channel.is_empty() {
                ch.submit(on_channel);
            }
        }
        for (ch, frames) in channels.iter().zip(host_frames) {
            if !frames.is_empty() {
                ch.submit(frames);
            }
        }
        let mut budget = self.shared.config.inline_send as usize;
        // Frame `i` goes to connection `start + i` modulo `n`; the first frame's
        // connection goes first.
        for j in 0..n {
            let k = start.wrapping_add(j) % n;
            let slices = std::mem::take(&mut per_conn[k]);
            let sent = conns[k].submit(slices.into_iter(), budget);
            budget = budget.saturating_sub(sent);
        }
        Ok(())
    }

    fn abort(&self, _peer: PeerId, batch: BatchId) {
        // Its slices see the abort flag on their own; the watcher also ends its use of
        // connections that stalled, as at a deadline.
        self.shared.watch.abort(batch);
    }

    fn gauges(&self) -> Vec<(String, u64)> {
        let mut g = self.shared.staging.gauges();
        g.push((
            "samehost_request_bytes".into(),
            self.shared.channel_bytes.load(Ordering::Relaxed),
        ));
        g
    }

    fn path_to(&self, peer: PeerId) -> Option<String> {
        self.peer_path(peer).ok().map(|p| p.to_string())
    }

    fn drive(&self, peer: PeerId, batch: BatchId, until: Deadline) -> bool {
        // With `caller_reads`, a same-host peer's answers are read by the waiting
        // caller (`Link::drive`); socket frames are not: their I/O threads serve every
        // connection at once. A wait never blocks here on a channel being opened.
        if !self.shared.config.caller_reads {
            return false;
        }
        let Ok(pc) = self.peers.get(peer) else {
            return false;
        };
        // The links, not the channels: a disconnect meanwhile still closes them.
        let Some(channels) = pc.channels.try_lock() else {
            return false;
        };
        let links: Vec<_> = channels.iter().map(|c| c.link()).collect();
        drop(channels);
        drop(pc);
        let mut waited = false;
        for link in &links {
            waited |= link.drive(batch, until);
        }
        waited
    }
}

impl Drop for TcpBackend {
    fn drop(&mut self) {
        // Its listener is one of the tasks waited for below.
        drop(self.samehost.take());
        self.shared.closed.store(true, Ordering::Release);
        self.shared.watch.close();
        self.shared.closing.notify_one();
        for pc in self.peers.drain() {
            for c in pc.conns.read().iter() {
                c.kill(Error::new(
                    ErrorKind::Cancelled,
                    "the tcp backend is shutting down",
                ));
            }
        }
        let serving: Vec<_> = self.shared.serving.lock().drain().collect();
        for (_, s) in serving {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        // Every socket is shut down: the tasks end at their next step. Dropped on an
        // I/O thread (a completion that let go of the engine), waiting could hold up
        // the very tasks waited for; they end on their own then.
        if !crate::runtime::on_io_thread() {
            let left = self.shared.tasks.wait(self.shared.config.io_timeout);
            if left > 0 {
                tracing::warn!(
                    tasks = left,
                    "te-tcp connection tasks still running after the backend closed"
                );
            }
        }
    }
}

/// `slice` as a frame for the same-host channel `ch`, where both its memory and the
/// peer region's can be copied there (host memory with cross-memory attach, device
/// memory of one runtime shared with the peer); `Err(slice)` sends it over the socket.
fn channel_frame(
    ch: &Channel,
    peer: &PeerConns,
    pins: &[Pin],
    keys: &mut HashMap<RegionId, Option<u64>>,
    slice: crate::initiator::slice::Slice,
) -> std::result::Result<Frame, crate::initiator::slice::Slice> {
    let remote = peer.kinds.read().get(&slice.remote).cloned();
    let key = match (&slice.device, remote) {
        (None, Some(None)) if ch.cma => 0,
        (Some((rt, _)), Some(Some(name))) if name == rt.name() => {
            // The local region the slice's bytes are in: its allocation is shared once.
            let at = slice.local as u64;
            let Some(region) = pins
                .iter()
                .map(Pin::region)
                .find(|r| at >= r.addr && at - r.addr < r.len)
                .map(|r| r.id)
            else {
                return Err(slice);
            };
            let key = *keys.entry(region).or_insert_with(|| ch.key(rt, region, at));
            match key {
                Some(k) => k,
                None => return Err(slice),
            }
        }
        _ => return Err(slice),
    };
    let ranges = if slice.parts.is_empty() {
        vec![Range {
            region: slice.remote.0,
            offset: slice.remote_offset,
            len: slice.len,
            key,
            addr: slice.local as u64,
        }]
    } else {
        slice
            .parts
            .iter()
            .map(|p| Range {
                region: slice.remote.0,
                offset: p.remote_offset,
                len: p.len,
                key,
                addr: p.local as u64,
            })
            .collect()
    };
    Ok(Frame {
        op: slice.op,
        ranges,
        batch: slice.batch.clone(),
    })
}
