//! What peers send an engine that its user reads: notifications (bounded in bytes) and
//! peer events (bounded in number, oldest dropped). Both can be drained without
//! blocking, waited for with a timeout, or awaited.

use crate::sync::{Condvar, Mutex};
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, SystemTime};

use crate::error::{Error, ErrorKind, Result};

/// A message a peer attached to a batch, received after the batch's data landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The sending engine's name, as its authenticated session gave it.
    pub from: String,
    /// The sending engine's epoch.
    pub from_epoch: u64,
    /// The sending engine's control-plane address (reply there with `Engine::connect`).
    pub from_address: String,
    /// When it was received.
    pub received: SystemTime,
    /// The message bytes.
    pub message: Vec<u8>,
}

/// What happened to a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum PeerEventKind {
    /// Its session broke without a goodbye: it died, or the network between us did.
    /// Whatever it was pushing will not complete.
    Lost,
    /// It came back with a new epoch: what it had in flight in its previous life will
    /// not complete, and its regions and layouts are new.
    Restarted,
    /// It closed its session on purpose (its engine shut down).
    Left,
    /// Its data connection broke in the middle of a WRITE into this engine's memory
    /// (posted by the backend, which received it): [`PeerEvent::torn`] names the bytes
    /// that may now hold part old, part new data.
    TornWrite,
}

/// The bytes of a registered region a [`PeerEventKind::TornWrite`] may have left part
/// old, part new.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TornRange {
    /// The region.
    pub region: crate::RegionId,
    /// The first byte that may be torn, from the region's start.
    pub start: u64,
    /// One past the last.
    pub end: u64,
}

/// A peer that had a session with this engine disappeared, restarted or left, or a
/// peer's write into this engine's memory was torn.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PeerEvent {
    /// What happened.
    pub kind: PeerEventKind,
    /// The peer's engine name; empty when the backend that posted the event does not
    /// know it (a data connection that names no engine).
    pub name: String,
    /// Its epoch (the new one, for `Restarted`).
    pub epoch: u64,
    /// Its epoch before, for `Restarted`.
    pub previous_epoch: Option<u64>,
    /// Its control-plane address; for an event a backend posted, the address of the
    /// backend's connection from the peer.
    pub address: String,
    /// When this engine noticed.
    pub at: SystemTime,
    /// For [`PeerEventKind::TornWrite`], the region and bytes; `None` otherwise.
    pub torn: Option<TornRange>,
}

struct State<T> {
    /// Each item with its size and its sender's key (0: not counted per sender).
    items: VecDeque<(T, usize, u64)>,
    bytes: usize,
    /// Bytes held per sender key.
    per_sender: HashMap<u64, usize>,
    dropped: u64,
    /// The wakers of the futures waiting, by each future's registration id: a future
    /// dropped unresolved takes its own out.
    wakers: HashMap<u64, Waker>,
    /// The last registration id handed out.
    last_waiter: u64,
}

/// A bounded queue that can be waited on and awaited.
pub(crate) struct Mailbox<T> {
    state: Mutex<State<T>>,
    cond: Condvar,
}

impl<T> Mailbox<T> {
    pub(crate) fn new() -> Mailbox<T> {
        Mailbox {
            state: Mutex::new(State {
                items: VecDeque::new(),
                bytes: 0,
                per_sender: HashMap::new(),
                dropped: 0,
                wakers: HashMap::new(),
                last_waiter: 0,
            }),
            cond: Condvar::new(),
        }
    }

    fn wake(&self, mut s: crate::sync::MutexGuard<'_, State<T>>) {
        let wakers = std::mem::take(&mut s.wakers);
        drop(s);
        self.cond.notify_one();
        for w in wakers.into_values() {
            w.wake();
        }
    }

    /// Queues `item` of `size` bytes from the sender keyed `sender` unless that would
    /// pass `budget` bytes in all, or `share` bytes from that sender: one sender cannot
    /// take the whole budget and lock the others out.
    pub(crate) fn push_within(
        &self,
        item: T,
        size: usize,
        (budget, share): (usize, usize),
        sender: u64,
    ) -> Result<()> {
        let mut s = self.state.lock();
        let theirs = s.per_sender.get(&sender).copied().unwrap_or(0);
        if theirs + size > share {
            return Err(Error::new(
                ErrorKind::Busy,
                format!(
                    "the receiver holds {theirs} bytes of this sender's unread notifications, its share of the budget is {share}; it must read them (or raise notification_bytes)"
                ),
            ));
        }
        if s.bytes + size > budget {
            return Err(Error::new(
                ErrorKind::Busy,
                format!(
                    "the receiver holds {} bytes of unread notifications and its budget is {budget}; it must read them (or raise notification_bytes)",
                    s.bytes
                ),
            ));
        }
        s.bytes += size;
        *s.per_sender.entry(sender).or_default() += size;
        s.items.push_back((item, size, sender));
        self.wake(s);
        Ok(())
    }

    /// Queues `item`, dropping the oldest beyond `capacity` items.
    pub(crate) fn push_dropping(&self, item: T, capacity: usize) {
        let mut s = self.state.lock();
        while s.items.len() >= capacity.max(1) {
            if let Some((_, size, sender)) = s.items.pop_front() {
                Mailbox::uncount(&mut *s, size, sender);
                s.dropped += 1;
            }
        }
        s.items.push_back((item, 0, 0));
        self.wake(s);
    }

    /// Items dropped because the queue was full.
    pub(crate) fn dropped(&self) -> u64 {
        self.state.lock().dropped
    }

    fn uncount(s: &mut State<T>, size: usize, sender: u64) {
        s.bytes -= size;
        if size > 0 {
            if let std::collections::hash_map::Entry::Occupied(mut e) = s.per_sender.entry(sender) {
                *e.get_mut() -= size;
                if *e.get() == 0 {
                    e.remove();
                }
            }
        }
    }

    fn take(s: &mut State<T>) -> Option<T> {
        let (item, size, sender) = s.items.pop_front()?;
        Mailbox::uncount(s, size, sender);
        Some(item)
    }

    /// The next item, waiting at most `timeout` (a deadline, so one past the clock's
    /// range waits without limit).
    pub(crate) fn pop(&self, timeout: Duration) -> Option<T> {
        let end = crate::Deadline::after(timeout);
        let mut s = self.state.lock();
        loop {
            if let Some(item) = Mailbox::take(&mut s) {
                return Some(item);
            }
            let left = end.remaining();
            if left.is_zero() {
                return None;
            }
            s = self.cond.wait_timeout(s, left).0;
        }
    }

    /// Everything queued, without waiting.
    pub(crate) fn drain(&self) -> Vec<T> {
        let mut s = self.state.lock();
        s.bytes = 0;
        s.per_sender.clear();
        s.items.drain(..).map(|(item, ..)| item).collect()
    }

    /// A future of the next item.
    pub(crate) fn next(&self) -> Next<'_, T> {
        Next {
            mailbox: self,
            waiter: None,
        }
    }
}

/// The future `Engine::next_notification` and `Engine::next_event` return. Dropped
/// before it resolves, it lets its waker go.
pub struct Next<'a, T> {
    mailbox: &'a Mailbox<T>,
    /// Its registration among the mailbox's wakers, once it has waited.
    waiter: Option<u64>,
}

impl<T> std::fmt::Debug for Next<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Next")
    }
}

impl<T> Future for Next<'_, T> {
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let this = self.get_mut();
        let mut s = this.mailbox.state.lock();
        if let Some(item) = Mailbox::take(&mut s) {
            if let Some(id) = this.waiter.take() {
                s.wakers.remove(&id);
            }
            return Poll::Ready(item);
        }
        let id = *this.waiter.get_or_insert_with(|| {
            s.last_waiter += 1;
            s.last_waiter
        });
        match s.wakers.get_mut(&id) {
            Some(w) if w.will_wake(cx.waker()) => {}
            Some(w) => w.clone_from(cx.waker()),
            None => {
                s.wakers.insert(id, cx.waker().clone());
            }
        }
        Poll::Pending
    }
}

impl<T> Drop for Next<'_, T> {
    fn drop(&mut self) {
        if let Some(id) = self.waiter {
            self.mailbox.state.lock().wakers.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_byte_budget_refuses_with_busy_and_reading_frees_it() {
        let m = Mailbox::new();
        m.push_within(1, 60, (100, 100), 1).unwrap();
        let e = m.push_within(2, 60, (100, 100), 2).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Busy);
        assert_eq!(m.pop(Duration::ZERO), Some(1));
        m.push_within(2, 60, (100, 100), 2).unwrap();
        assert_eq!(m.drain(), vec![2]);
        assert!(m.drain().is_empty());
    }

    #[test]
    fn a_sender_past_its_share_is_refused_while_others_still_fit() {
        let m = Mailbox::new();
        m.push_within(1, 40, (100, 50), 7).unwrap();
        let e = m.push_within(2, 20, (100, 50), 7).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Busy);
        assert!(e.to_string().contains("share"), "{e}");
        m.push_within(3, 40, (100, 50), 8).unwrap();
        assert_eq!(m.pop(Duration::ZERO), Some(1));
        m.push_within(2, 20, (100, 50), 7).unwrap();
        assert_eq!(m.drain(), vec![3, 2]);
    }

    #[test]
    fn a_timeout_past_the_clocks_range_waits_without_limit() {
        let m = Mailbox::new();
        m.push_dropping(7, 3);
        assert_eq!(m.pop(Duration::MAX), Some(7));
    }

    #[test]
    fn a_full_event_queue_drops_the_oldest_and_counts_them() {
        let m = Mailbox::new();
        for i in 0..5 {
            m.push_dropping(i, 3);
        }
        assert_eq!(m.drain(), vec![2, 3, 4]);
        assert_eq!(m.dropped(), 2);
    }

    #[test]
    fn an_awaited_item_wakes_its_waker() {
        use std::sync::Arc;
        use std::task::Wake;
        struct Flag(std::sync::atomic::AtomicBool);
        impl Wake for Flag {
            fn wake(self: Arc<Self>) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let m = Mailbox::new();
        let flag = Arc::new(Flag(std::sync::atomic::AtomicBool::new(false)));
        let waker = Waker::from(flag.clone());
        let mut next = m.next();
        assert!(Pin::new(&mut next)
            .poll(&mut Context::from_waker(&waker))
            .is_pending());
        m.push_dropping(7, 10);
        assert!(flag.0.load(std::sync::atomic::Ordering::SeqCst));
        assert_eq!(
            Pin::new(&mut next).poll(&mut Context::from_waker(&waker)),
            Poll::Ready(7)
        );
    }

    #[test]
    fn a_future_polled_again_keeps_only_its_latest_waker_and_drops_it_with_itself() {
        use std::sync::Arc;
        use std::task::Wake;
        struct Flag(std::sync::atomic::AtomicBool);
        impl Wake for Flag {
            fn wake(self: Arc<Self>) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let m: Mailbox<i32> = Mailbox::new();
        let (first, second) = (
            Arc::new(Flag(std::sync::atomic::AtomicBool::new(false))),
            Arc::new(Flag(std::sync::atomic::AtomicBool::new(false))),
        );
        let mut next = m.next();
        for flag in [&first, &second] {
            let waker = Waker::from(flag.clone());
            assert!(Pin::new(&mut next)
                .poll(&mut Context::from_waker(&waker))
                .is_pending());
        }
        assert_eq!(m.state.lock().wakers.len(), 1, "one waker per future");
        assert_eq!(Arc::strong_count(&first), 1, "the first waker was let go");
        drop(next);
        assert!(m.state.lock().wakers.is_empty());
        assert_eq!(Arc::strong_count(&second), 1, "the second waker was let go");
        m.push_dropping(7, 10);
        assert!(!second.0.load(std::sync::atomic::Ordering::SeqCst));
    }
}
