//! A backend's connected peers by [`PeerId`]: the ids it hands out, and the one error
//! every backend gives for a peer it does not know.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::sync::{RwLock, RwLockWriteGuard};
use crate::{Error, ErrorKind, PeerId, Result};

/// Peers of one backend instance, each some state `P` (usually an `Arc`).
#[derive(Debug)]
pub struct PeerTable<P> {
    backend: &'static str,
    next: AtomicU64,
    map: RwLock<HashMap<PeerId, P>>,
}

impl<P: Clone> PeerTable<P> {
    /// An empty table of the backend named `backend` (for messages).
    pub fn new(backend: &'static str) -> PeerTable<P> {
        PeerTable {
            backend,
            next: AtomicU64::new(1),
            map: RwLock::new(HashMap::new()),
        }
    }

    /// An id this table has not handed out before.
    pub fn next_id(&self) -> PeerId {
        PeerId(self.next.fetch_add(1, Ordering::Relaxed))
    }

    /// Adds (or replaces) peer `id`; returns the one it replaced.
    pub fn insert(&self, id: PeerId, peer: P) -> Option<P> {
        self.map.write().insert(id, peer)
    }

    /// Peer `id`.
    ///
    /// # Errors
    /// `PeerUnreachable` if the backend is not connected to it (never was, was
    /// disconnected, or dropped it after a failure): connect again.
    pub fn get(&self, id: PeerId) -> Result<P> {
        self.map.read().get(&id).cloned().ok_or_else(|| {
            Error::new(
                ErrorKind::PeerUnreachable,
                format!(
                    "the {} backend is not connected to peer {} (connect again)",
                    self.backend, id.0
                ),
            )
        })
    }

    /// Takes peer `id` out of the table.
    ///
    /// # Errors
    /// `PeerUnreachable` if the backend is not connected to it.
    pub fn remove(&self, id: PeerId) -> Result<P> {
        self.map.write().remove(&id).ok_or_else(|| {
            Error::new(
                ErrorKind::PeerUnreachable,
                format!(
                    "the {} backend has no peer {} to disconnect",
                    self.backend, id.0
                ),
            )
        })
    }

    /// Every peer, as the table holds them now.
    pub fn all(&self) -> Vec<P> {
        self.map.read().values().cloned().collect()
    }

    /// Takes every peer out of the table (at shutdown).
    pub fn drain(&self) -> Vec<P> {
        self.map.write().drain().map(|(_, p)| p).collect()
    }

    /// The table itself, locked, for an update that must look and change at once.
    pub fn write(&self) -> RwLockWriteGuard<'_, HashMap<PeerId, P>> {
        self.map.write()
    }
}

#[cfg(test)]
mod tests {
    use super::PeerTable;
    use crate::ErrorKind;

    #[test]
    fn an_unknown_peer_is_unreachable_and_names_the_backend() {
        let t: PeerTable<u32> = PeerTable::new("tcp");
        let (a, b) = (t.next_id(), t.next_id());
        assert_ne!(a, b);
        assert!(t.insert(a, 7).is_none());
        assert_eq!(t.get(a).unwrap(), 7);
        let e = t.get(b).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PeerUnreachable);
        assert!(
            e.to_string().contains("tcp backend is not connected"),
            "{e}"
        );
        assert_eq!(t.remove(a).unwrap(), 7);
        assert_eq!(t.remove(a).unwrap_err().kind(), ErrorKind::PeerUnreachable);
        t.insert(b, 1);
        assert_eq!(t.drain(), [1]);
    }
}
