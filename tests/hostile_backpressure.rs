//! Hostile peers that send and never read, or hold what a genuine peer needs: the
//! unread-reply flood of every request kind against a server (`te serve`) and against
//! an initiator, idle connections holding the tcp data listener's pending handshakes,
//! and a peer's 60 KB error text. Under each, memory and threads stay near their idle
//! values and a genuine peer connecting meanwhile moves verified data.
//!
//! The tests run one at a time (they share the heap counter and the thread count).

mod common;

use std::io::{ErrorKind as IoKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ciborium::value::Value;
use common::{kind, serial, Counting, MIB};
use te::{Access, Config, Engine, EngineConfig, TransferRequest};

#[global_allocator]
static HEAP: Counting = Counting;

/// The heartbeat of the engines under attack: a peer that does not read for three of
/// them (600 ms) is closed. Genuine peers keep the default, so that a loaded machine's
/// pauses do not drop their sessions mid-test.
const HEARTBEAT: Duration = Duration::from_millis(200);

/// The control plane's blocking threads: 8 workers for backend requests
/// (`control/server.rs`), 4 for looking up peers' host names and 1 for telling the
/// backend of peers gone (`control/mod.rs`). A worker lets go of its turn as its
/// request ends, just before its thread is idle again, so a flood can start every one
/// of them.
const BLOCKING_THREADS: u64 = 8 + 4 + 1;

/// An engine under attack, on the short [`HEARTBEAT`].
fn engine(set: impl FnOnce(&mut EngineConfig)) -> Engine {
    genuine(|c| {
        c.heartbeat = HEARTBEAT;
        set(c)
    })
}

/// A genuine peer's engine, on the default heartbeat.
fn genuine(set: impl FnOnce(&mut EngineConfig)) -> Engine {
    let mut c = Config::defaults();
    c.engine.backend = "tcp".into();
    set(&mut c.engine);
    Engine::from_config(&c).unwrap()
}

/// A genuine peer: connects to `addr` (within 10 s), writes 64 KiB of `fill` into its
/// region `region` and reads them back into a second buffer, verified.
fn genuine_transfer(me: &Engine, addr: &str, region: &str, fill: u8) {
    let n = 64 << 10;
    let src = me.alloc("src", n, Access::LOCAL).unwrap();
    let back = me.alloc("back", n, Access::LOCAL).unwrap();
    src.write(0, &vec![fill; n]).unwrap();
    let peer = me
        .connect_with(addr, Duration::from_secs(10))
        .expect("a genuine peer connects");
    let rid = peer
        .region(region)
        .expect("the descriptor names the region")
        .id;
    me.transfer(
        &peer,
        &[TransferRequest::write(src.id(), 0, rid, 0, n as u64)],
    )
    .unwrap()
    .wait()
    .expect("a genuine peer's write completes");
    me.transfer(
        &peer,
        &[TransferRequest::read(back.id(), 0, rid, 0, n as u64)],
    )
    .unwrap()
    .wait()
    .expect("a genuine peer's read completes");
    assert_eq!(back.to_vec().unwrap(), vec![fill; n], "verified");
}

/// Makes the kernel hold little of what the peer sends to `s`, so an engine that writes
/// to a peer that does not read finds its writes stalled soon.
fn small_receive_buffer(s: &TcpStream) {
    let v: libc::c_int = 4096;
    // SAFETY: `s` is an open socket; the option value is a valid c_int of that size.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(r, 0, "setsockopt(SO_RCVBUF)");
}

/// Writes `frame` over and over, 256 at a time, never reading, until the engine closes
/// the connection, `max` frames are sent, or `limit` passes. Returns the frames sent
/// and, if the engine closed it, when.
fn flood(
    mut s: TcpStream,
    frame: Vec<u8>,
    max: usize,
    limit: Duration,
) -> (usize, Option<Duration>) {
    s.set_write_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let chunk: Vec<u8> = frame
        .iter()
        .copied()
        .cycle()
        .take(frame.len() * 256)
        .collect();
    let start = Instant::now();
    let mut sent = 0;
    let mut off = 0;
    while sent < max && start.elapsed() < limit {
        match s.write(&chunk[off..]) {
            Ok(0) => return (sent, Some(start.elapsed())),
            Ok(n) => {
                off += n;
                if off == chunk.len() {
                    off = 0;
                    sent += 256;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    IoKind::WouldBlock | IoKind::TimedOut | IoKind::Interrupted
                ) => {}
            Err(_) => return (sent, Some(start.elapsed())),
        }
    }
    (sent, None)
}

/// A backend request's payload: the sender's deadline and `len` bytes for the backend.
fn backend_msg(len: usize) -> Vec<u8> {
    common::cbor(vec![
        ("timeout_ms", common::int(1000)),
        ("payload", Value::Bytes(vec![7; len])),
    ])
}

/// A temporary configuration file for `te serve`, removed when dropped.
struct ConfigFile(std::path::PathBuf);

impl ConfigFile {
    fn new(text: &str) -> ConfigFile {
        let p = std::env::temp_dir().join(format!("te-backpressure-{}.toml", std::process::id()));
        std::fs::write(&p, text).unwrap();
        ConfigFile(p)
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn a_session_that_never_reads_its_replies_is_throttled_then_closed_for_every_request_kind() {
    let _s = serial();
    let config = ConfigFile::new(
        "[engine]\nbackend = \"tcp\"\nheartbeat = \"200ms\"\nnotification_bytes = \"1MiB\"\n",
    );
    let path = config.0.to_str().unwrap();
    let serve = common::Serve::start(&["--config", path, "--buffer-size", "1MiB"]);
    let me = genuine(|_| {});
    // Once before measuring, so that what starts at the first peer has started.
    genuine_transfer(&me, &serve.addr, "buffer", 0x11);
    std::thread::sleep(Duration::from_millis(300));
    let (rss_idle, threads_idle) = (serve.rss_kib(), serve.threads());
    let epoch = {
        let (_, ready) = common::handshake(&serve.addr, "probe", 1).unwrap();
        match common::field(&ready, "epoch") {
            Some(Value::Integer(i)) => u64::try_from(i128::from(i)).unwrap(),
            other => panic!("ready names no epoch: {other:?}"),
        }
    };
    let floods = [
        (
            "Backend",
            common::frame(kind::BACKEND, 1, &backend_msg(4096)),
        ),
        ("GetSegment", common::frame(kind::GET_SEGMENT, 1, &[])),
        (
            "Notify",
            common::frame(kind::NOTIFY, 1, &common::notice(epoch, &[1; 1024], vec![])),
        ),
        ("Ping", common::frame(kind::PING, 1, &[])),
    ];
    for (i, (what, frame)) in floods.into_iter().enumerate() {
        let (s, _) = common::handshake(&serve.addr, "flooder", 2 + i as u64).unwrap();
        let attack =
            std::thread::spawn(move || flood(s, frame, 2_000_000, Duration::from_secs(15)));
        let (mut rss_peak, mut threads_peak) = (0, 0);
        let mut served = false;
        while !attack.is_finished() {
            rss_peak = rss_peak.max(serve.rss_kib());
            threads_peak = threads_peak.max(serve.threads());
            if !served {
                // A genuine peer during the flood, over a session of its own.
                genuine_transfer(&genuine(|_| {}), &serve.addr, "buffer", 0x20 + i as u8);
                served = true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let (sent, closed) = attack.join().unwrap();
        if !served {
            genuine_transfer(&genuine(|_| {}), &serve.addr, "buffer", 0x20 + i as u8);
        }
        rss_peak = rss_peak.max(serve.rss_kib());
        println!(
            "{what} flood: {sent} frames sent unread; te serve RSS {rss_idle} KiB idle, peak {rss_peak} KiB \
             (+{} KiB); threads {threads_idle} idle, peak {threads_peak}; closed after {closed:?}",
            rss_peak.saturating_sub(rss_idle)
        );
        assert!(
            closed.is_some(),
            "te serve never closed a session that did not read ({what})"
        );
        assert!(
            rss_peak < rss_idle + 16 * 1024,
            "a {what} flood grew te serve from {rss_idle} to {rss_peak} KiB"
        );
        assert!(
            threads_peak <= threads_idle + BLOCKING_THREADS,
            "a {what} flood grew te serve from {threads_idle} to {threads_peak} threads"
        );
    }
    // And after every flood, the first peer's session still works.
    genuine_transfer(&me, &serve.addr, "buffer", 0x33);
}

/// A fake target's control plane: it answers the handshake and the descriptor request
/// with what `real` said (so the initiator connects, its data going to `real`), then
/// sends `frame` over and over without reading. Returns its address and the flood's
/// outcome.
fn fake_target(
    real: &Engine,
    frame: Vec<u8>,
) -> (String, std::thread::JoinHandle<(usize, Option<Duration>)>) {
    let (mut probe, ready) = common::handshake(&real.address().to_string(), "probe", 1).unwrap();
    probe
        .write_all(&common::frame(kind::GET_SEGMENT, 1, &[]))
        .unwrap();
    let (k, _, segment) = common::read_frame(&mut probe).unwrap();
    assert_eq!(k, kind::SEGMENT);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let t = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        small_receive_buffer(&s);
        let (k, _, _) = common::read_frame(&mut s).unwrap();
        assert_eq!(k, kind::HELLO);
        let welcome = common::cbor(vec![
            ("version", common::int(2)),
            ("nonce", Value::Bytes(vec![9; 32])),
        ]);
        s.write_all(&common::frame(kind::WELCOME, 0, &welcome))
            .unwrap();
        s.write_all(&common::frame(kind::READY, 0, &ready)).unwrap();
        // The initiator may ping before it asks.
        let id = loop {
            match common::read_frame(&mut s).unwrap() {
                (k, _, _) if k == kind::PING => {}
                (k, id, _) => {
                    assert_eq!(k, kind::GET_SEGMENT);
                    break id;
                }
            }
        };
        s.write_all(&common::frame(kind::SEGMENT, id, &segment))
            .unwrap();
        flood(s, frame, 2_000_000, Duration::from_secs(15))
    });
    (addr, t)
}

/// Threads of this process.
fn threads() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap()
}

#[test]
fn an_initiator_whose_target_floods_it_and_never_reads_closes_the_session_with_memory_bounded() {
    let _s = serial();
    let real = genuine(|_| {});
    let _dst = real
        .alloc("dst", 64 << 10, Access::REMOTE_READ_WRITE)
        .unwrap();
    let other = genuine(|_| {});
    let _region = other
        .alloc("other", 64 << 10, Access::REMOTE_READ_WRITE)
        .unwrap();
    let me = engine(|_| {});
    genuine_transfer(&me, &other.address().to_string(), "other", 0x10);
    let floods = [
        ("Ping", kind::PING, Vec::new()),
        ("Backend", kind::BACKEND, backend_msg(4096)),
        ("GetSegment", kind::GET_SEGMENT, Vec::new()),
        (
            "Notify",
            kind::NOTIFY,
            common::notice(me.epoch(), &[1; 1024], vec![]),
        ),
        // Replies to requests never made.
        ("Ack", kind::ACK, Vec::new()),
    ];
    for (i, (what, k, body)) in floods.into_iter().enumerate() {
        let threads_before = threads();
        let before = common::reset_peak();
        let (addr, attack) = fake_target(&real, common::frame(k, 1_000 + i as u64, &body));
        let _peer = me
            .connect_with(&addr, Duration::from_secs(10))
            .expect("the fake target answers the handshake and the descriptor");
        // The same engine serves a genuine target meanwhile.
        genuine_transfer(&me, &other.address().to_string(), "other", 0x20 + i as u8);
        let threads_during = threads();
        let (sent, closed) = attack.join().unwrap();
        let peak = common::peak_growth(before);
        println!(
            "{what} flood from a target: {sent} frames; initiator heap peak +{:.2} MiB; \
             threads {threads_before} → {threads_during}; closed after {closed:?}",
            peak as f64 / MIB as f64
        );
        if what != "Ack" {
            assert!(
                closed.is_some(),
                "the initiator never closed a {what} flood"
            );
        }
        assert!(
            peak < 16 * MIB,
            "a {what} flood grew the heap by {peak} bytes"
        );
        assert!(
            threads_during <= threads_before + 2,
            "a {what} flood grew the threads from {threads_before} to {threads_during}"
        );
    }
}

#[test]
fn idle_connections_holding_the_data_listeners_pending_slots_cannot_lock_a_genuine_peer_out() {
    let _s = serial();
    const HELD: usize = 1000;
    if let Err(why) = common::raise_nofile(3 * HELD as u64 + 1024) {
        println!("SKIP: {why}");
        return;
    }
    let token = |c: &mut EngineConfig| c.auth_token = Some("s3cret".into());
    let target = engine(token);
    let _dst = target
        .alloc("dst", 64 << 10, Access::REMOTE_READ_WRITE)
        .unwrap();
    let desc = target.segment();
    let (data, _) = te_core::kit::net::decode_addr(&desc.endpoint[1..]).expect("a tcp endpoint");
    // The attacker keeps up to HELD idle connections to the data listener, never
    // handshaking, and reopens whatever the listener closed, at most 100 a second.
    let stop = Arc::new(AtomicBool::new(false));
    let attacker = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut held: Vec<TcpStream> = Vec::new();
            let mut opened = 0usize;
            let start = Instant::now();
            while !stop.load(Ordering::Acquire) && start.elapsed() < Duration::from_secs(60) {
                // Closed by the listener: end of stream, or reset.
                held.retain(|s| match s.peek(&mut [0u8; 1]) {
                    Ok(n) => n > 0,
                    Err(e) => e.kind() == IoKind::WouldBlock,
                });
                let budget = 100 * start.elapsed().as_millis() as usize / 1000 + 64;
                while held.len() < HELD && opened < budget {
                    let Ok(s) = TcpStream::connect(data) else {
                        break;
                    };
                    s.set_nonblocking(true).unwrap();
                    held.push(s);
                    opened += 1;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            opened
        })
    };
    // Let the attacker fill the pending slots (64) and more.
    std::thread::sleep(Duration::from_millis(1500));
    let before = common::heap();
    for run in 0..6u8 {
        let start = Instant::now();
        genuine_transfer(
            &genuine(token),
            &target.address().to_string(),
            "dst",
            0x40 + run,
        );
        println!(
            "genuine peer {run} served in {:?} during the flood",
            start.elapsed()
        );
    }
    let growth = common::heap_growth(before);
    stop.store(true, Ordering::Release);
    let opened = attacker.join().unwrap();
    println!(
        "{opened} idle data connections opened; heap +{:.2} MiB",
        growth as f64 / MIB as f64
    );
    assert!(
        opened > 64,
        "the attacker filled the pending slots ({opened})"
    );
    assert!(growth < 16 * MIB, "the heap grew by {growth} bytes");
}

#[test]
fn a_peers_60_kb_error_text_is_cut_and_escaped() {
    let _s = serial();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let text = format!("\x1b[2J\x1b[31mpwned\r\n{}", "A".repeat(60_000));
    let hostile = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = common::read_frame(&mut s).unwrap();
        let error = common::cbor(vec![
            ("code", common::int(1)),
            ("message", Value::Text(text)),
        ]);
        s.write_all(&common::frame(kind::ERROR, 0, &error)).unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
    });
    let me = engine(|_| {});
    let e = me
        .connect_with(&addr, Duration::from_secs(5))
        .expect_err("the peer refused");
    hostile.join().unwrap();
    let shown = e.to_string();
    println!("{} bytes shown: {shown}", shown.len());
    assert!(shown.len() < 1500, "{} bytes shown", shown.len());
    assert!(shown.contains("more bytes cut"), "{shown}");
    assert!(shown.contains("\\u{1b}[2J"), "{shown}");
    assert!(!shown.chars().any(char::is_control), "{shown:?}");
}
