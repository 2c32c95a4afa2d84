//! Batch deadlines: one task per backend, on te-tcp's I/O threads, that wakes at the
//! earliest deadline of the batches in flight and cuts what still holds an expired
//! batch.
//!
//! At the deadline, slices not yet written are dropped from their queue. A slice already
//! written waits for its answer, and the receiving thread may be in the middle of
//! placing a READ's payload; neither can be taken back while the connection lives. If
//! answers still move on that connection, the batch's own arrive soon and are dropped
//! (a healthy, busy connection is not closed for one impatient batch); if nothing moved
//! for [`STALL_GRACE`], the connection is closed: its tasks leave the caller's
//! memory, every slice on it fails, and the expired batch completes with `Timeout`
//! within about `STALL_GRACE` of its deadline rather than after `io_timeout`.

use std::cmp::{Ordering as CmpOrdering, Reverse};
use std::collections::BinaryHeap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};
use te_core::sync::Mutex;
use tokio::sync::Notify;

use crate::completion::Batch;
use crate::initiator::conn::Conn;
use crate::samehost::Channel;

/// How long a connection that carries an expired batch may go without any answer or
/// send before it is closed.
#[cfg(not(test))]
pub(crate) const STALL_GRACE: Duration = Duration::from_millis(250);
/// Longer in this crate's tests, so a busy connection whose answers a loaded machine
/// delays is not taken for a stalled one; stalled targets there hold answers for seconds.
#[cfg(test)]
pub(crate) const STALL_GRACE: Duration = Duration::from_secs(1);

/// One batch to watch.
struct Timed {
    at: Instant,
    seq: u64,
    batch: Weak<Batch>,
    conns: Vec<Weak<Conn>>,
    /// Each connection's progress count at the last look after the deadline.
    seen: Vec<Option<u64>>,
    /// Same-host channels the batch's requests may wait on, and theirs.
    channels: Vec<Weak<Channel>>,
    channels_seen: Vec<Option<u64>>,
}

impl PartialEq for Timed {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Timed {}
impl PartialOrd for Timed {
    fn partial_cmp(&self, o: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(o))
    }
}
impl Ord for Timed {
    fn cmp(&self, o: &Self) -> CmpOrdering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

#[derive(Default)]
struct State {
    heap: BinaryHeap<Reverse<Timed>>,
    seq: u64,
    /// The heap's size after the last pruning of finished batches.
    pruned: usize,
    closed: bool,
}

/// The deadlines of a backend's batches in flight.
#[derive(Default)]
pub(crate) struct Watch {
    state: Mutex<State>,
    /// Wakes the watching task (its only waiter): an earlier deadline, an abort, or
    /// closing.
    wake: Notify,
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.state.lock().heap.len();
        f.debug_struct("Watch").field("batches", &n).finish()
    }
}

impl Watch {
    /// Watches `batch`, whose slices travel on `conns` and `channels`.
    pub(crate) fn add(&self, batch: &Arc<Batch>, conns: &[Arc<Conn>], channels: &[Arc<Channel>]) {
        let mut s = self.state.lock();
        // Finished batches are dropped lazily: at most about twice the live ones stay.
        if s.heap.len() > 2 * s.pruned + 1024 {
            s.heap.retain(|t| t.0.batch.strong_count() > 0);
            s.pruned = s.heap.len();
        }
        drop(s);
        self.push(Timed {
            at: batch.deadline(),
            seq: 0,
            batch: Arc::downgrade(batch),
            conns: conns.iter().map(Arc::downgrade).collect(),
            seen: vec![None; conns.len()],
            channels: channels.iter().map(Arc::downgrade).collect(),
            channels_seen: vec![None; channels.len()],
        });
    }

    fn push(&self, mut t: Timed) {
        let mut s = self.state.lock();
        s.seq += 1;
        t.seq = s.seq;
        let earliest = s.heap.peek().is_none_or(|e| t.at < e.0.at);
        s.heap.push(Reverse(t));
        drop(s);
        if earliest {
            self.wake.notify_one();
        }
    }

    /// Treats the batches with engine id `id` as expired now (the engine aborted them:
    /// a cancel or a deregistration), so a stalled connection does not hold them until
    /// `io_timeout`. Linear in the batches watched; aborts are rare.
    pub(crate) fn abort(&self, id: te_core::BatchId) {
        let now = Instant::now();
        let mut s = self.state.lock();
        let mut all = std::mem::take(&mut s.heap).into_vec();
        let mut found = false;
        for t in &mut all {
            if t.0
                .seen
                .iter()
                .chain(&t.0.channels_seen)
                .all(Option::is_none)
                && t.0.batch.upgrade().is_some_and(|b| b.id() == id)
            {
                t.0.at = t.0.at.min(now);
                found = true;
            }
        }
        s.heap = BinaryHeap::from(all);
        drop(s);
        if found {
            self.wake.notify_one();
        }
    }

    /// Ends [`Watch::run`].
    pub(crate) fn close(&self) {
        self.state.lock().closed = true;
        self.wake.notify_one();
    }

    /// The watching task: sleeps until the earliest deadline, then cuts what holds
    /// the batches that expired unfinished.
    pub(crate) async fn run(&self) {
        loop {
            let mut due = Vec::new();
            loop {
                let next = {
                    let mut s = self.state.lock();
                    if s.closed {
                        return;
                    }
                    let now = Instant::now();
                    while s.heap.peek().is_some_and(|t| t.0.at <= now) {
                        if let Some(Reverse(t)) = s.heap.pop() {
                            due.push(t);
                        }
                    }
                    if !due.is_empty() {
                        break;
                    }
                    s.heap.peek().map(|t| t.0.at)
                };
                // A wake since the look above left a permit: this returns at once.
                match next {
                    Some(at) => {
                        let at = tokio::time::Instant::from_std(at);
                        let _ = tokio::time::timeout_at(at, self.wake.notified()).await;
                    }
                    None => self.wake.notified().await,
                }
            }
            for mut t in due {
                let Some(batch) = t.batch.upgrade() else {
                    continue;
                };
                if batch.is_finished() {
                    continue;
                }
                let mut again = false;
                for (c, seen) in t.conns.iter().zip(t.seen.iter_mut()) {
                    *seen = c.upgrade().and_then(|c| c.cut(&batch, *seen));
                    again |= seen.is_some();
                }
                for (c, seen) in t.channels.iter().zip(t.channels_seen.iter_mut()) {
                    *seen = c.upgrade().and_then(|c| c.cut(&batch, *seen));
                    again |= seen.is_some();
                }
                if again {
                    t.at = Instant::now() + STALL_GRACE;
                    self.push(t);
                }
            }
        }
    }
}
