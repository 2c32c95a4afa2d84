//! What the device-memory test binaries share: `fakedev` memory, backends, a blocking
//! submit, and a batch of scattered blocks.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use te_core::device::{DeviceCopy, DeviceRuntime};
pub use te_core::testkit::{self, pattern, soon};
use te_core::{
    Access, BackendContext, MemoryDesc, MemoryKind, Op, PeerId, RegionId, SegmentDesc,
    TransferBackend, TransferRequest,
};
use te_tcp::{TcpBackend, TcpConfig};

pub const BLOCK: u64 = 32 << 10;
pub const BLOCKS: u64 = 128;
pub const SLICE: u64 = 512 << 10;

/// Device memory of a `fakedev` device, freed on drop.
pub struct DevMem {
    rt: Arc<dyn DeviceRuntime>,
    ordinal: u32,
    addr: u64,
    len: usize,
}

impl DevMem {
    pub fn new(ordinal: u32, len: usize) -> DevMem {
        let rt = te_core::device::runtime(te_core::device::fakedev::NAME).expect("fakedev");
        let addr = rt.alloc(ordinal, len).expect("alloc");
        DevMem {
            rt,
            ordinal,
            addr,
            len,
        }
    }

    pub fn register(&self, b: &TcpBackend, id: u64, access: Access) {
        let mem = MemoryDesc {
            name: "d".into(),
            addr: self.addr,
            len: self.len as u64,
            kind: MemoryKind::Device {
                runtime: te_core::device::fakedev::NAME.into(),
                ordinal: self.ordinal,
            },
            access,
        };
        b.register(RegionId(id), &mem).expect("register");
    }

    pub fn fill(&self, v: &[u8]) {
        let copy = DeviceCopy::ToDevice {
            ordinal: self.ordinal,
            device: self.addr,
            host: v.as_ptr(),
            len: v.len().min(self.len),
        };
        // SAFETY: `v` outlives the synchronous copy, which stays inside the allocation.
        unsafe { self.rt.copy_sync(copy) }.expect("copy");
    }

    pub fn read(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        let copy = DeviceCopy::ToHost {
            ordinal: self.ordinal,
            device: self.addr,
            host: v.as_mut_ptr(),
            len: self.len,
        };
        // SAFETY: `v` outlives the synchronous copy and holds `len` bytes.
        unsafe { self.rt.copy_sync(copy) }.expect("copy");
        v
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        let _ = self.rt.free(self.ordinal, self.addr);
    }
}

/// Registers host memory `v` (kept alive by the caller) as region `id` of `b`.
pub fn host(b: &TcpBackend, id: u64, v: &mut [u8], access: Access) {
    b.register(RegionId(id), &testkit::host_memory(v, access))
        .expect("register host memory");
}

/// Sets what this process's fakedev copies cost: `launch` on a group's queue thread
/// before it copies, and `latency` before its end is reported. The settings hold for
/// the whole process.
pub fn fakedev_costs(launch: Duration, latency: Duration) {
    let table: toml::Table = format!(
        "launch_cost = \"{}us\"\nsync_cost = \"0us\"\ncompletion_latency = \"{}us\"",
        launch.as_micros(),
        latency.as_micros()
    )
    .parse()
    .expect("fakedev settings");
    te_core::device::configure(&BTreeMap::from([("fakedev".to_string(), table)]));
}

/// A tcp backend with `SLICE`-byte slices; `local_copies` as given.
pub fn backend(local_copies: bool) -> TcpBackend {
    backend_with(|c| c.local_copies = local_copies)
}

/// A tcp backend with `SLICE`-byte slices and what `set` changes.
pub fn backend_with(set: impl FnOnce(&mut TcpConfig)) -> TcpBackend {
    let mut c = TcpConfig::default();
    c.slice_size = SLICE;
    set(&mut c);
    TcpBackend::new(c, &BackendContext::default()).expect("backend")
}

/// The descriptor an initiator connects to `target` with.
pub fn segment(target: &TcpBackend) -> SegmentDesc {
    testkit::segment(te_tcp::NAME, target.endpoint(), String::new(), Vec::new())
}

/// Connects `init` to `target`.
pub fn connect(init: &TcpBackend, target: &TcpBackend) -> PeerId {
    init.connect(&segment(target), soon()).expect("connect")
}

/// A target and an initiator in this process, connected, each `BLOCKS` blocks of
/// fakedev:0 memory: the target's region 1 (`remote`), the initiator's region 1
/// (`src`, filled with `data`) and region 2 (`back`). Keep `src` bound while it is
/// used: dropping it frees the memory.
pub struct Pair {
    pub target: TcpBackend,
    pub init: TcpBackend,
    pub remote: DevMem,
    pub src: DevMem,
    pub back: DevMem,
    pub data: Vec<u8>,
    pub peer: PeerId,
}

impl Pair {
    /// Both backends with `local_copies` as given.
    pub fn new(local_copies: bool) -> Pair {
        Pair::with(|| backend(local_copies))
    }

    /// Both backends made by `backend`.
    pub fn with(backend: impl Fn() -> TcpBackend) -> Pair {
        let total = (BLOCK * BLOCKS) as usize;
        let (target, init) = (backend(), backend());
        let (remote, src, back) = (
            DevMem::new(0, total),
            DevMem::new(0, total),
            DevMem::new(0, total),
        );
        remote.register(&target, 1, Access::REMOTE_READ_WRITE);
        src.register(&init, 1, Access::LOCAL);
        back.register(&init, 2, Access::LOCAL);
        let data = pattern(total, 1);
        src.fill(&data);
        let peer = connect(&init, &target);
        Pair {
            target,
            init,
            remote,
            src,
            back,
            data,
            peer,
        }
    }
}

/// Submits `reqs` and waits for the batch's result.
pub fn run(b: &TcpBackend, peer: PeerId, reqs: &[TransferRequest]) -> te_core::Result<()> {
    testkit::run_batch(b, peer, reqs, Duration::from_secs(20))
}

/// Block `i` of local region `local` goes to (or comes from) block `i * 37 mod 128` of
/// remote region 1, so a frame's entries are scattered over the remote region.
pub fn requests(op: Op, local: u64) -> Vec<TransferRequest> {
    (0..BLOCKS)
        .map(|i| TransferRequest {
            op,
            local: RegionId(local),
            local_offset: i * BLOCK,
            remote: RegionId(1),
            remote_offset: (i * 37 % BLOCKS) * BLOCK,
            len: BLOCK,
        })
        .collect()
}

/// Asserts every block of `data` landed where `requests` sends it in `landed`.
pub fn assert_scattered(landed: &[u8], data: &[u8]) {
    for i in 0..BLOCKS {
        let (at, from) = (((i * 37 % BLOCKS) * BLOCK) as usize, (i * BLOCK) as usize);
        assert!(
            landed[at..at + BLOCK as usize] == data[from..from + BLOCK as usize],
            "block {i} landed intact"
        );
    }
}

/// Deregisters `ids` of `b`.
pub fn deregister(b: &TcpBackend, ids: &[u64]) {
    for &id in ids {
        b.deregister(RegionId(id), soon()).expect("deregister");
    }
}
