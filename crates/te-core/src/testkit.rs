//! The conformance suite: te's contract, as tests any backend runs.
//!
//! Each test is named as a sentence of the contract and selected by the backend's
//! capabilities. A backend's test target (with `harness = false`) runs it:
//!
//! ```ignore
//! use te_core::testkit::{self, Harness};
//! fn main() {
//!     let h = Harness::new("stub", config).with_slow(slow_config);
//!     testkit::run(testkit::trials(&h));
//! }
//! ```
//!
//! `slow` is a configuration of the same backend whose batches take about 200 ms (the
//! stub's `delay`); tests about deadlines, waiting and shutdown with work in flight need
//! it and are skipped, with the reason in their name, without it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Failed, Trial};

use crate::{
    Access, Buffer, Completion, Config, Engine, ErrorKind, MemoryDesc, MemoryKind, Peer,
    RegionDesc, RegionId, Registry, SegmentDesc, TransferOptions, TransferRequest, TransferStatus,
};

/// How the suite makes engines of the backend under test.
#[derive(Debug, Clone)]
pub struct Harness {
    label: String,
    config: Config,
    slow: Option<Config>,
    memory: (MemoryKind, MemoryKind),
}

impl Harness {
    /// A harness whose engines come from `config`.
    pub fn new(label: &str, config: Config) -> Harness {
        Harness {
            label: label.to_string(),
            config,
            slow: None,
            memory: (MemoryKind::Host, MemoryKind::Host),
        }
    }

    /// Puts the initiator's buffers in `initiator` memory and the target's in `target`
    /// memory (`host`, `fakedev:0`, `cuda:0`, …) instead of host memory.
    pub fn with_memory(mut self, initiator: MemoryKind, target: MemoryKind) -> Harness {
        self.memory = (initiator, target);
        self
    }

    /// Adds a configuration whose batches take about 200 ms.
    pub fn with_slow(mut self, slow: Config) -> Harness {
        self.slow = Some(slow);
        self
    }

    fn engine(&self, config: &Config, name: &str) -> Result<Engine, Failed> {
        let mut c = config.clone();
        c.engine.name = format!("{}-{name}", self.label);
        Engine::from_config(&c).map_err(|e| fail(format!("cannot create engine: {e}")))
    }

    /// A target with a remotely readable and writable buffer, an initiator with a local
    /// buffer, and the initiator's peer for the target.
    fn pair(&self, config: &Config, len: usize) -> Result<Pair, Failed> {
        let target = self.engine(config, "target")?;
        let initiator = self.engine(config, "initiator")?;
        let remote = target
            .alloc("dst", len, Access::REMOTE_READ_WRITE)
            .map_err(e2f)?;
        let local = initiator.alloc("src", len, Access::LOCAL).map_err(e2f)?;
        let peer = initiator
            .connect(&target.address().to_string())
            .map_err(e2f)?;
        let remote_desc = peer
            .region("dst")
            .ok_or_else(|| fail("the target's region is not in its descriptor"))?;
        Ok(Pair {
            remote_desc,
            peer,
            local,
            remote,
            initiator,
            target,
        })
    }
}

/// Field order matters: buffers deregister before their engines go.
struct Pair {
    remote_desc: RegionDesc,
    peer: Peer,
    local: Buffer,
    remote: Buffer,
    initiator: Engine,
    target: Engine,
}

fn fail(m: impl Into<String>) -> Failed {
    Failed::from(m.into())
}

fn e2f(e: crate::Error) -> Failed {
    fail(e.to_string())
}

macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(fail(format!($($msg)+)));
        }
    };
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn expect_kind(
    r: crate::Result<impl std::fmt::Debug>,
    kind: ErrorKind,
    what: &str,
) -> Result<(), Failed> {
    match r {
        Err(e) if e.kind() == kind => Ok(()),
        Err(e) => Err(fail(format!("{what}: expected {kind}, got {:?}", e))),
        Ok(v) => Err(fail(format!("{what}: expected {kind}, got Ok({v:?})"))),
    }
}

type Test = fn(&Harness) -> Result<(), Failed>;

/// Every contract test that applies to the harness's backend.
pub fn trials(h: &Harness) -> Vec<Trial> {
    let caps = match Registry::discover(&h.config.engine.plugin_dirs)
        .get(&h.config.engine.backend)
        .and_then(|e| e.create(&h.config.backend_context(&h.config.engine.backend)))
    {
        Ok(b) => b.info().capabilities.clone(),
        Err(e) => {
            let msg = e.to_string();
            return vec![Trial::test(
                format!("{}::backend_can_be_created", h.label),
                move || Err(fail(msg)),
            )];
        }
    };
    let mut tests: Vec<(&str, Test, bool)> = vec![
        ("an_empty_batch_completes", an_empty_batch_completes, true),
        (
            "completion_is_delivered_exactly_once",
            completion_is_delivered_exactly_once,
            true,
        ),
        (
            "out_of_bounds_requests_are_refused_before_posting",
            out_of_bounds_requests_are_refused_before_posting,
            true,
        ),
        (
            "unknown_region_requests_are_refused_before_posting",
            unknown_region_requests_are_refused_before_posting,
            true,
        ),
        (
            "zero_length_requests_are_refused",
            zero_length_requests_are_refused,
            true,
        ),
        (
            "deregistered_regions_are_refused",
            deregistered_regions_are_refused,
            caps.write,
        ),
        (
            "write_then_read_back_gives_the_same_bytes",
            write_then_read_back_gives_the_same_bytes,
            caps.read && caps.write,
        ),
        (
            "a_write_into_a_region_without_remote_write_is_refused",
            a_write_into_a_region_without_remote_write_is_refused,
            caps.write,
        ),
        (
            "a_read_of_a_region_without_remote_read_is_refused",
            a_read_of_a_region_without_remote_read_is_refused,
            caps.read,
        ),
        (
            "notifications_arrive_after_the_data",
            notifications_arrive_after_the_data,
            caps.write,
        ),
        (
            "many_concurrent_batches_from_several_threads_all_complete",
            many_concurrent_batches_from_several_threads_all_complete,
            caps.write,
        ),
        (
            "a_second_connect_returns_the_cached_peer",
            a_second_connect_returns_the_cached_peer,
            true,
        ),
        (
            "regions_registered_after_connect_are_reachable",
            regions_registered_after_connect_are_reachable,
            caps.write,
        ),
        (
            "requests_with_unsupported_memory_are_refused_at_register",
            requests_with_unsupported_memory_are_refused_at_register,
            true,
        ),
    ];
    let slow: Vec<(&str, Test)> = vec![
        (
            "a_batch_past_its_deadline_fails_with_timeout_and_is_released",
            a_batch_past_its_deadline_fails_with_timeout_and_is_released,
        ),
        (
            "a_waiting_thread_uses_almost_no_cpu",
            a_waiting_thread_uses_almost_no_cpu,
        ),
        (
            "dropping_the_engine_with_batches_in_flight_neither_hangs_nor_crashes",
            dropping_the_engine_with_batches_in_flight_neither_hangs_nor_crashes,
        ),
        (
            "a_handle_can_be_awaited_as_a_future",
            a_handle_can_be_awaited_as_a_future,
        ),
    ];
    for (name, test) in slow {
        tests.push((name, test, caps.write));
    }
    tests
        .into_iter()
        .map(|(name, test, applies)| {
            let h = h.clone();
            let needs_slow = h.slow.is_none() && SLOW_TESTS.contains(&name);
            Trial::test(format!("{}::{name}", h.label), move || test(&h))
                .with_ignored_flag(!applies || needs_slow)
        })
        .collect()
}

const SLOW_TESTS: &[&str] = &[
    "a_batch_past_its_deadline_fails_with_timeout_and_is_released",
    "a_waiting_thread_uses_almost_no_cpu",
    "dropping_the_engine_with_batches_in_flight_neither_hangs_nor_crashes",
    "a_handle_can_be_awaited_as_a_future",
];

/// Runs trials as a test binary's `main` does, exiting with the result.
pub fn run(trials: Vec<Trial>) -> ! {
    libtest_mimic::run(&Arguments::from_args(), trials).exit()
}

fn an_empty_batch_completes(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(&h.config, 4096)?;
    let handle = p.initiator.transfer(&p.peer, &[]).map_err(e2f)?;
    ensure!(
        handle
            .wait_timeout(Duration::from_secs(5))
            .is_some_and(|r| r.is_ok()),
        "empty batch did not complete"
    );
    ensure!(
        matches!(handle.status(), TransferStatus::Done),
        "status is not Done"
    );
    Ok(())
}

fn write_then_read_back_gives_the_same_bytes(h: &Harness) -> Result<(), Failed> {
    let len = 1 << 20;
    let p = h.pair(&h.config, len)?;
    let data = pattern(len, 7);
    p.local.write(0, &data).map_err(e2f)?;
    let rid = p.remote_desc.id;
    // Four requests, one per quarter, written out of order.
    let q = (len / 4) as u64;
    let writes: Vec<_> = [3u64, 0, 2, 1]
        .iter()
        .map(|&i| TransferRequest::write(p.local.id(), i * q, rid, i * q, q))
        .collect();
    p.initiator
        .transfer(&p.peer, &writes)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    ensure!(
        p.remote.to_vec().map_err(e2f)? == data,
        "the target's bytes differ from what was written"
    );
    p.local.write(0, &vec![0; len]).map_err(e2f)?;
    let reads = [TransferRequest::read(p.local.id(), 0, rid, 0, len as u64)];
    p.initiator
        .transfer(&p.peer, &reads)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    ensure!(
        p.local.to_vec().map_err(e2f)? == data,
        "bytes read back differ"
    );
    Ok(())
}

fn completion_is_delivered_exactly_once(h: &Harness) -> Result<(), Failed> {
    // Straight at the backend, below the engine, which would hide a second completion.
    let registry = Registry::discover(&h.config.engine.plugin_dirs);
    let entry = registry.get(&h.config.engine.backend).map_err(e2f)?;
    let ctx = h.config.backend_context(&h.config.engine.backend);
    let a = entry.create(&ctx).map_err(e2f)?;
    let b = entry.create(&ctx).map_err(e2f)?;
    let (mut src, mut dst) = (vec![1u8; 4096], vec![0u8; 4096]);
    let desc = |v: &mut Vec<u8>, access| MemoryDesc {
        name: "m".into(),
        addr: v.as_mut_ptr() as u64,
        len: v.len() as u64,
        kind: MemoryKind::Host,
        access,
    };
    a.register(RegionId(1), &desc(&mut src, Access::LOCAL))
        .map_err(e2f)?;
    let key = b
        .register(RegionId(1), &desc(&mut dst, Access::REMOTE_READ_WRITE))
        .map_err(e2f)?;
    let seg = SegmentDesc {
        engine: "b".into(),
        epoch: 1,
        backend: b.info().name.clone(),
        endpoint: b.endpoint(),
        regions: vec![RegionDesc {
            id: RegionId(1),
            name: "m".into(),
            addr: dst.as_ptr() as u64,
            len: 4096,
            kind: MemoryKind::Host,
            access: Access::REMOTE_READ_WRITE,
            key,
        }],
        layouts: Vec::new(),
    };
    let peer = a.connect(&seg).map_err(e2f)?;
    let n = 64;
    let counts: Arc<Vec<AtomicUsize>> = Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
    for i in 0..n {
        let c = counts.clone();
        let done = Completion::new(Duration::from_secs(10), move |_, _| {
            c[i].fetch_add(1, Ordering::SeqCst);
        });
        let req =
            TransferRequest::write(RegionId(1), 64 * i as u64, RegionId(1), 64 * i as u64, 64);
        if a.submit(peer, &[req], done).is_err() {
            return Err(fail(format!("submit {i} failed")));
        }
    }
    let end = Instant::now() + Duration::from_secs(10);
    while counts.iter().any(|c| c.load(Ordering::SeqCst) == 0) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(50));
    for (i, c) in counts.iter().enumerate() {
        let c = c.load(Ordering::SeqCst);
        ensure!(c == 1, "batch {i} completed {c} times");
    }
    a.deregister(RegionId(1)).map_err(e2f)?;
    b.deregister(RegionId(1)).map_err(e2f)?;
    Ok(())
}

fn out_of_bounds_requests_are_refused_before_posting(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(&h.config, 4096)?;
    p.local.write(0, &[9; 4096]).map_err(e2f)?;
    let (l, r) = (p.local.id(), p.remote_desc.id);
    for (req, what) in [
        (
            TransferRequest::write(l, 0, r, 4000, 200),
            "remote end past the region",
        ),
        (
            TransferRequest::write(l, 4000, r, 0, 200),
            "local end past the region",
        ),
        (
            TransferRequest::write(l, 0, r, u64::MAX - 10, 100),
            "remote offset overflowing",
        ),
        (
            TransferRequest::read(l, 0, r, 0, 4097),
            "read longer than the region",
        ),
    ] {
        let good = TransferRequest::write(l, 0, r, 0, 16);
        expect_kind(
            p.initiator.transfer(&p.peer, &[good, req]),
            ErrorKind::OutOfBounds,
            what,
        )?;
    }
    ensure!(
        p.remote.to_vec().map_err(e2f)? == vec![0; 4096],
        "a refused batch changed the target's memory"
    );
    Ok(())
}

fn unknown_region_requests_are_refused_before_posting(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(&h.config, 4096)?;
    let req = TransferRequest::write(p.local.id(), 0, RegionId(987_654), 0, 16);
    expect_kind(
        p.initiator.transfer(&p.peer, &[req]),
        ErrorKind::NotRegistered,
        "unknown remote region",
    )?;
    let req = TransferRequest::write(RegionId(987_654), 0, p.remote_desc.id, 0, 16);
    expect_kind(
        p.initiator.transfer(&p.peer, &[req]),
        ErrorKind::NotRegistered,
        "unknown local region",
    )
}

fn zero_length_requests_are_refused(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(&h.config, 4096)?;
    let req = TransferRequest::write(p.local.id(), 0, p.remote_desc.id, 0, 0);
    expect_kind(
        p.initiator.transfer(&p.peer, &[req]),
        ErrorKind::InvalidRequest,
        "zero length",
    )
}

fn deregistered_regions_are_refused(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(&h.config, 4096)?;
    let extra = p
        .initiator
        .alloc("extra", 4096, Access::LOCAL)
        .map_err(e2f)?;
    let gone = extra.id();
    drop(extra);
    let req = TransferRequest::write(gone, 0, p.remote_desc.id, 0, 16);
    expect_kind(
        p.initiator.transfer(&p.peer, &[req]),
        ErrorKind::NotRegistered,
        "deregistered local region",
    )?;
    // A remote region deregistered after the initiator fetched the descriptor is still
    // listed there; the target's own check refuses it and the batch fails.
    let target_extra = p
        .target
        .alloc("gone", 4096, Access::REMOTE_READ_WRITE)
        .map_err(e2f)?;
    let peer = p
        .initiator
        .connect(&p.target.address().to_string())
        .map_err(e2f)?;
    let _ = peer.region("gone");
    let stale = p.initiator.transfer(&peer, &[]).map_err(e2f)?;
    stale.wait().map_err(e2f)?;
    let rid = target_extra.id();
    let probe = TransferRequest::write(p.local.id(), 0, rid, 0, 16);
    // Make sure the initiator knows the region before it goes away.
    p.initiator
        .transfer(&peer, &[probe])
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    drop(target_extra);
    match p.initiator.transfer(&peer, &[probe]) {
        Err(e) if e.kind() == ErrorKind::NotRegistered => Ok(()),
        Err(e) => Err(fail(format!("expected NotRegistered, got {e:?}"))),
        Ok(handle) => expect_kind(
            handle.wait(),
            ErrorKind::NotRegistered,
            "write into a deregistered remote region",
        ),
    }
}

fn a_write_into_a_region_without_remote_write_is_refused(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(&h.config, 4096)?;
    let ro = p
        .target
        .alloc("ro", 4096, Access::REMOTE_READ)
        .map_err(e2f)?;
    let peer = p
        .initiator
        .connect(&p.target.address().to_string())
        .map_err(e2f)?;
    let req = TransferRequest::write(p.local.id(), 0, ro.id(), 0, 16);
    expect_kind(
        p.initiator.transfer(&peer, &[req]),
        ErrorKind::InvalidRequest,
        "write into a read-only region",
    )
}

fn a_read_of_a_region_without_remote_read_is_refused(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(&h.config, 4096)?;
    let wo = p
        .target
        .alloc(
            "wo",
            4096,
            Access {
                remote_read: false,
                remote_write: true,
            },
        )
        .map_err(e2f)?;
    let peer = p
        .initiator
        .connect(&p.target.address().to_string())
        .map_err(e2f)?;
    let req = TransferRequest::read(p.local.id(), 0, wo.id(), 0, 16);
    expect_kind(
        p.initiator.transfer(&peer, &[req]),
        ErrorKind::InvalidRequest,
        "read of a write-only region",
    )
}

fn notifications_arrive_after_the_data(h: &Harness) -> Result<(), Failed> {
    let len = 256 << 10;
    let p = h.pair(&h.config, len)?;
    for round in 0..8u8 {
        let data = pattern(len, round);
        p.local.write(0, &data).map_err(e2f)?;
        let options = TransferOptions {
            notify: Some(vec![round]),
            ..TransferOptions::default()
        };
        let req = TransferRequest::write(p.local.id(), 0, p.remote_desc.id, 0, len as u64);
        let handle = p
            .initiator
            .transfer_with(&p.peer, &[req], &options)
            .map_err(e2f)?;
        let n = p
            .target
            .recv_notification(Duration::from_secs(10))
            .ok_or_else(|| fail("no notification within 10 s"))?;
        // The data must already be there when the notification is seen.
        ensure!(
            p.remote.to_vec().map_err(e2f)? == data,
            "round {round}: notification arrived before the data"
        );
        ensure!(
            n.message == [round] && n.from_epoch == p.initiator.epoch(),
            "round {round}: wrong notification {n:?}"
        );
        handle.wait().map_err(e2f)?;
    }
    Ok(())
}

fn many_concurrent_batches_from_several_threads_all_complete(h: &Harness) -> Result<(), Failed> {
    let threads = 4;
    let per_thread = 50;
    let block = 4096usize;
    let p = h.pair(&h.config, threads * per_thread * block)?;
    p.local
        .write(0, &pattern(threads * per_thread * block, 3))
        .map_err(e2f)?;
    let errors = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for t in 0..threads {
            let (p, errors) = (&p, &errors);
            s.spawn(move || {
                let mut handles = Vec::new();
                for i in 0..per_thread {
                    let off = ((t * per_thread + i) * block) as u64;
                    let req = TransferRequest::write(
                        p.local.id(),
                        off,
                        p.remote_desc.id,
                        off,
                        block as u64,
                    );
                    match p.initiator.transfer(&p.peer, &[req]) {
                        Ok(hd) => handles.push(hd),
                        Err(e) => errors
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(e.to_string()),
                    }
                }
                for hd in handles {
                    if let Err(e) = hd.wait() {
                        errors
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(e.to_string());
                    }
                }
            });
        }
    });
    let errors = errors.into_inner().unwrap_or_else(|p| p.into_inner());
    ensure!(
        errors.is_empty(),
        "{} batches failed, first: {}",
        errors.len(),
        errors[0]
    );
    ensure!(
        p.remote.to_vec().map_err(e2f)? == p.local.to_vec().map_err(e2f)?,
        "the target's bytes differ"
    );
    Ok(())
}

fn a_second_connect_returns_the_cached_peer(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(&h.config, 4096)?;
    let again = p
        .initiator
        .connect(&p.target.address().to_string())
        .map_err(e2f)?;
    ensure!(
        again.epoch() == p.peer.epoch() && again.epoch() == p.target.epoch(),
        "epochs differ"
    );
    ensure!(
        Arc::ptr_eq(&again.segment(), &p.peer.segment()),
        "a second connect did a new handshake"
    );
    Ok(())
}

fn regions_registered_after_connect_are_reachable(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(&h.config, 4096)?;
    let late = p
        .target
        .alloc("late", 4096, Access::REMOTE_READ_WRITE)
        .map_err(e2f)?;
    p.local.write(0, &[5; 64]).map_err(e2f)?;
    let req = TransferRequest::write(p.local.id(), 0, late.id(), 0, 64);
    p.initiator
        .transfer(&p.peer, &[req])
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    let mut got = [0u8; 64];
    late.read(0, &mut got).map_err(e2f)?;
    ensure!(got == [5; 64], "the late region did not receive the bytes");
    Ok(())
}

fn requests_with_unsupported_memory_are_refused_at_register(h: &Harness) -> Result<(), Failed> {
    let e = h.engine(&h.config, "mem")?;
    let desc = MemoryDesc {
        name: "dev".into(),
        addr: 0x1000,
        len: 4096,
        kind: MemoryKind::Device {
            runtime: "nosuchruntime".into(),
            ordinal: 0,
        },
        access: Access::LOCAL,
    };
    // SAFETY: the registration is refused before anything touches the address.
    expect_kind(
        unsafe { e.register(desc) },
        ErrorKind::Unsupported,
        "unknown device runtime",
    )
}

fn slow(h: &Harness) -> &Config {
    h.slow.as_ref().unwrap_or(&h.config)
}

fn a_batch_past_its_deadline_fails_with_timeout_and_is_released(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(slow(h), 4096)?;
    let req = TransferRequest::write(p.local.id(), 0, p.remote_desc.id, 0, 16);
    let options = TransferOptions {
        timeout: Some(Duration::from_millis(20)),
        ..TransferOptions::default()
    };
    let start = Instant::now();
    let handle = p
        .initiator
        .transfer_with(&p.peer, &[req], &options)
        .map_err(e2f)?;
    expect_kind(handle.wait(), ErrorKind::Timeout, "batch past its deadline")?;
    ensure!(
        start.elapsed() < Duration::from_millis(150),
        "the timeout fired late: {:?}",
        start.elapsed()
    );
    // The engine keeps working afterwards.
    let handle = p.initiator.transfer(&p.peer, &[req]).map_err(e2f)?;
    handle.wait().map_err(e2f)
}

fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec; the clock id is a constant Linux provides.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn a_waiting_thread_uses_almost_no_cpu(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(slow(h), 4096)?;
    let req = TransferRequest::write(p.local.id(), 0, p.remote_desc.id, 0, 16);
    let handle = p.initiator.transfer(&p.peer, &[req]).map_err(e2f)?;
    let (cpu0, wall0) = (thread_cpu_time(), Instant::now());
    handle.wait().map_err(e2f)?;
    let (cpu, wall) = (thread_cpu_time() - cpu0, wall0.elapsed());
    ensure!(
        wall >= Duration::from_millis(100),
        "the slow batch took only {wall:?}; the slow config is not slow"
    );
    ensure!(
        cpu * 20 < wall,
        "the waiting thread used {cpu:?} of CPU in {wall:?} (more than 5%)"
    );
    Ok(())
}

fn dropping_the_engine_with_batches_in_flight_neither_hangs_nor_crashes(
    h: &Harness,
) -> Result<(), Failed> {
    let p = h.pair(slow(h), 64 << 10)?;
    let mut handles = Vec::new();
    for i in 0..16u64 {
        let req = TransferRequest::write(p.local.id(), i * 4096, p.remote_desc.id, i * 4096, 4096);
        handles.push(p.initiator.transfer(&p.peer, &[req]).map_err(e2f)?);
    }
    let start = Instant::now();
    let Pair {
        remote_desc: _,
        peer,
        local,
        remote,
        initiator,
        target,
    } = p;
    drop(initiator);
    drop(target);
    drop(peer);
    drop(local);
    drop(remote);
    for hd in handles {
        // Each either completed or failed; none may hang.
        ensure!(
            hd.wait_timeout(Duration::from_secs(10)).is_some(),
            "a batch hung after the engines were dropped"
        );
    }
    ensure!(
        start.elapsed() < Duration::from_secs(10),
        "dropping took {:?}",
        start.elapsed()
    );
    Ok(())
}

fn a_handle_can_be_awaited_as_a_future(h: &Harness) -> Result<(), Failed> {
    use std::future::Future;
    use std::task::{Context, Poll, Wake, Waker};
    struct Flag(Mutex<bool>, std::sync::Condvar);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            *self.0.lock().unwrap_or_else(|p| p.into_inner()) = true;
            self.1.notify_all();
        }
    }
    let p = h.pair(slow(h), 4096)?;
    let req = TransferRequest::write(p.local.id(), 0, p.remote_desc.id, 0, 16);
    let mut handle = p.initiator.transfer(&p.peer, &[req]).map_err(e2f)?;
    let flag = Arc::new(Flag(Mutex::new(false), std::sync::Condvar::new()));
    let waker = Waker::from(flag.clone());
    let mut cx = Context::from_waker(&waker);
    ensure!(
        std::pin::Pin::new(&mut handle).poll(&mut cx).is_pending(),
        "a slow batch was ready at once"
    );
    let woken = flag.0.lock().unwrap_or_else(|p| p.into_inner());
    let (woken, _) = flag
        .1
        .wait_timeout_while(woken, Duration::from_secs(10), |w| !*w)
        .unwrap_or_else(|p| p.into_inner());
    ensure!(*woken, "the waker was not called");
    drop(woken);
    match std::pin::Pin::new(&mut handle).poll(&mut cx) {
        Poll::Ready(r) => r.map_err(e2f),
        Poll::Pending => Err(fail("woken but still pending")),
    }
}
