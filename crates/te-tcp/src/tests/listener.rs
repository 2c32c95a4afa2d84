//! The data listener and its limits: handshake and idle timeouts, caps on pending and
//! served connections, running out of file descriptors, and where it listens.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use te_core::{Access, RegionId, TransferBackend, TransferRequest};

use super::{backend, connected, eventually, register, run, segment, soon};
use crate::endpoint::decode_endpoint;
use crate::{TcpBackend, TcpConfig};

/// How long until the target closes `s`, which sends one byte every 100 ms; `None` if
/// it is still open after `limit`.
fn closed_after(s: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    while start.elapsed() < limit {
        let _ = s.write(b"T");
        let mut b = [0u8; 64];
        match s.read(&mut b) {
            Ok(0) => return Some(start.elapsed()),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return Some(start.elapsed())
            }
            _ => {}
        }
    }
    None
}

#[test]
fn a_peer_that_trickles_its_handshake_is_cut_at_the_handshake_timeout() {
    let target = backend(|c| c.handshake_timeout = Duration::from_millis(300));
    let addr = decode_endpoint(&target.endpoint()).unwrap().addr;
    let mut s = TcpStream::connect(addr).unwrap();
    // Without the timeout the connection would stay open: the upper bound only
    // leaves room for a loaded machine.
    let t = closed_after(&mut s, Duration::from_secs(5)).expect("closed");
    assert!(
        t >= Duration::from_millis(250) && t < Duration::from_secs(5),
        "closed after {t:?}"
    );
    // The target still serves honest peers.
    let init = backend(|_| {});
    init.connect(&segment(&target), soon()).expect("connect");
}

#[test]
fn a_new_connection_evicts_the_oldest_pending_one_and_connections_are_capped() {
    let target = backend(|c| {
        c.max_pending = 2;
        c.max_connections = 3;
        // Far above the bounds below, so "closed at once" cannot be the timeout.
        c.handshake_timeout = Duration::from_secs(20);
    });
    let addr = decode_endpoint(&target.endpoint()).unwrap().addr;
    let mut idle: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    eventually("two pending handshakes", Duration::from_secs(5), || {
        target.shared().pending.len() == 2
    });
    // A third unauthenticated connection takes the oldest one's place, which is
    // closed at once; the second and third stay.
    let third = TcpStream::connect(addr).unwrap();
    let t = closed_after(&mut idle[0], Duration::from_secs(5)).expect("evicted");
    assert!(t < Duration::from_secs(5), "closed after {t:?}");
    assert_eq!(closed_after(&mut idle[1], Duration::from_millis(300)), None);
    assert_eq!(target.shared().pending.len(), 2);
    // An authenticated one is not pending; it fits the connection cap (3), a fourth
    // connection does not.
    drop((idle, third));
    eventually("no connection served", Duration::from_secs(5), || {
        target.shared().serving.lock().is_empty()
    });
    let init = backend(|c| c.connections_per_peer = 3);
    let peer = init.connect(&segment(&target), soon()).expect("connect");
    assert_eq!(init.live_connections(peer), 3);
    let mut fourth = TcpStream::connect(addr).unwrap();
    let t = closed_after(&mut fourth, Duration::from_secs(5)).expect("refused");
    assert!(t < Duration::from_secs(5), "closed after {t:?}");
}

#[test]
fn an_idle_data_connection_is_closed_after_idle_timeout() {
    // Counted from the handshake too: long enough for the write below to come first.
    let target = backend(|c| c.idle_timeout = Duration::from_secs(1));
    let init = backend(|c| c.connections_per_peer = 1);
    let (mut mem, mut src) = (vec![0u8; 4096], vec![1u8; 4096]);
    let peer = connected(&target, &mut mem, &init, &mut src);
    let w = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, 4096);
    run(&init, peer, &[w]).expect("write");
    eventually("the idle connection closed", Duration::from_secs(5), || {
        init.live_connections(peer) == 0
    });
    // Connecting again refills the pool.
    init.connect(&segment(&target), soon()).unwrap();
    run(&init, peer, &[w]).expect("write after reconnecting");
}

const FD_CHILD: &str = "TE_TCP_TEST_FD_CHILD";

#[test]
fn the_listener_survives_running_out_of_file_descriptors() {
    let name = "tests::listener::the_listener_survives_running_out_of_file_descriptors";
    if std::env::var_os(FD_CHILD).is_none() {
        // The descriptor limit is the process's: lower it in a child of our own.
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--nocapture", "--test-threads=1"])
            .env(FD_CHILD, "1")
            .output()
            .expect("run the child");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{text}");
        assert!(text.contains("fd child: served again"), "{text}");
        return;
    }
    let target = backend(|c| c.handshake_timeout = Duration::from_millis(500));
    let mut mem = vec![0u8; 4096];
    register(&target, 1, &mut mem, Access::REMOTE_READ_WRITE);
    let init = backend(|c| c.connections_per_peer = 1);
    let mut src = vec![9u8; 4096];
    register(&init, 1, &mut src, Access::LOCAL);
    let addr = decode_endpoint(&target.endpoint()).unwrap().addr;
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `old` is a valid rlimit for the kernel to fill.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut old) }, 0);
    let low = libc::rlimit {
        rlim_cur: open + 16,
        rlim_max: old.rlim_max,
    };
    // SAFETY: a valid rlimit, read by the kernel.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) }, 0);
    // Use every descriptor, then free one for a client: the listener has a connection
    // to accept and no descriptor to accept it with. Other threads may hold descriptors
    // for a moment (and free them later), so squeeze again until accept fails.
    let errors = || {
        target
            .shared()
            .accept_errors
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let mut files = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..20 {
        while files.len() < 128 {
            match std::fs::File::open("/dev/null") {
                Ok(f) => files.push(f),
                Err(_) => break,
            }
        }
        assert!(files.len() < 128, "the descriptor limit was not reached");
        files.pop();
        if let Ok(c) = TcpStream::connect(addr) {
            clients.push(c);
        }
        let end = Instant::now() + Duration::from_millis(300);
        while errors() == 0 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
        if errors() > 0 {
            break;
        }
    }
    assert!(
        errors() > 0,
        "accept never failed: {} clients, {} files, {} served",
        clients.len(),
        files.len(),
        target.shared().serving.lock().len()
    );
    drop(files);
    drop(clients);
    // SAFETY: a valid rlimit, read by the kernel.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &old) }, 0);
    let peer = init
        .connect(&segment(&target), soon())
        .expect("connect after");
    let w = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, 4096);
    run(&init, peer, &[w]).expect("write after");
    drop(init);
    drop(target);
    assert!(mem.iter().all(|&b| b == 9));
    println!("fd child: served again");
}

#[test]
fn without_a_listen_key_the_data_listener_follows_the_engines_listen_and_advertise() {
    let ctx = |host: &str, advertise: Option<&str>| te_core::BackendContext {
        listen_host: Some(host.into()),
        advertise: advertise.map(str::to_string),
        ..Default::default()
    };
    // Every interface, advertised as loopback: the endpoint names the advertised host.
    let b = TcpBackend::new(TcpConfig::default(), &ctx("0.0.0.0", Some("127.0.0.1"))).unwrap();
    let addr = decode_endpoint(&b.endpoint()).unwrap().addr;
    assert_eq!(addr.ip().to_string(), "127.0.0.1");
    assert_ne!(addr.port(), 0);
    TcpStream::connect(addr).expect("the data listener is reachable where advertised");
    // Every interface and nothing advertised: refused, saying where to set it.
    let e = TcpBackend::new(TcpConfig::default(), &ctx("0.0.0.0", None)).unwrap_err();
    assert!(e.to_string().contains("advertise"), "{e}");
    // An explicit listen wins over the engine's host.
    let b = backend(|c| c.listen = Some("127.0.0.1:0".into()));
    let addr = decode_endpoint(&b.endpoint()).unwrap().addr;
    assert!(addr.ip().is_loopback());
}
