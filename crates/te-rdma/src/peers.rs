//! A connected peer ([`Peer`]): its regions as its descriptor gave them, and its paths
//! (one QP set, which its target holds until it is released).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use te_core::sync::{Mutex, RwLock};

use te_core::{PeerId, RegionId};

use crate::endpoint::Endpoint;
use crate::path::Path;
use crate::regions::RemoteRegion;

/// A connected peer: its regions and paths (one QP set, which its target holds until
/// it is released).
pub(crate) struct Peer {
    pub(crate) id: PeerId,
    pub(crate) endpoint: Endpoint,
    /// The peer engine's control-plane address, where the exchange goes.
    pub(crate) address: String,
    /// The id of the QP set the target holds for these paths.
    pub(crate) set: u64,
    pub(crate) regions: RwLock<HashMap<RegionId, Arc<RemoteRegion>>>,
    pub(crate) paths: Vec<Arc<Path>>,
    pub(crate) next: AtomicUsize,
    /// The peer is gone (disconnected, replaced, backend closing): its work
    /// fails instead of moving to another path.
    pub(crate) dead: AtomicBool,
    /// Why the peer is dead, for the batches that fail because of it.
    pub(crate) why: Mutex<String>,
}

impl Peer {
    /// Marks the peer dead with the reason batches will fail with.
    pub(crate) fn kill(&self, why: String) {
        *self.why.lock() = why;
        self.dead.store(true, Ordering::Release);
    }

    /// The healthy paths.
    pub(crate) fn healthy(&self) -> Vec<&Arc<Path>> {
        self.paths
            .iter()
            .filter(|p| !p.broken.load(Ordering::Acquire))
            .collect()
    }
}
