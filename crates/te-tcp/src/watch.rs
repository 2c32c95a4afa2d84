//! Batch deadlines: one thread per backend that wakes at the earliest deadline of the
//! batches in flight and cuts what still holds an expired batch.
//!
//! A slice already written waits for its answer, and the receiving thread may be in the
//! middle of placing a READ's payload; neither can be taken back while the connection
//! lives. So at the deadline a connection that carries a written slice of the batch (or
//! is receiving into it) is closed: its threads leave the caller's memory, every slice
//! on it fails, and the expired batch completes with `Timeout` at its deadline rather
//! than after `io_timeout`. Slices not yet written are simply dropped from their queue.

use std::cmp::{Ordering as CmpOrdering, Reverse};
use std::collections::BinaryHeap;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Instant;

use crate::conn::{Batch, Conn};

/// One batch to watch.
struct Timed {
    at: Instant,
    seq: u64,
    batch: Weak<Batch>,
    conns: Vec<Weak<Conn>>,
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
    wake: Condvar,
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .heap
            .len();
        f.debug_struct("Watch").field("batches", &n).finish()
    }
}

impl Watch {
    /// Watches `batch`, whose slices travel on `conns`.
    pub(crate) fn add(&self, batch: &Arc<Batch>, conns: &[Arc<Conn>]) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        // Finished batches are dropped lazily: at most about twice the live ones stay.
        if s.heap.len() > 2 * s.pruned + 1024 {
            s.heap.retain(|t| t.0.batch.strong_count() > 0);
            s.pruned = s.heap.len();
        }
        s.seq += 1;
        let seq = s.seq;
        let earliest = s.heap.peek().is_none_or(|t| batch.deadline() < t.0.at);
        s.heap.push(Reverse(Timed {
            at: batch.deadline(),
            seq,
            batch: Arc::downgrade(batch),
            conns: conns.iter().map(Arc::downgrade).collect(),
        }));
        drop(s);
        if earliest {
            self.wake.notify_one();
        }
    }

    /// Ends [`Watch::run`].
    pub(crate) fn close(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).closed = true;
        self.wake.notify_all();
    }

    /// The watching thread: sleeps until the earliest deadline, then cuts what holds
    /// the batches that expired unfinished.
    pub(crate) fn run(&self) {
        loop {
            let mut due = Vec::new();
            {
                let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
                loop {
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
                    s = match s.heap.peek().map(|t| t.0.at) {
                        Some(at) => {
                            self.wake
                                .wait_timeout(s, at.saturating_duration_since(now))
                                .unwrap_or_else(|p| p.into_inner())
                                .0
                        }
                        None => self.wake.wait(s).unwrap_or_else(|p| p.into_inner()),
                    };
                }
            }
            for t in due {
                let Some(batch) = t.batch.upgrade() else {
                    continue;
                };
                if batch.is_finished() {
                    continue;
                }
                for c in t.conns.iter().filter_map(Weak::upgrade) {
                    c.cut(&batch);
                }
            }
        }
    }
}
