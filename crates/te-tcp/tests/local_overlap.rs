//! A region moved into itself through a peer in this process: pieces whose ranges
//! overlap one another never share a device group, whose copies a list-copy kernel runs
//! at once. Checked through `listcopy` (`common/listcopy.rs`), a runtime of this test
//! binary over `fakedev` that counts groups whose copies overlap and runs each group's
//! copies last to first, as a kernel's threads may finish them. One test, as it reads
//! process-wide counters.

mod common;
#[path = "common/listcopy.rs"]
mod listcopy;

use common::{backend, connect, deregister, pattern, run};
use listcopy::{Mem, NAME};
use te_core::{Access, MemoryDesc, MemoryKind, Op, RegionId, TransferBackend, TransferRequest};

const BLOCK: u64 = 4096;
const BLOCKS: u64 = 16;

/// A request of `n` blocks from block `from` to block `to` of region 1, as `op` names
/// them: a WRITE's source is local, a READ's remote.
fn mv(op: Op, from: u64, to: u64, n: u64) -> TransferRequest {
    let (local, remote) = match op {
        Op::Write => (from, to),
        Op::Read => (to, from),
    };
    TransferRequest {
        op,
        local: RegionId(1),
        local_offset: local * BLOCK,
        remote: RegionId(1),
        remote_offset: remote * BLOCK,
        len: n * BLOCK,
    }
}

/// A move of blocks: (from block, to block, blocks).
type Move = (u64, u64, u64);

/// The bytes `reqs` leave in `was` when run one after another.
fn in_order(was: &[u8], reqs: &[Move]) -> Vec<u8> {
    let mut v = was.to_vec();
    for &(from, to, n) in reqs {
        let (f, t, n) = (
            (from * BLOCK) as usize,
            (to * BLOCK) as usize,
            (n * BLOCK) as usize,
        );
        v.copy_within(f..f + n, t);
    }
    v
}

#[test]
fn pieces_of_a_batch_that_overlap_one_another_never_share_a_device_group() {
    let b = backend(true);
    let mem = Mem::new((BLOCK * BLOCKS) as usize);
    let desc = MemoryDesc {
        name: "d".into(),
        addr: mem.addr,
        len: BLOCK * BLOCKS,
        kind: MemoryKind::Device {
            runtime: NAME.into(),
            ordinal: 0,
        },
        access: Access::REMOTE_READ_WRITE,
    };
    b.register(RegionId(1), &desc).expect("register");
    let me = connect(&b, &b);
    assert_eq!(
        b.peer_path(me).expect("a peer"),
        te_tcp::PeerPath::InProcess
    );

    // Each case: (op, [(from block, to block, blocks)]), every request apart from
    // itself, so each is a device copy.
    let mut cases: Vec<(Op, Vec<Move>)> = vec![
        // A chain: block 0 to 1, then 1 to 2; pieces adjacent on both sides.
        (Op::Write, vec![(0, 1, 1), (1, 2, 1)]),
        (Op::Read, vec![(3, 4, 1), (4, 5, 1)]),
        // Two sources to one destination.
        (Op::Write, vec![(0, 9, 2), (4, 10, 2)]),
        // Swapping two blocks through a third.
        (Op::Write, vec![(2, 15, 1), (3, 2, 1), (15, 3, 1)]),
    ];
    // Random moves of 1 to 3 blocks, from a fixed seed.
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |m: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % m
    };
    for _ in 0..20 {
        let mut reqs = Vec::new();
        for _ in 0..1000 {
            let n = 1 + next(3);
            let (from, to) = (next(BLOCKS - n + 1), next(BLOCKS - n + 1));
            if from + n <= to || to + n <= from {
                reqs.push((from, to, n));
            }
            if reqs.len() == 12 {
                break;
            }
        }
        assert_eq!(reqs.len(), 12, "the seed gives moves apart from themselves");
        cases.push((Op::Write, reqs));
    }
    for (k, (op, reqs)) in cases.iter().enumerate() {
        let was = pattern((BLOCK * BLOCKS) as usize, k as u8);
        mem.fill(&was);
        let batch: Vec<TransferRequest> = reqs.iter().map(|&(f, t, n)| mv(*op, f, t, n)).collect();
        run(&b, me, &batch).unwrap_or_else(|e| panic!("case {k} ({reqs:?}): {e}"));
        assert_eq!(
            listcopy::groups().1,
            0,
            "case {k} ({op:?} {reqs:?}): no device group held copies that overlap"
        );
        assert!(
            mem.read() == in_order(&was, reqs),
            "case {k} ({op:?} {reqs:?}): the bytes of the requests run in order"
        );
    }

    // Moves apart from one another are still one group.
    let before = listcopy::groups().0;
    let apart = [(0, 8, 2), (2, 10, 2), (5, 13, 3)];
    let batch: Vec<TransferRequest> = apart
        .iter()
        .map(|&(f, t, n)| mv(Op::Write, f, t, n))
        .collect();
    run(&b, me, &batch).expect("moves apart");
    assert_eq!(listcopy::groups().0 - before, 1, "one group");
    deregister(&b, &[1]);
}
