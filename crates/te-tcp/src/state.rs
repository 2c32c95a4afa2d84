//! What the backend's tasks share ([`Shared`]): its configuration and instance, its
//! registrations, its listener's bookkeeping and its tasks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use te_core::sync::Mutex;

use crate::config::TcpConfig;
use crate::regions::Regions;

/// What the backend's tasks share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) config: TcpConfig,
    /// Random per backend instance: peers name it in the handshake, so a restarted
    /// process (or another one on the same port) refuses what was meant for this one.
    pub(crate) instance: u64,
    pub(crate) regions: Regions,
    pub(crate) closed: AtomicBool,
    /// Ends the accept task.
    pub(crate) closing: tokio::sync::Notify,
    pub(crate) serving: Mutex<HashMap<u64, std::net::TcpStream>>,
    pub(crate) next_serving: AtomicU64,
    /// Accepted connections still in their handshake; the oldest is closed to make
    /// room for a new one.
    pub(crate) pending: Arc<te_core::kit::net::PendingSlots>,
    /// Times `accept` failed (out of descriptors, memory, …) and the listener backed off.
    pub(crate) accept_errors: AtomicU64,
    /// WRITEs into host memory whose payload stopped part way (a torn range).
    pub(crate) torn_writes: AtomicU64,
    /// The engine's control plane, where torn writes are posted as peer events.
    pub(crate) hook: te_core::ControlHook,
    /// The backend's tasks on te-tcp's I/O threads: accepting, watching deadlines, and
    /// serving and driving connections.
    pub(crate) tasks: Arc<crate::runtime::Tasks>,
    /// Pinned staging memory over all connections, both sides.
    pub(crate) staging: Arc<crate::stage::Usage>,
    /// The deadlines of batches in flight.
    pub(crate) watch: Arc<crate::initiator::watch::Watch>,
    /// Challenge nonces of accepted data connections, for same-host channels.
    pub(crate) nonces: crate::samehost::Nonces,
    /// What same-host peers' channels mapped here, shared between a peer's channels.
    pub(crate) imports: crate::samehost::Imports,
    /// Bytes the channels served here hold for requests' entries (the gauge
    /// `samehost_request_bytes`).
    pub(crate) channel_bytes: AtomicU64,
}

impl Shared {
    /// Whether the backend is still open (not dropped).
    pub(crate) fn is_open(&self) -> bool {
        !self.closed.load(Ordering::Acquire)
    }
}
