//! How a batch completes: the kit's [`Countdown`] over its slices, holding the pins on
//! its local regions, completing exactly once, when its last slice ends (answered,
//! failed, cut at its deadline, or its device copies done); the watcher (`watch`) ends
//! the slices of batches past their deadlines.

use std::sync::Arc;
use std::time::Instant;

use te_core::kit::Countdown;
use te_core::{BatchStage, Completion, Result};

use crate::errors::timeout_error;
use crate::regions::Pin;

/// One batch: its countdown, which holds the pins on its local regions, and its
/// deadline.
pub(crate) struct Batch {
    count: Countdown<Arc<Vec<Pin>>>,
    deadline: Instant,
}

impl Batch {
    pub(crate) fn new(slices: usize, done: Completion, pins: Vec<Pin>) -> Batch {
        let now = Instant::now();
        Batch {
            // A deadline too far to represent is as good as none.
            deadline: now
                .checked_add(done.remaining())
                .unwrap_or_else(|| now + std::time::Duration::from_secs(1 << 30)),
            count: Countdown::new(slices, done, Arc::new(pins)),
        }
    }

    /// The engine's id of the batch.
    pub(crate) fn id(&self) -> te_core::BatchId {
        self.count.batch()
    }

    /// When the batch's caller stops waiting.
    pub(crate) fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Whether every slice has ended (the batch is completed, or about to be).
    pub(crate) fn is_finished(&self) -> bool {
        self.count.is_finished()
    }

    /// The batch's pins, held by a device copy until it completes, so that the regions
    /// stay registered while a copy runs even if the batch has ended; `None` once the
    /// batch has ended.
    pub(crate) fn hold(&self) -> Option<Arc<Vec<Pin>>> {
        self.count.held()
    }

    /// Records one slice's end; the last one releases the pins, then completes.
    pub(crate) fn finish_slice(&self, result: Result<()>) {
        // Past its deadline, whatever broke, the batch ended for lack of time.
        let result = result.map_err(|e| {
            if Instant::now() >= self.deadline {
                timeout_error()
            } else {
                e
            }
        });
        self.count.finish(result);
    }

    /// Notes that `stage` began now for this batch (its first note counts).
    pub(crate) fn stage_began(&self, stage: BatchStage) {
        self.count.stage_began(stage);
    }

    /// Notes that `stage` ended now for this batch (its last note counts).
    pub(crate) fn stage_ended(&self, stage: BatchStage) {
        self.count.stage_ended(stage);
    }

    /// Whether the batch is to stop: aborted by the engine (deadline, cancel,
    /// deregistration), or past its deadline. A stopped batch sends nothing more, and
    /// the data that arrives for it is discarded, never placed.
    pub(crate) fn stopped(&self) -> bool {
        Instant::now() >= self.deadline || self.count.is_over()
    }
}
