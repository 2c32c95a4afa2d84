//! The side channel: the connect exchange that builds a peer's QPs (initiator and
//! target halves), the watch that notices a peer leaving, and the background repair
//! that rebuilds a peer's paths after one failed.
//!
//! The target builds at most `qps_per_path` × device pairs QPs for one request (the
//! device pairs being the larger of its device count and the initiator devices the
//! request names), and holds them while the initiator keeps the channel open.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use te_core::{Deadline, Error, ErrorKind, PeerId, Result};

use crate::backend::{lock, spawn, Shared};
use crate::device::Device;
use crate::exchange::{self, Endpoint, GidType, Message};
use crate::path::{self, Path, PathState, Peer};
use crate::plan;
use crate::qp;

impl Shared {
    /// A new path (QP and CQ) on `dev` towards peer device `remote_device`, in INIT.
    fn new_path(
        self: &Arc<Self>,
        dev: &Arc<Device>,
        remote_device: usize,
        gid_type: GidType,
        (peer, peer_id): (Weak<Peer>, PeerId),
        depth: u32,
        channel: bool,
    ) -> Result<(Arc<Path>, u32)> {
        let tag = self.next_tag.fetch_add(1, Ordering::Relaxed);
        let cq = dev.ctx.create_cq(depth + 1, tag, channel)?;
        let qp = dev.ctx.create_qp(&cq, depth, tag)?;
        qp.modify(qp::init(&dev.params), "INIT")?;
        let psn = rand::random::<u32>() & 0x00ff_ffff;
        let path = Arc::new(Path {
            tag,
            device: dev.clone(),
            remote_device,
            gid_type,
            qp,
            cq,
            state: Mutex::new(PathState::new(depth as usize)),
            idle: Condvar::new(),
            broken: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            peer,
            peer_id,
            shared: Arc::downgrade(self),
            signal_every: self.config.signal_every,
        });
        Ok((path, psn))
    }

    /// Connects to the peer `ep` describes: builds a QP per path, runs the exchange on
    /// a new side channel, brings every QP to RTS, hooks the paths to their completion
    /// threads and starts the watch on the channel. The exchange ends by `deadline` or
    /// `connect_timeout` from now, whichever is sooner.
    ///
    /// # Errors
    /// `Timeout` if `deadline` passes first; `PeerUnreachable` if the peer cannot be
    /// reached, refuses, or does not answer within `connect_timeout`; `Unsupported` if
    /// no device pair can talk; `Protocol` for a malformed answer; `Backend` for verbs
    /// failures.
    pub(crate) fn establish(
        self: &Arc<Self>,
        ep: &Endpoint,
        id: PeerId,
        deadline: Deadline,
    ) -> Result<Arc<Peer>> {
        let local = &self.devices;
        let kinds = |l: usize, r: usize| {
            exchange::negotiate(
                (local[l].link_layer, local[l].roce()),
                (ep.devices[r].link_layer, ep.devices[r].roce),
            )
        };
        let pairs = plan::nic_pairs(local.len(), ep.devices.len(), |l, r| {
            local[l].port_up.load(Ordering::Acquire) && kinds(l, r).is_some()
        });
        if pairs.is_empty() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "no local RDMA device with an active port shares a link layer and GID type (InfiniBand, RoCE v1 or v2) with any of the peer's",
            ));
        }
        let limit = Instant::now() + self.config.connect_timeout;
        let callers = deadline.instant() <= limit;
        let until = if callers { deadline.instant() } else { limit };
        // An error once the time is up is the time's: the caller's deadline, or the
        // peer's silence.
        let late = |e: Error| {
            if Instant::now() < until {
                e
            } else if callers {
                Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "the deadline passed during the rdma connect exchange with {}",
                        ep.addr
                    ),
                )
                .with_source(e)
            } else {
                Error::new(
                    ErrorKind::PeerUnreachable,
                    format!(
                        "the peer's rdma side channel at {} did not answer within connect_timeout ({:?})",
                        ep.addr, self.config.connect_timeout
                    ),
                )
                .with_source(e)
            }
        };
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(late(Error::new(
                ErrorKind::Timeout,
                "no time was left to start the exchange",
            )));
        }
        let side = TcpStream::connect_timeout(&ep.addr, left).map_err(|e| {
            late(
                Error::new(
                    ErrorKind::PeerUnreachable,
                    format!("cannot reach the peer's rdma side channel at {}", ep.addr),
                )
                .with_source(e),
            )
        })?;
        let _ = side.set_nodelay(true);
        let order = plan::path_order(pairs.len(), self.config.qps_per_path);
        let depth = self.config.max_outstanding;
        let mut built = Err(Error::new(ErrorKind::Backend, "not built"));
        let peer = Arc::new_cyclic(|weak: &Weak<Peer>| {
            let mut channel = Until {
                stream: &side,
                until,
            };
            built = (|| -> Result<Vec<Arc<Path>>> {
                let mut paths = Vec::new();
                let mut mine = Vec::new();
                for &(pair, _) in &order {
                    let (l, r) = pairs[pair];
                    let kind = kinds(l, r).expect("pairs are compatible");
                    let (path, psn) =
                        self.new_path(&local[l], r, kind, (weak.clone(), id), depth, true)?;
                    mine.push(local[l].path_info(r, path.qp.qpn(), psn, kind));
                    paths.push((path, psn));
                }
                exchange::write_message(
                    &mut channel,
                    &Message::Request {
                        initiator: self.instance,
                        target: ep.instance,
                        paths: mine,
                    },
                )?;
                let theirs = match exchange::read_message(&mut channel)? {
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
                        || t.gid_type != path.gid_type
                    {
                        return Err(Error::new(
                            ErrorKind::Protocol,
                            "the peer answered for other devices or another GID type",
                        ));
                    }
                    let dev = &path.device;
                    let sgid = dev.gid(path.gid_type).map_or(0, |(i, _)| i);
                    path.qp.modify(qp::rtr(&dev.params, t, sgid), "RTR")?;
                    path.qp
                        .modify(qp::rts(&dev.params, psn, t.rd_atomic), "RTS")?;
                    out.push(path);
                }
                Ok(out)
            })()
            .map_err(late);
            Peer {
                id,
                endpoint: ep.clone(),
                regions: RwLock::new(HashMap::new()),
                paths: built.clone().unwrap_or_default(),
                next: AtomicUsize::new(0),
                side: side.try_clone().unwrap_or(side),
                dead: AtomicBool::new(false),
                why: Mutex::new(String::new()),
            }
        });
        built?;
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
        lock(&self.threads).push(h);
        Ok(peer)
    }

    /// The peer currently registered under `id`.
    pub(crate) fn peer(&self, id: PeerId) -> Option<Arc<Peer>> {
        self.peers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
    }

    /// Asks the repair thread to rebuild peer `id`'s paths.
    pub(crate) fn repair(&self, id: PeerId) {
        let mut q = lock(&self.repairs);
        if !q.contains(&id) {
            q.push_back(id);
        }
        self.repair_wake.notify_all();
    }

    /// Asks for every peer with a failed path to be rebuilt (a port came back).
    pub(crate) fn repair_degraded(&self) {
        let ids: Vec<PeerId> = self
            .peers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|p| !p.dead.load(Ordering::Acquire) && p.healthy().len() < p.paths.len())
            .map(|p| p.id)
            .collect();
        for id in ids {
            self.repair(id);
        }
    }
}

/// A side channel whose every read and write ends by `until`, so that one exchange of
/// several calls is bounded by one point in time.
struct Until<'a> {
    stream: &'a TcpStream,
    until: Instant,
}

impl Until<'_> {
    fn left(&self) -> std::io::Result<Duration> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the connect exchange ran out of time",
            ));
        }
        Ok(left)
    }
}

impl Read for Until<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        let mut stream = self.stream;
        stream.read(buf)
    }
}

impl Write for Until<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        let mut stream = self.stream;
        stream.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let mut stream = self.stream;
        stream.flush()
    }
}

/// Blocks on the side channel; when it closes, the peer is gone: its QPs are retired
/// (moved to ERR, their flush completions awaited) and what they held fails with
/// `PeerUnreachable`.
pub(crate) fn watch_peer(mut side: TcpStream, peer: &Weak<Peer>) {
    let mut sink = [0u8; 64];
    while matches!(side.read(&mut sink), Ok(n) if n > 0) {}
    if let Some(peer) = peer.upgrade() {
        if peer.dead.load(Ordering::Acquire) {
            return; // Disconnected or replaced on purpose; that path retires it.
        }
        peer.kill(format!(
            "the peer's side channel at {} closed: it exited or disconnected",
            peer.endpoint.addr
        ));
        path::retire(&peer, Instant::now() + RETIRE_WAIT);
    }
}

/// How long retiring QPs waits for their flush completions.
pub(crate) const RETIRE_WAIT: Duration = Duration::from_secs(5);

/// The repair thread: rebuilds, in the background, the paths of peers one of whose
/// paths failed. The new set replaces the old under the same peer id; the old set is
/// retired, and what it held moves to the new paths. While a rebuild fails it is tried
/// again, waiting longer each time (up to 5 s); a peer with no healthy path meanwhile
/// fails its batches with `PeerUnreachable`.
pub(crate) fn repair_loop(shared: &Weak<Shared>) {
    let mut backoff: HashMap<PeerId, (Duration, Instant)> = HashMap::new();
    loop {
        let Some(s) = shared.upgrade() else { return };
        let id = {
            let mut q = lock(&s.repairs);
            loop {
                if s.closed.load(Ordering::Acquire) {
                    return;
                }
                let now = Instant::now();
                if let Some(i) = q
                    .iter()
                    .position(|id| backoff.get(id).is_none_or(|(_, at)| *at <= now))
                {
                    break q.remove(i).expect("found");
                }
                let wake = backoff
                    .values()
                    .map(|(_, at)| *at)
                    .min()
                    .map_or(Duration::from_secs(1), |at| {
                        at.saturating_duration_since(now)
                    })
                    .max(Duration::from_millis(1));
                q = s
                    .repair_wake
                    .wait_timeout(q, wake)
                    .map(|(g, _)| g)
                    .unwrap_or_else(|p| p.into_inner().0);
            }
        };
        let Some(old) = s.peer(id) else { continue };
        if old.dead.load(Ordering::Acquire) || old.healthy().len() == old.paths.len() {
            backoff.remove(&id);
            continue;
        }
        // Nobody waits for a repair: it is bounded by `connect_timeout` alone.
        match s.establish(&old.endpoint, id, Deadline::after(s.config.connect_timeout)) {
            Ok(new) if s.closed.load(Ordering::Acquire) => {
                new.kill("the rdma backend is closing".into());
                path::retire(&new, Instant::now() + RETIRE_WAIT);
                return;
            }
            Ok(new) => {
                backoff.remove(&id);
                let regions = old
                    .regions
                    .read()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone();
                *new.regions.write().unwrap_or_else(|p| p.into_inner()) = regions;
                s.peers
                    .write()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(id, new);
                tracing::info!(peer = %old.endpoint.addr, "RDMA paths rebuilt");
                // The old set's work moves to the new set; it is not dead.
                *lock(&old.why) = "replaced by rebuilt paths".into();
                path::retire(&old, Instant::now() + RETIRE_WAIT);
                old.dead.store(true, Ordering::Release);
                let _ = old.side.shutdown(std::net::Shutdown::Both);
            }
            Err(e) => {
                let wait = backoff
                    .get(&id)
                    .map_or(Duration::from_millis(50), |(d, _)| {
                        (*d * 2).min(Duration::from_secs(5))
                    });
                tracing::warn!(peer = %old.endpoint.addr, error = %e, retry_in = ?wait, "cannot rebuild RDMA paths");
                if old.healthy().is_empty() {
                    *lock(&old.why) =
                        format!("every QP to the peer failed, and rebuilding them failed: {e}");
                }
                backoff.insert(id, (wait, Instant::now() + wait));
                s.repair(id);
            }
        }
    }
}

/// The target's side of the connect exchange: build a QP per requested path (within
/// the cap), bring it to RTS towards the initiator's QP, answer, then keep the QPs
/// until the initiator closes the side channel.
pub(crate) fn serve(shared: &Arc<Shared>, mut stream: TcpStream) -> Result<()> {
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
    let theirs: HashSet<u8> = asked.iter().map(|p| p.local_device).collect();
    let cap = shared.config.qps_per_path * shared.devices.len().max(theirs.len());
    if asked.len() > cap {
        return refuse(
            &mut stream,
            format!(
                "the request asks for {} QPs; this side builds at most {cap} per connection (qps_per_path = {} × {} device pairs): make qps_per_path the same on both sides",
                asked.len(),
                shared.config.qps_per_path,
                shared.devices.len().max(theirs.len())
            ),
        );
    }
    let mut held = Vec::new();
    let mut answer = Vec::new();
    for p in &asked {
        let Some(dev) = shared.devices.get(p.remote_device as usize) else {
            return refuse(&mut stream, format!("no device {} here", p.remote_device));
        };
        let Some((sgid, _)) = dev
            .gid(p.gid_type)
            .filter(|_| dev.link_layer == p.link_layer)
        else {
            return refuse(
                &mut stream,
                format!(
                    "device {} has no {:?} GID on the initiator's link layer",
                    dev.name, p.gid_type
                ),
            );
        };
        let built = shared.new_path(
            dev,
            p.local_device as usize,
            p.gid_type,
            (Weak::new(), PeerId(0)),
            1,
            false,
        );
        let (path, psn) = match built {
            Ok(x) => x,
            Err(e) => return refuse(&mut stream, e.to_string()),
        };
        if let Err(e) = path
            .qp
            .modify(qp::rtr(&dev.params, p, sgid), "RTR")
            .and_then(|()| {
                path.qp
                    .modify(qp::rts(&dev.params, psn, p.rd_atomic), "RTS")
            })
        {
            return refuse(&mut stream, e.to_string());
        }
        answer.push(dev.path_info(p.local_device as usize, path.qp.qpn(), psn, p.gid_type));
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
