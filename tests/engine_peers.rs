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
use std::time::{Duration, Instant};

use te::{Access, Engine, ErrorKind, RegionId, TransferRequest};

use common::manual::{engine, register, Manual};
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

#[test]
fn a_peer_of_another_engine_is_refused_or_reached() {
    let _serial = serial();
    let tcp = |name: &str| {
        let mut c = te::Config::defaults();
        c.engine.name = format!("peers-{name}-{}", std::process::id());
        c.engine.backend = "tcp".into();
        Engine::from_config(&c).expect("tcp engine")
    };
    let (one, two, b, c) = (tcp("one"), tcp("two"), tcp("b"), tcp("c"));
    let at_b = b.alloc("b", 4096, Access::REMOTE_READ_WRITE).unwrap();
    let at_c = c.alloc("c", 4096, Access::REMOTE_READ_WRITE).unwrap();
    let src = two.alloc("src", 4096, Access::LOCAL).unwrap();
    src.write(0, &[7u8; 4096]).unwrap();
    // Each engine connects to both, in another order.
    let b_of_one = one.connect(&b.address().to_string()).unwrap();
    one.connect(&c.address().to_string()).unwrap();
    two.connect(&c.address().to_string()).unwrap();
    two.connect(&b.address().to_string()).unwrap();
    // Engine `two` is handed engine `one`'s handle on `b` (two engines in one
    // program, one per device, are common).
    let options = te::TransferOptions {
        timeout: Some(Duration::from_secs(5)),
        ..Default::default()
    };
    let r = two
        .transfer_with(
            &b_of_one,
            &[TransferRequest::write(src.id(), 0, at_b.id(), 0, 4096)],
            &options,
        )
        .and_then(|h| h.wait());
    let (mut got_b, mut got_c) = (vec![0u8; 4096], vec![0u8; 4096]);
    at_b.read(0, &mut got_b).unwrap();
    at_c.read(0, &mut got_c).unwrap();
    assert_eq!(got_c, vec![0u8; 4096], "bytes for b landed at c");
    match r {
        Ok(()) => assert_eq!(
            got_b,
            vec![7u8; 4096],
            "the write reported done did not land"
        ),
        Err(e) => assert_eq!(
            e.kind(),
            ErrorKind::InvalidRequest,
            "a Peer that engine `one` made was used with engine `two`, which sent the batch to its \
             own backend peer of the same id (engine c) instead of b, and failed with c's refusal: \
             {e}"
        ),
    }
    // Refreshing it through the other engine is refused too.
    let refused = two.refresh(&b_of_one, Duration::from_secs(5)).unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::InvalidRequest, "{refused}");
    // And the other engine says nothing of its path.
    assert!(one.path_to(&b_of_one).is_some(), "tcp names its paths");
    assert_eq!(
        two.path_to(&b_of_one),
        None,
        "engine `two` described its peer c"
    );
}

#[test]
fn peers_that_left_are_let_go() {
    let _serial = serial();
    let backend = Manual::new(true);
    let e = engine(&backend, |_| {});
    const PEERS: usize = 6;
    let mut held = Vec::new();
    for _ in 0..PEERS {
        let gone = engine(&Manual::new(true), |_| {});
        held.push(e.connect(&gone.address().to_string()).expect("connect"));
        // The peer shuts down: it says goodbye on its session.
        drop(gone);
    }
    // Let go on the control plane's thread after each departure: wait (10 s at most)
    // until every one has been.
    let end = Instant::now() + Duration::from_secs(10);
    let let_go = || {
        let m = e.metrics();
        m.peers_left == PEERS as u64 && m.peers.is_empty() && backend.peers_held() == 0
    };
    while !let_go() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
    let m = e.metrics();
    assert_eq!(m.peers_left, PEERS as u64, "the engine saw each peer leave");
    assert!(
        m.peers.is_empty() && backend.peers_held() == 0,
        "{PEERS} peers connected and left, each saying goodbye; the engine still lists {} of them \
         in its metrics (docs/metrics.md: `peers` are the connected peers, and the metrics endpoint \
         labels a series with each) and its backend still holds {} connections, never disconnected: \
         a decode engine whose prefill peers come and go grows without bound",
        m.peers.len(),
        backend.peers_held()
    );
    // A handle the user still holds on a departed peer fails clearly, without panic.
    let src = register(&e, "src", 4096, Access::LOCAL);
    let write = [TransferRequest::write(src.id(), 0, RegionId(1), 0, 4096)];
    let refused = e.transfer(&held[0], &write).unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::PeerUnreachable, "{refused}");
    assert!(!held[0].is_valid());
}
