//! The conformance suite on te-rdma through the FAKE verbs provider (`libfakeverbs.so`,
//! built beside this test), which carries RDMA WRITE and READ in software: once with
//! both engines in this process, once with each target engine in a child process.
//!
//! The fake's devices are `fake0`, `fake1` (two NICs, so paths stripe across them) and
//! `fakeslow`, whose work requests each wait 200 ms: the slow configuration uses it.
//! What the fake cannot prove is listed in docs/rdma.md.

use te_core::testkit::{self, Harness};
use te_core::Config;

// Linked so it registers itself.
use te_rdma as _;

const TABLE: &str = "devices = [\"fake0\", \"fake1\"]";
const SLOW_TABLE: &str = "devices = [\"fakeslow\"]";

fn toml(table: &str) -> String {
    format!("[engine]\nbackend = \"rdma\"\n[backends.rdma]\n{table}\n")
}

fn config(table: &str) -> Config {
    Config::from_toml(&toml(table), "rdma_fake.toml", std::path::Path::new("."))
        .expect("valid config")
}

fn main() {
    // Before any thread starts: the child targets inherit both variables.
    if std::env::var_os(te_rdma::VERBS_LIB_ENV).is_none() {
        let exe = std::env::current_exe().expect("the test binary's path");
        let lib = exe.with_file_name("libfakeverbs.so");
        std::env::set_var(te_rdma::VERBS_LIB_ENV, &lib);
    }
    if std::env::var_os("TE_FAKEVERBS_DEVICES").is_none() {
        std::env::set_var("TE_FAKEVERBS_DEVICES", "fake0 fake1 fakeslow:delay=200ms");
    }
    testkit::serve_target_if_asked();
    if let Err(why) = te_rdma::probe() {
        // The fake is built with this test, so this is a failure, not a skip.
        eprintln!("the fake verbs provider does not load: {why}");
        std::process::exit(1);
    }
    let one = Harness::new("rdma-fake", config(TABLE)).with_slow(config(SLOW_TABLE));
    let two = Harness::new("rdma-fake-two-process", config(TABLE))
        .with_slow(config(SLOW_TABLE))
        .with_remote_target(&toml(TABLE), Some(&toml(SLOW_TABLE)));
    let mut trials = testkit::trials(&one);
    trials.extend(testkit::trials(&two));
    trials.push(testkit::Trial::test(
        "rdma-fake::a_batch_tells_its_time_on_the_wire",
        a_batch_tells_its_time_on_the_wire,
    ));
    testkit::run(trials);
}

/// te-rdma times its wire stage: from a batch's first work request posted until its
/// last completion.
fn a_batch_tells_its_time_on_the_wire() -> Result<(), libtest_mimic::Failed> {
    let e = |e: te_core::Error| libtest_mimic::Failed::from(e.to_string());
    let target = te_core::Engine::from_config(&config(TABLE)).map_err(e)?;
    let dst = target
        .alloc("dst", 1 << 20, te_core::Access::REMOTE_READ_WRITE)
        .map_err(e)?;
    let me = te_core::Engine::from_config(&config(TABLE)).map_err(e)?;
    let src = me
        .alloc("src", 1 << 20, te_core::Access::LOCAL)
        .map_err(e)?;
    let peer = me.connect(&target.address().to_string()).map_err(e)?;
    let write =
        te_core::TransferRequest::write(src.id(), 0, peer.region("dst").unwrap().id, 0, 1 << 20);
    let h = me.transfer(&peer, &[write]).map_err(e)?;
    h.wait().map_err(e)?;
    let t = h.telemetry().ok_or("an ended batch tells no telemetry")?;
    drop(dst);
    match t.wire {
        Some(w) if w <= t.duration && t.queued.is_some() => Ok(()),
        _ => Err(format!("te-rdma did not time its wire stage: {t:?}").into()),
    }
}
