//! KV layouts where they are easy to get wrong, on the stub backend: a parent region
//! deregistered while a layout over it is being registered, slots that overlap, and runs
//! of blocks merged past the backend's largest request.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use te::backend::{BackendContext, BatchId, Completion, Deadline, TransferBackend};
use te::{
    Access, BackendInfo, BlockOptions, Config, Engine, ErrorKind, KvGroup, KvLayout, KvSlot,
    MemoryDesc, MemoryKind, Origin, PeerId, RegionId, Result, SegmentDesc, TransferRequest,
};
use te_stub::{StubBackend, StubConfig};

/// A one-shot rendezvous: `enter` blocks the backend's thread until `open`.
#[derive(Default)]
struct Gate {
    state: Mutex<(bool, bool)>,
    cond: Condvar,
}

impl Gate {
    fn enter(&self) {
        let mut s = self.state.lock().unwrap();
        s.0 = true;
        self.cond.notify_all();
        // Bounded: the test opens the gate well before this.
        let (_s, _) = self
            .cond
            .wait_timeout_while(s, Duration::from_secs(20), |s| !s.1)
            .unwrap();
    }
    fn wait_entered(&self) -> bool {
        let s = self.state.lock().unwrap();
        let (s, _) = self
            .cond
            .wait_timeout_while(s, Duration::from_secs(20), |s| !s.0)
            .unwrap();
        s.0
    }
    fn open(&self) {
        self.state.lock().unwrap().1 = true;
        self.cond.notify_all();
    }
}

/// The stub backend, with a slow `register` for memory of one name (a fabric whose
/// memory registration takes time, as an RDMA NIC's does for large regions) and
/// capabilities that may differ from the stub's.
#[derive(Debug)]
struct Wrapped {
    inner: StubBackend,
    info: BackendInfo,
    slow_name: Option<String>,
    gate: Arc<GateDebug>,
}

#[derive(Default)]
struct GateDebug(Gate);

impl std::fmt::Debug for GateDebug {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Gate")
    }
}

impl Wrapped {
    fn new(slow_name: Option<&str>, max_request_size: Option<u64>) -> Wrapped {
        let inner = StubBackend::new(StubConfig::default(), &BackendContext::default()).unwrap();
        let mut info = inner.info().clone();
        if let Some(m) = max_request_size {
            info.capabilities.max_request_size = m;
        }
        Wrapped {
            inner,
            info,
            slow_name: slow_name.map(str::to_string),
            gate: Arc::default(),
        }
    }
}

impl TransferBackend for Wrapped {
    fn info(&self) -> &BackendInfo {
        &self.info
    }
    fn endpoint(&self) -> Vec<u8> {
        self.inner.endpoint()
    }
    fn register(&self, id: RegionId, mem: &MemoryDesc) -> Result<Vec<u8>> {
        if self.slow_name.as_deref() == Some(mem.name.as_str()) {
            self.gate.0.enter();
        }
        self.inner.register(id, mem)
    }
    fn deregister(&self, id: RegionId, deadline: Deadline) -> Result<()> {
        self.inner.deregister(id, deadline)
    }
    fn connect(&self, peer: &SegmentDesc, deadline: Deadline) -> Result<PeerId> {
        self.inner.connect(peer, deadline)
    }
    fn disconnect(&self, peer: PeerId, deadline: Deadline) -> Result<()> {
        self.inner.disconnect(peer, deadline)
    }
    fn submit(&self, peer: PeerId, batch: &[TransferRequest], done: Completion) -> Result<()> {
        self.inner.submit(peer, batch, done)
    }
    fn abort(&self, peer: PeerId, batch: BatchId) {
        self.inner.abort(peer, batch)
    }
}

fn slot(name: &str, region: RegionId, offset: u64, bpb: u64, blocks: u64) -> KvSlot {
    KvSlot {
        name: name.into(),
        region,
        offset,
        bytes_per_block: bpb,
        blocks,
    }
}

/// A layout being registered registers its slots' views one by one before it is
/// published. A deregistration of their parent in that window waits until the layout
/// is registered or undone ("a parent is never let go while a view over its memory is
/// still registered", docs/decisions.md); here the layout fails with `NotRegistered`
/// and no view over the memory is left registered or published.
#[test]
fn a_parent_deregistered_while_its_layout_is_being_registered_leaves_no_live_view() {
    let backend = Arc::new(Wrapped::new(Some("m/g/s1"), None));
    let gate = backend.gate.clone();
    let target = Engine::with_backend(
        Config::defaults().engine,
        backend.clone(),
        Origin::BuiltIn,
        0,
    )
    .unwrap();
    // The caller's memory; leaked so that the test itself never touches freed memory
    // (the caller would free it once `deregister` returned `Ok`).
    let mem: &'static mut [u8] = Box::leak(vec![0u8; 1024].into_boxed_slice());
    let (addr, len) = (mem.as_ptr() as u64, mem.len() as u64);
    // SAFETY: the memory is leaked: it stays valid for the life of the process.
    let reg = unsafe {
        target.register(MemoryDesc {
            name: "kv".into(),
            addr,
            len,
            kind: MemoryKind::Host,
            access: Access::REMOTE_READ_WRITE,
        })
    }
    .unwrap();
    let parent = reg.id();
    let layout = KvLayout {
        name: "m".into(),
        groups: vec![KvGroup {
            name: "g".into(),
            slots: vec![slot("s0", parent, 0, 64, 8), slot("s1", parent, 512, 64, 8)],
        }],
    };
    let (early, deregistered, registered) = std::thread::scope(|s| {
        let registering = s.spawn(|| target.register_layout(layout));
        assert!(
            gate.0.wait_entered(),
            "the layout's second view was never registered"
        );
        // Slot s0's view is registered; s1's is being registered. The caller lets go of
        // the parent region now: that waits until the layout is done or undone.
        let deregistering = s.spawn(|| reg.deregister());
        std::thread::sleep(Duration::from_millis(300));
        let early = deregistering.is_finished();
        gate.0.open();
        let registered = registering.join().unwrap();
        (early, deregistering.join().unwrap(), registered)
    });
    assert!(
        !early,
        "region {parent}'s deregistration returned while a view over it was being registered"
    );
    assert!(deregistered.is_ok(), "{deregistered:?}");
    let e = registered.expect_err("the layout over a deregistered region was registered");
    assert_eq!(e.kind(), ErrorKind::NotRegistered, "{e}");
    let live_views: Vec<_> = target
        .segment()
        .regions
        .into_iter()
        .filter(|r| r.addr >= addr && r.addr < addr + len)
        .collect();
    assert!(
        live_views.is_empty(),
        "region {parent} was deregistered, yet views over it are still registered: {live_views:?}"
    );
}

/// A KV layout whose slots overlap in one region: block 4 of slot `s0` is block 0 of
/// slot `s1`. A push into `s0` then overwrites `s1`'s blocks, although the request
/// stayed inside its slot's view. The engine should refuse such a layout with a clear
/// error (naming the two slots) when it is registered.
#[test]
fn a_layout_whose_slots_overlap_is_refused() {
    let engine = Engine::from_config(&Config::defaults()).unwrap();
    let b = engine.alloc("kv", 1024, Access::REMOTE_READ_WRITE).unwrap();
    let layout = KvLayout {
        name: "m".into(),
        groups: vec![KvGroup {
            name: "g".into(),
            slots: vec![slot("s0", b.id(), 0, 64, 8), slot("s1", b.id(), 256, 64, 8)],
        }],
    };
    let r = engine.register_layout(layout);
    assert!(
        r.as_ref()
            .is_err_and(|e| e.kind() == ErrorKind::InvalidRequest),
        "a layout whose slots `s0` (bytes 0..512) and `s1` (bytes 256..768) overlap was accepted: {r:?}"
    );
}

/// `pull_blocks` merges runs of consecutive blocks into one request per slot, then the
/// engine's own check refuses the merged request for exceeding the backend's largest
/// request ("split it"), although the caller named single blocks that each fit. The
/// plan should split runs at the backend's `max_request_size`.
#[test]
fn merged_block_runs_respect_the_backends_largest_request() {
    let bpb = 4096u64;
    let target = Engine::with_backend(
        Config::defaults().engine,
        Arc::new(Wrapped::new(None, Some(2 * bpb))),
        Origin::BuiltIn,
        0,
    )
    .unwrap();
    let tb = target
        .alloc("kv", 8 * bpb as usize, Access::REMOTE_READ_WRITE)
        .unwrap();
    tb.write(0, &vec![7u8; 8 * bpb as usize]).unwrap();
    target
        .register_layout(KvLayout {
            name: "m".into(),
            groups: vec![KvGroup {
                name: "g".into(),
                slots: vec![slot("k", tb.id(), 0, bpb, 8)],
            }],
        })
        .unwrap();
    let initiator = Engine::with_backend(
        Config::defaults().engine,
        Arc::new(Wrapped::new(None, Some(2 * bpb))),
        Origin::BuiltIn,
        0,
    )
    .unwrap();
    let lb = initiator
        .alloc("kv", 8 * bpb as usize, Access::LOCAL)
        .unwrap();
    initiator
        .register_layout(KvLayout {
            name: "m".into(),
            groups: vec![KvGroup {
                name: "g".into(),
                slots: vec![slot("k", lb.id(), 0, bpb, 8)],
            }],
        })
        .unwrap();
    let peer = initiator.connect(&target.address().to_string()).unwrap();
    let r = initiator
        .pull_blocks(
            &peer,
            "m",
            &[0, 1, 2, 3],
            &[0, 1, 2, 3],
            &BlockOptions::default(),
        )
        .and_then(|h| h.wait());
    assert!(
        r.is_ok(),
        "four blocks of {bpb} bytes, each within the backend's largest request of {} bytes, \
         were refused: {r:?}",
        2 * bpb
    );
    assert!(lb.to_vec().unwrap()[..4 * bpb as usize]
        .iter()
        .all(|&b| b == 7));
}
