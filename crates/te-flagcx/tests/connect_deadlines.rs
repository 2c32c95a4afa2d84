//! How long a connection attempt lives: exactly as long as some caller waits for it
//! (a `connect` until its deadline, a parked batch until its own), never a fixed time
//! of the backend's. Driven directly through `TransferBackend` over the FAKE shim, with
//! peers that never answer the handshake (a listener that never accepts) or that start
//! answering late (a proxy in front of a real fake target). Every test is bounded; they
//! run one at a time (a process-wide lock) because they count this process's threads.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use te_core::testkit::pattern;
use te_core::{Access, ErrorKind, RegionId, SegmentDesc, TransferBackend, TransferRequest};

mod direct;
use direct::*;

/// The thread name prefix of the backend's connection attempts (comm is cut at 15).
const ATTEMPT: &str = "te-flagcx-conn";

/// Waits up to `within` for every attempt thread beyond `before` to end; returns how
/// many are left.
fn attempts_left(before: usize, within: Duration) -> usize {
    let until = Instant::now() + within;
    loop {
        let left = threads_named(ATTEMPT).saturating_sub(before);
        if left == 0 || Instant::now() >= until {
            return left;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A peer that completes the TCP handshake (the kernel does, from the backlog) and
/// never answers FlagCX's: its segment, and the listener to keep alive meanwhile.
fn silent_peer(address: &str) -> (SegmentDesc, TcpListener) {
    let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
    let seg = segment(
        silent.local_addr().expect("addr").to_string().into_bytes(),
        address,
        vec![region(1, 0x1000_0000, 4096, Access::REMOTE_READ_WRITE)],
    );
    (seg, silent)
}

/// A connect to a peer that never answers returns at its deadline, not the backend's:
/// `Timeout`, naming the peer's endpoint.
#[test]
fn a_connect_to_a_peer_that_never_answers_returns_at_its_deadline_naming_the_peer() {
    let _g = serial();
    let (seg, _silent) = silent_peer("127.0.0.1:7101");
    let endpoint = String::from_utf8(seg.endpoint.clone()).expect("text");
    let b = backend("");
    let start = Instant::now();
    let r = b.connect_within(&seg, start + Duration::from_millis(200));
    let took = start.elapsed();
    match &r {
        Err(e) if e.kind() == ErrorKind::Timeout && e.to_string().contains(&endpoint) => {}
        other => panic!("a connect to a silent peer {endpoint}: {other:?}"),
    }
    assert!(
        took >= Duration::from_millis(190) && took < Duration::from_millis(1500),
        "a connect with a 200 ms deadline returned after {took:?}"
    );
}

/// Once every caller of an attempt gave up, the attempt is gone too: no thread keeps
/// connecting to a silent peer for a fixed time of its own (it was 30 s).
#[test]
fn no_attempt_thread_is_left_once_every_caller_gave_up() {
    let _g = serial();
    let (seg, _silent) = silent_peer("127.0.0.1:7102");
    let before = threads_named(ATTEMPT);
    let b = Arc::new(backend(""));
    // Two callers sharing the peer, 200 ms and 500 ms, then one alone.
    let other = {
        let (b, seg) = (b.clone(), seg.clone());
        std::thread::spawn(move || {
            b.connect_within(&seg, Instant::now() + Duration::from_millis(500))
        })
    };
    let first = b.connect_within(&seg, Instant::now() + Duration::from_millis(200));
    let second = other.join().expect("the connecting thread panicked");
    for (what, r) in [("200 ms", &first), ("500 ms", &second)] {
        assert!(
            matches!(r, Err(e) if e.kind() == ErrorKind::Timeout),
            "the {what} connect to a silent peer: {r:?}"
        );
    }
    let left = attempts_left(before, Duration::from_millis(1000));
    assert_eq!(
        left, 0,
        "1 s after both connects to a silent peer gave up, {left} attempt thread(s) still connect to it"
    );
    let third = b.connect_within(&seg, Instant::now() + Duration::from_millis(100));
    assert!(
        matches!(&third, Err(e) if e.kind() == ErrorKind::Timeout),
        "a third connect: {third:?}"
    );
    let left = attempts_left(before, Duration::from_millis(1000));
    assert_eq!(
        left, 0,
        "1 s after a 100 ms connect to a silent peer gave up, {left} attempt thread(s) still connect to it"
    );
}

/// Copies `from` into `to` until either ends, then ends both.
fn pipe(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = [0u8; 16 << 10];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 || to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

/// A proxy in front of `target` that holds every connection silent until `from`, then
/// relays it: a peer that starts answering then. Serves at most `max` connections.
fn late_proxy(target: String, from: Instant, max: usize) -> String {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let ep = l.local_addr().expect("addr").to_string();
    std::thread::spawn(move || {
        for s in l.incoming().take(max) {
            let Ok(down) = s else { return };
            let target = target.clone();
            std::thread::spawn(move || {
                std::thread::sleep(from.saturating_duration_since(Instant::now()));
                let Ok(up) = TcpStream::connect(&target) else {
                    return;
                };
                // Every relay ends by itself once a side is idle this long.
                for s in [&down, &up] {
                    let _ = s.set_read_timeout(Some(Duration::from_secs(20)));
                }
                let (Ok(down2), Ok(up2)) = (down.try_clone(), up.try_clone()) else {
                    return;
                };
                std::thread::spawn(move || pipe(up2, down2));
                pipe(down, up);
            });
        }
    });
    ep
}

/// Two callers share a peer that starts answering at 1 s: the one with a 200 ms
/// deadline gets `Timeout` at 200 ms, the one with 3 s is connected (the attempt lives
/// for the caller still waiting), and its connection moves bytes.
#[test]
fn a_caller_with_a_later_deadline_is_connected_after_an_earlier_one_gave_up() {
    let _g = serial();
    let target = backend("");
    let dst = Mem::new(LEN);
    let d = register(&target, 1, &dst, Access::REMOTE_READ_WRITE);
    let target_ep = String::from_utf8(target.endpoint()).expect("text");
    let start = Instant::now();
    let proxy = late_proxy(target_ep, start + Duration::from_secs(1), 8);
    let seg = segment(proxy.into_bytes(), "127.0.0.1:7103", vec![d]);
    let b = Arc::new(backend(""));
    let src = Mem::new(LEN);
    register(&b, 10, &src, Access::LOCAL);
    let before = threads_named(ATTEMPT);
    // The 200 ms caller starts the attempt; the 3 s one comes while it runs.
    let hasty = {
        let (b, seg) = (b.clone(), seg.clone());
        std::thread::spawn(move || {
            let r = b.connect_within(&seg, start + Duration::from_millis(200));
            (r, start.elapsed())
        })
    };
    let until = start + Duration::from_millis(150);
    while threads_named(ATTEMPT) == before && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        threads_named(ATTEMPT) > before,
        "the 200 ms connect started no attempt within 150 ms"
    );
    let patient = b.connect_within(&seg, start + Duration::from_secs(3));
    let patient_took = start.elapsed();
    let (hasty, hasty_took) = hasty.join().expect("the connecting thread panicked");
    assert!(
        matches!(&hasty, Err(e) if e.kind() == ErrorKind::Timeout),
        "the 200 ms connect: {hasty:?}"
    );
    assert!(
        hasty_took < Duration::from_millis(900),
        "the 200 ms connect returned after {hasty_took:?}"
    );
    let peer = match patient {
        Ok(peer) => peer,
        Err(e) => panic!(
            "the 3 s connect to a peer answering at 1 s failed after {patient_took:?}: {e:?}"
        ),
    };
    src.write(&pattern(LEN, 4));
    match run(
        &b,
        peer,
        TransferRequest::write(RegionId(10), 0, RegionId(1), 0, LEN as u64),
    ) {
        Some(Ok(())) => {}
        other => panic!("a WRITE on the late connection: {other:?}"),
    }
    assert!(
        dst.read() == pattern(LEN, 4),
        "the WRITE's bytes did not land"
    );
    drop(b);
    drop(target);
}

/// A batch parked for a peer whose renewed connection never answers keeps the attempt
/// going for as long as it waits (past the 100 ms connect that started it), and fails
/// with `Timeout` at its own deadline; then no attempt thread is left.
#[test]
fn a_parked_batch_keeps_its_attempt_until_its_own_deadline_and_no_longer() {
    let _g = serial();
    let remote = 0x7000_0000_0000u64;
    let (ep, stop) = answers_once(remote, LEN as u64);
    let outside = threads_named(ATTEMPT);
    let b = backend("");
    let src = Mem::new(LEN);
    register(&b, 10, &src, Access::LOCAL);
    let r1 = region(1, remote, LEN as u64, Access::REMOTE_READ_WRITE);
    let r2 = region(
        2,
        remote + LEN as u64,
        LEN as u64,
        Access::REMOTE_READ_WRITE,
    );
    let peer = connect(
        &b,
        &segment(ep.clone().into_bytes(), "127.0.0.1:7104", vec![r1.clone()]),
    );
    // The fake's worker of that connection was started by an attempt thread and
    // carries its name; the attempt itself ends just after `connect` returned.
    let before = outside + 1;
    let ended = attempts_left(before, Duration::from_millis(1000));
    assert_eq!(ended, 0, "the first attempt's thread did not end");
    // Region 2 needs a new connection, which never comes.
    let seg = segment(ep.into_bytes(), "127.0.0.1:7104", vec![r1, r2]);
    let r = b.connect_within(&seg, Instant::now() + Duration::from_millis(100));
    assert!(
        matches!(&r, Err(e) if e.kind() == ErrorKind::Timeout),
        "a connect whose new connection never answers: {r:?}"
    );
    let (done, rx) = completion(Duration::from_millis(800));
    let start = Instant::now();
    b.submit(
        peer,
        &[TransferRequest::write(
            RegionId(10),
            0,
            RegionId(2),
            0,
            LEN as u64,
        )],
        done,
    )
    .expect("submit");
    std::thread::sleep(Duration::from_millis(400));
    let running = threads_named(ATTEMPT).saturating_sub(before);
    let result = rx.recv_timeout(Duration::from_secs(5));
    let took = start.elapsed();
    let left = attempts_left(before, Duration::from_millis(1000));
    let _ = stop.send(());
    drop(b);
    assert_eq!(
        running, 1,
        "400 ms into a parked batch's 800 ms wait, {running} attempt thread(s) were renewing its connection"
    );
    match result {
        Ok(Err(e)) if e.kind() == ErrorKind::Timeout => {}
        other => panic!("a parked batch whose connection never came: {other:?}"),
    }
    assert!(
        took >= Duration::from_millis(750) && took < Duration::from_secs(2),
        "the parked batch with an 800 ms deadline ended after {took:?}"
    );
    assert_eq!(
        left, 0,
        "1 s after the parked batch gave up, {left} attempt thread(s) still connect for it"
    );
}
