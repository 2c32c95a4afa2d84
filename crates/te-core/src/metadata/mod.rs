//! Where engines find each other by name: the [`MetadataStore`] seam.
//!
//! `[engine] metadata` picks the store:
//! - `p2p` (the default): no store. Peers are named by their control-plane
//!   `host:port`, and each engine's descriptor comes from its own control plane.
//! - `etcd://host:port[,host:port…]`: each engine publishes a small entry (name, epoch,
//!   control-plane address, backend) under `[engine] metadata_prefix`, held by a lease
//!   of `[engine] metadata_ttl` that a background thread renews; `Engine::connect`
//!   resolves a name through it, and a watch invalidates a cached peer as soon as its
//!   entry changes (a restart) or disappears. Descriptors stay on the control plane,
//!   so no descriptor is ever too large for the store.

mod etcd;
mod http;

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::config::{EngineConfig, MetadataLocation};
use crate::error::{Error, ErrorKind, Result};
use crate::time::Deadline;

/// What an engine publishes about itself in a metadata store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineEntry {
    /// The engine's configured name (`[engine] name`).
    pub name: String,
    /// Random at every start; a new epoch under the same name is a restart.
    pub epoch: u64,
    /// The control-plane address peers connect to (`host:port`).
    pub address: String,
    /// The backend the engine runs.
    pub backend: String,
}

/// Called with a resolved entry that changed (a restart) or disappeared.
pub type OnStale = Box<dyn Fn(&EngineEntry) + Send + Sync>;

/// A directory of engines by name, with liveness.
pub trait MetadataStore: Send + Sync {
    /// The store as the configuration names it, for messages.
    fn describe(&self) -> String;

    /// Publishes this engine's entry and keeps it alive until
    /// [`MetadataStore::withdraw`] (or the process dies and its lease expires).
    ///
    /// # Errors
    /// `PeerUnreachable` naming the store's endpoints if it cannot be reached before
    /// `deadline`.
    fn publish(&self, entry: &EngineEntry, deadline: Deadline) -> Result<()>;

    /// The entry published under `name`, if any. A store remembers what it resolved, so
    /// that it can report it stale later.
    ///
    /// # Errors
    /// `PeerUnreachable` if the store cannot be reached before `deadline`.
    fn resolve(&self, name: &str, deadline: Deadline) -> Result<Option<EngineEntry>>;

    /// Every engine in the store.
    ///
    /// # Errors
    /// As [`MetadataStore::resolve`]; `Unsupported` for `p2p`, which has no directory.
    fn list(&self, deadline: Deadline) -> Result<Vec<EngineEntry>>;

    /// Sets what to call when a resolved entry changes or disappears.
    fn on_stale(&self, f: OnStale);

    /// Removes this engine's entry (best effort, within `deadline`).
    fn withdraw(&self, deadline: Deadline);
}

/// Opens the store `config.metadata` names.
///
/// # Errors
/// `ConfigInvalid` for a malformed `metadata` value.
pub fn open(config: &EngineConfig) -> Result<Arc<dyn MetadataStore>> {
    match crate::config::metadata_location(&config.metadata)? {
        MetadataLocation::P2p => Ok(Arc::new(P2p)),
        MetadataLocation::Etcd(endpoints) => Ok(Arc::new(etcd::Etcd::new(
            endpoints,
            &config.metadata_prefix,
            config.metadata_ttl,
        ))),
    }
}

/// Whether `s` names an address (`host:port`) rather than an engine.
pub(crate) fn is_address(s: &str) -> bool {
    s.rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
}

/// No store: engines are named by their addresses.
struct P2p;

impl MetadataStore for P2p {
    fn describe(&self) -> String {
        "p2p".to_string()
    }

    fn publish(&self, _: &EngineEntry, _: Deadline) -> Result<()> {
        Ok(())
    }

    fn resolve(&self, _: &str, _: Deadline) -> Result<Option<EngineEntry>> {
        Ok(None)
    }

    fn list(&self, _: Deadline) -> Result<Vec<EngineEntry>> {
        Err(Error::new(
            ErrorKind::Unsupported,
            "metadata = \"p2p\" keeps no directory of engines; set [engine] metadata = \"etcd://HOST:PORT\"",
        ))
    }

    fn on_stale(&self, _: OnStale) {}

    fn withdraw(&self, _: Deadline) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_addresses_are_told_apart() {
        assert!(is_address("127.0.0.1:5000"));
        assert!(is_address("[::1]:5000"));
        assert!(is_address("decode.local:80"));
        assert!(!is_address("decode-0"));
        assert!(!is_address("decode:zero"));
        assert!(!is_address(":80"));
    }
}
