//! The engine's peers and inbox against their standards, through the public API: a
//! notification or event future lets its waker go when it is dropped, a peer of one
//! engine is never sent to another engine's peer of the same backend id, and peers
//! that left are let go (their descriptor, metrics series and backend connection).
//!
//! Most tests drive a hand-made backend (`Manual`) through `Engine::with_backend`.

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Wake, Waker};

use common::manual::{engine, Manual};
use common::serial;

/// Counts how many of these wakers are alive.
struct Counted(Arc<AtomicUsize>);

impl Counted {
    fn waker(live: &Arc<AtomicUsize>) -> Waker {
        live.fetch_add(1, Ordering::SeqCst);
        Waker::from(Arc::new(Counted(live.clone())))
    }
}

impl Wake for Counted {
    fn wake(self: Arc<Self>) {}
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[test]
fn a_dropped_notification_or_event_future_lets_its_waker_go() {
    let _serial = serial();
    let e = engine(&Manual::new(true), |_| {});
    let live = Arc::new(AtomicUsize::new(0));
    // Tasks that each wait a while for a notification or an event, then give up (a
    // timeout around the future), and are gone.
    const TASKS: usize = 1000;
    for _ in 0..TASKS {
        let waker = Counted::waker(&live);
        let mut cx = Context::from_waker(&waker);
        let mut next = e.next_notification();
        assert!(Pin::new(&mut next).poll(&mut cx).is_pending());
        let mut event = e.next_event();
        assert!(Pin::new(&mut event).poll(&mut cx).is_pending());
    }
    let kept = live.load(Ordering::SeqCst);
    assert_eq!(
        kept, 0,
        "{TASKS} tasks polled next_notification() and next_event() once and dropped both futures; \
         the engine still holds {kept} of their wakers (and, through them, what the tasks hold), \
         growing with every such task until a notification or event arrives"
    );
}
