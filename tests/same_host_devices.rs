//! Two processes that number their devices differently (as `CUDA_VISIBLE_DEVICES` makes
//! them): a same-host peer names the device of each allocation it shares by its
//! host-wide name (`DeviceRuntime::device_id`), and this process, the target, maps it
//! on its own ordinal of that device. fakedev's `visible` plays `CUDA_VISIBLE_DEVICES`.
//! Alone in its binary: this process's fakedev is made once, from the first config.

use std::process::{Command, Stdio};
use std::time::Duration;

use te::{Access, Config, Engine};
use te_core::device::DeviceRuntime;

/// `te bench` against `target` with fakedev:0 memory, its devices numbered `visible`;
/// returns whether it succeeded.
fn bench(target: &Engine, visible: &str) -> bool {
    let dir = std::env::temp_dir().join(format!("te-devices-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join(format!("visible-{}.toml", visible.replace(", ", "-")));
    std::fs::write(
        &config,
        format!("[engine]\nbackend = \"tcp\"\n[runtimes.fakedev]\nvisible = [{visible}]\n"),
    )
    .unwrap();
    let status = Command::new(env!("CARGO_BIN_EXE_te"))
        .args(["bench", "--config"])
        .arg(&config)
        .args(["--mem", "fakedev:0", "--target"])
        .arg(target.address().to_string())
        .args([
            "--block-size",
            "64KiB",
            "--batch",
            "8",
            "--duration",
            "300ms",
        ])
        .args(["--warmup", "0s", "--buffer-size", "1MiB", "--verify"])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .status()
        .expect("te bench runs");
    let _ = std::fs::remove_dir_all(&dir);
    status.success()
}

/// Runs `te bench` as [`bench`] does while watching on which of this process's devices
/// the peer's memory is mapped; returns whether it succeeded and where it was seen.
fn bench_watched(target: &Engine, visible: &str) -> (bool, [bool; 2]) {
    let dev = te_core::device::fakedev::process().expect("fakedev runs here");
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watch = std::thread::spawn({
        let done = done.clone();
        move || {
            let mut seen = [false; 2];
            while !done.load(std::sync::atomic::Ordering::Acquire) {
                seen[0] |= dev.imported_on(0) > 0;
                seen[1] |= dev.imported_on(1) > 0;
                std::thread::sleep(Duration::from_millis(2));
            }
            seen
        }
    });
    let ok = bench(target, visible);
    done.store(true, std::sync::atomic::Ordering::Release);
    (ok, watch.join().unwrap())
}

#[test]
fn a_peer_that_numbers_devices_otherwise_is_mapped_on_the_same_device_here() {
    let c = Config::from_toml(
        "[engine]\nbackend = \"tcp\"\n",
        "target.toml",
        std::path::Path::new("."),
    )
    .unwrap();
    let e = Engine::from_config(&c).unwrap();
    let kind: te::MemoryKind = "fakedev:0".parse().unwrap();
    let _buffer = e
        .alloc_on(&kind, "buffer", 1 << 20, Access::REMOTE_READ_WRITE)
        .unwrap();
    let dev = te_core::device::fakedev::process().expect("fakedev runs here");
    // The peer's fakedev:0 is device 1 (`visible = [1, 0]`), this process's fakedev:1:
    // its memory is mapped there, and every byte is verified.
    let before = dev.stats().copies;
    let (ok, seen) = bench_watched(&e, "1, 0");
    assert!(ok, "te bench with its devices swapped");
    assert_eq!(
        seen,
        [false, true],
        "mapped on fakedev:1, this process's name for it"
    );
    assert!(
        dev.stats().copies > before,
        "the copies ran here, on the channel"
    );
    // The peer numbering its devices as this process does: mapped on fakedev:0.
    let (ok, seen) = bench_watched(&e, "0, 1");
    assert!(ok, "te bench with the same numbering");
    assert_eq!(seen, [true, false], "mapped on fakedev:0");
}
