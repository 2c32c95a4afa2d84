//! The completion thread: it owns every batch in flight and every batch parked until
//! its peer's connection is up, and completes each exactly once.
//!
//! With nothing in flight it sleeps on a condition variable (woken by a new batch, by
//! a connection attempt ending, or at the earliest deadline of a parked batch), so an
//! idle backend costs no wake-ups. With batches in flight it queries them, then blocks
//! in the shim's `te_flagcx_wait` until one may have finished: a fixed pause would add
//! its length to every transfer's latency. FlagCX itself offers no blocking wait, so
//! over the real shim that call returns at once and the thread polls, yielding the CPU
//! between rounds, for as long as (and only while) transfers are in flight. A
//! transfer that reported anything but "pending" is never queried again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{JoinHandle, ThreadId};
use std::time::Duration;
use te_core::kit::thread::SpawnMasked as _;
use te_core::sync::{Condvar, Mutex, MutexGuard};

use te_core::{Completion, Error, ErrorKind, Result, TransferRequest};

use crate::batch::{InFlight, Poster};
use crate::ffi;
use crate::peers::{State, Waiting};

/// The longest single wait in the shim while batches are in flight (a bound, not a
/// polling period: the wait ends as soon as a transfer finishes).
const LONGEST_WAIT: Duration = Duration::from_secs(1);

/// A batch waiting for its peer's connection, counted among the callers of its
/// peer's attempt until it is dropped.
pub(crate) struct Parked {
    pub(crate) waiting: Waiting,
    pub(crate) requests: Vec<TransferRequest>,
    pub(crate) done: Completion,
}

#[derive(Default)]
struct Queue {
    incoming: Vec<InFlight>,
    parked: Vec<Parked>,
    /// A connection attempt ended or a peer closed: look at the parked batches again.
    kicked: bool,
    /// The thread is (about to be) in `te_flagcx_wait`: wake it through the shim.
    in_shim: bool,
    stop: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    cond: Condvar,
    engine: Arc<ffi::Engine>,
    /// Rounds of the thread's loop, for tests of its idleness.
    rounds: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock()
    }

    /// Wakes the thread wherever it waits. Called with the queue changed.
    fn wake(&self, q: MutexGuard<'_, Queue>) {
        let in_shim = q.in_shim;
        drop(q);
        self.cond.notify_one();
        if in_shim {
            self.engine.wake();
        }
    }
}

/// What submitters and connect threads hand batches and news to the thread through.
#[derive(Clone)]
pub(crate) struct Handle(Arc<Shared>);

impl Handle {
    /// Hands a posted batch to the thread. After shutdown, the batch's connection is
    /// closed and the batch reports cancelled.
    pub(crate) fn add(&self, batch: InFlight) {
        let mut q = self.0.lock();
        if q.stop {
            drop(q);
            batch.cancel();
            return;
        }
        q.incoming.push(batch);
        self.0.wake(q);
    }

    /// Hands a batch over to wait for its peer's connection.
    pub(crate) fn park(&self, batch: Parked) {
        let mut q = self.0.lock();
        if q.stop {
            return;
        }
        q.parked.push(batch);
        self.0.wake(q);
    }

    /// Says a connection attempt ended or a peer closed.
    pub(crate) fn kick(&self) {
        let mut q = self.0.lock();
        q.kicked = true;
        self.0.wake(q);
    }
}

/// The completion thread.
pub(crate) struct Progress {
    handle: Handle,
    thread: Option<JoinHandle<()>>,
    thread_id: ThreadId,
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Progress")
            .field("rounds", &self.rounds())
            .finish()
    }
}

impl Progress {
    /// Starts the thread.
    pub(crate) fn start(engine: Arc<ffi::Engine>, poster: Arc<Poster>) -> Result<Progress> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                incoming: Vec::with_capacity(64),
                ..Queue::default()
            }),
            cond: Condvar::new(),
            engine,
            rounds: AtomicU64::new(0),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("te-flagcx".into())
            .spawn_masked(move || run(&s, &poster))
            .map_err(|e| {
                Error::new(ErrorKind::Io, "cannot start the FlagCX completion thread")
                    .with_source(e)
            })?;
        Ok(Progress {
            thread_id: thread.thread().id(),
            handle: Handle(shared),
            thread: Some(thread),
        })
    }

    pub(crate) fn handle(&self) -> &Handle {
        &self.handle
    }

    /// How many times the thread went round its loop.
    pub(crate) fn rounds(&self) -> u64 {
        self.handle.0.rounds.load(Ordering::Relaxed)
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        let shared = &self.handle.0;
        let (incoming, parked) = {
            let mut q = shared.lock();
            q.stop = true;
            let taken = (
                std::mem::take(&mut q.incoming),
                std::mem::take(&mut q.parked),
            );
            shared.wake(q);
            taken
        };
        // Every connection first, then the completions report their batches cancelled:
        // a batch sharing its connection with another must not report while the other
        // keeps its transfers going.
        cancel(incoming);
        drop(parked);
        if std::thread::current().id() != self.thread_id {
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }
}

fn run(shared: &Shared, poster: &Poster) {
    let mut active: Vec<InFlight> = Vec::with_capacity(64);
    let mut parked: Vec<Parked> = Vec::new();
    loop {
        shared.rounds.fetch_add(1, Ordering::Relaxed);
        // Read before querying: a transfer finishing after this makes the wait below
        // return at once.
        let seen = shared.engine.events();
        {
            let mut q = shared.lock();
            q.in_shim = false;
            if q.stop {
                drop(q);
                // Nothing of a parked batch was posted: they report cancelled at once.
                drop(parked);
                cancel(active);
                return;
            }
            let news = q.kicked || !q.incoming.is_empty() || !q.parked.is_empty();
            // `append` leaves the queue's vectors empty with their capacity kept.
            active.append(&mut q.incoming);
            parked.append(&mut q.parked);
            q.kicked = false;
            if active.is_empty() && !news {
                match earliest(&parked) {
                    None => drop(shared.cond.wait(q)),
                    Some(left) if !left.is_zero() => drop(shared.cond.wait_timeout(q, left)),
                    Some(_) => {}
                }
            }
        }
        let mut i = 0;
        while i < active.len() {
            if active[i].poll() || (active[i].end_if_expired() && active[i].poll()) {
                poster.finish(active.swap_remove(i));
            } else {
                i += 1;
            }
        }
        unpark(&mut parked, &mut active, poster);
        if active.is_empty() {
            continue;
        }
        // Woken at the earliest deadline of a parked batch or of an aborted one in
        // flight, which is then ended.
        let wait = earliest(&parked)
            .into_iter()
            .chain(active.iter().filter_map(InFlight::abort_due))
            .fold(LONGEST_WAIT, Duration::min);
        {
            let mut q = shared.lock();
            if q.stop || q.kicked || !q.incoming.is_empty() || !q.parked.is_empty() {
                continue;
            }
            q.in_shim = true;
        }
        shared.engine.wait(seen, wait);
    }
}

/// Closes the connection of every batch, then drops them: each completion reports
/// its batch cancelled only once no connection of any of them moves bytes any more.
fn cancel(batches: Vec<InFlight>) {
    for b in &batches {
        b.link.conn.close();
    }
    drop(batches);
}

/// The time left to the earliest deadline of a parked batch.
fn earliest(parked: &[Parked]) -> Option<Duration> {
    parked.iter().map(|p| p.done.remaining()).min()
}

/// Posts parked batches whose peer is connected, and fails those whose connection
/// attempt failed or whose deadline passed.
fn unpark(parked: &mut Vec<Parked>, active: &mut Vec<InFlight>, poster: &Poster) {
    let mut i = 0;
    while i < parked.len() {
        let aborted = parked[i].done.is_aborted();
        let state = parked[i].waiting.peer.state(&parked[i].requests);
        if matches!(state, State::Connecting) && !parked[i].done.remaining().is_zero() && !aborted {
            i += 1;
            continue;
        }
        let p = parked.swap_remove(i);
        if aborted {
            // Nothing of it was posted: released at once.
            p.done.complete(Err(Error::new(
                ErrorKind::Cancelled,
                "aborted while waiting for its peer's connection; nothing was posted",
            )));
            continue;
        }
        match state {
            State::Ready(link) => match poster.start(link, &p.requests, p.done) {
                Ok(b) => active.push(b),
                Err(failed) => {
                    let (e, done) = *failed;
                    done.complete(Err(e.with_operation("transfer")))
                }
            },
            State::Failed(e) => p.done.complete(Err(e.with_operation("transfer"))),
            State::Connecting => p.done.complete(Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "the FlagCX connection to {} was still being established at the batch's deadline; nothing was posted",
                    p.waiting.peer.endpoint
                ),
            )
            .with_operation("transfer"))),
        }
    }
}
