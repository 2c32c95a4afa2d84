//! The control plane's listener: admission under caps, the handshake, and serving an
//! authenticated peer's requests.

use crate::sync::Mutex;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering::{self, Relaxed};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use super::session::{self, read_header, read_payload, within};
use super::wire::{self, BackendMsg, Hello, Identity, Kind, Notice, Proof, Ready, Welcome};
use super::{closed, Shared};
use crate::auth;
use crate::error::{Error, ErrorKind, Result};
use crate::kit::net::{PendingSlot, PendingSlots};
use crate::time::Deadline;

/// Authenticated sessions, in all and per source, and what each source's sessions
/// share.
#[derive(Default)]
struct Sessions {
    per_source: HashMap<IpAddr, (usize, Source)>,
    total: usize,
}

/// What one source address's sessions share: its turns at the backend workers, and its
/// budget of backend request bytes read and not yet answered.
#[derive(Clone)]
struct Source {
    ip: IpAddr,
    workers: Arc<Semaphore>,
    bytes: Arc<Semaphore>,
}

/// One connection's place in the admission book: a pending slot until its handshake
/// ends, then a session.
struct Ticket {
    shared: Arc<Shared>,
    sessions: Arc<Mutex<Sessions>>,
    /// `None` once the connection is a session.
    pending: Option<PendingSlot>,
    ip: IpAddr,
    pool: Arc<Pool>,
}

/// What every source's sessions share: the engine's backend workers, and its budget
/// of backend request bytes read and not yet answered.
struct Pool {
    workers: Arc<Semaphore>,
    bytes: Arc<Semaphore>,
}

impl Ticket {
    /// Turns an authenticated connection into a session, within the session caps;
    /// returns what it shares with its source's other sessions.
    fn promote(&mut self) -> Result<Source> {
        let s = &self.shared.settings;
        let mut a = self.sessions.lock();
        let from_source = a.per_source.get(&self.ip).map_or(0, |(n, _)| *n);
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
        let (n, share) = a.per_source.entry(self.ip).or_insert_with(|| {
            let source = Source {
                ip: self.ip,
                workers: Arc::new(Semaphore::new(SOURCE_SHARE)),
                bytes: Arc::new(Semaphore::new(SOURCE_REQUEST_BYTES)),
            };
            (0, source)
        });
        *n += 1;
        let share = share.clone();
        self.pending = None;
        Ok(share)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.pending.is_some() {
            return; // Never a session; its slot gives itself back.
        }
        let mut a = self.sessions.lock();
        a.total -= 1;
        if let Some((n, _)) = a.per_source.get_mut(&self.ip) {
            *n -= 1;
        }
        // A source is forgotten once it has no session and none of its backend requests
        // is still waiting or running (each holds a clone of it), so closing its sessions
        // and opening new ones gives it no fresh budget or worker turns.
        a.per_source
            .retain(|_, (n, source)| *n > 0 || Arc::strong_count(&source.bytes) > 1);
    }
}

/// Accepts connections until the engine closes. Running out of descriptors (or
/// memory) evicts the oldest unauthenticated connection and backs off, doubling from
/// 5 ms to 1 s; it never spins and never stops accepting. A burst of such errors is
/// logged once when it starts and once when it ends.
pub(super) async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    let pending = Arc::new(PendingSlots::default());
    let sessions = Arc::new(Mutex::new(Sessions::default()));
    let pool = Arc::new(Pool {
        workers: Arc::new(Semaphore::new(BACKEND_WORKERS)),
        bytes: Arc::new(Semaphore::new(ENGINE_REQUEST_BYTES)),
    });
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
                let slot = pending.admit(peer.ip(), s.max_pending_per_source, s.max_pending);
                let ticket = Ticket {
                    shared: shared.clone(),
                    sessions: sessions.clone(),
                    pending: Some(slot),
                    ip: crate::kit::net::source_of(peer.ip()),
                    pool: pool.clone(),
                };
                let guard = shared.task();
                shared.rt.spawn(async move {
                    let _guard = guard;
                    serve(ticket, stream, peer).await;
                });
            }
            Err(e) => {
                let scarce = crate::kit::net::out_of_resources(&e);
                if failures == 0 {
                    tracing::warn!(error = %e, "control plane: accept failed; backing off");
                }
                failures += 1;
                if scarce {
                    pending.evict_oldest();
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

async fn serve(mut ticket: Ticket, stream: TcpStream, addr: SocketAddr) {
    let shared = ticket.shared.clone();
    let _ = stream.set_nodelay(true);
    let (mut reader, mut writer) = stream.into_split();
    let deadline = Deadline::after(shared.settings.handshake_timeout);
    let mut closing = shared.closing.subscribe();
    let Some(slot) = &ticket.pending else { return };
    let handshake = tokio::select! {
        r = within(deadline, "the control-plane handshake", handshake(&shared, &mut reader, &mut writer)) => r,
        _ = slot.evicted() => {
            shared.counters.refused(None);
            return;
        }
        _ = closed(&mut closing) => return,
    };
    let admitted = handshake.and_then(|(peer, proof)| ticket.promote().map(|s| (peer, proof, s)));
    let (peer, proof, source) = match admitted {
        Ok(admitted) => {
            let peer = &admitted.0;
            tracing::debug!(%addr, peer = %peer.name, epoch = peer.epoch, "control plane: handshake accepted");
            admitted
        }
        Err(e) => {
            tracing::debug!(%addr, error = %e, "control plane: refused a connection");
            shared.counters.refused(Some(&e));
            let f = wire::frame(Kind::Error, 0, &wire::error_payload(&e));
            let _ = tokio::time::timeout(Duration::from_secs(1), writer.write_all(&f)).await;
            return;
        }
    };
    let ready = Ready {
        identity: shared.identity(),
        proof,
    };
    let ready = wire::frame(Kind::Ready, 0, &wire::encode(&ready));
    if writer.write_all(&ready).await.is_err() {
        return;
    }
    shared.link_up(&peer);
    let turns = Turns {
        source,
        pool: ticket.pool.clone(),
    };
    let graceful = session(&shared, &peer, turns, reader, writer).await;
    shared.link_down(&peer, graceful || shared.closed.load(Ordering::Acquire));
}

async fn write(w: &mut (impl AsyncWriteExt + Unpin), f: &[u8]) -> Result<()> {
    w.write_all(f)
        .await
        .map_err(|e| Error::io("write frame", "the connection to the peer broke", e))
}

/// Hello → Welcome → (with a token) Proof → checked; returns the peer and, with a
/// token, this side's proof for `Ready`. Nothing about this engine, and nothing made
/// with the token, is said before the peer has proved the token: a proof sent to
/// anyone who says hello would let them check guessed tokens offline.
async fn handshake(
    shared: &Shared,
    reader: &mut tokio::net::tcp::OwnedReadHalf,
    writer: &mut tokio::net::tcp::OwnedWriteHalf,
) -> Result<(Identity, Option<Vec<u8>>)> {
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
    if s.token.is_some() && version < wire::CLIENT_PROVES_FIRST {
        return Err(Error::new(
            ErrorKind::Protocol,
            format!(
                "this engine has an auth_token and needs control protocol version {} or newer \
                 (the client proves the token first); the peer speaks {}..={}: run the same te \
                 version on both",
                wire::CLIENT_PROVES_FIRST,
                hello.versions.0,
                hello.versions.1
            ),
        ));
    }
    let nonce = auth::nonce();
    let welcome = Welcome {
        version,
        nonce: nonce.to_vec(),
        auth: s.token.is_some(),
        proof: None,
    };
    write(
        writer,
        &wire::frame(Kind::Welcome, 0, &wire::encode(&welcome)),
    )
    .await?;
    let mut proof = None;
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
        proof = Some(auth::prove(token, "te-server", &nonce, &hello.nonce).to_vec());
    }
    let peer = Identity {
        name: hello.name,
        epoch: hello.epoch,
        address: hello.address,
        heartbeat_ms: hello.heartbeat_ms,
        notification_max: None,
    };
    Ok((peer, proof))
}

/// Replies queued for a session's writer, at most.
const REPLIES: usize = 64;
/// Bytes of replies queued for a session's writer, at most (one larger reply goes
/// alone).
const REPLY_BYTES: usize = 1 << 20;
/// A session's backend requests queued or running at once, at most.
const BACKEND_SHARE: usize = 4;
/// The threads that run backend requests for every session of an engine.
pub(super) const BACKEND_WORKERS: usize = 8;
/// The backend workers one source address (all its sessions) may hold at once: half,
/// so that one peer's slow requests leave the other half to everyone else.
const SOURCE_SHARE: usize = BACKEND_WORKERS / 2;
/// Bytes of backend requests one source address (all its sessions) may have read and
/// not yet answered: as many requests of the largest size a frame allows as the source
/// may run at once. A backend's own messages (queue-pair exchanges, shim handshakes)
/// are a few KiB, so hundreds of them fit; without the bound, a host's 1,024 sessions
/// could each keep five 1 MiB requests waiting.
const SOURCE_REQUEST_BYTES: usize = SOURCE_SHARE * Kind::Backend.limit(0);
/// Bytes of backend requests all sources together may have read and not yet answered:
/// 16 sources' worth. Without it, each of 4,096 sessions from as many addresses could
/// keep its source's 4 MiB waiting.
const ENGINE_REQUEST_BYTES: usize = 16 * SOURCE_REQUEST_BYTES;

/// What a backend request waits for before it runs: a turn of its source's share, then
/// a worker. Both are first come, first served, so a request of a source that holds no
/// worker waits for the next one free, not behind another source's queue.
#[derive(Clone)]
struct Turns {
    source: Source,
    pool: Arc<Pool>,
}

/// A backend request's bytes, held of its source's budget and the engine's, and counted
/// in the engine's `control_request_bytes` until the request is answered.
struct Charge {
    _held: (OwnedSemaphorePermit, OwnedSemaphorePermit),
    bytes: u64,
    shared: Arc<Shared>,
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.shared
            .counters
            .request_bytes
            .fetch_sub(self.bytes, Relaxed);
    }
}

/// Takes `len` bytes of `source`'s budget, and of the engine's, for a backend request,
/// or says why not.
fn charge(shared: &Arc<Shared>, turns: &Turns, len: usize) -> Result<Charge> {
    let source = &turns.source;
    let Ok(held) = source.bytes.clone().try_acquire_many_owned(len as u32) else {
        let waiting = SOURCE_REQUEST_BYTES - source.bytes.available_permits();
        return Err(Error::new(
            ErrorKind::Busy,
            format!(
                "this engine holds {waiting} bytes of backend requests from {} not yet answered, \
                 and a request of {len} bytes would pass the {} MiB one source address may have \
                 waiting; wait for answers before sending more",
                source.ip,
                SOURCE_REQUEST_BYTES >> 20
            ),
        ));
    };
    let all = &turns.pool.bytes;
    let Ok(all_held) = all.clone().try_acquire_many_owned(len as u32) else {
        let waiting = ENGINE_REQUEST_BYTES - all.available_permits();
        return Err(Error::new(
            ErrorKind::Busy,
            format!(
                "this engine holds {waiting} bytes of backend requests from all peers not yet \
                 answered, and a request of {len} bytes would pass its limit of {} MiB; try \
                 again later",
                ENGINE_REQUEST_BYTES >> 20
            ),
        ));
    };
    shared.counters.request_bytes.fetch_add(len as u64, Relaxed);
    Ok(Charge {
        _held: (held, all_held),
        bytes: len as u64,
        shared: shared.clone(),
    })
}

/// A reply, with what it holds of the session's budget until it is written.
type Queued = (Vec<u8>, Option<OwnedSemaphorePermit>);

/// Queues `frame` once the session's reply budget has room for it; false if the
/// writer has ended.
async fn queue(tx: &mpsc::Sender<Queued>, budget: &Arc<Semaphore>, frame: Vec<u8>) -> bool {
    let cost = frame.len().clamp(1, REPLY_BYTES) as u32;
    let Ok(held) = budget.clone().acquire_many_owned(cost).await else {
        return false;
    };
    tx.send((frame, Some(held))).await.is_ok()
}

/// Serves an authenticated peer until it leaves, breaks, goes silent, or this engine
/// closes. Returns whether the peer said goodbye.
///
/// Nothing a peer sends grows without bound: replies wait in a queue bounded in count
/// and bytes, backend requests take one of the session's [`BACKEND_SHARE`] turns, and
/// when either is full the session is not read (TCP throttles the peer). A backend
/// request's bytes are taken from its source's [`SOURCE_REQUEST_BYTES`] before its
/// payload is read, and a request that does not fit is read past and refused. It then
/// runs as its source's [`SOURCE_SHARE`] of the workers allows (see [`backend`]). A
/// peer that does not read its replies for three heartbeats, or sends nothing for
/// three, is reset.
async fn session(
    shared: &Arc<Shared>,
    peer: &Identity,
    turns: Turns,
    mut reader: tokio::net::tcp::OwnedReadHalf,
    mut writer: tokio::net::tcp::OwnedWriteHalf,
) -> bool {
    let (tx, mut rx) = mpsc::channel::<Queued>(REPLIES);
    let budget = Arc::new(Semaphore::new(REPLY_BYTES));
    let share = Arc::new(Semaphore::new(BACKEND_SHARE));
    // A peer pings at the faster of its heartbeat and ours (ours is in `Ready`), so
    // three of ours without a frame is silence, whatever heartbeat the peer claims: a
    // claimed 600 s would hold a silent session, and its per-source slot, for 30 min.
    let idle = 3 * shared.settings.heartbeat;
    let stall = 3 * shared.settings.heartbeat;
    let mut closing = shared.closing.subscribe();
    let writing = async {
        while let Some((f, _held)) = rx.recv().await {
            match tokio::time::timeout(stall, writer.write_all(&f)).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return,
                Err(_) => {
                    tracing::debug!(peer = %peer.name, "control plane: the peer stopped reading its replies, closing");
                    // Reset, not closed: a close would wait behind the unread replies.
                    let _ = writer.as_ref().set_zero_linger();
                    return;
                }
            }
        }
    };
    let reader = &mut reader;
    // It owns the sending side: once it ends, the writer sees the queue close after
    // the last reply (the backend requests' reserved places end with them).
    let reading = async move {
        loop {
            let frame = tokio::select! {
                f = tokio::time::timeout(idle, read_request(reader, shared, &turns)) => f,
                _ = closed(&mut closing) => {
                    let _ = tx.send((wire::frame(Kind::Bye, 0, &[]), None)).await;
                    return false;
                }
            };
            let (h, payload, charged) = match frame {
                Ok(Ok(Request::Read(h, payload, charged))) => (h, payload, charged),
                Ok(Ok(Request::Refused(h, e))) => {
                    if !queue(&tx, &budget, answer(h.id, Err(e))).await {
                        return false;
                    }
                    continue;
                }
                Ok(Err(e)) => {
                    if e.kind() == ErrorKind::Protocol {
                        tracing::debug!(peer = %peer.name, error = %e, "control plane: malformed frame, closing");
                        let f = wire::frame(Kind::Error, 0, &wire::error_payload(&e));
                        let _ = tx.send((f, None)).await;
                    }
                    return false;
                }
                Err(_) => {
                    tracing::debug!(peer = %peer.name, "control plane: a session went silent, closing");
                    // Reset, not closed: a close could wait behind replies it never takes.
                    let _ = reader.as_ref().set_zero_linger();
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
                    // The backend may block (building queue pairs): on a worker, once
                    // this session has a turn and a place for the reply.
                    let Ok(turn) = share.clone().acquire_owned().await else {
                        return false;
                    };
                    let Ok(place) = tx.clone().reserve_owned().await else {
                        return false;
                    };
                    let (shared, peer) = (shared.clone(), peer.clone());
                    let turns = turns.clone();
                    shared.clone().rt.spawn(async move {
                        let r = backend(shared, peer, payload, charged, turns).await;
                        // The turn is given back once the reply is written.
                        place.send((answer(h.id, r), Some(turn)));
                    });
                    None
                }
                other => {
                    let e = Error::new(
                        ErrorKind::Protocol,
                        format!("a {other:?} frame is not a request"),
                    );
                    let f = wire::frame(Kind::Error, h.id, &wire::error_payload(&e));
                    let _ = tx.send((f, None)).await;
                    return false;
                }
            };
            if let Some(f) = reply {
                if !queue(&tx, &budget, f).await {
                    return false;
                }
            }
        }
    };
    tokio::pin!(reading, writing);
    tokio::select! {
        graceful = &mut reading => {
            // Let the last replies (and a goodbye) go out, within a heartbeat.
            let _ = tokio::time::timeout(shared.settings.heartbeat, &mut writing).await;
            graceful
        }
        () = &mut writing => false,
    }
}

/// A request as read from a session.
enum Request {
    /// Its header and payload, and for a backend request what it holds of its source's
    /// budget and the engine's.
    Read(wire::Header, Vec<u8>, Option<Charge>),
    /// A backend request its source's budget, or the engine's, had no room for: its
    /// payload was read past and not kept.
    Refused(wire::Header, Error),
}

/// Reads a request; a frame of another kind (an answer can be large) is refused
/// before its payload is read, and a backend request's bytes are taken from its
/// source's budget before its payload is read.
async fn read_request(
    r: &mut tokio::net::tcp::OwnedReadHalf,
    shared: &Arc<Shared>,
    turns: &Turns,
) -> Result<Request> {
    let h = read_header(r, shared.settings.notification_max).await?;
    if !matches!(
        h.kind,
        Kind::Bye | Kind::Ping | Kind::Pong | Kind::GetSegment | Kind::Notify | Kind::Backend
    ) {
        return Err(Error::new(
            ErrorKind::Protocol,
            format!("a {:?} frame is not a request", h.kind),
        ));
    }
    if h.kind != Kind::Backend {
        let payload = read_payload(r, &h).await?;
        return Ok(Request::Read(h, payload, None));
    }
    match charge(shared, turns, h.len) {
        Ok(charged) => {
            // The budget holds these bytes, so they are taken at once.
            let mut payload = vec![0; h.len];
            r.read_exact(&mut payload)
                .await
                .map_err(|e| match e.kind() {
                    std::io::ErrorKind::UnexpectedEof => session::cut_mid_frame(),
                    _ => session::frame_broke(e),
                })?;
            Ok(Request::Read(h, payload, Some(charged)))
        }
        Err(e) => {
            let skipped = tokio::io::copy(&mut r.take(h.len as u64), &mut tokio::io::sink())
                .await
                .map_err(session::frame_broke)?;
            if skipped != h.len as u64 {
                return Err(session::cut_mid_frame());
            }
            Ok(Request::Refused(h, e))
        }
    }
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

/// Runs a backend request on a worker, once its source has a turn and a worker is
/// free. It is served until the sender's deadline, but never longer than this engine's
/// `handshake_timeout` from its arrival: a peer claiming an hour would otherwise hold a
/// worker for that hour if the handler waits on something that does not come.
async fn backend(
    shared: Arc<Shared>,
    peer: Identity,
    payload: Vec<u8>,
    charged: Option<Charge>,
    turns: Turns,
) -> Result<(Kind, Vec<u8>)> {
    let m: BackendMsg = wire::decode(&payload, "backend message")?;
    drop(payload);
    let limit = shared.settings.handshake_timeout;
    let deadline = Deadline::after(Duration::from_millis(m.timeout_ms).min(limit));
    let wait = async {
        let source = turns.source.workers.acquire_owned().await;
        let worker = turns.pool.workers.clone().acquire_owned().await;
        Ok((source, worker))
    };
    let what = "the wait for a backend worker (this peer's share of them, or all of them, stayed busy; try again)";
    let (Ok(source), Ok(worker)) = within(deadline, what, wait).await? else {
        return Err(starting());
    };
    let handled = shared.rt.clone().spawn_blocking(move || {
        let _held = (source, worker, charged);
        shared.hook.handle(&peer, &m.payload, deadline)
    });
    match handled.await {
        Ok(answer) => Ok((Kind::BackendReply, answer?)),
        Err(e) if !e.is_panic() => Err(starting()),
        Err(_) => Err(Error::new(
            ErrorKind::Backend,
            "this engine's backend failed (its message handler panicked) while answering",
        )),
    }
}
