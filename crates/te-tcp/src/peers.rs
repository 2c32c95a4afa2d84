//! A peer as the initiator knows it ([`PeerConns`]): its data listener, its instance,
//! its connections and same-host channels; and how frames to it travel ([`PeerPath`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use te_core::sync::{Mutex, RwLock};

use te_core::RegionId;

use crate::initiator::conn::Conn;
use crate::samehost::Channel;
use crate::state::Shared;

/// One peer: where its data listener is, which instance it is, and the connections.
#[derive(Debug)]
pub(crate) struct PeerConns {
    pub(crate) addr: SocketAddr,
    pub(crate) instance: u64,
    pub(crate) conns: RwLock<Vec<Arc<Conn>>>,
    /// The slice size agreed with this peer: the smaller of our `slice_size` and the
    /// frame limit its connections announced.
    pub(crate) slice: AtomicU64,
    /// The peer itself, when it is a tcp backend of this process (see `local`).
    pub(crate) local: Option<std::sync::Weak<Shared>>,
    /// The peer's regions' memory: `None` for host memory, else the runtime's name.
    pub(crate) kinds: RwLock<HashMap<RegionId, Option<String>>>,
    /// The same-host channels to the peer, where it is a process of this host: one per
    /// data connection, each served by a thread of the target's. A batch's device frames
    /// are one request on the least busy channel; host frames spread over all.
    pub(crate) channels: Mutex<Vec<Arc<Channel>>>,
    /// What this backend exported to the peer, for all its channels.
    pub(crate) exports: Arc<Mutex<crate::samehost::Exports>>,
    /// The peer advertises this host's boot id: a channel is worth trying.
    pub(crate) same_boot: bool,
}

/// How frames to a peer travel ([`TcpBackend::peer_path`](crate::TcpBackend::peer_path)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerPath {
    /// Over the data connections.
    Socket,
    /// A tcp backend of this process: device frames are device copies
    /// (`local_copies`), the rest goes over the data connections.
    InProcess,
    /// A process of this host, through the same-host channel: device memory of one
    /// runtime as device copies, host memory with one cross-memory-attach copy where
    /// `cross_memory_attach` (else over the data connections), the rest over them.
    SameHost {
        /// The kernel lets the peer copy this process's host memory.
        cross_memory_attach: bool,
    },
}

impl std::fmt::Display for PeerPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PeerPath::Socket => "socket",
            PeerPath::InProcess => "in-process device copies (host memory over the socket)",
            PeerPath::SameHost {
                cross_memory_attach: true,
            } => "same-host channel (cross-memory attach)",
            PeerPath::SameHost {
                cross_memory_attach: false,
            } => "same-host channel (host memory over the socket)",
        })
    }
}
