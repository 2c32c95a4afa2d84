//! The stub's `TransferBackend`: a process-wide endpoint table and one worker thread
//! per backend instance that performs the copies.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::{JoinHandle, ThreadId};
use std::time::Instant;
use te_core::sync::{Condvar, Mutex, RwLock, RwLockReadGuard};

use te_core::device::{DeviceCopy, DeviceRuntime};
use te_core::{
    Access, BackendContext, BackendInfo, BatchId, Capabilities, Completion, Deadline, Error,
    ErrorKind, MemoryDesc, MemoryKind, Op, PeerId, RegionId, Result, SegmentDesc, TransferBackend,
    TransferRequest,
};

use crate::config::{Mode, StubConfig};

#[derive(Debug, Clone)]
struct Region {
    addr: u64,
    len: u64,
    access: Access,
    /// The device runtime and ordinal of device memory; `None` for host memory.
    device: Option<(Arc<dyn DeviceRuntime>, u32)>,
}

/// One backend instance's memory, as other instances in the process reach it.
#[derive(Debug)]
struct Endpoint {
    /// The engine's epoch.
    id: u64,
    regions: RwLock<HashMap<RegionId, Region>>,
}

/// Every live stub endpoint of this copy of the stub, by id.
static ENDPOINTS: Mutex<Option<HashMap<u64, Weak<Endpoint>>>> = Mutex::new(None);

fn endpoints() -> te_core::sync::MutexGuard<'static, Option<HashMap<u64, Weak<Endpoint>>>> {
    ENDPOINTS.lock()
}

/// What the Nth batch is made to suffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    Fail,
    FailPartway,
    Restart,
}

struct Job {
    peer: Weak<Endpoint>,
    requests: Vec<TransferRequest>,
    due: Instant,
    fault: Fault,
    done: Completion,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    stop: bool,
}

#[derive(Default)]
struct WorkerShared {
    queue: Mutex<Queue>,
    cond: Condvar,
}

impl WorkerShared {
    fn lock(&self) -> te_core::sync::MutexGuard<'_, Queue> {
        self.queue.lock()
    }
}

/// The in-process backend.
#[derive(Debug)]
pub struct StubBackend {
    info: BackendInfo,
    config: StubConfig,
    local: Arc<Endpoint>,
    peers: Arc<RwLock<HashMap<PeerId, Weak<Endpoint>>>>,
    batches: AtomicU64,
    shared: Arc<WorkerShared>,
    thread: Option<JoinHandle<()>>,
    thread_id: ThreadId,
}

impl std::fmt::Debug for WorkerShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WorkerShared")
    }
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
        let shared = Arc::new(WorkerShared::default());
        let peers = Arc::new(RwLock::new(HashMap::new()));
        let (s, me, c, p) = (shared.clone(), local.clone(), config.clone(), peers.clone());
        let thread = std::thread::Builder::new()
            .name("te-stub".into())
            .spawn(move || run(&s, &me, &c, &p))
            .map_err(|e| {
                Error::new(ErrorKind::Io, "cannot spawn the stub worker").with_source(e)
            })?;
        Ok(StubBackend {
            info: BackendInfo {
                name: crate::NAME.to_string(),
                version: env!("CARGO_PKG_VERSION").to_string(),
                capabilities: Capabilities {
                    // Device memory moves through its runtime's copies.
                    memory: std::iter::once("host")
                        .chain(te_core::device::runtimes().into_iter().map(|r| r.0))
                        .map(str::to_string)
                        .collect(),
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

fn endpoint_bytes(id: u64) -> Vec<u8> {
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
        let device = match &mem.kind {
            MemoryKind::Host => None,
            MemoryKind::Device { runtime, ordinal } => {
                Some((te_core::device::runtime(runtime)?, *ordinal))
            }
        };
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
        self.peers.write().insert(PeerId(id), ep);
        Ok(PeerId(id))
    }

    fn disconnect(&self, peer: PeerId, _deadline: Deadline) -> Result<()> {
        match self.peers.write().remove(&peer) {
            Some(_) => Ok(()),
            None => Err(Error::new(ErrorKind::PeerUnreachable, "unknown peer")),
        }
    }

    fn submit(&self, peer: PeerId, batch: &[TransferRequest], done: Completion) -> Result<()> {
        let ep = self.peers.read().get(&peer).cloned().ok_or_else(|| {
            Error::new(
                ErrorKind::PeerUnreachable,
                "the stub is not connected to that peer (connect again)",
            )
        })?;
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
            due: Instant::now() + self.config.delay,
            fault: self.fault(),
            done,
        };
        let mut q = self.shared.lock();
        if q.stop {
            return Err(Error::new(
                ErrorKind::Cancelled,
                "the stub backend is shutting down",
            ));
        }
        q.jobs.push_back(job);
        drop(q);
        self.shared.cond.notify_one();
        Ok(())
    }

    fn abort(&self, _peer: PeerId, batch: BatchId) {
        if self.config.ignore_abort {
            return;
        }
        // A queued batch has touched nothing yet: it is released at once. One being
        // copied sees its flag between requests.
        let job = {
            let mut q = self.shared.lock();
            let at = q.jobs.iter().position(|j| j.done.batch() == batch);
            at.and_then(|i| q.jobs.remove(i))
        };
        if let Some(job) = job {
            job.done.complete(Err(aborted()));
        }
    }
}

fn aborted() -> Error {
    Error::new(ErrorKind::Cancelled, "aborted before the stub ran it")
}

impl Drop for StubBackend {
    fn drop(&mut self) {
        if let Some(t) = endpoints().as_mut() {
            t.remove(&self.local.id);
        }
        let jobs = {
            let mut q = self.shared.lock();
            q.stop = true;
            std::mem::take(&mut q.jobs)
        };
        self.shared.cond.notify_all();
        // Queued batches complete as cancelled when their completions drop here.
        drop(jobs);
        if std::thread::current().id() != self.thread_id {
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }
}

fn run(
    shared: &WorkerShared,
    local: &Endpoint,
    config: &StubConfig,
    peers: &RwLock<HashMap<PeerId, Weak<Endpoint>>>,
) {
    let mut scratch = Vec::new();
    loop {
        let job = {
            let mut q = shared.lock();
            loop {
                if q.stop {
                    return;
                }
                let now = Instant::now();
                let pick = if config.reorder {
                    q.jobs.iter().rposition(|j| j.due <= now)
                } else {
                    q.jobs.front().filter(|j| j.due <= now).map(|_| 0)
                };
                if let Some(i) = pick {
                    break q.jobs.remove(i);
                }
                q = match q.jobs.iter().map(|j| j.due).min() {
                    Some(due) => {
                        shared
                            .cond
                            .wait_timeout(q, due.saturating_duration_since(now))
                            .0
                    }
                    None => shared.cond.wait(q),
                };
            }
        };
        let Some(job) = job else { continue };
        let result = execute(&job, local, config, &mut scratch);
        if job.fault == Fault::Restart {
            let id = job.peer.upgrade().map(|p| PeerId(p.id));
            if let Some(id) = id {
                peers.write().remove(&id);
            }
        }
        job.done.complete(result);
    }
}

fn execute(job: &Job, local: &Endpoint, config: &StubConfig, scratch: &mut Vec<u8>) -> Result<()> {
    let stops = |done: &Completion| done.is_aborted() && !config.ignore_abort;
    if stops(&job.done) {
        return Err(aborted());
    }
    match job.fault {
        Fault::Fail => {
            return Err(Error::new(
                ErrorKind::Backend,
                "injected failure (stub fail_every)",
            ))
        }
        Fault::Restart => {
            return Err(Error::new(
                ErrorKind::PeerRestarted,
                "injected restart (stub restart_every): the peer's stub endpoint restarted",
            ))
        }
        Fault::None | Fault::FailPartway => {}
    }
    let Some(remote) = job.peer.upgrade() else {
        return Err(Error::new(
            ErrorKind::PeerUnreachable,
            "the peer's stub endpoint is gone (its engine was dropped)",
        ));
    };
    // One engine connected to itself: one read lock serves both sides.
    let local_regions = read(local);
    let remote_guard;
    let remote_regions = if remote.id == local.id {
        &local_regions
    } else {
        remote_guard = read(&remote);
        &remote_guard
    };
    let total: u64 = job.requests.iter().map(|r| r.len).sum();
    let mut groups = Groups::default();
    let mut budget = match job.fault {
        Fault::FailPartway => total / 2,
        _ => u64::MAX,
    };
    for r in &job.requests {
        // The target's own check, against its own registrations.
        let l = region(&local_regions, r.local, r.local_offset, r.len, "local")?;
        let p = region(remote_regions, r.remote, r.remote_offset, r.len, "remote")?;
        let allowed = match r.op {
            Op::Read => p.access.remote_read,
            Op::Write => p.access.remote_write,
        };
        if !allowed {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                format!(
                    "the target refused a {} of region {}: no right",
                    r.op, r.remote
                ),
            ));
        }
        if stops(&job.done) {
            return Err(aborted());
        }
        if config.mode == Mode::Noop {
            continue;
        }
        let len = r.len.min(budget);
        let (src, dst) = match r.op {
            Op::Write => ((&l, r.local_offset), (&p, r.remote_offset)),
            Op::Read => ((&p, r.remote_offset), (&l, r.local_offset)),
        };
        copy(src, dst, len as usize, scratch, &mut groups)?;
        budget -= len;
        if budget == 0 {
            groups.run()?;
            return Err(Error::new(
                ErrorKind::Backend,
                "injected failure after part of the data moved (stub fail_partway_every)",
            ));
        }
    }
    groups.run()
}

/// The batch's device copies, one group per runtime: each group is enqueued at once
/// and synchronised once, as a fabric's copy engine would.
#[derive(Default)]
struct Groups(Vec<(Arc<dyn DeviceRuntime>, Vec<DeviceCopy>)>);

impl Groups {
    fn add(&mut self, rt: &Arc<dyn DeviceRuntime>, c: DeviceCopy) {
        match self.0.iter_mut().find(|(r, _)| Arc::ptr_eq(r, rt)) {
            Some((_, v)) => v.push(c),
            None => self.0.push((rt.clone(), vec![c])),
        }
    }

    /// Runs every group and waits until all have completed.
    fn run(&mut self) -> Result<()> {
        let groups = std::mem::take(&mut self.0);
        let (tx, rx) = std::sync::mpsc::channel();
        let mut started = 0;
        let mut first = Ok(());
        for (rt, copies) in &groups {
            let tx = tx.clone();
            // SAFETY: every range was checked against a live registration whose read
            // lock the caller holds until this returns, which is after every started
            // group has completed.
            match unsafe { rt.copy_group(copies, Box::new(move |r| drop(tx.send(r)))) } {
                Ok(()) => started += 1,
                Err(e) => first = first.and(Err(e)),
            }
        }
        for _ in 0..started {
            let r = rx.recv().unwrap_or_else(|_| {
                Err(Error::new(
                    ErrorKind::Backend,
                    "a device runtime dropped a copy group",
                ))
            });
            first = first.and(r);
        }
        first
    }
}

/// Largest piece of a copy between devices staged through the scratch buffer.
const STAGE: usize = 4 << 20;

/// Copies `len` bytes between two checked regions: host to host at once; through their
/// runtimes where they are device memory, into `groups` (device to device, not
/// through the host, on one device of one runtime).
fn copy(
    src: (&Region, u64),
    dst: (&Region, u64),
    len: usize,
    scratch: &mut Vec<u8>,
    groups: &mut Groups,
) -> Result<()> {
    let (s, d) = (src.0.addr + src.1, dst.0.addr + dst.1);
    match (&src.0.device, &dst.0.device) {
        // SAFETY: both ranges were checked against live registrations whose read locks
        // the caller holds; host ranges are only reached through raw pointers; `copy`
        // allows overlap (one engine writing into itself).
        (None, None) => unsafe { std::ptr::copy(s as *const u8, d as *mut u8, len) },
        (None, Some((rt, ordinal))) => groups.add(
            rt,
            DeviceCopy::ToDevice {
                ordinal: *ordinal,
                device: d,
                host: s as *const u8,
                len,
            },
        ),
        (Some((rt, ordinal)), None) => groups.add(
            rt,
            DeviceCopy::ToHost {
                ordinal: *ordinal,
                device: s,
                host: d as *mut u8,
                len,
            },
        ),
        (Some((srt, so)), Some((drt, dord))) if Arc::ptr_eq(srt, drt) && so == dord => groups.add(
            srt,
            DeviceCopy::DeviceToDevice {
                src_ordinal: *so,
                src: s,
                dst_ordinal: *dord,
                dst: d,
                len,
            },
        ),
        (Some((srt, so)), Some((drt, dord))) => {
            scratch.resize(len.min(STAGE), 0);
            let mut done = 0;
            while done < len {
                let n = (len - done).min(STAGE);
                let (from, to, host) = (s + done as u64, d + done as u64, scratch.as_mut_ptr());
                // SAFETY: as above; `scratch` is ours, at least `n` bytes long, and
                // each copy has completed (`copy_sync`) before the next reuses it.
                unsafe {
                    srt.copy_sync(DeviceCopy::ToHost {
                        ordinal: *so,
                        device: from,
                        host,
                        len: n,
                    })?;
                    drt.copy_sync(DeviceCopy::ToDevice {
                        ordinal: *dord,
                        device: to,
                        host,
                        len: n,
                    })?;
                }
                done += n;
            }
        }
    }
    Ok(())
}

fn read(e: &Endpoint) -> RwLockReadGuard<'_, HashMap<RegionId, Region>> {
    e.regions.read()
}

fn region(
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
    if offset.checked_add(len).is_none_or(|end| end > r.len) {
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
