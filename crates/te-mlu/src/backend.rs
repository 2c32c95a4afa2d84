//! The mlu backend's `TransferBackend`: one-sided copies between MLU memory of engines
//! on one host, over MLU-Link.
//!
//! - Endpoint: the backend instance's id, the abstract socket that hands out its region
//!   table (see `shm` and `handoff`), the host's identity (host name and boot id) and
//!   the PCI bus ids of the MLUs this process sees (ordinals differ between processes
//!   with different `MLU_VISIBLE_DEVICES`; bus ids do not).
//! - `register`: a remotely accessible `mlu:N` region's key carries the IPC handle of
//!   its allocation (`cnrtAcquireMemHandle`), the generation of that export (te's
//!   name for the allocation, whatever handle values CNRT gives) and the region's
//!   offset in it, plus its slot in the region table.
//! - `connect` (module `peers`): refuses peers on other hosts; receives the peer's region
//!   table over its socket (`SCM_RIGHTS`); maps each of the peer's regions into this
//!   process (`cnrtMapMemHandle`, once per allocation and generation) or, for a peer in
//!   this process, uses its addresses as they are.
//! - `submit`: checks every request against both sides' regions again, counts the batch
//!   in on each region it touches (so deregistration on either side waits for it), and
//!   hands it to a worker thread, which enqueues all the batch's copies
//!   (`cnrtMemcpyAsync*`, or `cnrtMemcpyPeerAsync` between two MLUs) on its own queue
//!   per MLU, making the queue's MLU current before each, and then waits once per queue:
//!   `cnrtQueueQuery`, and if work remains, `cnrtQueueSync` (which sleeps: the runtime
//!   set `cnrtDeviceScheduleBlock`). A copy CNRT refuses as busy (a full queue) waits
//!   for its queue and is tried once more; refused again, it fails the batch as
//!   `Busy`. A failed enqueue or sync fails that batch only; the queue is replaced.
//! - `deregister`: marks the region dead in the table and waits for every batch counted
//!   in on it, this process's and peers'; past the caller's deadline it returns
//!   `Timeout`, never `Ok`, and the region stays refused and counted.

use std::collections::HashMap;
use std::sync::Arc;
use std::thread::{JoinHandle, ThreadId};
use std::time::Instant;
use te_core::kit::fits;
use te_core::kit::thread::SpawnMasked as _;
use te_core::peer_table::PeerTable;
use te_core::sync::RwLock;
use te_core::worker::DueQueue;

use te_core::{
    BackendContext, BackendInfo, BatchId, Capabilities, Completion, Deadline, Error, ErrorKind,
    MemoryDesc, MemoryKind, Op, PeerId, RegionId, Result, SegmentDesc, TransferBackend,
    TransferRequest,
};

use crate::config::MluConfig;
use crate::endpoint::{host_identity, Endpoint, Ipc, Key};
use crate::ffi::{dir, IpcHandle};
use crate::handoff::{self, Server};
use crate::peers::PeerState;
use crate::runtime::{self, MluRuntime, RUNTIME};
use crate::shm::{handle_word, Extent, Table};
use crate::worker::{worker, Copy, Guard, Job, Kind};

/// Where a region's bytes are, as this process addresses them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mem {
    Host,
    /// A local MLU ordinal.
    Mlu(u32),
}

#[derive(Debug)]
struct Local {
    addr: u64,
    /// Its length: no request reaches past it, whatever the engine checked.
    len: u64,
    mem: Mem,
    slot: u32,
    /// The base of the allocation whose IPC handle the region's key carries, and the
    /// handle.
    export: Option<(u64, IpcHandle)>,
}

/// The intra-host MLU-Link backend.
pub struct MluBackend {
    info: BackendInfo,
    pub(crate) config: MluConfig,
    pub(crate) rt: Arc<MluRuntime>,
    pub(crate) endpoint: Endpoint,
    /// `peerable[a][b]`: mlu:a can copy to and from mlu:b (cnrtGetPeerAccessibility).
    peerable: Vec<Vec<bool>>,
    pub(crate) table: Arc<Table>,
    _server: Server,
    locals: RwLock<HashMap<RegionId, Local>>,
    pub(crate) peers: PeerTable<Arc<PeerState>>,
    shared: Arc<DueQueue<Job>>,
    threads: Vec<JoinHandle<()>>,
    thread_ids: Vec<ThreadId>,
}

impl std::fmt::Debug for MluBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MluBackend")
            .field("instance", &self.endpoint.instance)
            .field("config", &self.config)
            .finish()
    }
}

fn region_error(kind: ErrorKind, m: String) -> Error {
    Error::new(kind, m).with_operation("transfer")
}

/// `base + offset`, if `len` bytes from there lie inside the 64-bit address space.
fn span_at(base: u64, offset: u64, len: u64) -> Option<u64> {
    base.checked_add(offset)
        .filter(|at| at.checked_add(len).is_some())
}

impl MluBackend {
    /// A backend instance with its region table and worker threads.
    ///
    /// # Errors
    /// `Unavailable` without CNRT or MLUs; `ConfigInvalid` for a bad option; `Io` if
    /// the table or the threads cannot be created.
    pub fn new(config: MluConfig, ctx: &BackendContext) -> Result<MluBackend> {
        // A table parsed by te-core is validated already; a config made in code is here.
        te_core::BackendConfig::validate(&config)?;
        let rt = runtime::instance()?;
        let cnrt = rt.cnrt().clone();
        let devices = te_core::device::DeviceRuntime::device_count(&*rt)?;
        let buses = (0..devices)
            .map(|d| cnrt.pci_bus_id(d))
            .collect::<Result<Vec<_>>>()?;
        let peerable = (0..devices)
            .map(|a| {
                (0..devices)
                    .map(|b| a == b || cnrt.peer_accessible(a, b).unwrap_or(false))
                    .collect()
            })
            .collect();
        // The engine's epoch names this instance (a random one outside an engine).
        let instance = ctx.epoch_or_random();
        let table = Arc::new(Table::create(instance)?);
        let server = Server::start(instance, table.fd())?;
        crate::peers::publish(instance, &table);
        let endpoint = Endpoint {
            instance,
            socket: handoff::socket_name(instance),
            host: host_identity(),
            buses,
        };
        let shared = Arc::new(DueQueue::default());
        let mut threads = Vec::new();
        for i in 0..config.workers {
            let (s, c) = (shared.clone(), cnrt.clone());
            let t = std::thread::Builder::new()
                .name(format!("te-mlu-{i}"))
                .spawn_masked(move || worker(&s, &c))
                .map_err(|e| {
                    Error::new(ErrorKind::Io, "cannot start an mlu worker thread").with_source(e)
                })?;
            threads.push(t);
        }
        Ok(MluBackend {
            info: BackendInfo {
                name: crate::NAME.to_string(),
                version: env!("CARGO_PKG_VERSION").to_string(),
                capabilities: Capabilities {
                    memory: vec![RUNTIME.to_string(), "host".to_string()],
                    read: true,
                    write: true,
                    cross_process: true,
                    same_host_only: true,
                    max_request_size: isize::MAX as u64,
                    // The peer's own region table, not the descriptor, bounds every copy.
                    checks_at_target: true,
                },
            },
            thread_ids: threads.iter().map(|t| t.thread().id()).collect(),
            threads,
            config,
            rt,
            endpoint,
            peerable,
            table,
            _server: server,
            locals: RwLock::new(HashMap::new()),
            peers: PeerTable::new(crate::NAME),
            shared,
        })
    }
}

impl TransferBackend for MluBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn endpoint(&self) -> Vec<u8> {
        self.endpoint.encode()
    }

    fn register(&self, id: RegionId, mem: &MemoryDesc) -> Result<Vec<u8>> {
        let remote = mem.access.remote_read || mem.access.remote_write;
        let (kind, ipc, export) = match &mem.kind {
            MemoryKind::Host => (Mem::Host, None, None),
            MemoryKind::Device { runtime, ordinal } if runtime == RUNTIME => {
                let info = te_core::device::DeviceRuntime::pointer_info(&*self.rt, mem.addr)?;
                if remote {
                    let (handle, generation) = self.rt.export(&info)?;
                    let ipc = Ipc {
                        handle,
                        generation,
                        offset: mem.addr - info.base,
                    };
                    (Mem::Mlu(*ordinal), Some(ipc), Some((info.base, handle)))
                } else {
                    (Mem::Mlu(*ordinal), None, None)
                }
            }
            other => {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!("the mlu backend moves mlu:N and host memory, not {other}"),
                ))
            }
        };
        let extent = Extent {
            addr: mem.addr,
            offset: ipc.map_or(0, |i| i.offset),
            handle: handle_word(ipc),
            generation: ipc.map_or(0, |i| i.generation),
            len: mem.len,
            read: mem.access.remote_read,
            write: mem.access.remote_write,
        };
        let slot = match self.table.claim(id.0, extent) {
            Ok(slot) => slot,
            Err(e) => {
                if let Some((base, h)) = export {
                    self.rt.release_handle(base, h);
                }
                return Err(e);
            }
        };
        self.locals.write().insert(
            id,
            Local {
                addr: mem.addr,
                len: mem.len,
                mem: kind,
                slot,
                export,
            },
        );
        Ok(Key { slot, ipc }.encode())
    }

    fn deregister(&self, id: RegionId, deadline: Deadline) -> Result<()> {
        let Some(local) = self.locals.write().remove(&id) else {
            return Err(Error::new(
                ErrorKind::NotRegistered,
                format!("region {id} is not registered with the mlu backend"),
            ));
        };
        if self.table.retire(local.slot, deadline.remaining()) {
            if let Some((base, h)) = local.export {
                self.rt.release_handle(base, h);
            }
            return Ok(());
        }
        // A batch (of this process or a peer's) may still copy: the region stays
        // registered, dead in the table so no new batch enters it.
        self.locals.write().insert(id, local);
        Err(Error::new(
            ErrorKind::Timeout,
            format!("region {id} is still used by batches at the deadline: a peer may still be copying into or out of it, so its memory must stay allocated; deregister it again later (a peer process that died holding it keeps it forever: restart this engine to reclaim it)"),
        )
        .with_operation("deregister"))
    }

    fn connect(&self, peer: &SegmentDesc, deadline: Deadline) -> Result<PeerId> {
        self.connect_peer(peer, deadline)
    }

    fn disconnect(&self, peer: PeerId, _deadline: Deadline) -> Result<()> {
        self.peers.remove(peer).map(drop)
    }

    fn submit(&self, peer: PeerId, batch: &[TransferRequest], done: Completion) -> Result<()> {
        let p = self.peers.get(peer)?;
        let mut copies = Vec::with_capacity(batch.len());
        let mut guards: Vec<Guard> = Vec::new();
        let mut maps = Vec::new();
        let mut entered: Vec<(bool, u32)> = Vec::new();
        {
            let locals = self.locals.read();
            let remotes = p.regions.read();
            for r in batch {
                let l = locals.get(&r.local).ok_or_else(|| {
                    region_error(
                        ErrorKind::NotRegistered,
                        format!("local region {} is not registered", r.local),
                    )
                })?;
                let rm = remotes.get(&r.remote).ok_or_else(|| {
                    region_error(
                        ErrorKind::NotRegistered,
                        format!("region {} is not in the peer's descriptor as this backend knows it (connect again)", r.remote),
                    )
                })?;
                // The engine checked the request against both regions (bounds,
                // rights), but the backend does not rely on it: the local region is
                // checked here, the peer's own table below, when it is entered.
                if !fits(r.local_offset, r.len, l.len) {
                    return Err(region_error(
                        ErrorKind::OutOfBounds,
                        format!(
                            "local range {}+{} is outside local region {} of {} bytes: a request must lie inside the region it names",
                            r.local_offset, r.len, r.local, l.len
                        ),
                    ));
                }
                let raddr = rm.addr.clone()?;
                let (Some(l_at), Some(r_at)) = (
                    span_at(l.addr, r.local_offset, r.len),
                    span_at(raddr, r.remote_offset, r.len),
                ) else {
                    return Err(region_error(
                        ErrorKind::OutOfBounds,
                        format!(
                            "{} bytes at offset {} of local region {} and offset {} of the peer's region {} run past the end of the address space",
                            r.len, r.local_offset, r.local, r.remote_offset, r.remote
                        ),
                    ));
                };
                let ((src, smem), (dst, dmem)) = match r.op {
                    Op::Write => ((l_at, l.mem), (r_at, rm.mem)),
                    Op::Read => ((r_at, rm.mem), (l_at, l.mem)),
                };
                let kind = match (smem, dmem) {
                    (Mem::Host, Mem::Host) => Kind::HostToHost,
                    (Mem::Host, Mem::Mlu(d)) => Kind::Queue {
                        dev: d,
                        dir: dir::HOST_TO_DEV,
                    },
                    (Mem::Mlu(s), Mem::Host) => Kind::Queue {
                        dev: s,
                        dir: dir::DEV_TO_HOST,
                    },
                    (Mem::Mlu(s), Mem::Mlu(d)) if s == d => Kind::Queue {
                        dev: s,
                        dir: dir::DEV_TO_DEV,
                    },
                    (Mem::Mlu(s), Mem::Mlu(d))
                        if !self
                            .peerable
                            .get(s as usize)
                            .and_then(|row| row.get(d as usize))
                            .copied()
                            .unwrap_or(false) =>
                    {
                        return Err(region_error(
                            ErrorKind::Unsupported,
                            format!("mlu:{s} and mlu:{d} cannot reach each other (cnrtGetPeerAccessibility says no MLU-Link between them); stage through host memory or use another device"),
                        ));
                    }
                    (Mem::Mlu(s), Mem::Mlu(d)) => Kind::Peer {
                        dev: match l.mem {
                            Mem::Mlu(x) => x,
                            Mem::Host => s,
                        },
                        dst: d,
                        src: s,
                    },
                };
                copies.push(Copy {
                    dst,
                    src,
                    len: r.len as usize,
                    kind,
                });
                for (is_local, table, slot, region) in [
                    (true, &self.table, l.slot, r.local.0),
                    (false, &p.table, rm.slot, r.remote.0),
                ] {
                    if entered.contains(&(is_local, slot)) {
                        continue;
                    }
                    if !table.enter(slot, region) {
                        let side = if is_local { "local" } else { "the peer's" };
                        if !is_local {
                            drop((remotes, locals));
                            p.forget(r.remote);
                        }
                        return Err(region_error(
                            ErrorKind::NotRegistered,
                            format!("{side} region {region} was deregistered"),
                        ));
                    }
                    entered.push((is_local, slot));
                    guards.push(Guard {
                        table: table.clone(),
                        slot,
                    });
                    // Only a job holds the peer's mappings beyond the region table's
                    // lock, so once its guards are gone (it drops its mappings first),
                    // nothing of a batch keeps a deregistered allocation mapped.
                    if !is_local {
                        maps.extend(rm.mapping.clone());
                    }
                }
                // Counted in, the slot cannot change under us: check the request
                // against the owner's own word on the region, not the descriptor.
                let Some(ext) = p.table.extent(rm.slot, r.remote.0) else {
                    drop((remotes, locals));
                    p.forget(r.remote);
                    return Err(region_error(
                        ErrorKind::NotRegistered,
                        format!("the peer's region {} was deregistered", r.remote),
                    ));
                };
                if ext.origin() != rm.origin {
                    return Err(region_error(
                        ErrorKind::Protocol,
                        format!("the descriptor of the peer's region {} disagrees with the peer's own region table (a stale or forged descriptor): connect again", r.remote),
                    ));
                }
                if !fits(r.remote_offset, r.len, ext.len) {
                    return Err(region_error(
                        ErrorKind::OutOfBounds,
                        format!(
                            "the peer refuses range {}+{} of its region {} of {} bytes",
                            r.remote_offset, r.len, r.remote, ext.len
                        ),
                    ));
                }
                if !fits(r.remote_offset, r.len, rm.room) {
                    return Err(region_error(
                        ErrorKind::Protocol,
                        format!(
                            "range {}+{} of the peer's region {} runs past the end of the allocation this process maps for it ({} bytes from the region's start), though the peer's table gives the region {} bytes: the peer's region table is forged or corrupt",
                            r.remote_offset, r.len, r.remote, rm.room, ext.len
                        ),
                    ));
                }
                if !match r.op {
                    Op::Read => ext.read,
                    Op::Write => ext.write,
                } {
                    return Err(region_error(
                        ErrorKind::InvalidRequest,
                        format!(
                            "the peer's region {} does not allow remote {}s",
                            r.remote, r.op
                        ),
                    ));
                }
            }
        }
        let job = Job {
            copies,
            maps,
            guards,
            done,
        };
        self.shared
            .push(Instant::now() + self.config.debug_delay, job)
            .map_err(|_| Error::new(ErrorKind::Cancelled, "the mlu backend is shutting down"))
    }

    fn abort(&self, _peer: PeerId, batch: BatchId) {
        // A batch still queued has touched nothing: it is released at once. One whose
        // copies are enqueued is released when its queues have been synchronised.
        if let Some(job) = self.shared.remove(|j| j.done.batch() == batch) {
            job.complete(Err(Error::new(
                ErrorKind::Cancelled,
                "aborted before its copies started",
            )));
        }
    }
}

impl Drop for MluBackend {
    fn drop(&mut self) {
        crate::peers::withdraw(self.endpoint.instance);
        for local in self.locals.get_mut().values() {
            if let Some((base, h)) = local.export {
                self.rt.release_handle(base, h);
            }
        }
        let jobs = self.shared.stop();
        // Queued batches complete as cancelled when their completions drop here.
        drop(jobs);
        let me = std::thread::current().id();
        if !self.thread_ids.contains(&me) {
            for t in self.threads.drain(..) {
                let _ = t.join();
            }
        }
    }
}
