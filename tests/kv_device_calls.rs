//! KV blocks by random id on device memory cost the device O(1) calls per batch, not
//! one per block: `pull_blocks` and `push_blocks` of scattered ids between two tcp
//! engines of this process (device-to-device copies), and staged over the socket
//! (`local_copies = false`), counted by `fakedev`. One test in this binary, so nothing
//! else in the process moves fakedev bytes while it counts.

use te::{Access, BlockOptions, Config, Engine, KvLayout};
use te_core::device::DeviceRuntime;

const LAYERS: usize = 8;
const BLOCKS: u64 = 64;
const BPB: u64 = 4 << 10;
const BATCH: usize = 32;

fn engine(local_copies: bool) -> Engine {
    let mut c = Config::defaults();
    c.engine.backend = "tcp".into();
    let table: te_core::config::Table = format!("local_copies = {local_copies}").parse().unwrap();
    c.backends.insert("tcp".into(), table);
    Engine::from_config(&c).expect("engine")
}

/// Byte `i` of slot `s`'s block `b` as the target holds it.
fn byte(s: usize, b: u64, i: u64) -> u8 {
    (s as u64 * 131 + b * 7 + i).wrapping_mul(29) as u8
}

/// Pulls and pushes `BATCH` random blocks of a `LAYERS`-layer cache between two
/// engines; returns the device calls of the pull and of the push, every byte checked.
fn measure(local_copies: bool) -> (u64, u64, u64) {
    let (target, init) = (engine(local_copies), engine(local_copies));
    let kind = "fakedev:0".parse().unwrap();
    let slot_bytes = (BLOCKS * BPB) as usize;
    let side = 2 * LAYERS * slot_bytes;
    let remote = target
        .alloc_on(&kind, "kv", side, Access::REMOTE_READ_WRITE)
        .unwrap();
    let local = init
        .alloc_on(&kind, "kv", side, Access::REMOTE_READ_WRITE)
        .unwrap();
    let all: Vec<u8> = (0..2 * LAYERS)
        .flat_map(|s| (0..BLOCKS).flat_map(move |b| (0..BPB).map(move |i| byte(s, b, i))))
        .collect();
    remote.write(0, &all).unwrap();
    let layout = |id| {
        let regions: Vec<_> = (0..LAYERS).map(|_| (id, id)).collect();
        let mut l = KvLayout::per_layer_kv("m", &regions, BPB, BLOCKS);
        for (g, group) in l.groups.iter_mut().enumerate() {
            for (k, slot) in group.slots.iter_mut().enumerate() {
                slot.offset = ((2 * g + k) * slot_bytes) as u64;
            }
        }
        l
    };
    target.register_layout(layout(remote.id())).unwrap();
    init.register_layout(layout(local.id())).unwrap();
    let peer = init.connect(&target.address().to_string()).unwrap();
    // Scattered on both sides, no two adjacent on both: one request per block per slot.
    let remote_ids: Vec<u64> = (0..BATCH as u64).map(|i| i * 37 % BLOCKS).collect();
    let local_ids: Vec<u64> = (0..BATCH as u64).map(|i| i * 29 % BLOCKS).collect();
    let dev = te_core::device::fakedev::process().expect("fakedev is running");

    let before = dev.stats();
    init.pull_blocks(
        &peer,
        "m",
        &remote_ids,
        &local_ids,
        &BlockOptions::default(),
    )
    .unwrap()
    .wait()
    .unwrap();
    let pull = dev.stats().since(&before);
    let mut got = vec![0u8; side];
    local.read(0, &mut got).unwrap();
    for s in 0..2 * LAYERS {
        for (r, l) in remote_ids.iter().zip(&local_ids) {
            let at = s * slot_bytes + (*l * BPB) as usize;
            let ok = (0..BPB).all(|i| got[at + i as usize] == byte(s, *r, i));
            assert!(ok, "slot {s}: remote block {r} landed in local block {l}");
        }
    }
    if local_copies {
        assert_eq!(
            pull.copies,
            (2 * LAYERS * BATCH) as u64,
            "one copy per block"
        );
    }

    // Push them back to other ids: the target's blocks `i * 11 mod 64` get them.
    let back: Vec<u64> = (0..BATCH as u64).map(|i| i * 11 % BLOCKS).collect();
    let before = dev.stats();
    init.push_blocks(&peer, "m", &back, &local_ids, &BlockOptions::default())
        .unwrap()
        .wait()
        .unwrap();
    let push = dev.stats().since(&before);
    let mut now = vec![0u8; side];
    remote.read(0, &mut now).unwrap();
    for s in 0..2 * LAYERS {
        for (r, b) in remote_ids.iter().zip(&back) {
            let at = s * slot_bytes + (*b * BPB) as usize;
            let ok = (0..BPB).all(|i| now[at + i as usize] == byte(s, *r, i));
            assert!(ok, "slot {s}: block {r} pushed to {b}");
        }
    }
    (pull.calls, push.calls, pull.syncs)
}

#[test]
fn random_kv_blocks_on_the_device_cost_a_few_device_calls_per_batch_not_one_per_block() {
    // 16 slots x 32 random blocks = 512 requests of 4 KiB (2 MiB) per batch.
    let requests = (2 * LAYERS * BATCH) as u64;
    // Device to device in this process: every frame of the batch in one group.
    let (pull, push, syncs) = measure(true);
    assert!(
        pull <= 2 && push <= 2 && syncs <= 2,
        "local copies: pull {pull} calls, push {push}, {syncs} syncs for {requests} blocks"
    );
    // Staged over the socket: each slot is a region of its own at the target, so a
    // frame per slot (32 blocks, 128 KiB), staged with one call on each side.
    let (pull, push, _) = measure(false);
    let slots = 2 * LAYERS as u64;
    assert!(
        pull <= 2 * slots && push <= 2 * slots,
        "staged: pull {pull} calls, push {push} for {slots} slots of {BATCH} blocks"
    );
}
