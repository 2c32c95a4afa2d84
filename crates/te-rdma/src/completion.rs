//! Completion bookkeeping, free of verbs so it is tested without a NIC.
//!
//! - [`BatchState`] counts a batch's slices; its [`Completion`] is completed exactly
//!   once, when **every** slice is accounted for (landed, failed, or never posted
//!   because the batch had already failed or was aborted): `Ok` if all landed, else the
//!   first failure's error. A batch never completes while one of its work requests may
//!   still move bytes.
//! - [`SendQueue`] is one QP's work requests in posting order. A reliable connection
//!   completes work requests in order, so a signalled completion for work request `n`
//!   also completes every unsignalled one posted before it; an error completion fails
//!   `n` (earlier ones completed successfully before it); a QP in the error state
//!   hands back whatever it still holds as flush completions, one per work request.
//! - [`InFlight`] finds a batch by the engine's id when the engine aborts it.
//! - [`retryable`] says which completion errors another path may cure.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use te_core::sync::Mutex;

use te_core::kit::Countdown;
use te_core::{BatchId, BatchStage, Completion, Error, Result};

use crate::verbs;

/// One batch in flight: the kit's [`Countdown`] over its slices, whether it stopped,
/// and the table that finds it by the engine's id.
#[derive(Debug)]
pub(crate) struct BatchState {
    count: Countdown,
    /// A slice failed or the batch was aborted: post none of its slices any more.
    stopped: AtomicBool,
    table: Weak<InFlight>,
}

impl BatchState {
    /// A batch of `slices` slices, in no table; `slices` must not be zero.
    #[cfg(test)]
    pub(crate) fn new(slices: usize, done: Completion) -> BatchState {
        BatchState::in_table(slices, done, Weak::new())
    }

    fn in_table(slices: usize, done: Completion, table: Weak<InFlight>) -> BatchState {
        BatchState {
            count: Countdown::new(slices, done, ()),
            stopped: AtomicBool::new(false),
            table,
        }
    }

    /// Accounts one slice; the last one takes the batch out of its table and completes
    /// it.
    fn account(&self) {
        self.count.finish_then(Ok(()), || {
            if let Some(table) = self.table.upgrade() {
                table.remove(self.count.batch(), self);
            }
        });
    }

    /// Records `error` as the batch's if it is the first, and stops the batch.
    fn stop(&self, error: Error) {
        self.count.fail(error);
        self.stopped.store(true, Ordering::Release);
    }

    /// One of its slices is on a QP now: the batch's wire stage has begun.
    pub(crate) fn posted(&self) {
        self.count.stage_began(BatchStage::Wire);
    }

    /// One slice landed.
    pub(crate) fn slice_done(&self) {
        self.count.stage_ended(BatchStage::Wire);
        self.account();
    }

    /// One slice failed for good (no other path to retry on, or an error no other path
    /// cures). The batch stops posting; it completes, with the first error, when its
    /// last slice is accounted for.
    pub(crate) fn slice_failed(&self, error: Error) {
        self.stop(error);
        self.account();
    }

    /// Stops the batch without accounting a slice (the engine's abort: deadline,
    /// cancel, deregistration): its slices not yet posted are not posted (they are
    /// accounted as they are dropped), the ones posted complete as they will, and the
    /// batch completes with `error` once all are accounted for.
    pub(crate) fn abort(&self, error: Error) {
        self.stop(error);
    }

    /// Whether the engine asked for this batch to be aborted (its completion's flag);
    /// false once the batch completed.
    fn abort_requested(&self) -> bool {
        self.count.abort_requested()
    }

    /// Whether the batch takes no more work: a slice failed, or it was aborted.
    pub(crate) fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// Slices not yet accounted for.
    #[cfg(test)]
    pub(crate) fn remaining(&self) -> usize {
        self.count.remaining()
    }
}

/// The batches in flight by the engine's batch id, held weakly (a batch lives as long
/// as its slices), so that the engine's abort reaches the batch it names.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    batches: Mutex<HashMap<BatchId, Vec<Weak<BatchState>>>>,
}

impl InFlight {
    /// A batch of `slices` slices (not zero) that completes `done`, in this table until
    /// it completes.
    pub(crate) fn start(self: &Arc<Self>, slices: usize, done: Completion) -> Arc<BatchState> {
        let id = done.batch();
        let state = Arc::new(BatchState::in_table(slices, done, Arc::downgrade(self)));
        self.batches
            .lock()
            .entry(id)
            .or_default()
            .push(Arc::downgrade(&state));
        state
    }

    /// Aborts the batches of id `id` whose completion the engine flagged for abort,
    /// with `error`, and returns them. An id names one batch of an engine; completions
    /// made outside an engine all have id 0, hence the flag. Blocks on nothing but
    /// short critical sections.
    pub(crate) fn abort(&self, id: BatchId, error: impl Fn() -> Error) -> Vec<Arc<BatchState>> {
        let live: Vec<Arc<BatchState>> = self
            .batches
            .lock()
            .get(&id)
            .map(|v| v.iter().filter_map(Weak::upgrade).collect())
            .unwrap_or_default();
        let hit: Vec<_> = live.into_iter().filter(|b| b.abort_requested()).collect();
        for b in &hit {
            b.abort(error());
        }
        hit
    }

    /// Forgets `state` (and whatever of `id` is gone).
    fn remove(&self, id: BatchId, state: &BatchState) {
        let mut batches = self.batches.lock();
        if let Some(v) = batches.get_mut(&id) {
            v.retain(|w| !std::ptr::eq(w.as_ptr(), state) && w.strong_count() > 0);
            if v.is_empty() {
                batches.remove(&id);
            }
        }
    }

    /// Batches in the table.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.batches.lock().values().map(Vec::len).sum()
    }
}

/// Whether a work completion error is the transport's (the path, the port, the QP
/// having been flushed), which another path may cure. Access and protection errors
/// (`REM_ACCESS`, `LOC_PROT`, `REM_INV_REQ`, …) are the request's own: another path
/// would fail the same way and break that QP too.
pub(crate) fn retryable(status: u32) -> bool {
    matches!(
        status,
        verbs::IBV_WC_RETRY_EXC_ERR
            | verbs::IBV_WC_RNR_RETRY_EXC_ERR
            | verbs::IBV_WC_WR_FLUSH_ERR
            | verbs::IBV_WC_RESP_TIMEOUT_ERR
            | verbs::IBV_WC_FATAL_ERR
            | verbs::IBV_WC_GENERAL_ERR
            | verbs::IBV_WC_BAD_RESP_ERR
            | verbs::IBV_WC_REM_ABORT_ERR
    )
}

/// What happened to one posted work request.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// It completed successfully.
    Done,
    /// It failed (its own error, or flushed because an earlier one failed).
    Failed,
}

/// One QP's posted work requests, oldest first.
#[derive(Debug)]
pub(crate) struct SendQueue<T> {
    posted: VecDeque<(u64, T)>,
    next_id: u64,
    capacity: usize,
    since_signal: u32,
}

impl<T> SendQueue<T> {
    /// A queue that holds at most `capacity` outstanding work requests.
    pub(crate) fn new(capacity: usize) -> SendQueue<T> {
        SendQueue {
            posted: VecDeque::with_capacity(capacity),
            next_id: 1,
            capacity,
            since_signal: 0,
        }
    }

    /// Work requests posted and not yet completed.
    pub(crate) fn outstanding(&self) -> usize {
        self.posted.len()
    }

    /// Room for more work requests.
    pub(crate) fn room(&self) -> usize {
        self.capacity - self.posted.len()
    }

    /// Records a work request about to be posted; returns its `wr_id` and whether it
    /// must be signalled: every `every`-th one, and the last one of a post (`last`), so
    /// no work request waits for a completion that nothing will generate.
    ///
    /// # Errors
    /// Gives `item` back when the queue is full.
    pub(crate) fn push(&mut self, item: T, last: bool, every: u32) -> Result<(u64, bool), T> {
        if self.posted.len() >= self.capacity {
            return Err(item);
        }
        let id = self.next_id;
        self.next_id += 1;
        self.since_signal += 1;
        let signal = last || self.since_signal >= every;
        if signal {
            self.since_signal = 0;
        }
        self.posted.push_back((id, item));
        Ok((id, signal))
    }

    /// Takes back the most recent `n` records (a post that the device refused).
    pub(crate) fn unpush(&mut self, n: usize) -> Vec<T> {
        let at = self.posted.len().saturating_sub(n);
        self.since_signal = 0;
        self.posted.drain(at..).map(|(_, t)| t).collect()
    }

    /// A completion for `wr_id`: every older work request completed successfully, and
    /// `wr_id` itself with `ok`. `f` sees each with its outcome, oldest first. Returns
    /// false if `wr_id` is not outstanding (already accounted, e.g. after a reset).
    pub(crate) fn complete(&mut self, wr_id: u64, ok: bool, mut f: impl FnMut(T, Outcome)) -> bool {
        if !self.posted.iter().any(|(id, _)| *id == wr_id) {
            return false;
        }
        while let Some((id, item)) = self.posted.pop_front() {
            if id == wr_id {
                f(item, if ok { Outcome::Done } else { Outcome::Failed });
                break;
            }
            f(item, Outcome::Done);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::sync::Arc;
    use std::time::Duration;
    use te_core::ErrorKind;

    fn batch(n: usize) -> (Arc<BatchState>, mpsc::Receiver<Result<()>>) {
        let (tx, rx) = mpsc::channel();
        let done = Completion::new(Duration::from_secs(5), move |r, _| {
            tx.send(r).unwrap();
        });
        (Arc::new(BatchState::new(n, done)), rx)
    }

    #[test]
    fn a_batch_completes_once_when_its_last_slice_lands() {
        let (b, rx) = batch(3);
        b.slice_done();
        b.slice_done();
        assert!(rx.try_recv().is_err(), "not before the last slice");
        b.slice_done();
        assert!(rx.recv().unwrap().is_ok());
        assert!(rx.try_recv().is_err());
        assert_eq!(b.remaining(), 0);
    }

    #[test]
    fn a_failed_slice_completes_its_batch_only_when_every_slice_is_accounted_for() {
        let (b, rx) = batch(4);
        b.slice_done();
        b.slice_failed(Error::new(ErrorKind::Backend, "IBV_WC_REM_ACCESS_ERR"));
        assert!(b.is_stopped());
        assert!(
            rx.try_recv().is_err(),
            "two slices may still be moving bytes: the batch must not complete"
        );
        b.slice_failed(Error::new(ErrorKind::Backend, "second"));
        assert!(rx.try_recv().is_err());
        b.slice_done();
        let e = rx.recv().unwrap().unwrap_err();
        assert!(
            e.to_string().contains("REM_ACCESS"),
            "the first error wins: {e}"
        );
        assert_eq!(b.remaining(), 0);
        assert!(rx.try_recv().is_err(), "completed once only");
    }

    #[test]
    fn an_aborted_batch_posts_nothing_more_and_completes_when_its_slices_are_back() {
        let (b, rx) = batch(2);
        b.abort(Error::new(ErrorKind::Cancelled, "aborted"));
        assert!(b.is_stopped());
        b.slice_done();
        assert!(rx.try_recv().is_err());
        b.slice_failed(Error::new(ErrorKind::Cancelled, "not posted"));
        let e = rx.recv().unwrap().unwrap_err();
        assert!(e.to_string().contains("aborted"), "{e}");
    }

    #[test]
    fn the_engines_abort_stops_only_the_flagged_batch_which_completes_when_its_posted_slices_are_back(
    ) {
        let table = Arc::new(InFlight::default());
        let (tx, rx) = mpsc::channel();
        let deadline = te_core::Deadline::after(Duration::from_secs(5));
        let (tx1, tx2) = (tx.clone(), tx);
        let (d1, aborter) = Completion::abortable(deadline, move |r, _| tx1.send((1, r)).unwrap());
        let (d2, _) = Completion::abortable(deadline, move |r, _| tx2.send((2, r)).unwrap());
        // Completions made outside an engine share id 0: only the flag tells them apart.
        let (b1, b2) = (table.start(3, d1), table.start(1, d2));
        assert_eq!(table.len(), 2);
        assert!(
            table.abort(b1.count.batch(), cancelled).is_empty(),
            "no flag, no abort"
        );
        aborter.abort();
        let hit = table.abort(b1.count.batch(), cancelled);
        assert_eq!(hit.len(), 1);
        assert!(Arc::ptr_eq(&hit[0], &b1));
        assert!(b1.is_stopped() && !b2.is_stopped());
        // One slice was posted and lands; the two waiting ones are dropped unposted.
        b1.slice_done();
        b1.slice_failed(Error::new(ErrorKind::Cancelled, "not posted"));
        assert!(rx.try_recv().is_err(), "a slice is still unaccounted for");
        b1.slice_failed(Error::new(ErrorKind::Cancelled, "not posted"));
        let (which, r) = rx.recv().unwrap();
        assert_eq!(which, 1);
        assert!(r.unwrap_err().message().contains("aborted by the engine"));
        assert_eq!(table.len(), 1, "a completed batch leaves the table");
        b2.slice_done();
        assert!(matches!(rx.recv().unwrap(), (2, Ok(()))));
        assert_eq!(table.len(), 0);
        assert!(
            table.abort(b1.count.batch(), cancelled).is_empty(),
            "a completed batch is not found"
        );
    }

    fn cancelled() -> Error {
        Error::new(ErrorKind::Cancelled, "aborted by the engine")
    }

    #[test]
    fn concurrent_slices_complete_the_batch_once() {
        let (b, rx) = batch(64);
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let b = b.clone();
                std::thread::spawn(move || {
                    for i in 0..8 {
                        if t == 3 && i == 5 {
                            b.slice_failed(Error::new(ErrorKind::Backend, "x"));
                        } else {
                            b.slice_done();
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(rx.recv().unwrap().is_err());
        assert!(rx.try_recv().is_err());
        assert_eq!(b.remaining(), 0);
    }

    #[test]
    fn only_transport_and_flush_errors_are_retried_elsewhere() {
        for s in [
            verbs::IBV_WC_RETRY_EXC_ERR,
            verbs::IBV_WC_RNR_RETRY_EXC_ERR,
            verbs::IBV_WC_WR_FLUSH_ERR,
        ] {
            assert!(retryable(s), "{s}");
        }
        for s in [
            verbs::IBV_WC_REM_ACCESS_ERR,
            verbs::IBV_WC_LOC_PROT_ERR,
            verbs::IBV_WC_REM_INV_REQ_ERR,
            verbs::IBV_WC_LOC_LEN_ERR,
            verbs::IBV_WC_REM_OP_ERR,
        ] {
            assert!(!retryable(s), "{s}");
        }
    }

    #[test]
    fn signals_are_batched_and_the_last_of_a_post_is_always_signalled() {
        let mut q = SendQueue::new(100);
        let signalled: Vec<bool> = (0..10).map(|i| q.push(i, i == 9, 4).unwrap().1).collect();
        assert_eq!(
            signalled,
            [false, false, false, true, false, false, false, true, false, true]
        );
        assert_eq!(q.outstanding(), 10);
    }

    #[test]
    fn a_full_queue_gives_the_item_back() {
        let mut q = SendQueue::new(2);
        q.push('a', false, 1).unwrap();
        q.push('b', false, 1).unwrap();
        assert_eq!(q.push('c', true, 1), Err('c'));
        assert_eq!(q.room(), 0);
    }

    #[test]
    fn a_signalled_completion_completes_every_older_unsignalled_request() {
        let mut q = SendQueue::new(10);
        let ids: Vec<u64> = (0..5).map(|i| q.push(i, i == 4, 3).unwrap().0).collect();
        let mut seen = Vec::new();
        assert!(q.complete(ids[2], true, |t, o| seen.push((t, o))));
        assert_eq!(
            seen,
            [(0, Outcome::Done), (1, Outcome::Done), (2, Outcome::Done)]
        );
        assert!(!q.complete(ids[2], true, |_, _| panic!("accounted twice")));
        seen.clear();
        assert!(q.complete(ids[4], false, |t, o| seen.push((t, o))));
        assert_eq!(seen, [(3, Outcome::Done), (4, Outcome::Failed)]);
        assert_eq!(q.outstanding(), 0);
    }

    #[test]
    fn a_refused_post_is_taken_back() {
        let mut q = SendQueue::new(10);
        for i in 0..6 {
            q.push(i, false, 16).unwrap();
        }
        assert_eq!(q.unpush(2), [4, 5]);
        assert_eq!(q.outstanding(), 4);
        assert_eq!(q.room(), 6);
    }
}
