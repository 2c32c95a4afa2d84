//! Peers and their connections, established off the submit path.
//!
//! Each peer has at most one connection attempt running, on a thread of its own
//! (FlagCX's connect and handshake block): `connect` starts one and waits for it,
//! a submit that finds the connection stale starts one and parks its batch with the
//! completion thread, which posts it once the new connection is up, or fails it with
//! the attempt's error or at its deadline. Concurrent callers share the attempt, so a
//! peer never gets two connections racing each other.
//!
//! An attempt lives as long as someone waits for it, never a time of the backend's:
//! it gives up at the latest deadline among the callers (connects and parked batches)
//! that asked for it when it started. A caller that comes while it runs and would wait
//! longer asks for the next attempt, which the same thread starts only if this one
//! left no connection and a caller still waits for it, with the latest deadline among
//! those late callers. Each caller counts as waiting until it is served or leaves (its
//! deadline passed, its batch was aborted, the peer was disconnected); once no caller
//! counts on the running attempt (none waits for it, and none waiting for the next
//! would be served by it) it is cancelled at once through its shim attempt
//! ([`ffi::Attempt`]), and its thread ends or goes on to the next. The backend cancels
//! the attempts still running when it closes and joins their threads (see
//! [`Attempts`]), so none outlives it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;
use te_core::kit::thread::SpawnMasked as _;
use te_core::sync::{Condvar, Mutex, MutexGuard};

use te_core::{Error, ErrorKind, RegionId, Result, TransferRequest};

use crate::ffi;
use crate::progress::Handle;

/// The backend's connect threads, so that closing the backend can join them (after
/// cancelling their connects) and none holds the engine afterwards.
#[derive(Debug, Default)]
pub(crate) struct Attempts(Mutex<Vec<JoinHandle<()>>>);

impl Attempts {
    fn add(&self, thread: JoinHandle<()>) {
        let mut threads = self.0.lock();
        // Finished threads need no join.
        threads.retain(|t| !t.is_finished());
        threads.push(thread);
    }

    /// Joins every connect thread. Call with every peer closed and the engine's
    /// connects cancelled, so that each returns at once.
    pub(crate) fn join(&self) {
        loop {
            let threads = std::mem::take(&mut *self.0.lock());
            if threads.is_empty() {
                return;
            }
            for t in threads {
                let _ = t.join();
            }
        }
    }
}

/// A peer's regions as a connection's snapshot holds them: address and length by id.
pub(crate) type Table = Arc<HashMap<RegionId, (u64, u64)>>;

/// One shim connection and the peer regions its snapshot covers.
pub(crate) struct Link {
    pub(crate) conn: ffi::Conn,
    pub(crate) remote: Table,
    /// Set when the shim reported the snapshot stale or the connection broken: the
    /// next submit starts a new connection and parks its batch until it is up.
    pub(crate) stale: AtomicBool,
}

impl Link {
    /// Opens a connection, giving up at `until` (or once `attempt` is cancelled): a
    /// peer that does not complete the handshake by then (one that accepts and never
    /// answers, say) fails the attempt with `Timeout`.
    fn open(attempt: &ffi::Attempt, endpoint: &str, remote: Table, until: Instant) -> Result<Link> {
        let late = |why: String| {
            Error::new(
                ErrorKind::Timeout,
                format!(
                    "the FlagCX connection to {endpoint} was still being established at the deadline of every caller waiting for it, and was given up{why}"
                ),
            )
        };
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(late(String::new())
                .with_operation("connect")
                .with_context("endpoint", endpoint));
        }
        let conn = ffi::Conn::open(attempt, endpoint, left).map_err(|e| {
            // The shim gives up no sooner than `until`: a failure then is its timeout.
            if Instant::now() >= until {
                late(format!(": {e}"))
            } else {
                Error::from(e)
            }
            .with_operation("connect")
            .with_context("endpoint", endpoint)
        })?;
        Ok(Link {
            conn,
            remote,
            stale: AtomicBool::new(false),
        })
    }

    fn covers(&self, remote: &Table) -> bool {
        !self.stale.load(Ordering::Acquire) && remote.keys().all(|r| self.remote.contains_key(r))
    }
}

/// What a peer's connection is doing, under the peer's lock.
struct Slot {
    /// The connection in use, if any (it may be stale).
    link: Option<Arc<Link>>,
    /// The regions the next attempt must cover: the newest descriptor's.
    want: Table,
    /// Bumped by every request that needs an attempt of its own; `served` catches up
    /// as attempts end.
    wanted: u64,
    served: u64,
    /// The ticket of the attempt running (while `connecting`), when it gives up, and
    /// the regions it asked for.
    running: u64,
    until: Instant,
    running_want: Table,
    /// The latest deadline among the requests for the next attempt (`wanted > running`).
    next_until: Instant,
    /// Callers (connects and parked batches) waiting for the running attempt, and for
    /// the next one: those not served yet that have not left.
    waiting: usize,
    waiting_next: usize,
    /// The running attempt's shim attempt, while it connects.
    attempt: Option<Arc<ffi::Attempt>>,
    /// The running attempt was cancelled: no caller counts on it any more.
    dropped: bool,
    connecting: bool,
    /// Why the last attempt failed, until one succeeds.
    failure: Option<Error>,
    closed: bool,
}

/// Where a parked batch stands.
pub(crate) enum State {
    /// Post on this connection.
    Ready(Arc<Link>),
    /// An attempt is running.
    Connecting,
    /// No usable connection and no attempt running: fail with this.
    Failed(Error),
}

/// A connected (or connecting) peer.
pub(crate) struct PeerState {
    pub(crate) endpoint: String,
    /// The control-plane address its first descriptor came from.
    pub(crate) address: String,
    pub(crate) epoch: u64,
    engine: Arc<ffi::Engine>,
    progress: Handle,
    attempts: Arc<Attempts>,
    slot: Mutex<Slot>,
    changed: Condvar,
}

impl std::fmt::Debug for PeerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerState")
            .field("endpoint", &self.endpoint)
            .field("address", &self.address)
            .field("epoch", &self.epoch)
            .finish()
    }
}

impl PeerState {
    pub(crate) fn new(
        endpoint: &str,
        address: &str,
        epoch: u64,
        engine: Arc<ffi::Engine>,
        progress: Handle,
        attempts: Arc<Attempts>,
    ) -> PeerState {
        PeerState {
            endpoint: endpoint.to_string(),
            address: address.to_string(),
            epoch,
            engine,
            progress,
            attempts,
            slot: Mutex::new(Slot {
                link: None,
                want: Arc::default(),
                wanted: 0,
                served: 0,
                running: 0,
                until: Instant::now(),
                running_want: Arc::default(),
                next_until: Instant::now(),
                waiting: 0,
                waiting_next: 0,
                attempt: None,
                dropped: false,
                connecting: false,
                failure: None,
                closed: false,
            }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Slot> {
        self.slot.lock()
    }

    /// Makes sure a connection covering `remote` exists, starting an attempt if none
    /// does, and waits for it until `deadline`, which the attempt lives to (at least).
    ///
    /// # Errors
    /// `PeerUnreachable` once the peer was disconnected; the attempt's error
    /// (`PeerUnreachable`, `Timeout`, …); `Timeout` if no connection was up by
    /// `deadline` (an attempt goes on only for callers that wait longer).
    pub(crate) fn ensure(self: &Arc<Self>, remote: Table, deadline: Instant) -> Result<()> {
        let mut slot = self.lock();
        if slot.link.as_ref().is_some_and(|l| l.covers(&remote)) {
            return Ok(());
        }
        let join = slot.connecting && covers(&slot.want, &remote);
        if !join {
            slot.want = remote.clone();
        }
        let ticket = self.request(&mut slot, deadline, join);
        loop {
            if slot.closed {
                leave(&mut slot, ticket);
                return Err(disconnected(&self.endpoint));
            }
            if slot.served >= ticket {
                break;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                leave(&mut slot, ticket);
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "the FlagCX connection to {} was not up by the deadline (is its FlagCX endpoint reachable? a slow peer needs a later deadline)",
                        self.endpoint
                    ),
                ));
            }
            slot = self.changed.wait_timeout(slot, left).0;
        }
        match &slot.link {
            Some(l) if l.covers(&remote) => Ok(()),
            _ => Err(slot.failure.clone().unwrap_or_else(|| {
                Error::new(
                    ErrorKind::PeerUnreachable,
                    format!(
                        "the FlagCX connection to {} does not cover the peer's regions",
                        self.endpoint
                    ),
                )
            })),
        }
    }

    /// The connection to post `batch` on, or, if none usable covers its peer regions
    /// now, the batch's place among the callers waiting for an attempt living at least
    /// until `deadline` (the batch's), which is running or asked for: the caller parks
    /// the batch with it.
    ///
    /// # Errors
    /// `PeerUnreachable` once the peer was disconnected; `NotRegistered` for a peer
    /// region no descriptor passed to `connect` listed.
    pub(crate) fn usable(
        self: &Arc<Self>,
        batch: &[TransferRequest],
        deadline: Instant,
    ) -> Result<Usable> {
        let mut slot = self.lock();
        if slot.closed {
            return Err(disconnected(&self.endpoint));
        }
        if let Some(l) = &slot.link {
            if !l.stale.load(Ordering::Acquire)
                && batch.iter().all(|r| l.remote.contains_key(&r.remote))
            {
                return Ok(Usable::Post(l.clone()));
            }
        }
        if let Some((i, r)) = batch
            .iter()
            .enumerate()
            .find(|(_, r)| !slot.want.contains_key(&r.remote))
        {
            return Err(Error::new(
                ErrorKind::NotRegistered,
                format!(
                    "the peer's region {} is not in its descriptor as the FlagCX backend knows it (connect again)",
                    r.remote
                ),
            )
            .with_context("request", i));
        }
        // The newest descriptor covers the batch, and so does any attempt for it.
        let ticket = self.request(&mut slot, deadline, true);
        Ok(Usable::Wait(Waiting {
            peer: self.clone(),
            ticket,
        }))
    }

    /// What a batch parked on this peer should do now.
    pub(crate) fn state(&self, batch: &[TransferRequest]) -> State {
        let slot = self.lock();
        if slot.closed {
            return State::Failed(disconnected(&self.endpoint));
        }
        match &slot.link {
            Some(l)
                if !l.stale.load(Ordering::Acquire)
                    && batch.iter().all(|r| l.remote.contains_key(&r.remote)) =>
            {
                State::Ready(l.clone())
            }
            _ if slot.connecting => State::Connecting,
            _ => State::Failed(slot.failure.clone().unwrap_or_else(|| {
                Error::new(
                    ErrorKind::PeerUnreachable,
                    format!(
                        "no FlagCX connection to {} covers the batch's regions, and renewing it failed",
                        self.endpoint
                    ),
                )
            })),
        }
    }

    /// True if the peer has no connection and no attempt runs, or is asked for, for a
    /// caller still waiting (a first connect that failed, or whose callers all gave up).
    pub(crate) fn abandoned(&self) -> bool {
        let slot = self.lock();
        let waited_for = slot.connecting && slot.waiting + slot.waiting_next > 0;
        slot.link.is_none() && !waited_for
    }

    /// Forgets the connection and cancels the attempt running; batches parked on the
    /// peer fail, those in flight finish.
    pub(crate) fn close(&self) {
        let link = {
            let mut slot = self.lock();
            slot.closed = true;
            drop_attempt(&mut slot);
            slot.link.take()
        };
        self.changed.notify_all();
        self.progress.kick();
        drop(link);
    }

    /// Asks for an attempt that lives at least until `deadline`: the one running if
    /// it covers `slot.want` (`join`), gives up no sooner and was not cancelled, else
    /// the next one (which the thread runs if the one running leaves no connection
    /// covering `slot.want`). Starts the thread if none runs. Returns the ticket whose
    /// service means the request was seen; the caller waits until then, or calls
    /// [`leave`] with it.
    fn request(self: &Arc<Self>, slot: &mut Slot, deadline: Instant, join: bool) -> u64 {
        if slot.connecting {
            if slot.wanted > slot.running {
                slot.next_until = slot.next_until.max(deadline);
            } else if !join || slot.dropped || deadline > slot.until {
                slot.wanted += 1;
                slot.next_until = deadline;
            }
            if slot.wanted > slot.running {
                slot.waiting_next += 1;
            } else {
                slot.waiting += 1;
            }
            // A newer descriptor may leave the running attempt of use to no one.
            drop_if_unwanted(slot);
            return slot.wanted;
        }
        slot.wanted += 1;
        slot.running = slot.wanted;
        slot.until = deadline;
        slot.running_want = slot.want.clone();
        slot.waiting = 1;
        slot.waiting_next = 0;
        slot.dropped = false;
        slot.connecting = true;
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name("te-flagcx-connect".into())
            .spawn_masked(move || me.attempts());
        match spawned {
            Ok(thread) => self.attempts.add(thread),
            Err(e) => {
                slot.connecting = false;
                slot.served = slot.wanted;
                slot.waiting = 0;
                slot.failure = Some(
                    Error::new(ErrorKind::Io, "cannot start a FlagCX connect thread")
                        .with_source(e),
                );
            }
        }
        slot.wanted
    }

    /// Runs attempts until every request made so far is served: another one only
    /// while the last left no connection covering the newest descriptor and a caller
    /// still waits for it.
    fn attempts(self: Arc<Self>) {
        loop {
            // Made without the peer's lock: it is a call into the shim, which may take
            // its time, and callers come and leave (cancelling it) meanwhile.
            let attempt = ffi::Attempt::new(self.engine.clone())
                .map(Arc::new)
                .map_err(|e| {
                    Error::from(e)
                        .with_operation("connect")
                        .with_context("endpoint", &self.endpoint)
                });
            let (want, ticket, until, attempt) = {
                let mut slot = self.lock();
                // Cancelled while it was made: it fails at once.
                if let Ok(a) = &attempt {
                    if slot.dropped {
                        a.cancel();
                    }
                    slot.attempt = Some(a.clone());
                }
                (slot.running_want.clone(), slot.running, slot.until, attempt)
            };
            let opened = match &attempt {
                Ok(a) => Link::open(a, &self.endpoint, want, until),
                Err(e) => Err(e.clone()),
            };
            let mut slot = self.lock();
            // Dropped below, outside the lock, once no cancel can reach it.
            let attempt = (attempt, slot.attempt.take());
            let old = match opened {
                Ok(fresh) if slot.closed => Some(Arc::new(fresh)),
                Ok(fresh) => {
                    tracing::debug!(endpoint = %self.endpoint, "FlagCX connection established");
                    slot.failure = None;
                    slot.link.replace(Arc::new(fresh))
                }
                Err(e) => {
                    tracing::debug!(endpoint = %self.endpoint, error = %e, "FlagCX connect failed");
                    slot.failure = Some(if slot.dropped {
                        Error::new(
                            ErrorKind::Cancelled,
                            format!(
                                "the FlagCX connection attempt to {} was given up once no caller waited for it any more",
                                self.endpoint
                            ),
                        )
                        .with_operation("connect")
                    } else {
                        e
                    });
                    if slot
                        .link
                        .as_ref()
                        .is_some_and(|l| l.stale.load(Ordering::Acquire))
                    {
                        slot.link.take()
                    } else {
                        None
                    }
                }
            };
            let again = slot.wanted > ticket
                && slot.waiting_next > 0
                && !slot.closed
                && !slot.link.as_ref().is_some_and(|l| l.covers(&slot.want));
            if again {
                slot.served = ticket;
                slot.running = slot.wanted;
                slot.until = slot.next_until;
                slot.running_want = slot.want.clone();
                slot.waiting = std::mem::take(&mut slot.waiting_next);
                slot.dropped = false;
            } else {
                slot.served = slot.wanted;
                slot.waiting = 0;
                slot.waiting_next = 0;
            }
            slot.connecting = again;
            drop(slot);
            self.changed.notify_all();
            self.progress.kick();
            // Outside the lock: closing a connection waits for its threads.
            drop(old);
            drop(attempt);
            if !again {
                return;
            }
        }
    }
}

/// What a submit does with a batch: post it on this connection, or park it with its
/// place among the callers waiting for an attempt.
pub(crate) enum Usable {
    Post(Arc<Link>),
    Wait(Waiting),
}

/// A parked batch's place among the callers waiting for its peer's attempt: dropped
/// when the batch leaves the parking (posted, failed, aborted, past its deadline, or
/// the backend closing), so the attempt is cancelled once no one counts on it.
pub(crate) struct Waiting {
    pub(crate) peer: Arc<PeerState>,
    ticket: u64,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        leave(&mut self.peer.lock(), self.ticket);
    }
}

/// A caller with `ticket` stops waiting (it may have been served): the attempt it
/// waited for is cancelled if no one else counts on it.
fn leave(slot: &mut Slot, ticket: u64) {
    if slot.served >= ticket {
        return;
    }
    if ticket > slot.running {
        slot.waiting_next = slot.waiting_next.saturating_sub(1);
    } else {
        slot.waiting = slot.waiting.saturating_sub(1);
    }
    drop_if_unwanted(slot);
}

/// Cancels the running attempt once no caller counts on it: none waits for it, and
/// those waiting for the next one would not be served by it (it does not cover the
/// newest descriptor), or there are none.
fn drop_if_unwanted(slot: &mut Slot) {
    if slot.waiting == 0 && (slot.waiting_next == 0 || !covers(&slot.running_want, &slot.want)) {
        drop_attempt(slot);
    }
}

/// Cancels the running attempt, if any: its connect returns at once, and its thread
/// goes on to the next attempt only if someone waits for that.
fn drop_attempt(slot: &mut Slot) {
    if slot.connecting && !slot.dropped {
        slot.dropped = true;
        if let Some(a) = &slot.attempt {
            a.cancel();
        }
    }
}

fn covers(table: &Table, remote: &Table) -> bool {
    remote.keys().all(|r| table.contains_key(r))
}

fn disconnected(endpoint: &str) -> Error {
    Error::new(
        ErrorKind::PeerUnreachable,
        format!("the FlagCX backend was disconnected from {endpoint}; connect again"),
    )
}
