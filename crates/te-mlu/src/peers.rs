//! Peers of the mlu backend: `connect` checks that the peer is on this host, receives
//! its region table over its socket (`SCM_RIGHTS`), and resolves each of its regions to
//! an address usable here: mapped from the allocation's IPC handle
//! (`cnrtMapMemHandle`, once per allocation), or, for a peer in this process, its
//! address as it is.
//!
//! A mapping is known by its handle value and the generation the owner gave that
//! export, never by the handle value alone: CNRT may give a new allocation at a freed
//! base the freed one's handle value, and a mapping of the freed allocation reached
//! through it would read and write memory the owner no longer registers. Mappings are
//! shared by every backend of this process, and one handle value is mapped for one
//! generation at a time (CNRT may answer a handle value mapped already with the
//! mapping it has); a mapping is unmapped once no region known here and no batch
//! holds it. Regions the owner deregistered are let go at once: each peer reached
//! through mappings has a thread asleep on its owner's region table ([`watch`]), which
//! the owner's `deregister` wakes; and at each `connect`, and wherever a batch finds
//! one gone.
//!
//! Whether a peer is in this process is never taken from its endpoint, which any
//! process can forge: it is a peer whose instance is one of this process's live
//! backends ([`publish`]), and it is then served from that backend's own table.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Weak};
use te_core::kit::thread::SpawnMasked as _;
use te_core::sync::{Condvar, Mutex, RwLock};

use te_core::kit::fits;
use te_core::{Deadline, Error, ErrorKind, MemoryKind, PeerId, RegionId, Result, SegmentDesc};

use crate::backend::{Mem, MluBackend};
use crate::config::IpcMode;
use crate::endpoint::{Endpoint, Ipc, Key};
use crate::ffi::IpcHandle;
use crate::handoff;
use crate::runtime::{MluRuntime, RUNTIME};
use crate::shm::{handle_word, Table};

/// The peers' allocations this process maps, by IPC handle value: the generation of
/// the export mapped, and the mapping while anything holds it.
///
/// An entry goes only when its mapping is unmapped (`Mapping::drop`), so a handle value
/// is never mapped again while a mapping of it is still being undone.
static MAPPINGS: Mutex<BTreeMap<IpcHandle, (u64, Weak<Mapping>)>> = Mutex::new(BTreeMap::new());

/// Notified when a mapping is gone from [`MAPPINGS`].
static UNMAPPED: Condvar = Condvar::new();

/// The peers of this process's backend instances, so that regions a peer deregistered
/// can be let go wherever they are known ([`let_go_of_deregistered`]).
static PEERS: Mutex<Vec<Weak<PeerState>>> = Mutex::new(Vec::new());

/// The region tables of this process's live backend instances, by instance id.
static LOCAL_TABLES: Mutex<BTreeMap<u64, Weak<Table>>> = Mutex::new(BTreeMap::new());

/// Makes backend instance `instance`, with `table`, known to this process's other
/// instances as one of theirs.
pub(crate) fn publish(instance: u64, table: &Arc<Table>) {
    let mut tables = LOCAL_TABLES.lock();
    tables.retain(|_, t| t.strong_count() > 0);
    tables.insert(instance, Arc::downgrade(table));
}

/// Forgets backend instance `instance` (it is being dropped).
pub(crate) fn withdraw(instance: u64) {
    LOCAL_TABLES.lock().remove(&instance);
}

/// The table of `instance` if it is a live backend instance of this process.
fn local_table(instance: u64) -> Option<Arc<Table>> {
    LOCAL_TABLES.lock().get(&instance).and_then(Weak::upgrade)
}

/// A peer's allocation mapped into this process; unmapped when the last user (a region
/// known here, or a batch) goes.
#[derive(Debug)]
pub(crate) struct Mapping {
    rt: Arc<MluRuntime>,
    handle: IpcHandle,
    ordinal: u32,
    addr: u64,
    /// Its bytes from `addr` on, as CNRT reports them for the mapped address: the
    /// most that any region of it may reach, whatever its owner claims.
    len: u64,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let mut maps = MAPPINGS.lock();
        if let Err(e) = self.rt.unmap(self.ordinal, self.addr) {
            tracing::warn!(error = %e, "unmapping a peer's MLU memory failed");
        }
        let me: *const Mapping = self;
        if maps
            .get(&self.handle)
            .is_some_and(|(_, m)| std::ptr::eq(m.as_ptr(), me))
        {
            maps.remove(&self.handle);
        }
        drop(maps);
        UNMAPPED.notify_all();
    }
}

#[derive(Debug)]
pub(crate) struct Remote {
    /// The address usable here, or why the region cannot be reached from here.
    pub(crate) addr: std::result::Result<u64, Error>,
    pub(crate) mapping: Option<Arc<Mapping>>,
    /// The bytes from the region's start to the end of its mapped allocation: a
    /// request must end inside them whatever the owner's table says of the region's
    /// length, which its owner may rewrite at any time. Unbounded (`u64::MAX`) for a
    /// region reached directly, which is this process's own.
    pub(crate) room: u64,
    pub(crate) mem: Mem,
    pub(crate) slot: u32,
    /// The descriptor's address, and the key's offset in the allocation, its IPC
    /// handle (as `shm::handle_word`) and the export's generation, which must agree
    /// with the peer's own region table (`shm::Extent::origin`).
    pub(crate) origin: (u64, u64, u64, u64),
}

#[derive(Debug)]
pub(crate) struct PeerState {
    pub(crate) endpoint: Endpoint,
    /// The peer is a backend instance of this process (found by [`local_table`]).
    pub(crate) same_process: bool,
    pub(crate) table: Arc<Table>,
    pub(crate) regions: RwLock<HashMap<RegionId, Arc<Remote>>>,
    /// Set when this state goes, so that its watcher ([`watch`]) stops.
    gone: Arc<AtomicBool>,
}

impl Drop for PeerState {
    fn drop(&mut self) {
        self.gone.store(true, SeqCst);
        // Moved, so that a watcher about to sleep on the count it read does not.
        self.table.signal_change();
    }
}

/// A peer's watcher: lets go of the peer's regions that its owner deregisters as soon
/// as the owner's table says so, so that their allocations are unmapped here once no
/// batch holds them, instead of at the next batch or refresh. Asleep on the table's
/// count of changes (a futex the owner's `retire` wakes), never polling; it ends when
/// the peer's state goes.
fn watch(peer: &Weak<PeerState>, table: &Table, gone: &AtomicBool) {
    loop {
        // Read before the checks: a change after them makes the wait return at once.
        let seen = table.changes();
        if gone.load(SeqCst) {
            return;
        }
        let Some(p) = peer.upgrade() else { return };
        p.forget_deregistered();
        drop(p);
        table.wait_for_change(seen);
    }
}

impl PeerState {
    /// Forgets the peer's region `id`, which its table says it deregistered: a batch
    /// naming it is refused from now on without entering the table, and the peer's
    /// allocation is unmapped here once no region or batch holds it.
    pub(crate) fn forget(&self, id: RegionId) {
        self.regions.write().remove(&id);
    }

    /// Whether the peer's table holds `id` live in `slot` now.
    fn live(&self, id: RegionId, slot: u32) -> bool {
        self.table.extent(slot, id.0).is_some()
    }

    /// Forgets every region of the peer's that its table no longer holds (taking the
    /// write lock, which batches' submits wait for, only where there is one).
    fn forget_deregistered(&self) {
        let dead = |id: &RegionId, r: &Arc<Remote>| !self.live(*id, r.slot);
        if self.regions.read().iter().any(|(id, r)| dead(id, r)) {
            self.regions.write().retain(|id, r| !dead(id, r));
        }
    }
}

/// Forgets, in every peer of this process's backends, the regions their owners
/// deregistered, so that their allocations are unmapped once no batch holds them.
fn let_go_of_deregistered() {
    let peers: Vec<Arc<PeerState>> = {
        let mut peers = PEERS.lock();
        peers.retain(|p| p.strong_count() > 0);
        peers.iter().filter_map(Weak::upgrade).collect()
    };
    for p in peers {
        p.forget_deregistered();
    }
}

impl MluBackend {
    /// `TransferBackend::connect`: the peer's table and regions, kept where they are
    /// known already (a peer that reconnects with the same endpoint keeps its mappings),
    /// fetched before `deadline`.
    pub(crate) fn connect_peer(&self, peer: &SegmentDesc, deadline: Deadline) -> Result<PeerId> {
        let ep = Endpoint::decode(&peer.endpoint)?;
        // What an engine refuses when it decodes a descriptor, for one handed here as
        // a value: regions past the end of the address space, an id listed twice.
        peer.check_regions()?;
        if ep.host != self.endpoint.host {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "engine `{}` is on another host ({}; this is {}): the mlu backend connects engines on one host over MLU-Link; across hosts use the tcp or rdma backend with mlu:N memory",
                    peer.engine, ep.host, self.endpoint.host
                ),
            ));
        }
        // The socket is the instance's own (no other process can bind it while the
        // instance lives), so the table fetched from it is that instance's.
        if ep.socket != handoff::socket_name(ep.instance) {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!(
                    "engine `{}` names @{} as the table socket of mlu instance {:#x}, which serves it at @{}",
                    peer.engine,
                    ep.socket,
                    ep.instance,
                    handoff::socket_name(ep.instance)
                ),
            ));
        }
        let id = PeerId(ep.instance);
        let state = match self.peers.get(id).ok() {
            Some(s) if s.endpoint == ep => s,
            Some(_) => {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    format!(
                        "engine `{}` claims mlu instance {:#x}, which is connected already with another endpoint: refused (disconnect that peer first if it really changed)",
                        peer.engine, ep.instance
                    ),
                ));
            }
            None => {
                let (table, same_process) = match local_table(ep.instance) {
                    Some(t) => (t, true),
                    None => {
                        let fd = handoff::fetch(&ep.socket, ep.instance, deadline)?;
                        (Arc::new(Table::open(fd, ep.instance)?), false)
                    }
                };
                let gone = Arc::new(AtomicBool::new(false));
                let state = Arc::new(PeerState {
                    endpoint: ep,
                    same_process,
                    table: table.clone(),
                    regions: RwLock::new(HashMap::new()),
                    gone: gone.clone(),
                });
                // A peer reached through mappings is watched, so they go as soon as
                // their owner deregisters them; one reached directly maps nothing.
                if !(same_process && self.config.ipc == IpcMode::Auto) {
                    let weak = Arc::downgrade(&state);
                    let spawned = std::thread::Builder::new()
                        .name("te-mlu-watch".into())
                        .spawn_masked(move || watch(&weak, &table, &gone));
                    if let Err(e) = spawned {
                        tracing::warn!(error = %e, "cannot start the thread that watches an mlu peer's deregistrations: its freed allocations stay mapped here until a batch finds them gone or the peer is refreshed");
                    }
                }
                let mut peers = PEERS.lock();
                peers.retain(|p| p.strong_count() > 0);
                peers.push(Arc::downgrade(&state));
                state
            }
        };
        // What is known of regions the peer no longer lists, or has deregistered since,
        // goes first: their allocations are unmapped (once no batch holds them) before
        // any handle is mapped again. A region that could not be reached is tried again.
        let listed: HashSet<RegionId> = peer.regions.iter().map(|r| r.id).collect();
        state
            .regions
            .write()
            .retain(|id, r| listed.contains(id) && r.addr.is_ok() && state.live(*id, r.slot));
        let old = state.regions.read().clone();
        let mut regions = HashMap::new();
        for r in &peer.regions {
            let remote = match old.get(&r.id) {
                Some(known) => known.clone(),
                None => Arc::new(self.remote(&state, &peer.engine, r)?),
            };
            regions.insert(r.id, remote);
        }
        *state.regions.write() = regions;
        self.peers.insert(id, state);
        Ok(id)
    }

    fn local_ordinal(&self, peer: &PeerState, remote: u32) -> Result<u32> {
        if peer.same_process {
            return Ok(remote);
        }
        let ep = &peer.endpoint;
        let bus = ep.buses.get(remote as usize).ok_or_else(|| {
            Error::new(
                ErrorKind::Protocol,
                format!(
                    "the peer names mlu:{remote} but lists only {} MLUs",
                    ep.buses.len()
                ),
            )
        })?;
        self.endpoint
            .buses
            .iter()
            .position(|b| b == bus)
            .map(|p| p as u32)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Unsupported,
                    format!("the peer's mlu:{remote} (PCI {bus}) is not visible to this process (check MLU_VISIBLE_DEVICES)"),
                )
            })
    }

    /// The mapping of the allocation `ipc` names, on local MLU `ordinal`: the one this
    /// process holds for that handle and generation, or a new one. A handle value
    /// mapped for another generation (an allocation the owner freed, which may have
    /// given its handle value to this one) is not mapped again until that mapping is
    /// gone: regions their owners deregistered are let go first, and if a batch or a
    /// region still live in its owner's table holds it, this is `Busy`.
    ///
    /// No `Arc<Mapping>` may drop while `MAPPINGS` is locked here: its unmapping locks it.
    fn map(&self, ordinal: u32, ipc: Ipc) -> Result<Arc<Mapping>> {
        let mut let_go = false;
        let mut maps = MAPPINGS.lock();
        loop {
            let Some((generation, weak)) = maps.get(&ipc.handle).cloned() else {
                let addr = self.rt.map(ordinal, ipc.handle)?;
                let len = match self.rt.mapped_len(addr) {
                    Ok(len) => len,
                    Err(e) => {
                        if let Err(u) = self.rt.unmap(ordinal, addr) {
                            tracing::warn!(error = %u, "unmapping a peer's MLU memory failed");
                        }
                        return Err(e);
                    }
                };
                let m = Arc::new(Mapping {
                    rt: self.rt.clone(),
                    handle: ipc.handle,
                    ordinal,
                    addr,
                    len,
                });
                maps.insert(ipc.handle, (ipc.generation, Arc::downgrade(&m)));
                return Ok(m);
            };
            let Some(m) = weak.upgrade() else {
                // Its last holder is unmapping it, and removes it when done.
                maps = UNMAPPED.wait(maps);
                continue;
            };
            drop(maps);
            if generation == ipc.generation && m.ordinal == ordinal {
                return Ok(m);
            }
            let mapped_on = m.ordinal;
            drop(m);
            if let_go {
                return Err(Error::new(
                    ErrorKind::Busy,
                    format!(
                        "the peer's MLU allocation behind IPC handle {:#x} (export generation {:#x}, on mlu:{ordinal}) cannot be mapped while this process maps that handle for another allocation (generation {generation:#x}, on mlu:{mapped_on}) that a batch in flight, or a region its owner still holds, uses: refresh the peer and retry once those batches are done",
                        u64::from_ne_bytes(ipc.handle),
                        ipc.generation,
                    ),
                ));
            }
            let_go_of_deregistered();
            let_go = true;
            maps = MAPPINGS.lock();
        }
    }

    /// The peer's region `r`, as engine `engine` describes it, resolved to an address
    /// here; what cannot be reached says why in `addr`.
    fn remote(&self, peer: &PeerState, engine: &str, r: &te_core::RegionDesc) -> Result<Remote> {
        let key = Key::decode(&r.key)?;
        let same_process = peer.same_process;
        let direct = same_process && self.config.ipc == IpcMode::Auto;
        let mut remote = Remote {
            addr: Ok(r.addr),
            mapping: None,
            room: u64::MAX,
            mem: Mem::Host,
            slot: key.slot,
            origin: (
                r.addr,
                key.ipc.map_or(0, |i| i.offset),
                handle_word(key.ipc),
                key.ipc.map_or(0, |i| i.generation),
            ),
        };
        // Only what the owner's table holds live now is mapped: a handle it does not
        // vouch for (a region deregistered since, a stale or forged descriptor) never is.
        let ext = match peer.table.extent(key.slot, r.id.0) {
            None => {
                remote.addr = Err(Error::new(
                    ErrorKind::NotRegistered,
                    format!("the peer's region {} was deregistered", r.id),
                ));
                return Ok(remote);
            }
            Some(ext) if ext.origin() != remote.origin => {
                remote.addr = Err(Error::new(
                    ErrorKind::Protocol,
                    format!("the descriptor of the peer's region {} disagrees with the peer's own region table (a stale or forged descriptor): connect again", r.id),
                ));
                return Ok(remote);
            }
            Some(ext) => ext,
        };
        match &r.kind {
            MemoryKind::Host if same_process => {}
            MemoryKind::Host => {
                remote.addr = Err(Error::new(
                    ErrorKind::Unsupported,
                    format!("region {} of the peer is host memory of another process, which MLU-Link cannot reach; register mlu:N memory there, or use the tcp backend for host memory", r.id),
                ));
            }
            MemoryKind::Device { runtime, ordinal } if runtime == RUNTIME => {
                match self.local_ordinal(peer, *ordinal) {
                    Ok(local) => {
                        remote.mem = Mem::Mlu(local);
                        if !direct {
                            remote.addr = match key.ipc {
                                Some(ipc) => self.map(local, ipc).and_then(|m| {
                                    // The owner's key and table say where the region
                                    // lies in the allocation; CNRT says how large it is.
                                    let at = m
                                        .addr
                                        .checked_add(ipc.offset)
                                        .filter(|_| fits(ipc.offset, ext.len, m.len))
                                        .ok_or_else(|| {
                                            Error::new(
                                                ErrorKind::Protocol,
                                                format!(
                                                    "region {} of engine `{engine}` (the peer) is refused: its owner puts it at offset {} for {} bytes in an allocation of {} bytes (the size CNRT reports for this process's mapping of it), so it would reach memory past the allocation; the peer's region key and table are forged or corrupt",
                                                    r.id, ipc.offset, ext.len, m.len
                                                ),
                                            )
                                        })?;
                                    remote.room = m.len - ipc.offset;
                                    remote.mapping = Some(m);
                                    Ok(at)
                                }),
                                None => Err(Error::new(
                                    ErrorKind::Unsupported,
                                    format!("region {} of the peer has no IPC handle", r.id),
                                )),
                            };
                        }
                    }
                    Err(e) => remote.addr = Err(e),
                }
            }
            other => {
                remote.addr = Err(Error::new(
                    ErrorKind::Unsupported,
                    format!("region {} of the peer is {other} memory, which the mlu backend does not move", r.id),
                ));
            }
        }
        Ok(remote)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use te_core::{BackendContext, Deadline, TransferBackend};

    use super::*;
    use crate::config::MluConfig;

    #[test]
    fn a_peer_on_another_host_is_refused_naming_tcp_and_rdma() {
        let b = MluBackend::new(MluConfig::default(), &BackendContext::default())
            .expect("the fake libcnrt loads");
        let mut ep = Endpoint::decode(&b.endpoint()).unwrap();
        ep.host = "elsewhere/0000".into();
        let seg = SegmentDesc {
            engine: "far".into(),
            epoch: 1,
            address: String::new(),
            backend: crate::NAME.into(),
            endpoint: ep.encode(),
            regions: Vec::new(),
            layouts: Vec::new(),
        };
        let e = b
            .connect(&seg, Deadline::after(Duration::from_secs(5)))
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        let m = e.to_string();
        assert!(m.contains("tcp or rdma backend with mlu:N memory"), "{m}");
        assert!(m.contains("elsewhere"), "{m}");
    }
}
