//! Batches past their deadline or aborted: they end on time, no late byte lands in the
//! caller's memory, and only a stalled connection is closed for them.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use te_core::{Access, Completion, ErrorKind, RegionId, TransferBackend, TransferRequest};

use super::{backend, connected, register};

#[test]
fn a_stalled_target_fails_the_batch_at_its_deadline_and_never_writes_later() {
    // The target holds every request 8 s; the batches' deadline is 300 ms.
    let target = backend(|c| c.debug_delay = Duration::from_secs(8));
    let init = backend(|c| c.connections_per_peer = 2);
    let (mut remote, mut local) = (vec![0x11u8; 8192], vec![0xABu8; 8192]);
    let peer = connected(&target, &mut remote, &init, &mut local);
    let (tx, rx) = mpsc::channel();
    let start = Instant::now();
    for (op, off) in [(te_core::Op::Read, 0), (te_core::Op::Write, 4096)] {
        let tx = tx.clone();
        let done = Completion::new(Duration::from_millis(300), move |r, _| {
            let _ = tx.send((op, r, start.elapsed()));
        });
        let r = TransferRequest {
            op,
            local: RegionId(1),
            local_offset: off,
            remote: RegionId(1),
            remote_offset: off,
            len: 4096,
        };
        init.submit(peer, &[r], done).unwrap();
    }
    for _ in 0..2 {
        let (op, r, at) = rx.recv_timeout(Duration::from_secs(5)).expect("completed");
        let e = r.expect_err("the target never answered in time");
        assert_eq!(e.kind(), ErrorKind::Timeout, "{op}: {e}");
        assert!(at < Duration::from_secs(5), "{op} completed after {at:?}");
    }
    assert_eq!(
        init.live_connections(peer),
        0,
        "the connections carrying the batches were closed"
    );
    // The target answers after 8 s; nothing of it may land in the caller's memory.
    std::thread::sleep(Duration::from_millis(8500));
    assert!(local.iter().all(|&b| b == 0xAB), "late bytes landed");
}

#[test]
fn a_busy_connection_is_not_closed_for_a_batch_past_its_deadline() {
    // Answers keep coming every ~10 ms; one batch's deadline passes while it waits
    // behind another. The busy connection stays, the late batch gets Timeout, and its
    // data is dropped, not placed. A 4 KiB frame limit keeps each read its own frame.
    let target = backend(|c| {
        c.debug_delay = Duration::from_millis(10);
        c.slice_size = 4096;
    });
    let init = backend(|c| c.connections_per_peer = 1);
    let (mut remote, mut long) = (vec![0x22u8; 4096], vec![0u8; 40 * 4096]);
    let peer = connected(&target, &mut remote, &init, &mut long);
    let mut late = vec![0xABu8; 4096];
    register(&init, 2, &mut late, Access::LOCAL);
    let read = |local, local_offset| TransferRequest {
        op: te_core::Op::Read,
        local: RegionId(local),
        local_offset,
        remote: RegionId(1),
        remote_offset: 0,
        len: 4096,
    };
    let (tx, rx) = mpsc::channel();
    let first: Vec<_> = (0..40).map(|i| read(1, i * 4096)).collect();
    let t = tx.clone();
    let done = Completion::new(Duration::from_secs(10), move |r, _| {
        let _ = t.send(("first", r));
    });
    init.submit(peer, &first, done).unwrap();
    let done = Completion::new(Duration::from_millis(100), move |r, _| {
        let _ = tx.send(("late", r));
    });
    init.submit(peer, &[read(2, 0)], done).unwrap();
    let mut results = std::collections::HashMap::new();
    for _ in 0..2 {
        let (name, r) = rx.recv_timeout(Duration::from_secs(10)).expect("completed");
        results.insert(name, r);
    }
    results["first"].as_ref().expect("the long batch succeeds");
    let e = results["late"].as_ref().expect_err("past its deadline");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert_eq!(init.live_connections(peer), 1, "the busy connection stays");
    assert!(long.iter().all(|&b| b == 0x22));
    assert!(late.iter().all(|&b| b == 0xAB), "late data was not placed");
}

#[test]
fn an_aborted_batch_on_a_stalled_target_ends_without_waiting_for_io_timeout() {
    let target = backend(|c| c.debug_delay = Duration::from_secs(8));
    let init = backend(|c| c.connections_per_peer = 1);
    let (mut remote, mut local) = (vec![0x33u8; 4096], vec![0xABu8; 4096]);
    let peer = connected(&target, &mut remote, &init, &mut local);
    let (tx, rx) = mpsc::channel();
    let (done, aborter) = Completion::abortable(
        te_core::Deadline::after(Duration::from_secs(10)),
        move |r, _| {
            let _ = tx.send(r);
        },
    );
    let r = TransferRequest::read(RegionId(1), 0, RegionId(1), 0, 4096);
    init.submit(peer, &[r], done).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    aborter.abort();
    init.abort(peer, te_core::BatchId(0));
    let r = rx.recv_timeout(Duration::from_secs(5)).expect("completed");
    assert!(r.is_err(), "an aborted batch does not succeed");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "ended {:?} after the abort",
        start.elapsed()
    );
    std::thread::sleep(Duration::from_millis(8500));
    assert!(local.iter().all(|&b| b == 0xAB), "late bytes landed");
}

#[test]
fn a_target_that_trickles_its_handshake_cannot_hold_connect_past_the_deadline() {
    use crate::wire::{Challenge, Hello, Status, Terms, Welcome, VERSION};
    use std::io::{Read, Write};
    // A stand-in target that answers the handshake correctly, one byte every 40 ms:
    // each read gets a byte well within any per-read timeout, but the whole handshake
    // takes about 4 s, far past the caller's 300 ms.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let trickler = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut hello = [0u8; Hello::LEN];
        s.read_exact(&mut hello).unwrap();
        let mut answer = Challenge {
            version: VERSION,
            status: Status::Ok,
            auth: false,
            nonce: [3; 32],
        }
        .encode()
        .to_vec();
        answer.extend(Terms { max_payload: 65536 }.encode());
        let mut proof = [0u8; crate::wire::Proof::LEN];
        for (i, b) in answer.iter().enumerate() {
            if s.write_all(&[*b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(40));
            if i + 1 == Challenge::LEN + Terms::LEN && s.read_exact(&mut proof).is_err() {
                return;
            }
        }
        let welcome = Welcome {
            status: Status::Ok,
            mac: [0; 32],
        }
        .encode();
        for b in welcome {
            if s.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(40));
        }
    });
    let init = backend(|c| c.connections_per_peer = 1);
    let seg = te_core::testkit::segment(
        crate::NAME,
        crate::endpoint::encode_endpoint(addr, 7, None),
        String::new(),
        Vec::new(),
    );
    let start = Instant::now();
    let r = init.connect(&seg, te_core::Deadline::after(Duration::from_millis(300)));
    let took = start.elapsed();
    let e = r.expect_err("the handshake cannot finish within the deadline");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(
        took < Duration::from_millis(1000),
        "connect returned {took:?} after its 300 ms deadline"
    );
    trickler.join().unwrap();
}
