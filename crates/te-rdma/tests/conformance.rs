//! The conformance suite on real RDMA NICs: two engines in this process, connected
//! through the NIC (a QP to a QP of the same host goes through the HCA).
//!
//! Where the backend cannot run (no libibverbs, no device, no active port) it prints
//! why and runs no trial (fails with `TE_REQUIRE=rdma`). `TE_RDMA_CONFIG` may hold extra `[backends.rdma]` lines, e.g.
//! `TE_RDMA_CONFIG='devices = ["mlx5_0"]'`; `TE_RDMA_MEMORY=cuda:0` puts both sides'
//! buffers in GPU memory.

use te_core::testkit::{self, Harness};
use te_core::{Config, MemoryKind};

// Linked so it registers itself.
use te_rdma as _;

fn config(table: &str) -> Config {
    let extra = std::env::var("TE_RDMA_CONFIG").unwrap_or_default();
    let text = format!("[engine]\nbackend = \"rdma\"\n[backends.rdma]\n{extra}\n{table}\n");
    Config::from_toml(&text, "rdma_conformance.toml", std::path::Path::new("."))
        .expect("valid config")
}

fn main() {
    if let Err(why) = te_rdma::probe() {
        te_core::require::skip("rdma", format!("the backend cannot run here: {why}"));
        testkit::run(Vec::new());
    }
    let mut h = Harness::new("rdma", config(""));
    if let Ok(kind) = std::env::var("TE_RDMA_MEMORY") {
        let kind: MemoryKind = kind.parse().expect("TE_RDMA_MEMORY is a memory kind");
        h = h.with_memory(kind.clone(), kind);
    }
    testkit::run(testkit::trials(&h));
}
