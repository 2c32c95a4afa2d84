//! The data path: a peer's paths (one RC QP each), the slices (jobs) they carry,
//! posting, settling completions, retrying on another path, and retiring a peer's QPs.
//!
//! Every slice is accounted for exactly once, and its batch completes only when all of
//! its slices are (module `completion`). A slice that failed with a transport or flush error
//! is posted again on another healthy path of the peer; any other error (remote access,
//! local protection, invalid request) fails its batch and touches no other path.
//!
//! **Attempts and moves.** A slice may fail over `2 × paths` times; then its batch fails
//! with `PeerUnreachable`. A slice handed back only because its path's set was retired
//! while that path was healthy (a rebuild replaced the set after another path failed) did
//! not fail: it moves to the peer's current paths without spending an attempt, so a batch
//! outlives repeated rebuilds while ports flap, as long as a healthy path is left each
//! time. Moves have a bound of their own, [`MAX_MOVES`], so that a slice cannot be
//! passed from set to set for ever.
//!
//! **Where abort hooks in.** The backend's `abort` stops a batch through
//! [`BatchState::abort`] (`track`) and takes its waiting slices off the peer's paths
//! ([`drop_stopped`]; [`pump`] would not post them either), each accounted as it is
//! dropped; the ones posted complete as the NIC completes them, and the batch's
//! completion runs when the last is accounted for.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;
use te_core::sync::{Condvar, Mutex};

use te_core::{Error, ErrorKind, Op, PeerId};

use crate::completion::{self, BatchState, Outcome, SendQueue};
use crate::context::{Cq, Qp};
use crate::device::Device;
use crate::exchange::GidType;
use crate::ffi;
use crate::peers::Peer;
use crate::qp;
use crate::regions::{Pin, RemoteRegion};
use crate::state::Shared;
use crate::verbs;
use crate::wr::{WorkItem, WrChain};

/// One slice on its way.
pub(crate) struct Job {
    pub(crate) batch: Arc<BatchState>,
    pub(crate) op: Op,
    pub(crate) local: Pin,
    pub(crate) local_addr: u64,
    pub(crate) remote: Arc<RemoteRegion>,
    pub(crate) remote_addr: u64,
    pub(crate) len: u32,
    /// Times it failed on a path and was posted again (bounded by `2 × paths`).
    pub(crate) attempts: usize,
    /// Times it moved because its healthy path's set was retired (bounded by
    /// [`MAX_MOVES`]).
    pub(crate) moves: usize,
}

/// The most times one slice moves to a rebuilt set of paths because the set it was on
/// was retired while its path was healthy. Each move takes a rebuild (a connect exchange
/// after a path failed), so a batch meets this only while the peer's paths fail over and
/// over; then it fails with `PeerUnreachable` rather than wait for ever.
pub(crate) const MAX_MOVES: usize = 64;

impl Job {
    /// The slice landed.
    fn landed(self) {
        self.unpin().slice_done();
    }

    /// The slice failed for good, or was never posted.
    fn failed(self, error: Error) {
        self.unpin().slice_failed(error);
    }

    /// Drops the slice's pin before it is accounted, so that whoever the batch's
    /// completion wakes finds the region unpinned (a `deregister` right after it does
    /// not wait for this thread).
    fn unpin(self) -> Arc<BatchState> {
        let Job { batch, local, .. } = self;
        drop(local);
        batch
    }
}

pub(crate) struct PathState {
    pub(crate) sq: SendQueue<Job>,
    pub(crate) waiting: VecDeque<Job>,
    chain: WrChain,
    items: Vec<WorkItem>,
    posting: Vec<Job>,
}

impl PathState {
    pub(crate) fn new(depth: usize) -> PathState {
        PathState {
            sq: SendQueue::new(depth),
            waiting: VecDeque::new(),
            chain: WrChain::default(),
            items: Vec::new(),
            posting: Vec::new(),
        }
    }
}

/// One RC QP to one peer device.
pub(crate) struct Path {
    pub(crate) tag: u64,
    pub(crate) device: Arc<Device>,
    pub(crate) remote_device: usize,
    pub(crate) gid_type: GidType,
    // Field order: the QP is destroyed before its CQ, and both before the jobs.
    pub(crate) qp: Qp,
    pub(crate) cq: Cq,
    pub(crate) state: Mutex<PathState>,
    /// Notified when the QP has nothing posted.
    pub(crate) idle: Condvar,
    /// The QP failed (or is being retired): it takes no new work.
    pub(crate) broken: AtomicBool,
    /// Its peer's path set was retired: once nothing is posted on it, it leaves its
    /// device's completion thread.
    pub(crate) retired: AtomicBool,
    /// Its set was retired while it was healthy (set under the state lock, before the
    /// QP goes to ERR): what it hands back since, flushed or never posted, did not fail
    /// and moves on without spending an attempt.
    pub(crate) replaced: AtomicBool,
    /// The peer this path belongs to (a target-side path has none).
    pub(crate) peer: Weak<Peer>,
    /// The peer's id and the backend, to find the peer's current paths after this set
    /// was replaced.
    pub(crate) peer_id: PeerId,
    pub(crate) shared: Weak<Shared>,
    pub(crate) signal_every: u32,
}

impl Path {
    /// Marks the path failed and moves its QP to ERR, so what it holds comes back as
    /// flush completions (and is retried elsewhere); the first time, asks for the
    /// peer's paths to be rebuilt.
    pub(crate) fn fail(&self, why: &str) {
        if self.broken.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::warn!(device = %self.device.name, qpn = self.qp.qpn(), reason = why, "an RDMA path failed");
        if let Err(e) = self.qp.modify(qp::error(), "ERR") {
            tracing::warn!(error = %e, "cannot move a QP to the error state");
        }
        if self.peer.strong_count() > 0 {
            if let Some(s) = self.shared.upgrade() {
                s.repair(self.peer_id);
            }
        }
    }

    /// Waits until nothing is posted on the QP, or `deadline`; true if nothing is.
    fn wait_idle(&self, deadline: Instant) -> bool {
        let mut st = self.state.lock();
        while st.sq.outstanding() > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = self.idle.wait_timeout(st, left).0;
        }
        true
    }
}

/// Why a job came back unfinished.
pub(crate) enum Failure {
    /// Another path may carry it (transport or flush error, a QP that failed before
    /// posting it).
    Retry(String),
    /// Its own error: fails its batch.
    Fatal(String, ErrorKind),
    /// Its path was healthy, but its set was retired: it moves to the peer's current
    /// paths without spending an attempt (see [`MAX_MOVES`]).
    Moved(String),
}

impl Failure {
    /// Why a job `path` hands back without landing (flushed, or never posted: its QP
    /// failed, or was retired) came back: moved if the path's set was retired while the
    /// path was healthy, else a retry.
    /// Called under the path's state lock, or by the thread that retired it, so that it
    /// sees `replaced` as `retire` set it.
    fn handed_back(path: &Path, why: String) -> Failure {
        if path.replaced.load(Ordering::Acquire) {
            Failure::Moved(why)
        } else {
            Failure::Retry(why)
        }
    }
}

/// Queues jobs on a path and posts what fits.
pub(crate) fn post(path: &Arc<Path>, jobs: impl IntoIterator<Item = Job>) {
    let mut back = Vec::new();
    {
        let mut st = path.state.lock();
        st.waiting.extend(jobs);
        pump(path, &mut st, &mut back);
    }
    for (job, why) in back {
        settle(path, job, why);
    }
}

/// Posts waiting jobs while the QP has room. A broken path hands its waiting jobs back
/// to be retried elsewhere; jobs of a stopped batch are handed back unposted.
fn pump(path: &Path, st: &mut PathState, back: &mut Vec<(Job, Failure)>) {
    if path.broken.load(Ordering::Acquire) {
        back.extend(st.waiting.drain(..).map(|j| {
            (
                j,
                Failure::handed_back(path, "its QP failed before posting it".into()),
            )
        }));
        return;
    }
    let dev = path.device.index;
    while !st.waiting.is_empty() && st.sq.room() > 0 {
        let PathState {
            sq,
            waiting,
            chain,
            items,
            posting,
        } = st;
        items.clear();
        posting.clear();
        while posting.len() < sq.room() {
            match waiting.pop_front() {
                Some(j) if j.batch.is_stopped() => back.push((
                    j,
                    Failure::Fatal("its batch stopped".into(), ErrorKind::Cancelled),
                )),
                Some(j) => posting.push(j),
                None => break,
            }
        }
        let n = posting.len();
        for (i, job) in posting.drain(..).enumerate() {
            let item = WorkItem {
                op: job.op,
                wr_id: 0,
                signaled: false,
                local_addr: job.local_addr,
                lkey: job.local.data.lkeys[dev],
                remote_addr: job.remote_addr,
                rkey: job.remote.rkeys[path.remote_device],
                len: job.len,
            };
            job.batch.posted();
            match sq.push(job, i + 1 == n, path.signal_every) {
                Ok((wr_id, signaled)) => items.push(WorkItem {
                    wr_id,
                    signaled,
                    ..item
                }),
                Err(job) => waiting.push_front(job),
            }
        }
        if items.is_empty() {
            continue;
        }
        let head = chain.build(items);
        // SAFETY: the chain names MRs pinned by the jobs now held in the send queue
        // until their completions are settled.
        let posted = unsafe { path.qp.post_send(head) };
        if let Err((rc, accepted)) = posted {
            let why = format!(
                "ibv_post_send failed: {}",
                std::io::Error::from_raw_os_error(rc)
            );
            // The work requests before the refused one are on the QP and come back as
            // completions (flushed, once the QP is in ERR); the rest never reached it.
            back.extend(
                sq.unpush(items.len() - accepted.min(items.len()))
                    .into_iter()
                    .map(|j| (j, Failure::Retry(why.clone()))),
            );
            back.extend(waiting.drain(..).map(|j| (j, Failure::Retry(why.clone()))));
            path.fail(&why);
            return;
        }
    }
}

/// Polls a path's CQ empty and settles what completed.
pub(crate) fn drain(path: &Arc<Path>, wc: &mut [verbs::ibv_wc]) {
    let v = path.device.ctx.v;
    loop {
        let n = path.cq.poll(wc);
        if n <= 0 {
            if n < 0 {
                tracing::error!(device = %path.device.name, "ibv_poll_cq failed");
            }
            return;
        }
        let mut done = Vec::new();
        let mut back = Vec::new();
        let mut failed_qp = None;
        {
            let mut st = path.state.lock();
            for c in &wc[..n as usize] {
                let ok = c.status == verbs::IBV_WC_SUCCESS;
                let text = || {
                    format!(
                        "{} (status {}, vendor error {:#x})",
                        ffi::status_text(v, c.status),
                        c.status,
                        c.vendor_err
                    )
                };
                st.sq.complete(c.wr_id, ok, |job, outcome| match outcome {
                    Outcome::Done => done.push(job),
                    Outcome::Failed => {
                        let f = if c.status == verbs::IBV_WC_WR_FLUSH_ERR {
                            // Flushed: moved on if its healthy path's set was retired.
                            Failure::handed_back(path, text())
                        } else if completion::retryable(c.status) {
                            Failure::Retry(text())
                        } else if c.status == verbs::IBV_WC_REM_ACCESS_ERR {
                            Failure::Fatal(
                                format!("{}: the peer's NIC refused the region's key, range or rights (the region was deregistered, or the descriptor is stale: fetch it again)", text()),
                                ErrorKind::NotRegistered,
                            )
                        } else {
                            Failure::Fatal(text(), ErrorKind::Backend)
                        };
                        back.push((job, f));
                    }
                });
                if !ok && failed_qp.is_none() {
                    failed_qp = Some(text());
                }
            }
            if failed_qp.is_none() {
                pump(path, &mut st, &mut back);
            }
            if st.sq.outstanding() == 0 {
                path.idle.notify_all();
                if path.retired.load(Ordering::Acquire) {
                    // Its retire gave up waiting; the last flush is in now.
                    unhook(path);
                }
            }
        }
        if let Some(why) = failed_qp {
            // The QP is in the error state after an error completion: everything else
            // it holds comes back flushed.
            path.fail(&why);
            let mut st = path.state.lock();
            pump(path, &mut st, &mut back);
        }
        for job in done {
            job.landed();
        }
        for (job, f) in back {
            settle(path, job, f);
        }
    }
}

/// Takes the slices of stopped (aborted or failed) batches that wait unposted on
/// `path` off it and accounts them, so that an aborted batch completes as soon as its
/// posted slices are back rather than when the path next has room.
pub(crate) fn drop_stopped(path: &Path) {
    let stopped: Vec<Job> = {
        let mut st = path.state.lock();
        if !st.waiting.iter().any(|j| j.batch.is_stopped()) {
            return;
        }
        let (stopped, keep): (Vec<Job>, Vec<Job>) =
            st.waiting.drain(..).partition(|j| j.batch.is_stopped());
        st.waiting = keep.into();
        stopped
    };
    // Outside the path's lock: the last slice completes the batch, whose callback is
    // the engine's.
    for job in stopped {
        job.failed(Error::new(
            ErrorKind::Cancelled,
            "its batch stopped before this slice was posted",
        ));
    }
}

/// Removes `path` from its device's completion thread.
fn unhook(path: &Path) {
    path.device.paths.write().remove(&path.tag);
}

/// A job came back from `from` without landing: retry it on another healthy path of
/// the peer (the peer's current set, if it was rebuilt), or fail its slice.
pub(crate) fn settle(from: &Path, mut job: Job, failure: Failure) {
    if job.batch.is_stopped() {
        // Its batch already failed or was aborted: only account the slice.
        job.failed(Error::new(ErrorKind::Cancelled, "its batch stopped"));
        return;
    }
    // The peer's current set of paths (this one's, or the set that replaced it) and its
    // healthy paths, taken together: a set retired while this looks would otherwise
    // show no healthy path although the set that replaced it has them.
    let found = from.shared.upgrade().and_then(|s| {
        let p = s.peer(from.peer_id).or_else(|| from.peer.upgrade())?;
        Some(s.usable(p))
    });
    let (current, healthy) = match found {
        Some((p, healthy)) => (Some(p), healthy),
        None => (from.peer.upgrade(), Vec::new()),
    };
    let moved = matches!(failure, Failure::Moved(_));
    let (why, kind) = match failure {
        Failure::Fatal(why, kind) => (why, kind),
        Failure::Retry(why) | Failure::Moved(why) => {
            // Decided on what `usable` saw: a path that failed since (its set retired,
            // the peer disconnected) hands the job back to be settled again.
            if let Some(p) = current.as_ref().filter(|_| !healthy.is_empty()) {
                // A move is no failure of the job's: it spends one of its moves, not an
                // attempt.
                let within = if moved {
                    job.moves += 1;
                    job.moves <= MAX_MOVES
                } else {
                    job.attempts += 1;
                    job.attempts <= 2 * p.paths.len()
                };
                if within {
                    let prefer: Vec<_> = healthy
                        .iter()
                        .filter(|h| {
                            job.local.data.nics.is_empty()
                                || job.local.data.nics.contains(&h.device.index)
                        })
                        .collect();
                    let pick = p.next.fetch_add(1, Ordering::Relaxed);
                    let to = if prefer.is_empty() {
                        &healthy[pick % healthy.len()]
                    } else {
                        prefer[pick % prefer.len()]
                    };
                    tracing::debug!(device = %from.device.name, reason = %why, moved, "an RDMA slice moves to another path");
                    let to = to.clone();
                    post(&to, [job]);
                    return;
                }
            }
            let why = if moved && job.moves > MAX_MOVES {
                format!("{why}; it moved {MAX_MOVES} times as the peer's paths were rebuilt")
            } else {
                why
            };
            (why, ErrorKind::PeerUnreachable)
        }
    };
    let because = match current.as_ref() {
        None => " (the peer was disconnected)".to_string(),
        Some(p) if p.dead.load(Ordering::Acquire) => format!(" ({})", p.why.lock()),
        Some(_) if healthy.is_empty() => {
            "; no healthy path to the peer is left (they are being rebuilt)".into()
        }
        Some(_) => String::new(),
    };
    let kind = if current
        .as_ref()
        .is_some_and(|p| p.dead.load(Ordering::Acquire))
    {
        ErrorKind::PeerUnreachable
    } else {
        kind
    };
    let error = Error::new(
        kind,
        format!(
            "RDMA {} of {} bytes on {} failed: {why}{because}",
            job.op, job.len, from.device.name
        ),
    );
    job.failed(error);
}

/// Retires a peer's QPs: moves each to ERR, waits (until `deadline`) for the flush
/// completions that hand back everything they held, then settles the work that was
/// never posted (failed if the peer is dead, else moved to its current paths). A path
/// leaves its completion thread only once it has drained (here, or when its last flush
/// completion comes in after `deadline`); until then what is still posted keeps its
/// region pinned and completes when the NIC flushes it. Returns whether every QP
/// drained by `deadline`.
pub(crate) fn retire(peer: &Peer, deadline: Instant) -> bool {
    let why = peer.why.lock().clone();
    for p in &peer.paths {
        {
            // Under the state lock, before the QP goes to ERR: whoever settles what the
            // path hands back from now on (its flushes, its waiting jobs) reads it there.
            let _st = p.state.lock();
            p.retired.store(true, Ordering::Release);
            if !p.broken.swap(true, Ordering::AcqRel) {
                p.replaced.store(true, Ordering::Release);
            }
        }
        if let Err(e) = p.qp.modify(qp::error(), "ERR") {
            tracing::warn!(error = %e, "cannot move a QP to the error state");
        }
    }
    let mut drained = true;
    for p in &peer.paths {
        drained &= p.wait_idle(deadline);
    }
    for p in &peer.paths {
        let jobs: Vec<Job> = p.state.lock().waiting.drain(..).collect();
        for job in jobs {
            let failure = Failure::handed_back(p, format!("its QP was retired: {why}"));
            settle(p, job, failure);
        }
    }
    for p in &peer.paths {
        // A path with work still posted leaves when its last flush comes in (`drain`).
        if p.state.lock().sq.outstanding() == 0 {
            unhook(p);
        }
    }
    if !drained {
        tracing::warn!("RDMA QPs did not flush in time; their regions stay pinned until they do");
    }
    drained
}
