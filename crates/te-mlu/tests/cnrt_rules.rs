//! What real CNRT and Linux do that te-mlu must cope with, as the FAKE libcnrt now
//! models it: a queue only takes copies while its own MLU is current; `cnrtQueueSync`
//! spins unless the device flag says block; copies waiting together are synchronized
//! together; a peer's `/proc/PID/fd` is out of reach from another PID namespace; a
//! region a peer may still be copying into is never reported deregistered; an
//! allocation gives its IPC handle once, while `cnrtMalloc` reuses freed bases; and
//! (where the fake is told so) allocations made one after the other at one base get
//! one handle value.
//!
//! The tests run one at a time: they read the fake's process-wide counters. Copies take
//! 20 ms, so every wait for a queue really waits. The binary re-executes itself with
//! `TE_MLU_TEST_ROLE=target` (under `unshare --pid --fork`) as the second process.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use libtest_mimic::{Arguments, Failed, Trial};
use te_core::device::{DeviceCopy, DeviceRuntime};
use te_core::{
    Access, Completion, Deadline, Engine, ErrorKind, MemoryDesc, RegionDesc, RegionId, SegmentDesc,
    TransferBackend, TransferRequest,
};
use te_mlu::{MluBackend, MluConfig};

macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+).into());
        }
    };
}

type Counter = unsafe extern "C" fn(*const std::ffi::c_char) -> u64;

/// A counter of the fake libcnrt this process loaded.
fn counter(name: &str) -> u64 {
    // SAFETY: the same file te-mlu loaded, so dlopen returns the same instance; its
    // initialisers only read environment variables.
    let lib = unsafe { libloading::Library::new(env!("TE_MLU_FAKE_CNRT")) }.expect("fake");
    // SAFETY: the fake-only function's prototype.
    let f: libloading::Symbol<'_, Counter> =
        unsafe { lib.get(b"te_fake_cnrt_counter\0") }.expect("te_fake_cnrt_counter");
    let name = std::ffi::CString::new(name).expect("name");
    // SAFETY: a NUL-terminated name.
    unsafe { f(name.as_ptr()) }
}

/// The fake libcnrt this process loaded, for calls the application makes itself.
fn app_cnrt() -> Result<libloading::Library, Failed> {
    // SAFETY: the same file te-mlu loaded, so dlopen returns the same instance.
    unsafe { libloading::Library::new(env!("TE_MLU_FAKE_CNRT")) }
        .map_err(|e| format!("cannot open the fake libcnrt: {e}").into())
}

type Malloc = unsafe extern "C" fn(*mut *mut std::ffi::c_void, usize) -> i32;
type Free = unsafe extern "C" fn(*mut std::ffi::c_void) -> i32;
type Memcpy = unsafe extern "C" fn(*mut std::ffi::c_void, *mut std::ffi::c_void, usize, i32) -> i32;
type Acquire = unsafe extern "C" fn(*mut *mut std::ffi::c_void, *mut std::ffi::c_void) -> i32;

/// `cnrtMalloc` on the calling thread's current MLU (mlu:0), as an application calls it.
fn app_malloc(len: usize) -> Result<u64, Failed> {
    let lib = app_cnrt()?;
    // SAFETY: cnrtMalloc's prototype (docs/mlu-abi.md).
    let f: libloading::Symbol<'_, Malloc> =
        unsafe { lib.get(b"cnrtMalloc\0") }.map_err(|e| e.to_string())?;
    let mut p = std::ptr::null_mut();
    // SAFETY: a valid out-parameter.
    let r = unsafe { f(&mut p, len) };
    ensure!(r == 0, "cnrtMalloc({len}) failed with {r}");
    Ok(p as u64)
}

/// `cnrtFree`, as an application calls it.
fn app_free(addr: u64) -> Result<(), Failed> {
    let lib = app_cnrt()?;
    // SAFETY: cnrtFree's prototype.
    let f: libloading::Symbol<'_, Free> =
        unsafe { lib.get(b"cnrtFree\0") }.map_err(|e| e.to_string())?;
    // SAFETY: `addr` came from cnrtMalloc and nothing uses it any more.
    let r = unsafe { f(addr as *mut std::ffi::c_void) };
    ensure!(r == 0, "cnrtFree({addr:#x}) failed with {r}");
    Ok(())
}

/// Fills MLU memory at `addr` with `data` (`cnrtMemcpy`, host to device).
fn app_write(addr: u64, data: &[u8]) -> Result<(), Failed> {
    let lib = app_cnrt()?;
    // SAFETY: cnrtMemcpy's prototype.
    let f: libloading::Symbol<'_, Memcpy> =
        unsafe { lib.get(b"cnrtMemcpy\0") }.map_err(|e| e.to_string())?;
    // SAFETY: `data` is borrowed until the synchronous copy returns; the fake checks
    // the device range; 0 is cnrtMemcpyHostToDev.
    let r = unsafe {
        f(
            addr as *mut std::ffi::c_void,
            data.as_ptr() as *mut std::ffi::c_void,
            data.len(),
            0,
        )
    };
    ensure!(r == 0, "cnrtMemcpy to {addr:#x} failed with {r}");
    Ok(())
}

/// `cnrtAcquireMemHandle`'s return code for the allocation at `addr`.
fn app_acquire(addr: u64) -> Result<i32, Failed> {
    app_handle(addr).map(|(r, _)| r)
}

/// `cnrtAcquireMemHandle` for the allocation at `addr`: its return code and the handle.
fn app_handle(addr: u64) -> Result<(i32, u64), Failed> {
    let lib = app_cnrt()?;
    // SAFETY: cnrtAcquireMemHandle's prototype.
    let f: libloading::Symbol<'_, Acquire> =
        unsafe { lib.get(b"cnrtAcquireMemHandle\0") }.map_err(|e| e.to_string())?;
    let mut h = std::ptr::null_mut();
    // SAFETY: a valid out-parameter; CNRT checks the address.
    let r = unsafe { f(&mut h, addr as *mut std::ffi::c_void) };
    Ok((r, h as u64))
}

/// Whether the fake gives two allocations made one after the other at one base the
/// same IPC handle value.
fn handle_values_repeat(len: usize) -> Result<bool, Failed> {
    let first = app_malloc(len)?;
    let a = app_handle(first);
    app_free(first)?;
    let second = app_malloc(len)?;
    let b = app_handle(second);
    app_free(second)?;
    let ((ra, a), (rb, b)) = (a?, b?);
    ensure!(
        ra == 0 && rb == 0 && first == second,
        "the fake gave no handles for two allocations at one base ({ra} at {first:#x}, {rb} at {second:#x}): this test proves nothing"
    );
    Ok(a == b)
}

fn e2f(e: te_core::Error) -> Failed {
    format!("{e:?}").into()
}

fn copies_alternating_between_mlus_each_run_with_their_own_mlu_current() -> Result<(), Failed> {
    // The stub moves mlu:N memory through the runtime's copy thread, whose queues were
    // each created with their own MLU current.
    let e = Engine::from_config(&config("stub", "")).map_err(e2f)?;
    let len = 64 << 10;
    let a = e.alloc_on(&mlu(0), "a", len, Access::LOCAL).map_err(e2f)?;
    let b = e.alloc_on(&mlu(1), "b", len, Access::LOCAL).map_err(e2f)?;
    for (round, seed) in [(0, 1u8), (1, 2), (2, 3), (3, 4)] {
        let (buf, which) = if round % 2 == 0 { (&a, 0) } else { (&b, 1) };
        let data = te_core::testkit::pattern(len, seed);
        buf.write(0, &data)
            .map_err(|e| format!("round {round}: a copy to mlu:{which} failed: {e}"))?;
        ensure!(
            buf.to_vec().map_err(e2f)? == data,
            "round {round}: mlu:{which} holds other bytes"
        );
    }
    Ok(())
}

fn waiting_for_copies_blocks_instead_of_spinning() -> Result<(), Failed> {
    let rt = te_mlu::runtime().map_err(e2f)?;
    ensure!(
        rt.blocking_sync(),
        "the runtime did not get cnrtDeviceScheduleBlock on every MLU"
    );
    let e = Engine::from_config(&config("mlu", "")).map_err(e2f)?;
    let target = Engine::from_config(&config("mlu", "")).map_err(e2f)?;
    let dst = target
        .alloc_on(&mlu(1), "dst", 64 << 10, Access::REMOTE_READ_WRITE)
        .map_err(e2f)?;
    let src = filled(&e, &mlu(0), "src", 64 << 10, Access::LOCAL, 7);
    let peer = e.connect(&target.address().to_string()).map_err(e2f)?;
    let remote = peer.region("dst").ok_or("no dst")?.id;
    let (spun, syncs) = (counter("spin_ns"), counter("syncs"));
    for _ in 0..4 {
        let req = [TransferRequest::write(src.id(), 0, remote, 0, 64 << 10)];
        e.transfer(&peer, &req).map_err(e2f)?.wait().map_err(e2f)?;
    }
    ensure!(
        dst.to_vec().map_err(e2f)? == src.to_vec().map_err(e2f)?,
        "the copies left other bytes"
    );
    ensure!(
        counter("syncs") > syncs,
        "no cnrtQueueSync happened, so this test proves nothing"
    );
    let spun = counter("spin_ns") - spun;
    ensure!(
        spun == 0,
        "cnrtQueueSync spun a core for {} ms",
        spun / 1_000_000
    );
    Ok(())
}

fn copies_waiting_together_are_synchronized_together() -> Result<(), Failed> {
    let rt = te_mlu::runtime().map_err(e2f)?;
    let len = 4096usize;
    let copies = 32usize;
    let dev = rt.alloc(0, len * copies).map_err(e2f)?;
    let host: Vec<Vec<u8>> = (0..copies)
        .map(|i| te_core::testkit::pattern(len, i as u8))
        .collect();
    let (tx, rx) = mpsc::channel();
    let syncs = counter("syncs");
    for (i, h) in host.iter().enumerate() {
        let tx = tx.clone();
        let copy = DeviceCopy::ToDevice {
            ordinal: 0,
            device: dev + (i * len) as u64,
            host: h.as_ptr(),
            len,
        };
        // SAFETY: `host` outlives every copy (all are awaited below before it drops),
        // and each device range is inside the allocation.
        unsafe {
            rt.copy(
                copy,
                Box::new(move |r| {
                    let _ = tx.send(r);
                }),
            )
        }
        .map_err(e2f)?;
    }
    for _ in 0..copies {
        rx.recv_timeout(Duration::from_secs(20))
            .map_err(|_| "a copy never completed")?
            .map_err(e2f)?;
    }
    let synced = counter("syncs") - syncs;
    let mut back = vec![0u8; len * copies];
    // SAFETY: `back` is borrowed until the synchronous copy returns.
    unsafe {
        (&*rt as &dyn DeviceRuntime).copy_sync(DeviceCopy::ToHost {
            ordinal: 0,
            device: dev,
            host: back.as_mut_ptr(),
            len: back.len(),
        })
    }
    .map_err(e2f)?;
    rt.free(0, dev).map_err(e2f)?;
    ensure!(back == host.concat(), "the grouped copies left other bytes");
    ensure!(
        synced <= copies as u64 / 4,
        "{copies} copies submitted together took {synced} queue synchronizations"
    );
    Ok(())
}

fn completion(timeout: Duration) -> (Completion, mpsc::Receiver<te_core::Result<()>>) {
    let (tx, rx) = mpsc::channel();
    let c = Completion::new(timeout, move |r, _| {
        let _ = tx.send(r);
    });
    (c, rx)
}

fn deregister_past_its_timeout_fails_while_a_peer_batch_still_holds_the_region(
) -> Result<(), Failed> {
    let rt = te_mlu::runtime().map_err(e2f)?;
    let len = 64u64 << 10;
    let mut slow = MluConfig::default();
    slow.debug_delay = Duration::from_millis(600);
    let ctx = te_core::BackendContext::default();
    let initiator = MluBackend::new(slow, &ctx).map_err(e2f)?;
    let target = MluBackend::new(MluConfig::default(), &ctx).map_err(e2f)?;
    let soon = || Deadline::after(Duration::from_secs(10));
    let src = rt.alloc(0, len as usize).map_err(e2f)?;
    let dst = rt.alloc(1, len as usize).map_err(e2f)?;
    let result = (|| -> Result<(), Failed> {
        let mem = |addr, n, access| MemoryDesc {
            name: "m".into(),
            addr,
            len,
            kind: mlu(n),
            access,
        };
        initiator
            .register(RegionId(10), &mem(src, 0, Access::LOCAL))
            .map_err(e2f)?;
        let key = target
            .register(RegionId(1), &mem(dst, 1, Access::REMOTE_READ_WRITE))
            .map_err(e2f)?;
        let seg = SegmentDesc {
            engine: "target".into(),
            epoch: 1,
            address: String::new(),
            backend: te_mlu::NAME.into(),
            endpoint: target.endpoint(),
            regions: vec![RegionDesc {
                id: RegionId(1),
                name: "m".into(),
                addr: dst,
                len,
                kind: mlu(1),
                access: Access::REMOTE_READ_WRITE,
                key,
            }],
            layouts: Vec::new(),
        };
        let peer = initiator.connect(&seg, soon()).map_err(e2f)?;
        let (done, rx) = completion(Duration::from_secs(10));
        let req = [TransferRequest::write(RegionId(10), 0, RegionId(1), 0, len)];
        initiator.submit(peer, &req, done).map_err(e2f)?;
        // The batch is counted in on the target's region and copies in 600 ms.
        let start = Instant::now();
        match target.deregister(RegionId(1), Deadline::after(Duration::from_millis(100))) {
            Ok(()) => {
                return Err(format!(
                    "deregister returned Ok after {:?} while a peer's batch was about to copy into the region",
                    start.elapsed()
                )
                .into())
            }
            Err(e) => ensure!(
                e.kind() == ErrorKind::Timeout && e.to_string().contains("must stay allocated"),
                "unclear error: {e:?}"
            ),
        }
        rx.recv_timeout(Duration::from_secs(10))
            .map_err(|_| "the batch never completed")?
            .map_err(e2f)?;
        target
            .deregister(RegionId(1), soon())
            .map_err(|e| format!("deregister once the batch finished: {e:?}"))?;
        initiator.deregister(RegionId(10), soon()).map_err(e2f)?;
        Ok(())
    })();
    drop((initiator, target));
    rt.free(0, src).map_err(e2f)?;
    rt.free(1, dst).map_err(e2f)?;
    result
}

/// Registers the application's MLU memory at `addr` with `e` for remote reads.
fn register_app_memory(
    e: &Engine,
    name: &str,
    addr: u64,
    len: u64,
) -> te_core::Result<te_core::Registration> {
    let desc = MemoryDesc {
        name: name.into(),
        addr,
        len,
        kind: mlu(0),
        access: Access::REMOTE_READ,
    };
    // SAFETY: the caller keeps the allocation until the registration is deregistered.
    unsafe { e.register(desc) }
}

/// Reads the peer's region `name` whole into `back` and checks it holds `seed`'s
/// pattern.
fn read_and_check(
    e: &Engine,
    peer: &te_core::Peer,
    name: &str,
    back: &te_core::Buffer,
    seed: u8,
) -> Result<(), Failed> {
    let len = back.len() as u64;
    let remote = peer
        .region(name)
        .ok_or_else(|| format!("the target has no `{name}`"))?
        .id;
    e.transfer(peer, &[TransferRequest::read(back.id(), 0, remote, 0, len)])
        .map_err(|e| format!("reading `{name}`: {e}"))?
        .wait()
        .map_err(|e| format!("reading `{name}`: {e}"))?;
    ensure!(
        back.to_vec().map_err(e2f)? == te_core::testkit::pattern(len as usize, seed),
        "the peer read other bytes than `{name}` holds"
    );
    Ok(())
}

fn a_region_registered_at_a_freed_allocations_base_reaches_the_new_allocation() -> Result<(), Failed>
{
    te_mlu::runtime().map_err(e2f)?;
    let target = Engine::from_config(&config("mlu", "")).map_err(e2f)?;
    // Through IPC handles, as a peer in another process maps them.
    let initiator = Engine::from_config(&config("mlu", "ipc = \"always\"")).map_err(e2f)?;
    let len = 64usize << 10;
    let back = initiator
        .alloc_on(&mlu(1), "back", len, Access::LOCAL)
        .map_err(e2f)?;
    let old = app_malloc(len)?;
    app_write(old, &te_core::testkit::pattern(len, 1))?;
    let reg = register_app_memory(&target, "old", old, len as u64).map_err(e2f)?;
    let peer = initiator
        .connect(&target.address().to_string())
        .map_err(e2f)?;
    read_and_check(&initiator, &peer, "old", &back, 1)?;
    reg.deregister().map_err(e2f)?;
    app_free(old)?;
    let new = app_malloc(len)?;
    let result = (|| -> Result<(), Failed> {
        ensure!(
            new == old,
            "cnrtMalloc put the new allocation at {new:#x}, not at the freed base {old:#x}: this test proves nothing"
        );
        app_write(new, &te_core::testkit::pattern(len, 2))?;
        let reg = register_app_memory(&target, "new", new, len as u64).map_err(e2f)?;
        initiator
            .refresh(&peer, Duration::from_secs(10))
            .map_err(e2f)?;
        let read = read_and_check(&initiator, &peer, "new", &back, 2);
        reg.deregister().map_err(e2f)?;
        read
    })();
    drop((initiator, target));
    app_free(new)?;
    result
}

fn a_region_registered_again_on_the_same_allocation_is_reached_through_its_one_handle(
) -> Result<(), Failed> {
    te_mlu::runtime().map_err(e2f)?;
    let len = 64usize << 10;
    // The fake refuses a second handle for one allocation, as CNRT does.
    let probe = app_malloc(len)?;
    let (first, second) = (app_acquire(probe)?, app_acquire(probe)?);
    app_free(probe)?;
    ensure!(
        first == 0 && second != 0,
        "the fake gave a second IPC handle for one allocation ({first}, then {second}): this test proves nothing"
    );
    let target = Engine::from_config(&config("mlu", "")).map_err(e2f)?;
    let initiator = Engine::from_config(&config("mlu", "ipc = \"always\"")).map_err(e2f)?;
    let back = initiator
        .alloc_on(&mlu(1), "back", len, Access::LOCAL)
        .map_err(e2f)?;
    let mem = app_malloc(len)?;
    let result = (|| -> Result<(), Failed> {
        app_write(mem, &te_core::testkit::pattern(len, 3))?;
        let reg = register_app_memory(&target, "first", mem, len as u64).map_err(e2f)?;
        let peer = initiator
            .connect(&target.address().to_string())
            .map_err(e2f)?;
        read_and_check(&initiator, &peer, "first", &back, 3)?;
        reg.deregister().map_err(e2f)?;
        app_write(mem, &te_core::testkit::pattern(len, 4))?;
        let reg = register_app_memory(&target, "again", mem, len as u64)
            .map_err(|e| format!("registering the same allocation again: {e}"))?;
        initiator
            .refresh(&peer, Duration::from_secs(10))
            .map_err(e2f)?;
        let read = read_and_check(&initiator, &peer, "again", &back, 4);
        reg.deregister().map_err(e2f)?;
        read
    })();
    drop((initiator, target));
    app_free(mem)?;
    result
}

/// Makes the fake's IPC handles name the allocation's base (`true`: a new allocation
/// at a freed base gets the freed one's handle value) or the allocation (`false`).
fn handles_by_base(on: bool) -> Result<(), Failed> {
    let lib = app_cnrt()?;
    // SAFETY: the fake-only control's prototype.
    let f: libloading::Symbol<'_, unsafe extern "C" fn(i32)> =
        unsafe { lib.get(b"te_fake_cnrt_handles_by_base\0") }.map_err(|e| e.to_string())?;
    // SAFETY: plain call.
    unsafe { f(i32::from(on)) };
    Ok(())
}

/// IPC mappings this process holds now (`cnrtMapMemHandle` less `cnrtUnMapMemHandle`).
fn mapped() -> u64 {
    counter("maps") - counter("unmaps")
}

/// A peer keeps reading one base the application frees and allocates again, `ROUNDS`
/// times, once with handles that name the allocation and once with handles that name
/// the base (the same value for every allocation there).
fn a_peer_reads_each_allocation_made_at_one_base_whatever_handle_values_cnrt_gives(
) -> Result<(), Failed> {
    const ROUNDS: u8 = 4;
    te_mlu::runtime().map_err(e2f)?;
    let len = 64usize << 10;
    for by_base in [false, true] {
        let mode = if by_base { "by base" } else { "by allocation" };
        handles_by_base(by_base)?;
        ensure!(
            handle_values_repeat(len)? == by_base,
            "{mode}: the fake does not give the handle values this test is about: it proves nothing"
        );
        let target = Engine::from_config(&config("mlu", "")).map_err(e2f)?;
        // Through IPC handles, as a peer in another process maps them.
        let initiator = Engine::from_config(&config("mlu", "ipc = \"always\"")).map_err(e2f)?;
        let back = initiator
            .alloc_on(&mlu(1), "back", len, Access::LOCAL)
            .map_err(e2f)?;
        let before = mapped();
        let mut base = None;
        let mut peer = None;
        let result = (|| -> Result<(), Failed> {
            for round in 1..=ROUNDS {
                let mem = app_malloc(len)?;
                let at = *base.get_or_insert(mem);
                let round_result = (|| -> Result<(), Failed> {
                    ensure!(
                        mem == at,
                        "{mode}, round {round}: cnrtMalloc put the allocation at {mem:#x}, not at the freed base {at:#x}: this test proves nothing"
                    );
                    app_write(mem, &te_core::testkit::pattern(len, round))?;
                    let name = format!("r{round}");
                    let reg = register_app_memory(&target, &name, mem, len as u64).map_err(e2f)?;
                    let p = match &peer {
                        Some(p) => {
                            initiator.refresh(p, Duration::from_secs(10)).map_err(e2f)?;
                            p
                        }
                        None => peer.insert(
                            initiator
                                .connect(&target.address().to_string())
                                .map_err(e2f)?,
                        ),
                    };
                    let read = read_and_check(&initiator, p, &name, &back, round).map_err(|e| {
                        format!("{mode}, round {round}: {}", e.message().unwrap_or("failed"))
                    });
                    let held = mapped() - before;
                    reg.deregister().map_err(e2f)?;
                    read?;
                    ensure!(
                        held == 1,
                        "{mode}, round {round}: the peer holds {held} mappings of the target's one registered allocation"
                    );
                    Ok(())
                })();
                app_free(mem)?;
                round_result?;
            }
            Ok(())
        })();
        drop((peer, back, initiator, target));
        let left = mapped() - before;
        result?;
        ensure!(
            left == 0,
            "{mode}: {left} mappings of the target's freed allocations are left once both engines are gone"
        );
    }
    handles_by_base(false)
}

/// Two engines of one process read one target's allocation, which the application
/// frees and makes again at the same base, with handles that name the base: one
/// mapping serves both, and the engine that has not refreshed yet does not keep the
/// freed allocation mapped under the handle value the new one has.
fn two_engines_of_one_process_reach_a_reallocation_at_one_base_through_one_mapping(
) -> Result<(), Failed> {
    te_mlu::runtime().map_err(e2f)?;
    let len = 64usize << 10;
    handles_by_base(true)?;
    ensure!(
        handle_values_repeat(len)?,
        "the fake gives two allocations at one base different handles: this test proves nothing"
    );
    let target = Engine::from_config(&config("mlu", "")).map_err(e2f)?;
    let ipc = "ipc = \"always\"";
    let one = Engine::from_config(&config("mlu", ipc)).map_err(e2f)?;
    let two = Engine::from_config(&config("mlu", ipc)).map_err(e2f)?;
    let back_one = one
        .alloc_on(&mlu(1), "back", len, Access::LOCAL)
        .map_err(e2f)?;
    let back_two = two
        .alloc_on(&mlu(1), "back", len, Access::LOCAL)
        .map_err(e2f)?;
    let before = mapped();
    let first = app_malloc(len)?;
    let mut second = None;
    let result = (|| -> Result<(), Failed> {
        app_write(first, &te_core::testkit::pattern(len, 1))?;
        let reg = register_app_memory(&target, "first", first, len as u64).map_err(e2f)?;
        let addr = target.address().to_string();
        let p1 = one.connect(&addr).map_err(e2f)?;
        let p2 = two.connect(&addr).map_err(e2f)?;
        read_and_check(&one, &p1, "first", &back_one, 1)?;
        read_and_check(&two, &p2, "first", &back_two, 1)?;
        let held = mapped() - before;
        ensure!(
            held == 1,
            "two engines of one process hold {held} mappings of one allocation"
        );
        reg.deregister().map_err(e2f)?;
        app_free(first)?;
        let mem = *second.insert(app_malloc(len)?);
        ensure!(
            mem == first,
            "cnrtMalloc put the new allocation at {mem:#x}, not at the freed base {first:#x}: this test proves nothing"
        );
        app_write(mem, &te_core::testkit::pattern(len, 2))?;
        let reg = register_app_memory(&target, "second", mem, len as u64).map_err(e2f)?;
        let reads = (|| -> Result<(), Failed> {
            // The second engine learns of the new allocation while the first still
            // knows the freed one's region.
            two.refresh(&p2, Duration::from_secs(10)).map_err(e2f)?;
            read_and_check(&two, &p2, "second", &back_two, 2).map_err(|e| {
                format!(
                    "the engine that refreshed: {}",
                    e.message().unwrap_or("failed")
                )
            })?;
            one.refresh(&p1, Duration::from_secs(10)).map_err(e2f)?;
            read_and_check(&one, &p1, "second", &back_one, 2).map_err(|e| {
                format!(
                    "the engine that refreshed later: {}",
                    e.message().unwrap_or("failed")
                )
            })?;
            let held = mapped() - before;
            ensure!(
                held == 1,
                "two engines of one process hold {held} mappings of the target's one registered allocation"
            );
            Ok(())
        })();
        reg.deregister().map_err(e2f)?;
        reads
    })();
    drop((back_one, back_two, one, two, target));
    match second {
        Some(mem) => app_free(mem)?,
        None if result.is_err() => {}
        None => app_free(first)?,
    }
    let left = mapped() - before;
    handles_by_base(false)?;
    result?;
    ensure!(
        left == 0,
        "{left} mappings of the target's freed allocations are left once the engines are gone"
    );
    Ok(())
}

/// The second process: a target engine on the mlu backend, serving until stdin closes.
fn target_main() {
    let e = Engine::from_config(&config("mlu", "")).expect("target engine");
    let dst = e
        .alloc_on(&mlu(0), "dst", 1 << 20, Access::REMOTE_READ_WRITE)
        .expect("dst");
    println!("ADDR {}", e.address());
    std::io::stdout().flush().expect("stdout");
    for line in std::io::stdin().lock().lines() {
        let line = line.expect("stdin");
        if let Some(seed) = line.strip_prefix("CHECK ") {
            let seed: u8 = seed.trim().parse().expect("seed");
            let want = te_core::testkit::pattern(1 << 20, seed);
            let ok = dst.to_vec().map(|v| v == want).unwrap_or(false);
            println!("{}", if ok { "OK" } else { "BAD" });
            std::io::stdout().flush().expect("stdout");
        }
    }
}

fn a_peer_in_another_pid_namespace_exchanges_mlu_memory() -> Result<(), Failed> {
    let probe = Command::new("unshare")
        .args(["--pid", "--fork", "--kill-child", "true"])
        .output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            println!(
                "skipped: this machine cannot run a process in a new PID namespace (unshare: {})",
                String::from_utf8_lossy(&o.stderr).trim()
            );
            return Ok(());
        }
        Err(e) => {
            println!("skipped: no `unshare` to run a process in a new PID namespace ({e})");
            return Ok(());
        }
    }
    let mut child = Command::new("unshare")
        .args(["--pid", "--fork", "--kill-child", "--"])
        .arg(std::env::current_exe().map_err(|e| e.to_string())?)
        .env("TE_MLU_TEST_ROLE", "target")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start the target under unshare: {e}"))?;
    let result = (|| -> Result<(), Failed> {
        let mut out = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        let mut line = String::new();
        out.read_line(&mut line).map_err(|e| e.to_string())?;
        let addr = line
            .strip_prefix("ADDR ")
            .ok_or_else(|| format!("the target process said {line:?}"))?
            .trim()
            .to_string();
        let e = Engine::from_config(&config("mlu", "")).map_err(e2f)?;
        let len = 1u64 << 20;
        let src = filled(&e, &mlu(1), "src", len, Access::LOCAL, 9);
        let back = e
            .alloc_on(&mlu(0), "back", len as usize, Access::LOCAL)
            .map_err(e2f)?;
        let peer = e
            .connect(&addr)
            .map_err(|e| format!("connecting to a peer in another PID namespace: {e}"))?;
        let dst = peer.region("dst").ok_or("the target has no `dst`")?.id;
        e.transfer(&peer, &[TransferRequest::write(src.id(), 0, dst, 0, len)])
            .map_err(e2f)?
            .wait()
            .map_err(e2f)?;
        let stdin = child.stdin.as_mut().ok_or("no stdin")?;
        writeln!(stdin, "CHECK 9").map_err(|e| e.to_string())?;
        stdin.flush().map_err(|e| e.to_string())?;
        let mut reply = String::new();
        out.read_line(&mut reply).map_err(|e| e.to_string())?;
        ensure!(
            reply.trim() == "OK",
            "the target found other bytes: {reply:?}"
        );
        e.transfer(&peer, &[TransferRequest::read(back.id(), 0, dst, 0, len)])
            .map_err(e2f)?
            .wait()
            .map_err(e2f)?;
        ensure!(
            back.to_vec().map_err(e2f)? == src.to_vec().map_err(e2f)?,
            "bytes read back from the other namespace differ"
        );
        Ok(())
    })();
    drop(child.stdin.take());
    let status = child.wait().map_err(|e| e.to_string())?;
    result?;
    ensure!(status.success(), "the target process exited with {status}");
    Ok(())
}

fn main() {
    use_fake_cnrt(&[("TE_FAKE_CNRT_COPY_DELAY_US", "20000")]);
    if std::env::var("TE_MLU_TEST_ROLE").as_deref() == Ok("target") {
        target_main();
        return;
    }
    type Test = fn() -> Result<(), Failed>;
    let tests: [(&str, Test); 9] = [
        (
            "copies_alternating_between_mlus_each_run_with_their_own_mlu_current",
            copies_alternating_between_mlus_each_run_with_their_own_mlu_current,
        ),
        (
            "waiting_for_copies_blocks_instead_of_spinning",
            waiting_for_copies_blocks_instead_of_spinning,
        ),
        (
            "copies_waiting_together_are_synchronized_together",
            copies_waiting_together_are_synchronized_together,
        ),
        (
            "deregister_past_its_timeout_fails_while_a_peer_batch_still_holds_the_region",
            deregister_past_its_timeout_fails_while_a_peer_batch_still_holds_the_region,
        ),
        (
            "a_peer_in_another_pid_namespace_exchanges_mlu_memory",
            a_peer_in_another_pid_namespace_exchanges_mlu_memory,
        ),
        (
            "a_region_registered_at_a_freed_allocations_base_reaches_the_new_allocation",
            a_region_registered_at_a_freed_allocations_base_reaches_the_new_allocation,
        ),
        (
            "a_region_registered_again_on_the_same_allocation_is_reached_through_its_one_handle",
            a_region_registered_again_on_the_same_allocation_is_reached_through_its_one_handle,
        ),
        (
            "a_peer_reads_each_allocation_made_at_one_base_whatever_handle_values_cnrt_gives",
            a_peer_reads_each_allocation_made_at_one_base_whatever_handle_values_cnrt_gives,
        ),
        (
            "two_engines_of_one_process_reach_a_reallocation_at_one_base_through_one_mapping",
            two_engines_of_one_process_reach_a_reallocation_at_one_base_through_one_mapping,
        ),
    ];
    let trials = tests
        .into_iter()
        .map(|(name, f)| Trial::test(format!("mlu_fake_cnrt_rules::{name}"), f))
        .collect();
    let mut args = Arguments::from_args();
    args.test_threads = Some(1);
    libtest_mimic::run(&args, trials).exit()
}
