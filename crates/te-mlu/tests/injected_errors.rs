//! Errors injected into the FAKE libcnrt surface as clear te errors and fail only the
//! batch (or allocation) they hit; the next one succeeds with every byte right.
//!
//! The tests run one at a time: an injected error hits the next call of its function
//! anywhere in the process. Copies are slowed to 50 ms, so a batch's queue is always
//! still busy when the backend first queries it and it has to synchronize.

mod common;

use common::*;
use libtest_mimic::{Arguments, Failed, Trial};
use te_core::{Access, Engine, ErrorKind, Peer, TransferRequest};

type Inject = unsafe extern "C" fn(*const std::ffi::c_char, i32, i32);

const NO_MEM: i32 = 100100;
const ARGS_INVALID: i32 = 100006;
const NOT_READY: i32 = 1;
const BUSY: i32 = 632014;

/// Injects `code` into the next `count` calls of `name` in the fake te-mlu loaded.
fn inject(name: &str, code: i32, count: i32) {
    // SAFETY: the same file te-mlu loaded, so dlopen returns the same instance; its
    // initialisers only read environment variables.
    let lib = unsafe { libloading::Library::new(env!("TE_MLU_FAKE_CNRT")) }.expect("fake");
    // SAFETY: the fake-only function's prototype.
    let f: libloading::Symbol<'_, Inject> =
        unsafe { lib.get(b"te_fake_cnrt_inject\0") }.expect("te_fake_cnrt_inject");
    let name = std::ffi::CString::new(name).expect("name");
    // SAFETY: a NUL-terminated name.
    unsafe { f(name.as_ptr(), code, count) };
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

/// Gives every queue of the fake this process loaded a depth: one holding `depth`
/// copies not yet run refuses more with `cnrtErrorBusy` (0: no limit).
fn queue_depth(depth: usize) {
    // SAFETY: the same file te-mlu loaded, so dlopen returns the same instance; its
    // initialisers only read environment variables.
    let lib = unsafe { libloading::Library::new(env!("TE_MLU_FAKE_CNRT")) }.expect("fake");
    // SAFETY: the fake-only function's prototype.
    let f: libloading::Symbol<'_, unsafe extern "C" fn(usize)> =
        unsafe { lib.get(b"te_fake_cnrt_queue_depth\0") }.expect("te_fake_cnrt_queue_depth");
    // SAFETY: plain call.
    unsafe { f(depth) };
}

/// A queue depth for as long as it lives; no limit again once dropped, whatever the
/// test did.
struct Depth;

impl Depth {
    fn set(depth: usize) -> Depth {
        queue_depth(depth);
        Depth
    }
}

impl Drop for Depth {
    fn drop(&mut self) {
        queue_depth(0);
    }
}

fn e2f(e: te_core::Error) -> Failed {
    e.to_string().into()
}

struct Pair {
    src: te_core::Buffer,
    dst: te_core::Buffer,
    peer: Peer,
    remote: te_core::RegionId,
    initiator: Engine,
    _target: Engine,
}

fn pair(backend: &str) -> Result<Pair, Failed> {
    pair_from(backend, &mlu(0))
}

/// A pair whose source (64 KiB, filled) is `src` memory, the destination on `mlu:1`.
fn pair_from(backend: &str, src: &te_core::MemoryKind) -> Result<Pair, Failed> {
    let target = Engine::from_config(&config(backend, "")).map_err(e2f)?;
    let initiator = Engine::from_config(&config(backend, "")).map_err(e2f)?;
    let dst = target
        .alloc_on(&mlu(1), "dst", 64 << 10, Access::REMOTE_READ_WRITE)
        .map_err(e2f)?;
    let src = filled(&initiator, src, "src", 64 << 10, Access::LOCAL, 3);
    let peer = initiator
        .connect(&target.address().to_string())
        .map_err(e2f)?;
    let remote = peer.region("dst").ok_or("no dst")?.id;
    Ok(Pair {
        src,
        dst,
        peer,
        remote,
        initiator,
        _target: target,
    })
}

/// Injects, runs one batch that must fail with a `Backend` error naming `needle`, then
/// one that must succeed.
fn one_batch_fails(backend: &str, name: &str, code: i32, needle: &str) -> Result<(), Failed> {
    one_batch_fails_as(backend, name, code, 1, ErrorKind::Backend, needle)
}

/// Injects `code` into the next `count` calls of `name`, runs one batch that must
/// fail with `kind` naming `needle`, then one that must succeed.
fn one_batch_fails_as(
    backend: &str,
    name: &str,
    code: i32,
    count: i32,
    kind: ErrorKind,
    needle: &str,
) -> Result<(), Failed> {
    let p = pair(backend)?;
    let req = [TransferRequest::write(p.src.id(), 0, p.remote, 0, 64 << 10)];
    inject(name, code, count);
    let e = match p.initiator.transfer(&p.peer, &req) {
        Err(e) => e,
        Ok(h) => match h.wait() {
            Err(e) => e,
            Ok(()) => return Err(format!("the batch with {name} failing succeeded").into()),
        },
    };
    // Whatever the batch did, the error is not left for another test's call.
    inject(name, 0, 0);
    if e.kind() != kind || !e.to_string().contains(needle) {
        return Err(format!("expected a {kind} error naming `{needle}`, got {e:?}").into());
    }
    p.initiator
        .transfer(&p.peer, &req)
        .map_err(e2f)?
        .wait()
        .map_err(|e| format!("the batch after the failed one failed too: {e}"))?;
    if p.dst.to_vec().map_err(e2f)? != p.src.to_vec().map_err(e2f)? {
        return Err("the batch after the failed one left wrong bytes".into());
    }
    Ok(())
}

fn an_allocation_without_device_memory_fails_clearly_and_the_next_succeeds() -> Result<(), Failed> {
    let e = Engine::from_config(&config("mlu", "")).map_err(e2f)?;
    inject("cnrtMalloc", NO_MEM, 1);
    let err = e
        .alloc_on(&mlu(0), "big", 1 << 20, Access::LOCAL)
        .expect_err("the injected NoMem");
    let m = err.to_string();
    if !m.contains("cnrtMalloc failed: cnrtErrorNoMem (100100)") || !m.contains("mlu=0") {
        return Err(format!("unclear error: {m}").into());
    }
    e.alloc_on(&mlu(0), "big", 1 << 20, Access::LOCAL)
        .map_err(e2f)?;
    Ok(())
}

fn an_invalid_argument_from_the_copy_fails_only_its_batch() -> Result<(), Failed> {
    one_batch_fails(
        "mlu",
        "cnrtMemcpyPeerAsync",
        ARGS_INVALID,
        "cnrtMemcpyPeerAsync failed: cnrtErrorArgsInvalid (100006)",
    )
}

fn a_queue_that_is_not_ready_at_sync_fails_only_its_batch() -> Result<(), Failed> {
    one_batch_fails(
        "mlu",
        "cnrtQueueSync",
        NOT_READY,
        "cnrtQueueSync failed: cnrtErrorNotReady (1)",
    )
}

fn not_ready_from_a_queue_query_only_means_wait() -> Result<(), Failed> {
    let p = pair("mlu")?;
    inject("cnrtQueueQuery", NOT_READY, 3);
    let req = [TransferRequest::write(p.src.id(), 0, p.remote, 0, 64 << 10)];
    p.initiator
        .transfer(&p.peer, &req)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    if p.dst.to_vec().map_err(e2f)? != p.src.to_vec().map_err(e2f)? {
        return Err("wrong bytes after a NotReady query".into());
    }
    Ok(())
}

fn a_mapping_whose_size_cnrt_does_not_report_is_never_copied_through() -> Result<(), Failed> {
    // Peers in one process map each other's handles as peers elsewhere do.
    let always = config("mlu", "ipc = \"always\"");
    let target = Engine::from_config(&always).map_err(e2f)?;
    let initiator = Engine::from_config(&always).map_err(e2f)?;
    let dst = target
        .alloc_on(&mlu(1), "dst", 64 << 10, Access::REMOTE_READ_WRITE)
        .map_err(e2f)?;
    let src = filled(&initiator, &mlu(0), "src", 64 << 10, Access::LOCAL, 3);
    // CNRT fails to say how large the allocation it maps at connect is.
    let (maps, unmaps) = (counter("maps"), counter("unmaps"));
    inject("cnrtPointerGetAttributes", ARGS_INVALID, 1);
    let peer = initiator.connect(&target.address().to_string());
    // Whatever connect did, the error is not left for another test's call.
    inject("cnrtPointerGetAttributes", 0, 0);
    let peer = peer.map_err(e2f)?;
    let remote = peer.region("dst").ok_or("no dst")?.id;
    let req = [TransferRequest::write(src.id(), 0, remote, 0, 64 << 10)];
    let e = match initiator.transfer(&peer, &req) {
        Err(e) => e,
        Ok(h) => match h.wait() {
            Err(e) => e,
            Ok(()) => {
                return Err("a batch copied through a mapping whose size CNRT did not say".into())
            }
        },
    };
    if e.kind() != ErrorKind::Unsupported || !e.to_string().contains("CNRT does not say how large")
    {
        return Err(
            format!("expected Unsupported saying CNRT did not say the size, got {e:?}").into(),
        );
    }
    if dst.to_vec().map_err(e2f)?.iter().any(|&b| b != 0) {
        return Err("the refused batch changed the target's memory".into());
    }
    let (mapped, unmapped) = (counter("maps") - maps, counter("unmaps") - unmaps);
    if mapped != 1 || unmapped != 1 {
        return Err(format!("the allocation was mapped {mapped} times and unmapped {unmapped} times: the mapping nothing may use must be undone at once").into());
    }
    // Once CNRT answers, refreshing the peer maps the allocation again.
    initiator
        .refresh(&peer, std::time::Duration::from_secs(10))
        .map_err(e2f)?;
    initiator
        .transfer(&peer, &req)
        .map_err(e2f)?
        .wait()
        .map_err(|e| format!("the batch after the refresh failed: {e}"))?;
    if dst.to_vec().map_err(e2f)? != src.to_vec().map_err(e2f)? {
        return Err("the batch after the refresh left wrong bytes".into());
    }
    Ok(())
}

/// A batch of `n` WRITEs of equal pieces of 64 KiB from `src` memory, each from the
/// same offset of the source as of the destination, on queues of depth 4: it must
/// complete with every byte right, and a full queue must have refused a copy on the
/// way.
fn a_batch_longer_than_its_queue_completes(
    backend: &str,
    src: &te_core::MemoryKind,
    n: u64,
) -> Result<(), Failed> {
    let p = pair_from(backend, src)?;
    let piece = (64 << 10) / n;
    let req: Vec<TransferRequest> = (0..n)
        .map(|i| TransferRequest::write(p.src.id(), i * piece, p.remote, i * piece, piece))
        .collect();
    let busy = counter("busy");
    let depth = Depth::set(4);
    let r = p.initiator.transfer(&p.peer, &req).and_then(|h| h.wait());
    drop(depth);
    let refused = counter("busy") - busy;
    r.map_err(|e| format!("a batch of {n} copies on queues of 4 failed: {e}"))?;
    if refused == 0 {
        return Err("no queue was ever full: the test proves nothing".into());
    }
    if p.dst.to_vec().map_err(e2f)? != p.src.to_vec().map_err(e2f)? {
        return Err("the batch over full queues left wrong bytes".into());
    }
    Ok(())
}

fn a_full_queue_makes_a_batch_wait_for_room_instead_of_failing() -> Result<(), Failed> {
    a_batch_longer_than_its_queue_completes("mlu", &mlu(0), 32)
}

fn a_full_runtime_queue_makes_a_stub_batch_wait_for_room_instead_of_failing() -> Result<(), Failed>
{
    // Host to mlu:1: the stub hands all 32 copies to the runtime's copy thread at once.
    a_batch_longer_than_its_queue_completes("stub", &te_core::MemoryKind::Host, 32)
}

fn a_copy_refused_as_busy_on_an_empty_queue_fails_its_batch_as_busy() -> Result<(), Failed> {
    // Busy once more after its queue was waited for: retry later.
    one_batch_fails_as(
        "mlu",
        "cnrtMemcpyPeerAsync",
        BUSY,
        2,
        ErrorKind::Busy,
        "cnrtMemcpyPeerAsync failed: cnrtErrorBusy (632014)",
    )
}

fn a_runtime_copy_refused_as_busy_on_an_empty_queue_fails_its_stub_batch_as_busy(
) -> Result<(), Failed> {
    one_batch_fails_as(
        "stub",
        "cnrtMemcpyAsync_V3",
        BUSY,
        2,
        ErrorKind::Busy,
        "cnrtMemcpyAsync_V3 failed: cnrtErrorBusy (632014)",
    )
}

fn a_copy_refused_as_busy_once_is_retried_once_its_queue_has_room() -> Result<(), Failed> {
    for (backend, name) in [
        ("mlu", "cnrtMemcpyPeerAsync"),
        ("stub", "cnrtMemcpyAsync_V3"),
    ] {
        let p = pair(backend)?;
        let req = [TransferRequest::write(p.src.id(), 0, p.remote, 0, 64 << 10)];
        inject(name, BUSY, 1);
        let r = p.initiator.transfer(&p.peer, &req).and_then(|h| h.wait());
        inject(name, 0, 0);
        r.map_err(|e| format!("{backend}: a copy refused as busy once failed its batch: {e}"))?;
        if p.dst.to_vec().map_err(e2f)? != p.src.to_vec().map_err(e2f)? {
            return Err(format!("{backend}: the retried copy left wrong bytes").into());
        }
    }
    Ok(())
}

fn a_failing_runtime_copy_fails_only_its_stub_batch() -> Result<(), Failed> {
    one_batch_fails(
        "stub",
        "cnrtMemcpyAsync_V3",
        ARGS_INVALID,
        "cnrtMemcpyAsync_V3 failed: cnrtErrorArgsInvalid (100006)",
    )
}

fn main() {
    use_fake_cnrt(&[("TE_FAKE_CNRT_COPY_DELAY_US", "50000")]);
    type Test = fn() -> Result<(), Failed>;
    let tests: [(&str, Test); 11] = [
        (
            "mlu::an_allocation_without_device_memory_fails_clearly_and_the_next_succeeds",
            an_allocation_without_device_memory_fails_clearly_and_the_next_succeeds,
        ),
        (
            "mlu::an_invalid_argument_from_the_copy_fails_only_its_batch",
            an_invalid_argument_from_the_copy_fails_only_its_batch,
        ),
        (
            "mlu::a_queue_that_is_not_ready_at_sync_fails_only_its_batch",
            a_queue_that_is_not_ready_at_sync_fails_only_its_batch,
        ),
        (
            "mlu::not_ready_from_a_queue_query_only_means_wait",
            not_ready_from_a_queue_query_only_means_wait,
        ),
        (
            "mlu::a_mapping_whose_size_cnrt_does_not_report_is_never_copied_through",
            a_mapping_whose_size_cnrt_does_not_report_is_never_copied_through,
        ),
        (
            "stub_mlu::a_failing_runtime_copy_fails_only_its_stub_batch",
            a_failing_runtime_copy_fails_only_its_stub_batch,
        ),
        (
            "mlu::a_full_queue_makes_a_batch_wait_for_room_instead_of_failing",
            a_full_queue_makes_a_batch_wait_for_room_instead_of_failing,
        ),
        (
            "stub_mlu::a_full_runtime_queue_makes_a_stub_batch_wait_for_room_instead_of_failing",
            a_full_runtime_queue_makes_a_stub_batch_wait_for_room_instead_of_failing,
        ),
        (
            "mlu::a_copy_refused_as_busy_on_an_empty_queue_fails_its_batch_as_busy",
            a_copy_refused_as_busy_on_an_empty_queue_fails_its_batch_as_busy,
        ),
        (
            "stub_mlu::a_runtime_copy_refused_as_busy_on_an_empty_queue_fails_its_stub_batch_as_busy",
            a_runtime_copy_refused_as_busy_on_an_empty_queue_fails_its_stub_batch_as_busy,
        ),
        (
            "a_copy_refused_as_busy_once_is_retried_once_its_queue_has_room",
            a_copy_refused_as_busy_once_is_retried_once_its_queue_has_room,
        ),
    ];
    let trials = tests
        .into_iter()
        .map(|(name, f)| Trial::test(name, f))
        .collect();
    let mut args = Arguments::from_args();
    args.test_threads = Some(1);
    libtest_mimic::run(&args, trials).exit()
}
