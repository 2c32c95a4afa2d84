//! The engine's control plane as a backend's messenger: a backend that needs side
//! traffic (queue-pair exchanges, shim handshakes) serves a handler for its own
//! messages and calls peers' engines through the engine's authenticated, bounded
//! sessions, within the caller's deadline — it never runs a listener of its own.

use std::fmt;
use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::inbox::PeerEvent;
use crate::time::Deadline;

/// Who sent a backend's message: a peer engine, authenticated by the control plane
/// (with `[engine] auth_token`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PeerInfo {
    /// The peer engine's name.
    pub name: String,
    /// Its epoch.
    pub epoch: u64,
    /// Its control-plane address.
    pub address: String,
}

/// Answers the messages peers' backends send to this engine's backend.
pub trait MessageHandler: Send + Sync + 'static {
    /// Answers `request` from `from`, within `deadline`: the sender's time left, and at
    /// most the serving engine's `handshake_timeout` from the request's arrival.
    ///
    /// # Errors
    /// Whatever refuses the request; the sender receives it as its call's error.
    fn handle(&self, from: &PeerInfo, request: &[u8], deadline: Deadline) -> Result<Vec<u8>>;

    /// Says that the peer engine named `name`, in its life `epoch`, is gone for good,
    /// as this engine's control plane learned on its authenticated sessions: it left
    /// (every session of that life ended with a goodbye: its engine shut down), or it
    /// restarted (its name came back with another epoch). That life sends nothing more,
    /// so what the handler keeps for it, by the name and epoch [`handle`] saw, may go.
    ///
    /// A session that broke without a goodbye (a [`Lost`] peer event) is not reported:
    /// the same life may come back (a network blip), and is reported once it comes back
    /// with another epoch or leaves. The name and epoch are those the peer proved the
    /// token with, not its address: an engine holding the token that claims another's
    /// name *and* epoch is, to te, that engine.
    ///
    /// Called on a control-plane thread of its own, one call at a time; possibly more
    /// than once for one life, and possibly before a request of that life that was
    /// still being answered returns. It may take locks and free resources but must not
    /// wait on a peer. The default does nothing.
    ///
    /// [`handle`]: MessageHandler::handle
    /// [`Lost`]: crate::PeerEventKind::Lost
    fn peer_gone(&self, name: &str, epoch: u64) {
        let _ = (name, epoch);
    }
}

/// What stands behind a [`ControlHook`]: the engine's control plane (control/), a
/// plugin's view of its host's (plugin.rs). This module knows neither; each implements
/// it.
pub(crate) trait HookTarget: Send + Sync {
    /// Which one it is, for `Debug`.
    fn kind(&self) -> &'static str;
    /// See [`ControlHook::serve`].
    fn serve(&self, handler: Arc<dyn MessageHandler>) -> Result<()>;
    /// See [`ControlHook::post_event`].
    fn post_event(&self, event: PeerEvent) -> Result<()>;
    /// See [`ControlHook::call`].
    fn call(&self, peer: &str, request: &[u8], deadline: Deadline) -> Result<Vec<u8>>;
}

/// A backend's access to its engine's control plane, handed over in its
/// [`BackendContext`](crate::BackendContext).
#[derive(Clone, Default)]
pub struct ControlHook(Option<Arc<dyn HookTarget>>);

impl fmt::Debug for ControlHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            None => f.write_str("ControlHook(none)"),
            Some(t) => write!(f, "ControlHook({})", t.kind()),
        }
    }
}

fn no_engine() -> Error {
    Error::new(
        ErrorKind::Unsupported,
        "this backend was created outside an engine: it has no control plane to send messages through",
    )
}

impl ControlHook {
    pub(crate) fn new(target: Arc<dyn HookTarget>) -> ControlHook {
        ControlHook(Some(target))
    }

    fn target(&self) -> Result<&Arc<dyn HookTarget>> {
        self.0.as_ref().ok_or_else(no_engine)
    }

    /// Whether an engine's control plane is behind it.
    pub fn is_connected(&self) -> bool {
        self.0.is_some()
    }

    /// Serves `handler` for the messages peers' backends send to this one. Once.
    ///
    /// # Errors
    /// `InvalidRequest` if a handler is set already; `Unsupported` outside an engine.
    pub fn serve(&self, handler: Arc<dyn MessageHandler>) -> Result<()> {
        self.target()?.serve(handler)
    }

    /// Posts a peer event the backend noticed on its own traffic (a write torn by a
    /// connection that broke mid-payload) to the engine's peer events, where the
    /// engine's user reads it with the others.
    ///
    /// # Errors
    /// `Unsupported` outside an engine; `Cancelled` once its control plane has stopped.
    pub fn post_event(&self, event: PeerEvent) -> Result<()> {
        self.target()?.post_event(event)
    }

    /// Sends `request` to the backend of the engine whose control plane is at `peer`
    /// (a descriptor's `address`) and returns its answer, within `deadline`.
    ///
    /// # Errors
    /// `PeerUnreachable`, `Unauthorized`, `Timeout`, or the peer's handler's error.
    pub fn call(&self, peer: &str, request: &[u8], deadline: Deadline) -> Result<Vec<u8>> {
        self.target()?.call(peer, request, deadline)
    }
}
