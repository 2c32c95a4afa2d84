//! The engine's control plane as a backend's messenger: a backend that needs side
//! traffic (queue-pair exchanges, shim handshakes) serves a handler for its own
//! messages and calls peers' engines through the engine's authenticated, bounded
//! sessions, within the caller's deadline — it never runs a listener of its own.

use std::fmt;
use std::sync::{Arc, OnceLock, Weak};

use crate::backend::Deadline;
use crate::control::{wire, Identity, Kind, Shared};
use crate::error::{Error, ErrorKind, Result};

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
    /// Answers `request` from `from`, within `deadline` (the sender's time left).
    ///
    /// # Errors
    /// Whatever refuses the request; the sender receives it as its call's error.
    fn handle(&self, from: &PeerInfo, request: &[u8], deadline: Deadline) -> Result<Vec<u8>>;
}

/// The hook as the engine holds it: the backend's handler and the control plane.
#[derive(Default)]
pub(crate) struct HookSlot {
    handler: OnceLock<Arc<dyn MessageHandler>>,
    control: OnceLock<Weak<Shared>>,
}

impl HookSlot {
    pub(crate) fn attach(&self, control: Weak<Shared>) {
        let _ = self.control.set(control);
    }

    pub(crate) fn handle(
        &self,
        from: &Identity,
        request: &[u8],
        deadline: Deadline,
    ) -> Result<Vec<u8>> {
        let h = self.handler.get().ok_or_else(|| {
            Error::new(
                ErrorKind::Unsupported,
                "this engine's backend takes no messages from peers",
            )
        })?;
        let from = PeerInfo {
            name: from.name.clone(),
            epoch: from.epoch,
            address: from.address.clone(),
        };
        h.handle(&from, request, deadline)
    }

    fn serve(&self, handler: Arc<dyn MessageHandler>) -> Result<()> {
        self.handler.set(handler).map_err(|_| {
            Error::new(
                ErrorKind::InvalidRequest,
                "the backend's message handler is set already",
            )
        })
    }

    fn post_event(&self, event: crate::PeerEvent) -> Result<()> {
        let control = self.control.get().and_then(Weak::upgrade).ok_or_else(|| {
            Error::new(
                ErrorKind::Cancelled,
                "the engine's control plane is not running",
            )
        })?;
        control.post_event(event);
        Ok(())
    }

    fn call(&self, peer: &str, request: &[u8], deadline: Deadline) -> Result<Vec<u8>> {
        let control = self.control.get().and_then(Weak::upgrade).ok_or_else(|| {
            Error::new(
                ErrorKind::Cancelled,
                "the engine's control plane is not running",
            )
        })?;
        let body = wire::encode(&wire::BackendMsg {
            timeout_ms: deadline.remaining().as_millis() as u64,
            payload: request.to_vec(),
        });
        match control.call(peer, Kind::Backend, body, deadline)? {
            (Kind::BackendReply, answer) => Ok(answer),
            (other, _) => Err(Error::new(
                ErrorKind::Protocol,
                format!("the peer answered a backend message with {other:?}"),
            )),
        }
    }
}

/// What a backend's messages go through: the engine's hook, a plugin's view of it, or
/// nothing (a backend created outside an engine, in a test).
#[derive(Clone)]
pub(crate) enum HookTarget {
    Engine(Arc<HookSlot>),
    Plugin(Arc<crate::plugin::FfiHookBox>),
}

/// A backend's access to its engine's control plane, handed over in its
/// [`BackendContext`](crate::BackendContext).
#[derive(Clone, Default)]
pub struct ControlHook(Option<HookTarget>);

impl fmt::Debug for ControlHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0 {
            None => "ControlHook(none)",
            Some(HookTarget::Engine(_)) => "ControlHook(engine)",
            Some(HookTarget::Plugin(_)) => "ControlHook(plugin)",
        })
    }
}

fn no_engine() -> Error {
    Error::new(
        ErrorKind::Unsupported,
        "this backend was created outside an engine: it has no control plane to send messages through",
    )
}

impl ControlHook {
    pub(crate) fn new(target: HookTarget) -> ControlHook {
        ControlHook(Some(target))
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
        match &self.0 {
            None => Err(no_engine()),
            Some(HookTarget::Engine(slot)) => slot.serve(handler),
            Some(HookTarget::Plugin(ffi)) => crate::plugin::serve_through(ffi, handler),
        }
    }

    /// Posts a peer event the backend noticed on its own traffic (a write torn by a
    /// connection that broke mid-payload) to the engine's peer events, where the
    /// engine's user reads it with the others.
    ///
    /// # Errors
    /// `Unsupported` outside an engine; `Cancelled` once its control plane has stopped.
    pub fn post_event(&self, event: crate::PeerEvent) -> Result<()> {
        match &self.0 {
            None => Err(no_engine()),
            Some(HookTarget::Engine(slot)) => slot.post_event(event),
            Some(HookTarget::Plugin(ffi)) => crate::plugin::post_through(ffi, &event),
        }
    }

    /// Sends `request` to the backend of the engine whose control plane is at `peer`
    /// (a descriptor's `address`) and returns its answer, within `deadline`.
    ///
    /// # Errors
    /// `PeerUnreachable`, `Unauthorized`, `Timeout`, or the peer's handler's error.
    pub fn call(&self, peer: &str, request: &[u8], deadline: Deadline) -> Result<Vec<u8>> {
        match &self.0 {
            None => Err(no_engine()),
            Some(HookTarget::Engine(slot)) => slot.call(peer, request, deadline),
            Some(HookTarget::Plugin(ffi)) => {
                crate::plugin::call_through(ffi, peer, request, deadline)
            }
        }
    }
}

/// A control plane of its own for a backend created outside an engine (tests and tools
/// that drive a backend directly): the listener, sessions, limits and authentication an
/// engine runs, from an [`EngineConfig`](crate::EngineConfig)'s `[engine]` settings,
/// serving only the backend's messages (a peer asking it for a descriptor is told the
/// engine is not ready). Hand [`StandaloneControl::hook`] to the backend, and drop the
/// backend first.
pub struct StandaloneControl {
    plane: crate::control::ControlPlane,
    hook: ControlHook,
}

impl fmt::Debug for StandaloneControl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StandaloneControl")
            .field("address", &self.address())
            .finish_non_exhaustive()
    }
}

impl StandaloneControl {
    /// Starts a control plane on `config.listen` that names itself `config.name` with
    /// `epoch` (non-zero: the epoch the backend was created with).
    ///
    /// # Errors
    /// `Io` if the address cannot be bound; `ConfigInvalid` for a zero epoch or an
    /// address that cannot be advertised.
    pub fn start(config: &crate::EngineConfig, epoch: u64) -> Result<StandaloneControl> {
        if epoch == 0 {
            return Err(Error::new(
                ErrorKind::ConfigInvalid,
                "a standalone control plane needs the backend's non-zero epoch",
            ));
        }
        let settings = crate::control::Settings::new(config, epoch);
        let slot = Arc::new(HookSlot::default());
        let plane = crate::control::ControlPlane::start(
            settings,
            &config.listen,
            config.advertise.as_deref(),
            slot.clone(),
        )?;
        slot.attach(Arc::downgrade(&plane.shared()));
        Ok(StandaloneControl {
            plane,
            hook: ControlHook::new(HookTarget::Engine(slot)),
        })
    }

    /// The hook to hand to the backend.
    pub fn hook(&self) -> ControlHook {
        self.hook.clone()
    }

    /// The address peers reach this control plane at (a descriptor's `address`).
    pub fn address(&self) -> std::net::SocketAddr {
        self.plane.shared().address()
    }

    /// Every peer event not yet read (those the backend posted, and its peers'),
    /// without waiting.
    pub fn try_recv_events(&self) -> Vec<crate::PeerEvent> {
        self.plane.shared().events.drain()
    }
}
