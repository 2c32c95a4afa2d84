//! This process as the target of a same-host peer: `te bench` in another process is the
//! initiator, with fakedev memory, so its allocations are mapped here and the copies
//! run on this process's fakedev (each group costs `sync_cost`, so copies are in flight
//! long enough to act during them). A killed initiator's mappings are released, and a
//! deregistration during the peer's copies waits for them and ends them. The fakedev
//! settings hold for this whole process, so these tests have their binary to themselves.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use te::{Access, Config, Engine};
use te_core::device::DeviceRuntime;

fn target() -> Engine {
    let text = "[engine]\nbackend = \"tcp\"\n[runtimes.fakedev]\nsync_cost = \"50ms\"\n";
    let c = Config::from_toml(text, "target.toml", std::path::Path::new(".")).unwrap();
    Engine::from_config(&c).unwrap()
}

/// `te bench` against `e` as long as it lasts, with fakedev memory.
fn bench(e: &Engine) -> Child {
    Command::new(env!("CARGO_BIN_EXE_te"))
        .args([
            "bench",
            "--backend",
            "tcp",
            "--mem",
            "fakedev:0",
            "--target",
        ])
        .arg(e.address().to_string())
        .args([
            "--block-size",
            "32KiB",
            "--batch",
            "16",
            "--duration",
            "60s",
        ])
        .args(["--warmup", "0s", "--buffer-size", "8MiB"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("te bench starts")
}

fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < end, "{what} within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_killed_initiators_memory_is_unmapped_and_a_deregistration_waits_for_copies() {
    let e = target();
    let kind: te::MemoryKind = "fakedev:0".parse().unwrap();
    let buffer = e
        .alloc_on(&kind, "buffer", 8 << 20, Access::REMOTE_READ_WRITE)
        .unwrap();
    let dev = te_core::device::fakedev::process().expect("fakedev runs here");

    // A peer killed mid-transfer: what this process mapped of it is released.
    let mut child = bench(&e);
    wait_for(
        "the initiator's memory mapped here",
        Duration::from_secs(30),
        || dev.imported() > 0,
    );
    let copies = dev.stats().copies;
    wait_for("copies on the channel", Duration::from_secs(10), || {
        dev.stats().copies > copies
    });
    // Four threads keep batches on several of the peer's channels at once; its one
    // allocation is mapped here once, shared by them.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(dev.imported(), 1, "one mapping per allocation of the peer");
    child.kill().unwrap();
    child.wait().unwrap();
    wait_for("its mappings released", Duration::from_secs(10), || {
        dev.imported() == 0
    });

    // A deregistration while a peer's copies run: it waits for the one in flight, and
    // none starts after it.
    let mut child = bench(&e);
    wait_for("copies on the channel", Duration::from_secs(30), || {
        dev.imported() > 0 && dev.stats().copies > copies
    });
    let started = Instant::now();
    drop(buffer);
    let waited = started.elapsed();
    let after = dev.stats().copies;
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        dev.stats().copies,
        after,
        "a copy into the region ran after its deregistration returned"
    );
    assert!(
        waited < Duration::from_secs(10),
        "deregistration took {waited:?}"
    );
    let _ = child.kill();
    let _ = child.wait();
    wait_for("its mappings released", Duration::from_secs(10), || {
        dev.imported() == 0
    });
}
