//! A peer in this process: device memory moves device to device, and the target's
//! checks still hold. Counted by `fakedev`'s synchronisations, so this binary holds one
//! test: nothing else in its process moves `fakedev` bytes while it counts.

mod common;

use common::{connect, deregister, pattern, requests, run, DevMem, Pair, BLOCK, BLOCKS, SLICE};
use te_core::{Access, ErrorKind, Op, RegionId, TransferRequest};

#[test]
fn device_frames_to_a_peer_in_this_process_are_device_copies_checked_by_the_target() {
    let total = (BLOCK * BLOCKS) as usize;
    let Pair {
        target,
        init,
        remote,
        src: _src,
        back,
        data,
        peer,
    } = Pair::new(true);
    let dev =
        te_core::device::fakedev::process().expect("the process's fakedev runtime is running");
    // 8 frames of 512 KiB. Staged, each costs a group at both ends (16 in all); device
    // to device, one group each.
    let frames = BLOCK * BLOCKS / SLICE;

    let before = dev.syncs();
    run(&init, peer, &requests(Op::Write, 1)).expect("write 128 x 32 KiB");
    let write_syncs = dev.syncs() - before;
    common::assert_scattered(&remote.read(), &data);
    let before = dev.syncs();
    run(&init, peer, &requests(Op::Read, 2)).expect("read 128 x 32 KiB");
    let read_syncs = dev.syncs() - before;
    assert!(back.read() == data, "the blocks read back intact");
    assert!(
        (1..=frames).contains(&write_syncs) && (1..=frames).contains(&read_syncs),
        "device to device: at most one group per frame, not staged at both ends \
         (write {write_syncs}, read {read_syncs}, frames {frames})"
    );

    // Blocks adjacent on both sides are merged into one copy per run; every byte lands.
    let contiguous: Vec<TransferRequest> = (0..BLOCKS)
        .map(|i| TransferRequest {
            op: Op::Write,
            local: RegionId(1),
            local_offset: i * BLOCK,
            remote: RegionId(1),
            remote_offset: i * BLOCK,
            len: BLOCK,
        })
        .collect();
    run(&init, peer, &contiguous).expect("write 128 adjacent blocks");
    assert!(remote.read() == data, "adjacent blocks landed intact");

    // The target's rights, bounds and registrations are checked as for a served frame.
    let ro = DevMem::new(0, total);
    ro.register(&target, 2, Access::REMOTE_READ);
    // Reads land in region 2, so the source of the writes below stays as it was.
    let one = |op, remote: u64, remote_offset: u64| {
        [TransferRequest {
            op,
            local: RegionId(if op == Op::Read { 2 } else { 1 }),
            local_offset: 0,
            remote: RegionId(remote),
            remote_offset,
            len: BLOCK,
        }]
    };
    let before = ro.read();
    let e = run(&init, peer, &one(Op::Write, 2, 0)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{e}");
    assert!(e.to_string().contains("not remotely writable"), "{e}");
    assert!(ro.read() == before, "a refused write placed nothing");
    let e = run(&init, peer, &one(Op::Write, 1, total as u64 - 100)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
    let e = run(&init, peer, &one(Op::Read, 9, 0)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotRegistered, "{e}");
    run(&init, peer, &one(Op::Read, 2, 0)).expect("a read of a read-only region");

    // Another device of the same runtime: the frames go over the socket, staged.
    let other = DevMem::new(1, total);
    other.register(&target, 3, Access::REMOTE_READ_WRITE);
    let to_other: Vec<TransferRequest> = requests(Op::Write, 1)
        .into_iter()
        .map(|r| TransferRequest {
            remote: RegionId(3),
            ..r
        })
        .collect();
    let before = dev.syncs();
    run(&init, peer, &to_other).expect("write to device 1");
    let staged = dev.syncs() - before;
    common::assert_scattered(&other.read(), &data);
    assert!(
        staged >= 2 * frames,
        "another device is staged at both ends ({staged} groups for {frames} frames)"
    );

    // A region moved into itself, the two ranges overlapping: staged, not a device copy
    // (undefined for overlapping ranges), so what lands is what was there before.
    let own = DevMem::new(0, 4 * BLOCK as usize);
    own.register(&init, 5, Access::REMOTE_READ_WRITE);
    let was = pattern(4 * BLOCK as usize, 1);
    own.fill(&was);
    let me = connect(&init, &init);
    let shift = [TransferRequest {
        op: Op::Write,
        local: RegionId(5),
        local_offset: 0,
        remote: RegionId(5),
        remote_offset: BLOCK,
        len: 2 * BLOCK,
    }];
    let before = dev.syncs();
    run(&init, me, &shift).expect("an overlapping write into the same region");
    let groups = dev.syncs() - before;
    assert_eq!(
        groups, 2,
        "staged: one group out of the device, one back in"
    );
    let (b, now) = (BLOCK as usize, own.read());
    assert!(
        now[b..3 * b] == was[..2 * b],
        "the bytes from before the move landed"
    );

    deregister(&init, &[1, 2, 5]);
    deregister(&target, &[1, 2, 3]);
}
