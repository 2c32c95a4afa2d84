//! The RDMA backend's `TransferBackend`: devices, registrations, peers and their paths
//! (one RC QP each), posting, the completion threads, and the side channel.

use std::collections::{HashMap, VecDeque};
use std::io::Read;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use te_core::{
    BackendInfo, Capabilities, Completion, Error, ErrorKind, MemoryDesc, MemoryKind, Op, PeerId,
    RegionId, Result, SegmentDesc, TransferBackend, TransferRequest,
};

use crate::config::{RdmaConfig, MAX_SLICE};
use crate::exchange::{self, DeviceInfo, Endpoint, LinkLayer, Message, PathInfo};
use crate::ffi::{self, Context, Cq, Mr, Qp, Verbs};
use crate::plan;
use crate::qp::{self, QpParams};
use crate::track::{BatchState, Outcome, SendQueue};
use crate::wr::{WorkItem, WrChain};

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One opened device and what a QP on it needs.
struct Device {
    ctx: Context,
    index: usize,
    name: String,
    link_layer: LinkLayer,
    lid: u16,
    gid: [u8; 16],
    params: QpParams,
    /// The paths whose CQs report to this device's channel, by CQ tag.
    paths: RwLock<HashMap<u64, Arc<Path>>>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("name", &self.name).finish()
    }
}

impl Device {
    fn path_info(&self, remote_device: usize, qpn: u32, psn: u32) -> PathInfo {
        PathInfo {
            local_device: self.index as u8,
            remote_device: remote_device as u8,
            qpn,
            psn,
            lid: self.lid,
            gid: self.gid,
            mtu: self.params.mtu,
            link_layer: self.link_layer,
            port: self.params.port,
        }
    }
}

/// A registered local region: one MR per device.
struct LocalRegion {
    addr: u64,
    len: u64,
    mrs: Vec<Mr>,
    pins: Mutex<u64>,
    unpinned: Condvar,
    _dmabuf: Option<OwnedFd>,
}

/// Keeps a region registered while a slice uses it.
struct Pin(Arc<LocalRegion>);

impl Pin {
    fn new(r: &Arc<LocalRegion>) -> Pin {
        *lock(&r.pins) += 1;
        Pin(r.clone())
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        let mut n = lock(&self.0.pins);
        *n -= 1;
        if *n == 0 {
            self.0.unpinned.notify_all();
        }
    }
}

/// A peer's region: address and one rkey per peer device.
#[derive(Debug)]
struct RemoteRegion {
    addr: u64,
    len: u64,
    rkeys: Vec<u32>,
}

/// One slice on its way.
struct Job {
    batch: Arc<BatchState>,
    op: Op,
    local: Pin,
    local_addr: u64,
    remote: Arc<RemoteRegion>,
    remote_addr: u64,
    len: u32,
    attempts: usize,
}

struct PathState {
    sq: SendQueue<Job>,
    waiting: VecDeque<Job>,
    chain: WrChain,
    items: Vec<WorkItem>,
    posting: Vec<Job>,
}

/// One RC QP to one peer device.
struct Path {
    tag: u64,
    device: Arc<Device>,
    remote_device: usize,
    // Field order: the QP is destroyed before its CQ.
    qp: Qp,
    cq: Cq,
    state: Mutex<PathState>,
    /// Marked for reset: takes no new work; rebuilt by the next `connect`.
    broken: AtomicBool,
    peer: Weak<Peer>,
    signal_every: u32,
}

struct Peer {
    endpoint: Endpoint,
    regions: RwLock<HashMap<RegionId, Arc<RemoteRegion>>>,
    paths: Vec<Arc<Path>>,
    next: AtomicUsize,
    side: TcpStream,
    dead: AtomicBool,
    /// Why the peer is dead, for the batches that fail because of it.
    why: Mutex<String>,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.side.shutdown(Shutdown::Both);
    }
}

struct Shared {
    config: RdmaConfig,
    instance: u64,
    devices: Vec<Arc<Device>>,
    regions: RwLock<HashMap<RegionId, Arc<LocalRegion>>>,
    next_tag: AtomicU64,
    closed: AtomicBool,
    /// Side-channel connections this backend serves as the target, to close at drop.
    serving: Mutex<HashMap<u64, TcpStream>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// The RDMA backend.
pub struct RdmaBackend {
    info: BackendInfo,
    shared: Arc<Shared>,
    endpoint: Vec<u8>,
    listener: Arc<TcpListener>,
    peers: RwLock<HashMap<PeerId, Arc<Peer>>>,
    by_instance: Mutex<HashMap<u64, PeerId>>,
    next_peer: AtomicU64,
    stop: Vec<OwnedFd>,
    completion_threads: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for RdmaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaBackend")
            .field("devices", &self.shared.devices)
            .field("instance", &self.shared.instance)
            .finish_non_exhaustive()
    }
}

fn config_error(m: String) -> Error {
    Error::new(ErrorKind::ConfigInvalid, format!("[backends.rdma] {m}"))
        .with_operation("create backend")
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map_err(|e| {
            Error::new(ErrorKind::Io, format!("cannot start thread {name}")).with_source(e)
        })
}

/// GIDs of a port with their kernel type names, for `qp::pick_gid`.
fn gid_table(ctx: &Context, name: &str, port: u8, len: i32) -> Vec<(u8, [u8; 16], Option<String>)> {
    (0..len.clamp(0, 64) as u8)
        .filter_map(|i| {
            let gid = ctx.gid(port, i).ok()?;
            let kind = std::fs::read_to_string(format!(
                "/sys/class/infiniband/{name}/ports/{port}/gid_attrs/types/{i}"
            ))
            .ok()
            .map(|s| s.trim().to_string());
            Some((i, gid, kind))
        })
        .collect()
}

fn open_devices(v: &'static Verbs, config: &RdmaConfig) -> Result<Vec<Arc<Device>>> {
    let present = ffi::device_names(v)?;
    let explicit = !config.devices.is_empty();
    let wanted = if explicit {
        for d in &config.devices {
            if !present.contains(d) {
                return Err(config_error(format!(
                    "devices names {d:?}, which is not here; present: {}",
                    present.join(", ")
                )));
            }
        }
        config.devices.clone()
    } else {
        present
    };
    let mut devices = Vec::new();
    let mut skipped = Vec::new();
    for name in wanted {
        let ctx = Context::open(v, &name)?;
        let port = ctx.port(config.port)?;
        if port.state != ibverbs_sys::ibv_port_state::IBV_PORT_ACTIVE {
            let why = format!(
                "{name} port {} is not active (state {})",
                config.port, port.state
            );
            if explicit {
                return Err(Error::new(ErrorKind::Unavailable, why));
            }
            skipped.push(why);
            continue;
        }
        let link_layer = if u32::from(port.link_layer) == ibverbs_sys::IBV_LINK_LAYER_ETHERNET {
            LinkLayer::Ethernet
        } else {
            LinkLayer::InfiniBand
        };
        let gid_index = match link_layer {
            LinkLayer::Ethernet => {
                let table = gid_table(&ctx, &name, config.port, port.gid_tbl_len);
                qp::pick_gid(config.gid_index, &table).ok_or_else(|| {
                    Error::new(
                        ErrorKind::Unavailable,
                        format!("{name} port {} has no usable GID (is an IP address configured on its interface?)", config.port),
                    )
                })?
            }
            LinkLayer::InfiniBand => config.gid_index.unwrap_or(0),
        };
        let gid = ctx.gid(config.port, gid_index).unwrap_or([0; 16]);
        let mtu = qp::mtu_enum(config.mtu)
            .unwrap_or(5)
            .min(port.active_mtu.clamp(1, 5) as u8);
        let params = QpParams {
            port: config.port,
            gid_index,
            mtu,
            timeout: config.timeout,
            retry_count: config.retry_count,
            rnr_retry: config.rnr_retry,
            service_level: config.service_level,
            traffic_class: config.traffic_class,
            max_rd_atomic: ctx.attr.max_qp_init_rd_atom.clamp(1, 16) as u8,
            max_dest_rd_atomic: ctx.attr.max_qp_rd_atom.clamp(1, 16) as u8,
        };
        if (ctx.attr.max_qp_wr as i64) < i64::from(config.max_outstanding) {
            return Err(config_error(format!(
                "max_outstanding = {} exceeds {name}'s max_qp_wr ({})",
                config.max_outstanding, ctx.attr.max_qp_wr
            )));
        }
        devices.push(Arc::new(Device {
            index: devices.len(),
            ctx,
            name,
            link_layer,
            lid: port.lid,
            gid,
            params,
            paths: RwLock::new(HashMap::new()),
        }));
    }
    if devices.is_empty() {
        return Err(Error::new(
            ErrorKind::Unavailable,
            format!(
                "no RDMA devices with an active port: {}",
                skipped.join("; ")
            ),
        ));
    }
    if devices.len() > exchange::MAX_DEVICES {
        devices.truncate(exchange::MAX_DEVICES);
    }
    Ok(devices)
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

impl RdmaBackend {
    /// Opens the devices, starts their completion threads and the side channel.
    ///
    /// # Errors
    /// `Unavailable` without libibverbs, devices or an active port (the reason says
    /// which); `ConfigInvalid` for bad options; `Io` if the listener cannot bind.
    pub fn new(config: RdmaConfig) -> Result<RdmaBackend> {
        config.validate()?;
        let v = ffi::verbs()?;
        let devices = open_devices(v, &config)?;
        let listener = TcpListener::bind(&config.listen).map_err(|e| {
            Error::new(
                ErrorKind::Io,
                format!(
                    "cannot listen on {} for the rdma side channel",
                    config.listen
                ),
            )
            .with_source(e)
        })?;
        let bound = listener.local_addr().map_err(|e| {
            Error::new(ErrorKind::Io, "the side channel has no address").with_source(e)
        })?;
        let advertised: SocketAddr = match &config.advertise {
            Some(host) => (host.as_str(), bound.port())
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
                .ok_or_else(|| config_error(format!("advertise = {host:?} does not resolve")))?,
            None if bound.ip().is_unspecified() => {
                return Err(config_error(format!(
                    "listen = {:?} binds every interface; set `advertise` to the address peers should use",
                    config.listen
                )))
            }
            None => bound,
        };
        let instance = loop {
            let i: u64 = rand::random();
            if i != 0 {
                break i;
            }
        };
        let endpoint = exchange::encode_endpoint(&Endpoint {
            addr: advertised,
            instance,
            devices: devices
                .iter()
                .map(|d| DeviceInfo {
                    name: d.name.clone(),
                    link_layer: d.link_layer,
                })
                .collect(),
        });
        let shared = Arc::new(Shared {
            config,
            instance,
            devices,
            regions: RwLock::new(HashMap::new()),
            next_tag: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            serving: Mutex::new(HashMap::new()),
            threads: Mutex::new(Vec::new()),
        });
        let mut stop = Vec::new();
        let mut completion_threads = Vec::new();
        for d in &shared.devices {
            let (rd, wr) = pipe()?;
            let (dev, window) = (d.clone(), shared.config.adaptive_poll);
            completion_threads.push(spawn(&format!("te-rdma-cq-{}", d.name), move || {
                completion_loop(&dev, &rd, window)
            })?);
            stop.push(wr);
        }
        let listener = Arc::new(listener);
        let (s, l) = (shared.clone(), listener.clone());
        let accept = spawn("te-rdma-accept", move || accept_loop(&s, &l))?;
        lock(&shared.threads).push(accept);
        Ok(RdmaBackend {
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
                },
            },
            shared,
            endpoint,
            listener,
            peers: RwLock::new(HashMap::new()),
            by_instance: Mutex::new(HashMap::new()),
            next_peer: AtomicU64::new(1),
            stop,
            completion_threads: Mutex::new(completion_threads),
        })
    }
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

/// One device's completion thread: waits on the completion channel (and the stop
/// pipe) in poll(2), takes each event, acknowledges it, re-arms the CQ, then drains it.
/// With `window` > 0 it keeps polling a CQ that just had completions for that long
/// before sleeping again.
fn completion_loop(dev: &Arc<Device>, stop: &OwnedFd, window: Duration) {
    let v = dev.ctx.v;
    let mut wc = vec![
        // SAFETY: `ibv_wc` is plain data; all-zero is a valid value.
        unsafe { std::mem::zeroed::<ibverbs::ibv_wc>() };
        32
    ];
    loop {
        let mut fds = [
            libc::pollfd {
                fd: dev.ctx.channel_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: stop.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if rc < 0 {
            if ffi::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            tracing::error!(device = %dev.name, error = %ffi::last_os_error(), "poll on the completion channel failed");
            return;
        }
        if fds[1].revents != 0 {
            return;
        }
        loop {
            let mut cq = std::ptr::null_mut();
            let mut tag = std::ptr::null_mut();
            // SAFETY: the channel is live and non-blocking; valid out-parameters.
            if unsafe { (v.ibv_get_cq_event)(dev.ctx.channel, &mut cq, &mut tag) } != 0 {
                break; // EAGAIN: no more events.
            }
            // SAFETY: `cq` is the CQ the event is for; acknowledged once.
            unsafe { (v.ibv_ack_cq_events)(cq, 1) };
            let path = dev
                .paths
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .get(&(tag as usize as u64))
                .cloned();
            let Some(path) = path else { continue };
            path.cq.arm();
            let mut until = Instant::now() + window;
            loop {
                let n = drain(&path, &mut wc);
                if window.is_zero() {
                    break;
                }
                let now = Instant::now();
                if n > 0 {
                    until = now + window;
                } else if now >= until {
                    break;
                } else {
                    std::hint::spin_loop();
                }
            }
        }
    }
}

/// Polls a path's CQ empty and settles what completed; returns the completions seen.
fn drain(path: &Arc<Path>, wc: &mut [ibverbs::ibv_wc]) -> usize {
    let v = path.device.ctx.v;
    let mut total = 0;
    loop {
        let n = path.cq.poll(wc);
        if n <= 0 {
            if n < 0 {
                tracing::error!(device = %path.device.name, "ibv_poll_cq failed");
            }
            return total;
        }
        total += n as usize;
        let mut done = Vec::new();
        let mut failed = Vec::new();
        {
            let mut st = lock(&path.state);
            for c in &wc[..n as usize] {
                let error = c.error().map(|(status, vendor)| {
                    format!("{} (vendor error {vendor:#x})", ffi::status_text(v, status))
                });
                let ok = error.is_none();
                st.sq.complete(c.wr_id(), ok, |job, outcome| match outcome {
                    Outcome::Done => done.push(job),
                    Outcome::Failed => failed.push((job, error.clone().unwrap_or_default())),
                });
            }
            if !failed.is_empty() {
                path.broken.store(true, Ordering::Release);
            }
            pump(path, &mut st, &mut failed);
        }
        for job in done {
            job.batch.slice_done();
        }
        for (job, why) in failed {
            retry(path, job, &why);
        }
    }
}

/// Posts waiting jobs while the QP has room. A broken path hands its waiting jobs back
/// through `failed`, to be retried elsewhere.
fn pump(path: &Path, st: &mut PathState, failed: &mut Vec<(Job, String)>) {
    if path.broken.load(Ordering::Acquire) {
        failed.extend(
            st.waiting
                .drain(..)
                .map(|j| (j, "the QP was marked for reset".to_string())),
        );
        return;
    }
    let dev = path.device.index;
    while !st.waiting.is_empty() && st.sq.room() > 0 {
        let n = st.waiting.len().min(st.sq.room());
        let PathState {
            sq,
            waiting,
            chain,
            items,
            posting,
        } = st;
        items.clear();
        posting.clear();
        posting.extend(waiting.drain(..n));
        for (i, job) in posting.drain(..).enumerate() {
            let item = WorkItem {
                op: job.op,
                wr_id: 0,
                signaled: false,
                local_addr: job.local_addr,
                lkey: job.local.0.mrs[dev].lkey(),
                remote_addr: job.remote_addr,
                rkey: job.remote.rkeys[path.remote_device],
                len: job.len,
            };
            match sq.push(job, i + 1 == n, path.signal_every) {
                Ok((wr_id, signaled)) => items.push(WorkItem {
                    wr_id,
                    signaled,
                    ..item
                }),
                Err(job) => waiting.push_front(job),
            }
        }
        let head = chain.build(items);
        // SAFETY: the chain names MRs pinned by the jobs now held in the send queue
        // until their completions are settled.
        let rc = unsafe { path.qp.post_send(head) };
        if rc != 0 {
            path.broken.store(true, Ordering::Release);
            let why = format!(
                "ibv_post_send failed: {}",
                std::io::Error::from_raw_os_error(rc)
            );
            failed.extend(sq.unpush(items.len()).into_iter().map(|j| (j, why.clone())));
            failed.extend(waiting.drain(..).map(|j| (j, why.clone())));
            return;
        }
    }
}

/// Queues jobs on a path and posts what fits.
fn post(path: &Arc<Path>, jobs: impl IntoIterator<Item = Job>) {
    let mut failed = Vec::new();
    {
        let mut st = lock(&path.state);
        st.waiting.extend(jobs);
        pump(path, &mut st, &mut failed);
    }
    for (job, why) in failed {
        retry(path, job, &why);
    }
}

/// A slice failed on `from`: retry it on another healthy path of the same peer, or fail
/// its batch with the reason.
fn retry(from: &Path, mut job: Job, why: &str) {
    let peer = from.peer.upgrade();
    let alive = peer
        .as_ref()
        .is_some_and(|p| !p.dead.load(Ordering::Acquire));
    if job.batch.is_finished() {
        return; // Its batch already failed; the slice is only accounted.
    }
    if let Some(peer) = peer.as_ref().filter(|_| alive) {
        job.attempts += 1;
        if job.attempts < peer.paths.len() {
            let start = peer.next.fetch_add(1, Ordering::Relaxed);
            let n = peer.paths.len();
            if let Some(p) = (0..n)
                .map(|i| &peer.paths[(start + i) % n])
                .find(|p| !p.broken.load(Ordering::Acquire))
            {
                tracing::warn!(device = %from.device.name, reason = why, "rdma slice failed; retrying on another path");
                post(p, [job]);
                return;
            }
        }
    }
    let (kind, because) = match peer.as_ref() {
        Some(p) if !alive => (ErrorKind::PeerUnreachable, format!(" ({})", lock(&p.why))),
        None => (
            ErrorKind::PeerUnreachable,
            " (the peer was disconnected)".into(),
        ),
        Some(p) if p.paths.iter().all(|p| p.broken.load(Ordering::Acquire)) => (
            ErrorKind::PeerUnreachable,
            "; every QP to the peer failed, the next connect rebuilds them".into(),
        ),
        Some(_) => (ErrorKind::Backend, String::new()),
    };
    job.batch.slice_failed(Error::new(
        kind,
        format!(
            "RDMA {} of {} bytes on {} failed: {why}{because}",
            job.op, job.len, from.device.name
        ),
    ));
}

impl Shared {
    fn new_path(
        &self,
        dev: &Arc<Device>,
        remote_device: usize,
        peer: Weak<Peer>,
        depth: u32,
        channel: bool,
    ) -> Result<(Arc<Path>, u32)> {
        let tag = self.next_tag.fetch_add(1, Ordering::Relaxed);
        let cq = dev.ctx.create_cq(depth + 1, tag, channel)?;
        let qp = dev.ctx.create_qp(&cq, depth)?;
        qp.modify(qp::init(&dev.params), "INIT")?;
        let psn = rand::random::<u32>() & 0x00ff_ffff;
        let path = Arc::new(Path {
            tag,
            device: dev.clone(),
            remote_device,
            qp,
            cq,
            state: Mutex::new(PathState {
                sq: SendQueue::new(depth as usize),
                waiting: VecDeque::new(),
                chain: WrChain::default(),
                items: Vec::new(),
                posting: Vec::new(),
            }),
            broken: AtomicBool::new(false),
            peer,
            signal_every: self.config.signal_every,
        });
        Ok((path, psn))
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    let mut next = 0u64;
    for stream in listener.incoming() {
        if shared.closed.load(Ordering::Acquire) {
            return;
        }
        let Ok(stream) = stream else { continue };
        next += 1;
        let id = next;
        if let Ok(c) = stream.try_clone() {
            lock(&shared.serving).insert(id, c);
        }
        let s = shared.clone();
        let handle = spawn("te-rdma-serve", move || {
            if let Err(e) = serve(&s, stream) {
                tracing::warn!(error = %e, "rdma connect exchange failed");
            }
            lock(&s.serving).remove(&id);
        });
        if let Ok(h) = handle {
            lock(&shared.threads).push(h);
        }
    }
}

/// The target's side of the connect exchange: build a QP per requested path, bring it
/// to RTS towards the initiator's QP, answer, then keep the QPs until the initiator
/// closes the side channel.
fn serve(shared: &Arc<Shared>, mut stream: TcpStream) -> Result<()> {
    let timeout = shared.config.connect_timeout;
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.set_write_timeout(Some(timeout));
    let Message::Request {
        target,
        paths: asked,
        ..
    } = exchange::read_message(&mut stream)?
    else {
        return Err(Error::new(
            ErrorKind::Protocol,
            "expected a connect request",
        ));
    };
    let refuse = |stream: &mut TcpStream, reason: String| {
        let _ = exchange::write_message(
            stream,
            &Message::Refuse {
                reason: reason.clone(),
            },
        );
        Err(Error::new(ErrorKind::PeerUnreachable, reason))
    };
    if target != shared.instance {
        return refuse(
            &mut stream,
            format!(
                "the request names instance {target:#x}, this is {:#x}: the descriptor is stale (the target restarted)",
                shared.instance
            ),
        );
    }
    let mut held = Vec::new();
    let mut answer = Vec::new();
    for p in &asked {
        let Some(dev) = shared.devices.get(p.remote_device as usize) else {
            return refuse(&mut stream, format!("no device {} here", p.remote_device));
        };
        if dev.link_layer != p.link_layer {
            return refuse(
                &mut stream,
                format!(
                    "device {} has another link layer than the initiator's",
                    dev.name
                ),
            );
        }
        let built = shared.new_path(dev, p.local_device as usize, Weak::new(), 1, false);
        let (path, psn) = match built {
            Ok(x) => x,
            Err(e) => return refuse(&mut stream, e.to_string()),
        };
        if let Err(e) = path
            .qp
            .modify(qp::rtr(&dev.params, p), "RTR")
            .and_then(|()| path.qp.modify(qp::rts(&dev.params, psn), "RTS"))
        {
            return refuse(&mut stream, e.to_string());
        }
        answer.push(dev.path_info(p.local_device as usize, path.qp.qpn(), psn));
        held.push(path);
    }
    exchange::write_message(&mut stream, &Message::Accept { paths: answer })?;
    let _ = stream.set_read_timeout(None);
    // The QPs live until the initiator closes the side channel (or this backend closes).
    let mut sink = [0u8; 64];
    while matches!(stream.read(&mut sink), Ok(n) if n > 0) {}
    drop(held);
    Ok(())
}

impl RdmaBackend {
    fn establish(&self, ep: &Endpoint) -> Result<Arc<Peer>> {
        let shared = &self.shared;
        let local = &shared.devices;
        let pairs = plan::nic_pairs(local.len(), ep.devices.len(), |l, r| {
            local[l].link_layer == ep.devices[r].link_layer
        });
        if pairs.is_empty() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "no local RDMA device shares a link layer (InfiniBand or Ethernet) with any of the peer's",
            ));
        }
        let timeout = shared.config.connect_timeout;
        let mut side = TcpStream::connect_timeout(&ep.addr, timeout).map_err(|e| {
            Error::new(
                ErrorKind::PeerUnreachable,
                format!("cannot reach the peer's rdma side channel at {}", ep.addr),
            )
            .with_source(e)
        })?;
        let _ = side.set_nodelay(true);
        let _ = side.set_read_timeout(Some(timeout));
        let _ = side.set_write_timeout(Some(timeout));
        let order = plan::path_order(pairs.len(), shared.config.qps_per_path);
        let depth = shared.config.max_outstanding;
        Ok(Arc::new_cyclic(|weak: &Weak<Peer>| {
            // `new_cyclic` cannot fail; errors are carried out through `built`.
            let built = (|| -> Result<Vec<Arc<Path>>> {
                let mut paths = Vec::new();
                let mut mine = Vec::new();
                for &(pair, _) in &order {
                    let (l, r) = pairs[pair];
                    let (path, psn) = shared.new_path(&local[l], r, weak.clone(), depth, true)?;
                    mine.push(local[l].path_info(r, path.qp.qpn(), psn));
                    paths.push((path, psn));
                }
                exchange::write_message(
                    &mut side,
                    &Message::Request {
                        initiator: shared.instance,
                        target: ep.instance,
                        paths: mine,
                    },
                )?;
                let theirs = match exchange::read_message(&mut side)? {
                    Message::Accept { paths } => paths,
                    Message::Refuse { reason } => {
                        return Err(Error::new(
                            ErrorKind::PeerUnreachable,
                            format!("the peer refused the connection: {reason}"),
                        ))
                    }
                    Message::Request { .. } => {
                        return Err(Error::new(
                            ErrorKind::Protocol,
                            "the peer answered with a request",
                        ))
                    }
                };
                if theirs.len() != paths.len() {
                    return Err(Error::new(
                        ErrorKind::Protocol,
                        format!(
                            "asked for {} paths, the peer accepted {}",
                            paths.len(),
                            theirs.len()
                        ),
                    ));
                }
                let mut out = Vec::new();
                for ((path, psn), t) in paths.into_iter().zip(&theirs) {
                    if t.local_device as usize != path.remote_device
                        || t.remote_device as usize != path.device.index
                    {
                        return Err(Error::new(
                            ErrorKind::Protocol,
                            "the peer answered for other devices",
                        ));
                    }
                    let params = &path.device.params;
                    path.qp.modify(qp::rtr(params, t), "RTR")?;
                    path.qp.modify(qp::rts(params, psn), "RTS")?;
                    out.push(path);
                }
                Ok(out)
            })();
            let (paths, why) = match built {
                Ok(p) => (p, String::new()),
                Err(e) => (Vec::new(), e.to_string()),
            };
            Peer {
                endpoint: ep.clone(),
                regions: RwLock::new(HashMap::new()),
                paths,
                next: AtomicUsize::new(0),
                side: side.try_clone().unwrap_or(side),
                dead: AtomicBool::new(!why.is_empty()),
                why: Mutex::new(why),
            }
        }))
        .and_then(|peer| {
            if peer.dead.load(Ordering::Acquire) {
                return Err(Error::new(
                    ErrorKind::PeerUnreachable,
                    lock(&peer.why).clone(),
                ));
            }
            for p in &peer.paths {
                p.device
                    .paths
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(p.tag, p.clone());
                p.cq.arm();
            }
            let _ = peer.side.set_read_timeout(None);
            let watch = peer.side.try_clone().map_err(|e| {
                Error::new(ErrorKind::Io, "cannot watch the side channel").with_source(e)
            })?;
            let weak = Arc::downgrade(&peer);
            let h = spawn("te-rdma-watch", move || watch_peer(watch, &weak))?;
            lock(&self.shared.threads).push(h);
            Ok(peer)
        })
    }
}

/// Blocks on the side channel; when it closes, the peer is dead: its QPs go to the
/// error state so everything outstanding on them completes (flushed) at once.
fn watch_peer(mut side: TcpStream, peer: &Weak<Peer>) {
    let mut sink = [0u8; 64];
    while matches!(side.read(&mut sink), Ok(n) if n > 0) {}
    if let Some(peer) = peer.upgrade() {
        *lock(&peer.why) = format!(
            "the peer's side channel at {} closed: it exited or disconnected",
            peer.endpoint.addr
        );
        peer.dead.store(true, Ordering::Release);
        for p in &peer.paths {
            p.broken.store(true, Ordering::Release);
            if let Err(e) = p.qp.modify(qp::error(), "ERR") {
                tracing::warn!(error = %e, "cannot move a QP to the error state");
            }
        }
    }
}

/// Unhooks a peer's paths from their completion threads and fails whatever they still
/// hold with `PeerUnreachable`; the QPs are destroyed when the last reference goes.
fn teardown(peer: &Peer) {
    let why = lock(&peer.why).clone();
    for p in &peer.paths {
        p.device
            .paths
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&p.tag);
        let jobs: Vec<Job> = {
            let mut st = lock(&p.state);
            let mut jobs = st.sq.drain();
            jobs.extend(st.waiting.drain(..));
            jobs
        };
        for job in jobs {
            job.batch.slice_failed(Error::new(
                ErrorKind::PeerUnreachable,
                format!("the connection to the peer was closed: {why}"),
            ));
        }
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
        let devices = &self.shared.devices;
        let (mrs, dmabuf) = match &mem.kind {
            MemoryKind::Host => (
                devices
                    .iter()
                    .map(|d| d.ctx.reg_mr(mem.addr, mem.len))
                    .collect::<Result<Vec<_>>>()?,
                None,
            ),
            MemoryKind::Device { runtime, ordinal } if runtime == "cuda" => {
                register_cuda(devices, *ordinal, mem.addr, mem.len)?
            }
            other => {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!(
                        "the rdma backend registers {} memory, not {other}",
                        self.info.capabilities.memory.join(" and ")
                    ),
                ))
            }
        };
        let key = exchange::encode_key(&mrs.iter().map(Mr::rkey).collect::<Vec<_>>());
        let region = Arc::new(LocalRegion {
            addr: mem.addr,
            len: mem.len,
            mrs,
            pins: Mutex::new(0),
            unpinned: Condvar::new(),
            _dmabuf: dmabuf,
        });
        self.shared
            .regions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, region);
        Ok(key)
    }

    fn deregister(&self, id: RegionId) -> Result<()> {
        let region = self
            .shared
            .regions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::NotRegistered,
                    format!("region {id} is not registered with the rdma backend"),
                )
            })?;
        let mut pins = lock(&region.pins);
        while *pins > 0 {
            let (p, t) = region
                .unpinned
                .wait_timeout(pins, Duration::from_secs(5))
                .unwrap_or_else(|p| p.into_inner());
            pins = p;
            if t.timed_out() && *pins > 0 {
                tracing::warn!(region = %id, slices = *pins, "deregister waits for RDMA work requests still using the region");
            }
        }
        Ok(())
    }

    fn connect(&self, segment: &SegmentDesc) -> Result<PeerId> {
        let ep = exchange::decode_endpoint(&segment.endpoint)?;
        let regions = segment
            .regions
            .iter()
            .map(|r| {
                let rkeys = exchange::decode_key(&r.key, ep.devices.len())?;
                Ok((
                    r.id,
                    Arc::new(RemoteRegion {
                        addr: r.addr,
                        len: r.len,
                        rkeys,
                    }),
                ))
            })
            .collect::<Result<HashMap<_, _>>>()?;
        let known = lock(&self.by_instance).get(&ep.instance).copied();
        if let Some(id) = known {
            let peers = self.peers.read().unwrap_or_else(|p| p.into_inner());
            if let Some(peer) = peers.get(&id) {
                let healthy = !peer.dead.load(Ordering::Acquire)
                    && peer.paths.iter().all(|p| !p.broken.load(Ordering::Acquire));
                if healthy {
                    *peer.regions.write().unwrap_or_else(|p| p.into_inner()) = regions;
                    return Ok(id);
                }
            }
        }
        // No connection lock is held while the exchange runs.
        let peer = self.establish(&ep)?;
        *peer.regions.write().unwrap_or_else(|p| p.into_inner()) = regions;
        let id = known.unwrap_or_else(|| PeerId(self.next_peer.fetch_add(1, Ordering::Relaxed)));
        let old = self
            .peers
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, peer);
        lock(&self.by_instance).insert(ep.instance, id);
        if let Some(old) = old {
            *lock(&old.why) = "replaced by a new connection after a QP failed".into();
            old.dead.store(true, Ordering::Release);
            teardown(&old);
        }
        Ok(id)
    }

    fn disconnect(&self, peer: PeerId) -> Result<()> {
        let old = self
            .peers
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&peer)
            .ok_or_else(|| Error::new(ErrorKind::PeerUnreachable, "unknown peer"))?;
        lock(&self.by_instance).retain(|_, id| *id != peer);
        *lock(&old.why) = "disconnected".into();
        old.dead.store(true, Ordering::Release);
        for p in &old.paths {
            p.broken.store(true, Ordering::Release);
            let _ = p.qp.modify(qp::error(), "ERR");
        }
        teardown(&old);
        Ok(())
    }

    fn submit(&self, peer: PeerId, batch: &[TransferRequest], done: Completion) -> Result<()> {
        if done.remaining().is_zero() {
            return Err(Error::new(
                ErrorKind::Timeout,
                "the batch's deadline passed before it was posted",
            ));
        }
        let peer = self
            .peers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&peer)
            .cloned()
            .ok_or_else(|| Error::new(ErrorKind::PeerUnreachable, "unknown peer"))?;
        if peer.dead.load(Ordering::Acquire) {
            return Err(Error::new(
                ErrorKind::PeerUnreachable,
                lock(&peer.why).clone(),
            ));
        }
        let usable: Vec<&Arc<Path>> = peer
            .paths
            .iter()
            .filter(|p| !p.broken.load(Ordering::Acquire))
            .collect();
        if usable.is_empty() {
            return Err(Error::new(
                ErrorKind::PeerUnreachable,
                "every QP to the peer failed; the next connect rebuilds them",
            ));
        }
        let local_regions = self
            .shared
            .regions
            .read()
            .unwrap_or_else(|p| p.into_inner());
        let remote_regions = peer.regions.read().unwrap_or_else(|p| p.into_inner());
        let mut resolved = Vec::with_capacity(batch.len());
        for (i, r) in batch.iter().enumerate() {
            let local = local_regions.get(&r.local).ok_or_else(|| {
                Error::new(
                    ErrorKind::NotRegistered,
                    format!("local region {} is not registered", r.local),
                )
                .with_context("request", i)
            })?;
            let remote = remote_regions.get(&r.remote).ok_or_else(|| {
                Error::new(
                    ErrorKind::NotRegistered,
                    format!("the peer has no region {}", r.remote),
                )
                .with_context("request", i)
            })?;
            let fits = |off: u64, len: u64| off.checked_add(r.len).is_some_and(|end| end <= len);
            if !fits(r.local_offset, local.len) || !fits(r.remote_offset, remote.len) {
                return Err(
                    Error::new(ErrorKind::OutOfBounds, "request outside its region")
                        .with_context("request", i),
                );
            }
            resolved.push((local.clone(), remote.clone()));
        }
        drop((local_regions, remote_regions));
        let slice = self.shared.config.slice_size.min(MAX_SLICE);
        let count = plan::slice_count(batch.iter().map(|r| r.len), slice);
        if count == 0 {
            done.complete(Ok(()));
            return Ok(());
        }
        let start = peer.next.fetch_add(count as usize, Ordering::Relaxed);
        let specs = plan::plan(batch.iter().map(|r| r.len), slice, usable.len(), start);
        let state = Arc::new(BatchState::new(specs.len(), done));
        let mut per_path: Vec<Vec<Job>> = (0..usable.len()).map(|_| Vec::new()).collect();
        for s in specs {
            let r = &batch[s.request];
            let (local, remote) = &resolved[s.request];
            per_path[s.path].push(Job {
                batch: state.clone(),
                op: r.op,
                local: Pin::new(local),
                local_addr: local.addr + r.local_offset + s.offset,
                remote: remote.clone(),
                remote_addr: remote.addr + r.remote_offset + s.offset,
                len: s.len as u32,
                attempts: 0,
            });
        }
        for (path, jobs) in usable.into_iter().zip(per_path) {
            if !jobs.is_empty() {
                post(path, jobs);
            }
        }
        Ok(())
    }
}

/// Registers CUDA memory on every device: DMA-BUF first, then plain `ibv_reg_mr`
/// (nvidia-peermem).
#[cfg(feature = "cuda")]
fn register_cuda(
    devices: &[Arc<Device>],
    ordinal: u32,
    addr: u64,
    len: u64,
) -> Result<(Vec<Mr>, Option<OwnedFd>)> {
    crate::cuda::check_pointer(ordinal, addr, len)?;
    let dmabuf = crate::cuda::export_dmabuf(ordinal, addr, len).and_then(|buf| {
        let mrs = devices
            .iter()
            .map(|d| {
                d.ctx
                    .reg_dmabuf_mr(buf.fd.as_raw_fd(), buf.offset, len, addr)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((mrs, Some(buf.fd)))
    });
    match dmabuf {
        Ok(x) => Ok(x),
        Err(dmabuf_error) => {
            let peermem = devices
                .iter()
                .map(|d| d.ctx.reg_mr(addr, len))
                .collect::<Result<Vec<_>>>();
            match peermem {
                Ok(mrs) => {
                    tracing::info!(reason = %dmabuf_error, "DMA-BUF registration unavailable; cuda memory registered through nvidia-peermem");
                    Ok((mrs, None))
                }
                Err(e) => Err(Error::new(
                    ErrorKind::Unsupported,
                    format!(
                        "cuda:{ordinal} memory cannot be registered with the NIC: DMA-BUF: {dmabuf_error}; ibv_reg_mr (nvidia-peermem): {e}"
                    ),
                )),
            }
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn register_cuda(
    _: &[Arc<Device>],
    ordinal: u32,
    _: u64,
    _: u64,
) -> Result<(Vec<Mr>, Option<OwnedFd>)> {
    Err(Error::new(
        ErrorKind::Unsupported,
        format!("cuda:{ordinal} memory: te-rdma was built without its `cuda` feature"),
    ))
}

impl Drop for RdmaBackend {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        // SAFETY: shutting down our own listening socket wakes the accept loop.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        for (_, s) in lock(&self.shared.serving).drain() {
            let _ = s.shutdown(Shutdown::Both);
        }
        let peers: Vec<_> = self
            .peers
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
            .map(|(_, p)| p)
            .collect();
        for p in &peers {
            let _ = p.side.shutdown(Shutdown::Both);
            teardown(p);
        }
        for w in &self.stop {
            // SAFETY: writing one byte from a valid buffer to our own pipe.
            unsafe { libc::write(w.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
        }
        for t in lock(&self.completion_threads).drain(..) {
            let _ = t.join();
        }
        for t in lock(&self.shared.threads).drain(..) {
            let _ = t.join();
        }
        for d in &self.shared.devices {
            d.paths.write().unwrap_or_else(|p| p.into_inner()).clear();
        }
    }
}
