//! The FlagCX `TransferBackend`: registrations (see `regions`), one shim connection
//! per peer established off the submit path (see `peers`), and batches split into
//! descriptors the shim accepts (see `batch`), completed by the completion thread
//! (see `progress`).

use std::sync::Arc;
use std::time::Instant;
use te_core::peer_table::PeerTable;

use te_core::{
    BackendInfo, BatchId, Capabilities, Completion, Deadline, Error, ErrorKind, MemoryDesc, PeerId,
    RegionId, Result, SegmentDesc, TransferBackend, TransferRequest,
};

use crate::batch::Poster;
use crate::config::FlagcxConfig;
use crate::ffi::{self, ACCESS_REMOTE_READ, ACCESS_REMOTE_WRITE, E_INVALID};
use crate::peers::{Attempts, PeerState, Table, Usable};
use crate::progress::{Parked, Progress};
use crate::regions::Regions;

/// The FlagCX backend: a shim engine, its registrations and its peers.
///
/// Dropping it closes every peer first, cancels the connects still running and joins
/// their threads, then stops the completion thread (batches still in flight report
/// cancelled once every one of their connections closed), then the engine goes
/// (connections hold it until they are gone).
pub struct FlagcxBackend {
    progress: Progress,
    info: BackendInfo,
    engine: Arc<ffi::Engine>,
    endpoint: String,
    max_desc: u64,
    poster: Arc<Poster>,
    peers: PeerTable<Arc<PeerState>>,
    attempts: Arc<Attempts>,
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
        let poster = Arc::new(Poster::new(Arc::new(Regions::new("FlagCX")), max_desc));
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
                    // Flagcx resolves remote addresses from its own table; te cannot name the region.
                    checks_at_target: false,
                },
            },
            progress: Progress::start(engine.clone(), poster.clone())?,
            engine,
            endpoint,
            max_desc,
            poster,
            peers: PeerTable::new(crate::NAME),
            attempts: Arc::default(),
        })
    }

    /// The shim's per-descriptor limit; larger requests are split.
    pub fn max_descriptor_len(&self) -> u64 {
        self.max_desc
    }

    /// [`TransferBackend::connect`], waiting for the connection at most until
    /// `deadline`. The connection is established on a thread of its own; concurrent
    /// calls for one peer share it, and it is given up (cancelled in the shim) once the
    /// last of them and of the batches parked for it left: reached its deadline, was
    /// aborted, or the peer was disconnected.
    ///
    /// # Errors
    /// `Protocol` for an endpoint that is not text, regions
    /// [`SegmentDesc::check_regions`] refuses, or an instance (its epoch) already known with another
    /// endpoint or control-plane address (the known peer is left as it was); the
    /// shim's error if the connection fails (`PeerUnreachable`, …); `Timeout`, naming
    /// the endpoint, if it is not up by `deadline` (it goes on only for callers and
    /// batches that wait longer).
    pub fn connect_within(&self, peer: &SegmentDesc, deadline: Instant) -> Result<PeerId> {
        let endpoint = std::str::from_utf8(&peer.endpoint).map_err(|_| {
            Error::new(
                ErrorKind::Protocol,
                "the peer's FlagCX endpoint is not UTF-8 text",
            )
        })?;
        peer.check_regions().map_err(|e| {
            e.with_operation("connect")
                .with_context("endpoint", endpoint)
        })?;
        let remote: Table = Arc::new(
            peer.regions
                .iter()
                .map(|r| (r.id, (r.addr, r.len)))
                .collect(),
        );
        let (id, state) = {
            let mut peers = self.peers.write();
            let known = peers
                .iter()
                .find(|(_, p)| p.epoch == peer.epoch)
                .map(|(id, p)| (*id, p.clone()));
            if let Some((_, p)) = &known {
                // One instance (its epoch, random at every start) has one endpoint and
                // one control-plane address for its whole life: a descriptor naming it
                // with others is not that peer, and must neither reach its connection
                // nor replace the regions its batches are posted with.
                if p.endpoint != endpoint || p.address != peer.address {
                    return Err(Error::new(
                        ErrorKind::Protocol,
                        format!(
                            "the descriptor names FlagCX instance (epoch {:#x}) connected at {} with endpoint {}, but comes from {} with endpoint {}: a forged or corrupt descriptor",
                            peer.epoch, p.address, p.endpoint, peer.address, endpoint
                        ),
                    )
                    .with_operation("connect"));
                }
            }
            known.unwrap_or_else(|| {
                let id = self.peers.next_id();
                let state = Arc::new(PeerState::new(
                    endpoint,
                    &peer.address,
                    peer.epoch,
                    self.engine.clone(),
                    self.progress.handle().clone(),
                    self.attempts.clone(),
                ));
                peers.insert(id, state.clone());
                (id, state)
            })
        };
        match state.ensure(remote, deadline) {
            Ok(()) => Ok(id),
            Err(e) => {
                if state.abandoned() {
                    let mut peers = self.peers.write();
                    if peers.get(&id).is_some_and(|p| Arc::ptr_eq(p, &state)) {
                        peers.remove(&id);
                    }
                    drop(peers);
                    state.close();
                }
                Err(e
                    .with_operation("connect")
                    .with_context("endpoint", endpoint))
            }
        }
    }

    /// [`TransferBackend::deregister`], waiting for the region's batches at most until
    /// `deadline`. On `Ok`, no transfer this backend posted touches the memory any more.
    ///
    /// # Errors
    /// `NotRegistered` for an unknown region; `Timeout` if batches still use it at
    /// `deadline` (it stays registered, refused to new batches, and its memory must
    /// stay allocated: call again later); the shim's error if FlagCX refuses.
    pub fn deregister_within(&self, id: RegionId, deadline: Instant) -> Result<()> {
        match self.poster.regions.retire(id, deadline)? {
            Some(region) => self
                .engine
                .deregister(region.data)
                .map_err(|e| Error::from(e).with_context("region", id)),
            None => Ok(()),
        }
    }
}

impl Drop for FlagcxBackend {
    fn drop(&mut self) {
        for p in self.peers.drain() {
            p.close();
        }
        // Connects still running (to a peer that never answers, say) end now, and their
        // threads with them: none holds the engine once the backend is gone.
        self.engine.cancel_connects();
        self.attempts.join();
    }
}

impl TransferBackend for FlagcxBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn endpoint(&self) -> Vec<u8> {
        self.endpoint.as_bytes().to_vec()
    }

    fn register(&self, id: RegionId, mem: &MemoryDesc) -> Result<Vec<u8>> {
        // The shim enforces the rights at the target (or refuses memory it cannot
        // restrict): a peer's descriptor, which it writes itself, decides nothing.
        let mut access = 0;
        if mem.access.remote_read {
            access |= ACCESS_REMOTE_READ;
        }
        if mem.access.remote_write {
            access |= ACCESS_REMOTE_WRITE;
        }
        let mr = self
            .engine
            .register(mem.addr, mem.len, &mem.kind.to_string(), access)
            .map_err(|e| Error::from(e).with_context("region", id))?;
        self.poster
            .regions
            .insert(id, mem.addr, mem.len, mem.access, mr);
        // FlagCX resolves remote keys from the region table it exchanges at connect
        // time, so a peer needs no key bytes from the descriptor.
        Ok(Vec::new())
    }

    fn deregister(&self, id: RegionId, deadline: Deadline) -> Result<()> {
        self.deregister_within(id, deadline.instant())
    }

    fn connect(&self, peer: &SegmentDesc, deadline: Deadline) -> Result<PeerId> {
        self.connect_within(peer, deadline.instant())
    }

    fn disconnect(&self, peer: PeerId, _deadline: Deadline) -> Result<()> {
        // Parked batches fail and a connection attempt running is cancelled; those in
        // flight finish, then the connection closes.
        self.peers.remove(peer)?.close();
        Ok(())
    }

    fn submit(&self, peer: PeerId, batch: &[TransferRequest], done: Completion) -> Result<()> {
        let state = self.peers.get(peer)?;
        match state.usable(batch, done.deadline().instant())? {
            Usable::Post(link) => match self.poster.start(link, batch, done) {
                Ok(b) => {
                    self.progress.handle().add(b);
                    Ok(())
                }
                Err(failed) => Err(failed.0.with_context("peer", &state.endpoint)),
            },
            // The connection is being (re)established: the completion thread posts the
            // batch once it is up, or fails it with the attempt's error or at its
            // deadline.
            Usable::Wait(waiting) => {
                self.progress.handle().park(Parked {
                    waiting,
                    requests: batch.to_vec(),
                    done,
                });
                Ok(())
            }
        }
    }

    fn abort(&self, _peer: PeerId, _batch: BatchId) {
        // A batch still waiting for its connection is released at once, and the attempt
        // it waited for cancelled if no one else counts on it; one posted to FlagCX
        // (which has no cancel) is released when its transfers finish.
        self.progress.handle().kick();
    }
}
