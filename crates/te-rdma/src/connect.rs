//! The connect exchange over the engine's control-plane hook (initiator and target
//! halves), and the background repair that rebuilds a peer's paths after one failed.
//!
//! The exchange is one request and its answer, carried by the engines' authenticated,
//! size-limited control plane within the caller's deadline; te-rdma runs no listener.
//! The target builds at most `qps_per_path` × device pairs QPs for one request (the
//! device pairs being the larger of its device count and the initiator devices the
//! request names) and holds at most [`SETS_PER_PEER`] sets per initiator (the engine
//! name and epoch it authenticated with), and `max_served_qps` QPs in all: a set goes
//! when the initiator releases it, when a newer set of its pushes it out, when the
//! control plane says the initiator's engine left or restarted (`peer_gone`), when the
//! table is full and it is the oldest (an initiator whose name came back with another
//! epoch loses its old sets first), or when the backend closes.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};
use te_core::sync::{Condvar, Mutex, RwLock};

use te_core::{Deadline, Error, ErrorKind, MessageHandler, PeerId, PeerInfo, Result};

use crate::device::Device;
use crate::endpoint::Endpoint;
use crate::exchange::{self, GidType, Message};
use crate::path::{self, Path, PathState};
use crate::peers::Peer;
use crate::plan;
use crate::qp;
use crate::state::Shared;

/// The most QP sets a target holds for one initiator: the one in use and the one a
/// repair is building to replace it.
pub(crate) const SETS_PER_PEER: usize = 2;

/// Backends created outside an engine (no control plane), by instance: they reach
/// each other, in this process only, by calling the target's handler directly.
static LOCAL: Mutex<Vec<(u64, Weak<Shared>)>> = Mutex::new(Vec::new());

/// Lists a backend without a control plane among those of this process.
pub(crate) fn list_local(shared: &Arc<Shared>) {
    let mut l = LOCAL.lock();
    l.retain(|(_, w)| w.strong_count() > 0);
    l.push((shared.instance, Arc::downgrade(shared)));
}

/// Takes a backend off that list.
pub(crate) fn unlist_local(instance: u64) {
    LOCAL
        .lock()
        .retain(|(i, w)| *i != instance && w.strong_count() > 0);
}

/// The QP sets a target holds for its initiators, each known by the engine name and
/// epoch its initiator authenticated with on the control plane (the epoch is also the
/// one its requests name): an address is only what the initiator claims, so another
/// engine claiming it (or two engines given one address by mistake) must not take the
/// first one's sets away.
#[derive(Default)]
pub(crate) struct Served {
    by: HashMap<(String, u64), Initiator>,
    /// Numbers the sets in the order they were built.
    seq: u64,
}

/// One initiator's sets.
struct Initiator {
    /// Oldest first: (set id, its number in [`Served::seq`]'s order, the target's half
    /// of its paths).
    sets: VecDeque<(u64, u64, Vec<Arc<Path>>)>,
    /// Another epoch has come under this name since: the initiator most likely
    /// restarted, so these sets are the first to go when the table is full.
    superseded: bool,
}

impl Served {
    /// Keeps `paths` as set `set` of the initiator named `name` with `epoch`: its
    /// oldest set beyond [`SETS_PER_PEER`] goes, and while all sets together hold more
    /// than `max_qps` QPs, the oldest of the superseded initiators' sets goes, else the
    /// oldest of all (never this one). Returns what went, to be dropped outside the lock.
    fn hold(
        &mut self,
        (name, epoch): (&str, u64),
        set: u64,
        paths: Vec<Arc<Path>>,
        max_qps: usize,
    ) -> Vec<Vec<Arc<Path>>> {
        let mut gone = Vec::new();
        for ((n, e), i) in &mut self.by {
            if n == name && *e != epoch && !i.superseded {
                tracing::info!(peer = %name, "an rdma peer came back with a new epoch; its previous QP sets go first when the target's table is full");
                i.superseded = true;
            }
        }
        self.seq += 1;
        let key = (name.to_string(), epoch);
        let me = self.by.entry(key.clone()).or_insert(Initiator {
            sets: VecDeque::new(),
            superseded: false,
        });
        if let Some(i) = me.sets.iter().position(|(id, ..)| *id == set) {
            gone.extend(me.sets.remove(i).map(|(.., p)| p));
        }
        while me.sets.len() >= SETS_PER_PEER {
            tracing::warn!(peer = %name, "an rdma peer holds {SETS_PER_PEER} QP sets already; its oldest goes");
            gone.extend(me.sets.pop_front().map(|(.., p)| p));
        }
        me.sets.push_back((set, self.seq, paths));
        let mine = self.seq;
        let mut qps: usize = self
            .by
            .values()
            .flat_map(|i| &i.sets)
            .map(|s| s.2.len())
            .sum();
        while qps > max_qps {
            let Some(victim) = self
                .by
                .iter()
                .filter_map(|(k, i)| {
                    let (_, n, _) = i.sets.front()?;
                    (*n != mine).then_some((!i.superseded, *n, k.clone()))
                })
                .min()
            else {
                break;
            };
            let i = self.by.get_mut(&victim.2).expect("found above");
            let (.., paths) = i.sets.pop_front().expect("found above");
            tracing::warn!(peer = %victim.2 .0, "the rdma target holds more than max_served_qps = {max_qps} QPs; an initiator's oldest set goes");
            qps -= paths.len();
            gone.push(paths);
        }
        self.by.retain(|_, i| !i.sets.is_empty());
        gone
    }

    /// Takes set `set` of the initiator named `name` with `epoch`, if it holds it.
    fn release(&mut self, (name, epoch): (&str, u64), set: u64) -> Option<Vec<Arc<Path>>> {
        let key = (name.to_string(), epoch);
        let i = self.by.get_mut(&key)?;
        let at = i.sets.iter().position(|(id, ..)| *id == set)?;
        let (.., paths) = i.sets.remove(at)?;
        if i.sets.is_empty() {
            self.by.remove(&key);
        }
        Some(paths)
    }

    /// Takes every set of the initiator named `name` with `epoch`.
    fn forget(&mut self, (name, epoch): (&str, u64)) -> Vec<Vec<Arc<Path>>> {
        let key = (name.to_string(), epoch);
        self.by
            .remove(&key)
            .map(|i| i.sets.into_iter().map(|(.., paths)| paths).collect())
            .unwrap_or_default()
    }
}

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
            replaced: AtomicBool::new(false),
            peer,
            peer_id,
            shared: Arc::downgrade(self),
            signal_every: self.config.signal_every,
        });
        Ok((path, psn))
    }

    /// Connects to the peer `ep` describes, whose engine's control plane is at
    /// `address`: builds a QP per path, sends the request through the hook, brings
    /// every QP to RTS towards the answer and hooks the paths to their completion
    /// threads. The exchange ends by `deadline` or `connect_timeout` from now,
    /// whichever is sooner.
    ///
    /// # Errors
    /// `Timeout` if `deadline` passes first; `PeerUnreachable` if the peer cannot be
    /// reached or does not answer within `connect_timeout`; the target's refusal
    /// (`InvalidRequest`, `PeerRestarted`, `Unauthorized`, …); `Unsupported` if no
    /// device pair can talk or the backend has no control plane; `Protocol` for a
    /// malformed answer; `Backend` for verbs failures.
    pub(crate) fn establish(
        self: &Arc<Self>,
        ep: &Endpoint,
        address: &str,
        id: PeerId,
        deadline: Deadline,
    ) -> Result<Arc<Peer>> {
        let local = &self.devices;
        let pairs = self.pairs(ep);
        if pairs.is_empty() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                "no local RDMA device with an active port shares a link layer and GID type (InfiniBand, RoCE v1 or v2) with any of the peer's",
            ));
        }
        let limit = Instant::now() + self.config.connect_timeout;
        let callers = deadline.instant() <= limit;
        let until = if callers { deadline.instant() } else { limit };
        // A timeout is the time's: the caller's deadline, or the peer's silence.
        let late = |e: Error| {
            if e.kind() != ErrorKind::Timeout && Instant::now() < until {
                e
            } else if callers {
                Error::new(
                    ErrorKind::Timeout,
                    format!("the deadline passed during the rdma connect exchange with {address}"),
                )
                .with_source(e)
            } else {
                Error::new(
                    ErrorKind::PeerUnreachable,
                    format!(
                        "the peer's engine at {address} did not answer the rdma connect exchange within connect_timeout ({:?})",
                        self.config.connect_timeout
                    ),
                )
                .with_source(e)
            }
        };
        if Instant::now() >= until {
            return Err(late(Error::new(
                ErrorKind::Timeout,
                "no time was left to start the exchange",
            )));
        }
        let order = plan::path_order(pairs.len(), self.config.qps_per_path);
        let depth = self.config.max_outstanding;
        let set = self.next_set.fetch_add(1, Ordering::Relaxed);
        let mut accepted = false;
        let mut built = Err(Error::new(ErrorKind::Backend, "not built"));
        let peer = Arc::new_cyclic(|weak: &Weak<Peer>| {
            built = (|| -> Result<Vec<Arc<Path>>> {
                let mut paths = Vec::new();
                let mut mine = Vec::new();
                for &(pair, _) in &order {
                    let (l, r) = pairs[pair];
                    let kind = self.kind(ep, l, r).expect("pairs are compatible");
                    let (path, psn) =
                        self.new_path(&local[l], r, kind, (weak.clone(), id), depth, true)?;
                    mine.push(local[l].path_info(r, path.qp.qpn(), psn, kind));
                    paths.push((path, psn));
                }
                let request = exchange::encode(&Message::Request {
                    initiator: self.instance,
                    target: ep.instance,
                    set,
                    paths: mine,
                });
                let answer = self.call(address, ep.instance, &request, Deadline::at(until))?;
                let theirs = match exchange::decode(&answer)? {
                    Message::Accept { paths } => paths,
                    other => {
                        return Err(Error::new(
                            ErrorKind::Protocol,
                            format!("the peer answered a connect request with {other:?}"),
                        ))
                    }
                };
                accepted = true;
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
                address: address.to_string(),
                set,
                regions: RwLock::new(HashMap::new()),
                paths: built.clone().unwrap_or_default(),
                next: AtomicUsize::new(0),
                dead: AtomicBool::new(false),
                why: Mutex::new(String::new()),
            }
        });
        if let Err(e) = built {
            if accepted {
                // The target built its half; it need not keep it.
                self.release(&peer, Deadline::at(until));
            }
            return Err(e);
        }
        for p in &peer.paths {
            p.device.paths.write().insert(p.tag, p.clone());
            p.cq.arm();
        }
        Ok(peer)
    }

    /// The GID type local device `l` and device `r` of the peer `ep` talk with, if any.
    fn kind(&self, ep: &Endpoint, l: usize, r: usize) -> Option<GidType> {
        let (local, remote) = (&self.devices[l], &ep.devices[r]);
        exchange::negotiate(
            (local.link_layer, local.roce()),
            (remote.link_layer, remote.roce),
        )
    }

    /// The device pairs (local, peer) a set of paths to the peer `ep` built now uses:
    /// [`plan::nic_pairs`] over the pairs that talk and whose local port is up.
    fn pairs(&self, ep: &Endpoint) -> Vec<(usize, usize)> {
        plan::nic_pairs(self.devices.len(), ep.devices.len(), |l, r| {
            self.devices[l].port_up.load(Ordering::Acquire) && self.kind(ep, l, r).is_some()
        })
    }

    /// Whether `peer`'s set needs rebuilding: one of its paths failed, or it lacks a
    /// device pair a set built now would use (it was built while a port was down, and
    /// the port came back). A set built with every pair usable now is not degraded, so
    /// a rebuild that finds nothing new is not asked for again.
    fn degraded(&self, peer: &Peer) -> bool {
        if peer.healthy().len() < peer.paths.len() {
            return true;
        }
        let have: HashSet<(usize, usize)> = peer
            .paths
            .iter()
            .map(|p| (p.device.index, p.remote_device))
            .collect();
        self.pairs(&peer.endpoint)
            .iter()
            .any(|pair| !have.contains(pair))
    }

    /// Sends an exchange message to the target `instance` whose engine's control plane
    /// is at `address`; to a backend of this process created outside an engine, by a
    /// direct call.
    fn call(
        &self,
        address: &str,
        instance: u64,
        message: &[u8],
        deadline: Deadline,
    ) -> Result<Vec<u8>> {
        let local = LOCAL
            .lock()
            .iter()
            .find(|(i, _)| *i == instance)
            .map(|(_, w)| w.clone());
        if let Some(target) = local {
            let me = PeerInfo {
                name: "this process".into(),
                epoch: self.instance,
                address: format!("local:{:#x}", self.instance),
            };
            return Target(target).handle(&me, message, deadline);
        }
        self.hook.call(address, message, deadline)
    }

    /// Tells the target of `peer` that it may destroy its half of the peer's QP set.
    /// Best effort, within `deadline`: a target that cannot be told keeps the set until
    /// this engine returns with another epoch or a newer set pushes it out.
    pub(crate) fn release(&self, peer: &Peer, deadline: Deadline) {
        let message = exchange::encode(&Message::Release {
            initiator: self.instance,
            target: peer.endpoint.instance,
            set: peer.set,
        });
        if let Err(e) = self.call(&peer.address, peer.endpoint.instance, &message, deadline) {
            tracing::debug!(peer = %peer.address, error = %e, "cannot release the peer's rdma QPs");
        }
    }

    /// The peer currently registered under `id`.
    pub(crate) fn peer(&self, id: PeerId) -> Option<Arc<Peer>> {
        self.peers.get(id).ok()
    }

    /// `peer` and its healthy paths; where it has none (it is dead, or every path of it
    /// failed), the set that replaced it under its id since it was looked up, and that
    /// set's. A repair puts the rebuilt set in the table before it retires the old one
    /// (marks its paths broken, then the peer dead), so a set seen without a healthy
    /// path while the table still holds it, or holds none, was not replaced.
    pub(crate) fn usable(&self, mut peer: Arc<Peer>) -> (Arc<Peer>, Vec<Arc<Path>>) {
        loop {
            if !peer.dead.load(Ordering::Acquire) {
                let healthy: Vec<Arc<Path>> = peer.healthy().into_iter().cloned().collect();
                if !healthy.is_empty() {
                    return (peer, healthy);
                }
            }
            match self.peer(peer.id) {
                Some(newer) if !Arc::ptr_eq(&newer, &peer) => peer = newer,
                _ => return (peer, Vec::new()),
            }
        }
    }

    /// Asks the repair thread to rebuild peer `id`'s paths.
    pub(crate) fn repair(&self, id: PeerId) {
        let mut q = self.repairs.lock();
        if !q.contains(&id) {
            q.push_back(id);
        }
        self.repair_wake.notify_all();
    }

    /// Asks for every degraded peer to be rebuilt (a port came back): one with a failed
    /// path, or one whose set was built without the port (see [`Shared::degraded`]).
    pub(crate) fn repair_degraded(&self) {
        let ids: Vec<PeerId> = self
            .peers
            .all()
            .iter()
            .filter(|p| !p.dead.load(Ordering::Acquire) && self.degraded(p))
            .map(|p| p.id)
            .collect();
        for id in ids {
            self.repair(id);
        }
    }
}

impl Shared {
    /// Closes `peer`'s set (already killed) when no caller gives a deadline (a set a
    /// repair replaced, or built in vain): waits up to `connect_timeout` for its QPs'
    /// flushes, then up to `connect_timeout` again to tell its target.
    fn close_unwaited(&self, peer: &Peer) {
        path::retire(peer, Instant::now() + self.config.connect_timeout);
        self.release(peer, Deadline::after(self.config.connect_timeout));
    }
}

/// The repair thread: rebuilds, in the background, the paths of degraded peers (one of
/// whose paths failed, or whose set lacks a port that came back; see
/// [`Shared::degraded`]). The new set replaces the old under the same peer id; the old
/// set is retired, and what it held moves to the new paths. While a rebuild fails it is
/// tried again, waiting longer each time (up to 5 s); a peer with no healthy path
/// meanwhile fails its batches with `PeerUnreachable`.
pub(crate) fn repair_loop(shared: &Weak<Shared>) {
    let mut backoff: HashMap<PeerId, (Duration, Instant)> = HashMap::new();
    loop {
        let Some(s) = shared.upgrade() else { return };
        let id = {
            let mut q = s.repairs.lock();
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
                // Queued peers wait out their back-off; with none queued, only a
                // `repair` or the backend closing wakes this thread.
                let next = q
                    .iter()
                    .filter_map(|id| backoff.get(id))
                    .map(|(_, at)| *at)
                    .min();
                q = match next {
                    Some(at) => {
                        let wait = at
                            .saturating_duration_since(now)
                            .max(Duration::from_millis(1));
                        s.repair_wake.wait_timeout(q, wait).0
                    }
                    None => s.repair_wake.wait(q),
                };
            }
        };
        let Some(old) = s.peer(id) else {
            backoff.remove(&id);
            continue;
        };
        if old.dead.load(Ordering::Acquire) || !s.degraded(&old) {
            backoff.remove(&id);
            continue;
        }
        // Nobody waits for a repair: it is bounded by `connect_timeout` alone.
        let bound = Deadline::after(s.config.connect_timeout);
        match s.establish(&old.endpoint, &old.address, id, bound) {
            Ok(new) if s.closed.load(Ordering::Acquire) => {
                new.kill("the rdma backend is closing".into());
                s.close_unwaited(&new);
                return;
            }
            Ok(new) => {
                backoff.remove(&id);
                let regions = old.regions.read().clone();
                *new.regions.write() = regions;
                // Put back only in place of the set it rebuilt: a disconnect (or a
                // connect that replaced it) while it was built wins.
                let put = {
                    let mut peers = s.peers.write();
                    match peers.get(&id) {
                        Some(p) if Arc::ptr_eq(p, &old) => {
                            peers.insert(id, new.clone());
                            true
                        }
                        _ => false,
                    }
                };
                if !put {
                    new.kill("its peer was disconnected while its paths were rebuilt".into());
                    s.close_unwaited(&new);
                    continue;
                }
                tracing::info!(peer = %old.address, "RDMA paths rebuilt");
                // The old set's work moves to the new set; it is not dead.
                *old.why.lock() = "replaced by rebuilt paths".into();
                path::retire(&old, Instant::now() + s.config.connect_timeout);
                old.dead.store(true, Ordering::Release);
                s.release(&old, Deadline::after(s.config.connect_timeout));
            }
            Err(e) => {
                let wait = backoff
                    .get(&id)
                    .map_or(Duration::from_millis(50), |(d, _)| {
                        (*d * 2).min(Duration::from_secs(5))
                    });
                tracing::warn!(peer = %old.address, error = %e, retry_in = ?wait, "cannot rebuild RDMA paths");
                if old.healthy().is_empty() {
                    *old.why.lock() =
                        format!("every QP to the peer failed, and rebuilding them failed: {e}");
                }
                backoff.insert(id, (wait, Instant::now() + wait));
                s.repair(id);
            }
        }
    }
}

/// The target's side of the exchange, served on the engine's control plane: the
/// requests of authenticated peers, within their deadline.
pub(crate) struct Target(pub(crate) Weak<Shared>);

impl MessageHandler for Target {
    fn handle(&self, from: &PeerInfo, request: &[u8], deadline: Deadline) -> Result<Vec<u8>> {
        let shared = self
            .0
            .upgrade()
            .filter(|s| !s.closed.load(Ordering::Acquire))
            .ok_or_else(|| Error::new(ErrorKind::Unavailable, "the rdma backend is closing"))?;
        let message = exchange::decode(request).map_err(|e| {
            tracing::warn!(peer = %from.address, name = %from.name, error = %e, "refused a malformed rdma request");
            e
        })?;
        let (initiator, target) = match &message {
            Message::Request {
                initiator, target, ..
            }
            | Message::Release {
                initiator, target, ..
            } => (*initiator, *target),
            Message::Accept { .. } => {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    "an rdma accept is an answer, not a request",
                ))
            }
        };
        if initiator != from.epoch {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                format!(
                    "the request names initiator instance {initiator:#x}, but the peer authenticated as epoch {:#x}: an rdma backend names itself with its engine's epoch",
                    from.epoch
                ),
            ));
        }
        if target != shared.instance {
            return Err(Error::new(
                ErrorKind::PeerRestarted,
                format!(
                    "the request names instance {target:#x}, this is {:#x}: the descriptor is stale (the target restarted); connect again",
                    shared.instance
                ),
            ));
        }
        match message {
            Message::Request { set, paths, .. } => {
                let (answer, held) = build(&shared, &paths, deadline)?;
                shared.hold(from, set, held);
                Ok(exchange::encode(&Message::Accept { paths: answer }))
            }
            Message::Release { set, .. } => {
                let gone = shared.served.lock().release((&from.name, from.epoch), set);
                // The QPs are destroyed outside the table's lock.
                drop(gone);
                Ok(Vec::new())
            }
            Message::Accept { .. } => unreachable!("refused above"),
        }
    }

    /// The initiator engine `name` left or restarted: the sets its life `epoch` made
    /// go now, rather than when `max_served_qps` pushes them out.
    fn peer_gone(&self, name: &str, epoch: u64) {
        let Some(shared) = self.0.upgrade() else {
            return;
        };
        let gone = shared.served.lock().forget((name, epoch));
        if !gone.is_empty() {
            tracing::info!(peer = %name, epoch, sets = gone.len(), "an rdma initiator's engine left or restarted; the QPs it held here are destroyed");
        }
        // The QPs are destroyed outside the table's lock.
        drop(gone);
    }
}

impl Shared {
    /// Keeps `paths` as set `set` of the initiator `from` (see [`Served::hold`]).
    fn hold(&self, from: &PeerInfo, set: u64, paths: Vec<Arc<Path>>) {
        let gone = self.served.lock().hold(
            (&from.name, from.epoch),
            set,
            paths,
            self.config.max_served_qps,
        );
        // The QPs are destroyed outside the table's lock.
        drop(gone);
    }
}

/// Builds and brings to RTS a QP per requested path (within the cap), returning the
/// answer's paths and the QPs.
fn build(
    shared: &Arc<Shared>,
    asked: &[exchange::PathInfo],
    deadline: Deadline,
) -> Result<(Vec<exchange::PathInfo>, Vec<Arc<Path>>)> {
    if let Some(p) = asked
        .iter()
        .find(|p| p.local_device as usize >= crate::endpoint::MAX_DEVICES)
    {
        return Err(Error::new(
            ErrorKind::InvalidRequest,
            format!(
                "the request names initiator device {}; an rdma endpoint has at most {} devices",
                p.local_device,
                crate::endpoint::MAX_DEVICES
            ),
        ));
    }
    let theirs: HashSet<u8> = asked.iter().map(|p| p.local_device).collect();
    let pairs = shared.devices.len().max(theirs.len());
    let cap = shared.config.qps_per_path * pairs;
    if asked.len() > cap {
        return Err(Error::new(
            ErrorKind::InvalidRequest,
            format!(
                "the request asks for {} QPs; this side builds at most {cap} per connection (qps_per_path = {} × {pairs} device pairs): make qps_per_path the same on both sides",
                asked.len(),
                shared.config.qps_per_path,
            ),
        ));
    }
    let mut held = Vec::new();
    let mut answer = Vec::new();
    for p in asked {
        if deadline.is_past() {
            return Err(Error::new(
                ErrorKind::Timeout,
                "the initiator's deadline passed while its QPs were being built",
            ));
        }
        let Some(dev) = shared.devices.get(p.remote_device as usize) else {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                format!(
                    "the request names device {}; this side has {}",
                    p.remote_device,
                    shared.devices.len()
                ),
            ));
        };
        let Some((sgid, _)) = dev
            .gid(p.gid_type)
            .filter(|_| dev.link_layer == p.link_layer)
        else {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "device {} has no {:?} GID on the initiator's link layer",
                    dev.name, p.gid_type
                ),
            ));
        };
        let (path, psn) = shared.new_path(
            dev,
            p.local_device as usize,
            p.gid_type,
            (Weak::new(), PeerId(0)),
            1,
            false,
        )?;
        path.qp
            .modify(qp::rtr(&dev.params, p, sgid), "RTR")
            .and_then(|()| {
                path.qp
                    .modify(qp::rts(&dev.params, psn, p.rd_atomic), "RTS")
            })?;
        answer.push(dev.path_info(p.local_device as usize, path.qp.qpn(), psn, p.gid_type));
        held.push(path);
    }
    Ok((answer, held))
}
