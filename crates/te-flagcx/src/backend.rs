//! The FlagCX `TransferBackend`: registrations, one shim connection per peer (renewed
//! when the peer's regions change), and batches split into descriptors the shim
//! accepts, completed by the completion thread.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use te_core::{
    BackendInfo, Capabilities, Completion, Error, ErrorKind, MemoryDesc, Op, PeerId, RegionId,
    Result, SegmentDesc, TransferBackend, TransferRequest,
};

use crate::config::FlagcxConfig;
use crate::ffi::{self, Desc, E_INVALID, E_STALE, E_UNREACHABLE, OP_READ, OP_WRITE};
use crate::progress::{InFlight, Progress};

#[derive(Debug, Clone, Copy)]
struct LocalRegion {
    mr: u64,
    addr: u64,
    len: u64,
}

/// Descriptor vectors reused from batch to batch, so a submit does not allocate.
#[derive(Debug, Default)]
struct Scratch {
    writes: Vec<Desc>,
    reads: Vec<Desc>,
}

/// Descriptors a scratch buffer holds before it has to grow.
const SCRATCH_DESCS: usize = 256;

/// One shim connection and the peer regions its snapshot covers.
pub(crate) struct Link {
    pub(crate) conn: ffi::Conn,
    /// Address and length of each peer region, by id, as of the connect.
    remote: HashMap<RegionId, (u64, u64)>,
    /// Set when the shim reported the snapshot stale or the connection broken: the
    /// next use opens a new connection.
    pub(crate) renew: AtomicBool,
    scratch: Mutex<Vec<Scratch>>,
}

impl Link {
    fn open(
        engine: &Arc<ffi::Engine>,
        endpoint: &str,
        remote: HashMap<RegionId, (u64, u64)>,
    ) -> Result<Link> {
        let conn = ffi::Conn::open(engine.clone(), endpoint).map_err(|e| {
            Error::from(e)
                .with_operation("connect")
                .with_context("endpoint", endpoint)
        })?;
        let scratch = Scratch {
            writes: Vec::with_capacity(SCRATCH_DESCS),
            reads: Vec::with_capacity(SCRATCH_DESCS),
        };
        Ok(Link {
            conn,
            remote,
            renew: AtomicBool::new(false),
            scratch: Mutex::new(vec![scratch]),
        })
    }

    fn take_scratch(&self) -> Scratch {
        self.scratch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .unwrap_or_default()
    }

    fn put_scratch(&self, mut s: Scratch) {
        s.writes.clear();
        s.reads.clear();
        self.scratch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(s);
    }
}

/// A connected peer; its link is replaced when it has to be renewed.
struct PeerState {
    endpoint: String,
    epoch: u64,
    link: RwLock<Arc<Link>>,
}

impl PeerState {
    fn link(&self) -> Arc<Link> {
        self.link.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Installs `fresh` unless another thread replaced `old` already; returns the link
    /// now in use.
    fn replace(&self, old: &Arc<Link>, fresh: Link) -> Arc<Link> {
        let mut current = self.link.write().unwrap_or_else(|p| p.into_inner());
        if Arc::ptr_eq(&current, old) {
            *current = Arc::new(fresh);
        }
        current.clone()
    }
}

/// The FlagCX backend: a shim engine, its registrations and its peers.
///
/// Fields drop in order: the completion thread stops first (batches still in flight
/// complete as cancelled), then peers and their connections close, then the engine
/// (connections hold it until they are gone).
pub struct FlagcxBackend {
    progress: Progress,
    info: BackendInfo,
    engine: Arc<ffi::Engine>,
    endpoint: String,
    max_desc: u64,
    regions: RwLock<HashMap<RegionId, LocalRegion>>,
    peers: RwLock<HashMap<PeerId, Arc<PeerState>>>,
    next_peer: AtomicU64,
}

impl std::fmt::Debug for FlagcxBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlagcxBackend")
            .field("shim", &self.engine.shim().path)
            .field("endpoint", &self.endpoint)
            .field("max_desc", &self.max_desc)
            .finish()
    }
}

impl FlagcxBackend {
    /// Loads the shim the configuration selects (see [`FlagcxConfig::shim`]), creates
    /// its engine with the configured options and starts its server and the
    /// completion thread.
    ///
    /// # Errors
    /// `Unavailable` if the shim cannot be loaded (naming the library or the missing
    /// symbol) or its engine cannot start; `ConfigInvalid` if the shim refuses
    /// `shim_options`.
    pub fn new(config: FlagcxConfig) -> Result<FlagcxBackend> {
        let path = crate::shim_path(config.shim.as_deref());
        let shim = ffi::load(&path).map_err(|e| Error::from(e).with_operation("create backend"))?;
        let engine = ffi::Engine::create(shim, &config.shim_options).map_err(|e| {
            let kind = match e.code() {
                Some(E_INVALID) => ErrorKind::ConfigInvalid,
                _ => ErrorKind::Unavailable,
            };
            Error::new(
                kind,
                format!(
                    "the FlagCX shim {} could not start an engine with shim_options \"{}\": {e}",
                    path.display(),
                    config.shim_options
                ),
            )
            .with_operation("create backend")
        })?;
        let engine = Arc::new(engine);
        let endpoint = engine
            .endpoint()
            .map_err(|e| Error::from(e).with_operation("create backend"))?;
        let max_desc = engine.max_desc_len();
        if max_desc == 0 {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!(
                    "the FlagCX shim {} reports a descriptor limit of 0 bytes",
                    path.display()
                ),
            )
            .with_operation("create backend"));
        }
        let memory = engine.memory_kinds();
        tracing::info!(
            shim = %path.display(),
            version = %engine.shim().version,
            %endpoint,
            max_desc,
            memory = %memory.join(","),
            "FlagCX shim loaded"
        );
        Ok(FlagcxBackend {
            info: BackendInfo {
                name: crate::NAME.to_string(),
                version: env!("CARGO_PKG_VERSION").to_string(),
                capabilities: Capabilities {
                    memory,
                    read: true,
                    write: true,
                    cross_process: true,
                    same_host_only: false,
                    max_request_size: u64::MAX,
                },
            },
            progress: Progress::start(config.max_poll_interval)?,
            engine,
            endpoint,
            max_desc,
            regions: RwLock::new(HashMap::new()),
            peers: RwLock::new(HashMap::new()),
            next_peer: AtomicU64::new(1),
        })
    }

    /// The shim's per-descriptor limit; larger requests are split.
    pub fn max_descriptor_len(&self) -> u64 {
        self.max_desc
    }

    /// A fresh link replacing `old`, which the shim reported stale or broken.
    fn renew(&self, peer: &PeerState, old: &Arc<Link>) -> Result<Arc<Link>> {
        let fresh = Link::open(&self.engine, &peer.endpoint, old.remote.clone())?;
        tracing::debug!(endpoint = %peer.endpoint, "FlagCX connection renewed");
        Ok(peer.replace(old, fresh))
    }

    /// Fills `scratch` with the batch's descriptors, split at the shim's limit.
    fn plan(&self, link: &Link, batch: &[TransferRequest], scratch: &mut Scratch) -> Result<()> {
        let regions = self.regions.read().unwrap_or_else(|p| p.into_inner());
        for (i, r) in batch.iter().enumerate() {
            let fail = |kind, m: String| Err(Error::new(kind, m).with_context("request", i));
            let Some(local) = regions.get(&r.local) else {
                return fail(
                    ErrorKind::NotRegistered,
                    format!(
                        "local region {} is not registered with the FlagCX backend",
                        r.local
                    ),
                );
            };
            let Some(&(remote_addr, remote_len)) = link.remote.get(&r.remote) else {
                link.renew.store(true, Ordering::Release);
                return fail(
                    ErrorKind::NotRegistered,
                    format!(
                        "the peer's region {} is not in the connection's region table; the connection will be renewed",
                        r.remote
                    ),
                );
            };
            if !fits(r.local_offset, r.len, local.len)
                || !fits(r.remote_offset, r.len, remote_len)
                || r.len == 0
            {
                return fail(
                    ErrorKind::OutOfBounds,
                    format!(
                        "{} of {} bytes at local {}+{} / remote {}+{} does not fit its regions",
                        r.op, r.len, r.local, r.local_offset, r.remote, r.remote_offset
                    ),
                );
            }
            let out = match r.op {
                Op::Write => &mut scratch.writes,
                Op::Read => &mut scratch.reads,
            };
            split(
                out,
                local.mr,
                local.addr + r.local_offset,
                remote_addr + r.remote_offset,
                r.len,
                self.max_desc,
            );
        }
        Ok(())
    }
}

fn fits(offset: u64, len: u64, region_len: u64) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= region_len)
}

/// Appends descriptors covering `len` bytes, none longer than `max`.
pub(crate) fn split(
    out: &mut Vec<Desc>,
    mr: u64,
    local_addr: u64,
    remote_addr: u64,
    len: u64,
    max: u64,
) {
    let mut done = 0;
    while done < len {
        let n = max.min(len - done);
        out.push(Desc {
            local_mr: mr,
            local_addr: local_addr + done,
            remote_addr: remote_addr + done,
            len: n,
        });
        done += n;
    }
}

fn remote_table(peer: &SegmentDesc) -> HashMap<RegionId, (u64, u64)> {
    peer.regions
        .iter()
        .map(|r| (r.id, (r.addr, r.len)))
        .collect()
}

impl TransferBackend for FlagcxBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn endpoint(&self) -> Vec<u8> {
        self.endpoint.as_bytes().to_vec()
    }

    fn register(&self, id: RegionId, mem: &MemoryDesc) -> Result<Vec<u8>> {
        let mr = self
            .engine
            .register(mem.addr, mem.len, &mem.kind.to_string())
            .map_err(|e| Error::from(e).with_context("region", id))?;
        let region = LocalRegion {
            mr,
            addr: mem.addr,
            len: mem.len,
        };
        self.regions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, region);
        // FlagCX resolves remote keys from the region table it exchanges at connect
        // time, so a peer needs no key bytes from the descriptor.
        Ok(Vec::new())
    }

    fn deregister(&self, id: RegionId) -> Result<()> {
        let removed = self
            .regions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        let Some(region) = removed else {
            return Err(Error::new(
                ErrorKind::NotRegistered,
                format!("region {id} is not registered with the FlagCX backend"),
            ));
        };
        // Outside the lock: the shim waits here for transfers still touching the memory.
        self.engine
            .deregister(region.mr)
            .map_err(|e| Error::from(e).with_context("region", id))
    }

    fn connect(&self, peer: &SegmentDesc) -> Result<PeerId> {
        let endpoint = std::str::from_utf8(&peer.endpoint).map_err(|_| {
            Error::new(
                ErrorKind::Protocol,
                "the peer's FlagCX endpoint is not UTF-8 text",
            )
        })?;
        let remote = remote_table(peer);
        let existing = self
            .peers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|(_, p)| p.endpoint == endpoint && p.epoch == peer.epoch)
            .map(|(id, p)| (*id, p.clone()));
        if let Some((id, state)) = existing {
            let link = state.link();
            let covered = remote.keys().all(|r| link.remote.contains_key(r));
            if covered && !link.renew.load(Ordering::Acquire) {
                return Ok(id);
            }
            // FlagCX's region table is the snapshot taken at connect time: regions
            // registered since are reachable only through a new connection.
            let fresh = Link::open(&self.engine, endpoint, remote)?;
            *state.link.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(fresh);
            tracing::debug!(%endpoint, "FlagCX connection renewed for new peer regions");
            return Ok(id);
        }
        let link = Link::open(&self.engine, endpoint, remote)?;
        let id = PeerId(self.next_peer.fetch_add(1, Ordering::Relaxed));
        let state = Arc::new(PeerState {
            endpoint: endpoint.to_string(),
            epoch: peer.epoch,
            link: RwLock::new(Arc::new(link)),
        });
        self.peers
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, state);
        Ok(id)
    }

    fn disconnect(&self, peer: PeerId) -> Result<()> {
        // The connection closes when the last batch in flight on it has finished.
        match self
            .peers
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&peer)
        {
            Some(_) => Ok(()),
            None => Err(Error::new(
                ErrorKind::PeerUnreachable,
                "unknown FlagCX peer",
            )),
        }
    }

    fn submit(&self, peer: PeerId, batch: &[TransferRequest], done: Completion) -> Result<()> {
        let Some(state) = self
            .peers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&peer)
            .cloned()
        else {
            return Err(Error::new(
                ErrorKind::PeerUnreachable,
                "the FlagCX backend is not connected to that peer",
            ));
        };
        let mut link = state.link();
        if link.renew.load(Ordering::Acquire) {
            link = self.renew(&state, &link)?;
        }
        let mut scratch = link.take_scratch();
        if let Err(e) = self.plan(&link, batch, &mut scratch) {
            link.put_scratch(scratch);
            return Err(e);
        }
        let mut xfers = [None, None];
        let mut late = None;
        let mut failed = None;
        for (op, descs) in [(OP_WRITE, &scratch.writes), (OP_READ, &scratch.reads)] {
            if descs.is_empty() {
                continue;
            }
            match link.conn.post(op, descs) {
                Ok(x) => {
                    let slot = if xfers[0].is_none() { 0 } else { 1 };
                    xfers[slot] = Some(x);
                }
                Err(e) => {
                    if matches!(e.code(), Some(E_STALE | E_UNREACHABLE)) {
                        link.renew.store(true, Ordering::Release);
                    }
                    let e = Error::from(e).with_context("peer", &state.endpoint);
                    if xfers[0].is_none() {
                        failed = Some(e);
                    } else {
                        // The WRITEs are in flight: the batch fails once they finished.
                        late = Some(e);
                    }
                    break;
                }
            }
        }
        link.put_scratch(scratch);
        if let Some(e) = failed {
            return Err(e);
        }
        self.progress.add(InFlight {
            link,
            xfers,
            error: late,
            done,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_over_the_limit_is_split_into_contiguous_descriptors_that_cover_it_exactly() {
        const GIB: u64 = 1 << 30;
        for (len, max, expect) in [
            (5 * GIB, GIB, 5),
            (5 * GIB + 1, GIB, 6),
            (4 * GIB, u32::MAX as u64, 2),
            (4096, 4096, 1),
            (1, GIB, 1),
        ] {
            let mut out = Vec::new();
            split(&mut out, 7, 0x1000, 0x9000_0000, len, max);
            assert_eq!(out.len(), expect, "{len} bytes at most {max} each");
            assert_eq!(out.iter().map(|d| d.len).sum::<u64>(), len);
            assert!(out
                .iter()
                .all(|d| d.len <= max && d.len > 0 && d.local_mr == 7));
            for (i, d) in out.iter().enumerate() {
                let at = i as u64 * max;
                assert_eq!(
                    (d.local_addr, d.remote_addr),
                    (0x1000 + at, 0x9000_0000 + at)
                );
            }
        }
    }
}
