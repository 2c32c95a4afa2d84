//! Hostile or corrupt peers, driven directly through `TransferBackend` over the FAKE
//! shim: descriptors that run past the address space or name a connected instance from
//! elsewhere, and peers that ignore the rights a target gave its regions. Every test is
//! bounded; they run one at a time (a process-wide lock).

use std::time::{Duration, Instant};

use te_core::testkit::pattern;
use te_core::{Access, ErrorKind, RegionId, TransferBackend, TransferRequest};

mod direct;
use direct::*;

/// A peer's descriptor whose region runs past the end of the address space (addr + len
/// overflows) must be refused at connect (as te-rdma does), not accepted and then
/// trusted by `Poster::plan`, whose `remote_addr + remote_offset` overflows. When the
/// batch was parked, that happens on the completion thread: it dies, and every later
/// batch of every peer hangs.
#[test]
fn a_descriptor_running_past_the_address_space_is_refused_and_kills_no_thread() {
    let _g = serial();
    let target = backend("");
    let dst = Mem::new(LEN);
    let d1 = register(&target, 1, &dst, Access::REMOTE_READ_WRITE);
    // A slow handshake, so that the batch naming the new region parks while the
    // connection is renewed.
    let initiator = backend("connect_delay_ms=300");
    let src = Mem::new(LEN);
    register(&initiator, 10, &src, Access::LOCAL);
    let good = segment(target.endpoint(), "127.0.0.1:7001", vec![d1.clone()]);
    let peer = connect(&initiator, &good);

    let hostile = region(2, u64::MAX - 4095, 8192, Access::REMOTE_READ_WRITE);
    let seg = segment(target.endpoint(), "127.0.0.1:7001", vec![d1, hostile]);
    let accepted = match initiator.connect_within(&seg, Instant::now() + Duration::from_millis(1)) {
        Err(e) if matches!(e.kind(), ErrorKind::Protocol | ErrorKind::InvalidRequest) => false,
        other => {
            eprintln!("connect with a region at 0xffff_ffff_ffff_f000 of 8192 bytes: {other:?}");
            true
        }
    };
    let mut problems = Vec::new();
    if accepted {
        problems.push(
            "a descriptor whose region 2 runs past the end of the address space was not refused at connect"
                .to_string(),
        );
        // Offset 5000 fits the descriptor's 8192 bytes; the address does not exist.
        let (done, hostile_rx) = completion(Duration::from_secs(5));
        let req = TransferRequest::write(RegionId(10), 0, RegionId(2), 5000, 100);
        let submitted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            initiator.submit(peer, &[req], done)
        }));
        match submitted {
            Err(_) => problems.push("submit panicked on the hostile region".into()),
            Ok(r) => {
                eprintln!("submit to the hostile region: {r:?}");
                eprintln!(
                    "hostile batch: {:?}",
                    hostile_rx.recv_timeout(Duration::from_secs(3))
                );
            }
        }
    }
    // The backend must keep serving the good region.
    src.write(&pattern(LEN, 3));
    match run(
        &initiator,
        peer,
        TransferRequest::write(RegionId(10), 0, RegionId(1), 0, LEN as u64),
    ) {
        Some(Ok(())) => {}
        Some(Err(e)) => problems.push(format!("a good batch afterwards failed: {e:?}")),
        None => problems
            .push("a good batch afterwards never completed (the completion thread is gone)".into()),
    }
    drop(initiator);
    drop(target);
    assert!(problems.is_empty(), "{}", problems.join("; "));
}
