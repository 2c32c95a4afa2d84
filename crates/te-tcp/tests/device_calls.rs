//! What a staged frame of device memory costs each device in driver calls, counted by
//! `fakedev` per device: the initiator's memory is on fakedev:0 and the target's on
//! fakedev:1, so each side's count is its own. This binary holds one test, so nothing
//! else in its process moves `fakedev` bytes while it counts.
//!
//! Also here, since they move fakedev bytes too: every byte of both ops with both sides
//! on the device and with host and device memory mixed in one batch; a failed copy
//! group, of either op on either side, failing exactly its batch and giving its staging
//! back.

mod common;

use std::sync::Arc;

use common::{backend, connect, deregister, host, pattern, run, DevMem};
use te_core::device::fakedev::FakeDev;
use te_core::device::CopyStats;
use te_core::{Access, ErrorKind, Op, RegionId, TransferRequest};

const SMALL: u64 = 4 << 10;
/// 128 blocks of 4 KiB: one 512 KiB frame of 128 entries.
const SLICES: u64 = 128;

fn stats(dev: &FakeDev) -> [CopyStats; 2] {
    [dev.device_stats(0), dev.device_stats(1)]
}

fn since(dev: &FakeDev, before: &[CopyStats; 2]) -> [CopyStats; 2] {
    let now = stats(dev);
    [now[0].since(&before[0]), now[1].since(&before[1])]
}

/// Block `first + i * 53 mod 128` of local region `local` to or from block
/// `i * 37 mod 128` of remote region `remote`, `SMALL` bytes each: scattered on both
/// sides, so neither side's copies merge.
fn scattered(op: Op, local: u64, remote: u64, first: u64) -> Vec<TransferRequest> {
    (0..SLICES)
        .map(|i| TransferRequest {
            op,
            local: RegionId(local),
            local_offset: (first + i * 53 % SLICES) * SMALL,
            remote: RegionId(remote),
            remote_offset: (i * 37 % SLICES) * SMALL,
            len: SMALL,
        })
        .collect()
}

fn assert_landed(landed: &[u8], data: &[u8], first: u64) {
    let b = SMALL as usize;
    for i in 0..SLICES as usize {
        let n = SLICES as usize;
        let (at, from) = ((i * 37 % n) * b, (first as usize + i * 53 % n) * b);
        assert!(
            landed[at..at + b] == data[from..from + b],
            "block {i} landed intact"
        );
    }
}

#[test]
fn a_frame_of_128_device_slices_costs_each_side_at_most_two_device_calls() {
    let total = (SMALL * SLICES) as usize;
    // Staged over the socket, as to a peer in another process.
    let (target, init) = (backend(false), backend(false));
    let remote = DevMem::new(1, 2 * total);
    remote.register(&target, 1, Access::REMOTE_READ_WRITE);
    let src = DevMem::new(0, 2 * total);
    let back = DevMem::new(0, 2 * total);
    src.register(&init, 1, Access::LOCAL);
    back.register(&init, 2, Access::LOCAL);
    let data = pattern(2 * total, 1);
    src.fill(&data);
    let peer = connect(&init, &target);
    let dev =
        te_core::device::fakedev::process().expect("the process's fakedev runtime is running");
    let dev: Arc<FakeDev> = dev;

    // WRITE: one 512 KiB frame of 128 scattered entries. The initiator gathers it from
    // fakedev:0 with one batched call; the target scatters it into fakedev:1 with one.
    let before = stats(&dev);
    run(&init, peer, &scattered(Op::Write, 1, 1, 0)).expect("write 128 x 4 KiB");
    let [mine, theirs] = since(&dev, &before);
    assert_landed(&remote.read(), &data, 0);
    assert_eq!(
        (mine.copies, theirs.copies),
        (SLICES, SLICES),
        "{mine:?} {theirs:?}"
    );
    assert!(
        mine.calls <= 2 && theirs.calls <= 2,
        "a 128-slice frame took {} device calls at the initiator and {} at the target",
        mine.calls,
        theirs.calls
    );
    assert!(mine.syncs <= 1 && theirs.syncs <= 1, "{mine:?} {theirs:?}");

    // READ it back into other device memory: the same on the way back.
    let before = stats(&dev);
    run(&init, peer, &scattered(Op::Read, 2, 1, 0)).expect("read 128 x 4 KiB");
    let [mine, theirs] = since(&dev, &before);
    let got = back.read();
    let b = SMALL as usize;
    for i in 0..SLICES as usize {
        let at = (i * 53 % SLICES as usize) * b;
        assert!(
            got[at..at + b] == data[at..at + b],
            "block {i} read back intact"
        );
    }
    assert!(
        mine.calls <= 2 && theirs.calls <= 2,
        "read: {} calls at the initiator, {} at the target",
        mine.calls,
        theirs.calls
    );

    // Host and device memory in one batch, both ops: the host blocks go as host
    // frames, the device ones staged, every byte where it belongs.
    let mut h = pattern(total, 1).into_iter().rev().collect::<Vec<u8>>();
    let want = h.clone();
    host(&init, 3, &mut h, Access::LOCAL);
    let mut mixed = scattered(Op::Write, 1, 1, SLICES);
    for r in mixed.iter_mut().skip(1).step_by(2) {
        r.local = RegionId(3);
        r.local_offset -= SLICES * SMALL;
    }
    run(&init, peer, &mixed).expect("a mixed write");
    let landed = remote.read();
    for (i, r) in mixed.iter().enumerate() {
        let (at, from, n) = (
            r.remote_offset as usize,
            r.local_offset as usize,
            SMALL as usize,
        );
        let src: &[u8] = if r.local == RegionId(3) { &want } else { &data };
        assert!(landed[at..at + n] == src[from..from + n], "mixed block {i}");
    }
    let mut h2 = vec![0u8; total];
    host(&init, 4, &mut h2, Access::LOCAL);
    let mut read_mixed = scattered(Op::Read, 2, 1, SLICES);
    for r in read_mixed.iter_mut().skip(1).step_by(2) {
        r.local = RegionId(4);
        r.local_offset -= SLICES * SMALL;
    }
    run(&init, peer, &read_mixed).expect("a mixed read");
    let got = back.read();
    for r in &read_mixed {
        let (from, to, n) = (
            r.remote_offset as usize,
            r.local_offset as usize,
            SMALL as usize,
        );
        let dst: &[u8] = if r.local == RegionId(4) { &h2 } else { &got };
        assert!(
            dst[to..to + n] == landed[from..from + n],
            "mixed read at {to}"
        );
    }

    // A failed copy group fails its batch alone, and gives its staging back: for each
    // op, a copy group fails once at the initiator, then once at the target (a WRITE's
    // gather there and scatter here, a READ's the other way round).
    for (op, local) in [(Op::Write, 1), (Op::Read, 2)] {
        for (side, ordinal) in [("initiator", 0), ("target", 1)] {
            dev.fail_next(ordinal, 1);
            let e = run(&init, peer, &scattered(op, local, 1, 0)).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Backend, "{op:?} {side}: {e}");
            assert!(e.to_string().contains("injected"), "{op:?} {side}: {e}");
            // 32 MiB in 64 frames of 512 KiB: eight times the staging ring of each
            // direction, so a range the failure kept would stop the ring coming round.
            let whole = TransferRequest {
                op,
                local: RegionId(local),
                local_offset: 0,
                remote: RegionId(1),
                remote_offset: 0,
                len: (2 * total) as u64,
            };
            let big = vec![whole; 32];
            run(&init, peer, &big).expect("the staging came back: a batch of 4 rings goes through");
            run(&init, peer, &scattered(op, local, 1, 0)).expect("the next batch succeeds");
        }
    }
    assert_landed(&remote.read(), &data, 0);

    deregister(&init, &[1, 2, 3, 4]);
    deregister(&target, &[1]);
    drop((h, h2));
}
