//! A same-host target that dies or stops at the worst moment: `te serve` as the target,
//! this test as the initiator. A target killed inside a copy hands its batch back at
//! once (the end of its socket is the end of the copy), and no submit waits for a
//! stopped target's answer to a share.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use te::{Access, Config, Engine, Peer, TransferRequest};
use te_core::TransferBackend;
use te_tcp::{PeerPath, TcpBackend, TcpConfig};

/// A `te serve` process, killed when dropped.
struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `te serve` on the tcp backend with a `size` buffer named `buffer` in `mem`, with
/// configuration `toml` (through `TE_CONFIG`) if given.
fn serve(mem: &str, size: &str, toml: Option<&str>) -> Server {
    let te = env!("CARGO_BIN_EXE_te");
    let mut cmd = Command::new(te);
    if let Some(text) = toml {
        let f = std::env::temp_dir().join(format!(
            "te-same-host-failures-{}-{:x}.toml",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::write(&f, text).unwrap();
        cmd.env("TE_CONFIG", f);
    }
    let mut child = cmd
        .args([
            "serve",
            "--backend",
            "tcp",
            "--buffer-size",
            size,
            "--mem",
            mem,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("te serve starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("te serve prints its address");
    let addr = line.trim().to_string();
    assert!(!addr.is_empty(), "te serve printed no address");
    Server { child, addr }
}

/// An engine on tcp with `[backends.tcp]` lines `tcp`.
fn engine_tcp(tcp: &str) -> Engine {
    let text =
        format!("[engine]\nbackend = \"tcp\"\ndefault_timeout = \"30s\"\n[backends.tcp]\n{tcp}");
    let c = Config::from_toml(&text, "same_host_failures.toml", std::path::Path::new(".")).unwrap();
    Engine::from_config(&c).expect("engine")
}

/// How a tcp backend of this process reaches `peer`'s target.
fn path(peer: &Peer) -> PeerPath {
    let b = TcpBackend::new(TcpConfig::default(), &te_core::BackendContext::default()).unwrap();
    let id = b
        .connect(
            &peer.segment(),
            te_core::Deadline::after(Duration::from_secs(10)),
        )
        .unwrap();
    b.peer_path(id).unwrap()
}

/// A target whose device copies start with a 1.5 s launch (as in `tests/same_host.rs`).
const SLOW_COPIES: &str = "[runtimes.fakedev]\nlaunch_cost = \"1500ms\"\n";

/// A READ from a target SIGKILLed inside its copy (`BUSY` set in the fence page and
/// never cleared): the batch is handed back with an error soon after the kill, by the
/// channel's own threads, with or without `caller_reads`.
fn killed_inside_a_copy(caller_reads: bool) {
    let server = serve("fakedev:0", "1MiB", Some(SLOW_COPIES));
    let e = engine_tcp(&format!(
        "local_ipc = true\ncaller_reads = {caller_reads}\nconnections_per_peer = 1\n"
    ));
    let kind: te::MemoryKind = "fakedev:0".parse().unwrap();
    let dst = e.alloc_on(&kind, "dst", 1 << 20, Access::LOCAL).unwrap();
    let peer = e.connect(&server.addr).unwrap();
    assert!(matches!(path(&peer), PeerPath::SameHost { .. }));
    let remote = peer.region("buffer").unwrap().id;
    let opts = te::TransferOptions {
        timeout: Some(Duration::from_secs(3)),
        ..Default::default()
    };
    let h = e
        .transfer_with(
            &peer,
            &[TransferRequest::read(dst.id(), 0, remote, 0, 1 << 20)],
            &opts,
        )
        .unwrap();
    // The target has read the request and is in its 1.5 s launch (BUSY set).
    std::thread::sleep(Duration::from_millis(500));
    let pid = server.child.id() as i32;
    // SAFETY: signals the child this test started and still owns.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let killed = Instant::now();
    // Polled, not waited for: no caller drives the channel (with `caller_reads` a
    // waiting caller would read the channel itself); the channel's own threads must
    // hand the batch back.
    let until = killed + Duration::from_secs(12);
    while !h.is_done() && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
    let waited = killed.elapsed();
    if !h.is_done() {
        // Leave the engine and its memory alone: the backend still holds the batch.
        std::mem::forget((h, peer, dst, e));
        panic!(
            "caller_reads = {caller_reads}: the batch (3 s deadline) was not handed back {waited:?} after its target was killed inside a copy"
        );
    }
    assert!(h.wait().is_err(), "the batch cannot have completed");
    assert!(
        waited < Duration::from_secs(2),
        "handed back {waited:?} after the kill, not at the end of the socket"
    );
}

#[test]
fn a_target_killed_inside_a_copy_hands_the_batch_back_at_once() {
    killed_inside_a_copy(false);
}

#[test]
fn a_target_killed_inside_a_copy_hands_the_batch_back_at_once_when_callers_read() {
    killed_inside_a_copy(true);
}

/// Stops process `pid` (a `te serve` the test started) and waits until the kernel
/// shows it stopped: the signal is delivered asynchronously.
fn stop(pid: i32) {
    // SAFETY: signals a child the calling test started and still owns.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let stopped = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit(") ").next().map(|r| r.starts_with('T')))
            .unwrap_or(false)
    };
    let until = Instant::now() + Duration::from_secs(5);
    while !stopped() {
        assert!(Instant::now() < until, "te serve did not stop");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The first batch from a fakedev allocation shares it on the channel; a stopped
/// target never answers that share. Submitting returns at once (the request waits
/// behind the share, not the caller), and the batch fails by its deadline.
#[test]
fn submitting_device_memory_to_a_stopped_target_never_waits_for_the_share() {
    let server = serve("fakedev:0", "1MiB", None);
    let e = engine_tcp("local_ipc = true\nconnections_per_peer = 1\n");
    let kind: te::MemoryKind = "fakedev:0".parse().unwrap();
    let src = e.alloc_on(&kind, "src", 1 << 20, Access::LOCAL).unwrap();
    let peer = e.connect(&server.addr).unwrap();
    assert!(matches!(path(&peer), PeerPath::SameHost { .. }));
    let remote = peer.region("buffer").unwrap().id;
    let pid = server.child.id() as i32;
    stop(pid);
    let opts = te::TransferOptions {
        timeout: Some(Duration::from_secs(4)),
        ..Default::default()
    };
    let start = Instant::now();
    let h = e
        .transfer_with(
            &peer,
            &[TransferRequest::write(src.id(), 0, remote, 0, 1 << 20)],
            &opts,
        )
        .unwrap();
    let submitted = start.elapsed();
    let r = h.wait_timeout(Duration::from_secs(10));
    let ended = start.elapsed();
    // SAFETY: signals the child this test started and still owns.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert!(
        submitted < Duration::from_secs(1),
        "submitting a batch with a 4 s deadline to a stopped target took {submitted:?}"
    );
    let err = r.expect("the batch ends").unwrap_err();
    assert_eq!(err.kind(), te::ErrorKind::Timeout, "{err}");
    assert!(
        ended < Duration::from_millis(5500),
        "a batch with a 4 s deadline ended after {ended:?}"
    );
}
