//! The engine's side of a backend's [`ControlHook`]: the slot holding the backend's
//! message handler, reached by peers' backend requests and by the backend's own calls
//! through this control plane; and a control plane of its own for a backend created
//! outside an engine.

use std::fmt;
use std::sync::{Arc, OnceLock, Weak};

use super::{wire, Identity, Kind, Shared};
use crate::error::{Error, ErrorKind, Result};
use crate::hook::{ControlHook, HookTarget, MessageHandler, PeerInfo};
use crate::inbox::PeerEvent;
use crate::time::Deadline;

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

    /// The backend's handler, once it serves one.
    pub(crate) fn handler(&self) -> Option<Arc<dyn MessageHandler>> {
        self.handler.get().cloned()
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
}

impl HookTarget for HookSlot {
    fn kind(&self) -> &'static str {
        "engine"
    }

    fn serve(&self, handler: Arc<dyn MessageHandler>) -> Result<()> {
        self.handler.set(handler).map_err(|_| {
            Error::new(
                ErrorKind::InvalidRequest,
                "the backend's message handler is set already",
            )
        })
    }

    fn post_event(&self, event: PeerEvent) -> Result<()> {
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

/// A control plane of its own for a backend created outside an engine (tests and tools
/// that drive a backend directly): the listener, sessions, limits and authentication an
/// engine runs, from an [`EngineConfig`](crate::EngineConfig)'s `[engine]` settings,
/// serving only the backend's messages (a peer asking it for a descriptor is told the
/// engine is not ready). Hand [`StandaloneControl::hook`] to the backend, and drop the
/// backend first.
pub struct StandaloneControl {
    plane: super::ControlPlane,
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
    /// `Io` if the address cannot be bound; `ConfigInvalid` for a zero epoch, a value
    /// of `config` out of range (see [`EngineConfig::validate`](crate::EngineConfig::validate))
    /// or an address that cannot be advertised.
    pub fn start(config: &crate::EngineConfig, epoch: u64) -> Result<StandaloneControl> {
        config.validate()?;
        if epoch == 0 {
            return Err(Error::new(
                ErrorKind::ConfigInvalid,
                "a standalone control plane needs the backend's non-zero epoch",
            ));
        }
        let settings = super::Settings::new(config, epoch);
        let slot = Arc::new(HookSlot::default());
        let plane = super::ControlPlane::start(
            settings,
            &config.listen,
            config.advertise.as_deref(),
            slot.clone(),
        )?;
        slot.attach(Arc::downgrade(&plane.shared()));
        Ok(StandaloneControl {
            plane,
            hook: ControlHook::new(slot),
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

    /// What this control plane counted: peers up, peer events, refused connections and
    /// the bytes of peers' backend requests it holds (no batches run here, so the rest
    /// of [`Metrics`](crate::Metrics) stays empty).
    pub fn metrics(&self) -> crate::Metrics {
        let mut m = crate::Metrics::default();
        self.plane.shared().counters.fill(&mut m);
        m
    }

    /// Every peer event not yet read (those the backend posted, and its peers'),
    /// without waiting.
    pub fn try_recv_events(&self) -> Vec<PeerEvent> {
        self.plane.shared().events.drain()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_standalone_control_plane_checks_its_config_as_an_engine_does() {
        type Set = fn(&mut crate::EngineConfig);
        let cases: [(&str, Set); 3] = [
            ("heartbeat = 0s", |c| c.heartbeat = Duration::ZERO),
            ("max_sessions = 0", |c| c.max_sessions = 0),
            ("auth_token = \"\"", |c| c.auth_token = Some(String::new())),
        ];
        for (what, set) in cases {
            let mut config = crate::EngineConfig::default();
            set(&mut config);
            match StandaloneControl::start(&config, 1) {
                Err(e) => assert_eq!(e.kind(), ErrorKind::ConfigInvalid, "{what}: {e}"),
                Ok(_) => panic!("a standalone control plane started with {what}"),
            }
        }
        let good = StandaloneControl::start(&crate::EngineConfig::default(), 1);
        assert!(good.is_ok(), "{good:?}");
    }
}
