//! What staging device memory costs in synchronisations, counted by `fakedev`.
//!
//! This binary holds one test, so nothing else in its process moves `fakedev` bytes
//! while it counts the runtime's synchronisations: the count is exact, not timed.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use te_core::device::{DeviceCopy, DeviceRuntime};
use te_core::{
    Access, BackendContext, Completion, MemoryDesc, MemoryKind, Op, RegionId, SegmentDesc,
    TransferBackend, TransferRequest,
};
use te_tcp::{TcpBackend, TcpConfig};

const BLOCK: u64 = 32 << 10;
const BLOCKS: u64 = 128;
const SLICE: u64 = 512 << 10;

/// Device memory of `fakedev:0`, freed on drop.
struct DevMem {
    rt: Arc<dyn DeviceRuntime>,
    addr: u64,
    len: usize,
}

impl DevMem {
    fn new(len: usize) -> DevMem {
        let rt = te_core::device::runtime(te_core::fakedev::NAME).expect("fakedev");
        let addr = rt.alloc(0, len).expect("alloc");
        DevMem { rt, addr, len }
    }

    fn register(&self, b: &TcpBackend, id: u64, access: Access) {
        let mem = MemoryDesc {
            name: "d".into(),
            addr: self.addr,
            len: self.len as u64,
            kind: MemoryKind::Device {
                runtime: te_core::fakedev::NAME.into(),
                ordinal: 0,
            },
            access,
        };
        b.register(RegionId(id), &mem).expect("register");
    }

    fn fill(&self, v: &[u8]) {
        let copy = DeviceCopy::ToDevice {
            ordinal: 0,
            device: self.addr,
            host: v.as_ptr(),
            len: v.len().min(self.len),
        };
        // SAFETY: `v` outlives the synchronous copy, which stays inside the allocation.
        unsafe { self.rt.copy_sync(copy) }.expect("copy");
    }

    fn read(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        let copy = DeviceCopy::ToHost {
            ordinal: 0,
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
        let _ = self.rt.free(0, self.addr);
    }
}

fn backend() -> TcpBackend {
    let mut c = TcpConfig::default();
    c.slice_size = SLICE;
    TcpBackend::new(c, &BackendContext::default()).expect("backend")
}

/// Submits `reqs` and waits for the batch's result.
fn run(b: &TcpBackend, peer: te_core::PeerId, reqs: &[TransferRequest]) -> te_core::Result<()> {
    let (tx, rx) = mpsc::channel();
    let done = Completion::new(Duration::from_secs(20), move |r, _| {
        let _ = tx.send(r);
    });
    b.submit(peer, reqs, done)?;
    rx.recv_timeout(Duration::from_secs(20))
        .expect("the batch completed")
}

/// Block `i` of the local region goes to block `i * 37 mod 128` of the remote one, so
/// a frame's entries are scattered over the remote region.
fn requests(op: Op, local: u64) -> Vec<TransferRequest> {
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

#[test]
fn a_batch_of_small_device_blocks_synchronises_once_per_frame_on_each_side_not_once_per_block() {
    let total = (BLOCK * BLOCKS) as usize;
    let target = backend();
    let init = backend();
    let (remote, src, back) = (DevMem::new(total), DevMem::new(total), DevMem::new(total));
    remote.register(&target, 1, Access::REMOTE_READ_WRITE);
    src.register(&init, 1, Access::LOCAL);
    back.register(&init, 2, Access::LOCAL);
    let data: Vec<u8> = (0..total)
        .map(|i| (i as u8).wrapping_mul(31) ^ (i >> 15) as u8)
        .collect();
    src.fill(&data);
    let seg = SegmentDesc {
        engine: "target".into(),
        epoch: 1,
        address: String::new(),
        backend: te_tcp::NAME.into(),
        endpoint: target.endpoint(),
        regions: Vec::new(),
        layouts: Vec::new(),
    };
    let peer = init
        .connect(&seg, te_core::Deadline::after(Duration::from_secs(10)))
        .expect("connect");
    let dev = te_core::fakedev::process().expect("the process's fakedev runtime is running");
    // 4 MiB in frames of 512 KiB: 8 frames of 16 blocks. Each frame is staged by one
    // group of copies at the initiator and one at the target; one synchronisation per
    // block (each side) would be 256.
    let frames = BLOCK * BLOCKS / SLICE;
    let most = 2 * frames;

    let before = dev.syncs();
    run(&init, peer, &requests(Op::Write, 1)).expect("write 128 x 32 KiB");
    let write_syncs = dev.syncs() - before;
    let landed = remote.read();
    for i in 0..BLOCKS {
        let (at, from) = (((i * 37 % BLOCKS) * BLOCK) as usize, (i * BLOCK) as usize);
        assert!(
            landed[at..at + BLOCK as usize] == data[from..from + BLOCK as usize],
            "block {i} landed intact"
        );
    }

    let before = dev.syncs();
    run(&init, peer, &requests(Op::Read, 2)).expect("read 128 x 32 KiB");
    let read_syncs = dev.syncs() - before;
    assert!(back.read() == data, "the blocks read back intact");

    assert!(
        write_syncs <= most,
        "the write synchronised {write_syncs} times, more than {most}"
    );
    assert!(
        read_syncs <= most,
        "the read synchronised {read_syncs} times, more than {most}"
    );
    init.deregister(
        RegionId(1),
        te_core::Deadline::after(Duration::from_secs(10)),
    )
    .expect("deregister");
    init.deregister(
        RegionId(2),
        te_core::Deadline::after(Duration::from_secs(10)),
    )
    .expect("deregister");
    target
        .deregister(
            RegionId(1),
            te_core::Deadline::after(Duration::from_secs(10)),
        )
        .expect("deregister");
}
