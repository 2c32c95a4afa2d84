//! A batch split into slices completes once: when its last slice is accounted for,
//! with its first error.
//!
//! A backend that splits a batch over connections, paths or work requests counts the
//! slices out with a [`Countdown`]: each slice's end (landed, failed, dropped unsent)
//! is one [`Countdown::finish`], and the last one completes the batch, so a batch never
//! completes while one of its slices may still move bytes. What the batch holds for
//! its slices (`H`: pins on its regions) is dropped just before the completion.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::backend::{BatchId, BatchStage, Completion};
use crate::error::{Error, Result};
use crate::sync::Mutex;

/// A batch's slices still out, its first error and its completion.
#[derive(Debug)]
pub struct Countdown<H = ()> {
    id: BatchId,
    remaining: AtomicUsize,
    error: Mutex<Option<Error>>,
    done: Mutex<Option<(Completion, H)>>,
}

impl<H> Countdown<H> {
    /// A batch of `slices` slices (not zero) that completes `done`, holding `held`
    /// until then.
    pub fn new(slices: usize, done: Completion, held: H) -> Countdown<H> {
        Countdown {
            id: done.batch(),
            remaining: AtomicUsize::new(slices),
            error: Mutex::new(None),
            done: Mutex::new(Some((done, held))),
        }
    }

    /// The engine's id of the batch.
    pub fn batch(&self) -> BatchId {
        self.id
    }

    /// Records `error` as the batch's, if it is the first; accounts no slice.
    pub fn fail(&self, error: Error) {
        let mut first = self.error.lock();
        if first.is_none() {
            *first = Some(error);
        }
    }

    /// The batch's first error so far.
    pub fn error(&self) -> Option<Error> {
        self.error.lock().clone()
    }

    /// Accounts one slice, which ended with `result`; the last one completes the batch.
    /// Returns whether it was the last.
    pub fn finish(&self, result: Result<()>) -> bool {
        self.finish_then(result, || ())
    }

    /// As [`Countdown::finish`], running `last` before the completion when this was the
    /// last slice (to take the batch out of a table that finds it, say).
    pub fn finish_then(&self, result: Result<()>, last: impl FnOnce()) -> bool {
        if let Err(e) = result {
            self.fail(e);
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) != 1 {
            return false;
        }
        last();
        // Each lock is let go before the completion runs the engine's callbacks (wakers,
        // C callbacks), which may take their time while another thread of the backend
        // records an error here.
        let taken = self.done.lock().take();
        if let Some((done, held)) = taken {
            drop(held);
            let error = self.error.lock().take();
            done.complete(error.map_or(Ok(()), Err));
        }
        true
    }

    /// Whether every slice has been accounted for (the batch is completed, or about to
    /// be).
    pub fn is_finished(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
    }

    /// Slices not yet accounted for.
    pub fn remaining(&self) -> usize {
        self.remaining.load(Ordering::Acquire)
    }

    /// Whether the engine asked for the batch to be aborted (deadline, cancel,
    /// deregistration); false once it completed.
    pub fn abort_requested(&self) -> bool {
        self.done.lock().as_ref().is_some_and(|d| d.0.is_aborted())
    }

    /// Whether the batch is over for its slices: completed, or aborted by the engine.
    pub fn is_over(&self) -> bool {
        self.done.lock().as_ref().is_none_or(|d| d.0.is_aborted())
    }

    /// Notes that `stage` of the batch began now (see [`Completion::stage_began`]);
    /// nothing once it completed.
    pub fn stage_began(&self, stage: BatchStage) {
        if let Some(d) = self.done.lock().as_ref() {
            d.0.stage_began(stage);
        }
    }

    /// Notes that `stage` of the batch ended now (see [`Completion::stage_ended`]).
    pub fn stage_ended(&self, stage: BatchStage) {
        if let Some(d) = self.done.lock().as_ref() {
            d.0.stage_ended(stage);
        }
    }

    /// What the batch holds, for a slice that must hold it longer than the batch may
    /// live (a device copy that cannot be stopped); `None` once it completed.
    pub fn held(&self) -> Option<H>
    where
        H: Clone,
    {
        self.done.lock().as_ref().map(|d| d.1.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use std::sync::mpsc;
    use std::time::Duration;

    fn completion() -> (Completion, mpsc::Receiver<Result<()>>) {
        let (tx, rx) = mpsc::channel();
        let done = Completion::new(Duration::from_secs(9), move |r, _| {
            let _ = tx.send(r);
        });
        (done, rx)
    }

    #[test]
    fn the_last_slice_completes_the_batch_with_the_first_error() {
        let (done, result) = completion();
        let c = Countdown::new(3, done, ());
        assert!(!c.finish(Ok(())));
        assert!(!c.finish(Err(Error::new(ErrorKind::Io, "first"))));
        assert!(
            result.try_recv().is_err(),
            "completed before its last slice"
        );
        let mut ran = false;
        assert!(
            c.finish_then(Err(Error::new(ErrorKind::Protocol, "second")), || ran =
                true)
        );
        assert!(ran);
        let e = result.recv().unwrap().unwrap_err();
        assert_eq!(e.message(), "first");
        assert!(c.is_finished() && c.is_over() && c.held().is_none());
    }
}
