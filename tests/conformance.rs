//! The conformance suite on te-stub where the facade matters: loaded as a plugin from
//! the cdylib `cargo build --workspace` produced, on fake-device memory, and as the
//! contract's adversary. The plain built-in run is te-stub's own
//! `crates/te-stub/tests/conformance.rs`.

use te::Config;
use te_core::testkit::{self, engine_config, Harness};

fn stub_config(table: &str) -> Config {
    engine_config("stub", table)
}

fn main() {
    testkit::serve_target_if_asked();
    let plugin =
        Harness::for_backend("stub", "", Some("delay = \"200ms\"")).labelled("stub_plugin");
    let plugin = plugin.with_built_plugin("te_stub");
    // Device memory through the fake device runtime: both sides on devices, and mixed.
    let fakedev = |label: &str, initiator: &str, target: &str| {
        Harness::new(label, stub_config(""))
            .with_slow(stub_config("delay = \"200ms\""))
            .with_memory(initiator.parse().unwrap(), target.parse().unwrap())
    };
    // The stub as the contract's adversary: completions out of order, and a slow
    // fabric that cannot stop, so an engine that resolves a handle before the backend
    // has released its batch is caught writing into handed-back memory.
    let adversary = Harness::new("stub_adversary", stub_config("reorder = true")).with_slow(
        stub_config("delay = \"200ms\"\nignore_abort = true\nreorder = true"),
    );
    let mut trials = testkit::trials(&plugin);
    trials.extend(testkit::trials(&adversary));
    trials.extend(testkit::trials(&fakedev(
        "stub_fakedev",
        "fakedev:0",
        "fakedev:1",
    )));
    trials.extend(testkit::trials(&fakedev(
        "stub_host_to_fakedev",
        "host",
        "fakedev:0",
    )));
    trials.extend(testkit::trials(&fakedev(
        "stub_fakedev_to_host",
        "fakedev:1",
        "host",
    )));
    testkit::run(trials);
}
