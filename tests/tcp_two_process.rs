//! The tcp backend across two processes: `te serve` as the target, this test as the
//! initiator, over loopback.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use te::{Access, Config, Engine, ErrorKind, Peer, TransferOptions, TransferRequest};
use te_core::{Completion, TransferBackend};

/// A `te serve` process, killed when dropped.
struct Server {
    child: Child,
    addr: String,
    _dir: TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!(
            "te-tcp-2p-{tag}-{}-{:x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&p).expect("temp dir");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tcp_table(token: Option<&str>) -> String {
    match token {
        Some(t) => format!("auth_token = \"{t}\"\n"),
        None => String::new(),
    }
}

/// Starts `te serve` on the tcp backend with a `buffer_size`-byte buffer named `buffer`.
fn serve(token: Option<&str>, listen: Option<&str>, buffer_size: &str) -> Server {
    serve_with(&tcp_table(token), listen, buffer_size, "host")
}

/// As [`serve`], with `table` as the `[backends.tcp]` table and the buffer in `mem`.
fn serve_with(table: &str, listen: Option<&str>, buffer_size: &str, mem: &str) -> Server {
    let dir = TempDir::new("serve");
    let path = dir.0.join("serve.toml");
    std::fs::write(
        &path,
        format!("[engine]\nbackend = \"tcp\"\n[backends.tcp]\n{table}"),
    )
    .expect("write config");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_te"));
    cmd.args(["serve", "--config"])
        .arg(&path)
        .args(["--buffer-size", buffer_size, "--mem", mem]);
    if let Some(l) = listen {
        cmd.args(["--listen", l]);
    }
    let mut child = cmd
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
    Server {
        child,
        addr,
        _dir: dir,
    }
}

fn initiator(token: Option<&str>) -> Engine {
    initiator_with(&tcp_table(token))
}

/// An initiator engine with `table` as its `[backends.tcp]` table.
fn initiator_with(table: &str) -> Engine {
    let text =
        format!("[engine]\nbackend = \"tcp\"\ndefault_timeout = \"30s\"\n[backends.tcp]\n{table}");
    let c = Config::from_toml(&text, "tcp_two_process.toml", std::path::Path::new("."))
        .expect("valid config");
    Engine::from_config(&c).expect("initiator engine")
}

use te_core::testkit::pattern;

fn write_all(e: &Engine, peer: &Peer, src: &te::Buffer, len: u64) -> te::Result<()> {
    let remote = peer.region("buffer").expect("te serve registers `buffer`");
    let req = TransferRequest::write(src.id(), 0, remote.id, 0, len);
    e.transfer(peer, &[req])?.wait()
}

fn read_all(e: &Engine, peer: &Peer, dst: &te::Buffer, len: u64) -> te::Result<()> {
    let remote = peer.region("buffer").expect("te serve registers `buffer`");
    let req = TransferRequest::read(dst.id(), 0, remote.id, 0, len);
    e.transfer(peer, &[req])?.wait()
}

#[test]
fn bytes_written_to_another_process_read_back_the_same() {
    let server = serve(None, None, "8MiB");
    let e = initiator(None);
    let len = 8 << 20;
    let src = e.alloc("src", len, Access::LOCAL).unwrap();
    let dst = e.alloc("dst", len, Access::LOCAL).unwrap();
    let data = pattern(len, 1);
    src.write(0, &data).unwrap();
    let peer = e.connect(&server.addr).unwrap();
    // Many small batches from several threads, then one large one, then read it all.
    let remote = peer.region("buffer").unwrap().id;
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (e, peer, src) = (&e, &peer, &src);
            s.spawn(move || {
                let mut hs = Vec::new();
                for i in 0..64u64 {
                    let off = (t * 64 + i) * 4096;
                    let req = TransferRequest::write(src.id(), off, remote, off, 4096);
                    hs.push(e.transfer(peer, &[req]).unwrap());
                }
                for h in hs {
                    h.wait().unwrap();
                }
            });
        }
    });
    write_all(&e, &peer, &src, len as u64).unwrap();
    read_all(&e, &peer, &dst, len as u64).unwrap();
    assert!(dst.to_vec().unwrap() == data, "bytes read back differ");
}

#[test]
fn a_write_past_the_region_end_is_refused_with_out_of_bounds_and_memory_is_unchanged() {
    let server = serve(None, None, "64KiB");
    let e = initiator(None);
    let src = e.alloc("src", 128 << 10, Access::LOCAL).unwrap();
    let check = e.alloc("check", 64 << 10, Access::LOCAL).unwrap();
    let before = pattern(64 << 10, 5);
    src.write(0, &before).unwrap();
    let peer = e.connect(&server.addr).unwrap();
    write_all(&e, &peer, &src, 64 << 10).unwrap();
    src.write(0, &vec![0xee; 128 << 10]).unwrap();
    let remote = peer.region("buffer").unwrap();
    // The engine refuses it before anything is posted...
    let past = TransferRequest::write(src.id(), 0, remote.id, (64 << 10) - 16, 32);
    let err = e.transfer(&peer, &[past]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfBounds, "{err}");
    // ...and so does the target itself, when a backend bypasses the engine's check.
    let registry = te_core::Registry::discover(&[]);
    let backend: Arc<dyn TransferBackend> = registry
        .get("tcp")
        .unwrap()
        .create(&Config::defaults().backend_context("tcp"))
        .unwrap();
    let mut raw = vec![0xeeu8; 64];
    let mem = te::MemoryDesc {
        name: "raw".into(),
        addr: raw.as_mut_ptr() as u64,
        len: raw.len() as u64,
        kind: te::MemoryKind::Host,
        access: Access::LOCAL,
    };
    backend.register(te::RegionId(1), &mem).unwrap();
    let id = backend
        .connect(
            &peer.segment(),
            te_core::Deadline::after(Duration::from_secs(10)),
        )
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let done = Completion::new(Duration::from_secs(10), move |r, _| {
        let _ = tx.send(r);
    });
    let bad = TransferRequest::write(te::RegionId(1), 0, remote.id, (64 << 10) - 16, 32);
    backend.submit(id, &[bad], done).unwrap();
    let r = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(r.unwrap_err().kind(), ErrorKind::OutOfBounds);
    backend
        .deregister(
            te::RegionId(1),
            te_core::Deadline::after(Duration::from_secs(10)),
        )
        .unwrap();
    drop(backend);
    read_all(&e, &peer, &check, 64 << 10).unwrap();
    assert!(
        check.to_vec().unwrap() == before,
        "the target's memory changed after refused writes"
    );
}

#[test]
fn a_peer_killed_mid_transfer_fails_the_batch_well_within_its_deadline_and_others_keep_working() {
    // The target holds every request 2 s (and so takes no same-host shortcut), so the
    // batches are certainly in flight over the socket when it is killed.
    let mut doomed = serve_with("debug_delay = \"2s\"\n", None, "64MiB", "host");
    let healthy = serve(None, None, "1MiB");
    let e = initiator(None);
    let src = e.alloc("src", 64 << 20, Access::LOCAL).unwrap();
    src.write(0, &pattern(1 << 20, 9)).unwrap();
    let peer = e.connect(&doomed.addr).unwrap();
    let other = e.connect(&healthy.addr).unwrap();
    let remote = peer.region("buffer").unwrap().id;
    let reqs: Vec<TransferRequest> = (0..64u64)
        .map(|i| TransferRequest::write(src.id(), i << 20, remote, i << 20, 1 << 20))
        .collect();
    let options = TransferOptions {
        timeout: Some(Duration::from_secs(30)),
        ..TransferOptions::default()
    };
    // Keep batches in flight, then kill the target under them.
    let mut handles = Vec::new();
    for _ in 0..8 {
        handles.push(e.transfer_with(&peer, &reqs, &options).unwrap());
    }
    doomed.child.kill().unwrap();
    let killed = Instant::now();
    let mut failures = 0;
    for h in handles {
        if let Err(err) = h.wait() {
            assert_eq!(err.kind(), ErrorKind::PeerUnreachable, "{err}");
            failures += 1;
        }
    }
    let took = killed.elapsed();
    assert!(failures > 0, "every batch finished before the kill");
    assert!(took < Duration::from_secs(5), "failing took {took:?}");
    // The dead peer stays dead; the other one works.
    let again = e.transfer_with(&peer, &reqs[..1], &options);
    assert!(
        again.and_then(|h| h.wait()).is_err(),
        "a transfer to a killed peer succeeded"
    );
    write_all(&e, &other, &src, 1 << 20).unwrap();
}

#[test]
fn after_a_restart_the_next_transfer_goes_to_the_new_instance() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let listen = format!("127.0.0.1:{port}");
    let first = serve(None, Some(&listen), "1MiB");
    let e = initiator(None);
    let src = e.alloc("src", 1 << 20, Access::LOCAL).unwrap();
    let dst = e.alloc("dst", 1 << 20, Access::LOCAL).unwrap();
    src.write(0, &pattern(1 << 20, 1)).unwrap();
    let peer = e.connect(&first.addr).unwrap();
    write_all(&e, &peer, &src, 1 << 20).unwrap();
    drop(first);
    let second = serve(None, Some(&listen), "1MiB");
    assert_eq!(second.addr, listen);
    // The old peer belongs to the previous life: refused, not delivered.
    let err = write_all(&e, &peer, &src, 1 << 20).unwrap_err();
    assert!(
        matches!(
            err.kind(),
            ErrorKind::PeerUnreachable | ErrorKind::PeerRestarted
        ),
        "{err}"
    );
    let fresh = e.connect(&second.addr).unwrap();
    assert_ne!(
        fresh.epoch(),
        peer.epoch(),
        "a new instance has a new epoch"
    );
    // The new instance's buffer is still zero: nothing of the old life reached it.
    read_all(&e, &fresh, &dst, 1 << 20).unwrap();
    assert!(dst.to_vec().unwrap().iter().all(|&b| b == 0));
    src.write(0, &pattern(1 << 20, 2)).unwrap();
    write_all(&e, &fresh, &src, 1 << 20).unwrap();
    read_all(&e, &fresh, &dst, 1 << 20).unwrap();
    assert!(dst.to_vec().unwrap() == pattern(1 << 20, 2));
}

#[test]
fn a_wrong_or_missing_auth_token_is_refused() {
    let server = serve(Some("open sesame"), None, "64KiB");
    for token in [None, Some("open sesame!")] {
        let e = initiator(token);
        let err = e.connect(&server.addr).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Unauthorized, "{token:?}: {err}");
        assert!(err.to_string().contains("auth_token"), "{err}");
    }
    let e = initiator(Some("open sesame"));
    let src = e.alloc("src", 64 << 10, Access::LOCAL).unwrap();
    let peer = e.connect(&server.addr).unwrap();
    write_all(&e, &peer, &src, 64 << 10).unwrap();
}

#[test]
fn device_blocks_move_intact_between_processes_with_different_slice_sizes() {
    // The target stages through 64 KiB buffers; the initiator would cut 8 MiB slices.
    // Before the handshake agreed a limit, this overran the target's heap.
    const BLOCK: u64 = 4 << 20;
    let server = serve_with("slice_size = \"64KiB\"\n", None, "16MiB", "fakedev:0");
    let e = initiator_with("slice_size = \"8MiB\"\n");
    let dev: te::MemoryKind = "fakedev:0".parse().unwrap();
    let src = e
        .alloc_on(&dev, "src", 4 * BLOCK as usize, Access::LOCAL)
        .unwrap();
    let dst = e
        .alloc_on(&dev, "dst", 4 * BLOCK as usize, Access::LOCAL)
        .unwrap();
    let data = pattern(4 * BLOCK as usize, 9);
    src.write(0, &data).unwrap();
    let peer = e.connect(&server.addr).unwrap();
    let remote = peer.region("buffer").unwrap().id;
    let writes: Vec<_> = (0..4)
        .map(|i| TransferRequest::write(src.id(), i * BLOCK, remote, (3 - i) * BLOCK, BLOCK))
        .collect();
    e.transfer(&peer, &writes).unwrap().wait().unwrap();
    let reads: Vec<_> = (0..4)
        .map(|i| TransferRequest::read(dst.id(), i * BLOCK, remote, (3 - i) * BLOCK, BLOCK))
        .collect();
    e.transfer(&peer, &reads).unwrap().wait().unwrap();
    assert!(dst.to_vec().unwrap() == data, "blocks read back differ");
    // The target is still alive and serving.
    e.transfer(&peer, &writes[..1]).unwrap().wait().unwrap();
}
