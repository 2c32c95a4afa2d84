//! Peers that stop answering, driven directly through `TransferBackend` over the FAKE
//! shim (or speaking its wire protocol by hand): what they may hold up, and for how
//! long. Every test is bounded; they run one at a time (a process-wide lock) because
//! some count this process's threads.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use te_core::{
    Access, Completion, Deadline, ErrorKind, MemoryDesc, MemoryKind, RegionId, TransferBackend,
    TransferRequest,
};

mod direct;
use direct::*;

/// A peer that accepts the TCP connection but never answers the handshake: each
/// `connect` returns `Timeout` at its deadline, with at most one attempt thread per
/// peer. An attempt that a parked batch keeps going (its peer's renewed connection
/// never answers) is cancelled when the backend is dropped: 1 s later no attempt
/// thread is left, the batch has ended, and the engine no longer listens.
#[test]
fn connect_attempts_to_a_silent_peer_do_not_outlive_the_backend() {
    let _g = serial();
    // Listening, never accepting: the kernel completes the TCP handshake, nobody answers.
    let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
    let seg = segment(
        silent.local_addr().expect("addr").to_string().into_bytes(),
        "127.0.0.1:7009",
        vec![region(1, 0x1000_0000, 4096, Access::REMOTE_READ_WRITE)],
    );
    let before = threads_named("te-flagcx-conn");
    let b = backend("");
    let endpoint = String::from_utf8(b.endpoint()).expect("text endpoint");
    for _ in 0..3 {
        let start = Instant::now();
        let r = b.connect_within(&seg, Instant::now() + Duration::from_millis(200));
        assert!(
            matches!(&r, Err(e) if e.kind() == ErrorKind::Timeout),
            "connect to a silent peer: {r:?}"
        );
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "connect overran its deadline"
        );
    }
    let attempts = threads_named("te-flagcx-conn").saturating_sub(before);
    assert!(
        attempts <= 1,
        "three connects to one silent peer left {attempts} te-flagcx-connect threads"
    );
    // A batch parked for 30 s on a connection being renewed to a peer that no longer
    // answers: its attempt runs when the backend is dropped.
    let remote = 0x1000_0000u64;
    let (ep, stop) = answers_once(remote, LEN as u64);
    let src = Mem::new(LEN);
    register(&b, 10, &src, Access::LOCAL);
    let r1 = region(1, remote, LEN as u64, Access::REMOTE_READ_WRITE);
    let r2 = region(
        2,
        remote + LEN as u64,
        LEN as u64,
        Access::REMOTE_READ_WRITE,
    );
    let once = ep.clone().into_bytes();
    let peer = connect(&b, &segment(once, "127.0.0.1:7011", vec![r1.clone()]));
    let renewed = segment(ep.into_bytes(), "127.0.0.1:7011", vec![r1, r2]);
    let _ = b.connect_within(&renewed, Instant::now() + Duration::from_millis(50));
    let (done, rx) = completion(Duration::from_secs(30));
    let write = TransferRequest::write(RegionId(10), 0, RegionId(2), 0, LEN as u64);
    b.submit(peer, &[write], done).expect("submit");
    drop(b);
    std::thread::sleep(Duration::from_millis(1000));
    let leaked = threads_named("te-flagcx-conn").saturating_sub(before);
    let batch = rx.try_recv();
    let still_listening = TcpStream::connect_timeout(
        &endpoint.parse().expect("socket address"),
        Duration::from_millis(500),
    )
    .is_ok();
    // Unblock the attempts (their sockets get reset) so the test leaves nothing behind.
    drop(silent);
    let _ = stop.send(());
    drop(src);
    assert!(
        leaked == 0 && !still_listening,
        "1 s after the backend was dropped, {leaked} te-flagcx-connect thread(s) are still blocked on a silent peer, and the dropped backend's FlagCX endpoint {endpoint} still accepts connections: {still_listening}"
    );
    assert!(
        matches!(batch, Ok(Err(_))),
        "a batch parked when the backend was dropped: {batch:?}"
    );
}

/// A FAKE-protocol peer that answers the handshake with one region and then never reads
/// again. Returns its endpoint and a sender that ends it.
fn never_reading_peer(addr: u64, len: u64) -> (String, mpsc::Sender<()>) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let ep = l.local_addr().expect("addr").to_string();
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        let Ok((mut s, _)) = l.accept() else { return };
        let mut hello = [0u8; 8];
        if s.read_exact(&mut hello).is_err() {
            return;
        }
        let mut table = Vec::new();
        table.extend_from_slice(&1u32.to_ne_bytes());
        table.extend_from_slice(&addr.to_ne_bytes());
        table.extend_from_slice(&len.to_ne_bytes());
        let _ = s.write_all(&table);
        // Never read: hold the socket until told.
        let _ = stop_rx.recv_timeout(Duration::from_secs(60));
        drop(s);
    });
    (ep, stop_tx)
}

/// A peer that stops reading mid-transfer: once the engine aborts the batch at its
/// deadline, the backend closes the batch's connection (FlagCX cannot cancel a
/// transfer), so the batch ends, failed, with nothing of it touching memory afterwards;
/// and registering unrelated memory meanwhile does not wait for the stuck transfer (the
/// fake pins the transfer's regions instead of holding its registration lock across
/// the socket).
#[test]
fn a_batch_to_a_peer_that_never_reads_ends_by_its_deadline() {
    let _g = serial();
    const BIG: usize = 32 << 20;
    let remote_addr = 0x7000_0000_0000u64;
    let (ep, stop) = never_reading_peer(remote_addr, BIG as u64);
    let b = backend("");
    let src = Mem::new(BIG);
    register(&b, 10, &src, Access::LOCAL);
    let seg = segment(
        ep.into_bytes(),
        "127.0.0.1:7010",
        vec![region(
            1,
            remote_addr,
            BIG as u64,
            Access::REMOTE_READ_WRITE,
        )],
    );
    let peer = connect(&b, &seg);
    let (tx, rx) = mpsc::channel();
    let (done, aborter) =
        Completion::abortable(Deadline::after(Duration::from_millis(500)), move |r, _| {
            let _ = tx.send(r);
        });
    b.submit(
        peer,
        &[TransferRequest::write(
            RegionId(10),
            0,
            RegionId(1),
            0,
            BIG as u64,
        )],
        done,
    )
    .expect("submit");
    std::thread::sleep(Duration::from_millis(500));
    // What the engine does at a batch's deadline.
    aborter.abort();
    b.abort(peer, te_core::BatchId(0));
    let ended = rx.recv_timeout(Duration::from_secs(3));
    // Registering unrelated memory must not wait for a stuck peer.
    let b = std::sync::Arc::new(b);
    let other = std::sync::Arc::new(Mem::new(LEN));
    let (rtx, rrx) = mpsc::channel();
    {
        let (b, other) = (b.clone(), other.clone());
        std::thread::spawn(move || {
            let r = b.register(
                RegionId(11),
                &MemoryDesc {
                    name: "other".into(),
                    addr: other.addr(),
                    len: other.len() as u64,
                    kind: MemoryKind::Host,
                    access: Access::LOCAL,
                },
            );
            let _ = rtx.send(r.map(|_| ()));
        });
    }
    let registered = rrx.recv_timeout(Duration::from_secs(2));
    // Release the peer; everything unblocks.
    let _ = stop.send(());
    let _ = rx.recv_timeout(Duration::from_secs(10));
    let _ = rrx.recv_timeout(Duration::from_secs(10));
    let mut problems = Vec::new();
    match ended {
        Ok(Err(_)) => {}
        Ok(Ok(())) => problems.push(
            "a WRITE to a peer that never reads reported success after its abort".to_string(),
        ),
        Err(_) => problems.push(
            "a WRITE to a peer that never reads had not ended 3 s after its 500 ms deadline and abort"
                .to_string(),
        ),
    }
    if registered.is_err() {
        problems
            .push("registering unrelated memory blocked for 2 s behind the stuck transfer".into());
    }
    // Keep `src` alive until the backend is gone.
    drop(b);
    drop(src);
    assert!(problems.is_empty(), "{}", problems.join("; "));
}

/// A peer that stops reading mid-transfer, with no abort from the engine: like a queue
/// pair whose retries run out, the fake gives the transfer up once the peer took none of
/// its bytes for `transfer_timeout_ms`, and the batch fails as unreachable long before
/// its own deadline.
#[test]
fn a_transfer_to_a_peer_that_stopped_reading_fails_after_the_transfer_timeout() {
    let _g = serial();
    const BIG: usize = 32 << 20;
    let remote_addr = 0x7000_0000_0000u64;
    let (ep, stop) = never_reading_peer(remote_addr, BIG as u64);
    let b = backend("transfer_timeout_ms=300");
    let src = Mem::new(BIG);
    register(&b, 10, &src, Access::LOCAL);
    let seg = segment(
        ep.into_bytes(),
        "127.0.0.1:7011",
        vec![region(
            1,
            remote_addr,
            BIG as u64,
            Access::REMOTE_READ_WRITE,
        )],
    );
    let peer = connect(&b, &seg);
    let (done, rx) = completion(Duration::from_secs(30));
    let start = Instant::now();
    b.submit(
        peer,
        &[TransferRequest::write(
            RegionId(10),
            0,
            RegionId(1),
            0,
            BIG as u64,
        )],
        done,
    )
    .expect("submit");
    let got = rx.recv_timeout(Duration::from_secs(5));
    let took = start.elapsed();
    let _ = stop.send(());
    drop(b);
    drop(src);
    match got {
        Ok(Err(e)) => assert!(
            e.kind() == ErrorKind::PeerUnreachable && e.to_string().contains("no progress"),
            "the stalled transfer failed with {e:?}"
        ),
        other => panic!("a transfer to a peer that stopped reading, after {took:?}: {other:?}"),
    }
    assert!(
        took < Duration::from_secs(3),
        "the stalled transfer took {took:?} to fail with a 300 ms transfer timeout"
    );
}

/// A hostile peer on the target's FlagCX listener starts a WRITE and stalls in the
/// middle of its payload. The target's `deregister_within` of another region returns
/// by its deadline: the fake pins the region being written instead of holding its
/// registration lock across the socket read.
#[test]
fn a_stalled_remote_write_does_not_block_the_targets_deregistration() {
    let _g = serial();
    let target = backend("");
    let dst = Mem::new(LEN);
    let other = Mem::new(LEN);
    register(&target, 1, &dst, Access::REMOTE_READ_WRITE);
    register(&target, 2, &other, Access::LOCAL);
    let ep = String::from_utf8(target.endpoint()).expect("endpoint");
    let mut s = TcpStream::connect(&ep).expect("connect to the target's listener");
    let mut hello = Vec::new();
    hello.extend_from_slice(&0x5445_4658u32.to_ne_bytes());
    hello.extend_from_slice(&1u32.to_ne_bytes());
    s.write_all(&hello).expect("hello");
    let mut n = [0u8; 4];
    s.read_exact(&mut n).expect("table size");
    let mut table = vec![0u8; u32::from_ne_bytes(n) as usize * 16];
    s.read_exact(&mut table).expect("table");
    // A WRITE of the whole of `dst`, of which only 10 bytes come.
    let mut req = Vec::new();
    req.extend_from_slice(&0x5445_4658u32.to_ne_bytes());
    req.extend_from_slice(&1u32.to_ne_bytes()); // WRITE
    req.extend_from_slice(&1u32.to_ne_bytes()); // one range
    req.extend_from_slice(&0u32.to_ne_bytes());
    req.extend_from_slice(&(LEN as u64).to_ne_bytes());
    req.extend_from_slice(&dst.addr().to_ne_bytes());
    req.extend_from_slice(&(LEN as u64).to_ne_bytes());
    req.extend_from_slice(&[0u8; 10]);
    s.write_all(&req).expect("request");
    std::thread::sleep(Duration::from_millis(200));
    let target = std::sync::Arc::new(target);
    let (tx, rx) = mpsc::channel();
    {
        let target = target.clone();
        std::thread::spawn(move || {
            let start = Instant::now();
            let r =
                target.deregister_within(RegionId(2), Instant::now() + Duration::from_millis(500));
            let _ = tx.send((r, start.elapsed()));
        });
    }
    let got = rx.recv_timeout(Duration::from_secs(3));
    drop(s);
    let late = rx.recv_timeout(Duration::from_secs(10));
    drop(target);
    match got {
        Ok((r, took)) => assert!(
            took < Duration::from_millis(1500),
            "deregister of an unrelated region took {took:?} ({r:?})"
        ),
        Err(_) => panic!(
            "deregister_within(500 ms) of an unrelated region had not returned 3 s later, while a peer stalled mid-WRITE (it returned {late:?} once the peer went away)"
        ),
    }
}

/// Opens a FAKE-protocol connection to `ep` and starts a WRITE of `len` bytes at `addr`
/// of which only 10 bytes come; returns the socket, to be held open.
fn stalled_write(ep: &str, addr: u64, len: u64) -> TcpStream {
    let mut s = TcpStream::connect(ep).expect("connect to the target's listener");
    let mut hello = Vec::new();
    hello.extend_from_slice(&0x5445_4658u32.to_ne_bytes());
    hello.extend_from_slice(&1u32.to_ne_bytes());
    s.write_all(&hello).expect("hello");
    let mut n = [0u8; 4];
    s.read_exact(&mut n).expect("table size");
    let mut table = vec![0u8; u32::from_ne_bytes(n) as usize * 16];
    s.read_exact(&mut table).expect("table");
    let mut req = Vec::new();
    req.extend_from_slice(&0x5445_4658u32.to_ne_bytes());
    req.extend_from_slice(&1u32.to_ne_bytes()); // WRITE
    req.extend_from_slice(&1u32.to_ne_bytes()); // one range
    req.extend_from_slice(&0u32.to_ne_bytes());
    req.extend_from_slice(&len.to_ne_bytes());
    req.extend_from_slice(&addr.to_ne_bytes());
    req.extend_from_slice(&len.to_ne_bytes());
    req.extend_from_slice(&[0u8; 10]);
    s.write_all(&req).expect("request");
    s
}

/// The region a stalled peer is writing into: deregistering it waits for the WRITE
/// moving bytes in it (FlagCX's rule that the memory stays while a transfer uses it),
/// but only until the target's transfer timeout gives the stalled WRITE up and ends
/// that peer's connection; it never waits for the peer itself.
#[test]
fn deregistering_the_region_a_stalled_peer_writes_waits_only_for_the_transfer_timeout() {
    let _g = serial();
    let target = backend("transfer_timeout_ms=1000");
    let dst = Mem::new(LEN);
    register(&target, 1, &dst, Access::REMOTE_READ_WRITE);
    let ep = String::from_utf8(target.endpoint()).expect("endpoint");
    let mut s = stalled_write(&ep, dst.addr(), LEN as u64);
    std::thread::sleep(Duration::from_millis(200));
    let target = std::sync::Arc::new(target);
    let (tx, rx) = mpsc::channel();
    {
        let target = target.clone();
        std::thread::spawn(move || {
            let start = Instant::now();
            let r = target.deregister_within(RegionId(1), Instant::now() + Duration::from_secs(5));
            let _ = tx.send((r, start.elapsed()));
        });
    }
    let got = rx.recv_timeout(Duration::from_secs(5));
    // The target ended the stalled peer's connection.
    s.set_read_timeout(Some(Duration::from_secs(1)))
        .expect("read timeout");
    let mut byte = [0u8; 1];
    let closed = matches!(s.read(&mut byte), Ok(0));
    // Release everything, whatever happened.
    drop(s);
    let _ = rx.recv_timeout(Duration::from_secs(10));
    drop(target);
    let Ok((r, took)) = got else {
        panic!("deregistering the region a stalled peer writes had not returned 5 s later");
    };
    assert!(r.is_ok(), "deregister: {r:?}");
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_secs(3),
        "deregistering the region being written took {took:?}, with a 1 s transfer timeout 200 ms into the stall"
    );
    assert!(closed, "the stalled peer's connection was not ended");
}
