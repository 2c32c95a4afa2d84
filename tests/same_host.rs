//! Two processes of this host on the tcp backend: `te serve` as the target, this test as
//! the initiator. A proven same-host peer gets the channel (`PeerPath::SameHost`): host
//! memory moves with one cross-memory-attach copy, fakedev memory through its memfd
//! mapped by the target, every byte checked both ways; the target's checks hold on
//! that path; `local_ipc = false` keeps every frame on the socket. A target that dies
//! or stops at the worst moment: killed inside a copy, it hands its batch back at once
//! (the end of its socket is the end of the copy); stopped, no submit waits for its
//! answer to a share.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use te::{Access, Config, Engine, ErrorKind, Peer, TransferRequest};
use te_core::device::DeviceRuntime;
use te_core::{Completion, TransferBackend};
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

/// `te serve` on the tcp backend with a `size` buffer named `buffer` in `mem`; `wrap`
/// is a command it runs under (e.g. `setpriv …`), if any.
fn serve(mem: &str, size: &str, wrap: &[&str]) -> Server {
    serve_with(mem, size, wrap, None)
}

/// As [`serve`], with configuration `toml` (through `TE_CONFIG`) if given.
fn serve_with(mem: &str, size: &str, wrap: &[&str], toml: Option<&str>) -> Server {
    let te = env!("CARGO_BIN_EXE_te");
    let mut args: Vec<&str> = wrap.to_vec();
    args.extend([
        te,
        "serve",
        "--backend",
        "tcp",
        "--buffer-size",
        size,
        "--mem",
        mem,
    ]);
    let mut cmd = Command::new(args[0]);
    if let Some(text) = toml {
        let f = std::env::temp_dir().join(format!(
            "te-same-host-{}-{:x}.toml",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::write(&f, text).unwrap();
        cmd.env("TE_CONFIG", f);
    }
    let mut child = cmd
        .args(&args[1..])
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

fn engine(local_ipc: bool) -> Engine {
    engine_with(local_ipc, false)
}

/// An engine on tcp, with `caller_reads` as given.
fn engine_with(local_ipc: bool, caller_reads: bool) -> Engine {
    engine_tcp(&format!(
        "local_ipc = {local_ipc}\ncaller_reads = {caller_reads}\n"
    ))
}

/// An engine on tcp with `[backends.tcp]` lines `tcp`.
fn engine_tcp(tcp: &str) -> Engine {
    let text =
        format!("[engine]\nbackend = \"tcp\"\ndefault_timeout = \"30s\"\n[backends.tcp]\n{tcp}");
    let c = Config::from_toml(&text, "same_host.toml", std::path::Path::new(".")).unwrap();
    Engine::from_config(&c).expect("engine")
}

/// How a tcp backend of this process reaches `peer`'s target.
fn path(peer: &Peer, local_ipc: bool) -> PeerPath {
    let mut config = TcpConfig::default();
    config.local_ipc = local_ipc;
    let b = TcpBackend::new(config, &te_core::BackendContext::default()).unwrap();
    let id = b
        .connect(
            &peer.segment(),
            te_core::Deadline::after(Duration::from_secs(10)),
        )
        .unwrap();
    b.peer_path(id).unwrap()
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
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while !stopped() {
        assert!(std::time::Instant::now() < until, "te serve did not stop");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn pattern(len: usize, seed: usize) -> Vec<u8> {
    te_core::testkit::pattern(len, seed as u8)
}

/// Moves a block of each of `bufs` to and from the target until it takes the channel:
/// the first transfer of an allocation shares it with the target and goes over the
/// socket, as do those before the target has answered the share.
fn shared_with_target(e: &Engine, peer: &Peer, bufs: &[&te::Buffer]) {
    let remote = peer.region("buffer").unwrap().id;
    let dev = te_core::device::fakedev::process().expect("fakedev");
    for buf in bufs {
        for i in 0.. {
            assert!(
                i < 100,
                "the target never took {:?} on the channel",
                buf.id()
            );
            let before = dev.stats();
            let w = TransferRequest::write(buf.id(), 0, remote, 0, 4096);
            e.transfer(peer, &[w]).unwrap().wait().unwrap();
            if dev.stats().since(&before).copies == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Writes `src`'s blocks scattered into the target's buffer (block i to block i * 37
/// mod n), reads them back into `back` in order, and checks both; returns what this
/// process's fakedev copied during the two transfers.
fn round_trip(
    e: &Engine,
    peer: &Peer,
    src: &te::Buffer,
    back: &te::Buffer,
    block: u64,
    n: u64,
) -> te_core::device::CopyStats {
    let remote = peer.region("buffer").unwrap().id;
    let data = pattern((block * n) as usize, block as usize);
    src.write(0, &data).unwrap();
    let writes: Vec<_> = (0..n)
        .map(|i| TransferRequest::write(src.id(), i * block, remote, (i * 37 % n) * block, block))
        .collect();
    let reads: Vec<_> = (0..n)
        .map(|i| TransferRequest::read(back.id(), i * block, remote, (i * 37 % n) * block, block))
        .collect();
    let dev = te_core::device::fakedev::process();
    let before = dev.as_ref().map(|d| d.stats()).unwrap_or_default();
    e.transfer(peer, &writes).unwrap().wait().unwrap();
    e.transfer(peer, &reads).unwrap().wait().unwrap();
    let moved = dev
        .as_ref()
        .map(|d| d.stats().since(&before))
        .unwrap_or_default();
    assert!(
        back.to_vec().unwrap()[..data.len()] == data[..],
        "bytes read back differ"
    );
    moved
}

#[test]
fn host_memory_moves_between_processes_through_the_channel_both_ways() {
    let server = serve("host", "8MiB", &[]);
    for local_ipc in [true, false] {
        let e = engine(local_ipc);
        let (src, back) = (
            e.alloc("src", 8 << 20, Access::LOCAL).unwrap(),
            e.alloc("back", 8 << 20, Access::LOCAL).unwrap(),
        );
        let peer = e.connect(&server.addr).unwrap();
        let want = if local_ipc {
            PeerPath::SameHost {
                cross_memory_attach: true,
            }
        } else {
            PeerPath::Socket
        };
        assert_eq!(path(&peer, local_ipc), want);
        // The engine says so too, in the backend's words (`te bench` prints them).
        assert_eq!(e.path_to(&peer), Some(want.to_string()));
        round_trip(&e, &peer, &src, &back, 64 << 10, 128);
        round_trip(&e, &peer, &src, &back, 4096, 1024);
    }
}

#[test]
fn fakedev_memory_moves_between_processes_as_device_copies_in_the_target() {
    let server = serve("fakedev:0", "8MiB", &[]);
    let e = engine(true);
    let kind: te::MemoryKind = "fakedev:0".parse().unwrap();
    let src = e.alloc_on(&kind, "src", 8 << 20, Access::LOCAL).unwrap();
    let back = e.alloc_on(&kind, "back", 8 << 20, Access::LOCAL).unwrap();
    let peer = e.connect(&server.addr).unwrap();
    assert!(matches!(path(&peer, true), PeerPath::SameHost { .. }));
    shared_with_target(&e, &peer, &[&src, &back]);
    // The target maps our memory and copies on its side: this process copies nothing.
    let moved = round_trip(&e, &peer, &src, &back, 32 << 10, 256);
    assert_eq!(
        moved.copies, 0,
        "the initiator copied device memory itself: {moved:?}"
    );
    let moved = round_trip(&e, &peer, &src, &back, 1 << 20, 8);
    assert_eq!(moved.copies, 0, "{moved:?}");
}

#[test]
fn the_target_checks_every_request_on_the_channel() {
    let server = serve("host", "64KiB", &[]);
    let e = engine(true);
    let peer = e.connect(&server.addr).unwrap();
    let remote = peer.region("buffer").unwrap();
    // A backend that skips the engine's own checks, as a hostile initiator would.
    let b = TcpBackend::new(TcpConfig::default(), &te_core::BackendContext::default()).unwrap();
    let id = b
        .connect(
            &peer.segment(),
            te_core::Deadline::after(Duration::from_secs(10)),
        )
        .unwrap();
    assert!(matches!(
        b.peer_path(id).unwrap(),
        PeerPath::SameHost { .. }
    ));
    let mut raw = vec![0xeeu8; 64];
    let mem = te::MemoryDesc {
        name: "raw".into(),
        addr: raw.as_mut_ptr() as u64,
        len: raw.len() as u64,
        kind: te::MemoryKind::Host,
        access: Access::LOCAL,
    };
    b.register(te::RegionId(1), &mem).unwrap();
    let run = |req: TransferRequest| {
        let (tx, rx) = std::sync::mpsc::channel();
        let done = Completion::new(Duration::from_secs(10), move |r, _| {
            let _ = tx.send(r);
        });
        b.submit(id, &[req], done).unwrap();
        rx.recv_timeout(Duration::from_secs(10)).unwrap()
    };
    let past = TransferRequest::write(te::RegionId(1), 0, remote.id, (64 << 10) - 16, 32);
    let err = run(past).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfBounds, "{err}");
    assert!(
        err.to_string().contains("same-host"),
        "refused on the channel: {err}"
    );
    let unknown = TransferRequest::write(te::RegionId(1), 0, te::RegionId(999), 0, 16);
    let err = run(unknown).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotRegistered, "{err}");
    // The channel and the peer still work.
    let ok = TransferRequest::write(te::RegionId(1), 0, remote.id, 0, 64);
    run(ok).unwrap();
    let check = e.alloc("check", 64, Access::LOCAL).unwrap();
    let req = TransferRequest::read(check.id(), 0, remote.id, 0, 64);
    e.transfer(&peer, &[req]).unwrap().wait().unwrap();
    assert_eq!(check.to_vec().unwrap(), vec![0xee; 64]);
}

#[test]
fn a_stopped_same_host_target_fails_the_batch_at_its_deadline() {
    let server = serve("host", "4MiB", &[]);
    let e = engine(true);
    let src = e.alloc("src", 4 << 20, Access::LOCAL).unwrap();
    let peer = e.connect(&server.addr).unwrap();
    assert!(matches!(path(&peer, true), PeerPath::SameHost { .. }));
    let remote = peer.region("buffer").unwrap().id;
    let pid = server.child.id() as i32;
    stop(pid);
    let start = std::time::Instant::now();
    let opts = te::TransferOptions {
        timeout: Some(Duration::from_secs(1)),
        ..Default::default()
    };
    let r = e
        .transfer_with(
            &peer,
            &[TransferRequest::read(src.id(), 0, remote, 0, 4 << 20)],
            &opts,
        )
        .unwrap()
        .wait();
    let took = start.elapsed();
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    let err = r.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "the batch ended after {took:?}"
    );
}

#[test]
fn a_request_left_in_a_channel_the_initiator_closed_is_not_served() {
    // The initiator sends a READ to a stopped target, then closes: the batch is handed
    // back. The request is still in the channel's socket; the target, resumed, must
    // not copy into memory the initiator already got back.
    let server = serve("host", "1MiB", &[]);
    let e = engine(true);
    let src = e.alloc("src", 1 << 20, Access::LOCAL).unwrap();
    let dst = e.alloc("dst", 1 << 20, Access::LOCAL).unwrap();
    let peer = e.connect(&server.addr).unwrap();
    assert!(matches!(
        path(&peer, true),
        PeerPath::SameHost {
            cross_memory_attach: true,
            ..
        }
    ));
    let remote = peer.region("buffer").unwrap().id;
    src.write(0, &vec![0x5a; 1 << 20]).unwrap();
    e.transfer(
        &peer,
        &[TransferRequest::write(src.id(), 0, remote, 0, 1 << 20)],
    )
    .unwrap()
    .wait()
    .unwrap();
    dst.write(0, &vec![0x11; 1 << 20]).unwrap();
    let pid = server.child.id() as i32;
    stop(pid);
    let h = read_mib(&e, &peer, &dst, remote, Duration::from_secs(20));
    std::thread::sleep(Duration::from_millis(100));
    drop(peer);
    drop(e);
    assert!(h.wait().is_err(), "the batch cannot have completed");
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        dst.to_vec().unwrap().iter().all(|&b| b == 0x11),
        "the target copied into memory handed back to its owner"
    );
    drop(server);
}

#[test]
fn closing_the_engine_frees_a_caller_waiting_on_a_stopped_same_host_target() {
    // With `caller_reads` the waiting caller reads its channel's answers itself; the
    // engine's close must still end its wait at once, not at the batch's deadline.
    let server = serve("fakedev:0", "4MiB", &[]);
    let e = engine_with(true, true);
    let kind: te::MemoryKind = "fakedev:0".parse().unwrap();
    let src = e.alloc_on(&kind, "src", 4 << 20, Access::LOCAL).unwrap();
    let peer = e.connect(&server.addr).unwrap();
    assert!(matches!(path(&peer, true), PeerPath::SameHost { .. }));
    let remote = peer.region("buffer").unwrap().id;
    let read = [TransferRequest::read(src.id(), 0, remote, 0, 4 << 20)];
    // Once while the target runs, so the allocation is shared and mapped there.
    e.transfer(&peer, &read).unwrap().wait().unwrap();
    let pid = server.child.id() as i32;
    // Killed at the end, never resumed, so it cannot serve the request after this
    // process let go of `src`.
    stop(pid);
    let opts = te::TransferOptions {
        timeout: Some(Duration::from_secs(20)),
        ..Default::default()
    };
    let h = e.transfer_with(&peer, &read, &opts).unwrap();
    let waiter = std::thread::spawn(move || {
        let r = h.wait();
        (r, std::time::Instant::now())
    });
    std::thread::sleep(Duration::from_millis(200));
    let start = std::time::Instant::now();
    drop(peer);
    drop(e);
    let (r, ended) = waiter.join().unwrap();
    assert!(r.is_err(), "the batch cannot have completed");
    assert!(
        ended.duration_since(start) < Duration::from_secs(5),
        "the wait ended {:?} after the close",
        ended.duration_since(start)
    );
    drop(src);
    drop(server);
}

/// A target whose device copies start with a 1.5 s launch: a request it has begun to
/// copy is still being copied long after its batch's deadline.
const SLOW_COPIES: &str = "[runtimes.fakedev]\nlaunch_cost = \"1500ms\"\n";

/// A 1 MiB READ into fresh fakedev memory (filled with 0x11) from a target whose
/// copies are slow, with `timeout`: the engine, the handle, the memory and when the
/// batch was submitted.
fn slow_read(
    server: &Server,
    timeout: Duration,
) -> (
    Engine,
    Peer,
    te::TransferHandle,
    te::Buffer,
    std::time::Instant,
) {
    let e = engine(true);
    let kind: te::MemoryKind = "fakedev:0".parse().unwrap();
    let dst = e.alloc_on(&kind, "dst", 1 << 20, Access::LOCAL).unwrap();
    dst.write(0, &vec![0x11; 1 << 20]).unwrap();
    let peer = e.connect(&server.addr).unwrap();
    assert!(matches!(path(&peer, true), PeerPath::SameHost { .. }));
    // Shared first (its own transfers pay the target's slow copies): the READ below
    // must take the channel.
    shared_with_target(&e, &peer, &[&dst]);
    dst.write(0, &vec![0x11; 1 << 20]).unwrap();
    let remote = peer.region("buffer").unwrap().id;
    let start = std::time::Instant::now();
    let h = read_mib(&e, &peer, &dst, remote, timeout);
    (e, peer, h, dst, start)
}

/// Submits a READ of the first MiB of `peer`'s region `remote` into `dst`, with
/// `timeout`.
fn read_mib(
    e: &Engine,
    peer: &Peer,
    dst: &te::Buffer,
    remote: te::RegionId,
    timeout: Duration,
) -> te::TransferHandle {
    let opts = te::TransferOptions {
        timeout: Some(timeout),
        ..Default::default()
    };
    e.transfer_with(
        peer,
        &[TransferRequest::read(dst.id(), 0, remote, 0, 1 << 20)],
        &opts,
    )
    .unwrap()
}

/// The caller, given `dst` back at `handed_back` after `start`, fills it with 0x22 and
/// finds it unchanged once any copy the target ran has long ended.
fn untouched_after_hand_back(dst: &te::Buffer, start: std::time::Instant, handed_back: Duration) {
    assert!(
        handed_back >= Duration::from_millis(1400),
        "handed back after {handed_back:?}, while the target's copy (1.5 s) ran"
    );
    dst.write(0, &vec![0x22; 1 << 20]).unwrap();
    std::thread::sleep(Duration::from_millis(2500).saturating_sub(start.elapsed()));
    let changed = dst.to_vec().unwrap().iter().filter(|&&b| b != 0x22).count();
    assert_eq!(changed, 0, "bytes landed after the batch was handed back");
}

#[test]
fn a_batch_past_its_deadline_is_handed_back_only_once_the_targets_copy_has_ended() {
    // The target has begun the copy when the deadline passes; the channel is stopped a
    // grace later, but the batch waits for the copy: its bytes cannot land after.
    let server = serve_with("fakedev:0", "1MiB", &[], Some(SLOW_COPIES));
    let (_e, _peer, h, dst, start) = slow_read(&server, Duration::from_millis(500));
    let err = h.wait().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    untouched_after_hand_back(&dst, start, start.elapsed());
}

#[test]
fn closing_the_engine_while_the_target_copies_hands_the_batch_back_after_the_copy() {
    let server = serve_with("fakedev:0", "1MiB", &[], Some(SLOW_COPIES));
    let (e, peer, h, dst, start) = slow_read(&server, Duration::from_secs(20));
    // The target has read the request and is in its copy's launch.
    std::thread::sleep(Duration::from_millis(300));
    drop(peer);
    drop(e);
    // The copy ran to its end: the batch may have completed, or be cancelled.
    let _ = h.wait();
    untouched_after_hand_back(&dst, start, start.elapsed());
}

#[test]
fn submitting_to_a_stopped_target_never_waits_and_a_batch_ends_at_its_deadline() {
    // One channel; the target stops reading. A request larger than the socket holds is
    // left to the channel's writing thread, so neither its caller nor the next batch's
    // waits for the target, and the next batch ends at its own deadline.
    let server = serve("host", "4MiB", &[]);
    let e = engine_tcp("connections_per_peer = 1\n");
    let src = e.alloc("src", 4 << 20, Access::LOCAL).unwrap();
    let peer = e.connect(&server.addr).unwrap();
    assert!(matches!(path(&peer, true), PeerPath::SameHost { .. }));
    let remote = peer.region("buffer").unwrap().id;
    let write = |at: u64| TransferRequest::write(src.id(), at, remote, at, 8);
    e.transfer(&peer, &[write(0)]).unwrap().wait().unwrap();
    let pid = server.child.id() as i32;
    stop(pid);
    let opts = |timeout| te::TransferOptions {
        timeout: Some(timeout),
        ..Default::default()
    };
    // 40,000 entries: a request of 1.6 MB.
    let many: Vec<_> = (0..40_000).map(|i| write(i * 64)).collect();
    let start = std::time::Instant::now();
    let big = e
        .transfer_with(&peer, &many, &opts(Duration::from_secs(20)))
        .unwrap();
    let submitted = start.elapsed();
    let start = std::time::Instant::now();
    let r = e
        .transfer_with(&peer, &[write(0)], &opts(Duration::from_millis(500)))
        .unwrap()
        .wait();
    let ended = start.elapsed();
    // SAFETY: signals the child this test started and still owns.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert!(
        submitted < Duration::from_secs(1),
        "submitting took {submitted:?}"
    );
    let err = r.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    assert!(
        ended < Duration::from_millis(2500),
        "a batch with a 500 ms deadline ended after {ended:?}"
    );
    // The stalled channel was stopped: the large batch went with it.
    assert!(big.wait().is_err());
}

/// A READ from a target SIGKILLed inside its copy (`BUSY` set in the fence page and
/// never cleared): the batch is handed back with an error soon after the kill, by the
/// channel's own threads, with or without `caller_reads`.
fn killed_inside_a_copy(caller_reads: bool) {
    let server = serve_with("fakedev:0", "1MiB", &[], Some(SLOW_COPIES));
    let e = engine_tcp(&format!(
        "local_ipc = true\ncaller_reads = {caller_reads}\nconnections_per_peer = 1\n"
    ));
    let kind: te::MemoryKind = "fakedev:0".parse().unwrap();
    let dst = e.alloc_on(&kind, "dst", 1 << 20, Access::LOCAL).unwrap();
    let peer = e.connect(&server.addr).unwrap();
    assert!(matches!(path(&peer, true), PeerPath::SameHost { .. }));
    // Shared first: the READ below must take the channel, not the socket.
    shared_with_target(&e, &peer, &[&dst]);
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

/// The first batch from a fakedev allocation shares it on the channel; a stopped
/// target never answers that share. Submitting returns at once (the request waits
/// behind the share, not the caller), and the batch fails by its deadline.
#[test]
fn submitting_device_memory_to_a_stopped_target_never_waits_for_the_share() {
    let server = serve("fakedev:0", "1MiB", &[]);
    let e = engine_tcp("local_ipc = true\nconnections_per_peer = 1\n");
    let kind: te::MemoryKind = "fakedev:0".parse().unwrap();
    let src = e.alloc_on(&kind, "src", 1 << 20, Access::LOCAL).unwrap();
    let peer = e.connect(&server.addr).unwrap();
    assert!(matches!(path(&peer, true), PeerPath::SameHost { .. }));
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
