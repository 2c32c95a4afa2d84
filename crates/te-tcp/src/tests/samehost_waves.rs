//! A same-host channel's target never puts copies that overlap one another into one
//! device group, whose copies a list-copy kernel runs at once: entries whose ranges on
//! the target, or on the initiator, meet run one after another, in the request's
//! order, and a request without such overlaps is still one group. Checked through
//! `listcopy` (`tests/common/listcopy.rs`), a runtime of this test binary over
//! `fakedev` that counts groups whose copies overlap and runs each group's copies last
//! to first. One test, as it reads process-wide counters.

use std::time::Duration;

use te_core::{Access, MemoryDesc, MemoryKind, Op, RegionId, TransferBackend};

use super::samehost::{answered_key, channel, request, IMPORTS};
use super::{backend, pattern, soon};
use crate::samehost::Range;

#[path = "../../tests/common/listcopy.rs"]
mod listcopy;

use listcopy::Mem;

const BLOCK: u64 = 4096;
const BLOCKS: u64 = 16;
const LEN: usize = (BLOCK * BLOCKS) as usize;

/// A move of blocks: (from block, to block, blocks). A WRITE moves from the initiator's
/// memory to the target's region, a READ from the region to the initiator's memory.
type Move = (u64, u64, u64);

/// The entry for `m` of `op`, the initiator's memory at `mine`, shared under `key`.
fn entry(op: Op, (from, to, n): Move, mine: u64, key: u64) -> Range {
    let (theirs, ours) = match op {
        Op::Write => (to, from),
        Op::Read => (from, to),
    };
    Range {
        region: 1,
        offset: theirs * BLOCK,
        len: n * BLOCK,
        key,
        addr: mine + ours * BLOCK,
    }
}

/// The bytes of `into` once `moves` ran one after another, copying from `from` (from
/// `into` itself where `None`).
fn in_order(from: Option<&[u8]>, into: &[u8], moves: &[Move]) -> Vec<u8> {
    let mut v = into.to_vec();
    let mut src = from.unwrap_or(into).to_vec();
    for &(f, t, n) in moves {
        let (f, t, n) = (
            (f * BLOCK) as usize,
            (t * BLOCK) as usize,
            (n * BLOCK) as usize,
        );
        v[t..t + n].copy_from_slice(&src[f..f + n]);
        if from.is_none() {
            src.clone_from(&v);
        }
    }
    v
}

/// `count` random sets of 12 moves of 1 to 3 blocks, from a fixed seed; with `apart`,
/// each move's two ranges are apart (within one memory, a move onto itself).
fn random(seed: &mut u64, count: usize, apart: bool) -> Vec<Vec<Move>> {
    let mut next = |m: u64| {
        *seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (*seed >> 33) % m
    };
    let mut all = Vec::new();
    for _ in 0..count {
        let mut moves = Vec::new();
        for _ in 0..1000 {
            let n = 1 + next(3);
            let (from, to) = (next(BLOCKS - n + 1), next(BLOCKS - n + 1));
            if !apart || from + n <= to || to + n <= from {
                moves.push((from, to, n));
            }
            if moves.len() == 12 {
                break;
            }
        }
        assert_eq!(moves.len(), 12, "the seed gives moves");
        all.push(moves);
    }
    all
}

#[test]
fn entries_of_a_request_that_overlap_one_another_never_share_a_device_group() {
    let _alone = IMPORTS.lock();
    let rt = te_core::device::runtime(listcopy::NAME).expect("the listcopy runtime");
    let (region, other) = (Mem::new(LEN), Mem::new(LEN));
    let target = backend(|_| {});
    let desc = MemoryDesc {
        name: "d".into(),
        addr: region.addr,
        len: LEN as u64,
        kind: MemoryKind::Device {
            runtime: listcopy::NAME.into(),
            ordinal: 0,
        },
        access: Access::REMOTE_READ_WRITE,
    };
    target.register(RegionId(1), &desc).expect("register");
    let ch = channel(&target);
    // The initiator's memory: another allocation, or (this process being the
    // initiator too) the region's own, mapped a second time by the target.
    let theirs = answered_key(&ch, &rt, RegionId(8), other.addr).expect("shared");
    let itself = answered_key(&ch, &rt, RegionId(9), region.addr).expect("shared");

    // Each case: (op, into the region itself, moves).
    let mut cases: Vec<(Op, bool, Vec<Move>)> = vec![
        // Two entries writing one block of the region, then of the initiator's memory.
        (Op::Write, false, vec![(0, 5, 2), (3, 6, 2)]),
        (Op::Read, false, vec![(5, 0, 2), (8, 1, 2)]),
        // A chain within the region: block 0 to 1, then 1 to 2.
        (Op::Write, true, vec![(0, 1, 1), (1, 2, 1)]),
        (Op::Read, true, vec![(3, 4, 1), (4, 5, 1)]),
    ];
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for op in [Op::Write, Op::Read] {
        for moves in random(&mut seed, 10, false) {
            cases.push((op, false, moves));
        }
        for moves in random(&mut seed, 5, true) {
            cases.push((op, true, moves));
        }
    }
    for (k, (op, into_itself, moves)) in cases.iter().enumerate() {
        let (mine, key) = match into_itself {
            true => (&region, itself),
            false => (&other, theirs),
        };
        let (was, ours) = (pattern(LEN, k as u8), pattern(LEN, k as u8 ^ 0x5a));
        region.fill(&was);
        if !into_itself {
            other.fill(&ours);
        }
        let ranges = moves
            .iter()
            .map(|&m| entry(*op, m, mine.addr, key))
            .collect();
        request(&ch, *op, ranges).unwrap_or_else(|e| panic!("case {k} ({moves:?}): {e}"));
        assert_eq!(
            listcopy::groups().1,
            0,
            "case {k} ({op:?} {moves:?}): no device group held copies that overlap"
        );
        let ok = match (op, into_itself) {
            (_, true) => region.read() == in_order(None, &was, moves),
            (Op::Write, false) => region.read() == in_order(Some(&ours), &was, moves),
            (Op::Read, false) => other.read() == in_order(Some(&was), &ours, moves),
        };
        assert!(
            ok,
            "case {k} ({op:?} {moves:?}): the bytes of the entries run in order"
        );
    }

    // Entries apart from one another are one group, one device call per request.
    let apart = [(0, 8, 2), (2, 10, 2), (5, 13, 3)];
    for (op, key, mine) in [
        (Op::Write, theirs, &other),
        (Op::Read, theirs, &other),
        (Op::Write, itself, &region),
    ] {
        let before = listcopy::groups().0;
        let ranges = apart
            .iter()
            .map(|&m| entry(op, m, mine.addr, key))
            .collect();
        request(&ch, op, ranges).expect("entries apart");
        assert_eq!(listcopy::groups().0 - before, 1, "{op:?}: one group");
    }

    // A chain of 8 waves of 100 ms each, in a batch given 250 ms: the target stops
    // between waves once the deadline passed, as it would not have started.
    listcopy::set_group_delay(100);
    let before = listcopy::groups().0;
    let chain: Vec<Range> = (0..8)
        .map(|i| entry(Op::Write, (i, i + 1, 1), region.addr, itself))
        .collect();
    let (tx, rx) = std::sync::mpsc::channel();
    let done = te_core::Completion::new(Duration::from_millis(250), move |r, _| {
        let _ = tx.send(r);
    });
    let batch = std::sync::Arc::new(crate::completion::Batch::new(1, done, Vec::new()));
    ch.submit(vec![crate::samehost::Frame {
        op: Op::Write,
        ranges: chain,
        batch,
    }]);
    let r = rx.recv_timeout(Duration::from_secs(5)).expect("answered");
    assert!(r.is_err(), "a batch past its deadline failed: {r:?}");
    // Long enough for all 8 waves, had the target gone on.
    std::thread::sleep(Duration::from_millis(1000));
    listcopy::set_group_delay(0);
    let started = listcopy::groups().0 - before;
    assert!(
        started <= 4,
        "{started} of 8 waves started for a batch whose 250 ms deadline passed after the third"
    );
    drop(ch);
    target.deregister(RegionId(1), soon()).unwrap();
}
