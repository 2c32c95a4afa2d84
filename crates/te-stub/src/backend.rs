//! The stub's `TransferBackend`: a process-wide endpoint table, and one worker thread
//! per backend instance (see `worker`) that performs the copies.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::{JoinHandle, ThreadId};
use std::time::Instant;
use te_core::kit::thread::SpawnMasked as _;
use te_core::peer_table::PeerTable;
use te_core::sync::{Mutex, RwLock, RwLockReadGuard};
use te_core::worker::DueQueue;

use te_core::device::DeviceRuntime;
use te_core::{
    Access, BackendContext, BackendInfo, BatchId, Capabilities, Completion, Deadline, Error,
    ErrorKind, MemoryDesc, PeerId, RegionId, Result, SegmentDesc, TransferBackend, TransferRequest,
};

use crate::config::StubConfig;
use crate::worker::run;

#[derive(Debug, Clone)]
pub(crate) struct Region {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) access: Access,
    /// The device runtime and ordinal of device memory; `None` for host memory.
    pub(crate) device: Option<(Arc<dyn DeviceRuntime>, u32)>,
}

/// One backend instance's memory, as other instances in the process reach it.
#[derive(Debug)]
pub(crate) struct Endpoint {
    /// The engine's epoch.
    pub(crate) id: u64,
    pub(crate) regions: RwLock<HashMap<RegionId, Region>>,
}

/// Every live stub endpoint of this copy of the stub, by id.
pub(crate) static ENDPOINTS: Mutex<Option<HashMap<u64, Weak<Endpoint>>>> = Mutex::new(None);

pub(crate) fn endpoints() -> te_core::sync::MutexGuard<'static, Option<HashMap<u64, Weak<Endpoint>>>>
{
    ENDPOINTS.lock()
}

/// What the Nth batch is made to suffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    None,
    Fail,
    FailPartway,
    Restart,
}

pub(crate) struct Job {
    pub(crate) peer: Weak<Endpoint>,
    pub(crate) requests: Vec<TransferRequest>,
    pub(crate) fault: Fault,
    pub(crate) done: Completion,
}

/// The in-process backend.
#[derive(Debug)]
pub struct StubBackend {
    pub(crate) info: BackendInfo,
    pub(crate) config: StubConfig,
    pub(crate) local: Arc<Endpoint>,
    pub(crate) peers: Arc<PeerTable<Weak<Endpoint>>>,
    pub(crate) batches: AtomicU64,
    pub(crate) shared: Arc<DueQueue<Job>>,
    pub(crate) thread: Option<JoinHandle<()>>,
    pub(crate) thread_id: ThreadId,
}

impl StubBackend {
    /// A new stub endpoint, named by the engine's epoch, with its worker thread.
    ///
    /// # Errors
    /// `Io` if the worker thread cannot start.
    pub fn new(config: StubConfig, ctx: &BackendContext) -> Result<StubBackend> {
        let local = Arc::new(Endpoint {
            id: ctx.epoch_or_random(),
            regions: RwLock::new(HashMap::new()),
        });
        endpoints()
            .get_or_insert_with(HashMap::new)
            .insert(local.id, Arc::downgrade(&local));
        let shared = Arc::new(DueQueue::default());
        let peers = Arc::new(PeerTable::new(crate::NAME));
        let (s, me, c, p) = (shared.clone(), local.clone(), config.clone(), peers.clone());
        let thread = std::thread::Builder::new()
            .name("te-stub".into())
            .spawn_masked(move || run(&s, &me, &c, &p))
            .map_err(|e| {
                Error::new(ErrorKind::Io, "cannot spawn the stub worker").with_source(e)
            })?;
        Ok(StubBackend {
            info: BackendInfo {
                name: crate::NAME.to_string(),
                version: env!("CARGO_PKG_VERSION").to_string(),
                capabilities: Capabilities {
                    // Device memory moves through its runtime's copies.
                    memory: Capabilities::host_and_runtimes(),
                    read: true,
                    write: true,
                    cross_process: false,
                    same_host_only: true,
                    max_request_size: u64::MAX,
                    // The target's own table is checked before every copy.
                    checks_at_target: true,
                },
            },
            config,
            local,
            peers,
            batches: AtomicU64::new(0),
            thread_id: thread.thread().id(),
            shared,
            thread: Some(thread),
        })
    }

    fn fault(&self) -> Fault {
        let n = self.batches.fetch_add(1, Ordering::Relaxed) + 1;
        let every = |k: u64| k > 0 && n % k == 0;
        if every(self.config.fail_every) {
            Fault::Fail
        } else if every(self.config.fail_partway_every) {
            Fault::FailPartway
        } else if every(self.config.restart_every) {
            Fault::Restart
        } else {
            Fault::None
        }
    }
}

pub(crate) fn endpoint_bytes(id: u64) -> Vec<u8> {
    let mut v = id.to_le_bytes().to_vec();
    v.extend_from_slice(&std::process::id().to_le_bytes());
    v
}

impl TransferBackend for StubBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn endpoint(&self) -> Vec<u8> {
        endpoint_bytes(self.local.id)
    }

    fn register(&self, id: RegionId, mem: &MemoryDesc) -> Result<Vec<u8>> {
        let device = te_core::device::of(&mem.kind)?;
        let region = Region {
            addr: mem.addr,
            len: mem.len,
            access: mem.access,
            device,
        };
        self.local.regions.write().insert(id, region);
        Ok(Vec::new())
    }

    fn deregister(&self, id: RegionId, _deadline: Deadline) -> Result<()> {
        // The write lock waits for copies under way, which hold the read lock and end
        // in bounded time (a copy is never left waiting on anything but memory).
        match self.local.regions.write().remove(&id) {
            Some(_) => Ok(()),
            None => Err(Error::new(
                ErrorKind::NotRegistered,
                format!("region {id} is not registered with the stub"),
            )),
        }
    }

    fn connect(&self, peer: &SegmentDesc, _deadline: Deadline) -> Result<PeerId> {
        let bytes: [u8; 12] = peer.endpoint.as_slice().try_into().map_err(|_| {
            Error::new(
                ErrorKind::Protocol,
                format!("a stub endpoint is 12 bytes, got {}", peer.endpoint.len()),
            )
        })?;
        let (id, pid) = bytes.split_at(8);
        let id = u64::from_le_bytes(id.try_into().unwrap_or_default());
        let pid = u32::from_le_bytes(pid.try_into().unwrap_or_default());
        if pid != std::process::id() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "the stub backend connects engines of one process only; the peer is process {pid}; use tcp across processes"
                ),
            ));
        }
        let ep = endpoints().as_ref().and_then(|t| t.get(&id)).cloned();
        let Some(ep) = ep.filter(|e| e.strong_count() > 0) else {
            return Err(Error::new(
                ErrorKind::PeerUnreachable,
                "no live stub endpoint with that id here: its engine is gone, or uses another copy of the stub (built in vs. plugin)",
            ));
        };
        self.peers.insert(PeerId(id), ep);
        Ok(PeerId(id))
    }

    fn disconnect(&self, peer: PeerId, _deadline: Deadline) -> Result<()> {
        self.peers.remove(peer).map(drop)
    }

    fn submit(&self, peer: PeerId, batch: &[TransferRequest], done: Completion) -> Result<()> {
        let ep = self.peers.get(peer)?;
        if ep.strong_count() == 0 {
            return Err(Error::new(
                ErrorKind::PeerUnreachable,
                "the peer's stub endpoint is gone (its engine was dropped)",
            ));
        }
        let mut requests = batch.to_vec();
        if self.config.reorder {
            requests.reverse();
        }
        let job = Job {
            peer: ep,
            requests,
            fault: self.fault(),
            done,
        };
        // A job refused here drops, and its completion with it: the engine sees the
        // error returned instead.
        self.shared
            .push(Instant::now() + self.config.delay, job)
            .map_err(|_| Error::new(ErrorKind::Cancelled, "the stub backend is shutting down"))
    }

    fn abort(&self, _peer: PeerId, batch: BatchId) {
        if self.config.ignore_abort {
            return;
        }
        // A queued batch has touched nothing yet: it is released at once. One being
        // copied sees its flag between requests.
        if let Some(job) = self.shared.remove(|j| j.done.batch() == batch) {
            job.done.complete(Err(aborted()));
        }
    }
}

pub(crate) fn aborted() -> Error {
    Error::new(ErrorKind::Cancelled, "aborted before the stub ran it")
}

impl Drop for StubBackend {
    fn drop(&mut self) {
        if let Some(t) = endpoints().as_mut() {
            t.remove(&self.local.id);
        }
        let jobs = self.shared.stop();
        // Queued batches complete as cancelled when their completions drop here.
        drop(jobs);
        if std::thread::current().id() != self.thread_id {
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }
}

pub(crate) fn read(e: &Endpoint) -> RwLockReadGuard<'_, HashMap<RegionId, Region>> {
    e.regions.read()
}

pub(crate) fn region(
    table: &HashMap<RegionId, Region>,
    id: RegionId,
    offset: u64,
    len: u64,
    side: &str,
) -> Result<Region> {
    let r = table.get(&id).cloned().ok_or_else(|| {
        Error::new(
            ErrorKind::NotRegistered,
            format!(
                "{side} region {id} is not registered (deregistered while the batch was queued?)"
            ),
        )
    })?;
    if !te_core::kit::fits(offset, len, r.len) {
        return Err(Error::new(
            ErrorKind::OutOfBounds,
            format!(
                "{side} range {offset}+{len} is outside region {id} of {} bytes",
                r.len
            ),
        ));
    }
    Ok(r)
}
