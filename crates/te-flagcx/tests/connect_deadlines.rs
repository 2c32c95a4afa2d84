//! How long a connection attempt lives: exactly as long as some caller waits for it
//! (a `connect` until its deadline, a parked batch until its own), never a fixed time
//! of the backend's; and once every caller left early (a batch aborted, the peer
//! disconnected), it is cancelled at once, unless a caller waiting for the next attempt
//! would be served by it. Driven directly through `TransferBackend` over the FAKE shim,
//! with peers that never answer the handshake (a listener that never accepts), that
//! answer only the first (a peer that then leaves the rest in its backlog) or that
//! answer each connection at a time of the test's (a proxy in front of a real fake
//! target). Every test is bounded; they run one at a time (a process-wide lock) because
//! they count this process's threads and read the fake's counters.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use te_core::testkit::pattern;
use te_core::{
    Aborter, Access, BatchId, Completion, Deadline, ErrorKind, PeerId, RegionId, SegmentDesc,
    TransferBackend, TransferRequest,
};
use te_flagcx::FlagcxBackend;

mod direct;
use direct::*;

/// The thread name prefix of the backend's connection attempts (comm is cut at 15).
const ATTEMPT: &str = "te-flagcx-conn";

/// Waits up to `within` for every attempt thread beyond `before` to end; returns how
/// many are left.
fn attempts_left(before: usize, within: Duration) -> usize {
    attempts_left_at(before, Instant::now() + within)
}

/// Waits until `until` at the latest for every attempt thread beyond `before` to end;
/// returns how many are left.
fn attempts_left_at(before: usize, until: Instant) -> usize {
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

/// A shim slow to make a connection attempt holds up no caller: the attempt is made
/// without the peer's lock, so a connect still returns at its deadline (and the attempt,
/// which no one waits for once it is made, is cancelled at once).
#[test]
fn a_shim_slow_to_make_an_attempt_holds_no_caller_past_its_deadline() {
    let _g = serial();
    let (seg, _silent) = silent_peer("127.0.0.1:7103");
    let before = threads_named(ATTEMPT);
    let b = backend("attempt_delay_ms=1500");
    let start = Instant::now();
    let r = b.connect_within(&seg, start + Duration::from_millis(200));
    let took = start.elapsed();
    assert!(
        matches!(&r, Err(e) if e.kind() == ErrorKind::Timeout),
        "a connect while the shim makes its attempt: {r:?}"
    );
    assert!(
        took < Duration::from_millis(1000),
        "a connect with a 200 ms deadline returned after {took:?}, held up by the shim making its attempt (1.5 s)"
    );
    let left = attempts_left(before, Duration::from_millis(3000));
    assert_eq!(
        left, 0,
        "3 s after a connect gave up, {left} attempt thread(s) still connect"
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
    staged_proxy(target, vec![Stage::From(from); max])
}

/// What a [`staged_proxy`] does with one connection.
#[derive(Clone, Copy)]
enum Stage {
    /// Relays it to the target from this instant on (at once if it passed).
    From(Instant),
    /// Never answers it; lets it go once its initiator closes it.
    Silent,
}

/// A proxy in front of `target` that treats its i-th connection as `stages[i]` says,
/// then stops listening (later connections are refused).
fn staged_proxy(target: String, stages: Vec<Stage>) -> String {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let ep = l.local_addr().expect("addr").to_string();
    std::thread::spawn(move || {
        for (s, stage) in l.incoming().zip(stages) {
            let Ok(mut down) = s else { return };
            let target = target.clone();
            std::thread::spawn(move || {
                let from = match stage {
                    Stage::From(from) => from,
                    Stage::Silent => {
                        // Every relay ends by itself once its initiator is idle this long.
                        let _ = down.set_read_timeout(Some(Duration::from_secs(20)));
                        let mut buf = [0u8; 64];
                        while matches!(down.read(&mut buf), Ok(n) if n > 0) {}
                        return;
                    }
                };
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

/// How soon after its last waiter left an attempt must be gone: it is cancelled then,
/// not left to run until the deadline it was started with (seconds later in these
/// tests); the margin is for a loaded machine's scheduling.
const PROMPTLY: Duration = Duration::from_millis(300);

/// A backend connected (region 1) to a peer that answers only its first handshake, and
/// that peer's descriptor with region 2 added: connecting with it, or a batch on region
/// 2, asks for a new connection that never comes.
struct Renewing {
    b: Arc<FlagcxBackend>,
    peer: PeerId,
    renewed: SegmentDesc,
    /// Threads named like attempts while none runs (the fake's worker of the first
    /// connection was started by an attempt thread and carries its name).
    before: usize,
    stop: mpsc::Sender<()>,
    /// Outlives the backend (fields drop in order).
    _src: Mem,
}

fn renewing(address: &str) -> Renewing {
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
        &segment(ep.clone().into_bytes(), address, vec![r1.clone()]),
    );
    let before = outside + 1;
    let ended = attempts_left(before, Duration::from_millis(1000));
    assert_eq!(ended, 0, "the first attempt's thread did not end");
    Renewing {
        b: Arc::new(b),
        peer,
        renewed: segment(ep.into_bytes(), address, vec![r1, r2]),
        before,
        stop,
        _src: src,
    }
}

/// Submits a WRITE of region 10 into the peer's region `remote` with deadline `within`;
/// returns what aborts it and where its result arrives.
fn abortable_write(
    b: &FlagcxBackend,
    peer: PeerId,
    remote: u64,
    within: Duration,
) -> (Aborter, Done) {
    let (tx, rx) = mpsc::channel();
    let (done, aborter) = Completion::abortable(Deadline::after(within), move |r, _| {
        let _ = tx.send(r);
    });
    let write = TransferRequest::write(RegionId(10), 0, RegionId(remote), 0, LEN as u64);
    b.submit(peer, &[write], done).expect("submit");
    (aborter, rx)
}

/// What the engine does to abort a batch.
fn abort(b: &FlagcxBackend, peer: PeerId, aborter: &Aborter) {
    aborter.abort();
    b.abort(peer, BatchId(0));
}

/// Waits up to 150 ms for an attempt thread beyond `before` to start.
fn attempt_started(before: usize) -> bool {
    let until = Instant::now() + Duration::from_millis(150);
    while threads_named(ATTEMPT) == before && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(1));
    }
    threads_named(ATTEMPT) > before
}

/// A 200 ms connect and a 3 s batch wait for a renewal that never comes: once the
/// connect gave up and the batch is aborted at 500 ms, no one waits for the attempt,
/// and it is cancelled at once instead of connecting until the batch's 3 s deadline.
#[test]
fn an_attempt_is_cancelled_as_soon_as_its_last_waiter_is_aborted() {
    let _g = serial();
    let r = renewing("127.0.0.1:7105");
    let start = Instant::now();
    let hasty = {
        let (b, seg) = (r.b.clone(), r.renewed.clone());
        std::thread::spawn(move || b.connect_within(&seg, start + Duration::from_millis(200)))
    };
    assert!(
        attempt_started(r.before),
        "the 200 ms connect started no attempt within 150 ms"
    );
    let (aborter, rx) = abortable_write(&r.b, r.peer, 2, Duration::from_secs(3));
    let hasty = hasty.join().expect("the connecting thread panicked");
    assert!(
        matches!(&hasty, Err(e) if e.kind() == ErrorKind::Timeout),
        "the 200 ms connect: {hasty:?}"
    );
    std::thread::sleep(
        (start + Duration::from_millis(500)).saturating_duration_since(Instant::now()),
    );
    let running = threads_named(ATTEMPT).saturating_sub(r.before);
    abort(&r.b, r.peer, &aborter);
    let left = attempts_left_at(r.before, Instant::now() + PROMPTLY);
    let result = rx.recv_timeout(Duration::from_secs(2));
    let _ = r.stop.send(());
    assert_eq!(
        running, 1,
        "500 ms in, {running} attempt thread(s) were renewing the connection for the 3 s batch"
    );
    match result {
        Ok(Err(e)) if e.kind() == ErrorKind::Cancelled => {}
        other => panic!("a batch aborted while its connection was being renewed: {other:?}"),
    }
    assert_eq!(
        left, 0,
        "{PROMPTLY:?} after its last waiter was aborted, {left} attempt thread(s) still connect to a peer that never answers"
    );
}

/// A batch parked on an attempt it started, aborted: the attempt is cancelled at once.
#[test]
fn a_parked_batch_aborted_cancels_the_attempt_it_waited_for() {
    let _g = serial();
    let r = renewing("127.0.0.1:7106");
    // Region 2 is asked for by a connect that gives up at once, so a batch may use it.
    let t =
        r.b.connect_within(&r.renewed, Instant::now() + Duration::from_millis(50));
    assert!(
        matches!(&t, Err(e) if e.kind() == ErrorKind::Timeout),
        "a 50 ms connect whose new connection never answers: {t:?}"
    );
    assert_eq!(attempts_left(r.before, Duration::from_secs(1)), 0);
    let handles = fake_counter("attempts");
    let (aborter, rx) = abortable_write(&r.b, r.peer, 2, Duration::from_secs(3));
    std::thread::sleep(Duration::from_millis(300));
    let running = threads_named(ATTEMPT).saturating_sub(r.before);
    let handles_running = fake_counter("attempts");
    abort(&r.b, r.peer, &aborter);
    let left = attempts_left_at(r.before, Instant::now() + PROMPTLY);
    let result = rx.recv_timeout(Duration::from_secs(2));
    let handles_left = fake_counter("attempts");
    let _ = r.stop.send(());
    assert_eq!(
        (handles_running, handles_left),
        (handles + 1, handles),
        "the shim's attempt handles (before, while renewing, once cancelled: {handles})"
    );
    assert_eq!(
        running, 1,
        "300 ms into the parked batch's 3 s wait, {running} attempt thread(s) were renewing its connection"
    );
    match result {
        Ok(Err(e)) if e.kind() == ErrorKind::Cancelled => {}
        other => panic!("a parked batch aborted: {other:?}"),
    }
    assert_eq!(
        left, 0,
        "{PROMPTLY:?} after the only batch waiting for it was aborted, {left} attempt thread(s) still connect"
    );
}

/// Disconnecting a peer fails the batch parked on it and cancels the attempt at once.
#[test]
fn disconnecting_a_peer_cancels_its_attempt() {
    let _g = serial();
    let r = renewing("127.0.0.1:7107");
    let t =
        r.b.connect_within(&r.renewed, Instant::now() + Duration::from_millis(50));
    assert!(
        matches!(&t, Err(e) if e.kind() == ErrorKind::Timeout),
        "{t:?}"
    );
    assert_eq!(attempts_left(r.before, Duration::from_secs(1)), 0);
    let (_aborter, rx) = abortable_write(&r.b, r.peer, 2, Duration::from_secs(3));
    std::thread::sleep(Duration::from_millis(300));
    let running = threads_named(ATTEMPT).saturating_sub(r.before);
    r.b.disconnect(r.peer, Deadline::after(Duration::from_secs(1)))
        .expect("disconnect");
    // The first connection's worker goes with the peer's connection.
    let left = attempts_left_at(r.before - 1, Instant::now() + PROMPTLY);
    let result = rx.recv_timeout(Duration::from_secs(2));
    let _ = r.stop.send(());
    assert_eq!(
        running, 1,
        "{running} attempt thread(s) were renewing the connection"
    );
    match result {
        Ok(Err(e)) if e.kind() == ErrorKind::PeerUnreachable => {}
        other => panic!("a batch parked on a peer that was disconnected: {other:?}"),
    }
    assert_eq!(
        left, 0,
        "{PROMPTLY:?} after its peer was disconnected, {left} attempt thread(s) still connect to it"
    );
}

/// A target with regions 1, 2 and 3 remotely writable, behind a proxy that answers
/// its connections as `stages` says; the descriptors with regions 1, 1–2 and 1–3.
struct Staged {
    target: FlagcxBackend,
    dst: Vec<Mem>,
    segs: Vec<SegmentDesc>,
}

fn staged(address: &str, stages: Vec<Stage>) -> Staged {
    let target = backend("");
    let dst: Vec<Mem> = (0..3).map(|_| Mem::new(LEN)).collect();
    let regions: Vec<_> = dst
        .iter()
        .enumerate()
        .map(|(i, m)| register(&target, i as u64 + 1, m, Access::REMOTE_READ_WRITE))
        .collect();
    let ep = staged_proxy(String::from_utf8(target.endpoint()).expect("text"), stages);
    let segs = (1..=3)
        .map(|n| segment(ep.clone().into_bytes(), address, regions[..n].to_vec()))
        .collect();
    Staged { target, dst, segs }
}

/// Connects `b` to the staged peer with region 1, then asks for regions 1–2 with a
/// connect that gives up after 50 ms (the proxy's second connection is silent);
/// returns the peer once no attempt runs.
fn wanting_two(b: &FlagcxBackend, s: &Staged) -> PeerId {
    let outside = threads_named(ATTEMPT);
    let peer = connect(b, &s.segs[0]);
    let t = b.connect_within(&s.segs[1], Instant::now() + Duration::from_millis(50));
    assert!(
        matches!(&t, Err(e) if e.kind() == ErrorKind::Timeout),
        "a 50 ms connect to a silent peer: {t:?}"
    );
    // The fake's worker of the first connection carries the attempt thread's name.
    let left = attempts_left(outside + 1, Duration::from_secs(1));
    assert_eq!(
        left, 0,
        "the attempts of the first two connects did not end"
    );
    peer
}

/// A batch starts the attempt renewing a connection, a 5 s connect asks for the next
/// one (it waits longer than the attempt lives), and the batch is aborted: the attempt
/// is left running, because the connect counts on it (no next one would be answered),
/// and the connect is connected when the peer answers at 1 s.
#[test]
fn an_attempt_a_later_caller_counts_on_runs_on_when_its_own_waiters_leave() {
    let _g = serial();
    let s = staged(
        "127.0.0.1:7108",
        vec![
            Stage::From(Instant::now()),
            Stage::Silent,
            // Relayed 1 s after the batch below started its attempt.
            Stage::From(Instant::now() + Duration::from_millis(1300)),
        ],
    );
    let b = Arc::new(backend(""));
    let src = Mem::new(LEN);
    register(&b, 10, &src, Access::LOCAL);
    let peer = wanting_two(&b, &s);
    let start = Instant::now();
    let (aborter, rx) = abortable_write(&b, peer, 2, Duration::from_secs(3));
    let patient = {
        let (b, seg) = (b.clone(), s.segs[1].clone());
        std::thread::spawn(move || b.connect_within(&seg, start + Duration::from_secs(5)))
    };
    std::thread::sleep(Duration::from_millis(300));
    abort(&b, peer, &aborter);
    let aborted = rx.recv_timeout(Duration::from_secs(2));
    let patient = patient.join().expect("the connecting thread panicked");
    let took = start.elapsed();
    match aborted {
        Ok(Err(e)) if e.kind() == ErrorKind::Cancelled => {}
        other => panic!("the aborted batch: {other:?}"),
    }
    let peer = match patient {
        Ok(p) => p,
        Err(e) => panic!("the 5 s connect after the batch sharing its attempt was aborted, after {took:?}: {e:?}"),
    };
    src.write(&pattern(LEN, 7));
    match run(
        &b,
        peer,
        TransferRequest::write(RegionId(10), 0, RegionId(2), 0, LEN as u64),
    ) {
        Some(Ok(())) => {}
        other => panic!("a WRITE on the renewed connection: {other:?}"),
    }
    assert!(
        s.dst[1].read() == pattern(LEN, 7),
        "the WRITE's bytes did not land"
    );
    drop(b);
    drop(s.target);
}

/// A batch's attempt renews a connection for regions 1–2; a connect then needs region 3
/// too, which that attempt cannot give it, and asks for the next one. When the batch is
/// aborted, no one counts on the running attempt: it is cancelled and the next one
/// starts at once (the peer answers it at once), instead of after the running one
/// reached the batch's 3 s deadline.
#[test]
fn an_attempt_no_caller_counts_on_gives_way_to_the_next_at_once() {
    let _g = serial();
    let s = staged(
        "127.0.0.1:7109",
        vec![
            Stage::From(Instant::now()),
            Stage::Silent,
            Stage::Silent,
            Stage::From(Instant::now()),
        ],
    );
    let b = Arc::new(backend(""));
    let src = Mem::new(LEN);
    register(&b, 10, &src, Access::LOCAL);
    let peer = wanting_two(&b, &s);
    let (aborter, rx) = abortable_write(&b, peer, 2, Duration::from_secs(3));
    let start = Instant::now();
    let patient = {
        let (b, seg) = (b.clone(), s.segs[2].clone());
        std::thread::spawn(move || b.connect_within(&seg, start + Duration::from_secs(5)))
    };
    std::thread::sleep(Duration::from_millis(300));
    abort(&b, peer, &aborter);
    let aborted_at = start.elapsed();
    let aborted = rx.recv_timeout(Duration::from_secs(2));
    let patient = patient.join().expect("the connecting thread panicked");
    let took = start.elapsed();
    match aborted {
        Ok(Err(e)) if e.kind() == ErrorKind::Cancelled => {}
        other => panic!("the aborted batch: {other:?}"),
    }
    assert!(
        patient.is_ok() && took < aborted_at + Duration::from_secs(1),
        "a connect needing region 3, once the batch whose attempt could not give it was aborted at {aborted_at:?}: {patient:?} after {took:?} (the attempt runs until the batch's 3 s deadline)"
    );
    drop(b);
    drop(s.target);
}
