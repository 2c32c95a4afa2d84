//! The control plane's listener: admission under caps, the handshake, and serving an
//! authenticated peer's requests.

use crate::sync::Mutex;
use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Notify};

use super::session::{read_header, read_payload, within};
use super::wire::{self, BackendMsg, Hello, Identity, Kind, Notice, Proof, Welcome};
use super::{closed, Shared};
use crate::auth;
use crate::backend::Deadline;
use crate::error::{Error, ErrorKind, Result};

/// Connections not yet authenticated, oldest first, and sessions per source.
#[derive(Default)]
struct Admission {
    pending: VecDeque<(u64, IpAddr, Arc<Notify>)>,
    sessions: HashMap<IpAddr, usize>,
    total: usize,
    next: u64,
}

impl Admission {
    /// Makes room for one more unauthenticated connection from `ip`, evicting the
    /// oldest of that source past its cap, or the oldest of all past the total.
    fn admit(&mut self, ip: IpAddr, per_source: usize, max: usize) -> (u64, Arc<Notify>) {
        let from_source = self.pending.iter().filter(|p| p.1 == ip).count();
        if from_source >= per_source.max(1) {
            if let Some(i) = self.pending.iter().position(|p| p.1 == ip) {
                self.evict(i);
            }
        } else if self.pending.len() >= max.max(1) {
            self.evict(0);
        }
        self.next += 1;
        let evict = Arc::new(Notify::new());
        self.pending.push_back((self.next, ip, evict.clone()));
        (self.next, evict)
    }

    fn evict(&mut self, i: usize) {
        if let Some((_, ip, n)) = self.pending.remove(i) {
            tracing::debug!(%ip, "control plane: evicting an unauthenticated connection");
            n.notify_one();
        }
    }

    fn evict_oldest(&mut self) -> bool {
        let any = !self.pending.is_empty();
        self.evict(0);
        any
    }

    fn forget(&mut self, id: u64) {
        self.pending.retain(|p| p.0 != id);
    }
}

/// One connection's place in the admission book.
struct Ticket {
    shared: Arc<Shared>,
    admission: Arc<Mutex<Admission>>,
    id: u64,
    ip: IpAddr,
    session: bool,
}

impl Ticket {
    /// Turns an authenticated connection into a session, within the session caps.
    fn promote(&mut self) -> Result<()> {
        let s = &self.shared.settings;
        let mut a = self.admission.lock();
        a.forget(self.id);
        let from_source = a.sessions.get(&self.ip).copied().unwrap_or(0);
        if a.total >= s.max_sessions || from_source >= s.max_sessions_per_source {
            return Err(Error::new(
                ErrorKind::Busy,
                format!(
                    "this engine serves {} sessions ({} from {}), its limit; try again later or raise max_sessions",
                    a.total, from_source, self.ip
                ),
            ));
        }
        a.total += 1;
        *a.sessions.entry(self.ip).or_insert(0) += 1;
        self.session = true;
        Ok(())
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut a = self.admission.lock();
        if self.session {
            a.total -= 1;
            if let Some(n) = a.sessions.get_mut(&self.ip) {
                *n -= 1;
                if *n == 0 {
                    a.sessions.remove(&self.ip);
                }
            }
        } else {
            a.forget(self.id);
        }
    }
}

/// Accepts connections until the engine closes. Running out of descriptors (or
/// memory) evicts the oldest unauthenticated connection and backs off, doubling from
/// 5 ms to 1 s; it never spins and never stops accepting. A burst of such errors is
/// logged once when it starts and once when it ends.
pub(super) async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    let admission = Arc::new(Mutex::new(Admission::default()));
    let mut closing = shared.closing.subscribe();
    let mut backoff = Duration::ZERO;
    let mut failures = 0u64;
    loop {
        let accepted = tokio::select! {
            _ = closed(&mut closing) => return,
            r = listener.accept() => r,
        };
        match accepted {
            Ok((stream, peer)) => {
                if failures > 0 {
                    tracing::warn!(
                        failures,
                        "control plane: accepting again after running out of resources"
                    );
                    failures = 0;
                }
                backoff = Duration::ZERO;
                let s = &shared.settings;
                let (id, evict) =
                    admission
                        .lock()
                        .admit(peer.ip(), s.max_pending_per_source, s.max_pending);
                let ticket = Ticket {
                    shared: shared.clone(),
                    admission: admission.clone(),
                    id,
                    ip: peer.ip(),
                    session: false,
                };
                let guard = shared.task();
                shared.rt.spawn(async move {
                    let _guard = guard;
                    serve(ticket, stream, peer, evict).await;
                });
            }
            Err(e) => {
                let scarce = crate::net::out_of_resources(&e);
                if failures == 0 {
                    tracing::warn!(error = %e, "control plane: accept failed; backing off");
                }
                failures += 1;
                if scarce {
                    admission.lock().evict_oldest();
                }
                backoff = (backoff * 2).clamp(Duration::from_millis(5), Duration::from_secs(1));
                tokio::select! {
                    _ = closed(&mut closing) => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
            }
        }
    }
}

async fn serve(mut ticket: Ticket, stream: TcpStream, addr: SocketAddr, evict: Arc<Notify>) {
    let shared = ticket.shared.clone();
    let _ = stream.set_nodelay(true);
    let (mut reader, mut writer) = stream.into_split();
    let deadline = Deadline::after(shared.settings.handshake_timeout);
    let mut closing = shared.closing.subscribe();
    let handshake = tokio::select! {
        r = within(deadline, "the control-plane handshake", handshake(&shared, &mut reader, &mut writer)) => r,
        _ = evict.notified() => return,
        _ = closed(&mut closing) => return,
    };
    let peer = match handshake.and_then(|peer| ticket.promote().map(|()| peer)) {
        Ok(peer) => peer,
        Err(e) => {
            tracing::debug!(%addr, error = %e, "control plane: refused a connection");
            let f = wire::frame(Kind::Error, 0, &wire::error_payload(&e));
            let _ = tokio::time::timeout(Duration::from_secs(1), writer.write_all(&f)).await;
            return;
        }
    };
    let ready = wire::frame(Kind::Ready, 0, &wire::encode(&shared.identity()));
    if writer.write_all(&ready).await.is_err() {
        return;
    }
    shared.link_up(&peer);
    let graceful = session(&shared, &peer, reader, writer).await;
    shared.link_down(&peer, graceful || shared.closed.load(Ordering::Acquire));
}

async fn write(w: &mut (impl AsyncWriteExt + Unpin), f: &[u8]) -> Result<()> {
    w.write_all(f)
        .await
        .map_err(|e| Error::io("write frame", "the connection to the peer broke", e))
}

/// Hello → Welcome (with this side's proof) → Proof → checked. Nothing about this
/// engine is said before the peer has proved the token.
async fn handshake(
    shared: &Shared,
    reader: &mut tokio::net::tcp::OwnedReadHalf,
    writer: &mut tokio::net::tcp::OwnedWriteHalf,
) -> Result<Identity> {
    let s = &shared.settings;
    // Each frame's kind is checked before its payload is read: before the handshake a
    // peer may send only small frames, whatever limit its kind has later.
    let h = read_header(reader, 0).await?;
    if h.kind != Kind::Hello {
        return Err(Error::new(
            ErrorKind::Protocol,
            format!("a connection must start with hello, not {:?}", h.kind),
        ));
    }
    let hello: Hello = wire::decode(&read_payload(reader, &h).await?, "hello")?;
    let version = hello.versions.1.min(s.versions.1);
    if version < hello.versions.0.max(s.versions.0) {
        return Err(Error::new(
            ErrorKind::Protocol,
            format!(
                "no protocol version in common: the peer speaks {}..={}, this engine {}..={}; upgrade the older one",
                hello.versions.0, hello.versions.1, s.versions.0, s.versions.1
            ),
        ));
    }
    let nonce = auth::nonce();
    let proof = s
        .token
        .as_ref()
        .map(|t| auth::prove(t, "te-server", &nonce, &hello.nonce).to_vec());
    let welcome = Welcome {
        version,
        nonce: nonce.to_vec(),
        proof,
    };
    write(
        writer,
        &wire::frame(Kind::Welcome, 0, &wire::encode(&welcome)),
    )
    .await?;
    if let Some(token) = &s.token {
        let h = read_header(reader, 0).await?;
        if h.kind != Kind::Proof {
            return Err(Error::new(
                ErrorKind::Unauthorized,
                format!(
                    "this engine requires an auth_token; the peer sent {:?} instead of its proof",
                    h.kind
                ),
            ));
        }
        let p: Proof = wire::decode(&read_payload(reader, &h).await?, "proof")?;
        if !auth::verify(token, "te-client", &hello.nonce, &nonce, &p.proof) {
            return Err(Error::new(
                ErrorKind::Unauthorized,
                "the peer could not prove the auth_token: set the same [engine] auth_token on both engines",
            ));
        }
    }
    Ok(Identity {
        name: hello.name,
        epoch: hello.epoch,
        address: hello.address,
        heartbeat_ms: hello.heartbeat_ms,
        notification_max: None,
    })
}

/// Serves an authenticated peer until it leaves, breaks, goes silent, or this engine
/// closes. Returns whether the peer said goodbye.
async fn session(
    shared: &Arc<Shared>,
    peer: &Identity,
    mut reader: tokio::net::tcp::OwnedReadHalf,
    mut writer: tokio::net::tcp::OwnedWriteHalf,
) -> bool {
    // Replies go through a bounded queue: a peer that sends requests and never reads
    // the answers stops being read, instead of growing this engine's memory.
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(64);
    let heartbeat = Duration::from_millis(peer.heartbeat_ms.clamp(50, 600_000));
    let idle = 3 * heartbeat.max(shared.settings.heartbeat);
    let mut closing = shared.closing.subscribe();
    let writing = async {
        while let Some(f) = rx.recv().await {
            if writer.write_all(&f).await.is_err() {
                return;
            }
        }
    };
    let reader = &mut reader;
    // It owns the sending side: once it ends, the writer sees the queue close after
    // the last reply (the blocking tasks' clones end with them).
    let reading = async move {
        loop {
            let frame = tokio::select! {
                f = tokio::time::timeout(idle, read_request(reader, shared.settings.notification_max)) => f,
                _ = closed(&mut closing) => {
                    let _ = tx.send(wire::frame(Kind::Bye, 0, &[])).await;
                    return false;
                }
            };
            let (h, payload) = match frame {
                Ok(Ok(f)) => f,
                Ok(Err(e)) => {
                    if e.kind() == ErrorKind::Protocol {
                        tracing::debug!(peer = %peer.name, error = %e, "control plane: malformed frame, closing");
                        let _ = tx
                            .send(wire::frame(Kind::Error, 0, &wire::error_payload(&e)))
                            .await;
                    }
                    return false;
                }
                Err(_) => {
                    tracing::debug!(peer = %peer.name, "control plane: a session went silent, closing");
                    return false;
                }
            };
            let reply = match h.kind {
                Kind::Bye => return true,
                Kind::Ping => Some(wire::frame(Kind::Pong, h.id, &[])),
                Kind::Pong => None,
                Kind::GetSegment => Some(answer(h.id, segment(shared))),
                Kind::Notify => Some(answer(h.id, notify(shared, peer, &payload))),
                Kind::Backend => {
                    // The backend may block (building queue pairs): off this thread.
                    let (shared, peer, tx) = (shared.clone(), peer.clone(), tx.clone());
                    shared.clone().rt.spawn_blocking(move || {
                        let r = backend(&shared, &peer, &payload);
                        let _ = tx.blocking_send(answer(h.id, r));
                    });
                    None
                }
                other => {
                    let e = Error::new(
                        ErrorKind::Protocol,
                        format!("a {other:?} frame is not a request"),
                    );
                    let _ = tx
                        .send(wire::frame(Kind::Error, h.id, &wire::error_payload(&e)))
                        .await;
                    return false;
                }
            };
            if let Some(f) = reply {
                if tx.send(f).await.is_err() {
                    return false;
                }
            }
        }
    };
    tokio::pin!(reading, writing);
    tokio::select! {
        graceful = &mut reading => {
            // Let the last replies (and a goodbye) go out, within a heartbeat.
            let _ = tokio::time::timeout(heartbeat, &mut writing).await;
            graceful
        }
        () = &mut writing => false,
    }
}

/// Reads a request; a frame of another kind (an answer can be large) is refused
/// before its payload is read.
async fn read_request(
    r: &mut tokio::net::tcp::OwnedReadHalf,
    notification_max: usize,
) -> Result<(wire::Header, Vec<u8>)> {
    let h = read_header(r, notification_max).await?;
    if !matches!(
        h.kind,
        Kind::Bye | Kind::Ping | Kind::Pong | Kind::GetSegment | Kind::Notify | Kind::Backend
    ) {
        return Err(Error::new(
            ErrorKind::Protocol,
            format!("a {:?} frame is not a request", h.kind),
        ));
    }
    let payload = read_payload(r, &h).await?;
    Ok((h, payload))
}

/// A reply frame: the answer, or the error.
fn answer(id: u64, r: Result<(Kind, Vec<u8>)>) -> Vec<u8> {
    match r {
        Ok((kind, body)) => wire::frame(kind, id, &body),
        Err(e) => wire::frame(Kind::Error, id, &wire::error_payload(&e)),
    }
}

fn starting() -> Error {
    Error::new(
        ErrorKind::Unavailable,
        "the engine is starting or shutting down; try again",
    )
}

fn segment(shared: &Shared) -> Result<(Kind, Vec<u8>)> {
    let h = shared.handler().ok_or_else(starting)?;
    Ok((Kind::Segment, wire::encode(&h.segment())))
}

fn notify(shared: &Shared, peer: &Identity, payload: &[u8]) -> Result<(Kind, Vec<u8>)> {
    let n: Notice = wire::decode(payload, "notification")?;
    if n.message.len() > shared.settings.notification_max {
        return Err(Error::new(
            ErrorKind::Busy,
            format!(
                "a notification of {} bytes exceeds this engine's notification_max ({} bytes)",
                n.message.len(),
                shared.settings.notification_max
            ),
        ));
    }
    let h = shared.handler().ok_or_else(starting)?;
    h.notify(peer, n.to_epoch, n.message)?;
    Ok((Kind::Ack, Vec::new()))
}

fn backend(shared: &Shared, peer: &Identity, payload: &[u8]) -> Result<(Kind, Vec<u8>)> {
    let m: BackendMsg = wire::decode(payload, "backend message")?;
    let deadline = Deadline::after(Duration::from_millis(m.timeout_ms));
    let answer = shared.hook.handle(peer, &m.payload, deadline)?;
    Ok((Kind::BackendReply, answer))
}
