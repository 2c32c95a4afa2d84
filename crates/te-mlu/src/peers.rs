//! Peers of the mlu backend: `connect` checks that the peer is on this host, receives
//! its region table over its socket (`SCM_RIGHTS`), and resolves each of its regions to
//! an address usable here: mapped from the allocation's IPC handle
//! (`cnrtMapMemHandle`, once per allocation), or, for a peer in this process, its
//! address as it is.
//!
//! Whether a peer is in this process is never taken from its endpoint, which any
//! process can forge: it is a peer whose instance is one of this process's live
//! backends ([`publish`]), and it is then served from that backend's own table.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Weak};
use te_core::sync::{Mutex, RwLock};

use te_core::{Deadline, Error, ErrorKind, MemoryKind, PeerId, RegionId, Result, SegmentDesc};

use crate::backend::{Mem, MluBackend};
use crate::config::IpcMode;
use crate::endpoint::{Endpoint, Key};
use crate::ffi::IpcHandle;
use crate::handoff;
use crate::runtime::{MluRuntime, RUNTIME};
use crate::shm::{handle_word, Table};

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

/// A peer's allocation mapped into this process; unmapped when the last user goes.
#[derive(Debug)]
pub(crate) struct Mapping {
    rt: Arc<MluRuntime>,
    ordinal: u32,
    addr: u64,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if let Err(e) = self.rt.unmap(self.ordinal, self.addr) {
            tracing::warn!(error = %e, "unmapping a peer's MLU memory failed");
        }
    }
}

#[derive(Debug)]
pub(crate) struct Remote {
    /// The address usable here, or why the region cannot be reached from here.
    pub(crate) addr: std::result::Result<u64, Error>,
    pub(crate) mapping: Option<Arc<Mapping>>,
    pub(crate) mem: Mem,
    pub(crate) slot: u32,
    /// The descriptor's address, and the key's offset in the allocation and its IPC
    /// handle (as `shm::handle_word`), which must agree with the peer's own region table.
    pub(crate) origin: (u64, u64, u64),
}

#[derive(Debug)]
pub(crate) struct PeerState {
    pub(crate) endpoint: Endpoint,
    /// The peer is a backend instance of this process (found by [`local_table`]).
    pub(crate) same_process: bool,
    pub(crate) table: Arc<Table>,
    pub(crate) regions: RwLock<HashMap<RegionId, Arc<Remote>>>,
    pub(crate) maps: Mutex<HashMap<IpcHandle, Weak<Mapping>>>,
}

impl PeerState {
    /// Forgets the peer's region `id`, which its table says it deregistered: a batch
    /// naming it is refused from now on without entering the table, and the peer's
    /// allocation is unmapped here once no region or batch of this backend holds it.
    pub(crate) fn forget(&self, id: RegionId) {
        self.regions.write().remove(&id);
        self.maps.lock().retain(|_, m| m.strong_count() > 0);
    }
}

impl MluBackend {
    /// `TransferBackend::connect`: the peer's table and regions, kept where they are
    /// known already (a peer that reconnects with the same endpoint keeps its mappings),
    /// fetched before `deadline`.
    pub(crate) fn connect_peer(&self, peer: &SegmentDesc, deadline: Deadline) -> Result<PeerId> {
        let ep = Endpoint::decode(&peer.endpoint)?;
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
                Arc::new(PeerState {
                    endpoint: ep,
                    same_process,
                    table,
                    regions: RwLock::new(HashMap::new()),
                    maps: Mutex::new(HashMap::new()),
                })
            }
        };
        let old = state.regions.read().clone();
        let mut regions = HashMap::new();
        for r in &peer.regions {
            let remote = match old.get(&r.id) {
                Some(known) => known.clone(),
                None => Arc::new(self.remote(&state, r)?),
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

    fn map(&self, peer: &PeerState, ordinal: u32, handle: IpcHandle) -> Result<Arc<Mapping>> {
        let mut maps = peer.maps.lock();
        if let Some(m) = maps.get(&handle).and_then(Weak::upgrade) {
            return Ok(m);
        }
        let addr = self.rt.map(ordinal, handle)?;
        let m = Arc::new(Mapping {
            rt: self.rt.clone(),
            ordinal,
            addr,
        });
        maps.retain(|_, m| m.strong_count() > 0);
        maps.insert(handle, Arc::downgrade(&m));
        Ok(m)
    }

    fn remote(&self, peer: &PeerState, r: &te_core::RegionDesc) -> Result<Remote> {
        let key = Key::decode(&r.key)?;
        let same_process = peer.same_process;
        let direct = same_process && self.config.ipc == IpcMode::Auto;
        let mut remote = Remote {
            addr: Ok(r.addr),
            mapping: None,
            mem: Mem::Host,
            slot: key.slot,
            origin: (
                r.addr,
                key.handle.map_or(0, |(_, off)| off),
                handle_word(key.handle),
            ),
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
                            remote.addr = match key.handle {
                                Some((h, off)) => self.map(peer, local, h).map(|m| {
                                    let a = m.addr + off;
                                    remote.mapping = Some(m);
                                    a
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
