//! What the backend's threads share ([`Shared`]): its configuration and devices, its
//! registrations, its peers and the QP sets it serves, its batches in flight. The
//! connection logic on it is in `connect`.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::thread::JoinHandle;
use te_core::peer_table::PeerTable;
use te_core::sync::{Condvar, Mutex};

use te_core::{ControlHook, PeerId};

use crate::completion::InFlight;
use crate::config::RdmaConfig;
use crate::connect::Served;
use crate::device::Device;
use crate::peers::Peer;
use crate::regions::Regions;
use crate::topology::Place;

/// What the backend's threads share.
pub(crate) struct Shared {
    pub(crate) config: RdmaConfig,
    pub(crate) instance: u64,
    pub(crate) devices: Vec<Arc<Device>>,
    /// Where each device sits on the PCIe tree.
    pub(crate) nic_places: Vec<Place>,
    pub(crate) regions: Regions,
    /// The batches in flight, for the engine's abort.
    pub(crate) in_flight: Arc<InFlight>,
    pub(crate) peers: PeerTable<Arc<Peer>>,
    pub(crate) by_instance: Mutex<HashMap<u64, PeerId>>,
    pub(crate) next_tag: AtomicU64,
    pub(crate) closed: AtomicBool,
    /// The engine's control plane: the exchange's requests go through it.
    pub(crate) hook: ControlHook,
    /// The next QP set id this backend asks a target for.
    pub(crate) next_set: AtomicU64,
    /// The QP sets this backend holds as the target, per initiator.
    pub(crate) served: Mutex<Served>,
    pub(crate) threads: Mutex<Vec<JoinHandle<()>>>,
    /// Peers whose paths the repair thread should rebuild.
    pub(crate) repairs: Mutex<VecDeque<PeerId>>,
    pub(crate) repair_wake: Condvar,
}
