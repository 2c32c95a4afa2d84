//! The completion thread: it owns every transfer in flight and completes each batch once
//! the shim says its transfers finished.
//!
//! While nothing is in flight it sleeps on a condition variable. While something is,
//! it queries the pending transfers, pausing between rounds for a few microseconds at
//! first and doubling up to `max_pause` while none finishes, so a long transfer costs
//! a handful of wake-ups and a short one is seen almost at once. A transfer that
//! reported anything but "pending" is never queried again.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{JoinHandle, ThreadId};
use std::time::Duration;

use te_core::{Completion, Error, ErrorKind, Result};

use crate::backend::Link;
use crate::ffi::{E_STALE, E_UNREACHABLE};

/// The first pause between two query rounds.
const MIN_PAUSE: Duration = Duration::from_micros(5);

/// One batch in flight: up to two shim transfers (its WRITEs and its READs).
pub(crate) struct InFlight {
    pub(crate) link: Arc<Link>,
    /// Transfers not yet reported finished.
    pub(crate) xfers: [Option<u64>; 2],
    /// The batch's first failure.
    pub(crate) error: Option<Error>,
    pub(crate) done: Completion,
}

impl InFlight {
    /// Queries the batch's unfinished transfers; true once all have finished.
    fn poll(&mut self) -> bool {
        let mut pending = false;
        for slot in &mut self.xfers {
            let Some(xfer) = *slot else { continue };
            match self.link.conn.query(xfer) {
                Ok(false) => pending = true,
                Ok(true) => *slot = None,
                Err(e) => {
                    *slot = None;
                    if matches!(e.code(), Some(E_STALE | E_UNREACHABLE)) {
                        self.link.renew.store(true, Ordering::Release);
                    }
                    if self.error.is_none() {
                        self.error = Some(Error::from(e).with_operation("transfer"));
                    }
                }
            }
        }
        !pending
    }

    fn finish(self) {
        let result = match self.error {
            Some(e) => Err(e),
            None => Ok(()),
        };
        self.done.complete(result);
    }
}

#[derive(Default)]
struct Queue {
    incoming: Vec<InFlight>,
    stop: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    cond: Condvar,
    max_pause: Duration,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The completion thread and its queue of newly posted batches.
pub(crate) struct Progress {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    thread_id: ThreadId,
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Progress")
            .field("max_pause", &self.shared.max_pause)
            .finish()
    }
}

impl Progress {
    /// Starts the thread.
    pub(crate) fn start(max_pause: Duration) -> Result<Progress> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                incoming: Vec::with_capacity(64),
                stop: false,
            }),
            cond: Condvar::new(),
            max_pause: max_pause.max(MIN_PAUSE),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("te-flagcx".into())
            .spawn(move || run(&s))
            .map_err(|e| {
                Error::new(ErrorKind::Io, "cannot start the FlagCX completion thread")
                    .with_source(e)
            })?;
        Ok(Progress {
            thread_id: thread.thread().id(),
            shared,
            thread: Some(thread),
        })
    }

    /// Hands a posted batch to the thread.
    pub(crate) fn add(&self, batch: InFlight) {
        let mut q = self.shared.lock();
        if q.stop {
            // Dropping the completion reports the batch cancelled; the shim's transfer
            // is abandoned with its connection.
            return;
        }
        q.incoming.push(batch);
        drop(q);
        self.shared.cond.notify_one();
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        let pending = {
            let mut q = self.shared.lock();
            q.stop = true;
            std::mem::take(&mut q.incoming)
        };
        self.shared.cond.notify_all();
        drop(pending);
        if std::thread::current().id() != self.thread_id {
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }
}

fn run(shared: &Shared) {
    let mut active: Vec<InFlight> = Vec::with_capacity(64);
    let mut pause = MIN_PAUSE;
    loop {
        {
            let mut q = shared.lock();
            loop {
                if q.stop {
                    // Completions dropped here report their batches cancelled.
                    drop(q);
                    drop(active);
                    return;
                }
                if !q.incoming.is_empty() {
                    // `append` leaves `incoming` empty with its capacity kept.
                    active.append(&mut q.incoming);
                    pause = MIN_PAUSE;
                    break;
                }
                if active.is_empty() {
                    q = shared.cond.wait(q).unwrap_or_else(|p| p.into_inner());
                } else {
                    let (guard, timeout) = shared
                        .cond
                        .wait_timeout(q, pause)
                        .unwrap_or_else(|p| p.into_inner());
                    q = guard;
                    if timeout.timed_out() {
                        break;
                    }
                }
            }
        }
        let before = active.len();
        let mut i = 0;
        while i < active.len() {
            if active[i].poll() {
                active.swap_remove(i).finish();
            } else {
                i += 1;
            }
        }
        pause = if active.len() < before {
            MIN_PAUSE
        } else {
            (pause * 2).min(shared.max_pause)
        };
    }
}
