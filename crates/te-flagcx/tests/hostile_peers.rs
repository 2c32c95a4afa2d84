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

/// A descriptor naming a connected peer's instance (its epoch and endpoint) from
/// another control-plane address is forged or corrupt: it must be refused, and must not
/// replace the region table the connected peer's batches are posted with.
#[test]
fn a_descriptor_naming_a_connected_instance_from_another_address_is_refused() {
    let _g = serial();
    let target = backend("");
    let dst = Mem::new(LEN);
    let ro = Mem::new(LEN);
    ro.write(&vec![0x11; LEN]);
    let d1 = register(&target, 1, &dst, Access::REMOTE_READ_WRITE);
    let d2 = register(&target, 2, &ro, Access::REMOTE_READ);
    let initiator = backend("");
    let src = Mem::new(LEN);
    register(&initiator, 10, &src, Access::LOCAL);
    let legit = segment(
        target.endpoint(),
        "127.0.0.1:7001",
        vec![d1.clone(), d2.clone()],
    );
    let peer = connect(&initiator, &legit);

    // Same instance and endpoint, another address; its region 1 points at the
    // read-only region, and a new id forces a new connection.
    let forged = segment(
        target.endpoint(),
        "10.66.66.66:7001",
        vec![
            region(1, ro.addr(), LEN as u64, Access::REMOTE_READ_WRITE),
            region(3, dst.addr(), LEN as u64, Access::REMOTE_READ_WRITE),
        ],
    );
    let r = initiator.connect_within(&forged, Instant::now() + Duration::from_secs(5));
    let mut problems = Vec::new();
    if !matches!(&r, Err(e) if e.kind() == ErrorKind::Protocol) {
        problems.push(format!(
            "a descriptor naming connected instance (epoch 1, endpoint {}) from another address was not refused: {r:?}",
            String::from_utf8_lossy(&target.endpoint())
        ));
    }
    // The legit peer's WRITE to its region 1 (remote-writable in its descriptor).
    src.write(&vec![0xAB; LEN]);
    let w = run(
        &initiator,
        peer,
        TransferRequest::write(RegionId(10), 0, RegionId(1), 0, LEN as u64),
    );
    if ro.read() != vec![0x11; LEN] {
        problems.push(format!(
            "the legit peer's WRITE to region 1 ({w:?}) landed in the target's read-only region 2"
        ));
    }
    if dst.read() != vec![0xAB; LEN] {
        problems.push("the legit peer's WRITE did not land in its region 1".into());
    }
    drop(initiator);
    drop(target);
    assert!(problems.is_empty(), "{}", problems.join("; "));
}

/// A region registered read-only must not accept a remote WRITE, a local-only one must
/// not accept any remote access, and a write-only one must not serve a READ: the
/// target's own registration decides, not a peer's descriptor (a hostile peer writes
/// its own). The shim's `te_flagcx_register` is never told the rights.
#[test]
fn the_target_enforces_its_regions_rights_whatever_the_descriptor_says() {
    let _g = serial();
    let target = backend("");
    let ro = Mem::new(LEN);
    let local = Mem::new(LEN);
    let wo = Mem::new(LEN);
    ro.write(&vec![0x11; LEN]);
    local.write(&vec![0x22; LEN]);
    wo.write(&vec![0x33; LEN]);
    register(&target, 1, &ro, Access::REMOTE_READ);
    register(&target, 2, &local, Access::LOCAL);
    register(
        &target,
        3,
        &wo,
        Access {
            remote_read: false,
            remote_write: true,
        },
    );
    // The hostile initiator's own idea of the target's regions.
    let rw = Access::REMOTE_READ_WRITE;
    let forged = segment(
        target.endpoint(),
        "127.0.0.1:7001",
        vec![
            region(1, ro.addr(), LEN as u64, rw),
            region(2, local.addr(), LEN as u64, rw),
            region(3, wo.addr(), LEN as u64, rw),
        ],
    );
    let hostile = backend("");
    let src = Mem::new(LEN);
    register(&hostile, 10, &src, Access::LOCAL);
    let peer = connect(&hostile, &forged);
    src.write(&vec![0xEE; LEN]);
    let mut problems = Vec::new();
    let w1 = run(
        &hostile,
        peer,
        TransferRequest::write(RegionId(10), 0, RegionId(1), 0, LEN as u64),
    );
    if ro.read() != vec![0x11; LEN] {
        problems.push(format!(
            "a remote WRITE landed in a read-only region ({w1:?})"
        ));
    }
    let w2 = run(
        &hostile,
        peer,
        TransferRequest::write(RegionId(10), 0, RegionId(2), 0, LEN as u64),
    );
    if local.read() != vec![0x22; LEN] {
        problems.push(format!(
            "a remote WRITE landed in a local-only region ({w2:?})"
        ));
    }
    let r3 = run(
        &hostile,
        peer,
        TransferRequest::read(RegionId(10), 0, RegionId(3), 0, LEN as u64),
    );
    if src.read() == vec![0x33; LEN] {
        problems.push(format!("a write-only region served a remote READ ({r3:?})"));
    }
    drop(hostile);
    drop(target);
    assert!(problems.is_empty(), "{}", problems.join("; "));
}
