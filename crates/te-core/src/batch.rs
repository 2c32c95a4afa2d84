//! Batches in flight: [`TransferHandle`], and the timer that enforces deadlines.
//!
//! A batch's state belongs to the batch alone (its own small lock), so status reads
//! and waits never take an engine-wide lock. Waiting blocks on a condition variable or
//! parks a `Waker`; nothing spins.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind, Result};

/// Where a batch stands.
#[derive(Debug, Clone)]
pub enum TransferStatus {
    /// Still in flight.
    Pending,
    /// Every request completed (and the notification, if any, was delivered).
    Done,
    /// The batch failed; no guarantee is made about which of its bytes moved.
    Failed(Error),
}

#[derive(Default)]
struct Slot {
    result: Option<Result<()>>,
    waker: Option<Waker>,
}

/// The shared state of one batch.
pub(crate) struct BatchState {
    done: AtomicBool,
    slot: Mutex<Slot>,
    cond: Condvar,
    deadline: Instant,
}

impl BatchState {
    pub(crate) fn new(deadline: Instant) -> Arc<BatchState> {
        Arc::new(BatchState {
            done: AtomicBool::new(false),
            slot: Mutex::new(Slot::default()),
            cond: Condvar::new(),
            deadline,
        })
    }

    pub(crate) fn deadline(&self) -> Instant {
        self.deadline
    }

    pub(crate) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Sets the result if none is set yet; returns whether this call set it.
    pub(crate) fn finish(&self, result: Result<()>) -> bool {
        let waker = {
            let mut slot = self.slot.lock().unwrap_or_else(|p| p.into_inner());
            if slot.result.is_some() {
                return false;
            }
            slot.result = Some(result);
            self.done.store(true, Ordering::Release);
            slot.waker.take()
        };
        self.cond.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
        true
    }

    fn timed_out(&self) {
        self.finish(Err(Error::new(
            ErrorKind::Timeout,
            "the batch did not complete before its deadline; raise the timeout or check the peer",
        )
        .with_operation("transfer")));
    }
}

/// A submitted batch: await it, wait for it, or ask where it stands.
///
/// Dropping the handle does not cancel the batch; it only stops listening.
#[derive(Clone)]
pub struct TransferHandle {
    state: Arc<BatchState>,
}

impl std::fmt::Debug for TransferHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferHandle")
            .field("status", &self.status())
            .finish()
    }
}

impl TransferHandle {
    pub(crate) fn new(state: Arc<BatchState>) -> TransferHandle {
        TransferHandle { state }
    }

    /// Where the batch stands, without blocking.
    pub fn status(&self) -> TransferStatus {
        if !self.state.is_done() {
            return TransferStatus::Pending;
        }
        match &self
            .state
            .slot
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .result
        {
            Some(Ok(())) => TransferStatus::Done,
            Some(Err(e)) => TransferStatus::Failed(e.clone()),
            None => TransferStatus::Pending,
        }
    }

    /// Blocks until the batch completes, fails, or reaches its deadline.
    ///
    /// # Errors
    /// The batch's error: `Timeout` at the deadline, `PeerUnreachable`, what the
    /// backend reported.
    pub fn wait(&self) -> Result<()> {
        let mut slot = self.state.slot.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = &slot.result {
                return r.clone();
            }
            slot = self
                .state
                .cond
                .wait(slot)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Blocks for at most `timeout`; `None` if the batch is still in flight then.
    ///
    /// # Errors
    /// As [`TransferHandle::wait`], inside the `Some`.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<()>> {
        let end = Instant::now() + timeout;
        let mut slot = self.state.slot.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = &slot.result {
                return Some(r.clone());
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            slot = self
                .state
                .cond
                .wait_timeout(slot, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// The batch's deadline.
    pub fn deadline(&self) -> Instant {
        self.state.deadline
    }
}

impl Future for TransferHandle {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let mut slot = self.state.slot.lock().unwrap_or_else(|p| p.into_inner());
        match &slot.result {
            Some(r) => Poll::Ready(r.clone()),
            None => {
                slot.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// Fails batches at their deadline: one thread per engine, sleeping on a condition
/// variable until the earliest deadline.
pub(crate) struct Timer {
    shared: Arc<TimerShared>,
    thread: Option<JoinHandle<()>>,
}

struct Due(Instant, Weak<BatchState>);

impl PartialEq for Due {
    fn eq(&self, o: &Due) -> bool {
        self.0 == o.0
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, o: &Due) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Due {
    fn cmp(&self, o: &Due) -> std::cmp::Ordering {
        self.0.cmp(&o.0)
    }
}

#[derive(Default)]
struct Deadlines {
    heap: BinaryHeap<Reverse<Due>>,
    stop: bool,
    /// The heap size at which finished batches are swept out.
    sweep_at: usize,
}

#[derive(Default)]
struct TimerShared {
    heap: Mutex<Deadlines>,
    cond: Condvar,
}

/// The smallest heap worth sweeping.
const SWEEP_MIN: usize = 4096;

impl Timer {
    pub(crate) fn start() -> Result<Timer> {
        let shared = Arc::new(TimerShared::default());
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("te-deadlines".into())
            .spawn(move || run_timer(&s))
            .map_err(|e| Error::io("start engine", "cannot spawn the deadline thread", e))?;
        Ok(Timer {
            shared,
            thread: Some(thread),
        })
    }

    pub(crate) fn add(&self, state: &Arc<BatchState>) {
        let mut guard = self.shared.heap.lock().unwrap_or_else(|p| p.into_inner());
        let earliest = guard.heap.peek().map(|Reverse(d)| d.0);
        guard
            .heap
            .push(Reverse(Due(state.deadline, Arc::downgrade(state))));
        // Batches that finish before their deadline leave entries behind. Sweeping them
        // whenever the heap has doubled since the last sweep keeps it proportional to
        // the batches in flight, at amortised constant cost per batch.
        if guard.heap.len() >= guard.sweep_at.max(SWEEP_MIN) {
            guard
                .heap
                .retain(|Reverse(d)| d.1.upgrade().is_some_and(|b| !b.is_done()));
            guard.sweep_at = 2 * guard.heap.len();
        }
        drop(guard);
        if earliest.is_none_or(|e| state.deadline < e) {
            self.shared.cond.notify_one();
        }
    }
}

fn run_timer(shared: &TimerShared) {
    let mut guard = shared.heap.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        if guard.stop {
            return;
        }
        let now = Instant::now();
        while let Some(Reverse(d)) = guard.heap.peek() {
            if d.0 > now {
                break;
            }
            let Some(Reverse(Due(_, batch))) = guard.heap.pop() else {
                break;
            };
            if let Some(b) = batch.upgrade() {
                b.timed_out();
            }
        }
        guard = match guard.heap.peek().map(|Reverse(d)| d.0) {
            Some(next) => {
                let wait = next.saturating_duration_since(Instant::now());
                shared
                    .cond
                    .wait_timeout(guard, wait)
                    .unwrap_or_else(|p| p.into_inner())
                    .0
            }
            None => shared.cond.wait(guard).unwrap_or_else(|p| p.into_inner()),
        };
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        self.shared
            .heap
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .stop = true;
        self.shared.cond.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timer_fails_a_batch_at_its_deadline_and_not_before() {
        let timer = Timer::start().unwrap();
        let late = BatchState::new(Instant::now() + Duration::from_secs(60));
        let soon = BatchState::new(Instant::now() + Duration::from_millis(20));
        timer.add(&late);
        timer.add(&soon);
        let h = TransferHandle::new(soon);
        assert_eq!(h.wait().unwrap_err().kind(), ErrorKind::Timeout);
        assert!(matches!(
            TransferHandle::new(late).status(),
            TransferStatus::Pending
        ));
    }

    #[test]
    fn finished_batches_do_not_pile_up_in_the_timer() {
        let timer = Timer::start().unwrap();
        for _ in 0..100_000 {
            let b = BatchState::new(Instant::now() + Duration::from_secs(60));
            timer.add(&b);
            b.finish(Ok(()));
        }
        let len = timer.shared.heap.lock().unwrap().heap.len();
        assert!(len <= 2 * SWEEP_MIN, "{len} entries for no batch in flight");
    }

    #[test]
    fn only_the_first_result_counts() {
        let b = BatchState::new(Instant::now() + Duration::from_secs(1));
        assert!(b.finish(Ok(())));
        assert!(!b.finish(Err(Error::new(ErrorKind::Backend, "late"))));
        assert!(TransferHandle::new(b).wait().is_ok());
    }
}
