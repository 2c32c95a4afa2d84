//! Peers of the control plane: versions agreed or refused, many handshakes against one
//! listener, and a peer that dies.

mod common;

use std::io::Write;
use std::net::TcpListener;
use std::time::{Duration, Instant};

use ciborium::value::Value;
use common::kind;
use te::{Access, Config, Engine, ErrorKind, PeerEventKind, TransferRequest};

fn engine(backend: &str) -> Engine {
    let mut c = Config::defaults();
    c.engine.backend = backend.into();
    Engine::from_config(&c).unwrap()
}

/// The version a raw hello announcing `versions` gets, or the engine's refusal.
fn agreed(addr: &str, versions: (u16, u16)) -> Result<u64, String> {
    let mut s = common::raw(addr);
    s.write_all(&common::frame(
        kind::HELLO,
        0,
        &common::hello(versions, "other-build", 1),
    ))
    .unwrap();
    let (k, _, p) = common::read_frame(&mut s).unwrap();
    match k {
        kind::WELCOME => Ok(common::field(&p, "version")
            .and_then(|v| v.into_integer().ok())
            .and_then(|i| u64::try_from(i).ok())
            .expect("a version in the welcome")),
        kind::ERROR => Err(common::error_message(&p)),
        other => panic!("hello answered with kind {other}"),
    }
}

#[test]
fn a_peer_speaking_a_wider_range_gets_the_highest_common_version() {
    let target = engine("stub");
    let addr = target.address().to_string();
    let (oldest, newest) = te_core::CONTROL_VERSIONS;
    assert_eq!(agreed(&addr, (oldest, newest)), Ok(newest.into()));
    assert_eq!(agreed(&addr, (1, newest + 7)), Ok(newest.into()));
    assert_eq!(agreed(&addr, (newest, newest + 1)), Ok(newest.into()));
}

#[test]
fn a_peer_with_no_version_in_common_is_told_both_ranges() {
    let target = engine("stub");
    let addr = target.address().to_string();
    let (oldest, newest) = te_core::CONTROL_VERSIONS;
    let newer = agreed(&addr, (newest + 1, newest + 3)).unwrap_err();
    assert!(
        newer.contains(&format!(
            "no protocol version in common: the peer speaks {}..={}, this engine {oldest}..={newest}",
            newest + 1,
            newest + 3
        )),
        "{newer}"
    );
    let older = agreed(&addr, (0, oldest - 1)).unwrap_err();
    assert!(older.contains("no protocol version in common"), "{older}");
}

#[test]
fn a_server_choosing_a_version_this_engine_does_not_speak_is_refused() {
    // A fake server that answers every hello with version 9.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let (k, _, _) = common::read_frame(&mut s).unwrap();
        assert_eq!(k, kind::HELLO);
        let welcome = common::cbor(vec![
            ("version", common::int(9)),
            ("nonce", Value::Bytes(vec![1; 32])),
        ]);
        s.write_all(&common::frame(kind::WELCOME, 0, &welcome))
            .unwrap();
        // Whatever the client does next, it must not be a proof or a request.
        common::frames_until_closed(&mut s)
    });
    let me = engine("stub");
    let e = me
        .connect_with(&addr, Duration::from_secs(5))
        .expect_err("version 9 is refused");
    assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
    let (oldest, newest) = te_core::CONTROL_VERSIONS;
    assert!(
        e.to_string().contains(&format!(
            "the peer chose protocol version 9, outside the {oldest}..={newest}"
        )),
        "{e}"
    );
    let after = server.join().unwrap();
    assert!(
        after.is_empty(),
        "the client sent {after:?} after the welcome"
    );
}

/// A raw peer's whole visit: handshake, the descriptor, goodbye.
fn visit(addr: &str, i: u64) -> std::net::TcpStream {
    let (mut s, _) = common::handshake(addr, &format!("visitor-{i}"), i + 1)
        .unwrap_or_else(|e| panic!("handshake {i} refused: {e}"));
    s.write_all(&common::frame(kind::GET_SEGMENT, 1, &[]))
        .unwrap();
    let (k, id, p) = common::read_frame(&mut s).unwrap();
    assert_eq!((k, id), (kind::SEGMENT, 1), "{}", common::error_message(&p));
    s
}

#[test]
fn a_thousand_handshakes_against_one_te_serve_complete() {
    let serve = common::Serve::start(&["--backend", "tcp", "--buffer-size", "1MiB"]);
    let rss_before = serve.rss_kib();
    let start = Instant::now();
    for i in 0..1000 {
        let mut s = visit(&serve.addr, i);
        s.write_all(&common::frame(kind::BYE, 0, &[])).unwrap();
    }
    let sequential = start.elapsed();

    // Then 1,000 at once, from 20 threads, every session held until all are up.
    if let Err(why) = common::raise_nofile(4096) {
        println!("SKIP the concurrent part: {why}");
        return;
    }
    let start = Instant::now();
    let held: Vec<std::net::TcpStream> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..20u64)
            .map(|t| {
                let addr = serve.addr.clone();
                scope.spawn(move || {
                    (0..50u64)
                        .map(|i| visit(&addr, 1000 + t * 50 + i))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect()
    });
    let concurrent = start.elapsed();
    let (rss_held, threads) = (serve.rss_kib(), serve.threads());
    assert_eq!(held.len(), 1000);
    println!(
        "1000 sequential handshakes (hello, welcome, ready, descriptor): {sequential:?}; \
         1000 from 20 threads, all held: {concurrent:?}; te serve RSS {rss_before} KiB \
         before, {rss_held} KiB and {threads} threads with 1000 sessions"
    );
    drop(held);
}

#[test]
fn a_killed_peer_is_reported_lost_and_its_use_fails_clearly() {
    let mut serve = common::Serve::start(&["--backend", "tcp", "--buffer-size", "1MiB"]);
    let me = engine("tcp");
    let src = me.alloc("src", 4096, Access::LOCAL).unwrap();
    let peer = me.connect(&serve.addr).unwrap();
    let rid = peer.region("buffer").unwrap().id;
    let req = [TransferRequest::write(src.id(), 0, rid, 0, 4096)];
    me.transfer(&peer, &req).unwrap().wait().unwrap();

    let start = Instant::now();
    serve.child.kill().unwrap();
    serve.child.wait().unwrap();
    let event = me
        .recv_event(Duration::from_secs(10))
        .expect("a peer event within 10 s");
    println!("peer lost reported after {:?}", start.elapsed());
    assert_eq!(event.kind, PeerEventKind::Lost, "{event:?}");
    assert_eq!(event.address, serve.addr);
    assert_eq!(event.epoch, peer.epoch());

    let failed = me.transfer(&peer, &req).and_then(|h| h.wait());
    let e = failed.expect_err("a write to a dead peer fails");
    assert!(
        matches!(
            e.kind(),
            ErrorKind::PeerUnreachable | ErrorKind::PeerRestarted
        ),
        "{e}"
    );
    assert!(start.elapsed() < Duration::from_secs(20));
}
