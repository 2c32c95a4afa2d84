//! What closing a backend leaves behind, driven directly through `TransferBackend` over
//! the FAKE shim: batches cancelled at close with their transfers still queued. Every
//! test is bounded; they run one at a time (a process-wide lock).

use std::sync::mpsc;
use std::time::Duration;

use te_core::testkit::pattern;
use te_core::{Access, Completion, RegionId, TransferBackend, TransferRequest};

mod direct;
use direct::*;

/// Dropping the backend with two batches in flight on one connection: each batch must
/// be reported cancelled only once nothing touches its memory any more. `InFlight`'s
/// field order closes the connection before the completion runs only when the batch is
/// the connection's last user; the first batch dropped reports "cancelled" while the
/// second still holds the connection open, so its queued READ still lands in memory the
/// caller was just handed back.
#[test]
fn a_batch_cancelled_at_close_is_not_written_after_its_completion() {
    let _g = serial();
    let target = backend("");
    let dst = Mem::new(LEN);
    dst.write(&pattern(LEN, 5));
    let d1 = register(&target, 1, &dst, Access::REMOTE_READ_WRITE);
    // Transfers move their bytes 300 ms after they were posted.
    let initiator = backend("delay_ms=300");
    let a = std::sync::Arc::new(Mem::new(LEN));
    let b = Mem::new(LEN);
    register(&initiator, 10, &a, Access::LOCAL);
    register(&initiator, 11, &b, Access::LOCAL);
    let peer = connect(
        &initiator,
        &segment(target.endpoint(), "127.0.0.1:7001", vec![d1]),
    );
    let (tx, rx) = mpsc::channel();
    let mem = a.clone();
    let done_a = Completion::new(Duration::from_secs(10), move |r, dropped| {
        // The caller got its memory back: it reuses it at once.
        mem.write(&vec![0xEE; LEN]);
        std::thread::sleep(Duration::from_millis(700));
        let intact = mem.read() == vec![0xEE; LEN];
        let _ = tx.send((r.is_ok(), dropped, intact));
    });
    let (done_b, _rx_b) = completion(Duration::from_secs(10));
    initiator
        .submit(
            peer,
            &[TransferRequest::read(
                RegionId(10),
                0,
                RegionId(1),
                0,
                LEN as u64,
            )],
            done_a,
        )
        .expect("submit a");
    initiator
        .submit(
            peer,
            &[TransferRequest::read(
                RegionId(11),
                0,
                RegionId(1),
                0,
                LEN as u64,
            )],
            done_b,
        )
        .expect("submit b");
    // Both batches reach the completion thread's list of batches in flight.
    std::thread::sleep(Duration::from_millis(50));
    drop(initiator);
    let got = rx.recv_timeout(Duration::from_secs(5));
    drop(target);
    let (ok, dropped, intact) = got.expect("batch a never completed");
    assert!(
        intact,
        "batch a was completed at close (ok={ok}, dropped={dropped}), and its READ then landed in the memory handed back"
    );
}
