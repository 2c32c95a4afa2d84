//! A region moved into itself through a peer in this process: pieces whose ranges
//! overlap one another never share a device group, whose copies a list-copy kernel runs
//! at once. Checked through `listcopy`, a runtime of this test binary over `fakedev`
//! that counts groups whose copies overlap and runs each group's copies last to first,
//! as a kernel's threads may finish them. One test, as it reads process-wide counters.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use common::{backend, connect, deregister, pattern, run};
use te_core::device::{CopyDone, DeviceCopy, DeviceRuntime, PointerInfo};
use te_core::{
    Access, MemoryDesc, MemoryKind, Op, RegionId, Result, TransferBackend, TransferRequest,
};

const NAME: &str = "listcopy";
const BLOCK: u64 = 4096;
const BLOCKS: u64 = 16;

/// Device-to-device groups started, and those of them with overlapping copies.
static GROUPS: AtomicU64 = AtomicU64::new(0);
static OVERLAPPING: AtomicU64 = AtomicU64::new(0);

#[derive(Debug)]
struct ListCopy;

fn create(_: &toml::Table) -> Result<Arc<dyn DeviceRuntime>> {
    Ok(Arc::new(ListCopy))
}

/// The process's fakedev runtime, looked up on first use (not while `create` runs,
/// inside te-core's lookup).
fn fakedev() -> &'static Arc<dyn DeviceRuntime> {
    static FAKEDEV: OnceLock<Arc<dyn DeviceRuntime>> = OnceLock::new();
    FAKEDEV
        .get_or_init(|| te_core::device::runtime(te_core::device::fakedev::NAME).expect("fakedev"))
}

te_core::register_runtime!(NAME, "fakedev, copying a group's copies in reverse", create);

/// Whether `[a, a + n)` and `[b, b + m)` share a byte.
fn meet(a: u64, n: usize, b: u64, m: usize) -> bool {
    a < b + m as u64 && b < a + n as u64
}

impl DeviceRuntime for ListCopy {
    fn name(&self) -> &str {
        NAME
    }
    fn device_count(&self) -> Result<u32> {
        fakedev().device_count()
    }
    fn pointer_info(&self, addr: u64) -> Result<PointerInfo> {
        fakedev().pointer_info(addr)
    }
    fn alloc(&self, ordinal: u32, len: usize) -> Result<u64> {
        fakedev().alloc(ordinal, len)
    }
    fn free(&self, ordinal: u32, addr: u64) -> Result<()> {
        fakedev().free(ordinal, addr)
    }
    fn alloc_pinned(&self, len: usize) -> Result<*mut u8> {
        fakedev().alloc_pinned(len)
    }
    unsafe fn free_pinned(&self, ptr: *mut u8, len: usize) {
        // SAFETY: forwarded from the caller.
        unsafe { fakedev().free_pinned(ptr, len) }
    }
    unsafe fn copy(&self, copy: DeviceCopy, done: CopyDone) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe { fakedev().copy(copy, done) }
    }
    unsafe fn copy_group(&self, copies: &[DeviceCopy], done: CopyDone) -> Result<()> {
        let d2d: Vec<(u64, u64, usize)> = copies
            .iter()
            .filter_map(|c| match *c {
                DeviceCopy::DeviceToDevice { src, dst, len, .. } => Some((src, dst, len)),
                _ => None,
            })
            .collect();
        if !d2d.is_empty() {
            GROUPS.fetch_add(1, Ordering::SeqCst);
        }
        // A destination that meets any copy's source or destination (its own source
        // included), all on one device here.
        let overlap = d2d.iter().enumerate().any(|(i, &(_, d, n))| {
            d2d.iter()
                .enumerate()
                .any(|(j, &(s, d2, m))| meet(d, n, s, m) || (i != j && meet(d, n, d2, m)))
        });
        if overlap {
            OVERLAPPING.fetch_add(1, Ordering::SeqCst);
        }
        let reversed: Vec<DeviceCopy> = copies.iter().rev().copied().collect();
        // SAFETY: forwarded from the caller; a group's copies are not ordered.
        unsafe { fakedev().copy_group(&reversed, done) }
    }
}

/// `BLOCKS` blocks of `listcopy` device 0, freed on drop.
struct Mem {
    rt: Arc<dyn DeviceRuntime>,
    addr: u64,
}

impl Mem {
    fn new() -> Mem {
        let rt = te_core::device::runtime(NAME).expect("the listcopy runtime");
        let addr = rt.alloc(0, (BLOCK * BLOCKS) as usize).expect("alloc");
        Mem { rt, addr }
    }
    fn copy(&self, c: DeviceCopy) {
        // SAFETY: the host side outlives the synchronous copy; both sides are in range.
        unsafe { self.rt.copy_sync(c) }.expect("copy");
    }
    fn fill(&self, v: &[u8]) {
        self.copy(DeviceCopy::ToDevice {
            ordinal: 0,
            device: self.addr,
            host: v.as_ptr(),
            len: v.len(),
        });
    }
    fn read(&self) -> Vec<u8> {
        let mut v = vec![0u8; (BLOCK * BLOCKS) as usize];
        self.copy(DeviceCopy::ToHost {
            ordinal: 0,
            device: self.addr,
            host: v.as_mut_ptr(),
            len: v.len(),
        });
        v
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        let _ = self.rt.free(0, self.addr);
    }
}

/// A request of `n` blocks from block `from` to block `to` of region 1, as `op` names
/// them: a WRITE's source is local, a READ's remote.
fn mv(op: Op, from: u64, to: u64, n: u64) -> TransferRequest {
    let (local, remote) = match op {
        Op::Write => (from, to),
        Op::Read => (to, from),
    };
    TransferRequest {
        op,
        local: RegionId(1),
        local_offset: local * BLOCK,
        remote: RegionId(1),
        remote_offset: remote * BLOCK,
        len: n * BLOCK,
    }
}

/// A move of blocks: (from block, to block, blocks).
type Move = (u64, u64, u64);

/// The bytes `reqs` leave in `was` when run one after another.
fn in_order(was: &[u8], reqs: &[Move]) -> Vec<u8> {
    let mut v = was.to_vec();
    for &(from, to, n) in reqs {
        let (f, t, n) = (
            (from * BLOCK) as usize,
            (to * BLOCK) as usize,
            (n * BLOCK) as usize,
        );
        v.copy_within(f..f + n, t);
    }
    v
}

#[test]
fn pieces_of_a_batch_that_overlap_one_another_never_share_a_device_group() {
    let b = backend(true);
    let mem = Mem::new();
    let desc = MemoryDesc {
        name: "d".into(),
        addr: mem.addr,
        len: BLOCK * BLOCKS,
        kind: MemoryKind::Device {
            runtime: NAME.into(),
            ordinal: 0,
        },
        access: Access::REMOTE_READ_WRITE,
    };
    b.register(RegionId(1), &desc).expect("register");
    let me = connect(&b, &b);
    assert_eq!(
        b.peer_path(me).expect("a peer"),
        te_tcp::PeerPath::InProcess
    );

    // Each case: (op, [(from block, to block, blocks)]), every request apart from
    // itself, so each is a device copy.
    let mut cases: Vec<(Op, Vec<Move>)> = vec![
        // A chain: block 0 to 1, then 1 to 2; pieces adjacent on both sides.
        (Op::Write, vec![(0, 1, 1), (1, 2, 1)]),
        (Op::Read, vec![(3, 4, 1), (4, 5, 1)]),
        // Two sources to one destination.
        (Op::Write, vec![(0, 9, 2), (4, 10, 2)]),
        // Swapping two blocks through a third.
        (Op::Write, vec![(2, 15, 1), (3, 2, 1), (15, 3, 1)]),
    ];
    // Random moves of 1 to 3 blocks, from a fixed seed.
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |m: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % m
    };
    for _ in 0..20 {
        let mut reqs = Vec::new();
        for _ in 0..1000 {
            let n = 1 + next(3);
            let (from, to) = (next(BLOCKS - n + 1), next(BLOCKS - n + 1));
            if from + n <= to || to + n <= from {
                reqs.push((from, to, n));
            }
            if reqs.len() == 12 {
                break;
            }
        }
        assert_eq!(reqs.len(), 12, "the seed gives moves apart from themselves");
        cases.push((Op::Write, reqs));
    }
    for (k, (op, reqs)) in cases.iter().enumerate() {
        let was = pattern((BLOCK * BLOCKS) as usize, k as u8);
        mem.fill(&was);
        let batch: Vec<TransferRequest> = reqs.iter().map(|&(f, t, n)| mv(*op, f, t, n)).collect();
        run(&b, me, &batch).unwrap_or_else(|e| panic!("case {k} ({reqs:?}): {e}"));
        assert_eq!(
            OVERLAPPING.load(Ordering::SeqCst),
            0,
            "case {k} ({op:?} {reqs:?}): no device group held copies that overlap"
        );
        assert!(
            mem.read() == in_order(&was, reqs),
            "case {k} ({op:?} {reqs:?}): the bytes of the requests run in order"
        );
    }

    // Moves apart from one another are still one group.
    let before = GROUPS.load(Ordering::SeqCst);
    let apart = [(0, 8, 2), (2, 10, 2), (5, 13, 3)];
    let batch: Vec<TransferRequest> = apart
        .iter()
        .map(|&(f, t, n)| mv(Op::Write, f, t, n))
        .collect();
    run(&b, me, &batch).expect("moves apart");
    assert_eq!(GROUPS.load(Ordering::SeqCst) - before, 1, "one group");
    deregister(&b, &[1]);
}
