//! How a batch completes: it counts its slices still out, keeps the first error, holds
//! the pins on its local regions, and completes exactly once, when its last slice ends
//! (answered, failed, cut at its deadline, or its device copies done); the watcher
//! (`watch`) ends the slices of batches past their deadlines.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;
use te_core::sync::Mutex;

use te_core::{Completion, Error, Result};

use crate::conn::timeout_error;
use crate::regions::Pin;

/// One batch: its completion, the pins on its local regions, and how many slices are
/// still out.
pub(crate) struct Batch {
    pub(crate) remaining: AtomicUsize,
    pub(crate) error: OnceLock<Error>,
    pub(crate) done: Mutex<Option<(Completion, Arc<Vec<Pin>>)>>,
    pub(crate) deadline: Instant,
    pub(crate) id: te_core::BatchId,
}

impl Batch {
    pub(crate) fn new(slices: usize, done: Completion, pins: Vec<Pin>) -> Batch {
        let now = Instant::now();
        let id = done.batch();
        Batch {
            id,
            remaining: AtomicUsize::new(slices),
            error: OnceLock::new(),
            // A deadline too far to represent is as good as none.
            deadline: now
                .checked_add(done.remaining())
                .unwrap_or_else(|| now + std::time::Duration::from_secs(1 << 30)),
            done: Mutex::new(Some((done, Arc::new(pins)))),
        }
    }

    /// The engine's id of the batch.
    pub(crate) fn id(&self) -> te_core::BatchId {
        self.id
    }

    /// When the batch's caller stops waiting.
    pub(crate) fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Whether every slice has ended (the batch is completed, or about to be).
    pub(crate) fn is_finished(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
    }

    /// The batch's pins, held by a device copy until it completes, so that the regions
    /// stay registered while a copy runs even if the batch has ended; `None` once the
    /// batch has ended.
    pub(crate) fn hold(&self) -> Option<Arc<Vec<Pin>>> {
        self.done.lock().as_ref().map(|d| d.1.clone())
    }

    /// Records one slice's end; the last one releases the pins, then completes.
    pub(crate) fn finish_slice(&self, result: Result<()>) {
        if let Err(e) = result {
            // Past its deadline, whatever broke, the batch ended for lack of time.
            let e = if Instant::now() >= self.deadline {
                timeout_error()
            } else {
                e
            };
            let _ = self.error.set(e);
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            let taken = self.done.lock().take();
            if let Some((done, pins)) = taken {
                drop(pins);
                done.complete(match self.error.get() {
                    Some(e) => Err(e.clone()),
                    None => Ok(()),
                });
            }
        }
    }

    /// Whether the batch is to stop: aborted by the engine (deadline, cancel,
    /// deregistration), or past its deadline. A stopped batch sends nothing more, and
    /// the data that arrives for it is discarded, never placed.
    pub(crate) fn stopped(&self) -> bool {
        Instant::now() >= self.deadline
            || self.done.lock().as_ref().is_none_or(|d| d.0.is_aborted())
    }
}
