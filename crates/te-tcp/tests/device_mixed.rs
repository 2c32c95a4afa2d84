//! Device memory on fakedev through te-tcp's staged path and in-process copies, mixed
//! with host memory, under concurrency and injected copy failures: every byte checked,
//! each failure confined to its batch, staging back to zero. fakedev's settings hold
//! for the whole process, so these tests run one at a time.

mod common;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::{connect, host, pattern, soon};
use te_core::device::fakedev::FakeDev;
use te_core::{Access, ErrorKind, Op, PeerId, RegionId, TransferBackend, TransferRequest};
use te_tcp::{TcpBackend, TcpConfig};

/// Device memory of fakedev, freed on drop; its reads retry copies that an injected
/// failure hit (the failures are for te's copies, not the test's).
struct Dm {
    rt: Arc<dyn te_core::device::DeviceRuntime>,
    ordinal: u32,
    addr: u64,
    len: usize,
}

impl Dm {
    fn new(ordinal: u32, len: usize) -> Dm {
        let rt = te_core::device::runtime(te_core::device::fakedev::NAME).expect("fakedev");
        let addr = rt.alloc(ordinal, len).expect("alloc");
        Dm {
            rt,
            ordinal,
            addr,
            len,
        }
    }

    fn register(&self, b: &TcpBackend, id: u64, access: Access) {
        let mem = te_core::MemoryDesc {
            name: "d".into(),
            addr: self.addr,
            len: self.len as u64,
            kind: te_core::MemoryKind::Device {
                runtime: te_core::device::fakedev::NAME.into(),
                ordinal: self.ordinal,
            },
            access,
        };
        b.register(RegionId(id), &mem).expect("register");
    }

    fn copy(&self, c: te_core::device::DeviceCopy) {
        for _ in 0..100 {
            // SAFETY: the host range outlives the synchronous copy; the device range
            // is inside the allocation.
            match unsafe { self.rt.copy_sync(c) } {
                Ok(()) => return,
                Err(e) if e.to_string().contains("injected") => continue,
                Err(e) => panic!("copy: {e}"),
            }
        }
        panic!("a test copy failed 100 times");
    }

    fn fill(&self, v: &[u8]) {
        self.copy(te_core::device::DeviceCopy::ToDevice {
            ordinal: self.ordinal,
            device: self.addr,
            host: v.as_ptr(),
            len: v.len().min(self.len),
        });
    }

    fn read(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        self.copy(te_core::device::DeviceCopy::ToHost {
            ordinal: self.ordinal,
            device: self.addr,
            host: v.as_mut_ptr(),
            len: self.len,
        });
        v
    }
}

impl Drop for Dm {
    fn drop(&mut self) {
        let _ = self.rt.free(self.ordinal, self.addr);
    }
}

static SERIAL: Mutex<()> = Mutex::new(());

fn serial(launch: Duration) -> (MutexGuard<'static, ()>, Arc<FakeDev>) {
    let g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    common::fakedev_costs(launch, Duration::ZERO);
    let _ = te_core::device::runtime(te_core::device::fakedev::NAME).expect("fakedev");
    let dev = te_core::device::fakedev::process().expect("fakedev runs here");
    (g, dev)
}

fn backend_with(set: impl FnOnce(&mut TcpConfig)) -> TcpBackend {
    common::backend_with(|c| {
        c.local_copies = false;
        c.local_ipc = false;
        set(c);
    })
}

fn in_use(b: &TcpBackend) -> u64 {
    b.gauges()
        .into_iter()
        .find(|(n, _)| n == "staging_bytes_in_use")
        .expect("staging gauge")
        .1
}

fn staging_settles(b: &TcpBackend) -> u64 {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let n = in_use(b);
        if n == 0 || Instant::now() >= end {
            return n;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn run(b: &TcpBackend, peer: PeerId, reqs: &[TransferRequest]) -> te_core::Result<()> {
    te_core::testkit::run_batch(b, peer, reqs, Duration::from_secs(30))
}

const LANE: u64 = 1 << 20;
const LANES: u64 = 4;

/// Requests of lane `lane` (its own bytes of every region): scattered small blocks and
/// a few larger ones, local region `local` (1 = device, 2 = host) to remote region
/// `remote` (1 = device:1, 2 = host), all at the same offsets.
fn lane_requests(op: Op, lane: u64, round: u64) -> Vec<TransferRequest> {
    let mut v = Vec::new();
    let base = lane * LANE;
    let mut at = 0u64;
    let mut i = 0u64;
    while at < LANE {
        let len = match (i + round) % 5 {
            0 => 4096,
            1 => 1000,
            2 => 96 << 10,
            3 => 4096 + 64,
            _ => 33 << 10,
        };
        let len = len.min(LANE - at);
        let local = 1 + (i + round) % 2;
        let remote = 1 + (i / 2 + round) % 2;
        v.push(TransferRequest {
            op,
            local: RegionId(local),
            local_offset: base + at,
            remote: RegionId(remote),
            remote_offset: base + at,
            len,
        });
        at += len;
        i += 1;
    }
    // Scatter their order, so frames gather pieces from all over.
    let n = v.len();
    (0..n).map(|k| v[(k * 7) % n]).collect()
}

/// Mixed host and device memory on both sides, both ops, several threads at once on
/// two connections: every byte lands where it belongs.
#[test]
fn concurrent_mixed_device_and_host_batches_of_both_ops_move_every_byte() {
    let (_g, _dev) = serial(Duration::ZERO);
    let total = (LANE * LANES) as usize;
    let target = backend_with(|c| c.connections_per_peer = 2);
    let init = backend_with(|c| c.connections_per_peer = 2);
    let rdev = Dm::new(1, total);
    rdev.register(&target, 1, Access::REMOTE_READ_WRITE);
    let mut rhost = vec![0u8; total];
    host(&target, 2, &mut rhost, Access::REMOTE_READ_WRITE);
    let ldev = Dm::new(0, total);
    ldev.register(&init, 1, Access::LOCAL);
    let mut lhost = vec![0u8; total];
    host(&init, 2, &mut lhost, Access::LOCAL);
    let peer = connect(&init, &target);

    for round in 0..3u64 {
        let data_dev = pattern(total, 10 + round as u8);
        let data_host = pattern(total, 50 + round as u8);
        ldev.fill(&data_dev);
        // SAFETY-free: lhost is registered, nothing moves it now.
        lhost.copy_from_slice(&data_host);
        std::thread::scope(|s| {
            for lane in 0..LANES {
                let init = &init;
                s.spawn(move || {
                    run(init, peer, &lane_requests(Op::Write, lane, round)).expect("write");
                });
            }
        });
        // Every remote byte comes from the local region its request named.
        let rd = rdev.read();
        for lane in 0..LANES {
            for r in lane_requests(Op::Write, lane, round) {
                let src: &[u8] = if r.local == RegionId(1) {
                    &data_dev
                } else {
                    &data_host
                };
                let dst: &[u8] = if r.remote == RegionId(1) { &rd } else { &rhost };
                let (o, n) = (r.local_offset as usize, r.len as usize);
                assert!(
                    dst[o..o + n] == src[o..o + n],
                    "round {round}: write at {o}+{n} local {:?} remote {:?}",
                    r.local,
                    r.remote
                );
            }
        }
        // Read it all back into cleared local memory.
        ldev.fill(&vec![0u8; total]);
        lhost.fill(0);
        std::thread::scope(|s| {
            for lane in 0..LANES {
                let init = &init;
                s.spawn(move || {
                    run(init, peer, &lane_requests(Op::Read, lane, round + 1)).expect("read");
                });
            }
        });
        let ld = ldev.read();
        for lane in 0..LANES {
            for r in lane_requests(Op::Read, lane, round + 1) {
                let src: &[u8] = if r.remote == RegionId(1) { &rd } else { &rhost };
                let dst: &[u8] = if r.local == RegionId(1) { &ld } else { &lhost };
                let (o, n) = (r.local_offset as usize, r.len as usize);
                assert!(
                    dst[o..o + n] == src[o..o + n],
                    "round {round}: read at {o}+{n} local {:?} remote {:?}",
                    r.local,
                    r.remote
                );
            }
        }
    }
    assert_eq!(staging_settles(&init), 0);
    assert_eq!(staging_settles(&target), 0);
    common::deregister(&init, &[1, 2]);
    common::deregister(&target, &[1, 2]);
    let _ = soon();
    let _ = ErrorKind::Backend;
}

/// Copy groups fail at random on both devices while mixed batches of both ops run on
/// several threads: each batch either succeeds with every byte in place or fails with
/// the injected error; staging comes back to zero on both sides, and a clean batch
/// afterwards goes through.
#[test]
fn injected_copy_failures_under_concurrency_fail_only_their_batches() {
    let (_g, dev) = serial(Duration::ZERO);
    let total = (LANE * LANES) as usize;
    let target = backend_with(|c| c.connections_per_peer = 2);
    let init = backend_with(|c| c.connections_per_peer = 2);
    let rdev = Dm::new(1, total);
    rdev.register(&target, 1, Access::REMOTE_READ_WRITE);
    let mut rhost = vec![0u8; total];
    host(&target, 2, &mut rhost, Access::REMOTE_READ_WRITE);
    let ldev = Dm::new(0, total);
    ldev.register(&init, 1, Access::LOCAL);
    let mut lhost = vec![0u8; total];
    host(&init, 2, &mut lhost, Access::LOCAL);
    let peer = connect(&init, &target);
    let data_dev = pattern(total, 21);
    let data_host = pattern(total, 77);
    ldev.fill(&data_dev);
    lhost.copy_from_slice(&data_host);
    let rhost_addr = rhost.as_ptr() as usize;
    let lhost_addr = lhost.as_ptr() as usize;
    let stop = std::sync::atomic::AtomicBool::new(false);
    let failed = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        let (dev, stop) = (&dev, &stop);
        s.spawn(move || {
            let mut k = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                dev.fail_next(k % 2, 1);
                k += 1;
                std::thread::sleep(Duration::from_millis(3));
            }
        });
        let mut lanes = Vec::new();
        for lane in 0..LANES {
            let (init, rdev, ldev, failed) = (&init, &rdev, &ldev, &failed);
            lanes.push(s.spawn(move || {
                for round in 0..6u64 {
                    let w = lane_requests(Op::Write, lane, round);
                    // What the lane's local bytes hold now (earlier reads changed them).
                    let now_dev = ldev.read();
                    // SAFETY: the lane's bytes are changed by its own batches only.
                    let now_host =
                        unsafe { std::slice::from_raw_parts(lhost_addr as *const u8, total) }
                            .to_vec();
                    let (data_dev, data_host) = (&now_dev, &now_host);
                    match run(init, peer, &w) {
                        Ok(()) => {
                            let rd = rdev.read();
                            for r in &w {
                                let (o, n) = (r.local_offset as usize, r.len as usize);
                                let src: &[u8] = if r.local == RegionId(1) {
                                    data_dev
                                } else {
                                    data_host
                                };
                                // SAFETY: the lane's bytes of the host region are
                                // written by this lane's batches only, all ended.
                                let rh = unsafe {
                                    std::slice::from_raw_parts(rhost_addr as *const u8, total)
                                };
                                let dst: &[u8] = if r.remote == RegionId(1) { &rd } else { rh };
                                assert!(
                                    dst[o..o + n] == src[o..o + n],
                                    "lane {lane} round {round}: a successful write at {o}+{n} \
                                     ({:?} -> {:?}) did not land",
                                    r.local,
                                    r.remote
                                );
                            }
                        }
                        Err(e) => {
                            failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            assert_eq!(e.kind(), ErrorKind::Backend, "{e}");
                            assert!(e.to_string().contains("injected"), "{e}");
                        }
                    }
                    // Read the remote lane back into the host region only where it was
                    // host memory: the device-local reads check the device region.
                    let rq = lane_requests(Op::Read, lane, round);
                    let before_dev = ldev.read();
                    match run(init, peer, &rq) {
                        Ok(()) => {
                            let rd = rdev.read();
                            let ld = ldev.read();
                            // SAFETY: as above.
                            let rh = unsafe {
                                std::slice::from_raw_parts(rhost_addr as *const u8, total)
                            };
                            let lh = unsafe {
                                std::slice::from_raw_parts(lhost_addr as *const u8, total)
                            };
                            for r in &rq {
                                let (o, n) = (r.local_offset as usize, r.len as usize);
                                let src: &[u8] = if r.remote == RegionId(1) { &rd } else { rh };
                                let dst: &[u8] = if r.local == RegionId(1) { &ld } else { lh };
                                assert!(
                                    dst[o..o + n] == src[o..o + n],
                                    "lane {lane} round {round}: a successful read at {o}+{n} \
                                     ({:?} <- {:?}) is wrong",
                                    r.local,
                                    r.remote
                                );
                            }
                            let _ = before_dev;
                        }
                        Err(e) => {
                            failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            assert_eq!(e.kind(), ErrorKind::Backend, "{e}");
                            assert!(e.to_string().contains("injected"), "{e}");
                        }
                    }
                    // Restore the lane's local sources for the next round.
                    let _ = ldev;
                }
            }));
        }
        for l in lanes {
            if let Err(p) = l.join() {
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                std::panic::resume_unwind(p);
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    // Clear what is still armed.
    let clean = lane_requests(Op::Write, 0, 0);
    let mut tries = 0;
    while run(&init, peer, &clean).is_err() {
        tries += 1;
        assert!(tries < 20, "a clean batch never went through");
    }
    eprintln!(
        "failed batches: {}",
        failed.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert_eq!(staging_settles(&init), 0, "initiator staging in use");
    assert_eq!(staging_settles(&target), 0, "target staging in use");
    common::deregister(&init, &[1, 2]);
    common::deregister(&target, &[1, 2]);
}

/// A peer in this process with `local_copies`: a batch mixing host memory, device 0 and
/// device 1 on both sides, both ops, some frames device-to-device and some over the
/// socket: every byte lands.
#[test]
fn local_copies_mixed_with_socket_frames_move_every_byte() {
    let (_g, dev) = serial(Duration::ZERO);
    let total = (LANE * LANES) as usize;
    let mk = || {
        common::backend_with(|c| {
            c.local_copies = true;
            c.local_ipc = false;
            c.connections_per_peer = 2;
        })
    };
    let (target, init) = (mk(), mk());
    // Target: region 1 on device 0 (same as the initiator's: device copies), region 2
    // host, region 3 on device 1 (staged).
    let r0 = Dm::new(0, total);
    r0.register(&target, 1, Access::REMOTE_READ_WRITE);
    let mut rh = vec![0u8; total];
    host(&target, 2, &mut rh, Access::REMOTE_READ_WRITE);
    let r1 = Dm::new(1, total);
    r1.register(&target, 3, Access::REMOTE_READ_WRITE);
    let l0 = Dm::new(0, total);
    l0.register(&init, 1, Access::LOCAL);
    let mut lh = vec![0u8; total];
    host(&init, 2, &mut lh, Access::LOCAL);
    let peer = connect(&init, &target);
    let before = dev.syncs();
    for round in 0..4u64 {
        let d = pattern(total, 30 + round as u8);
        let h = pattern(total, 90 + round as u8);
        l0.fill(&d);
        lh.copy_from_slice(&h);
        let mut w = lane_requests(Op::Write, 0, round);
        for (k, r) in w.iter_mut().enumerate() {
            if k % 3 == 0 {
                r.remote = RegionId(3);
            }
        }
        run(&init, peer, &w).expect("mixed write");
        let (a, b) = (r0.read(), r1.read());
        for r in &w {
            let (o, n) = (r.local_offset as usize, r.len as usize);
            let src: &[u8] = if r.local == RegionId(1) { &d } else { &h };
            let dst: &[u8] = match r.remote.0 {
                1 => &a,
                2 => &rh,
                _ => &b,
            };
            assert!(
                dst[o..o + n] == src[o..o + n],
                "round {round}: write {:?}->{:?} at {o}+{n}",
                r.local,
                r.remote
            );
        }
        l0.fill(&vec![0u8; total]);
        lh.fill(0);
        let mut rq = lane_requests(Op::Read, 0, round + 1);
        for (k, r) in rq.iter_mut().enumerate() {
            if k % 3 == 1 {
                r.remote = RegionId(3);
            }
        }
        run(&init, peer, &rq).expect("mixed read");
        let ld = l0.read();
        for r in &rq {
            let (o, n) = (r.local_offset as usize, r.len as usize);
            let src: &[u8] = match r.remote.0 {
                1 => &a,
                2 => &rh,
                _ => &b,
            };
            let dst: &[u8] = if r.local == RegionId(1) { &ld } else { &lh };
            assert!(
                dst[o..o + n] == src[o..o + n],
                "round {round}: read {:?}<-{:?} at {o}+{n}",
                r.local,
                r.remote
            );
        }
    }
    assert!(dev.syncs() > before);
    assert_eq!(staging_settles(&init), 0);
    assert_eq!(staging_settles(&target), 0);
    common::deregister(&init, &[1, 2]);
    common::deregister(&target, &[1, 2, 3]);
}

fn gauge(b: &TcpBackend, name: &str) -> u64 {
    b.gauges()
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|g| g.1)
        .unwrap_or(0)
}

/// A flood of small and large device batches of both ops submitted without waiting, on
/// one connection: every one completes, every byte lands, and the pinned staging stays
/// within the two rings of the connection.
#[test]
fn a_flood_of_device_batches_completes_within_bounded_staging() {
    let (_g, _dev) = serial(Duration::ZERO);
    let total = 8usize << 20;
    let target = backend_with(|c| c.connections_per_peer = 1);
    let init = backend_with(|c| c.connections_per_peer = 1);
    let rdev = Dm::new(1, total);
    rdev.register(&target, 1, Access::REMOTE_READ_WRITE);
    let src = Dm::new(0, total);
    src.register(&init, 1, Access::LOCAL);
    let back = Dm::new(0, total);
    back.register(&init, 2, Access::LOCAL);
    let data = pattern(total, 5);
    src.fill(&data);
    let peer = connect(&init, &target);
    let (tx, rx) = std::sync::mpsc::channel();
    let mut n = 0;
    let mut most = 0;
    // Writes: 4 KiB blocks one per batch, then 128 KiB ones.
    let mut at = 0u64;
    while at < total as u64 {
        let len = if at < (total as u64) / 2 {
            4096
        } else {
            128 << 10
        };
        let tx = tx.clone();
        let c = te_core::Completion::new(Duration::from_secs(60), move |r, _| {
            let _ = tx.send(r);
        });
        let r = TransferRequest {
            op: Op::Write,
            local: RegionId(1),
            local_offset: at,
            remote: RegionId(1),
            remote_offset: total as u64 - at - len,
            len,
        };
        init.submit(peer, &[r], c).expect("submit");
        n += 1;
        at += len;
        most = most.max(gauge(&init, "staging_bytes_pinned"));
    }
    for i in 0..n {
        rx.recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("write batch {i} of {n} completed"))
            .expect("write");
    }
    let landed = rdev.read();
    let mut at = 0usize;
    while at < total {
        let len = if at < total / 2 { 4096 } else { 128 << 10 };
        let to = total - at - len;
        assert!(landed[to..to + len] == data[at..at + len], "write at {at}");
        at += len;
    }
    // Reads: the same shapes back, in another order.
    let mut n = 0;
    let mut at = 0u64;
    while at < total as u64 {
        let len = if at < (total as u64) / 2 {
            4096
        } else {
            128 << 10
        };
        let tx = tx.clone();
        let c = te_core::Completion::new(Duration::from_secs(60), move |r, _| {
            let _ = tx.send(r);
        });
        let r = TransferRequest {
            op: Op::Read,
            local: RegionId(2),
            local_offset: at,
            remote: RegionId(1),
            remote_offset: total as u64 - at - len,
            len,
        };
        init.submit(peer, &[r], c).expect("submit");
        n += 1;
        at += len;
        most = most.max(gauge(&init, "staging_bytes_pinned"));
    }
    for i in 0..n {
        rx.recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("read batch {i} of {n} completed"))
            .expect("read");
    }
    assert!(back.read() == data, "read back intact");
    assert!(most <= 2 * (4 << 20), "pinned staging {most}");
    assert_eq!(staging_settles(&init), 0);
    assert_eq!(staging_settles(&target), 0);
    common::deregister(&init, &[1, 2]);
    common::deregister(&target, &[1]);
}
