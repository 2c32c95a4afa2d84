//! How te-rdma lets go of work and memory, through the FAKE verbs provider: a
//! disconnect waits for its flushes, an aborted batch posts none of its waiting slices,
//! a deregistration waits for the slices that pin its region (or times out), a batch
//! unpins its regions before its completion runs, and a dropped backend deregisters its
//! regions before it closes its devices, waiting for a peer that hangs no longer than
//! `connect_timeout`; and a connected pair that has moved data and is left alone wakes
//! no thread.
//!
//! Run as `cargo test -p te-rdma --test fake_teardown`.

mod common;

use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{
    backend, check, host, node, pair, pattern, region, run, segment, soon, write_all, Fake, Node,
};
use libtest_mimic::Failed;
use te_core::{
    Access, Completion, Deadline, ErrorKind, PeerId, RegionId, TransferBackend, TransferRequest,
};
use te_rdma::RdmaConfig;

/// An initiator on `fakeslow` (each work request takes 200 ms) that posts one work
/// request at a time, so a batch of several slices keeps most of them waiting.
fn one_at_a_time() -> Node {
    let mut c = RdmaConfig::default();
    c.devices = vec!["fakeslow".into()];
    c.qps_per_path = 1;
    c.max_outstanding = 1;
    c.signal_every = 1;
    node(c).expect("an rdma backend on the fake")
}

/// A target on fake0 with a remotely writable region of 8 slices, an initiator that
/// posts one slow work request at a time with an 8-slice source, connected.
struct SlowPair {
    target: Node,
    initiator: Node,
    dst: Vec<u8>,
    src: Vec<u8>,
    peer: PeerId,
}

const SLICE: usize = 64 << 10;

fn slow_pair() -> Result<SlowPair, Failed> {
    let target = backend(&["fake0"]);
    let dst = vec![0u8; 8 * SLICE];
    let key = target.register(RegionId(1), &host(&dst, Access::REMOTE_READ_WRITE))?;
    let initiator = one_at_a_time();
    let src = pattern(8 * SLICE, 4);
    initiator.register(RegionId(1), &host(&src, Access::LOCAL))?;
    let peer = initiator.connect(&segment(&target, vec![region(1, &dst, key)]), soon())?;
    Ok(SlowPair {
        target,
        initiator,
        dst,
        src,
        peer,
    })
}

fn disconnect_moves_the_qps_to_error_and_waits_for_their_flushes() -> Result<(), Failed> {
    let fake = Fake::open();
    let p = pair()?;
    // Every work request waits 100 ms, so a batch is in flight at the disconnect.
    let (tx, rx) = mpsc::channel();
    for d in ["fake0", "fake1"] {
        type F = unsafe extern "C" fn(*const c_char, u64, u32) -> c_int;
        let c = CString::new(d).expect("a name");
        // SAFETY: the fake's function of this signature.
        unsafe {
            std::mem::transmute::<*mut c_void, F>(fake.sym("fakeverbs_delay_device"))(
                c.as_ptr(),
                100_000,
                64,
            )
        };
    }
    let done = Completion::new(Duration::from_secs(5), move |r, _| {
        let _ = tx.send(r);
    });
    p.initiator.submit(p.peer, &[write_all(&p)], done)?;
    std::thread::sleep(Duration::from_millis(50));
    let start = Instant::now();
    p.initiator.disconnect(p.peer, soon())?;
    // When disconnect returns, every work request has been flushed and accounted for.
    check(
        fake.outstanding() == 0,
        format!(
            "{} work requests still outstanding after disconnect",
            fake.outstanding()
        ),
    )?;
    let r = rx.recv_timeout(Duration::from_secs(1))?;
    check(
        matches!(&r, Err(e) if e.kind() == ErrorKind::PeerUnreachable),
        format!("the batch: {r:?}"),
    )?;
    check(
        start.elapsed() < Duration::from_secs(2),
        format!("disconnect took {:?}", start.elapsed()),
    )?;
    for d in ["fake0", "fake1"] {
        // What is left of the delays must not slow the next tests.
        type F = unsafe extern "C" fn(*const c_char) -> c_int;
        let c = CString::new(d).expect("a name");
        // SAFETY: as above.
        unsafe {
            std::mem::transmute::<*mut c_void, F>(fake.sym("fakeverbs_clear_faults"))(c.as_ptr())
        };
    }
    drop(p.target);
    Ok(())
}

fn an_aborted_batch_posts_none_of_its_waiting_slices_and_is_released_once_its_posted_ones_are_back(
) -> Result<(), Failed> {
    let fake = Fake::open();
    let p = slow_pair()?;
    let (tx, rx) = mpsc::channel();
    let outstanding: unsafe extern "C" fn() -> u64 =
        // SAFETY: the fake's function of this signature.
        unsafe { std::mem::transmute(fake.sym("fakeverbs_outstanding")) };
    let start = Instant::now();
    let (done, aborter) = Completion::abortable(soon(), move |r, _| {
        // SAFETY: a plain counter read.
        let left = unsafe { outstanding() };
        let _ = tx.send((r, left, start.elapsed()));
    });
    let batch = done.batch();
    let req = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, p.src.len() as u64);
    p.initiator.submit(p.peer, &[req], done)?;
    // 8 slices one after another take 1.6 s; abort while the second is posted.
    std::thread::sleep(Duration::from_millis(300));
    aborter.abort();
    p.initiator.abort(p.peer, batch);
    // When the abort actually happened: a loaded machine may oversleep.
    let aborted = start.elapsed();
    let (r, left, took) = rx.recv_timeout(Duration::from_secs(5))?;
    check(
        matches!(&r, Err(e) if e.kind() == ErrorKind::Cancelled),
        format!("the aborted batch: {r:?}"),
    )?;
    check(
        left == 0,
        format!("the batch was released with {left} work requests outstanding"),
    )?;
    check(
        took < aborted + Duration::from_millis(700),
        format!("released after {took:?} (aborted at {aborted:?}): its waiting slices were posted"),
    )?;
    // Long enough for every slice to have landed, had any been posted after the abort.
    std::thread::sleep(Duration::from_millis(1600));
    let landed = p
        .dst
        .chunks(SLICE)
        .zip(p.src.chunks(SLICE))
        .filter(|(d, s)| d == s)
        .count();
    let untouched = p
        .dst
        .chunks(SLICE)
        .filter(|d| d.iter().all(|&b| b == 0))
        .count();
    // At most the slices posted by the abort, one per 200 ms, and one more of margin;
    // never all 8, or the check could not fail (an abort that late proves nothing, and
    // fails here rather than passing).
    let most = ((aborted.as_millis() / 200) as usize + 2).min(7);
    check(
        landed + untouched == 8 && (1..=most).contains(&landed),
        format!(
            "{landed} slices landed and {untouched} are untouched, of 8 (aborted at {aborted:?})"
        ),
    )?;
    drop(p.target);
    Ok(())
}

fn deregister_times_out_while_a_slice_pins_the_region_and_its_ok_means_the_keys_are_gone(
) -> Result<(), Failed> {
    let fake = Fake::open();
    let p = slow_pair()?;
    let addr = p.src.as_ptr() as u64;
    let (tx, rx) = mpsc::channel();
    let done = Completion::new(Duration::from_secs(5), move |r, _| {
        let _ = tx.send(r);
    });
    let req = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, p.src.len() as u64);
    p.initiator.submit(p.peer, &[req], done)?;
    std::thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    let r = p
        .initiator
        .deregister(RegionId(1), Deadline::after(Duration::from_millis(200)));
    let took = start.elapsed();
    check(
        matches!(&r, Err(e) if e.kind() == ErrorKind::Timeout),
        format!("deregister with slices in flight: {r:?}"),
    )?;
    check(
        took >= Duration::from_millis(150) && took < Duration::from_millis(1000),
        format!("deregister returned after {took:?}, not at its deadline"),
    )?;
    check(
        fake.mr_key("fakeslow", addr) != 0,
        "the MR went while work requests still used it".into(),
    )?;
    // The region is out of the table: a new batch on it is refused.
    let r = run(&p.initiator, p.peer, &[req], &fake).0;
    check(
        matches!(&r, Err(e) if e.kind() == ErrorKind::NotRegistered),
        format!("a batch on a region being deregistered: {r:?}"),
    )?;
    // The batch in flight is not the backend's to stop (the engine aborts it): it lands.
    rx.recv_timeout(Duration::from_secs(5))??;
    check(p.dst == p.src, "the batch in flight did not land".into())?;
    p.initiator.deregister(RegionId(1), soon())?;
    check(
        fake.mr_key("fakeslow", addr) == 0,
        "deregister returned Ok with the region's MR still registered".into(),
    )?;
    let r = p.initiator.deregister(RegionId(1), soon());
    check(
        matches!(&r, Err(e) if e.kind() == ErrorKind::NotRegistered),
        format!("a second deregister: {r:?}"),
    )?;
    drop(p.target);
    Ok(())
}

fn a_batchs_regions_are_unpinned_by_the_time_its_completion_runs() -> Result<(), Failed> {
    let p = pair()?;
    let initiator = std::sync::Arc::new(p.initiator);
    let (tx, rx) = mpsc::channel();
    let b = initiator.clone();
    // On the completion thread, before anything after the completion runs there: a
    // deregistration with no time to wait finds no slice pinning the region.
    let done = Completion::new(Duration::from_secs(5), move |r, _| {
        let dereg = b.deregister(RegionId(1), Deadline::after(Duration::ZERO));
        let _ = tx.send((r, dereg));
    });
    let req = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, p.src.len() as u64);
    initiator.submit(p.peer, &[req], done)?;
    let (r, dereg) = rx.recv_timeout(Duration::from_secs(5))?;
    r?;
    check(
        dereg.is_ok(),
        format!("deregister from the batch's completion: {dereg:?}"),
    )?;
    drop(p.target);
    Ok(())
}

fn a_backend_dropped_with_regions_registered_deregisters_them_before_closing_its_devices(
) -> Result<(), Failed> {
    let fake = Fake::open();
    let before = fake.busy_pds();
    let b = backend(&["fake0", "fake1"]);
    let buf = vec![0u8; 8192];
    b.register(RegionId(1), &host(&buf, Access::REMOTE_READ_WRITE))?;
    drop(b);
    check(
        fake.busy_pds() == before,
        "the devices were closed with memory regions still registered in them".into(),
    )?;
    check(
        fake.mr_key("fake0", buf.as_ptr() as u64) == 0,
        "the region's MR outlived the backend".into(),
    )
}

fn an_idle_connected_pair_wakes_no_thread() -> Result<(), Failed> {
    let fake = Fake::open();
    let p = pair()?;
    let (r, _, _) = run(&p.initiator, p.peer, &[write_all(&p)], &fake);
    r?;
    // What the batch set going settles; then the completion threads, the control
    // plane and the fake's device threads must all sleep.
    std::thread::sleep(Duration::from_millis(300));
    let me = std::process::id();
    let before = te_core::testkit::context_switches(me);
    std::thread::sleep(Duration::from_secs(2));
    let n = te_core::testkit::context_switches(me) - before;
    // A thread polling even every 100 ms makes 20 or more, each backend's repair
    // thread on a 1 s timer 2; this one's sleep makes one (3 leaves room for one more).
    check(
        n <= 3,
        format!("{n} context switches in 2 s of idle (a thread polls)"),
    )
}

/// A TCP relay to a control plane, for one connection, that the test can freeze: it
/// then passes nothing on, and keeps the connection open (a peer that hangs).
struct FrozenRelay {
    address: String,
    frozen: std::sync::Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
}

impl FrozenRelay {
    fn to(to: std::net::SocketAddr) -> Result<FrozenRelay, Failed> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let address = listener.local_addr()?.to_string();
        let frozen = std::sync::Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let f = frozen.clone();
        std::thread::spawn(move || {
            let Ok((a, _)) = listener.accept() else {
                return;
            };
            let Ok(b) = std::net::TcpStream::connect(to) else {
                return;
            };
            let (a2, b2) = (a.try_clone().expect("clone"), b.try_clone().expect("clone"));
            let g = f.clone();
            std::thread::spawn(move || FrozenRelay::pipe(a, b2, &g));
            FrozenRelay::pipe(b, a2, &f);
        });
        Ok(FrozenRelay { address, frozen })
    }

    /// Copies `from` into `to`, holding what it read while the relay is frozen.
    fn pipe(
        mut from: std::net::TcpStream,
        mut to: std::net::TcpStream,
        frozen: &(std::sync::Mutex<bool>, std::sync::Condvar),
    ) {
        use std::io::{Read, Write};
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let mut held = frozen.0.lock().unwrap_or_else(|e| e.into_inner());
            while *held {
                held = frozen.1.wait(held).unwrap_or_else(|e| e.into_inner());
            }
            drop(held);
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Both);
        let _ = from.shutdown(std::net::Shutdown::Both);
    }

    fn freeze(&self, frozen: bool) {
        *self.frozen.0.lock().unwrap_or_else(|e| e.into_inner()) = frozen;
        self.frozen.1.notify_all();
    }
}

/// A backend that closes while its peer's control plane hangs waits for it no longer
/// than its configuration says (`connect_timeout`, for the QPs' flushes and again for
/// telling the target), not a fixed time of its own.
fn a_backend_closing_while_its_peer_hangs_waits_at_most_connect_timeout_for_it(
) -> Result<(), Failed> {
    let target = backend(&["fake0"]);
    let relay = FrozenRelay::to(target.control.address())?;
    let mut c = RdmaConfig::default();
    c.devices = vec!["fake1".into()];
    c.qps_per_path = 1;
    c.connect_timeout = Duration::from_millis(100);
    let initiator = node(c)?;
    let seg = common::segment_at(target.endpoint(), relay.address.clone(), Vec::new());
    initiator.connect(&seg, soon())?;
    relay.freeze(true);
    let Node { backend, control } = initiator;
    let start = Instant::now();
    drop(backend);
    let took = start.elapsed();
    relay.freeze(false);
    drop(control);
    check(
        took < Duration::from_millis(700),
        format!(
            "with connect_timeout = 100 ms, the backend took {took:?} to close while its peer hung"
        ),
    )
}

fn main() {
    common::use_the_fake();
    common::run_tests(vec![
        (
            "disconnect_moves_the_qps_to_error_and_waits_for_their_flushes",
            disconnect_moves_the_qps_to_error_and_waits_for_their_flushes,
        ),
        (
            "an_aborted_batch_posts_none_of_its_waiting_slices_and_is_released_once_its_posted_ones_are_back",
            an_aborted_batch_posts_none_of_its_waiting_slices_and_is_released_once_its_posted_ones_are_back,
        ),
        (
            "deregister_times_out_while_a_slice_pins_the_region_and_its_ok_means_the_keys_are_gone",
            deregister_times_out_while_a_slice_pins_the_region_and_its_ok_means_the_keys_are_gone,
        ),
        (
            "a_batchs_regions_are_unpinned_by_the_time_its_completion_runs",
            a_batchs_regions_are_unpinned_by_the_time_its_completion_runs,
        ),
        (
            "a_backend_dropped_with_regions_registered_deregisters_them_before_closing_its_devices",
            a_backend_dropped_with_regions_registered_deregisters_them_before_closing_its_devices,
        ),
        (
            "an_idle_connected_pair_wakes_no_thread",
            an_idle_connected_pair_wakes_no_thread,
        ),
        (
            "a_backend_closing_while_its_peer_hangs_waits_at_most_connect_timeout_for_it",
            a_backend_closing_while_its_peer_hangs_waits_at_most_connect_timeout_for_it,
        ),
    ]);
}
