//! Peers and their connections, established off the submit path.
//!
//! Each peer has at most one connection attempt running, on a thread of its own
//! (FlagCX's connect and handshake block): `connect` starts one and waits for it,
//! a submit that finds the connection stale starts one and parks its batch with the
//! completion thread, which posts it once the new connection is up, or fails it with
//! the attempt's error or at its deadline. Concurrent callers share the attempt, so a
//! peer never gets two connections racing each other. An attempt gives up after
//! [`ATTEMPT_LIMIT`], and the backend cancels those still running when it closes and
//! joins their threads (see [`Attempts`]), so none outlives it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use te_core::sync::{Condvar, Mutex, MutexGuard};

use te_core::{Error, ErrorKind, RegionId, Result, TransferRequest};

use crate::ffi;
use crate::progress::Handle;

/// How long one connection attempt may take, whatever the peer does: a peer that
/// accepts but never answers the handshake fails the attempt then.
pub(crate) const ATTEMPT_LIMIT: Duration = Duration::from_secs(30);

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
    fn open(engine: &Arc<ffi::Engine>, endpoint: &str, remote: Table) -> Result<Link> {
        let conn = ffi::Conn::open(engine.clone(), endpoint, ATTEMPT_LIMIT).map_err(|e| {
            Error::from(e)
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
    /// Bumped by every request for an attempt; `served` catches up as attempts end.
    wanted: u64,
    served: u64,
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
    /// does, and waits for it until `deadline`.
    ///
    /// # Errors
    /// The attempt's error (`PeerUnreachable`, …); `Timeout` if it is still running at
    /// `deadline` (it goes on, and batches park until it ends).
    pub(crate) fn ensure(self: &Arc<Self>, remote: Table, deadline: Instant) -> Result<()> {
        let mut slot = self.lock();
        if slot.link.as_ref().is_some_and(|l| l.covers(&remote)) {
            return Ok(());
        }
        let ticket = if slot.connecting && covers(&slot.want, &remote) {
            slot.wanted
        } else {
            slot.want = remote.clone();
            self.request(&mut slot)
        };
        while slot.served < ticket {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "the FlagCX connection to {} was not up by the deadline; it is still being established",
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

    /// The connection to post `batch` on, or `None` if none usable covers its peer
    /// regions now, in which case an attempt is running (started here if needed) and
    /// the caller parks the batch.
    ///
    /// # Errors
    /// `PeerUnreachable` once the peer was disconnected; `NotRegistered` for a peer
    /// region no descriptor passed to `connect` listed.
    pub(crate) fn usable(self: &Arc<Self>, batch: &[TransferRequest]) -> Result<Option<Arc<Link>>> {
        let mut slot = self.lock();
        if slot.closed {
            return Err(disconnected(&self.endpoint));
        }
        if let Some(l) = &slot.link {
            if !l.stale.load(Ordering::Acquire)
                && batch.iter().all(|r| l.remote.contains_key(&r.remote))
            {
                return Ok(Some(l.clone()));
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
        if !slot.connecting {
            self.request(&mut slot);
        }
        Ok(None)
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

    /// True if no connection was ever established and no attempt is running (a first
    /// connect that failed).
    pub(crate) fn never_connected(&self) -> bool {
        let slot = self.lock();
        slot.link.is_none() && !slot.connecting
    }

    /// Forgets the connection; batches parked on the peer fail, those in flight finish.
    pub(crate) fn close(&self) {
        let link = {
            let mut slot = self.lock();
            slot.closed = true;
            slot.link.take()
        };
        self.changed.notify_all();
        self.progress.kick();
        drop(link);
    }

    /// Asks for an attempt; starts its thread unless one is running. Returns the
    /// ticket whose service means the request was seen.
    fn request(self: &Arc<Self>, slot: &mut Slot) -> u64 {
        slot.wanted += 1;
        if !slot.connecting {
            slot.connecting = true;
            let me = self.clone();
            let spawned = std::thread::Builder::new()
                .name("te-flagcx-connect".into())
                .spawn(move || me.attempts());
            match spawned {
                Ok(thread) => self.attempts.add(thread),
                Err(e) => {
                    slot.connecting = false;
                    slot.served = slot.wanted;
                    slot.failure = Some(
                        Error::new(ErrorKind::Io, "cannot start a FlagCX connect thread")
                            .with_source(e),
                    );
                }
            }
        }
        slot.wanted
    }

    /// Runs attempts until every request made so far is served.
    fn attempts(self: Arc<Self>) {
        loop {
            let (want, ticket) = {
                let slot = self.lock();
                (slot.want.clone(), slot.wanted)
            };
            let opened = Link::open(&self.engine, &self.endpoint, want);
            let mut slot = self.lock();
            let old = match opened {
                Ok(fresh) if slot.closed => Some(Arc::new(fresh)),
                Ok(fresh) => {
                    tracing::debug!(endpoint = %self.endpoint, "FlagCX connection established");
                    slot.failure = None;
                    slot.link.replace(Arc::new(fresh))
                }
                Err(e) => {
                    tracing::debug!(endpoint = %self.endpoint, error = %e, "FlagCX connect failed");
                    slot.failure = Some(e);
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
            slot.served = ticket;
            let again = slot.wanted > ticket && !slot.closed;
            slot.connecting = again;
            drop(slot);
            self.changed.notify_all();
            self.progress.kick();
            // Outside the lock: closing a connection waits for its threads.
            drop(old);
            if !again {
                return;
            }
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
