//! The conformance suite on the tcp backend, both engines in this process, talking over
//! loopback sockets exactly as two processes would: te-tcp built in, and te-tcp loaded
//! as a plugin from the cdylib `cargo build --workspace` produced; and with every target
//! engine in a child process, so the suite runs across two processes. With fake-device
//! memory on both sides and mixed with host memory, it runs every staging path, and
//! with both sides on one fake device in this process, the device-to-device path.

use te_core::testkit::{self, engine_config, Harness};
use te_core::Config;

fn tcp_config(table: &str) -> Config {
    engine_config("tcp", table)
}

fn main() {
    testkit::serve_target_if_asked();
    // The slow configuration holds every request 200 ms at the target.
    let slow = "debug_delay = \"200ms\"";
    // Built in, in this process and with every target in a child process.
    let builtin = Harness::for_backend(te_tcp::NAME, "", Some(slow)).labelled("tcp_builtin");
    let mut trials = testkit::trials_everywhere(&builtin);
    let plugin = Harness::for_backend(te_tcp::NAME, "", Some(slow))
        .labelled("tcp_plugin")
        .with_built_plugin("te_tcp");
    trials.extend(testkit::trials(&plugin));
    // Device memory, staged through pinned host buffers: the fake device on both sides
    // and mixed with host memory, in this process; and on both sides across processes.
    for (label, initiator, target) in [
        ("tcp_fakedev", "fakedev:0", "fakedev:1"),
        ("tcp_host_to_fakedev", "host", "fakedev:0"),
        ("tcp_fakedev_to_host", "fakedev:0", "host"),
    ] {
        let h = Harness::new(label, tcp_config(""))
            .with_slow(tcp_config(slow))
            .with_memory(initiator.parse().unwrap(), target.parse().unwrap());
        trials.extend(testkit::trials(&h));
    }
    // Both ends on fakedev:0 in this process: device-to-device copies (`local_copies`).
    // The slow trials (deadlines, cancel, shutdown) hold frames with the target's
    // `debug_delay`, which sends every frame over the socket, so they stage.
    let local = Harness::new("tcp_fakedev_local", tcp_config(""))
        .with_slow(tcp_config(slow))
        .with_memory("fakedev:0".parse().unwrap(), "fakedev:0".parse().unwrap());
    trials.extend(testkit::trials(&local));
    let two_process_fakedev = Harness::new("tcp_two_process_fakedev", tcp_config(""))
        .with_slow(tcp_config(slow))
        .with_memory("fakedev:0".parse().unwrap(), "fakedev:0".parse().unwrap())
        .with_remote_target(
            &testkit::engine_toml("tcp", ""),
            Some(&testkit::engine_toml("tcp", slow)),
        );
    trials.extend(testkit::trials(&two_process_fakedev));
    testkit::run(trials);
}
