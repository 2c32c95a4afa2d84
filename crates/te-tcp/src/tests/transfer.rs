//! Data that lands intact: requests cut into slices, blocks gathered into
//! scatter-gather frames, host and device memory at either end.

use te_core::{Access, RegionId, TransferBackend, TransferRequest};

use super::{backend, connected, pattern, register, run, segment, soon, DevMem, Guarded};

#[test]
fn large_requests_are_sliced_and_land_intact_in_both_directions() {
    let target = backend(|_| {});
    let init = backend(|c| {
        c.slice_size = 4096;
        c.connections_per_peer = 3;
    });
    let len = (1 << 20) + 123;
    let mut remote = vec![0u8; len];
    let mut local: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    let want = local.clone();
    let peer = connected(&target, &mut remote, &init, &mut local);
    let n = len as u64;
    run(
        &init,
        peer,
        &[TransferRequest::write(RegionId(1), 0, RegionId(1), 0, n)],
    )
    .unwrap();
    assert!(remote == want, "the written bytes differ");
    local.fill(0);
    run(
        &init,
        peer,
        &[TransferRequest::read(RegionId(1), 0, RegionId(1), 0, n)],
    )
    .unwrap();
    assert!(local == want, "the read bytes differ");
    init.deregister(RegionId(1), soon()).unwrap();
    target.deregister(RegionId(1), soon()).unwrap();
}

#[test]
fn peers_with_different_slice_sizes_agree_and_device_blocks_move_intact() {
    const BLOCK: u64 = 4 << 20;
    // The target's staging buffers hold 64 KiB; the initiator would cut 8 MiB slices.
    let target = backend(|c| c.slice_size = 64 << 10);
    let init = backend(|c| c.slice_size = 8 << 20);
    let (remote, src, back) = (
        DevMem::new(4 * BLOCK as usize),
        DevMem::new(4 * BLOCK as usize),
        DevMem::new(4 * BLOCK as usize),
    );
    remote.register(&target, 1, Access::REMOTE_READ_WRITE);
    src.register(&init, 1, Access::LOCAL);
    back.register(&init, 2, Access::LOCAL);
    let data = pattern(4 * BLOCK as usize, 7);
    src.fill(&data);
    let peer = init.connect(&segment(&target), soon()).unwrap();
    let reqs = |op, local| -> Vec<TransferRequest> {
        (0..4)
            .map(|i| TransferRequest {
                op,
                local: RegionId(local),
                local_offset: i * BLOCK,
                remote: RegionId(1),
                remote_offset: (3 - i) * BLOCK,
                len: BLOCK,
            })
            .collect()
    };
    run(&init, peer, &reqs(te_core::Op::Write, 1)).expect("write 4 x 4 MiB");
    let landed = remote.read();
    for i in 0..4 {
        let (at, from) = ((3 - i) * BLOCK as usize, i * BLOCK as usize);
        assert!(
            landed[at..at + BLOCK as usize] == data[from..from + BLOCK as usize],
            "block {i} landed intact"
        );
    }
    run(&init, peer, &reqs(te_core::Op::Read, 2)).expect("read 4 x 4 MiB");
    assert!(back.read() == data, "the blocks read back intact");
}

/// A small deterministic generator (xorshift), so the test needs no seed handling.
fn shuffled(n: u64, seed: u64) -> Vec<u64> {
    let mut x = seed | 1;
    let mut v: Vec<u64> = (0..n).collect();
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

/// Requests moving block `local_ids[i]` of the local region to block `remote_ids[i]`
/// of remote region 1.
fn blocks(
    op: te_core::Op,
    local: u64,
    local_ids: &[u64],
    remote_ids: &[u64],
    block: u64,
) -> Vec<TransferRequest> {
    local_ids
        .iter()
        .zip(remote_ids)
        .map(|(&l, &r)| TransferRequest {
            op,
            local: RegionId(local),
            local_offset: l * block,
            remote: RegionId(1),
            remote_offset: r * block,
            len: block,
        })
        .collect()
}

/// Asserts that block `from[i]` of `data` is block `to[i]` of `landed`, for every `i`;
/// `what` names where it went in the message.
fn assert_blocks(landed: &[u8], data: &[u8], from: &[u64], to: &[u64], block: u64, what: &str) {
    let b = block as usize;
    for (&l, &r) in from.iter().zip(to) {
        let (l, r) = (l as usize * b, r as usize * b);
        assert!(landed[r..r + b] == data[l..l + b], "block {l} {what} {r}");
    }
}

#[test]
fn blocks_by_random_id_are_gathered_into_frames_and_land_intact_both_ways() {
    const BLOCK: u64 = 4096;
    const N: u64 = 2048;
    // 8 MiB in 2048 blocks with an 8 MiB frame limit: two frames of 1024 entries (cut
    // at the entry limit), one per connection.
    let target = backend(|c| c.slice_size = 8 << 20);
    let init = backend(|c| {
        c.connections_per_peer = 2;
        c.slice_size = 8 << 20;
    });
    let mut remote = Guarded::new((N * BLOCK) as usize, 0);
    remote.register(&target, 1, Access::REMOTE_READ_WRITE);
    let mut src = pattern((N * BLOCK) as usize, 3);
    register(&init, 1, &mut src, Access::LOCAL);
    let mut back = vec![0u8; (N * BLOCK) as usize];
    register(&init, 2, &mut back, Access::LOCAL);
    let peer = init.connect(&segment(&target), soon()).unwrap();
    let (local_ids, remote_ids) = (shuffled(N, 11), shuffled(N, 29));
    let w = blocks(te_core::Op::Write, 1, &local_ids, &remote_ids, BLOCK);
    run(&init, peer, &w).expect("write 2048 random blocks");
    assert_blocks(&remote.v, &src, &local_ids, &remote_ids, BLOCK, "landed at");
    assert!(remote.v[(N * BLOCK) as usize..]
        .iter()
        .all(|&x| x == Guarded::CANARY));
    // Read them back into other random places.
    let back_ids = shuffled(N, 47);
    let r = blocks(te_core::Op::Read, 2, &back_ids, &remote_ids, BLOCK);
    run(&init, peer, &r).expect("read 2048 random blocks");
    assert_blocks(&back, &src, &local_ids, &back_ids, BLOCK, "read back at");
}

#[test]
fn gathered_blocks_to_and_from_device_memory_at_the_target_land_intact() {
    const BLOCK: u64 = 4096;
    const N: u64 = 256;
    let target = backend(|c| c.slice_size = 64 << 10);
    let init = backend(|_| {});
    let remote = DevMem::new((N * BLOCK) as usize);
    remote.register(&target, 1, Access::REMOTE_READ_WRITE);
    let mut src = pattern((N * BLOCK) as usize, 5);
    register(&init, 1, &mut src, Access::LOCAL);
    let mut back = vec![0u8; (N * BLOCK) as usize];
    register(&init, 2, &mut back, Access::LOCAL);
    let peer = init.connect(&segment(&target), soon()).unwrap();
    let (local_ids, remote_ids) = (shuffled(N, 5), shuffled(N, 9));
    let w = blocks(te_core::Op::Write, 1, &local_ids, &remote_ids, BLOCK);
    run(&init, peer, &w).expect("write random blocks to device memory");
    let landed = remote.read();
    assert_blocks(&landed, &src, &local_ids, &remote_ids, BLOCK, "landed at");
    let r = blocks(te_core::Op::Read, 2, &local_ids, &remote_ids, BLOCK);
    run(&init, peer, &r).expect("read random blocks from device memory");
    assert!(back == src, "the blocks read back intact");
}

#[test]
fn device_blocks_gathered_at_both_ends_land_intact_scattered_or_in_runs() {
    const BLOCK: u64 = 4096;
    const N: u64 = 256;
    let target = backend(|c| c.slice_size = 64 << 10);
    let init = backend(|_| {});
    let size = (N * BLOCK) as usize;
    let (remote, src, back) = (DevMem::new(size), DevMem::new(size), DevMem::new(size));
    remote.register(&target, 1, Access::REMOTE_READ_WRITE);
    src.register(&init, 1, Access::LOCAL);
    back.register(&init, 2, Access::LOCAL);
    let data = pattern(size, 11);
    src.fill(&data);
    let peer = init.connect(&segment(&target), soon()).unwrap();
    // The first half scattered at both ends (one copy per block inside each frame's
    // group); the second half in order at both ends, so adjacent blocks share copies
    // and runs break where a frame ends.
    let (mut local_ids, mut remote_ids) = (shuffled(N / 2, 3), shuffled(N / 2, 17));
    local_ids.extend(N / 2..N);
    remote_ids.extend(N / 2..N);
    let w = blocks(te_core::Op::Write, 1, &local_ids, &remote_ids, BLOCK);
    run(&init, peer, &w).expect("write device blocks to device memory");
    let landed = remote.read();
    assert_blocks(&landed, &data, &local_ids, &remote_ids, BLOCK, "landed at");
    let r = blocks(te_core::Op::Read, 2, &local_ids, &remote_ids, BLOCK);
    run(&init, peer, &r).expect("read device blocks into device memory");
    assert!(back.read() == data, "the blocks read back intact");
}

#[test]
fn writes_of_one_batch_to_the_same_device_bytes_land_whole_in_request_order() {
    // Small frames (copied on the I/O thread) and large ones (copied by the runtime).
    for len in [4096usize, 256 << 10] {
        let target = backend(|_| {});
        let init = backend(|c| c.connections_per_peer = 1);
        let dev = DevMem::new(len);
        dev.register(&target, 1, Access::REMOTE_READ_WRITE);
        let mut src = vec![1u8; 2 * len];
        src[len..].fill(2);
        register(&init, 1, &mut src, Access::LOCAL);
        let peer = init.connect(&segment(&target), soon()).unwrap();
        let n = len as u64;
        let reqs = [
            TransferRequest::write(RegionId(1), 0, RegionId(1), 0, n),
            TransferRequest::write(RegionId(1), n, RegionId(1), 0, n),
        ];
        run(&init, peer, &reqs).unwrap();
        assert!(
            dev.read().iter().all(|&b| b == 2),
            "{len}: the later write wins"
        );
    }
}

#[test]
fn reads_of_one_batch_into_the_same_device_bytes_land_whole_in_request_order() {
    for len in [4096usize, 256 << 10] {
        let target = backend(|_| {});
        let init = backend(|c| c.connections_per_peer = 1);
        let mut remote = vec![1u8; 2 * len];
        remote[len..].fill(2);
        register(&target, 1, &mut remote, Access::REMOTE_READ_WRITE);
        let dev = DevMem::new(len);
        dev.register(&init, 1, Access::LOCAL);
        let peer = init.connect(&segment(&target), soon()).unwrap();
        let n = len as u64;
        let reqs = [
            TransferRequest::read(RegionId(1), 0, RegionId(1), 0, n),
            TransferRequest::read(RegionId(1), 0, RegionId(1), n, n),
        ];
        run(&init, peer, &reqs).unwrap();
        assert!(
            dev.read().iter().all(|&b| b == 2),
            "{len}: the later read wins"
        );
    }
}
