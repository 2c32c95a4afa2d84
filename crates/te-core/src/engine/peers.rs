//! Peers: names resolved, handshakes, descriptors kept current.

use super::*;

impl Inner {
    /// The address of `peer`: itself if it is `host:port`, else the address the
    /// metadata store has for that name.
    pub(super) fn resolve(&self, peer: &str, deadline: Deadline) -> Result<String> {
        if metadata::is_address(peer) || self.config.metadata == "p2p" {
            return Ok(peer.to_string());
        }
        match self.store.resolve(peer, deadline) {
            Ok(Some(entry)) => Ok(entry.address),
            Ok(None) => Err(Error::new(
                ErrorKind::PeerUnreachable,
                format!(
                    "no engine named `{peer}` in {}; is it running? (`te peers` lists the engines there)",
                    self.store.describe()
                ),
            )),
            Err(e) => Err(e),
        }
        .map_err(|e| e.with_operation("connect").with_context("peer", peer))
    }

    /// Invalidates the cached peers at `address` (their store entry went stale).
    pub(super) fn forget(&self, address: &str) {
        for p in self.peers.lock().values() {
            if p.inner.addr == address {
                p.inner.valid.store(false, Ordering::Release);
            }
        }
    }

    pub(super) fn connect(&self, addr: &str, deadline: Deadline) -> Result<Peer> {
        let addr = &self.resolve(addr, deadline)?;
        if let Some(p) = self.peers.lock().get(addr) {
            if self.live(p) {
                return Ok(p.clone());
            }
        }
        let segment = self.handshake(addr, deadline)?;
        let backend_id = self
            .backend
            .connect(&segment, deadline)
            .map_err(|e| e.with_operation("connect").with_context("peer", addr))?;
        let peer = Peer {
            inner: Arc::new(PeerInner {
                engine: self.life(),
                addr: addr.to_string(),
                epoch: segment.epoch,
                segment: RwLock::new(Arc::new(segment)),
                backend_id,
                valid: AtomicBool::new(true),
                metrics: Arc::default(),
            }),
        };
        let old = self.peers.lock().insert(addr.to_string(), peer.clone());
        if let Some(old) = old {
            old.inner.valid.store(false, Ordering::Release);
            if old.inner.backend_id != backend_id {
                let _ = self.backend.disconnect(old.inner.backend_id, deadline);
            }
        }
        Ok(peer)
    }

    pub(super) fn handshake(&self, addr: &str, deadline: Deadline) -> Result<SegmentDesc> {
        let segment: SegmentDesc = match self
            .control
            .call(addr, Kind::GetSegment, Vec::new(), deadline)
            .map_err(|e| e.with_operation("connect").with_context("peer", addr))?
        {
            (Kind::Segment, body) => wire::decode(&body, "segment descriptor")
                .map_err(|e| e.with_operation("connect").with_context("peer", addr))?,
            (other, _) => {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    format!("the peer answered the handshake with {other:?}"),
                )
                .with_operation("connect")
                .with_context("peer", addr))
            }
        };
        let ours = &self.backend.info().name;
        if &segment.backend != ours {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "the peer runs backend `{}` and this engine runs `{ours}`; both sides must use the same backend",
                    segment.backend
                ),
            )
            .with_operation("connect")
            .with_context("peer", addr));
        }
        for local in self.layouts.read().values() {
            if let Some(remote) = segment.layout(&local.local.name) {
                local
                    .local
                    .check_compatible(remote)
                    .map_err(|e| e.with_operation("connect").with_context("peer", addr))?;
            }
        }
        Ok(segment)
    }

    /// This engine's life, as its peers are tagged with it.
    fn life(&self) -> (u64, std::net::SocketAddr) {
        (self.epoch, self.control.address())
    }

    /// Refuses a peer another engine connected: its backend id names a connection of
    /// that engine's backend, which in this one may be another peer's.
    pub(super) fn mine(&self, peer: &Peer, operation: &'static str) -> Result<()> {
        if peer.inner.engine == self.life() {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::InvalidRequest,
            "this peer was connected by another engine; connect it with this one",
        )
        .with_operation(operation)
        .with_context("peer", &peer.inner.addr))
    }

    /// The live version of `peer`: itself if valid, else a fresh connection to the same
    /// address, provided the peer has not restarted.
    pub(super) fn current(&self, peer: &Peer, deadline: Deadline) -> Result<Peer> {
        self.mine(peer, "transfer")?;
        if self.live(peer) {
            return Ok(peer.clone());
        }
        let fresh = self.connect(&peer.inner.addr, deadline)?;
        if fresh.inner.epoch != peer.inner.epoch {
            return Err(Error::new(
                ErrorKind::PeerRestarted,
                "the peer restarted; its regions belong to its previous life: connect again and look them up anew",
            )
            .with_operation("transfer")
            .with_context("peer", &peer.inner.addr));
        }
        Ok(fresh)
    }

    /// Lets go of the peers of the life `epoch` of the engine `name`, gone for good (it
    /// left, or a newer life replaced it): out of the table, so out of the metrics, and
    /// disconnected from the backend. A handle the user still holds is invalid: its
    /// next use connects again, and fails clearly if no engine answers there.
    pub(super) fn let_go(&self, name: &str, epoch: u64) {
        let gone: Vec<Peer> = {
            let mut peers = self.peers.lock();
            let addrs: Vec<String> = peers
                .iter()
                .filter(|(_, p)| p.inner.epoch == epoch && p.inner.segment.read().engine == name)
                .map(|(addr, _)| addr.clone())
                .collect();
            let gone: Vec<Peer> = addrs.iter().filter_map(|a| peers.remove(a)).collect();
            for p in &gone {
                p.inner.valid.store(false, Ordering::Release);
            }
            // A backend id another entry still uses stays connected.
            gone.into_iter()
                .filter(|g| {
                    peers
                        .values()
                        .all(|p| p.inner.backend_id != g.inner.backend_id)
                })
                .collect()
        };
        let deadline = self.deadline(None);
        for p in gone {
            if let Err(e) = self.backend.disconnect(p.inner.backend_id, deadline) {
                tracing::debug!(peer = %p.inner.addr, error = %e, "disconnecting a peer that left");
            }
        }
    }

    /// Fetches the peer's descriptor again (it registered new regions).
    pub(super) fn refresh(&self, peer: &Peer, deadline: Deadline) -> Result<()> {
        self.mine(peer, "refresh")?;
        let segment = self.handshake(&peer.inner.addr, deadline)?;
        if segment.epoch != peer.inner.epoch {
            peer.inner.valid.store(false, Ordering::Release);
            return Err(Error::new(
                ErrorKind::PeerRestarted,
                "the peer restarted; connect again",
            )
            .with_operation("transfer")
            .with_context("peer", &peer.inner.addr));
        }
        self.backend.connect(&segment, deadline)?;
        *peer.inner.segment.write() = Arc::new(segment);
        Ok(())
    }
}

/// A connected peer: its descriptor and the backend's connection to it.
#[derive(Clone)]
pub struct Peer {
    pub(super) inner: Arc<PeerInner>,
}

pub(super) struct PeerInner {
    /// The epoch and control-plane address of the engine that connected it: only that
    /// engine may use it.
    pub(super) engine: (u64, std::net::SocketAddr),
    pub(super) addr: String,
    pub(super) epoch: u64,
    pub(super) segment: RwLock<Arc<SegmentDesc>>,
    pub(super) backend_id: PeerId,
    pub(super) valid: AtomicBool,
    /// What moved to and from this peer.
    pub(super) metrics: Arc<PeerCounters>,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("addr", &self.inner.addr)
            .field("epoch", &self.inner.epoch)
            .field("valid", &self.is_valid())
            .finish()
    }
}

impl Peer {
    /// The control-plane address it was reached at.
    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    /// The peer's epoch when connected.
    pub fn epoch(&self) -> u64 {
        self.inner.epoch
    }

    /// The peer's descriptor, as last fetched.
    pub fn segment(&self) -> Arc<SegmentDesc> {
        self.inner.segment.read().clone()
    }

    /// The peer's first region registered under `name`.
    pub fn region(&self, name: &str) -> Option<RegionDesc> {
        self.segment().region_named(name).cloned()
    }

    /// The peer's KV-cache layout named `name`, as last fetched. Its slots name the
    /// peer's views of them (regions of their own), at offset 0.
    pub fn kv_layout(&self, name: &str) -> Option<KvLayout> {
        self.segment().layout(name).cloned()
    }

    /// False once a failure or a restart invalidated it; the engine reconnects on next use.
    pub fn is_valid(&self) -> bool {
        self.inner.valid.load(Ordering::Acquire)
    }
}
