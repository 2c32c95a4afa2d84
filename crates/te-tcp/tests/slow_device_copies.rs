//! A connection whose READ answers wait for slow device copies into the caller's
//! memory is still making progress: another batch on it passing its deadline must not
//! make the deadline watcher take the connection for stalled and close it under a batch
//! with time left. fakedev's copies are made slow (a launch cost per group) for this
//! whole process, so this binary holds this one test.

mod common;

use std::sync::mpsc;
use std::time::Duration;

use common::{connect, host, pattern, DevMem};
use te_core::{Access, Completion, Op, RegionId, TransferBackend, TransferRequest};

#[test]
fn slow_copies_into_device_memory_are_not_taken_for_a_stalled_connection() {
    common::fakedev_costs(Duration::from_millis(400), Duration::ZERO);
    let _ = te_core::device::runtime(te_core::device::fakedev::NAME).expect("fakedev");
    let set = |c: &mut te_tcp::TcpConfig| {
        c.local_copies = false;
        c.local_ipc = false;
        c.connections_per_peer = 1;
    };
    let (target, init) = (common::backend_with(set), common::backend_with(set));
    const FRAME: u64 = 512 << 10;
    const FRAMES: u64 = 16;
    let mut remote = pattern((FRAME * FRAMES) as usize, 5);
    host(&target, 1, &mut remote, Access::REMOTE_READ_WRITE);
    let dev = DevMem::new(0, (FRAME * FRAMES) as usize);
    dev.register(&init, 1, Access::LOCAL);
    let mut small = vec![0u8; 4096];
    host(&init, 2, &mut small, Access::LOCAL);
    let peer = connect(&init, &target);
    // A long READ: its frames' copies into the device take 400 ms each.
    let reads: Vec<_> = (0..FRAMES)
        .map(|i| TransferRequest {
            op: Op::Read,
            local: RegionId(1),
            local_offset: i * FRAME,
            remote: RegionId(1),
            remote_offset: i * FRAME,
            len: FRAME,
        })
        .collect();
    let (tx, long) = mpsc::channel();
    let done = Completion::new(Duration::from_secs(60), move |r, _| {
        let _ = tx.send(r);
    });
    init.submit(peer, &reads, done)
        .expect("submit the long READ");
    std::thread::sleep(Duration::from_millis(200));
    // A short batch on the same connection, whose deadline passes meanwhile.
    let (tx, short) = mpsc::channel();
    let done = Completion::new(Duration::from_millis(100), move |r, _| {
        let _ = tx.send(r);
    });
    let w = TransferRequest::read(RegionId(2), 0, RegionId(1), 0, 4096);
    init.submit(peer, &[w], done)
        .expect("submit the short READ");
    let s = short
        .recv_timeout(Duration::from_secs(30))
        .expect("the short batch ends");
    let l = long
        .recv_timeout(Duration::from_secs(60))
        .expect("the long batch ends");
    assert!(
        l.is_ok(),
        "a READ with 60 s left failed while its copies into the device ran ({:?}); the short \
         batch ended {:?}",
        l.as_ref().map_err(|e| e.to_string()),
        s.as_ref().map_err(|e| e.kind())
    );
    assert_eq!(dev.read(), remote, "the long READ's bytes");
    common::deregister(&init, &[1, 2]);
}
