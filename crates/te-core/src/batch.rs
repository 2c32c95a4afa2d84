//! Batches in flight: [`TransferHandle`], and the timer that enforces deadlines.
//!
//! A batch's state belongs to the batch alone (its own small lock), so status reads
//! and waits never take an engine-wide lock. Waiting blocks on a condition variable or
//! parks a `Waker`; nothing spins. A thread that waits (`wait`, `wait_timeout`) is
//! first lent to the backend ([`TransferBackend::drive`](crate::TransferBackend::drive)),
//! which may block it on the batch's own I/O instead, so that the answer wakes the
//! waiter itself rather than a backend thread that then wakes it.

use crate::signals::SpawnMasked as _;
use crate::sync::{Condvar, Mutex};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::{BatchId, BatchSignals};
use crate::error::{Error, ErrorKind, Result};
use crate::metrics::{BatchMeter, BatchTelemetry};
use crate::time::Deadline;

/// Where a batch stands.
#[derive(Debug, Clone)]
pub enum TransferStatus {
    /// Still in flight (or, after a cancel or its deadline, still being released).
    Pending,
    /// Every request completed (and the notification, if any, was delivered).
    Done,
    /// The batch failed; no guarantee is made about which of its bytes moved, but none
    /// moves any more.
    Failed(Error),
}

#[derive(Default)]
struct Slot {
    result: Option<Result<()>>,
    wakers: Vec<Waker>,
}

/// Why a batch is being aborted (the value of its abort flag).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Abort {
    /// Its deadline passed.
    Deadline = 1,
    /// Its caller cancelled it.
    Cancel = 2,
    /// One of its local regions is being deregistered.
    Deregister = 3,
}

impl Abort {
    fn from_flag(v: u8) -> Option<Abort> {
        match v {
            1 => Some(Abort::Deadline),
            2 => Some(Abort::Cancel),
            3 => Some(Abort::Deregister),
            _ => None,
        }
    }

    pub(crate) fn error(self) -> Error {
        let e = match self {
            Abort::Deadline => Error::new(
                ErrorKind::Timeout,
                "the batch did not complete before its deadline; raise the timeout or check the peer",
            ),
            Abort::Cancel => Error::new(ErrorKind::Cancelled, "the batch was cancelled"),
            Abort::Deregister => Error::new(
                ErrorKind::Cancelled,
                "a region of the batch was deregistered while the batch was in flight",
            ),
        };
        e.with_operation("transfer")
    }
}

/// The batch is with its backend (its memory may be in use).
const PHASE_BACKEND: u8 = 0;
/// The backend released the batch; its notification is on its way.
const PHASE_NOTIFY: u8 = 1;

/// What tells the backend to stop the batch.
pub(crate) type AbortHook = Arc<dyn Fn() + Send + Sync>;

/// What lets a waiting thread do the backend's work for the batch until the deadline
/// it is given ([`TransferBackend::drive`](crate::TransferBackend::drive)): whether it
/// waited.
pub(crate) type DriveHook = Arc<dyn Fn(Deadline) -> bool + Send + Sync>;

/// The shared state of one batch.
pub(crate) struct BatchState {
    id: BatchId,
    done: AtomicBool,
    /// The abort flag and stage times it shares with its completion, held until the
    /// batch's state is dropped.
    signals: BatchSignals,
    phase: AtomicU8,
    hook: Mutex<Option<AbortHook>>,
    drive: Mutex<Option<DriveHook>>,
    slot: Mutex<Slot>,
    cond: Condvar,
    deadline: Deadline,
    /// What it moves and when, counted into the engine's metrics at its end; set
    /// once the batch has passed its checks.
    meter: OnceLock<BatchMeter>,
}

impl BatchState {
    pub(crate) fn new(id: BatchId, deadline: Deadline) -> Arc<BatchState> {
        Arc::new(BatchState {
            id,
            done: AtomicBool::new(false),
            signals: BatchSignals::new(),
            phase: AtomicU8::new(PHASE_BACKEND),
            hook: Mutex::new(None),
            drive: Mutex::new(None),
            slot: Mutex::new(Slot::default()),
            cond: Condvar::new(),
            deadline,
            meter: OnceLock::new(),
        })
    }

    /// Measures the batch with `meter` from now on.
    pub(crate) fn meter(&self, meter: BatchMeter) {
        let _ = self.meter.set(meter);
    }

    /// The batch's trace span, once it is measured.
    pub(crate) fn span(&self) -> Option<&tracing::Span> {
        self.meter.get().map(BatchMeter::span)
    }

    /// Notes that the backend has taken the batch.
    pub(crate) fn posted(&self) {
        if let Some(m) = self.meter.get() {
            m.posted();
        }
    }

    pub(crate) fn id(&self) -> BatchId {
        self.id
    }

    pub(crate) fn deadline(&self) -> Deadline {
        self.deadline
    }

    /// The signals the backend's completion shares.
    pub(crate) fn signals(&self) -> &BatchSignals {
        &self.signals
    }

    /// Why the batch is being aborted, if it is.
    pub(crate) fn aborted(&self) -> Option<Abort> {
        Abort::from_flag(self.signals.aborted())
    }

    /// Sets how the backend is told to stop (once it has the batch).
    pub(crate) fn set_hook(&self, hook: AbortHook) {
        *self.hook.lock() = Some(hook);
        // An abort that came before the hook was set is passed on now.
        if self.aborted().is_some() && !self.is_done() {
            self.call_hook();
        }
    }

    /// Sets how a waiting thread does the backend's work for the batch.
    pub(crate) fn set_drive(&self, hook: DriveHook) {
        *self.drive.lock() = Some(hook);
    }

    /// Lets the calling thread, about to wait for the batch, do the backend's work for
    /// it until `until` (where the backend has such work: a same-host answer it can
    /// read itself, saving the hand-off from the thread that would read it). Returns
    /// when the batch is done, `until` passes, or the backend has nothing more for this
    /// thread; the caller then waits on the condition variable as usual.
    fn drive(&self, until: Instant) {
        while !self.is_done() && Instant::now() < until {
            let hook = self.drive.lock().clone();
            match hook {
                Some(h) if h(Deadline::at(until)) => {}
                _ => return,
            }
        }
    }

    fn call_hook(&self) {
        // Not under the lock: the backend may release the batch inside the call, and
        // finishing it takes the lock.
        let hook = self.hook.lock().clone();
        if let Some(h) = hook {
            h();
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Asks to abort the batch. While the backend holds it, the backend is told and the
    /// handle resolves when the backend releases it; once only its notification is
    /// left, the batch ends at once. Returns whether this call set the reason.
    pub(crate) fn request_abort(&self, why: Abort) -> bool {
        if self.is_done() || !self.signals.abort(why as u8) {
            return false;
        }
        if self.phase.load(Ordering::SeqCst) == PHASE_NOTIFY {
            self.finish(Err(why.error()));
        } else {
            self.call_hook();
        }
        true
    }

    /// The backend released the batch and only its notification is left. Returns the
    /// abort that overtook it, if any (the batch then ends with that instead).
    pub(crate) fn enter_notify(&self) -> Option<Abort> {
        self.phase.store(PHASE_NOTIFY, Ordering::SeqCst);
        self.aborted()
    }

    /// Sets the result if none is set yet; returns whether this call set it.
    pub(crate) fn finish(&self, result: Result<()>) -> bool {
        self.finish_then(result, || {})
    }

    /// As [`BatchState::finish`], running `between` once the result is set (the batch
    /// reads as done) and before anyone is woken; it runs even if the batch had ended.
    pub(crate) fn finish_then(&self, result: Result<()>, between: impl FnOnce()) -> bool {
        let wakers = {
            let mut slot = self.slot.lock();
            if slot.result.is_some() {
                drop(slot);
                between();
                return false;
            }
            if let Some(m) = self.meter.get() {
                m.end(&result, self.signals.signals());
            }
            slot.result = Some(result);
            self.done.store(true, Ordering::Release);
            std::mem::take(&mut slot.wakers)
        };
        between();
        self.hook.lock().take();
        self.drive.lock().take();
        self.cond.notify_all();
        for w in wakers {
            w.wake();
        }
        true
    }
}

/// A submitted batch: await it, wait for it, poll it, or cancel it. Clones share the
/// batch: every clone can be awaited, waited on or polled, and all of them wake.
///
/// A handle resolves only once the backend has released the batch: after that no byte
/// moves into or out of the memory it named. Dropping a handle does not cancel the
/// batch; it only stops listening.
#[derive(Clone)]
pub struct TransferHandle {
    state: Arc<BatchState>,
}

impl std::fmt::Debug for TransferHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferHandle")
            .field("batch", &self.state.id)
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
        match &self.state.slot.lock().result {
            Some(Ok(())) => TransferStatus::Done,
            Some(Err(e)) => TransferStatus::Failed(e.clone()),
            None => TransferStatus::Pending,
        }
    }

    /// Whether the batch has resolved (completed, failed, timed out or been cancelled
    /// and released), without blocking.
    pub fn is_done(&self) -> bool {
        self.state.is_done()
    }

    /// Asks to stop the batch. Returns at once; the handle resolves with `Cancelled`
    /// when the backend has released the batch (at once if only its notification was
    /// left). A batch that already completed is not affected.
    pub fn cancel(&self) {
        self.state.request_abort(Abort::Cancel);
    }

    /// Blocks until the batch resolves: completes, fails, or is released after its
    /// deadline or a cancel.
    ///
    /// # Errors
    /// The batch's error: `Timeout` at the deadline, `Cancelled`, `PeerUnreachable`,
    /// what the backend reported.
    pub fn wait(&self) -> Result<()> {
        self.state.drive(self.state.deadline.instant());
        let mut slot = self.state.slot.lock();
        loop {
            if let Some(r) = &slot.result {
                return r.clone();
            }
            slot = self.state.cond.wait(slot);
        }
    }

    /// Blocks for at most `timeout`; `None` if the batch is still in flight then.
    ///
    /// # Errors
    /// As [`TransferHandle::wait`], inside the `Some`.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<()>> {
        let now = Instant::now();
        let end = now
            .checked_add(timeout)
            .unwrap_or(now + Duration::from_secs(1 << 30));
        self.state.drive(end.min(self.state.deadline.instant()));
        let mut slot = self.state.slot.lock();
        loop {
            if let Some(r) = &slot.result {
                return Some(r.clone());
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            slot = self.state.cond.wait_timeout(slot, left).0;
        }
    }

    /// What the batch did — its requests, bytes, when it was submitted, how long
    /// posting and the whole batch took — once it has ended; `None` before.
    pub fn telemetry(&self) -> Option<BatchTelemetry> {
        self.state.meter.get()?.telemetry()
    }

    /// The batch's deadline.
    pub fn deadline(&self) -> Instant {
        self.state.deadline.instant()
    }
}

impl Future for TransferHandle {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let mut slot = self.state.slot.lock();
        match &slot.result {
            Some(r) => Poll::Ready(r.clone()),
            None => {
                let waker = cx.waker();
                if !slot.wakers.iter().any(|w| w.will_wake(waker)) {
                    slot.wakers.push(waker.clone());
                }
                Poll::Pending
            }
        }
    }
}

/// Fails batches at their deadline: one thread per engine, sleeping on a condition
/// variable until the earliest deadline of a batch still in flight.
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
            .spawn_masked(move || run_timer(&s))
            .map_err(|e| Error::io("start engine", "cannot spawn the deadline thread", e))?;
        Ok(Timer {
            shared,
            thread: Some(thread),
        })
    }

    pub(crate) fn add(&self, state: &Arc<BatchState>) {
        let mut guard = self.shared.heap.lock();
        let earliest = guard.heap.peek().map(|Reverse(d)| d.0);
        guard.heap.push(Reverse(Due(
            state.deadline.instant(),
            Arc::downgrade(state),
        )));
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
        if earliest.is_none_or(|e| state.deadline.instant() < e) {
            self.shared.cond.notify_one();
        }
    }
}

fn run_timer(shared: &TimerShared) {
    let mut guard = shared.heap.lock();
    loop {
        if guard.stop {
            return;
        }
        let now = Instant::now();
        // Due entries are aborted, and entries of batches that ended are dropped whenever
        // they come first, due or not: the thread then sleeps until the deadline of a
        // batch still in flight, or for good when none is (an idle engine never wakes it).
        while let Some(Reverse(d)) = guard.heap.peek() {
            let live = d.1.upgrade().filter(|b| !b.is_done());
            if d.0 > now && live.is_some() {
                break;
            }
            guard.heap.pop();
            if let Some(b) = live {
                // The hook may call into the backend: not under the heap's lock.
                drop(guard);
                b.request_abort(Abort::Deadline);
                guard = shared.heap.lock();
            }
        }
        guard = match guard.heap.peek().map(|Reverse(d)| d.0) {
            Some(next) => {
                let wait = next.saturating_duration_since(Instant::now());
                shared.cond.wait_timeout(guard, wait).0
            }
            None => shared.cond.wait(guard),
        };
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        self.shared.heap.lock().stop = true;
        self.shared.cond.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn batch(timeout: Duration) -> Arc<BatchState> {
        BatchState::new(BatchId(1), Deadline::after(timeout))
    }

    #[test]
    fn at_its_deadline_the_timer_asks_the_backend_to_stop_and_the_handle_waits_for_it() {
        let timer = Timer::start().unwrap();
        let late = batch(Duration::from_secs(60));
        let soon = batch(Duration::from_millis(20));
        let (tx, rx) = mpsc::channel();
        soon.set_hook(Arc::new(move || {
            let _ = tx.send(());
        }));
        timer.add(&late);
        timer.add(&soon);
        let h = TransferHandle::new(soon.clone());
        rx.recv_timeout(Duration::from_secs(5)).unwrap();
        // Asked, not released: the handle still waits for the backend.
        assert!(h.wait_timeout(Duration::from_millis(50)).is_none());
        assert_eq!(soon.aborted(), Some(Abort::Deadline));
        soon.finish(Err(soon.aborted().unwrap().error()));
        assert_eq!(h.wait().unwrap_err().kind(), ErrorKind::Timeout);
        assert!(matches!(
            TransferHandle::new(late).status(),
            TransferStatus::Pending
        ));
    }

    #[test]
    fn an_abort_before_the_hook_is_set_is_passed_on_when_it_is() {
        let b = batch(Duration::from_secs(60));
        TransferHandle::new(b.clone()).cancel();
        let (tx, rx) = mpsc::channel();
        b.set_hook(Arc::new(move || {
            let _ = tx.send(());
        }));
        rx.recv_timeout(Duration::from_secs(1)).unwrap();
    }

    #[test]
    fn a_cancel_while_only_the_notification_is_left_ends_the_batch_at_once() {
        let b = batch(Duration::from_secs(60));
        assert_eq!(b.enter_notify(), None);
        let h = TransferHandle::new(b);
        h.cancel();
        assert_eq!(h.wait().unwrap_err().kind(), ErrorKind::Cancelled);
    }

    #[test]
    fn every_clone_of_a_handle_wakes() {
        use std::task::Wake;
        struct Count(std::sync::atomic::AtomicUsize);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let b = batch(Duration::from_secs(60));
        let h = TransferHandle::new(b.clone());
        let wakes = Arc::new(Count(std::sync::atomic::AtomicUsize::new(0)));
        for _ in 0..2 {
            let waker = Waker::from(Arc::new(Count(std::sync::atomic::AtomicUsize::new(0))));
            let _ = Pin::new(&mut h.clone()).poll(&mut Context::from_waker(&waker));
        }
        let waker = Waker::from(wakes.clone());
        let (mut f1, mut f2) = (h.clone(), h.clone());
        assert!(Pin::new(&mut f1)
            .poll(&mut Context::from_waker(&waker))
            .is_pending());
        let other = Waker::from(Arc::new(Count(std::sync::atomic::AtomicUsize::new(0))));
        assert!(Pin::new(&mut f2)
            .poll(&mut Context::from_waker(&other))
            .is_pending());
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let h = h.clone();
                std::thread::spawn(move || h.wait())
            })
            .collect();
        std::thread::sleep(Duration::from_millis(20));
        b.finish(Ok(()));
        for t in threads {
            t.join().unwrap().unwrap();
        }
        assert_eq!(wakes.0.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn finished_batches_do_not_pile_up_in_the_timer() {
        let timer = Timer::start().unwrap();
        for _ in 0..100_000 {
            let b = batch(Duration::from_secs(60));
            timer.add(&b);
            b.finish(Ok(()));
        }
        let len = timer.shared.heap.lock().heap.len();
        assert!(len <= 2 * SWEEP_MIN, "{len} entries for no batch in flight");
    }

    #[test]
    fn a_waiting_thread_is_lent_to_the_backend_until_its_batch_ends() {
        use std::sync::atomic::AtomicUsize;
        let b = batch(Duration::from_secs(60));
        let calls = Arc::new(AtomicUsize::new(0));
        let (c, state) = (calls.clone(), b.clone());
        b.set_drive(Arc::new(move |until: Deadline| {
            assert!(until.remaining() <= Duration::from_secs(60));
            // The backend's work, done on the waiting thread: the second call ends it.
            if c.fetch_add(1, Ordering::SeqCst) == 1 {
                state.finish(Ok(()));
            }
            true
        }));
        TransferHandle::new(b.clone()).wait().unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        TransferHandle::new(b).wait().unwrap();
        assert_eq!(
            calls.load(Ordering::SeqCst),
            2,
            "not lent once the batch ended"
        );
    }

    #[test]
    fn a_backend_with_nothing_for_the_thread_leaves_it_to_wait_and_a_timeout_bounds_the_loan() {
        let b = batch(Duration::from_secs(60));
        let (tx, rx) = mpsc::channel();
        b.set_drive(Arc::new(move |until: Deadline| {
            let _ = tx.send(until.remaining());
            false
        }));
        let h = TransferHandle::new(b.clone());
        assert!(h.wait_timeout(Duration::from_millis(20)).is_none());
        assert!(rx.try_recv().unwrap() <= Duration::from_millis(20));
        assert!(
            rx.try_recv().is_err(),
            "asked once, then the condition variable"
        );
        let finisher = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            b.finish(Ok(()));
        });
        h.wait().unwrap();
        finisher.join().unwrap();
    }

    #[test]
    fn only_the_first_result_counts() {
        let b = batch(Duration::from_secs(1));
        assert!(b.finish(Ok(())));
        assert!(!b.finish(Err(Error::new(ErrorKind::Backend, "late"))));
        assert!(TransferHandle::new(b).wait().is_ok());
    }
}
