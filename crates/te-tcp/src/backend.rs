//! The TCP backend's `TransferBackend`: the endpoint, registrations, peers and their
//! connection pools, and how a batch is sliced over them.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use te_core::sync::{Mutex, RwLock};

use te_core::{
    BackendContext, BackendInfo, BatchId, Capabilities, Completion, Deadline, Error, ErrorKind,
    MemoryDesc, MemoryKind, PeerId, RegionId, Result, SegmentDesc, TransferBackend,
    TransferRequest,
};

use crate::config::TcpConfig;
use crate::conn::Conn;
use crate::endpoint::{decode_endpoint, encode_endpoint};
use crate::regions::{Pin, Regions};
use crate::slice::{Batch, Part, Slice};
use crate::stage::Dev;
use crate::wire;

/// What the backend's tasks share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) config: TcpConfig,
    /// Random per backend instance: peers name it in the handshake, so a restarted
    /// process (or another one on the same port) refuses what was meant for this one.
    pub(crate) instance: u64,
    pub(crate) regions: Regions,
    pub(crate) closed: AtomicBool,
    /// Ends the accept task.
    pub(crate) closing: tokio::sync::Notify,
    pub(crate) serving: Mutex<HashMap<u64, std::net::TcpStream>>,
    pub(crate) next_serving: AtomicU64,
    /// Accepted connections still in their handshake.
    pub(crate) pending: AtomicUsize,
    /// Times `accept` failed (out of descriptors, memory, …) and the listener backed off.
    pub(crate) accept_errors: AtomicU64,
    /// WRITEs into host memory whose payload stopped part way (a torn range).
    pub(crate) torn_writes: AtomicU64,
    /// The engine's control plane, where torn writes are posted as peer events.
    pub(crate) hook: te_core::ControlHook,
    /// The backend's tasks on te-tcp's I/O threads: accepting, watching deadlines, and
    /// serving and driving connections.
    pub(crate) tasks: Arc<crate::io::Tasks>,
    /// The deadlines of batches in flight.
    pub(crate) watch: Arc<crate::watch::Watch>,
}

/// One peer: where its data listener is, which instance it is, and the connections.
#[derive(Debug)]
struct PeerConns {
    addr: SocketAddr,
    instance: u64,
    conns: RwLock<Vec<Arc<Conn>>>,
    /// The slice size agreed with this peer: the smaller of our `slice_size` and the
    /// frame limit its connections announced.
    slice: AtomicU64,
    /// The peer itself, when it is a tcp backend of this process (see `local`).
    local: Option<std::sync::Weak<Shared>>,
}

/// The TCP backend.
#[derive(Debug)]
pub struct TcpBackend {
    info: BackendInfo,
    shared: Arc<Shared>,
    endpoint: Vec<u8>,
    peers: RwLock<HashMap<PeerId, Arc<PeerConns>>>,
    by_endpoint: Mutex<HashMap<Vec<u8>, PeerId>>,
    next_peer: AtomicU64,
}

fn config_error(m: String) -> Error {
    Error::new(ErrorKind::ConfigInvalid, format!("[backends.tcp] {m}"))
        .with_operation("create backend")
}

impl Shared {
    /// Whether the backend is still open (not dropped).
    pub(crate) fn is_open(&self) -> bool {
        !self.closed.load(Ordering::Acquire)
    }
}

impl TcpBackend {
    /// Binds the data listener and starts accepting peers; `ctx` gives the engine's
    /// identity.
    ///
    /// # Errors
    /// `ConfigInvalid` for invalid options or an address that cannot be advertised;
    /// `Io` if the listener cannot bind or te-tcp's I/O threads cannot start.
    pub fn new(mut config: TcpConfig, ctx: &BackendContext) -> Result<TcpBackend> {
        config.validate()?;
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
        let advertised = match &config.advertise {
            Some(host) => (host.as_str(), bound.port())
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
                .ok_or_else(|| config_error(format!("advertise = {host:?} does not resolve")))?,
            None if bound.ip().is_unspecified() => {
                return Err(config_error(format!(
                    "the data listener on {listen:?} binds every interface; set `advertise` ([engine] or [backends.tcp]) to the address peers should use"
                )))
            }
            None => bound,
        };
        // The engine's epoch names this backend to peers, so a restarted engine is a
        // new instance that refuses connections meant for its previous life.
        let instance = ctx.epoch_or_random();
        let shared = Arc::new(Shared {
            config,
            instance,
            regions: Regions::default(),
            closed: AtomicBool::new(false),
            closing: tokio::sync::Notify::new(),
            serving: Mutex::new(HashMap::new()),
            next_serving: AtomicU64::new(0),
            pending: AtomicUsize::new(0),
            accept_errors: AtomicU64::new(0),
            torn_writes: AtomicU64::new(0),
            hook: ctx.hook.clone(),
            tasks: Arc::default(),
            watch: Arc::default(),
        });
        let watch = shared.watch.clone();
        shared.tasks.spawn(async move { watch.run().await })?;
        if let Err(e) = shared
            .tasks
            .spawn(crate::serve::accept_loop(shared.clone(), listener))
        {
            shared.watch.close();
            return Err(e);
        }
        let endpoint = encode_endpoint(advertised, instance);
        crate::local::publish(&shared, &endpoint);
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
            peers: RwLock::new(HashMap::new()),
            by_endpoint: Mutex::new(HashMap::new()),
            next_peer: AtomicU64::new(1),
        })
    }

    /// The address peers connect their data connections to.
    pub fn data_addr(&self) -> SocketAddr {
        decode_endpoint(&self.endpoint)
            .map(|(a, _)| a)
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)))
    }

    #[cfg(test)]
    pub(crate) fn shared(&self) -> &Shared {
        &self.shared
    }

    /// The connections to `peer` not known to be broken.
    #[cfg(test)]
    pub(crate) fn live_connections(&self, peer: PeerId) -> usize {
        self.peers.read().get(&peer).map_or(0, |pc| {
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

    fn pin_locals(&self, batch: &[TransferRequest]) -> Result<Vec<Pin>> {
        let mut pins: Vec<Pin> = Vec::new();
        for r in batch {
            if r.len == 0 {
                return Err(Error::new(ErrorKind::InvalidRequest, "zero-length request"));
            }
            match pins.iter().find(|p| p.region().id == r.local) {
                Some(p) => {
                    if r.local_offset
                        .checked_add(r.len)
                        .is_none_or(|end| end > p.region().len)
                    {
                        return Err(Error::new(
                            ErrorKind::OutOfBounds,
                            format!(
                                "local range {}+{} is outside region {} of {} bytes",
                                r.local_offset,
                                r.len,
                                r.local,
                                p.region().len
                            ),
                        ));
                    }
                }
                None => pins.push(self.shared.regions.pin(r.local, r.local_offset, r.len)?),
            }
        }
        Ok(pins)
    }
}

/// One frame a batch is cut into, before it becomes a [`Slice`]: one piece of one
/// request, or pieces of several requests to one remote region gathered together.
struct Frame {
    op: te_core::Op,
    remote: RegionId,
    /// The local region's device, when the parts are device memory (all on it).
    device: Option<Dev>,
    parts: Vec<Part>,
    bytes: u64,
}

/// Which local memory a piece is in: host memory, or a runtime's device.
type DevKey<'a> = Option<(&'a str, u32)>;

/// Cuts `batch` into frames: every request into pieces of at most `slice` bytes, and
/// the pieces going to the same remote region with the same op from the same kind of
/// local memory (host, or one device) gathered into frames of at most `slice` bytes and
/// [`wire::MAX_ENTRIES`] entries. Frames come out in the order they are opened. `bases`
/// holds each request's local region address and device.
///
/// Device pieces are gathered too: a frame's pieces are staged packed in one pinned
/// buffer of `slice` bytes by one group of copies, so a batch of small device blocks
/// pays one synchronisation per frame rather than one per block.
///
/// A batch smaller than the frame limit becomes one frame on one connection rather than
/// one per connection: fewer, fuller frames measured faster (see docs/decisions.md),
/// and batches larger than that still spread over the pool.
fn plan(batch: &[TransferRequest], bases: &[(usize, Option<Dev>)], slice: u64) -> Vec<Frame> {
    let mut frames: Vec<Frame> = Vec::new();
    // The open frame of each (op, remote region, local device): few per batch, so a
    // list.
    let mut open: Vec<(te_core::Op, RegionId, DevKey<'_>, usize)> = Vec::new();
    for (r, (base, dev)) in batch.iter().zip(bases) {
        let mut off = 0;
        while off < r.len {
            let len = slice.min(r.len - off);
            let part = Part {
                local: base + (r.local_offset + off) as usize,
                remote_offset: r.remote_offset + off,
                len,
            };
            off += len;
            let key = dev.as_ref().map(|d| (d.0.name(), d.1));
            let slot = open
                .iter()
                .position(|o| o.0 == r.op && o.1 == r.remote && o.2 == key);
            if let Some(f) = slot.map(|i| &mut frames[open[i].3]) {
                if f.bytes + len <= slice && f.parts.len() < wire::MAX_ENTRIES {
                    f.bytes += len;
                    f.parts.push(part);
                    continue;
                }
            }
            let at = frames.len();
            frames.push(Frame {
                op: r.op,
                remote: r.remote,
                device: dev.clone(),
                parts: vec![part],
                bytes: len,
            });
            match slot {
                Some(i) => open[i].3 = at,
                None => open.push((r.op, r.remote, key, at)),
            }
        }
    }
    frames
}

impl Frame {
    fn into_slice(self, b: &Arc<Batch>) -> Slice {
        Slice::gathered(b.clone(), self.op, self.remote, self.parts, self.device)
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
        let device = match &mem.kind {
            MemoryKind::Host => None,
            // Device memory is staged through pinned host buffers by its runtime.
            MemoryKind::Device { runtime, ordinal } => {
                Some((te_core::device::runtime(runtime)?, *ordinal))
            }
        };
        if usize::try_from(mem.addr.saturating_add(mem.len)).is_err() {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                "the region does not fit in this process's address space",
            ));
        }
        self.shared.regions.insert(id, mem, device);
        Ok(Vec::new())
    }

    fn deregister(&self, id: RegionId, deadline: Deadline) -> Result<()> {
        self.shared.regions.remove(id, deadline)
    }

    fn connect(&self, peer: &SegmentDesc, deadline: Deadline) -> Result<PeerId> {
        let (addr, instance) = decode_endpoint(&peer.endpoint)?;
        let existing = self.by_endpoint.lock().get(&peer.endpoint).copied();
        if let Some(id) = existing {
            let pc = self.peers.read().get(&id).cloned();
            if let Some(pc) = pc {
                self.fill_pool(&pc, deadline)?;
                return Ok(id);
            }
        }
        let pc = Arc::new(PeerConns {
            addr,
            instance,
            conns: RwLock::new(Vec::new()),
            slice: AtomicU64::new(self.shared.config.slice_size),
            local: self
                .shared
                .config
                .local_copies
                .then(|| crate::local::find(&peer.endpoint))
                .flatten(),
        });
        self.fill_pool(&pc, deadline)?;
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
        let id = PeerId(self.next_peer.fetch_add(1, Ordering::Relaxed));
        by.insert(peer.endpoint.clone(), id);
        peers.insert(id, pc);
        Ok(id)
    }

    fn disconnect(&self, peer: PeerId, _deadline: Deadline) -> Result<()> {
        let pc = self
            .peers
            .write()
            .remove(&peer)
            .ok_or_else(|| Error::new(ErrorKind::PeerUnreachable, "unknown peer"))?;
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
        let pc = self.peers.read().get(&peer).cloned().ok_or_else(|| {
            Error::new(
                ErrorKind::PeerUnreachable,
                "the tcp backend is not connected to that peer",
            )
        })?;
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
        let bases: Vec<(usize, Option<Dev>)> = batch
            .iter()
            .map(|r| {
                pins.iter()
                    .find(|p| p.region().id == r.local)
                    .map_or((0, None), |p| {
                        (p.region().addr as usize, p.region().device.clone())
                    })
            })
            .collect();
        let n = conns.len();
        let frames = plan(batch, &bases, slice);
        let b = Arc::new(Batch::new(frames.len(), done, pins));
        self.shared.watch.add(&b, &conns);
        // Start on the least loaded connection, the lowest on a tie: a lone small batch
        // then always finds the same warm connection and threads, while concurrent
        // batches and the frames of a large one still spread over the whole pool.
        let start = (0..n).min_by_key(|&k| conns[k].load()).unwrap_or(0);
        let mut per_conn: Vec<Vec<Slice>> = (0..n).map(|_| Vec::new()).collect();
        let local = pc.local.as_ref().and_then(std::sync::Weak::upgrade);
        let mut i = 0;
        for f in frames {
            let mut slice = f.into_slice(&b);
            if let Some(target) = local.as_deref().filter(|_| slice.device.is_some()) {
                match crate::local::start(target, slice) {
                    Ok(()) => continue,
                    Err(s) => slice = s,
                }
            }
            per_conn[start.wrapping_add(i) % n].push(slice);
            i += 1;
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
}

impl Drop for TcpBackend {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        self.shared.watch.close();
        self.shared.closing.notify_one();
        let peers: Vec<_> = self.peers.write().drain().collect();
        for (_, pc) in peers {
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
        if !crate::io::on_io_thread() {
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

#[cfg(test)]
mod tests {
    use super::*;
    use te_core::Op;

    fn req(op: Op, remote: u64, remote_offset: u64, len: u64) -> TransferRequest {
        TransferRequest {
            op,
            local: RegionId(1),
            local_offset: remote_offset,
            remote: RegionId(remote),
            remote_offset,
            len,
        }
    }

    #[test]
    fn a_batch_is_gathered_per_region_and_op_within_the_frame_and_entry_limits() {
        let mut batch = Vec::new();
        // 1500 blocks of 4 KiB to region 1: the entry limit cuts them at 1024.
        batch.extend((0..1500).map(|i| req(Op::Write, 1, i * 4096, 4096)));
        // Interleaved reads of region 1 and writes to region 2 gather apart.
        batch.extend((0..10).map(|i| req(Op::Read, 1, i * 4096, 4096)));
        batch.extend((0..10).map(|i| req(Op::Write, 2, i * 4096, 4096)));
        // A request longer than the frame limit is sliced; its last piece may be
        // gathered with what follows.
        batch.push(req(Op::Write, 3, 0, (8 << 20) + 100));
        batch.push(req(Op::Write, 3, 9 << 20, 100));
        let bases = vec![(0x10000usize, None); batch.len()];
        let slice = 8 << 20;
        let frames = plan(&batch, &bases, slice);
        let shape: Vec<(Op, u64, usize, u64)> = frames
            .iter()
            .map(|f| (f.op, f.remote.0, f.parts.len(), f.bytes))
            .collect();
        assert_eq!(
            shape,
            [
                (Op::Write, 1, 1024, 1024 * 4096),
                (Op::Write, 1, 476, 476 * 4096),
                (Op::Read, 1, 10, 10 * 4096),
                (Op::Write, 2, 10, 10 * 4096),
                (Op::Write, 3, 1, 8 << 20),
                (Op::Write, 3, 2, 200),
            ]
        );
        for f in &frames {
            assert!(f.bytes <= slice && f.parts.len() <= wire::MAX_ENTRIES);
            assert_eq!(f.parts.iter().map(|p| p.len).sum::<u64>(), f.bytes);
        }
        // Every byte of every request is in exactly one part, at the same offsets.
        let total: u64 = frames.iter().map(|f| f.bytes).sum();
        assert_eq!(total, batch.iter().map(|r| r.len).sum::<u64>());
        let p = frames[4].parts[0];
        assert_eq!((p.local, p.remote_offset), (0x10000, 0));
    }

    #[test]
    fn device_blocks_gather_into_frames_of_their_own_device_apart_from_host_ones() {
        let rt = te_core::device::runtime(te_core::fakedev::NAME).unwrap();
        // 128 blocks of 32 KiB from device 0, 4 from host memory, 4 from device 1, all
        // written to region 1.
        let mut batch: Vec<TransferRequest> = (0..128)
            .map(|i| req(Op::Write, 1, i * 32768, 32768))
            .collect();
        batch.extend((128..132).map(|i| req(Op::Write, 1, i * 32768, 32768)));
        batch.extend((132..136).map(|i| req(Op::Write, 1, i * 32768, 32768)));
        let mut bases = vec![(0x10000usize, Some((rt.clone(), 0))); 128];
        bases.extend((0..4).map(|_| (0x20000usize, None)));
        bases.extend((0..4).map(|_| (0x30000usize, Some((rt.clone(), 1)))));
        let frames = plan(&batch, &bases, 512 << 10);
        let shape: Vec<(Option<u32>, usize)> = frames
            .iter()
            .map(|f| (f.device.as_ref().map(|d| d.1), f.parts.len()))
            .collect();
        let mut want = vec![(Some(0), 16); 8];
        want.extend([(None, 4), (Some(1), 4)]);
        assert_eq!(shape, want);
        let p = frames[1].parts[0];
        assert_eq!(
            (p.local, p.remote_offset),
            (0x10000 + 16 * 32768, 16 * 32768)
        );
    }
}
