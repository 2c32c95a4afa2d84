//! The conformance suite on the tcp backend, both engines in this process, talking over
//! loopback sockets exactly as two processes would: te-tcp built in, and te-tcp loaded
//! as a plugin from the cdylib `cargo build --workspace` produced; and with every target
//! engine in a child process, so the suite runs across two processes. With fake-device
//! memory on both sides and mixed with host memory, it runs every staging path.

use std::path::PathBuf;

use te::testkit::{self, Harness};
use te::{Config, Origin, Registry};

fn tcp_config(plugin_dir: Option<PathBuf>, table: &str) -> Config {
    let text = format!("[engine]\nbackend = \"tcp\"\n[backends.tcp]\n{table}\n");
    let mut c = Config::from_toml(&text, "tcp_conformance.toml", std::path::Path::new("."))
        .expect("valid config");
    c.engine.plugin_dirs = plugin_dir.into_iter().collect();
    c
}

/// The directory cargo puts the workspace's cdylibs in (`target/<profile>`).
fn plugin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>")
        .to_path_buf()
}

fn main() {
    testkit::serve_target_if_asked();
    // The slow configuration holds every request 200 ms at the target.
    let slow = "debug_delay = \"200ms\"";
    // Built in, in this process and with every target in a child process.
    let builtin = Harness::for_backend("tcp", "", Some(slow)).labelled("tcp_builtin");
    let mut trials = testkit::trials_everywhere(&builtin);
    let dir = plugin_dir();
    let lib = dir.join(format!("libte_tcp{}", std::env::consts::DLL_SUFFIX));
    assert!(
        lib.exists(),
        "{} is missing: run `cargo build --workspace` before `cargo test` (the README's test command does)",
        lib.display()
    );
    let registry = Registry::discover(std::slice::from_ref(&dir));
    let resolved = registry.get("tcp").expect("tcp is registered");
    assert_eq!(
        resolved.origin(),
        &Origin::Plugin(lib),
        "the tcp plugin must shadow the built-in tcp"
    );
    let plugin = Harness::new("tcp_plugin", tcp_config(Some(dir.clone()), ""))
        .with_slow(tcp_config(Some(dir), slow));
    trials.extend(testkit::trials(&plugin));
    // Device memory, staged through pinned host buffers: the fake device on both sides
    // and mixed with host memory, in this process; and on both sides across processes.
    for (label, initiator, target) in [
        ("tcp_fakedev", "fakedev:0", "fakedev:1"),
        ("tcp_host_to_fakedev", "host", "fakedev:0"),
        ("tcp_fakedev_to_host", "fakedev:0", "host"),
    ] {
        let h = Harness::new(label, tcp_config(None, ""))
            .with_slow(tcp_config(None, slow))
            .with_memory(initiator.parse().unwrap(), target.parse().unwrap());
        trials.extend(testkit::trials(&h));
    }
    let two_process_fakedev = Harness::new("tcp_two_process_fakedev", tcp_config(None, ""))
        .with_slow(tcp_config(None, slow))
        .with_memory("fakedev:0".parse().unwrap(), "fakedev:0".parse().unwrap())
        .with_remote_target(
            &testkit::engine_toml("tcp", ""),
            Some(&testkit::engine_toml("tcp", slow)),
        );
    trials.extend(testkit::trials(&two_process_fakedev));
    testkit::run(trials);
}
