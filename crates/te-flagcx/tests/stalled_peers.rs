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

/// A peer that accepts the TCP connection but never answers the handshake: `connect`
/// returns `Timeout` at its deadline while the attempt goes on, later connects wait for
/// that same attempt (one thread per peer), and dropping the backend cancels it: 1 s
/// later no attempt thread is left and the engine no longer listens.
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
    // The three connects shared one attempt: one thread per peer, not one per call.
    let attempts = threads_named("te-flagcx-conn").saturating_sub(before);
    assert!(
        attempts <= 1,
        "three connects to one silent peer left {attempts} te-flagcx-connect threads"
    );
    drop(b);
    std::thread::sleep(Duration::from_millis(1000));
    let leaked = threads_named("te-flagcx-conn").saturating_sub(before);
    let still_listening = TcpStream::connect_timeout(
        &endpoint.parse().expect("socket address"),
        Duration::from_millis(500),
    )
    .is_ok();
    // Unblock the attempts (their sockets get reset) so the test leaves nothing behind.
    drop(silent);
    assert!(
        leaked == 0 && !still_listening,
        "1 s after the backend was dropped, {leaked} te-flagcx-connect thread(s) are still blocked on the silent peer, and the dropped backend's FlagCX endpoint {endpoint} still accepts connections: {still_listening}"
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
