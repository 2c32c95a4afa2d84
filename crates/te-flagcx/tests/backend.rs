//! The flagcx backend driven directly through `TransferBackend`, over the FAKE shim,
//! for what the engine's API does not expose: `deregister` as a barrier, connections
//! established once per peer and off the submit path, and a completion thread that
//! wakes only when there is something to do.
//!
//! The tests run one at a time: they read the fake's process-wide counters and the
//! completion threads' scheduler statistics.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

use libtest_mimic::Failed;
use te_core::testkit::{self, pattern};
use te_core::{
    Access, Completion, ErrorKind, MemoryDesc, MemoryKind, PeerId, RegionDesc, RegionId,
    SegmentDesc, TransferBackend, TransferRequest,
};
use te_flagcx::{FlagcxBackend, FlagcxConfig};

mod common;
use common::{counter, ensure, shim};

const LEN: usize = 64 << 10;

/// Memory the fake's threads write into behind Rust's back, so it is reached only
/// through raw pointers.
struct Mem {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: a plain heap allocation, only read and written through raw copies.
unsafe impl Send for Mem {}
// SAFETY: as above.
unsafe impl Sync for Mem {}

impl Mem {
    fn new(len: usize) -> Mem {
        let layout = Layout::from_size_align(len, 4096).expect("layout");
        // SAFETY: a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "out of memory");
        Mem { ptr, layout }
    }

    fn addr(&self) -> u64 {
        self.ptr as u64
    }

    fn len(&self) -> usize {
        self.layout.size()
    }

    fn write(&self, data: &[u8]) {
        assert!(data.len() <= self.len());
        // SAFETY: in bounds of the allocation; `data` is ordinary memory elsewhere.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr, data.len()) };
    }

    fn read(&self) -> Vec<u8> {
        let mut out = vec![0; self.len()];
        // SAFETY: in bounds of the allocation.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr, out.as_mut_ptr(), out.len()) };
        out
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, self.layout) };
    }
}

fn backend(options: &str) -> Result<FlagcxBackend, Failed> {
    let mut config = FlagcxConfig::default();
    config.shim = Some(shim().into());
    config.shim_options = options.to_string();
    FlagcxBackend::new(config).map_err(|e| format!("{e:?}").into())
}

fn register(b: &FlagcxBackend, id: u64, mem: &Mem, access: Access) -> Result<RegionDesc, Failed> {
    let desc = MemoryDesc {
        name: format!("r{id}"),
        addr: mem.addr(),
        len: mem.len() as u64,
        kind: MemoryKind::Host,
        access,
    };
    let key = b
        .register(RegionId(id), &desc)
        .map_err(|e| format!("{e:?}"))?;
    Ok(RegionDesc {
        id: RegionId(id),
        name: desc.name,
        addr: desc.addr,
        len: desc.len,
        kind: desc.kind,
        access,
        key,
    })
}

fn segment(b: &FlagcxBackend, regions: &[RegionDesc]) -> SegmentDesc {
    testkit::segment(
        te_flagcx::NAME,
        b.endpoint(),
        String::new(),
        regions.to_vec(),
    )
}

type Done = Receiver<(te_core::Result<()>, Instant)>;

fn completion(timeout: Duration) -> (Completion, Done) {
    let (tx, rx) = mpsc::channel();
    let c = Completion::new(timeout, move |r, _dropped| {
        let _ = tx.send((r, Instant::now()));
    });
    (c, rx)
}

/// A target with one remotely readable and writable region (id 1) full of a pattern,
/// and an initiator with the given shim options, connected to it, with a local region
/// (id 10). Fields drop in order: the backends before the memory they use.
struct Pair {
    initiator: FlagcxBackend,
    target: FlagcxBackend,
    src: Mem,
    _dst: Mem,
    dst_desc: RegionDesc,
    peer: PeerId,
}

fn pair(initiator_options: &str) -> Result<Pair, Failed> {
    let target = backend("")?;
    let dst = Mem::new(LEN);
    dst.write(&pattern(LEN, 5));
    let dst_desc = register(&target, 1, &dst, Access::REMOTE_READ_WRITE)?;
    let initiator = backend(initiator_options)?;
    let src = Mem::new(LEN);
    register(&initiator, 10, &src, Access::LOCAL)?;
    let peer = initiator
        .connect(
            &segment(&target, std::slice::from_ref(&dst_desc)),
            te_core::Deadline::after(Duration::from_secs(10)),
        )
        .map_err(|e| format!("{e:?}"))?;
    Ok(Pair {
        target,
        dst_desc,
        initiator,
        src,
        _dst: dst,
        peer,
    })
}

fn read_all() -> [TransferRequest; 1] {
    [TransferRequest::read(
        RegionId(10),
        0,
        RegionId(1),
        0,
        LEN as u64,
    )]
}

// ---------------------------------------------------------------- deregister

fn deregister_waits_for_the_batches_in_flight_on_its_region() -> Result<(), Failed> {
    // The fake moves a transfer's bytes 300 ms after it was posted.
    let p = pair("delay_ms=300")?;
    let (done, rx) = completion(Duration::from_secs(10));
    p.initiator
        .submit(p.peer, &read_all(), done)
        .map_err(|e| format!("{e:?}"))?;
    let start = Instant::now();
    p.initiator
        .deregister_within(RegionId(10), Instant::now() + Duration::from_secs(10))
        .map_err(|e| format!("{e:?}"))?;
    let waited = start.elapsed();
    // What the READ was to bring must be there the moment deregister returns.
    let at_return = p.src.read();
    ensure!(
        at_return == pattern(LEN, 5),
        "deregister returned after {waited:?} while the READ into the region was still in flight"
    );
    // And nothing lands afterwards.
    p.src.write(&vec![0xEE; LEN]);
    let (result, _) = rx
        .recv_timeout(Duration::from_secs(10))
        .map_err(|_| "the batch never completed")?;
    result.map_err(|e| format!("the READ failed: {e:?}"))?;
    std::thread::sleep(Duration::from_millis(400));
    ensure!(
        p.src.read() == vec![0xEE; LEN],
        "bytes landed in the region after deregister returned"
    );
    Ok(())
}

fn deregister_past_its_deadline_fails_and_keeps_the_region_registered() -> Result<(), Failed> {
    let p = pair("delay_ms=400")?;
    let (done, rx) = completion(Duration::from_secs(10));
    p.initiator
        .submit(p.peer, &read_all(), done)
        .map_err(|e| format!("{e:?}"))?;
    let e =
        match p
            .initiator
            .deregister_within(RegionId(10), Instant::now() + Duration::from_millis(50))
        {
            Ok(()) => return Err(
                "deregister returned Ok past its deadline with a READ into the region in flight"
                    .into(),
            ),
            Err(e) => e,
        };
    ensure!(
        e.kind() == ErrorKind::Timeout && e.to_string().contains("must stay allocated"),
        "unclear error: {e:?}"
    );
    // The region is refused to new batches, not forgotten.
    let (late, _late_rx) = completion(Duration::from_secs(10));
    match p.initiator.submit(p.peer, &read_all(), late) {
        Err(e) if e.kind() == ErrorKind::NotRegistered => {}
        other => return Err(format!("a batch on a region being deregistered: {other:?}").into()),
    }
    let (result, _) = rx
        .recv_timeout(Duration::from_secs(10))
        .map_err(|_| "the batch never completed")?;
    result.map_err(|e| format!("the READ failed: {e:?}"))?;
    ensure!(
        p.src.read() == pattern(LEN, 5),
        "the READ brought other bytes"
    );
    p.initiator
        .deregister_within(RegionId(10), Instant::now() + Duration::from_secs(5))
        .map_err(|e| format!("the second deregister failed: {e:?}"))?;
    match p.initiator.deregister_within(RegionId(10), Instant::now()) {
        Err(e) if e.kind() == ErrorKind::NotRegistered => Ok(()),
        other => Err(format!("a third deregister: {other:?}").into()),
    }
}

// ---------------------------------------------------------------- connections

fn concurrent_connects_to_one_peer_open_one_connection() -> Result<(), Failed> {
    let target = backend("")?;
    let dst = Mem::new(LEN);
    let d = register(&target, 1, &dst, Access::REMOTE_READ_WRITE)?;
    let seg = segment(&target, &[d]);
    let initiator = Arc::new(backend("connect_delay_ms=200")?);
    let before = counter("connects");
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (i, s) = (initiator.clone(), seg.clone());
            std::thread::spawn(move || {
                i.connect(&s, te_core::Deadline::after(Duration::from_secs(10)))
                    .map_err(|e| format!("{e:?}"))
            })
        })
        .collect();
    let mut ids = Vec::new();
    for t in threads {
        ids.push(t.join().map_err(|_| "a connecting thread panicked")??);
    }
    let opened = counter("connects") - before;
    ensure!(
        opened == 1,
        "four concurrent connects to one peer opened {opened} connections"
    );
    ensure!(
        ids.iter().all(|id| *id == ids[0]),
        "concurrent connects returned different peers: {ids:?}"
    );
    Ok(())
}

/// A peer whose new region needs a new connection: the connection is established on
/// its own thread; a batch submitted meanwhile returns at once and is posted when the
/// connection is up.
fn a_batch_for_a_peer_still_connecting_waits_for_the_connection_not_in_submit() -> Result<(), Failed>
{
    let p = pair("connect_delay_ms=3000")?;
    let late = Mem::new(LEN);
    let late_desc = register(&p.target, 2, &late, Access::REMOTE_READ_WRITE)?;
    let seg = segment(&p.target, &[p.dst_desc.clone(), late_desc]);
    match p
        .initiator
        .connect_within(&seg, Instant::now() + Duration::from_millis(20))
    {
        Err(e) if e.kind() == ErrorKind::Timeout => {}
        other => {
            return Err(format!("a connect past its deadline returned {other:?}").into());
        }
    }
    p.src.write(&pattern(LEN, 9));
    let (done, rx) = completion(Duration::from_secs(10));
    let write = [TransferRequest::write(
        RegionId(10),
        0,
        RegionId(2),
        0,
        LEN as u64,
    )];
    let start = Instant::now();
    p.initiator
        .submit(p.peer, &write, done)
        .map_err(|e| format!("{e:?}"))?;
    let in_submit = start.elapsed();
    ensure!(
        in_submit < Duration::from_secs(1),
        "submit took {in_submit:?}: it waited for the connection"
    );
    let (result, _) = rx
        .recv_timeout(Duration::from_secs(10))
        .map_err(|_| "the parked batch never completed")?;
    result.map_err(|e| format!("the parked batch failed: {e:?}"))?;
    ensure!(
        late.read() == pattern(LEN, 9),
        "the parked batch's bytes did not land in the new region"
    );
    Ok(())
}

fn a_parked_batch_fails_at_its_deadline_while_the_connection_is_still_coming() -> Result<(), Failed>
{
    let p = pair("connect_delay_ms=5000")?;
    let late = Mem::new(LEN);
    let late_desc = register(&p.target, 2, &late, Access::REMOTE_READ_WRITE)?;
    let seg = segment(&p.target, &[p.dst_desc.clone(), late_desc]);
    let _ = p.initiator.connect_within(&seg, Instant::now());
    let (done, rx) = completion(Duration::from_millis(100));
    let write = [TransferRequest::write(
        RegionId(10),
        0,
        RegionId(2),
        0,
        LEN as u64,
    )];
    let start = Instant::now();
    p.initiator
        .submit(p.peer, &write, done)
        .map_err(|e| format!("{e:?}"))?;
    let (result, at) = rx
        .recv_timeout(Duration::from_secs(10))
        .map_err(|_| "the parked batch never completed")?;
    let took = at - start;
    match result {
        Err(e) if e.kind() == ErrorKind::Timeout && e.to_string().contains("being established") => {
        }
        other => return Err(format!("a parked batch past its deadline: {other:?}").into()),
    }
    ensure!(
        took >= Duration::from_millis(90) && took < Duration::from_secs(3),
        "the parked batch completed after {took:?}, not at its 100 ms deadline"
    );
    ensure!(
        late.read() == vec![0; LEN],
        "a batch that timed out wrote its bytes"
    );
    Ok(())
}

// ---------------------------------------------------------------- the completion thread

/// Context switches of this process's FlagCX completion threads so far: the voluntary
/// ones (the thread's own waits), and with `preempted` the nonvoluntary ones too.
fn completion_thread_switches(preempted: bool) -> Result<u64, Failed> {
    let (voluntary, involuntary, _) = completion_threads()?;
    Ok(voluntary + if preempted { involuntary } else { 0 })
}

/// The te-flagcx threads' voluntary and involuntary context switches and CPU time (in
/// clock ticks), summed.
fn completion_threads() -> Result<(u64, u64, u64), Failed> {
    let (mut voluntary, mut involuntary, mut ticks) = (0, 0, 0);
    let mut threads = 0;
    for task in std::fs::read_dir("/proc/self/task").map_err(|e| e.to_string())? {
        let dir = task.map_err(|e| e.to_string())?.path();
        let Ok(comm) = std::fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        if comm.trim_end() != "te-flagcx" {
            continue;
        }
        let (Ok(status), Ok(stat)) = (
            std::fs::read_to_string(dir.join("status")),
            std::fs::read_to_string(dir.join("stat")),
        ) else {
            continue;
        };
        threads += 1;
        for line in status.lines() {
            let parse = |n: &str| n.trim().parse::<u64>().map_err(|e| e.to_string());
            if let Some(n) = line.strip_prefix("voluntary_ctxt_switches:") {
                voluntary += parse(n)?;
            } else if let Some(n) = line.strip_prefix("nonvoluntary_ctxt_switches:") {
                involuntary += parse(n)?;
            }
        }
        // utime and stime: the 12th and 13th fields after the command's closing paren.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map_or("", |(_, rest)| rest)
            .split_whitespace()
            .collect();
        for f in fields.get(11..13).unwrap_or_default() {
            ticks += f.parse::<u64>().map_err(|e| e.to_string())?;
        }
    }
    ensure!(threads > 0, "no te-flagcx completion thread found");
    Ok((voluntary, involuntary, ticks))
}

fn the_completion_thread_sleeps_while_idle_and_wakes_per_event_not_per_tick() -> Result<(), Failed>
{
    let p = pair("delay_ms=300")?;
    let (done, rx) = completion(Duration::from_secs(10));
    // While the 300 ms READ is in flight, the thread waits for it to finish; a
    // polling back-off would wake it hundreds of times.
    let before = completion_thread_switches(true)?;
    p.initiator
        .submit(p.peer, &read_all(), done)
        .map_err(|e| format!("{e:?}"))?;
    rx.recv_timeout(Duration::from_secs(10))
        .map_err(|_| "the batch never completed")?
        .0
        .map_err(|e| format!("{e:?}"))?;
    let busy = completion_thread_switches(true)? - before;
    ensure!(
        busy < 20,
        "the completion threads woke {busy} times for one 300 ms transfer"
    );
    // Nothing in flight: a second of idleness costs no wake-up at all. The thread
    // settles first (two readings 200 ms apart agree, for 5 s at most); only its own
    // waits count, not the preemptions a loaded machine adds.
    let settle = Instant::now();
    let mut before = completion_thread_switches(false)?;
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = completion_thread_switches(false)?;
        if now == before || settle.elapsed() > Duration::from_secs(5) {
            before = now;
            break;
        }
        before = now;
    }
    let (_, _, cpu_before) = completion_threads()?;
    std::thread::sleep(Duration::from_secs(1));
    let idle = completion_thread_switches(false)? - before;
    ensure!(
        idle == 0,
        "the idle completion threads woke {idle} times in one second"
    );
    // A thread that spins (or yields in a loop) never sleeps, so it shows no voluntary
    // switch: its CPU time does. One tick allows for the reading itself.
    let cpu = completion_threads()?.2 - cpu_before;
    ensure!(
        cpu <= 1,
        "the idle completion threads used {cpu} clock ticks of CPU in one second"
    );
    drop(p);
    Ok(())
}

fn main() {
    type Test = testkit::DirectTest;
    let tests: [(&str, Test); 6] = [
        (
            "deregister_waits_for_the_batches_in_flight_on_its_region",
            deregister_waits_for_the_batches_in_flight_on_its_region,
        ),
        (
            "deregister_past_its_deadline_fails_and_keeps_the_region_registered",
            deregister_past_its_deadline_fails_and_keeps_the_region_registered,
        ),
        (
            "concurrent_connects_to_one_peer_open_one_connection",
            concurrent_connects_to_one_peer_open_one_connection,
        ),
        (
            "a_batch_for_a_peer_still_connecting_waits_for_the_connection_not_in_submit",
            a_batch_for_a_peer_still_connecting_waits_for_the_connection_not_in_submit,
        ),
        (
            "a_parked_batch_fails_at_its_deadline_while_the_connection_is_still_coming",
            a_parked_batch_fails_at_its_deadline_while_the_connection_is_still_coming,
        ),
        (
            "the_completion_thread_sleeps_while_idle_and_wakes_per_event_not_per_tick",
            the_completion_thread_sleeps_while_idle_and_wakes_per_event_not_per_tick,
        ),
    ];
    testkit::run_tests("flagcx_fake_backend", tests.to_vec(), true)
}
