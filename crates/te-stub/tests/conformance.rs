//! The conformance suite on te-stub: built in, in one process and with every target in
//! a child process (the first lines of `main`: the pattern every backend crate's
//! conformance test follows; copy them, change the crate and the tables). Then the
//! runs only the stub makes: loaded as a plugin from the cdylib `cargo build
//! --workspace` produced, on fake-device memory, and as the contract's adversary.

use te_core::testkit::{self, engine_config, Harness};
use te_core::Config;

fn main() {
    testkit::serve_target_if_asked();
    // The second table makes every batch take about 200 ms (deadline, cancel and
    // shutdown tests need one).
    let h = Harness::for_backend(te_stub::NAME, "", Some("delay = \"200ms\""));
    let mut trials = testkit::trials_everywhere(&h);
    trials.extend(stub_only_trials());
    testkit::run(trials);
}

fn stub_config(table: &str) -> Config {
    engine_config("stub", table)
}

fn stub_only_trials() -> Vec<testkit::Trial> {
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
    trials
}
