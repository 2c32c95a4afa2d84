//! A session: this engine's one persistent, authenticated connection to a peer's
//! control plane, carrying its requests pipelined.

use crate::sync::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::wire::{self, Header, Hello, Identity, Kind, Proof, Ready, Welcome, HEADER};
use super::{closed, Shared};
use crate::auth;
use crate::error::{Error, ErrorKind, Result};
use crate::time::Deadline;

/// What runs with a request's answer.
pub(crate) type Reply = Box<dyn FnOnce(Result<(Kind, Vec<u8>)>) + Send>;

struct Request {
    kind: Kind,
    body: Vec<u8>,
    deadline: Deadline,
    reply: Reply,
}

type Pending = Arc<Mutex<HashMap<u64, (Deadline, Reply)>>>;

pub(crate) struct Session {
    addr: String,
    tx: mpsc::UnboundedSender<Request>,
    alive: AtomicBool,
    /// Why the connection could not be opened, once that is known.
    failure: Mutex<Option<Error>>,
}

impl Session {
    /// The session to `addr`, opened (within `deadline`) if there is none alive.
    pub(crate) fn get(shared: &Arc<Shared>, addr: &str, deadline: Deadline) -> Arc<Session> {
        let mut sessions = shared.sessions.lock();
        if let Some(s) = sessions.get(addr) {
            if s.alive.load(Ordering::Acquire) {
                return s.clone();
            }
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let s = Arc::new(Session {
            addr: addr.to_string(),
            tx,
            alive: AtomicBool::new(true),
            failure: Mutex::new(None),
        });
        sessions.insert(addr.to_string(), s.clone());
        drop(sessions);
        let guard = shared.task();
        shared
            .rt
            .spawn(run(shared.clone(), s.clone(), rx, deadline, guard));
        s
    }

    /// Queues a request on this session, or on a fresh one to the same peer if this
    /// one ended before the request could be queued.
    pub(crate) fn request(
        self: Arc<Self>,
        shared: &Arc<Shared>,
        kind: Kind,
        body: Vec<u8>,
        deadline: Deadline,
        reply: Reply,
    ) {
        let req = Request {
            kind,
            body,
            deadline,
            reply,
        };
        if let Err(mpsc::error::SendError(req)) = self.tx.send(req) {
            match self.failure.lock().clone() {
                Some(e) => (req.reply)(Err(e)),
                None => redispatch(shared, &self.addr, req),
            }
        }
    }

    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }
}

fn session_closed(addr: &str) -> Error {
    Error::new(
        ErrorKind::PeerUnreachable,
        "the session to the peer's control plane is closed",
    )
    .with_context("peer", addr)
}

/// Reads and checks a frame's header, so its kind can be judged before any of its
/// payload is read.
pub(crate) async fn read_header<R: AsyncReadExt + Unpin>(
    r: &mut R,
    notification_max: usize,
) -> Result<Header> {
    let mut h = [0u8; HEADER];
    r.read_exact(&mut h)
        .await
        .map_err(|e| Error::io("read frame", "the connection to the peer broke", e))?;
    Header::decode(&h, notification_max)
}

/// Reads the payload announced by `header`, allocating only as its bytes arrive.
pub(crate) async fn read_payload<R: AsyncReadExt + Unpin>(
    r: &mut R,
    header: &Header,
) -> Result<Vec<u8>> {
    let mut payload = Vec::new();
    r.take(header.len as u64)
        .read_to_end(&mut payload)
        .await
        .map_err(frame_broke)?;
    if payload.len() != header.len {
        return Err(cut_mid_frame());
    }
    Ok(payload)
}

/// Reading a frame failed with `e`.
pub(crate) fn frame_broke(e: std::io::Error) -> Error {
    Error::io("read frame", "the connection to the peer broke", e)
}

/// The peer closed the connection before a frame's payload was whole.
pub(crate) fn cut_mid_frame() -> Error {
    Error::new(
        ErrorKind::PeerUnreachable,
        "the peer closed the connection in the middle of a frame",
    )
    .with_operation("read frame")
}

/// Reads a frame of an open session from the server's side: replies, pings, pongs and
/// goodbyes. A request (the server is not the one asking) is refused by its header,
/// before its payload is read, and ends the session.
async fn read_answer_frame<R: AsyncReadExt + Unpin>(
    r: &mut R,
    notification_max: usize,
) -> Result<(Header, Vec<u8>)> {
    let h = read_header(r, notification_max).await?;
    if !matches!(
        h.kind,
        Kind::Segment
            | Kind::Ack
            | Kind::BackendReply
            | Kind::Error
            | Kind::Ping
            | Kind::Pong
            | Kind::Bye
    ) {
        return Err(Error::new(
            ErrorKind::Protocol,
            format!(
                "the peer sent a {:?} frame on a session it serves; it may send only replies, pings and goodbyes",
                h.kind
            ),
        )
        .with_operation("read frame"));
    }
    let payload = read_payload(r, &h).await?;
    Ok((h, payload))
}

/// Reads the server's answer during the handshake: `expected` or an error, refused by
/// its header otherwise, before its payload is read.
async fn read_answer(
    stream: &mut TcpStream,
    expected: Kind,
    to: &str,
) -> Result<(Header, Vec<u8>)> {
    let h = read_header(stream, 0).await?;
    if h.kind != expected && h.kind != Kind::Error {
        return Err(Error::new(
            ErrorKind::Protocol,
            format!("the peer answered {to} with {:?}", h.kind),
        ));
    }
    let payload = read_payload(stream, &h).await?;
    Ok((h, payload))
}

/// Runs `f` until `deadline`.
pub(crate) async fn within<T>(
    deadline: Deadline,
    what: &str,
    f: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(deadline.remaining(), f).await {
        Ok(r) => r,
        Err(_) => Err(Error::new(
            ErrorKind::Timeout,
            format!("the deadline passed during {what}"),
        )),
    }
}

async fn write(stream: &mut (impl AsyncWriteExt + Unpin), frame: &[u8]) -> Result<()> {
    stream
        .write_all(frame)
        .await
        .map_err(|e| Error::io("write frame", "the connection to the peer broke", e))
}

/// Pongs owed to a peer before its session stops being read.
const PONGS: usize = 16;

/// Writes a frame of an open session; a write still waiting after `stall` (three
/// heartbeats) means the peer has stopped reading, and ends the session.
async fn send(
    stream: &mut (impl AsyncWriteExt + Unpin),
    frame: &[u8],
    stall: Duration,
) -> Result<()> {
    match tokio::time::timeout(stall, write(stream, frame)).await {
        Ok(r) => r,
        Err(_) => Err(Error::new(
            ErrorKind::PeerUnreachable,
            "the peer stopped reading its control-plane session (a frame waited three heartbeats to be sent); closed it",
        )
        .with_operation("write frame")),
    }
}

/// Opens and authenticates a session's connection.
async fn open(shared: &Shared, addr: &str, deadline: Deadline) -> Result<(TcpStream, Identity)> {
    let s = &shared.settings;
    let mut stream = within(deadline, "connecting to the peer's control plane", async {
        let addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host(addr)
            .await
            .map_err(|e| {
                Error::new(
                    ErrorKind::PeerUnreachable,
                    "cannot resolve the address (expected HOST:PORT)",
                )
                .with_source(e)
            })?
            .collect();
        let mut last = None;
        for a in addrs {
            match TcpStream::connect(a).await {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        Err(match last {
            Some(e) => Error::io(
                "connect",
                "cannot reach the peer's control plane; is it running?",
                e,
            ),
            None => Error::new(
                ErrorKind::PeerUnreachable,
                "the address resolves to nothing",
            ),
        })
    })
    .await?;
    let _ = stream.set_nodelay(true);
    let me = shared.identity();
    let nonce = auth::nonce();
    let hello = Hello {
        versions: s.versions,
        nonce: nonce.to_vec(),
        name: me.name,
        epoch: me.epoch,
        address: me.address,
        heartbeat_ms: me.heartbeat_ms,
    };
    let peer = within(deadline, "the control-plane handshake", async {
        write(&mut stream, &wire::frame(Kind::Hello, 0, &wire::encode(&hello))).await?;
        let welcome: Welcome = match read_answer(&mut stream, Kind::Welcome, "hello").await? {
            (h, p) if h.kind == Kind::Welcome => wire::decode(&p, "welcome")?,
            (h, p) if h.kind == Kind::Error => {
                return Err(wire::decode::<wire::WireError>(&p, "error")?.into_error())
            }
            (h, _) => {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    format!("the peer answered hello with {:?}", h.kind),
                ))
            }
        };
        if welcome.version < s.versions.0 || welcome.version > s.versions.1 {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!(
                    "the peer chose protocol version {}, outside the {}..={} this engine speaks; upgrade the older engine",
                    welcome.version, s.versions.0, s.versions.1
                ),
            ));
        }
        // The client proves the token first; the server proves it back in `Ready`.
        let asks = welcome.auth || welcome.proof.is_some();
        match (&s.token, asks) {
            (Some(token), true) => {
                if welcome.version < wire::CLIENT_PROVES_FIRST {
                    return Err(Error::new(
                        ErrorKind::Protocol,
                        format!(
                            "the peer speaks control protocol version {}, in which the server proves the auth_token first; with a token this engine needs version {} or newer: run the same te version on both",
                            welcome.version,
                            wire::CLIENT_PROVES_FIRST
                        ),
                    ));
                }
                let mine = auth::prove(token, "te-client", &nonce, &welcome.nonce);
                let proof = Proof {
                    proof: mine.to_vec(),
                };
                write(&mut stream, &wire::frame(Kind::Proof, 0, &wire::encode(&proof))).await?;
            }
            (Some(_), false) => {
                return Err(Error::new(
                    ErrorKind::Unauthorized,
                    "the peer has no auth_token and this engine requires one: set the same token on both",
                ))
            }
            (None, true) => {
                return Err(Error::new(
                    ErrorKind::Unauthorized,
                    "the peer requires an auth_token: set the same [engine] auth_token on this engine",
                ))
            }
            (None, false) => {}
        }
        let ready: Ready = match read_answer(&mut stream, Kind::Ready, "the handshake").await? {
            (h, p) if h.kind == Kind::Ready => wire::decode(&p, "ready")?,
            (h, p) if h.kind == Kind::Error => {
                return Err(wire::decode::<wire::WireError>(&p, "error")?.into_error())
            }
            (h, _) => {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    format!("the peer answered the handshake with {:?}", h.kind),
                ))
            }
        };
        if let Some(token) = &s.token {
            let proved = ready.proof.as_ref().is_some_and(|p| {
                auth::verify(token, "te-server", &welcome.nonce, &nonce, p)
            });
            if !proved {
                return Err(Error::new(
                    ErrorKind::Unauthorized,
                    "the peer could not prove this engine's auth_token: set the same token on both",
                ));
            }
        }
        Ok(ready.identity)
    })
    .await
    .inspect_err(|e| tracing::debug!(%addr, error = %e, "control plane: handshake refused"))?;
    tracing::debug!(%addr, peer = %peer.name, epoch = peer.epoch, "control plane: session opened");
    Ok((stream, peer))
}

async fn run(
    shared: Arc<Shared>,
    session: Arc<Session>,
    mut rx: mpsc::UnboundedReceiver<Request>,
    deadline: Deadline,
    _guard: super::TaskGuard,
) {
    let addr = session.addr.clone();
    let mut closing = shared.closing.subscribe();
    // The opening is the session's, not its first caller's: bounded by the handshake
    // limit (or the first caller's time, if longer), while each request that waits for
    // it ends at its own deadline.
    let bound = Deadline::after(shared.settings.handshake_timeout.max(deadline.remaining()));
    let opening = open(&shared, &addr, bound);
    tokio::pin!(opening);
    let mut early: Vec<Request> = Vec::new();
    let opened = loop {
        let first_due = early.iter().map(|r| r.deadline.instant()).min();
        let due = async move {
            match first_due {
                Some(t) => tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = &mut opening => break r,
            _ = closed(&mut closing) => break Err(shared.shut_down_error()),
            Some(req) = rx.recv() => early.push(req),
            _ = due => {
                let (late, waiting): (Vec<_>, Vec<_>) =
                    early.into_iter().partition(|r| r.deadline.is_past());
                early = waiting;
                for req in late {
                    (req.reply)(Err(Error::new(
                        ErrorKind::Timeout,
                        "the deadline passed while the session to the peer's control plane was opening",
                    )
                    .with_operation("connect")
                    .with_context("peer", &addr)));
                }
            }
        }
    };
    let (stream, peer) = match opened {
        Ok(v) => v,
        Err(e) => {
            let e = e.with_operation("connect").with_context("peer", &addr);
            *session.failure.lock() = Some(e.clone());
            end(&shared, &session);
            rx.close();
            for req in early {
                (req.reply)(Err(e.clone()));
            }
            while let Ok(req) = rx.try_recv() {
                (req.reply)(Err(e.clone()));
            }
            return;
        }
    };
    shared.link_up(&peer);
    let pending: Pending = Arc::new(Mutex::new(HashMap::new()));
    let (mut reader, mut writer) = stream.into_split();
    let heartbeat = shared
        .settings
        .heartbeat
        .min(Duration::from_millis(peer.heartbeat_ms.max(50)));
    let idle = 3 * shared.settings.heartbeat;
    // A peer that pings faster than its pongs can be sent (it does not read them)
    // stops being read once a few are owed, and is closed at the next stalled write.
    let (pong_tx, mut pong_rx) = mpsc::channel::<u64>(PONGS);
    let nmax = shared.settings.notification_max;
    let p2 = pending.clone();
    // Replies, pings and goodbyes from the peer.
    let mut reading = tokio::spawn(async move {
        loop {
            let (h, payload) =
                match tokio::time::timeout(idle, read_answer_frame(&mut reader, nmax)).await {
                    Ok(Ok(f)) => f,
                    Ok(Err(e)) => return Err(e),
                    Err(_) => {
                        return Err(Error::new(
                            ErrorKind::PeerUnreachable,
                            "the peer's control plane went silent (no heartbeat)",
                        ))
                    }
                };
            match h.kind {
                Kind::Pong => {}
                Kind::Ping => {
                    let _ = pong_tx.send(h.id).await;
                }
                Kind::Bye => return Ok(()),
                _ => {
                    let waiting = p2.lock().remove(&h.id);
                    if let Some((_, reply)) = waiting {
                        let r = if h.kind == Kind::Error {
                            wire::decode::<wire::WireError>(&payload, "error")
                                .and_then(|w| Err(w.into_error()))
                        } else {
                            Ok((h.kind, payload))
                        };
                        reply(r);
                    }
                }
            }
        }
    });
    let mut tick = tokio::time::interval(heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut next_id = 1u64;
    let mut early = early.into_iter();
    let outcome: std::result::Result<bool, Error> = loop {
        // What came while the session opened goes first, in order.
        if let Some(req) = early.next() {
            if let Err(e) = post(req, &peer, &mut next_id, &pending, &mut writer, idle).await {
                break Err(e);
            }
            continue;
        }
        tokio::select! {
            r = &mut reading => break match r {
                Ok(Ok(())) => Ok(true),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(session_closed(&addr)),
            },
            req = rx.recv() => {
                let Some(req) = req else { break Ok(false) };
                if let Err(e) = post(req, &peer, &mut next_id, &pending, &mut writer, idle).await {
                    break Err(e);
                }
            }
            id = pong_rx.recv() => {
                if let Some(id) = id {
                    if let Err(e) = send(&mut writer, &wire::frame(Kind::Pong, id, &[]), idle).await {
                        break Err(e);
                    }
                }
            }
            _ = tick.tick() => {
                expire(&pending);
                if let Err(e) = send(&mut writer, &wire::frame(Kind::Ping, 0, &[]), idle).await {
                    break Err(e);
                }
            }
            _ = closed(&mut closing) => {
                let _ = tokio::time::timeout(heartbeat, write(&mut writer, &wire::frame(Kind::Bye, 0, &[]))).await;
                break Ok(false);
            }
        }
    };
    reading.abort();
    if outcome.is_err() {
        // A peer that failed (stopped reading, went silent, broke the protocol) is
        // reset, not closed: a close is queued behind the frames it has not read, so
        // a peer that does not read would never see it, and the kernel would keep
        // trying to send them.
        let _ = writer.as_ref().set_zero_linger();
    }
    drop(writer);
    end(&shared, &session);
    rx.close();
    let e = match &outcome {
        Err(e) => e.clone().with_context("peer", &addr),
        Ok(_) => session_closed(&addr),
    };
    // Requests never written to this connection go to a fresh session: the peer
    // may have said goodbye because it restarted, and its new life is listening. So do
    // those that came while it opened and were not sent yet, first.
    for req in early {
        redispatch(&shared, &addr, req);
    }
    while let Ok(req) = rx.try_recv() {
        redispatch(&shared, &addr, req);
    }
    let waiting: Vec<_> = pending.lock().drain().collect();
    for (_, (_, reply)) in waiting {
        reply(Err(e.clone()));
    }
    // A goodbye from the peer, or our own shutdown, is not a loss.
    let graceful = matches!(outcome, Ok(true)) || shared.closed.load(Ordering::Acquire);
    shared.link_down(&peer, graceful);
}

/// Sends `req` on the session (answered through `pending`), unless its deadline has
/// passed or it is larger than the peer accepts; an error is the connection's.
async fn post(
    req: Request,
    peer: &Identity,
    next_id: &mut u64,
    pending: &Pending,
    writer: &mut tokio::net::tcp::OwnedWriteHalf,
    idle: Duration,
) -> Result<()> {
    if req.deadline.is_past() {
        (req.reply)(Err(Error::new(
            ErrorKind::Timeout,
            "the deadline passed before the request was sent",
        )));
        return Ok(());
    }
    if let Err(e) = fits(peer, req.kind, req.body.len()) {
        (req.reply)(Err(e));
        return Ok(());
    }
    let id = *next_id;
    *next_id += 1;
    pending.lock().insert(id, (req.deadline, req.reply));
    send(writer, &wire::frame(req.kind, id, &req.body), idle).await
}

/// What a notice's encoding adds to its message, at most.
const NOTICE_OVERHEAD: usize = 64;

/// Refuses, before it is sent, a request larger than the peer said it accepts: the
/// peer would refuse its frame and close the session, failing every other request on
/// it.
pub(super) fn fits(peer: &Identity, kind: Kind, len: usize) -> Result<()> {
    let Some(max) = peer.notification_max else {
        return Ok(());
    };
    let max = usize::try_from(max).unwrap_or(usize::MAX);
    // A notice's encoding adds at most a few dozen bytes to its message; the peer
    // answers `Busy` itself for one within that margin.
    if kind == Kind::Notify && len > max.saturating_add(NOTICE_OVERHEAD) {
        return Err(Error::new(
            ErrorKind::Busy,
            format!(
                "a notification of about {len} bytes exceeds the peer's notification_max ({max} bytes); send bulk data as a transfer"
            ),
        )
        .with_context("peer", &peer.address));
    }
    if len > kind.limit(max) {
        return Err(Error::new(
            ErrorKind::InvalidRequest,
            format!(
                "a {kind:?} request of {len} bytes exceeds the peer's {}-byte limit",
                kind.limit(max)
            ),
        )
        .with_context("peer", &peer.address));
    }
    Ok(())
}

/// Sends a request that its session could not carry on a fresh session to `addr`,
/// unless the engine is closing or the request's deadline has passed.
fn redispatch(shared: &Arc<Shared>, addr: &str, req: Request) {
    if shared.closed.load(Ordering::Acquire) {
        return (req.reply)(Err(shared.shut_down_error()));
    }
    if req.deadline.is_past() {
        return (req.reply)(Err(session_closed(addr)));
    }
    let s = Session::get(shared, addr, req.deadline);
    if let Err(mpsc::error::SendError(req)) = s.tx.send(req) {
        let e = s.failure.lock().clone();
        (req.reply)(Err(e.unwrap_or_else(|| session_closed(addr))));
    }
}

/// Fails requests whose deadline passed while they waited for an answer.
fn expire(pending: &Pending) {
    let expired: Vec<Reply> = {
        let mut p = pending.lock();
        let ids: Vec<u64> = p
            .iter()
            .filter(|(_, (d, _))| d.is_past())
            .map(|(id, _)| *id)
            .collect();
        ids.into_iter()
            .filter_map(|id| p.remove(&id).map(|(_, r)| r))
            .collect()
    };
    for reply in expired {
        reply(Err(Error::new(
            ErrorKind::Timeout,
            "the peer did not answer before the deadline",
        )));
    }
}

/// Marks the session dead and forgets it (if it is still the one on record).
fn end(shared: &Shared, session: &Arc<Session>) {
    session.alive.store(false, Ordering::Release);
    let mut sessions = shared.sessions.lock();
    if sessions
        .get(&session.addr)
        .is_some_and(|s| Arc::ptr_eq(s, session))
    {
        sessions.remove(&session.addr);
    }
}
