//! Completion bookkeeping, free of verbs so it is tested without a NIC.
//!
//! - [`BatchState`] counts a batch's slices; its [`Completion`] is completed exactly
//!   once: `Ok` when the last slice succeeds, or the first failure's error at once.
//! - [`SendQueue`] is one QP's work requests in posting order. A reliable connection
//!   completes work requests in order, so a signalled completion for work request `n`
//!   also completes every unsignalled one posted before it; an error completion fails
//!   `n` (earlier ones completed successfully before it), and when a QP is reset,
//!   whatever it still holds is handed back to be retried elsewhere or failed.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use te_core::{Completion, Error, Result};

/// One batch in flight: its remaining slices and its completion.
#[derive(Debug)]
pub(crate) struct BatchState {
    remaining: AtomicUsize,
    done: Mutex<Option<Completion>>,
}

impl BatchState {
    /// A batch of `slices` slices; `slices` must not be zero.
    pub(crate) fn new(slices: usize, done: Completion) -> BatchState {
        BatchState {
            remaining: AtomicUsize::new(slices),
            done: Mutex::new(Some(done)),
        }
    }

    fn take(&self) -> Option<Completion> {
        self.done.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// One slice landed. Completes the batch with `Ok` if it was the last one and no
    /// slice failed.
    pub(crate) fn slice_done(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            if let Some(done) = self.take() {
                done.complete(Ok(()));
            }
        }
    }

    /// One slice failed for good (no other path to retry on). The first failure
    /// completes the batch with its error; later ones are only counted.
    pub(crate) fn slice_failed(&self, error: Error) {
        if let Some(done) = self.take() {
            done.complete(Err(error));
        }
        self.remaining.fetch_sub(1, Ordering::AcqRel);
    }

    /// Whether the batch has already been completed (a slice failed, or all landed).
    pub(crate) fn is_finished(&self) -> bool {
        self.done
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }

    /// Slices not yet accounted for.
    #[cfg(test)]
    pub(crate) fn remaining(&self) -> usize {
        self.remaining.load(Ordering::Acquire)
    }
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
    #[cfg(test)]
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

    /// Everything still outstanding, oldest first, for a QP being reset.
    pub(crate) fn drain(&mut self) -> Vec<T> {
        self.since_signal = 0;
        self.posted.drain(..).map(|(_, t)| t).collect()
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
    fn a_failed_slice_fails_its_batch_exactly_once_and_every_slice_is_still_counted() {
        let (b, rx) = batch(4);
        b.slice_done();
        b.slice_failed(Error::new(ErrorKind::Backend, "IBV_WC_REM_ACCESS_ERR"));
        assert!(b.is_finished());
        let e = rx.recv().unwrap().unwrap_err();
        assert!(e.to_string().contains("REM_ACCESS"), "{e}");
        b.slice_failed(Error::new(ErrorKind::Backend, "second"));
        b.slice_done();
        assert_eq!(b.remaining(), 0);
        assert!(rx.try_recv().is_err(), "completed once only");
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
    fn a_reset_hands_back_everything_outstanding_and_a_refused_post_is_taken_back() {
        let mut q = SendQueue::new(10);
        for i in 0..6 {
            q.push(i, false, 16).unwrap();
        }
        assert_eq!(q.unpush(2), [4, 5]);
        assert_eq!(q.drain(), [0, 1, 2, 3]);
        assert_eq!(q.outstanding(), 0);
        assert_eq!(q.room(), 10);
    }
}
