//! Fingerprints the sources of the types that cross the plugin boundary encoded (not
//! layout-checked by abi_stable), so a plugin built from other sources is refused.

use std::hash::Hasher;

const ENCODED: &[&str] = &[
    "src/desc.rs",
    "src/kv.rs",
    "src/codec.rs",
    "src/backend.rs",
    "src/plugin.rs",
    "src/hook.rs",
];

/// FNV-1a, 64-bit: stable across Rust releases, unlike `DefaultHasher`.
struct Fnv(u64);

impl Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
        }
    }
}

fn main() {
    let mut h = Fnv(0xcbf2_9ce4_8422_2325);
    for f in ENCODED {
        println!("cargo:rerun-if-changed={f}");
        let text =
            std::fs::read(f).unwrap_or_else(|e| panic!("te-core build: cannot read {f}: {e}"));
        h.write(&text);
    }
    println!("cargo:rustc-env=TE_SCHEMA={:016x}", h.finish());
}
