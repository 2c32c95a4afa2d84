//! The conformance suite on te-stub where the facade matters: loaded as a plugin from
//! the cdylib `cargo build --workspace` produced, on fake-device memory, and as the
//! contract's adversary. The plain built-in run is te-stub's own
//! `crates/te-stub/tests/conformance.rs`.

use std::path::PathBuf;

use te::testkit::{self, Harness};
use te::{Config, Origin, Registry};

fn stub_config(plugin_dir: Option<PathBuf>, table: &str) -> Config {
    let text = format!("[engine]\nbackend = \"stub\"\n[backends.stub]\n{table}\n");
    let mut c = Config::from_toml(&text, "conformance.toml", std::path::Path::new("."))
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
    let dir = plugin_dir();
    let lib = dir.join(format!("libte_stub{}", std::env::consts::DLL_SUFFIX));
    assert!(
        lib.exists(),
        "{} is missing: run `cargo build --workspace` before `cargo test` (the README's test command does)",
        lib.display()
    );
    let registry = Registry::discover(std::slice::from_ref(&dir));
    let resolved = registry.get("stub").expect("stub is registered");
    assert_eq!(
        resolved.origin(),
        &Origin::Plugin(lib.clone()),
        "the stub plugin must shadow the built-in stub; plugin problems: {:?}",
        registry
            .problems()
            .iter()
            .map(|p| p.error.to_string())
            .collect::<Vec<_>>()
    );

    let plugin = Harness::new("stub_plugin", stub_config(Some(dir.clone()), ""))
        .with_slow(stub_config(Some(dir), "delay = \"200ms\""));
    // Device memory through the fake device runtime: both sides on devices, and mixed.
    let fakedev = |label: &str, initiator: &str, target: &str| {
        Harness::new(label, stub_config(None, ""))
            .with_slow(stub_config(None, "delay = \"200ms\""))
            .with_memory(initiator.parse().unwrap(), target.parse().unwrap())
    };
    // The stub as the contract's adversary: completions out of order, and a slow
    // fabric that cannot stop, so an engine that resolves a handle before the backend
    // has released its batch is caught writing into handed-back memory.
    let adversary =
        Harness::new("stub_adversary", stub_config(None, "reorder = true")).with_slow(stub_config(
            None,
            "delay = \"200ms\"\nignore_abort = true\nreorder = true",
        ));
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
