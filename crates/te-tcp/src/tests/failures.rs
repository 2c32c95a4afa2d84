//! Failures mid-transfer: a target that dies, connections that break, and a WRITE whose
//! payload stops part way (a torn write, reported at the target).

use std::io::Write;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use te_core::{Access, Completion, ErrorKind, RegionId, TransferBackend, TransferRequest};

use super::{
    backend, connected, eventually, raw, read_header, register, run, segment, sg_frame, soon,
};
use crate::wire::{Header, Kind};
use crate::{TcpBackend, TcpConfig};

#[test]
fn a_target_that_dies_mid_transfer_fails_the_batch_with_peer_unreachable_at_once() {
    let target = backend(|c| c.debug_delay = Duration::from_millis(500));
    let init = backend(|_| {});
    let (mut remote, mut local) = (vec![0u8; 1 << 20], vec![1u8; 1 << 20]);
    let peer = connected(&target, &mut remote, &init, &mut local);
    let (tx, rx) = mpsc::channel();
    let deadline = Duration::from_secs(20);
    for i in 0..8u64 {
        let tx = tx.clone();
        let done = Completion::new(deadline, move |r, _| {
            let _ = tx.send(r);
        });
        let req = TransferRequest::write(RegionId(1), i << 17, RegionId(1), i << 17, 1 << 17);
        init.submit(peer, &[req], done).unwrap();
    }
    std::thread::sleep(Duration::from_millis(50));
    let start = Instant::now();
    target.deregister(RegionId(1), soon()).unwrap();
    drop(target);
    for _ in 0..8 {
        let r = rx.recv_timeout(Duration::from_secs(5)).expect("completed");
        let e = r.expect_err("the target died");
        assert_eq!(e.kind(), ErrorKind::PeerUnreachable, "{e}");
    }
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "failing took {:?}",
        start.elapsed()
    );
    // Nothing is left to use; a new submit says so at once, and a new target works.
    let done = Completion::new(deadline, |_, _| {});
    let req = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, 16);
    assert_eq!(
        init.submit(peer, &[req], done).unwrap_err().kind(),
        ErrorKind::PeerUnreachable
    );
    let other = backend(|_| {});
    let mut mem = vec![0u8; 64];
    register(&other, 1, &mut mem, Access::REMOTE_READ_WRITE);
    let p2 = init.connect(&segment(&other), soon()).unwrap();
    run(&init, p2, &[req]).unwrap();
    assert_eq!(mem[..16], [1; 16]);
    other.deregister(RegionId(1), soon()).unwrap();
    init.deregister(RegionId(1), soon()).unwrap();
}

#[test]
fn connect_refills_a_pool_with_broken_connections() {
    let target = backend(|_| {});
    let init = backend(|c| c.connections_per_peer = 2);
    let (mut mem, mut src) = (vec![0u8; 64], vec![3u8; 64]);
    let peer = connected(&target, &mut mem, &init, &mut src);
    let seg = segment(&target);
    // Break every connection the target serves.
    for (_, s) in target.shared().serving.lock().iter() {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
    let req = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, 64);
    let end = Instant::now() + Duration::from_secs(5);
    // The breaks arrive asynchronously; wait until a submit notices.
    loop {
        match run(&init, peer, &[req]) {
            Err(e) if e.kind() == ErrorKind::PeerUnreachable => break,
            _ if Instant::now() < end => std::thread::sleep(Duration::from_millis(5)),
            r => panic!("no failure after the connections broke: {r:?}"),
        }
    }
    // Each connection's receiver notices its own break; wait for all of them.
    while init.live_connections(peer) > 0 {
        assert!(
            Instant::now() < end,
            "a broken connection was never noticed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        init.connect(&seg, soon()).unwrap(),
        peer,
        "the same peer id"
    );
    run(&init, peer, &[req]).unwrap();
    assert_eq!(mem, vec![3u8; 64]);
    target.deregister(RegionId(1), soon()).unwrap();
    init.deregister(RegionId(1), soon()).unwrap();
}

#[test]
fn a_write_cut_off_mid_payload_is_reported_at_the_target_as_torn() {
    let target = backend(|c| c.slice_size = 1 << 20);
    let mut mem = vec![0u8; 1 << 20];
    register(&target, 1, &mut mem, Access::REMOTE_READ_WRITE);
    let mut s = raw(&target);
    // Announces 1 MiB, sends 100 bytes, and goes away.
    s.write_all(&Header::request(Kind::Write, 1, 1, 0, 1 << 20).encode())
        .unwrap();
    s.write_all(&[7u8; 100]).unwrap();
    drop(s);
    let torn = || {
        target
            .shared()
            .torn_writes
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    eventually("the torn write reported", Duration::from_secs(5), || {
        torn() == 1
    });
    // A refused or complete request is not torn.
    let mut s = raw(&target);
    s.write_all(&Header::request(Kind::Write, 2, 1, 0, 8).encode())
        .unwrap();
    s.write_all(&[1u8; 8]).unwrap();
    assert_eq!(read_header(&mut s).kind, Kind::WriteAck);
    drop(s);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(torn(), 1);
}

#[test]
fn a_write_torn_mid_payload_is_posted_as_a_peer_event_naming_region_and_range() {
    let control = te_core::StandaloneControl::start(&te_core::EngineConfig::default(), 7).unwrap();
    let ctx = te_core::BackendContext {
        hook: control.hook(),
        ..te_core::BackendContext::default()
    };
    let c = TcpConfig {
        slice_size: 1 << 20,
        ..TcpConfig::default()
    };
    let target = TcpBackend::new(c, &ctx).expect("backend");
    let mut mem = vec![0u8; 1 << 20];
    register(&target, 3, &mut mem, Access::REMOTE_READ_WRITE);
    // A plain WRITE of 1 MiB at 4096 that stops after 100 bytes, then a gathered one
    // whose entries span 100..9000 and that stops inside its second entry.
    let mut s = raw(&target);
    s.write_all(&Header::request(Kind::Write, 1, 3, 4096, (1 << 20) - 4096).encode())
        .unwrap();
    s.write_all(&[7u8; 100]).unwrap();
    drop(s);
    let mut s = raw(&target);
    s.write_all(&sg_frame(
        Kind::WriteV,
        1,
        3,
        &[(8000, 1000), (100, 50)],
        1050,
    ))
    .unwrap();
    s.write_all(&[8u8; 1010]).unwrap();
    let local = s.local_addr().unwrap().to_string();
    drop(s);
    let mut events = Vec::new();
    eventually("both torn writes posted", Duration::from_secs(5), || {
        events.extend(control.try_recv_events());
        events.len() >= 2
    });
    drop(target);
    let mut torn: Vec<_> = events
        .iter()
        .map(|e| {
            assert_eq!(e.kind, te_core::PeerEventKind::TornWrite, "{e:?}");
            e.torn.expect("a torn range")
        })
        .collect();
    torn.sort_by_key(|t| t.start);
    let range = |start, end| te_core::TornRange {
        region: RegionId(3),
        start,
        end,
    };
    assert_eq!(torn, [range(100, 9000), range(4096, 1 << 20)]);
    assert!(
        events.iter().any(|e| e.address == local),
        "the event names the connection's peer address: {events:?}"
    );
}

#[test]
fn a_target_that_acknowledges_a_write_before_taking_its_payload_never_ends_the_batch_early() {
    use crate::wire::{Challenge, Hello, Proof, Status, Terms, Welcome, VERSION};
    use std::io::Read;
    const LEN: usize = 16 << 20;
    // A stand-in target: after the handshake it reads the WRITE's header and at once
    // acknowledges it, before reading any of its 16 MiB payload (far more than the
    // socket buffers hold), then reads the rest once told to.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let target = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut b = [0u8; Hello::LEN];
        s.read_exact(&mut b).unwrap();
        let mut answer = Challenge {
            version: VERSION,
            status: Status::Ok,
            auth: false,
            nonce: [4; 32],
        }
        .encode()
        .to_vec();
        answer.extend(
            Terms {
                max_payload: LEN as u64,
            }
            .encode(),
        );
        s.write_all(&answer).unwrap();
        let mut b = [0u8; Proof::LEN];
        s.read_exact(&mut b).unwrap();
        let welcome = Welcome {
            status: Status::Ok,
            mac: [0; 32],
        };
        s.write_all(&welcome.encode()).unwrap();
        let mut h = [0u8; crate::wire::HEADER_LEN];
        s.read_exact(&mut h).unwrap();
        let h = Header::decode(&h).unwrap();
        s.write_all(&Header::response(Kind::WriteAck, 0, h.id, 0).encode())
            .unwrap();
        let _ = go_rx.recv_timeout(Duration::from_secs(10));
        // Everything the initiator sent after its batch ended carries 0xDD.
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut late = 0usize;
        let mut got = 0usize;
        let mut buf = vec![0u8; 1 << 16];
        while got < LEN {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    late += buf[..n].iter().filter(|&&b| b == 0xDD).count();
                    got += n;
                }
            }
        }
        late
    });
    let init = backend(|c| {
        c.connections_per_peer = 1;
        c.slice_size = LEN as u64;
        c.send_buffer = 64 << 10;
    });
    let mut src = vec![0x5Au8; LEN];
    register(&init, 1, &mut src, Access::LOCAL);
    let seg = te_core::testkit::segment(
        crate::NAME,
        crate::endpoint::encode_endpoint(addr, 7, None),
        String::new(),
        Vec::new(),
    );
    let peer = init.connect(&seg, soon()).unwrap();
    let w = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, LEN as u64);
    let r = run(&init, peer, &[w]);
    // The batch is handed back: its memory is the caller's again.
    src.fill(0xDD);
    go_tx.send(()).unwrap();
    let late = target.join().unwrap();
    assert_eq!(
        late, 0,
        "{late} bytes were read from the caller's memory after its batch ended ({r:?})"
    );
    let e = r.expect_err("an acknowledgement before the payload is not a completed write");
    assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
}
