//! The stub's `TransferBackend`: a process-wide endpoint table and one worker thread
//! per backend instance that performs the copies in submission order.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock, RwLockReadGuard, Weak};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use te_core::device::{DeviceCopy, DeviceRuntime};
use te_core::{
    Access, BackendInfo, Capabilities, Completion, Error, ErrorKind, MemoryDesc, MemoryKind, Op,
    PeerId, RegionId, Result, SegmentDesc, TransferBackend, TransferRequest,
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
    id: u64,
    regions: RwLock<HashMap<RegionId, Region>>,
}

/// Every live stub endpoint of this copy of the stub, by id.
static ENDPOINTS: Mutex<Option<HashMap<u64, Weak<Endpoint>>>> = Mutex::new(None);

fn endpoints() -> std::sync::MutexGuard<'static, Option<HashMap<u64, Weak<Endpoint>>>> {
    ENDPOINTS.lock().unwrap_or_else(|p| p.into_inner())
}

struct Job {
    peer: Weak<Endpoint>,
    requests: Vec<TransferRequest>,
    due: Instant,
    fail: bool,
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

/// The in-process backend.
#[derive(Debug)]
pub struct StubBackend {
    info: BackendInfo,
    config: StubConfig,
    local: Arc<Endpoint>,
    peers: RwLock<HashMap<PeerId, Weak<Endpoint>>>,
    batches: AtomicU64,
    worker: Worker,
}

#[derive(Debug)]
struct Worker {
    shared: Arc<WorkerShared>,
    thread: Option<JoinHandle<()>>,
    thread_id: ThreadId,
}

impl WorkerShared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl std::fmt::Debug for WorkerShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WorkerShared")
    }
}

impl StubBackend {
    /// A new stub endpoint with its worker thread.
    ///
    /// # Errors
    /// `Io` if the worker thread cannot start.
    pub fn new(config: StubConfig) -> Result<StubBackend> {
        let local = Arc::new(Endpoint {
            id: rand_id(),
            regions: RwLock::new(HashMap::new()),
        });
        endpoints()
            .get_or_insert_with(HashMap::new)
            .insert(local.id, Arc::downgrade(&local));
        let shared = Arc::new(WorkerShared::default());
        let (s, me) = (shared.clone(), local.clone());
        let mode = config.mode;
        let thread = std::thread::Builder::new()
            .name("te-stub".into())
            .spawn(move || run(&s, &me, mode))
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
                },
            },
            config,
            local,
            peers: RwLock::new(HashMap::new()),
            batches: AtomicU64::new(0),
            worker: Worker {
                thread_id: thread.thread().id(),
                shared,
                thread: Some(thread),
            },
        })
    }
}

fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.finish()
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
        self.local
            .regions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, region);
        Ok(Vec::new())
    }

    fn deregister(&self, id: RegionId) -> Result<()> {
        // The write lock waits for copies under way (they hold the read lock).
        match self
            .local
            .regions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id)
        {
            Some(_) => Ok(()),
            None => Err(Error::new(
                ErrorKind::NotRegistered,
                format!("region {id} is not registered with the stub"),
            )),
        }
    }

    fn connect(&self, peer: &SegmentDesc) -> Result<PeerId> {
        let bytes: [u8; 12] = peer.endpoint.as_slice().try_into().map_err(|_| {
            Error::new(
                ErrorKind::Protocol,
                format!("a stub endpoint is 12 bytes, got {}", peer.endpoint.len()),
            )
        })?;
        let id = u64::from_le_bytes(bytes[..8].try_into().unwrap_or_default());
        let pid = u32::from_le_bytes(bytes[8..].try_into().unwrap_or_default());
        if pid != std::process::id() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "the stub backend connects engines of one process only; the peer is process {pid}; use tcp across processes"
                ),
            ));
        }
        let ep = endpoints().as_ref().and_then(|t| t.get(&id)).cloned();
        if ep.as_ref().and_then(Weak::upgrade).is_none() {
            return Err(Error::new(
                ErrorKind::PeerUnreachable,
                "no live stub endpoint with that id here: its engine is gone, or uses another copy of the stub (built in vs. plugin)",
            ));
        }
        let peer_id = PeerId(id);
        self.peers
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(peer_id, ep.unwrap_or_default());
        Ok(peer_id)
    }

    fn disconnect(&self, peer: PeerId) -> Result<()> {
        match self
            .peers
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&peer)
        {
            Some(_) => Ok(()),
            None => Err(Error::new(ErrorKind::PeerUnreachable, "unknown peer")),
        }
    }

    fn submit(&self, peer: PeerId, batch: &[TransferRequest], done: Completion) -> Result<()> {
        let Some(ep) = self
            .peers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&peer)
            .cloned()
        else {
            return Err(Error::new(
                ErrorKind::PeerUnreachable,
                "the stub is not connected to that peer",
            ));
        };
        if ep.strong_count() == 0 {
            return Err(Error::new(
                ErrorKind::PeerUnreachable,
                "the peer's stub endpoint is gone (its engine was dropped)",
            ));
        }
        let n = self.batches.fetch_add(1, Ordering::Relaxed) + 1;
        let fail = self.config.fail_every > 0 && n % self.config.fail_every == 0;
        let job = Job {
            peer: ep,
            requests: batch.to_vec(),
            due: Instant::now() + self.config.delay,
            fail,
            done,
        };
        let mut q = self.worker.shared.lock();
        if q.stop {
            return Err(Error::new(
                ErrorKind::Cancelled,
                "the stub backend is shutting down",
            ));
        }
        q.jobs.push_back(job);
        drop(q);
        self.worker.shared.cond.notify_one();
        Ok(())
    }
}

impl Drop for StubBackend {
    fn drop(&mut self) {
        if let Some(t) = endpoints().as_mut() {
            t.remove(&self.local.id);
        }
        let jobs = {
            let mut q = self.worker.shared.lock();
            q.stop = true;
            std::mem::take(&mut q.jobs)
        };
        self.worker.shared.cond.notify_all();
        // Queued batches complete as cancelled when their completions drop here.
        drop(jobs);
        if std::thread::current().id() != self.worker.thread_id {
            if let Some(t) = self.worker.thread.take() {
                let _ = t.join();
            }
        }
    }
}

fn run(shared: &WorkerShared, local: &Endpoint, mode: Mode) {
    let mut scratch = Vec::new();
    loop {
        let job = {
            let mut q = shared.lock();
            loop {
                if q.stop {
                    return;
                }
                match q.jobs.front() {
                    Some(j) if j.due <= Instant::now() => break q.jobs.pop_front(),
                    Some(j) => {
                        let wait = j.due.saturating_duration_since(Instant::now());
                        q = shared
                            .cond
                            .wait_timeout(q, wait)
                            .unwrap_or_else(|p| p.into_inner())
                            .0;
                    }
                    None => q = shared.cond.wait(q).unwrap_or_else(|p| p.into_inner()),
                }
            }
        };
        let Some(job) = job else { continue };
        let result = execute(&job, local, mode, &mut scratch);
        job.done.complete(result);
    }
}

fn execute(job: &Job, local: &Endpoint, mode: Mode, scratch: &mut Vec<u8>) -> Result<()> {
    if job.done.remaining().is_zero() {
        return Err(Error::new(
            ErrorKind::Timeout,
            "the batch's deadline passed before the stub ran it",
        ));
    }
    if job.fail {
        return Err(Error::new(
            ErrorKind::Backend,
            "injected failure (stub fail_every)",
        ));
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
    for r in &job.requests {
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
        if mode == Mode::Noop {
            continue;
        }
        let (src, dst) = match r.op {
            Op::Write => ((&l, r.local_offset), (&p, r.remote_offset)),
            Op::Read => ((&p, r.remote_offset), (&l, r.local_offset)),
        };
        copy(src, dst, r.len as usize, job.done.remaining(), scratch)?;
    }
    Ok(())
}

/// Largest piece of a device-to-device copy staged through the scratch buffer.
const STAGE: usize = 4 << 20;

/// Copies `len` bytes between two checked regions, through their runtimes where they
/// are device memory.
fn copy(
    src: (&Region, u64),
    dst: (&Region, u64),
    len: usize,
    timeout: Duration,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let (s, d) = (src.0.addr + src.1, dst.0.addr + dst.1);
    // SAFETY (all arms): both ranges were checked against live registrations whose read
    // locks the caller holds, so deregistration (and with it freeing) waits until this
    // copy ends; host ranges are only reached through raw pointers.
    match (&src.0.device, &dst.0.device) {
        // `copy` allows overlap (one engine writing into itself).
        (None, None) => unsafe { std::ptr::copy(s as *const u8, d as *mut u8, len) },
        (None, Some((rt, ordinal))) => unsafe {
            rt.copy_sync(
                DeviceCopy::ToDevice {
                    ordinal: *ordinal,
                    device: d,
                    host: s as *const u8,
                    len,
                },
                timeout,
            )?
        },
        (Some((rt, ordinal)), None) => unsafe {
            rt.copy_sync(
                DeviceCopy::ToHost {
                    ordinal: *ordinal,
                    device: s,
                    host: d as *mut u8,
                    len,
                },
                timeout,
            )?
        },
        (Some((srt, so)), Some((drt, dord))) => {
            scratch.resize(len.min(STAGE), 0);
            let mut done = 0;
            while done < len {
                let n = (len - done).min(STAGE);
                let (from, to, host) = (s + done as u64, d + done as u64, scratch.as_mut_ptr());
                // SAFETY: as above; `scratch` is ours and at least `n` bytes long.
                unsafe {
                    srt.copy_sync(
                        DeviceCopy::ToHost {
                            ordinal: *so,
                            device: from,
                            host,
                            len: n,
                        },
                        timeout,
                    )?;
                    drt.copy_sync(
                        DeviceCopy::ToDevice {
                            ordinal: *dord,
                            device: to,
                            host,
                            len: n,
                        },
                        timeout,
                    )?;
                }
                done += n;
            }
        }
    }
    Ok(())
}

fn read(e: &Endpoint) -> RwLockReadGuard<'_, HashMap<RegionId, Region>> {
    e.regions.read().unwrap_or_else(|p| p.into_inner())
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
