//! The descriptors' own checks, and a peer's descriptor checked where the engine decodes
//! it, before its backend sees it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::backend::{Completion, TransferBackend};
use crate::control::{ControlPlane, Handler, HookSlot, Identity, Settings};
use crate::time::Deadline;
use crate::{Engine, EngineConfig, Origin};

#[test]
fn memory_kinds_parse_and_print() {
    assert_eq!("host".parse::<MemoryKind>().unwrap(), MemoryKind::Host);
    let cuda: MemoryKind = "cuda:1".parse().unwrap();
    assert_eq!(cuda.to_string(), "cuda:1");
    assert_eq!(cuda.runtime(), "cuda");
    for bad in ["", "cuda", "cuda:", "cuda:x", ":0", "cu-da:0"] {
        let e = bad.parse::<MemoryKind>().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{bad}");
    }
}

fn region(id: u64, addr: u64, len: u64) -> RegionDesc {
    RegionDesc {
        id: RegionId(id),
        name: format!("r{id}"),
        addr,
        len,
        kind: MemoryKind::Host,
        access: Access::REMOTE_READ_WRITE,
        key: Vec::new(),
    }
}

fn segment(regions: Vec<RegionDesc>) -> SegmentDesc {
    SegmentDesc {
        engine: "prefill-0".into(),
        epoch: 7,
        address: "127.0.0.1:7000".into(),
        backend: "rdma".into(),
        endpoint: vec![1, 2, 3],
        regions,
        layouts: Vec::new(),
    }
}

/// The two ways a peer's descriptor is decoded: the control plane's frames, and the
/// plugin boundary.
fn decodings(s: &SegmentDesc) -> [Result<SegmentDesc>; 2] {
    use crate::control::wire;
    [
        wire::decode(&wire::encode(s), "segment descriptor"),
        SegmentDesc::decode(&s.encode()),
    ]
}

#[test]
fn a_peers_region_past_the_address_space_or_listed_twice_is_refused_where_it_is_decoded() {
    let good = region(1, 0x1000, 1 << 20);
    for (regions, named, why) in [
        (
            vec![good.clone(), region(2, u64::MAX - 4095, 4096)],
            "region 2",
            "address space",
        ),
        (
            vec![good.clone(), region(3, u64::MAX, 1)],
            "region 3",
            "address space",
        ),
        (
            vec![good.clone(), region(1, u64::MAX - 4095, 1)],
            "region 1",
            "twice",
        ),
    ] {
        let forged = segment(regions);
        let e = forged.check_regions().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
        let m = e.to_string();
        assert!(
            m.contains("engine `prefill-0`") && m.contains(named) && m.contains(why),
            "{m}"
        );
        for (i, decoded) in decodings(&forged).into_iter().enumerate() {
            let e = decoded.expect_err(&format!("decoding {i} accepted {forged:?}"));
            assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
            if i == 0 {
                // The control plane's frames keep the reason (postcard drops it).
                let m = e.to_string();
                assert!(m.contains(named) && m.contains(why), "{m}");
            }
        }
    }
}

#[test]
fn empty_overlapping_and_top_of_memory_regions_are_a_peers_to_describe() {
    // A KV slot's view lies inside its region; a region may end at the last byte;
    // no backend misreads an empty region (every request into it is out of bounds).
    let fine = segment(vec![
        region(1, 0x1000, 1 << 20),
        region(2, 0x1000 + 4096, 4096),
        region(3, u64::MAX - 4095, 4095),
        region(4, u64::MAX - 4096, 4096),
        region(5, 0x2000, 0),
    ]);
    fine.check_regions().unwrap();
    for decoded in decodings(&fine) {
        assert_eq!(decoded.unwrap(), fine);
    }
}

// Through the engine: a peer whose control plane serves a forged descriptor is refused at
// connect, and the backend's `connect` is never called with it.

const BACKEND: &str = "recorder";

/// A backend that only counts the descriptors it is asked to connect to.
#[derive(Debug)]
struct Recorder {
    info: BackendInfo,
    connects: AtomicUsize,
}

impl TransferBackend for Recorder {
    fn info(&self) -> &BackendInfo {
        &self.info
    }
    fn endpoint(&self) -> Vec<u8> {
        Vec::new()
    }
    fn register(&self, _: RegionId, _: &MemoryDesc) -> Result<Vec<u8>> {
        Ok(Vec::new())
    }
    fn deregister(&self, _: RegionId, _: Deadline) -> Result<()> {
        Ok(())
    }
    fn connect(&self, _: &SegmentDesc, _: Deadline) -> Result<PeerId> {
        self.connects.fetch_add(1, Ordering::SeqCst);
        Ok(PeerId(1))
    }
    fn disconnect(&self, _: PeerId, _: Deadline) -> Result<()> {
        Ok(())
    }
    fn submit(&self, _: PeerId, _: &[TransferRequest], _: Completion) -> Result<()> {
        Err(Error::new(
            ErrorKind::Unsupported,
            "the recorder moves nothing",
        ))
    }
}

/// A peer's control plane that serves whatever descriptor it is given.
struct Forger(SegmentDesc);

impl Handler for Forger {
    fn segment(&self) -> SegmentDesc {
        self.0.clone()
    }
    fn notify(&self, _: &Identity, _: u64, _: Vec<u8>) -> Result<()> {
        Err(Error::new(ErrorKind::Unsupported, "no notifications here"))
    }
}

fn config(name: &str) -> EngineConfig {
    EngineConfig {
        name: name.into(),
        heartbeat: Duration::from_millis(200),
        ..EngineConfig::default()
    }
}

/// Connects `engine` to a peer serving `regions`.
fn connect_to(engine: &Engine, regions: Vec<RegionDesc>) -> Result<()> {
    let epoch = 9;
    let peer = config("forger");
    let plane = ControlPlane::start(
        Settings::new(&peer, epoch),
        &peer.listen,
        None,
        Arc::new(HookSlot::default()),
    )?;
    let handler: Arc<dyn Handler> = Arc::new(Forger(SegmentDesc {
        engine: peer.name.clone(),
        epoch,
        address: plane.shared().address().to_string(),
        backend: BACKEND.into(),
        endpoint: Vec::new(),
        regions,
        layouts: Vec::new(),
    }));
    plane.set_handler(Arc::downgrade(&handler));
    let addr = plane.shared().address().to_string();
    engine
        .connect_with(&addr, Duration::from_secs(10))
        .map(drop)
}

#[test]
fn a_peers_region_past_the_address_space_is_refused_before_the_backend_connects() {
    let backend = Arc::new(Recorder {
        info: BackendInfo {
            name: BACKEND.into(),
            version: "0".into(),
            capabilities: Capabilities {
                memory: vec!["host".into()],
                read: true,
                write: true,
                cross_process: true,
                same_host_only: false,
                max_request_size: 1 << 30,
                checks_at_target: true,
            },
        },
        connects: AtomicUsize::new(0),
    });
    let engine = Engine::with_backend(config("initiator"), backend.clone(), Origin::BuiltIn, 0)
        .expect("engine");

    // The setup reaches the backend with a genuine descriptor.
    connect_to(&engine, vec![region(1, 0x1000, 1 << 20)]).expect("a genuine peer");
    assert_eq!(backend.connects.load(Ordering::SeqCst), 1);

    let e = connect_to(
        &engine,
        vec![region(1, 0x1000, 1 << 20), region(2, u64::MAX - 4095, 8192)],
    )
    .expect_err("a region past the end of the address space was accepted");
    assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
    let m = e.to_string();
    assert!(
        m.contains("region 2") && m.contains("address space") && m.contains("peer="),
        "{m}"
    );
    assert_eq!(
        backend.connects.load(Ordering::SeqCst),
        1,
        "the backend was handed the forged descriptor"
    );
}
