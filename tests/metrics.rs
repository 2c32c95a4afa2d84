//! What an engine counts: batches and their outcomes, bytes and requests per direction
//! and per peer, latency, registered memory, notifications; and what a handle tells
//! of its batch. docs/metrics.md lists every field (checked here).

mod common;

use std::time::Duration;

use te::{Access, Config, Engine, ErrorKind, Metrics, PeerMetrics, TransferRequest};

fn stub(table: &str) -> Engine {
    let mut c = Config::from_toml(
        &format!("[engine]\nbackend = \"stub\"\n[backends.stub]\n{table}"),
        "metrics test",
        std::path::Path::new("."),
    )
    .unwrap();
    c.engine.default_timeout = Duration::from_secs(10);
    Engine::from_config(&c).unwrap()
}

#[test]
fn batches_bytes_latency_registrations_and_notifications_are_counted() {
    let target = stub("");
    let dst = target
        .alloc("dst", 64 << 10, Access::REMOTE_READ_WRITE)
        .unwrap();
    let me = stub("fail_every = 3");
    let src = me.alloc("src", 64 << 10, Access::LOCAL).unwrap();
    let peer = me.connect(&target.address().to_string()).unwrap();
    let rid = peer.region("dst").unwrap().id;
    let write = |n: u64| TransferRequest::write(src.id(), 0, rid, 0, n);
    let read = |n: u64| TransferRequest::read(src.id(), 0, rid, 0, n);

    // Batch 1: two writes and a read; 2: a write with a notification; 3: fails.
    let h = me
        .transfer(&peer, &[write(4096), write(8192), read(1024)])
        .unwrap();
    h.wait().unwrap();
    let t = h.telemetry().expect("an ended batch tells what it did");
    assert_eq!((t.requests, t.bytes), (3, 4096 + 8192 + 1024));
    assert!(t.post <= t.duration, "{t:?}");
    // The stub times its worker's copy as the wire.
    assert!(
        t.wire.is_some_and(|w| w <= t.duration) && t.device.is_none(),
        "{t:?}"
    );
    let opts = te::TransferOptions {
        notify: Some(b"done".to_vec()),
        ..Default::default()
    };
    me.transfer_with(&peer, &[write(100)], &opts)
        .unwrap()
        .wait()
        .unwrap();
    let failed = me.transfer(&peer, &[write(1)]).unwrap();
    assert_eq!(failed.wait().unwrap_err().kind(), ErrorKind::Backend);
    assert!(failed.telemetry().is_some());
    // A request refused by the checks is the call's error, not a batch.
    assert!(me.transfer(&peer, &[write(1 << 20)]).is_err());
    target.recv_notification(Duration::from_secs(5)).unwrap();

    let m = me.metrics();
    assert_eq!((m.batches_submitted, m.batches_completed), (3, 2), "{m:?}");
    assert_eq!(m.batches_failed, vec![("Backend".to_string(), 1)]);
    assert_eq!((m.batches_in_flight, m.bytes_in_flight), (0, 0));
    assert_eq!(
        (m.bytes_written, m.requests_written),
        (4096 + 8192 + 100, 3)
    );
    assert_eq!((m.bytes_read, m.requests_read), (1024, 1));
    assert_eq!(m.latency.count, 2);
    assert_eq!(m.latency.counts.iter().sum::<u64>(), 2);
    assert_eq!(m.latency.counts.len(), m.latency.bounds_us.len() + 1);
    assert_eq!(m.notifications_sent, 1);
    assert_eq!(m.registrations.len(), 1);
    let r = &m.registrations[0];
    assert_eq!((r.kind.as_str(), r.count, r.bytes), ("host", 1, 64 << 10));
    let p: &PeerMetrics = &m.peers[0];
    assert_eq!(p.address, target.address().to_string());
    assert_eq!(p.name, target.name());
    assert_eq!((p.batches_completed, p.batches_failed), (2, 1));
    assert_eq!((p.bytes_written, p.bytes_read), (4096 + 8192 + 100, 1024));

    let t = target.metrics();
    assert_eq!((t.notifications_received, t.notifications_refused), (1, 0));
    assert_eq!((t.peers_connected, m.peers_connected), (1, 1));
    assert_eq!(t.batches_submitted, 0);
    drop(dst);
    assert!(target.metrics().registrations.iter().all(|r| r.count == 0));
}

#[test]
fn with_metrics_off_batches_move_uncounted_and_handles_tell_nothing() {
    let target = stub("");
    let dst = target
        .alloc("dst", 4096, Access::REMOTE_READ_WRITE)
        .unwrap();
    let mut c = Config::from_toml(
        "[engine]\nbackend = \"stub\"\nmetrics = false\n",
        "metrics off",
        std::path::Path::new("."),
    )
    .unwrap();
    c.engine.default_timeout = Duration::from_secs(10);
    let me = Engine::from_config(&c).unwrap();
    let src = me.alloc("src", 4096, Access::LOCAL).unwrap();
    src.write(0, &[7; 4096]).unwrap();
    let peer = me.connect(&target.address().to_string()).unwrap();
    let rid = peer.region("dst").unwrap().id;
    let h = me
        .transfer(&peer, &[TransferRequest::write(src.id(), 0, rid, 0, 4096)])
        .unwrap();
    h.wait().unwrap();
    assert_eq!(
        dst.to_vec().unwrap(),
        vec![7; 4096],
        "the batch moved its bytes"
    );
    assert!(h.telemetry().is_none());
    let m = me.metrics();
    assert_eq!((m.batches_submitted, m.batches_completed), (0, 0), "{m:?}");
}

#[test]
fn docs_metrics_md_explains_every_field() {
    let doc = std::fs::read_to_string("docs/metrics.md").expect("docs/metrics.md");
    let fields = [
        te_core::config::fields::<Metrics>(),
        te_core::config::fields::<PeerMetrics>(),
        te_core::config::fields::<te::Histogram>(),
        te_core::config::fields::<te::RegisteredMemory>(),
    ];
    for f in fields.iter().flat_map(|f| f.iter()) {
        assert!(
            doc.contains(&format!("`{f}`")),
            "docs/metrics.md does not explain `{f}`"
        );
    }
    assert!(fields[0].contains(&"batches_failed"));
}

/// Waits (at most 5 s) until `f` holds of `e`'s metrics.
fn eventually(e: &Engine, f: impl Fn(&Metrics) -> bool) -> Metrics {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let m = e.metrics();
        if f(&m) || std::time::Instant::now() > deadline {
            return m;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn peers_that_leave_and_refused_connections_are_counted() {
    let mut c = Config::defaults();
    c.engine.auth_token = Some("s3cret".into());
    let target = Engine::from_config(&c).unwrap();
    let addr = target.address().to_string();
    // A te peer with a wrong token is refused for its proof; so is a raw peer that
    // skips its proof, and a first frame that is no hello.
    let mut wrong = c.clone();
    wrong.engine.auth_token = Some("guess".into());
    let e = Engine::from_config(&wrong).unwrap();
    assert!(e.connect_with(&addr, Duration::from_secs(5)).is_err());
    let mut s = common::raw(&addr);
    let hello = common::frame(
        common::kind::HELLO,
        0,
        &common::hello(te_core::CONTROL_VERSIONS, "x", 1),
    );
    std::io::Write::write_all(&mut s, &hello).unwrap();
    let segment = common::frame(common::kind::GET_SEGMENT, 1, &[]);
    std::io::Write::write_all(&mut s, &segment).unwrap();
    common::frames_until_closed(&mut s);
    let mut s = common::raw(&addr);
    std::io::Write::write_all(&mut s, b"GET / HTTP/1.1\r\n").unwrap();
    common::frames_until_closed(&mut s);
    let m = eventually(&target, |m| m.control_refusals.len() == 2);
    let by = |r: &str, n| (r.to_string(), n);
    assert_eq!(m.control_refusals, vec![by("auth", 2), by("protocol", 1)]);
    // A peer with the token connects, then leaves with a goodbye.
    let peer = Engine::from_config(&c).unwrap();
    peer.connect(&addr).unwrap();
    assert_eq!(
        eventually(&target, |m| m.peers_connected == 1).peers_connected,
        1
    );
    drop(peer);
    let m = eventually(&target, |m| m.peers_left == 1);
    assert_eq!((m.peers_connected, m.peers_left, m.peers_lost), (0, 1, 0));
}

#[test]
fn a_killed_peer_is_counted_lost_and_its_failed_batch_by_kind() {
    let mut serve = common::Serve::start(&["--backend", "tcp", "--buffer-size", "1MiB"]);
    let mut c = Config::defaults();
    c.engine.backend = "tcp".into();
    c.engine.default_timeout = Duration::from_secs(10);
    let me = Engine::from_config(&c).unwrap();
    let src = me.alloc("src", 1 << 20, Access::LOCAL).unwrap();
    let peer = me.connect(&serve.addr).unwrap();
    let rid = peer.region("buffer").unwrap().id;
    let write = [TransferRequest::write(src.id(), 0, rid, 0, 1 << 20)];
    me.transfer(&peer, &write).unwrap().wait().unwrap();
    serve.child.kill().unwrap();
    serve.child.wait().unwrap();
    // The next batch to it fails, as the call's error or as the batch's.
    let failed = me
        .transfer(&peer, &write)
        .and_then(|h| h.wait())
        .expect_err("a batch to a killed peer fails");
    let m = eventually(&me, |m| m.peers_lost == 1);
    assert_eq!(m.peers_lost, 1, "{m:?}");
    assert_eq!(m.batches_completed, 1, "{m:?}");
    let counted: u64 = m.batches_failed.iter().map(|(_, n)| n).sum();
    if counted == 1 {
        // Submitted, then failed: counted under its kind.
        assert_eq!(
            m.batches_failed,
            vec![(failed.kind().as_str().to_string(), 1)],
            "{m:?}"
        );
    } else {
        // Refused at submission (the peer already known lost): the call's error.
        assert_eq!((counted, m.batches_submitted), (0, 1), "{failed} {m:?}");
    }
}
