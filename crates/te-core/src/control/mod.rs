//! The control plane: every engine's listener, and its sessions to peers.
//!
//! It runs on a small runtime of its own (one thread per engine, event-driven), so a
//! thousand idle or slow peers cost sockets and a few hundred bytes each, not threads.
//!
//! - **Sessions.** An engine that connects to a peer opens one persistent session to
//!   its control plane: authenticated once, then carrying every request — the
//!   descriptor, notifications, the backend's own messages — pipelined, many in flight,
//!   matched to replies by id, with a heartbeat. One session per peer, one task each,
//!   so a slow or dead peer delays nothing sent to another.
//! - **The listener** (`server`) admits connections under caps: unauthenticated ones
//!   are few, short-lived (one deadline for the whole handshake) and the oldest is
//!   evicted to make room; sessions are capped in all and per source address; running
//!   out of descriptors backs off and evicts, never spins or stops.
//! - **Authentication** (`auth`): with `[engine] auth_token`, both sides prove the token
//!   (HMAC challenge–response), the client first: the server says nothing about itself,
//!   and nothing made with the token, before it has checked the client's proof; without
//!   it a peer learns nothing and can send nothing.
//! - **Peer events**: a session that breaks without a goodbye, or a peer that comes
//!   back with a new epoch, is reported to the engine's user; a peer's life that left
//!   or restarted, to the engine and the backend's message handler too (`peer_gone`),
//!   so that they may free what they held for that life.

mod hook;
mod server;
mod session;
#[cfg(test)]
mod tests;
pub(crate) mod wire;

use crate::signals::SpawnMasked as _;
use crate::sync::{Condvar, Mutex};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use crate::desc::SegmentDesc;
use crate::error::{Error, ErrorKind, Result};
use crate::inbox::{Mailbox, PeerEvent, PeerEventKind};
use crate::time::Deadline;
pub(crate) use hook::HookSlot;
pub use hook::StandaloneControl;

pub(crate) use wire::{Identity, Kind};
pub use wire::{MAX_FRAME, VERSIONS};

/// Peer events kept until read; the oldest are dropped beyond it.
pub(crate) const EVENTS: usize = 4096;
/// Threads for looking up peers' host names at once, besides the backend workers.
const LOOKUP_THREADS: usize = 4;

/// How the control plane behaves: the engine's identity and the `[engine]` limits.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) name: String,
    pub(crate) epoch: u64,
    pub(crate) token: Option<Vec<u8>>,
    pub(crate) heartbeat: Duration,
    pub(crate) handshake_timeout: Duration,
    pub(crate) max_pending: usize,
    pub(crate) max_pending_per_source: usize,
    pub(crate) max_sessions: usize,
    pub(crate) max_sessions_per_source: usize,
    pub(crate) notification_max: usize,
    /// The versions this engine speaks (a test can pretend to be another build).
    pub(crate) versions: (u16, u16),
}

impl Settings {
    /// The settings of an engine configured by `config`, running as `epoch`.
    pub(crate) fn new(config: &crate::EngineConfig, epoch: u64) -> Settings {
        Settings {
            name: config.name.clone(),
            epoch,
            token: config.auth_token.clone().map(String::into_bytes),
            heartbeat: config.heartbeat,
            handshake_timeout: config.handshake_timeout,
            max_pending: config.max_pending,
            max_pending_per_source: config.max_pending_per_source,
            max_sessions: config.max_sessions,
            max_sessions_per_source: config.max_sessions_per_source,
            notification_max: config.notification_max as usize,
            versions: VERSIONS,
        }
    }
}

/// What the server asks of its engine.
pub(crate) trait Handler: Send + Sync + 'static {
    /// The current segment descriptor.
    fn segment(&self) -> SegmentDesc;
    /// Accepts a notification from an authenticated peer.
    fn notify(&self, from: &Identity, to_epoch: u64, message: Vec<u8>) -> Result<()>;
    /// The life `epoch` of the peer named `name` is gone for good (it left, or a newer
    /// life replaced it): let go of what was kept for it. Called on a blocking thread
    /// of the control plane, one departure at a time.
    fn peer_gone(&self, _name: &str, _epoch: u64) {}
}

/// The sessions' and connections' view of which peers are up, for peer events.
///
/// A name can have more than one life up at once: a peer that restarted before its old
/// sessions were found dead, or another engine claiming its name. Each life is counted
/// apart, so none hides another's end: the newer life is reported as a restart only
/// when the older one ends, and a life that ends while an older one of its name is up
/// is reported as nothing.
#[derive(Default)]
struct Links {
    /// Per name with links up: its lives, oldest first, each with how many live
    /// sessions or connections it has.
    live: HashMap<String, Vec<(Identity, usize)>>,
    /// The last epoch of names whose links all ended, by a hash of the name, so that a
    /// name back with another epoch after a gap is a restart: at most [`DEPARTED`],
    /// the oldest forgotten first, in a few bytes each whatever the names' length.
    departed: HashMap<u64, u64>,
    departed_order: std::collections::VecDeque<u64>,
    hasher: std::hash::RandomState,
}

/// Names whose last epoch [`Links`] remembers after they left.
const DEPARTED: usize = 65_536;

impl Links {
    fn hash(&self, name: &str) -> u64 {
        std::hash::BuildHasher::hash_one(&self.hasher, name)
    }

    fn depart(&mut self, name: &str, epoch: u64) {
        let h = self.hash(name);
        if self.departed.insert(h, epoch).is_none() {
            self.departed_order.push_back(h);
        }
        while self.departed_order.len() > DEPARTED {
            if let Some(old) = self.departed_order.pop_front() {
                self.departed.remove(&old);
            }
        }
    }
}

/// What the engine's parts share: the runtime's handle, settings, the handler, events.
pub(crate) struct Shared {
    rt: tokio::runtime::Handle,
    pub(crate) settings: Settings,
    address: SocketAddr,
    handler: OnceLock<Weak<dyn Handler>>,
    pub(crate) hook: Arc<HookSlot>,
    pub(crate) events: Mailbox<PeerEvent>,
    /// Peers' lives gone for good (name, epoch), for the backend's handler and the
    /// engine; at most [`EVENTS`] waiting.
    gone: tokio::sync::mpsc::Sender<(String, u64)>,
    links: Mutex<Links>,
    sessions: Mutex<HashMap<String, Arc<session::Session>>>,
    closing: tokio::sync::watch::Sender<bool>,
    closed: AtomicBool,
    tasks: Mutex<usize>,
    tasks_done: Condvar,
    /// Peers up, lost, restarted, left; refusals.
    pub(crate) counters: crate::metrics::ControlCounters,
}

impl Shared {
    /// The handler, once the engine has set it.
    fn handler(&self) -> Option<Arc<dyn Handler>> {
        self.handler.get().and_then(Weak::upgrade)
    }

    /// A peer's session or connection came up. A name back with a new epoch, none of
    /// its lives being up, is a restart.
    fn link_up(&self, peer: &Identity) {
        let mut links = self.links.lock();
        if let Some(lives) = links.live.get_mut(&peer.name) {
            match lives.iter_mut().find(|(l, _)| l.epoch == peer.epoch) {
                Some((_, n)) => *n += 1,
                // Reported when one of the two ends (`link_down`).
                None => lives.push((peer.clone(), 1)),
            }
            return;
        }
        let h = links.hash(&peer.name);
        let previous = links.departed.remove(&h);
        links
            .live
            .insert(peer.name.clone(), vec![(peer.clone(), 1)]);
        self.counters.peers.fetch_add(1, Ordering::Relaxed);
        if let Some(previous) = previous.filter(|&p| p != peer.epoch) {
            self.counters.restarted.fetch_add(1, Ordering::Relaxed);
            self.event(PeerEventKind::Restarted, peer, Some(previous));
        }
    }

    /// A peer's session or connection ended; the last one of its life to end says how:
    /// the name left or was lost if no other life of it is up, it restarted if a newer
    /// one is.
    fn link_down(&self, peer: &Identity, graceful: bool) {
        let mut links = self.links.lock();
        let Some(lives) = links.live.get_mut(&peer.name) else {
            return;
        };
        let Some(i) = lives.iter().position(|(l, _)| l.epoch == peer.epoch) else {
            return;
        };
        lives[i].1 -= 1;
        if lives[i].1 > 0 {
            return;
        }
        lives.remove(i);
        let closed = self.closed.load(Ordering::Acquire);
        if let Some((newest, _)) = lives.last() {
            // Another life is up: newer than this one, it is the restart; older, this
            // one was the newcomer, and the name stays up as it was.
            if i < lives.len() && !closed {
                let newest = newest.clone();
                self.counters.restarted.fetch_add(1, Ordering::Relaxed);
                self.event(PeerEventKind::Restarted, &newest, Some(peer.epoch));
            }
            return;
        }
        links.live.remove(&peer.name);
        links.depart(&peer.name, peer.epoch);
        self.counters.peers.fetch_sub(1, Ordering::Relaxed);
        if !closed {
            let (kind, counter) = if graceful {
                (PeerEventKind::Left, &self.counters.left)
            } else {
                (PeerEventKind::Lost, &self.counters.lost)
            };
            counter.fetch_add(1, Ordering::Relaxed);
            self.event(kind, peer, None);
        }
    }

    /// Reports a peer event to the engine's user and, for a life that left or was
    /// replaced by a restart, to the backend's handler and the engine.
    fn event(&self, kind: PeerEventKind, peer: &Identity, previous_epoch: Option<u64>) {
        tracing::info!(?kind, peer = %peer.name, epoch = peer.epoch, address = %peer.address, "peer event");
        let gone = match kind {
            PeerEventKind::Left => Some(peer.epoch),
            PeerEventKind::Restarted => previous_epoch,
            // A lost life may come back with the same epoch.
            PeerEventKind::Lost | PeerEventKind::TornWrite => None,
        };
        if let Some(epoch) = gone {
            if let Err(tokio::sync::mpsc::error::TrySendError::Full(_)) =
                self.gone.try_send((peer.name.clone(), epoch))
            {
                tracing::warn!(peer = %peer.name, epoch, "{EVENTS} departed peers wait for the backend to free what it held for them; it is not told of this one");
            }
        }
        self.events.push_dropping(
            PeerEvent {
                kind,
                name: peer.name.clone(),
                epoch: peer.epoch,
                previous_epoch,
                address: peer.address.clone(),
                at: SystemTime::now(),
                torn: None,
            },
            EVENTS,
        );
    }

    /// Queues an event a backend posted through its hook.
    pub(crate) fn post_event(&self, event: PeerEvent) {
        tracing::info!(kind = ?event.kind, peer = %event.address, torn = ?event.torn, "peer event from the backend");
        self.events.push_dropping(event, EVENTS);
    }

    /// Counts a task in for the orderly shutdown; the guard counts it out.
    fn task(self: &Arc<Self>) -> TaskGuard {
        *self.tasks.lock() += 1;
        TaskGuard(self.clone())
    }

    /// This engine's identity as its sessions announce it.
    fn identity(&self) -> Identity {
        Identity {
            name: self.settings.name.clone(),
            epoch: self.settings.epoch,
            address: self.address.to_string(),
            heartbeat_ms: self.settings.heartbeat.as_millis() as u64,
            notification_max: Some(self.settings.notification_max as u64),
        }
    }

    fn shut_down_error(&self) -> Error {
        Error::new(
            ErrorKind::Cancelled,
            "the engine's control plane has shut down",
        )
    }

    /// Sends one request to the engine at `addr` over its session (opened if needed)
    /// and waits for the reply, until `deadline`.
    pub(crate) fn call(
        self: &Arc<Self>,
        addr: &str,
        kind: Kind,
        body: Vec<u8>,
        deadline: Deadline,
    ) -> Result<(Kind, Vec<u8>)> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.send(
            addr,
            kind,
            body,
            deadline,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        match rx.recv_timeout(deadline.remaining()) {
            Ok(r) => r,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(Error::new(
                ErrorKind::Timeout,
                "the peer did not answer before the deadline",
            )
            .with_context("peer", addr)),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(self.shut_down_error()),
        }
    }

    /// Queues one request to the engine at `addr`; `reply` runs once with its answer
    /// (or the failure), from the control plane's thread.
    pub(crate) fn send(
        self: &Arc<Self>,
        addr: &str,
        kind: Kind,
        body: Vec<u8>,
        deadline: Deadline,
        reply: session::Reply,
    ) {
        if self.closed.load(Ordering::Acquire) {
            return reply(Err(self.shut_down_error()));
        }
        session::Session::get(self, addr, deadline).request(self, kind, body, deadline, reply);
    }

    /// Whether the session to `addr` is up.
    pub(crate) fn session_alive(&self, addr: &str) -> bool {
        self.sessions.lock().get(addr).is_some_and(|s| s.is_alive())
    }

    /// The address peers reach this control plane at.
    pub(crate) fn address(&self) -> SocketAddr {
        self.address
    }
}

/// Tells the backend's handler, then the engine, of the peers' lives gone for good,
/// one at a time, on a blocking thread: the handler may destroy what it held (queue
/// pairs) and the engine disconnects the backend from them, which must not stall the
/// sessions, nor take more than one of the threads kept for host-name lookups.
async fn tell_gone(
    shared: Arc<Shared>,
    mut departures: tokio::sync::mpsc::Receiver<(String, u64)>,
) {
    while let Some((name, epoch)) = departures.recv().await {
        let (backend, engine) = (shared.hook.handler(), shared.handler());
        if backend.is_none() && engine.is_none() {
            continue;
        }
        let told = tokio::task::spawn_blocking(move || {
            if let Some(backend) = backend {
                backend.peer_gone(&name, epoch);
            }
            if let Some(engine) = engine {
                engine.peer_gone(&name, epoch);
            }
        })
        .await;
        if told.as_ref().is_err_and(|e| e.is_panic()) {
            tracing::error!(
                "letting a departed peer go panicked, in the backend's peer_gone or disconnect; this is a bug in the backend"
            );
        }
    }
}

/// Resolves once the engine closes (at once if it has closed already).
pub(crate) async fn closed(rx: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = rx.wait_for(|c| *c).await;
}

struct TaskGuard(Arc<Shared>);

impl Drop for TaskGuard {
    fn drop(&mut self) {
        let mut n = self.0.tasks.lock();
        *n -= 1;
        if *n == 0 {
            self.0.tasks_done.notify_all();
        }
    }
}

/// The control plane's owner: its runtime thread. Dropping it says goodbye to every
/// peer, then stops the runtime.
pub(crate) struct ControlPlane {
    shared: Arc<Shared>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl ControlPlane {
    /// Binds `listen` (peers are told `advertise`, or the bound address) and starts
    /// serving.
    ///
    /// # Errors
    /// `Io` if the address cannot be bound or the thread cannot start; `ConfigInvalid`
    /// for an address that cannot be advertised.
    pub(crate) fn start(
        settings: Settings,
        listen: &str,
        advertise: Option<&str>,
        hook: Arc<HookSlot>,
    ) -> Result<ControlPlane> {
        let (listener, address) = crate::kit::net::bind("[engine]", listen, advertise)
            .map_err(|e| e.with_operation("start control plane"))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("start control plane", "cannot configure the listener", e))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            // Backend requests take at most BACKEND_WORKERS, and the backend's
            // `peer_gone` one; the rest look up peers' host names, which so never wait
            // behind slow backend requests.
            .max_blocking_threads(server::BACKEND_WORKERS + LOOKUP_THREADS + 1)
            .thread_name("te-control")
            // Blocking threads take none of the process's signals (`kit::thread`).
            .on_thread_start(crate::signals::mask_signals)
            .build()
            .map_err(|e| Error::io("start control plane", "cannot build the runtime", e))?;
        let (closing, _) = tokio::sync::watch::channel(false);
        let (gone, departures) = tokio::sync::mpsc::channel(EVENTS);
        let shared = Arc::new(Shared {
            rt: rt.handle().clone(),
            settings,
            address,
            handler: OnceLock::new(),
            hook,
            events: Mailbox::new(),
            gone,
            links: Mutex::new(Links::default()),
            sessions: Mutex::new(HashMap::new()),
            closing,
            closed: AtomicBool::new(false),
            tasks: Mutex::new(0),
            tasks_done: Condvar::new(),
            counters: Default::default(),
        });
        let listener = {
            let _guard = rt.enter();
            tokio::net::TcpListener::from_std(listener)
                .map_err(|e| Error::io("start control plane", "cannot register the listener", e))?
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("te-control".into())
            .spawn_masked(move || {
                rt.spawn(tell_gone(s.clone(), departures));
                rt.spawn(server::accept_loop(s, listener));
                rt.block_on(async {
                    let _ = stopped.await;
                });
            })
            .map_err(|e| Error::io("start control plane", "cannot spawn its thread", e))?;
        Ok(ControlPlane {
            shared,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// What the engine's other parts keep.
    pub(crate) fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    /// Sets the engine that answers requests.
    pub(crate) fn set_handler(&self, handler: Weak<dyn Handler>) {
        let _ = self.shared.handler.set(handler);
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        // Every session and connection says goodbye (bounded by a heartbeat each),
        // then the runtime stops and cancels what is left.
        self.shared.closing.send_replace(true);
        let bound = self.shared.settings.heartbeat + Duration::from_millis(100);
        let n = self.shared.tasks.lock();
        let _ = self
            .shared
            .tasks_done
            .wait_timeout_while(n, bound, |n| *n > 0);
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
        self.shared.sessions.lock().clear();
    }
}
