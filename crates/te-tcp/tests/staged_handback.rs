//! A staged batch (device memory through pinned staging and the socket, as between two
//! hosts) is handed back only once nothing of it touches the caller's memory: not while
//! a copy from or into the caller's device memory runs, whether the batch ends by its
//! peer going away, its deadline or a cancel. A target's deregistration waits for a
//! copy into the region, and batches past their deadlines give a small staging ring
//! back whole.
//!
//! fakedev is made slow here: every copy group pays `LAUNCH` on its queue thread before
//! it copies a byte, so a copy is in flight for that long; fakedev counts a
//! synchronisation once a group's copies have run, so the count at a batch's hand-back
//! says whether its copy had ended. The fakedev settings hold for this whole process,
//! so the tests of this binary run one at a time (`serial`).

mod common;

use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::{connect, host, pattern, soon, DevMem};
use te_core::device::fakedev::FakeDev;
use te_core::{
    Aborter, Access, Completion, Deadline, ErrorKind, Op, PeerId, RegionId, Result,
    TransferBackend, TransferRequest,
};
use te_tcp::{TcpBackend, TcpConfig};

/// What every fakedev copy group costs before it copies.
const LAUNCH: Duration = Duration::from_millis(1000);
/// One frame, larger than the inline-copy limit (64 KiB): copied asynchronously.
const FRAME: u64 = 512 << 10;
/// How long a test waits for a batch's completion.
const COMPLETES: Duration = Duration::from_secs(15);

static SERIAL: Mutex<()> = Mutex::new(());

/// Holds this binary's tests to one at a time, with fakedev's copies slowed down.
fn serial() -> (MutexGuard<'static, ()>, Arc<FakeDev>) {
    let g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    common::fakedev_costs(LAUNCH, Duration::ZERO);
    let _ = te_core::device::runtime(te_core::device::fakedev::NAME).expect("fakedev");
    let dev = te_core::device::fakedev::process().expect("fakedev runs here");
    (g, dev)
}

/// Staged over the socket, as to a peer on another host, on one connection.
fn backend_with(set: impl FnOnce(&mut TcpConfig)) -> TcpBackend {
    common::backend_with(|c| {
        c.local_copies = false;
        c.local_ipc = false;
        c.connections_per_peer = 1;
        set(c);
    })
}

/// A target and an initiator, both made with `set`, connected: the target's region 1
/// is `len` bytes of host memory (a pattern), the initiator's region 1 `len` bytes of
/// fakedev:0. The target drops before its memory.
struct Staged {
    target: TcpBackend,
    init: TcpBackend,
    _remote: Vec<u8>,
    _dev: DevMem,
    peer: PeerId,
}

fn staged(len: u64, set: impl Fn(&mut TcpConfig)) -> Staged {
    let (target, init) = (backend_with(&set), backend_with(&set));
    let mut remote = pattern(len as usize, 3);
    host(&target, 1, &mut remote, Access::REMOTE_READ_WRITE);
    let dev = DevMem::new(0, len as usize);
    dev.register(&init, 1, Access::LOCAL);
    let peer = connect(&init, &target);
    Staged {
        target,
        init,
        _remote: remote,
        _dev: dev,
        peer,
    }
}

/// `len` bytes between local region `local` at `at` and remote region 1 at `at`.
fn req(op: Op, local: u64, at: u64, len: u64) -> TransferRequest {
    TransferRequest {
        op,
        local: RegionId(local),
        local_offset: at,
        remote: RegionId(1),
        remote_offset: at,
        len,
    }
}

/// Waits (bounded) until `b`'s staging in use is back to zero; returns what it last saw.
fn staging_settles(b: &TcpBackend) -> u64 {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let n = b
            .gauges()
            .into_iter()
            .find(|(n, _)| n == "staging_bytes_in_use")
            .expect("te-tcp reports its staging in use")
            .1;
        if n == 0 || Instant::now() >= end {
            return n;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A completion's report: its result, how long after the completion was made, and
/// fakedev's synchronisations on the device then.
struct Done {
    result: Result<()>,
    after: Duration,
    syncs: u64,
}

/// A completion with `timeout` left that reports to the receiver, counting the
/// synchronisations of fakedev:`ordinal`.
fn completion(
    dev: &Arc<FakeDev>,
    ordinal: u32,
    timeout: Duration,
) -> (Completion, mpsc::Receiver<Done>, Aborter) {
    let (tx, rx) = mpsc::channel();
    let (d, made) = (dev.clone(), Instant::now());
    let (c, aborter) = Completion::abortable(Deadline::after(timeout), move |r, _| {
        let _ = tx.send(Done {
            result: r,
            after: made.elapsed(),
            syncs: d.device_stats(ordinal).syncs,
        });
    });
    (c, rx, aborter)
}

/// Waits for `what`'s completion, checks that a copy group ran on its device since
/// `before` (its synchronisations then) and that `init`'s staging comes back; returns
/// the batch's result.
fn handed_back_after_its_copy(
    init: &TcpBackend,
    rx: &mpsc::Receiver<Done>,
    before: u64,
    what: &str,
) -> Result<()> {
    let done = rx.recv_timeout(COMPLETES).expect("the batch completes");
    assert!(
        done.syncs > before,
        "{what}: handed back {:?} after submission ({:?}) while its copy with the caller's \
         device memory had not ended (fakedev launch {LAUNCH:?})",
        done.after,
        done.result.as_ref().map_err(|e| e.kind()),
    );
    assert_eq!(staging_settles(init), 0, "{what}: staging in use");
    done.result
}

/// The target goes away while a WRITE's gather copy (device → staging) waits to run.
#[test]
fn a_staged_write_whose_peer_goes_away_is_handed_back_only_after_its_gather_copy() {
    let (_g, dev) = serial();
    let p = staged(FRAME, |_| {});
    let before = dev.device_stats(0).syncs;
    let (c, rx, _a) = completion(&dev, 0, Duration::from_secs(20));
    p.init
        .submit(p.peer, &[req(Op::Write, 1, 0, FRAME)], c)
        .expect("submit");
    std::thread::sleep(Duration::from_millis(150));
    drop(p.target);
    let r = handed_back_after_its_copy(&p.init, &rx, before, "the peer went away");
    assert_eq!(r.map_err(|e| e.kind()), Err(ErrorKind::PeerUnreachable));
    p.init.deregister(RegionId(1), soon()).expect("deregister");
}

/// The target goes away while a WRITE's gather copy waits to run, and the initiator
/// lets go of the dead connection (here by disconnecting; a reconnect drops it too):
/// the batch still ends after its copy, with the connection's error.
#[test]
fn a_staged_write_on_a_dead_connection_let_go_of_during_its_copy_fails_with_the_connections_error()
{
    let (_g, dev) = serial();
    let p = staged(FRAME, |_| {});
    let before = dev.device_stats(0).syncs;
    let (c, rx, _a) = completion(&dev, 0, Duration::from_secs(20));
    p.init
        .submit(p.peer, &[req(Op::Write, 1, 0, FRAME)], c)
        .expect("submit");
    std::thread::sleep(Duration::from_millis(150));
    drop(p.target);
    std::thread::sleep(Duration::from_millis(150));
    p.init.disconnect(p.peer, soon()).expect("disconnect");
    let r = handed_back_after_its_copy(&p.init, &rx, before, "its connection was let go of");
    assert_eq!(r.map_err(|e| e.kind()), Err(ErrorKind::PeerUnreachable));
    p.init.deregister(RegionId(1), soon()).expect("deregister");
}

/// A WRITE's deadline passes while its gather copy waits to run and its other frame
/// stalls at the target: the connection that holds it is closed, and the batch is
/// still handed back only after the copy.
#[test]
fn a_staged_write_past_its_deadline_is_handed_back_only_after_its_gather_copy() {
    let (_g, dev) = serial();
    // The target holds every frame for 3 s.
    let p = staged(2 * FRAME, |c| c.debug_delay = Duration::from_secs(3));
    let mut h = vec![7u8; 2 * FRAME as usize];
    host(&p.init, 2, &mut h, Access::LOCAL);
    let before = dev.device_stats(0).syncs;
    let (c, rx, _a) = completion(&dev, 0, Duration::from_millis(200));
    // A small host frame, written at once, then a device frame that waits for its copy.
    let batch = [
        req(Op::Write, 2, FRAME, 64 << 10),
        req(Op::Write, 1, 0, FRAME),
    ];
    p.init.submit(p.peer, &batch, c).expect("submit");
    let r = handed_back_after_its_copy(&p.init, &rx, before, "past its deadline");
    assert_eq!(r.map_err(|e| e.kind()), Err(ErrorKind::Timeout));
    common::deregister(&p.init, &[1, 2]);
}

/// A READ past its deadline, or cancelled, while its copy into the caller's device
/// memory (staging → device) waits to run.
#[test]
fn a_staged_read_past_its_deadline_or_cancelled_is_handed_back_only_after_its_copy_into_the_device()
{
    let (_g, dev) = serial();
    let p = staged(FRAME, |_| {});
    for (what, timeout) in [("past its deadline", 200), ("cancelled", 20_000)] {
        let before = dev.device_stats(0).syncs;
        let (c, rx, aborter) = completion(&dev, 0, Duration::from_millis(timeout));
        let id = c.batch();
        p.init
            .submit(p.peer, &[req(Op::Read, 1, 0, FRAME)], c)
            .expect("submit");
        if what == "cancelled" {
            std::thread::sleep(Duration::from_millis(200));
            aborter.abort();
            p.init.abort(p.peer, id);
        }
        // Its own result may be Ok: the engine replaces it with the abort's reason.
        let _ = handed_back_after_its_copy(&p.init, &rx, before, what);
    }
    p.init.deregister(RegionId(1), soon()).expect("deregister");
}

/// The target deregisters a region while a WRITE's copy into it (staging → device)
/// waits to run.
#[test]
fn a_targets_deregistration_waits_for_a_staged_writes_copy_into_the_region() {
    let (_g, dev) = serial();
    let target = backend_with(|_| {});
    let init = backend_with(|_| {});
    let remote = DevMem::new(1, FRAME as usize);
    remote.register(&target, 1, Access::REMOTE_READ_WRITE);
    let mut h = pattern(FRAME as usize, 9);
    host(&init, 1, &mut h, Access::LOCAL);
    let peer = connect(&init, &target);

    let before = dev.device_stats(1).syncs;
    let (c, rx, _a) = completion(&dev, 1, Duration::from_secs(20));
    init.submit(peer, &[req(Op::Write, 1, 0, FRAME)], c)
        .expect("submit");
    // The frame arrives and its copy to fakedev:1 waits for its launch.
    std::thread::sleep(Duration::from_millis(300));
    target
        .deregister(RegionId(1), Deadline::after(Duration::from_secs(10)))
        .expect("deregister");
    assert!(
        dev.device_stats(1).syncs > before,
        "the deregistration returned while a staged copy into the region was still to run"
    );
    let done = rx.recv_timeout(COMPLETES).expect("the batch completes");
    done.result.expect("the write was acknowledged");
    assert_eq!(staging_settles(&target), 0);
    init.deregister(RegionId(1), soon()).expect("deregister");
}

/// Batches of both ops, with short deadlines and slow copies, share a staging ring of
/// 16 slices: each completes, and the ring comes back whole.
#[test]
fn staged_batches_past_their_deadlines_on_a_small_ring_complete_and_give_their_staging_back() {
    let (_g, dev) = serial();
    let p = staged(6 * FRAME, |c| c.slice_size = 128 << 10);
    // Six batches of four slices each, WRITEs and READs in turn.
    let rxs: Vec<_> = (0..6u64)
        .map(|i| {
            let (c, rx, _a) = completion(&dev, 0, Duration::from_millis(300));
            let op = if i % 2 == 0 { Op::Write } else { Op::Read };
            p.init
                .submit(p.peer, &[req(op, 1, i * FRAME, FRAME)], c)
                .expect("submit");
            rx
        })
        .collect();
    for (i, rx) in rxs.iter().enumerate() {
        rx.recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("batch {i} completes"));
    }
    assert_eq!(staging_settles(&p.init), 0);
    p.init.deregister(RegionId(1), soon()).expect("deregister");
}
