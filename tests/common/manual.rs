//! `Manual`, a backend that moves nothing, for tests of the engine core through the
//! public API: a test decides when each batch completes and which deregistration
//! fails. Used through `Engine::with_backend`.
#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use te::backend::{Completion, Deadline, TransferBackend};
use te::{
    Access, BackendInfo, Capabilities, Engine, EngineConfig, Error, ErrorKind, MemoryDesc,
    MemoryKind, Origin, PeerId, RegionId, Registration, SegmentDesc, TransferRequest,
};

/// A backend that moves nothing: it completes each batch inside `submit` (`at_once`)
/// or keeps its completion for the test, and fails the deregistration of the regions
/// the test marks `stuck` (as a backend does whose peer still holds a transfer on them).
#[derive(Debug)]
pub struct Manual {
    pub info: BackendInfo,
    pub at_once: bool,
    pub held: Mutex<Vec<Completion>>,
    pub stuck: Mutex<HashSet<RegionId>>,
    pub registered: Mutex<HashSet<RegionId>>,
    /// Connected peers: epoch → id.
    pub peers: Mutex<HashMap<u64, PeerId>>,
    pub next: AtomicU64,
}

impl Manual {
    pub fn new(at_once: bool) -> Arc<Manual> {
        Arc::new(Manual {
            info: BackendInfo {
                name: "manual".into(),
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
            at_once,
            held: Mutex::new(Vec::new()),
            stuck: Mutex::new(HashSet::new()),
            registered: Mutex::new(HashSet::new()),
            peers: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
        })
    }

    /// The completion of the batch submitted first among those still held, waiting for
    /// one at most 5 s.
    pub fn take(&self) -> Completion {
        let end = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(c) = self.held.lock().unwrap().pop() {
                return c;
            }
            assert!(Instant::now() < end, "no batch reached the backend");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn peers_held(&self) -> usize {
        self.peers.lock().unwrap().len()
    }
}

impl TransferBackend for Manual {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn endpoint(&self) -> Vec<u8> {
        Vec::new()
    }

    fn register(&self, id: RegionId, _mem: &MemoryDesc) -> te::Result<Vec<u8>> {
        self.registered.lock().unwrap().insert(id);
        Ok(Vec::new())
    }

    fn deregister(&self, id: RegionId, _deadline: Deadline) -> te::Result<()> {
        if self.stuck.lock().unwrap().contains(&id) {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "a peer's transfer still holds region {id}; its memory must stay allocated"
                ),
            ));
        }
        self.registered.lock().unwrap().remove(&id);
        Ok(())
    }

    fn connect(&self, peer: &SegmentDesc, _deadline: Deadline) -> te::Result<PeerId> {
        let mut peers = self.peers.lock().unwrap();
        let next = &self.next;
        Ok(*peers
            .entry(peer.epoch)
            .or_insert_with(|| PeerId(next.fetch_add(1, Ordering::Relaxed))))
    }

    fn disconnect(&self, peer: PeerId, _deadline: Deadline) -> te::Result<()> {
        let mut peers = self.peers.lock().unwrap();
        let before = peers.len();
        peers.retain(|_, id| *id != peer);
        if peers.len() == before {
            return Err(Error::new(ErrorKind::PeerUnreachable, "unknown peer"));
        }
        Ok(())
    }

    fn submit(
        &self,
        _peer: PeerId,
        _batch: &[TransferRequest],
        done: Completion,
    ) -> te::Result<()> {
        if self.at_once {
            done.complete(Ok(()));
        } else {
            self.held.lock().unwrap().insert(0, done);
        }
        Ok(())
    }
}

/// An engine named uniquely (peers tell lives apart by name) around `backend`.
pub fn engine(backend: &Arc<Manual>, set: impl FnOnce(&mut EngineConfig)) -> Engine {
    static N: AtomicUsize = AtomicUsize::new(0);
    let mut c = EngineConfig {
        name: format!(
            "review-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ),
        backend: "manual".into(),
        ..EngineConfig::default()
    };
    set(&mut c);
    Engine::with_backend(c, backend.clone(), Origin::BuiltIn, 0).expect("engine")
}

/// `len` bytes of host memory registered with `access`; the memory is leaked, so a
/// test that fails with te still holding it cannot make anything touch freed memory.
pub fn register(e: &Engine, name: &str, len: usize, access: Access) -> Registration {
    let memory: &'static mut [u8] = Box::leak(vec![0u8; len].into_boxed_slice());
    // SAFETY: the memory is leaked: valid for the rest of the process.
    unsafe {
        e.register(MemoryDesc {
            name: name.into(),
            addr: memory.as_mut_ptr() as u64,
            len: len as u64,
            kind: MemoryKind::Host,
            access,
        })
    }
    .expect("registered")
}
