//! Helpers shared by te-mlu's test binaries, which all run against the FAKE libcnrt.

#![allow(dead_code)]

use std::path::Path;

use te_core::{Access, Buffer, Config, Engine, KvGroup, KvLayout, KvSlot, MemoryKind, RegionId};

/// Points te-mlu at the fake libcnrt, or at the real one `TE_MLU_REAL_CNRT` names (to
/// run these tests on MLUs). Call first thing in `main`, before any thread starts (it
/// sets environment variables).
pub fn use_fake_cnrt(extra_env: &[(&str, &str)]) {
    if let Ok(real) = std::env::var("TE_MLU_REAL_CNRT") {
        println!("te-mlu tests: using the real CNRT at {real}");
        std::env::set_var("TE_MLU_CNRT_LIB", real);
    } else {
        let fake = env!("TE_MLU_FAKE_CNRT");
        assert!(
            !fake.is_empty(),
            "the fake libcnrt was not built (is a C compiler installed?); see the build script's warnings"
        );
        std::env::set_var("TE_MLU_CNRT_LIB", fake);
    }
    for (k, v) in extra_env {
        std::env::set_var(k, v);
    }
    // Link te-mlu, te-stub and te-tcp, so their runtime and backends are registered here.
    assert_eq!(te_mlu::NAME, "mlu");
    assert_eq!(te_stub::NAME, "stub");
    assert_eq!(te_tcp::NAME, "tcp");
}

/// A configuration of `backend` with `table` as its `[backends.NAME]` table.
pub fn config(backend: &str, table: &str) -> Config {
    let text = format!("[engine]\nbackend = \"{backend}\"\n[backends.{backend}]\n{table}\n");
    Config::from_toml(&text, "te-mlu-test.toml", Path::new(".")).expect("valid config")
}

/// `mlu:N`.
pub fn mlu(n: u32) -> MemoryKind {
    MemoryKind::Device {
        runtime: "mlu".into(),
        ordinal: n,
    }
}

/// The bytes every filled test buffer holds at index `i`.
pub use te_core::testkit::byte;

/// A buffer of `kind` filled with `byte(i, seed)`.
pub fn filled(
    e: &Engine,
    kind: &MemoryKind,
    name: &str,
    len: u64,
    access: Access,
    seed: u8,
) -> Buffer {
    let b = e.alloc_on(kind, name, len as usize, access).expect("alloc");
    let data = te_core::testkit::pattern(len as usize, seed);
    b.write(0, &data).expect("fill");
    b
}

/// MLA-shaped: per layer a key cache of 576 B per block and an index cache of 132 B
/// per block, in two regions.
pub const KEY_BPB: u64 = 576;
/// Bytes per block of the index cache.
pub const INDEX_BPB: u64 = 132;
/// Layers of the test cache.
pub const LAYERS: usize = 8;
/// Blocks per layer.
pub const BLOCKS: u64 = 256;

/// The MLA layout over regions `key` and `index`.
pub fn mla(key: RegionId, index: RegionId) -> KvLayout {
    KvLayout {
        name: "mla".into(),
        groups: (0..LAYERS)
            .map(|l| KvGroup {
                name: format!("layer{l}"),
                slots: vec![
                    KvSlot {
                        name: "key".into(),
                        region: key,
                        offset: l as u64 * KEY_BPB * BLOCKS,
                        bytes_per_block: KEY_BPB,
                        blocks: BLOCKS,
                    },
                    KvSlot {
                        name: "index".into(),
                        region: index,
                        offset: l as u64 * INDEX_BPB * BLOCKS,
                        bytes_per_block: INDEX_BPB,
                        blocks: BLOCKS,
                    },
                ],
            })
            .collect(),
    }
}

/// Seeds of the target's key and index caches.
pub const KEY_SEED: u8 = 11;
/// Seed of the index cache.
pub const INDEX_SEED: u8 = 23;

/// A target's MLA cache: key on `key_kind`, index on `index_kind`, filled, with the
/// layout registered. Keep the buffers alive as long as the target serves.
pub fn mla_target(e: &Engine, key_kind: &MemoryKind, index_kind: &MemoryKind) -> (Buffer, Buffer) {
    let k = filled(
        e,
        key_kind,
        "key",
        KEY_BPB * BLOCKS * LAYERS as u64,
        Access::REMOTE_READ,
        KEY_SEED,
    );
    let i = filled(
        e,
        index_kind,
        "index",
        INDEX_BPB * BLOCKS * LAYERS as u64,
        Access::REMOTE_READ,
        INDEX_SEED,
    );
    e.register_layout(mla(k.id(), i.id()))
        .expect("register layout");
    (k, i)
}

/// Pulls 100 random blocks of the peer at `addr` into a fresh local cache on
/// `local_key` / `local_index` memory and checks every byte of the local cache:
/// moved blocks equal the target's, the rest are still zero.
pub fn pull_and_verify(
    initiator: &Engine,
    addr: &str,
    local_key: &MemoryKind,
    local_index: &MemoryKind,
) -> Result<(), String> {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    let lk = initiator
        .alloc_on(
            local_key,
            "key",
            (KEY_BPB * BLOCKS * LAYERS as u64) as usize,
            Access::LOCAL,
        )
        .map_err(|e| e.to_string())?;
    let li = initiator
        .alloc_on(
            local_index,
            "index",
            (INDEX_BPB * BLOCKS * LAYERS as u64) as usize,
            Access::LOCAL,
        )
        .map_err(|e| e.to_string())?;
    initiator
        .register_layout(mla(lk.id(), li.id()))
        .map_err(|e| e.to_string())?;
    let peer = initiator.connect(addr).map_err(|e| e.to_string())?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut ids: Vec<u64> = (0..BLOCKS).collect();
    ids.shuffle(&mut rng);
    let remote_ids = ids[..100].to_vec();
    ids.shuffle(&mut rng);
    let local_ids = ids[..100].to_vec();
    initiator
        .pull_blocks(
            &peer,
            "mla",
            &remote_ids,
            &local_ids,
            &te_core::BlockOptions::default(),
        )
        .map_err(|e| e.to_string())?
        .wait()
        .map_err(|e| e.to_string())?;
    let (lk, li) = (
        lk.to_vec().map_err(|e| e.to_string())?,
        li.to_vec().map_err(|e| e.to_string())?,
    );
    for layer in 0..LAYERS as u64 {
        for (bpb, seed, local) in [(KEY_BPB, KEY_SEED, &lk), (INDEX_BPB, INDEX_SEED, &li)] {
            let base = layer * bpb * BLOCKS;
            let mut expected = vec![0u8; (bpb * BLOCKS) as usize];
            for (&r, &d) in remote_ids.iter().zip(&local_ids) {
                for k in 0..bpb {
                    expected[(d * bpb + k) as usize] = byte(base + r * bpb + k, seed);
                }
            }
            let got = &local[base as usize..(base + bpb * BLOCKS) as usize];
            if got != expected.as_slice() {
                let at = got
                    .iter()
                    .zip(&expected)
                    .position(|(a, b)| a != b)
                    .unwrap_or(0);
                return Err(format!(
                    "layer {layer}, {bpb}-byte slot: first wrong byte at block {}, byte {}",
                    at as u64 / bpb,
                    at as u64 % bpb
                ));
            }
        }
    }
    Ok(())
}
