//! The control plane: versioned, length-prefixed frames over TCP.
//!
//! A frame is an 8-byte header — `b"TE"`, version `1`, a message kind, the payload
//! length as a little-endian `u32` — then the payload. Payloads larger than
//! [`MAX_FRAME`] are refused before any of it is read. Every engine serves its segment
//! descriptor and receives notifications here; one thread per connection, bounded in
//! number, each with an idle timeout, so a stuck or hostile client costs one thread
//! for a while and nothing else.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::codec;
use crate::desc::SegmentDesc;
use crate::error::{Error, ErrorKind, Result};

/// The frame magic.
pub(crate) const MAGIC: [u8; 2] = *b"TE";
/// The frame format version this build speaks.
pub const VERSION: u8 = 1;
/// The largest payload accepted.
pub const MAX_FRAME: usize = 64 << 20;
/// Connections served at once; more are closed on accept.
pub(crate) const MAX_CONNECTIONS: usize = 1024;
/// A connection that sends nothing for this long is closed.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

const HEADER: usize = 8;

/// A notification as it travels.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Notice {
    /// The epoch the sender believes the receiver has; a mismatch is refused.
    pub to_epoch: u64,
    pub from_engine: String,
    pub from_epoch: u64,
    pub message: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct WireError {
    code: u32,
    message: String,
}

/// A control-plane message.
#[derive(Debug, Clone)]
pub(crate) enum Msg {
    GetSegment,
    Segment(SegmentDesc),
    Notify(Notice),
    Ack,
    Error(Error),
}

impl Msg {
    fn kind(&self) -> u8 {
        match self {
            Msg::GetSegment => 1,
            Msg::Segment(_) => 2,
            Msg::Notify(_) => 3,
            Msg::Ack => 4,
            Msg::Error(_) => 5,
        }
    }

    /// The whole frame, header included.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let payload = match self {
            Msg::GetSegment | Msg::Ack => Vec::new(),
            Msg::Segment(s) => s.encode(),
            Msg::Notify(n) => codec::encode(n),
            Msg::Error(e) => codec::encode(&WireError {
                code: e.kind().code(),
                message: e.to_string(),
            }),
        };
        let mut frame = Vec::with_capacity(HEADER + payload.len());
        frame.extend_from_slice(&MAGIC);
        frame.push(VERSION);
        frame.push(self.kind());
        frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        frame.extend_from_slice(&payload);
        frame
    }

    /// Checks a header and returns the kind and payload length.
    pub(crate) fn parse_header(h: &[u8; HEADER]) -> Result<(u8, usize)> {
        let bad = |m: String| Err(Error::new(ErrorKind::Protocol, m).with_operation("read frame"));
        if h[..2] != MAGIC {
            return bad(format!(
                "bad magic {:02x}{:02x}: not a te control-plane peer",
                h[0], h[1]
            ));
        }
        if h[2] != VERSION {
            return bad(format!(
                "frame version {} is not {VERSION}: the peer runs an incompatible te",
                h[2]
            ));
        }
        let len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
        if len > MAX_FRAME {
            return bad(format!(
                "frame of {len} bytes exceeds the {MAX_FRAME}-byte limit"
            ));
        }
        Ok((h[3], len))
    }

    /// Decodes a payload of the given kind.
    pub(crate) fn decode(kind: u8, payload: &[u8]) -> Result<Msg> {
        let empty = |m: Msg| {
            if payload.is_empty() {
                Ok(m)
            } else {
                Err(Error::new(
                    ErrorKind::Protocol,
                    "unexpected payload on an empty message",
                ))
            }
        };
        match kind {
            1 => empty(Msg::GetSegment),
            2 => Ok(Msg::Segment(SegmentDesc::decode(payload)?)),
            3 => Ok(Msg::Notify(codec::decode(payload, "notification")?)),
            4 => empty(Msg::Ack),
            5 => {
                let w: WireError = codec::decode(payload, "error reply")?;
                Ok(Msg::Error(Error::from_parts(w.code, "peer", w.message)))
            }
            k => Err(Error::new(
                ErrorKind::Protocol,
                format!("unknown message kind {k}"),
            )),
        }
    }
}

fn remaining(deadline: Instant) -> Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(Error::new(
            ErrorKind::Timeout,
            "the deadline passed during a control-plane exchange",
        ))
    } else {
        Ok(left)
    }
}

/// Reads one frame, waiting at most until `deadline`.
pub(crate) fn read_msg(stream: &mut TcpStream, deadline: Instant) -> Result<Msg> {
    let mut header = [0u8; HEADER];
    read_exact(stream, &mut header, deadline)?;
    let (kind, len) = Msg::parse_header(&header)?;
    let mut payload = vec![0u8; len];
    read_exact(stream, &mut payload, deadline)?;
    Msg::decode(kind, &payload)
}

fn read_exact(stream: &mut TcpStream, mut buf: &mut [u8], deadline: Instant) -> Result<()> {
    while !buf.is_empty() {
        stream
            .set_read_timeout(Some(remaining(deadline)?))
            .map_err(|e| Error::io("read frame", "cannot set a read timeout", e))?;
        match stream.read(buf) {
            Ok(0) => {
                return Err(Error::new(
                    ErrorKind::PeerUnreachable,
                    "the peer closed the connection",
                )
                .with_operation("read frame"))
            }
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io("read frame", "reading from the peer failed", e)),
        }
    }
    Ok(())
}

/// Writes one frame, waiting at most until `deadline`.
pub(crate) fn write_msg(stream: &mut TcpStream, msg: &Msg, deadline: Instant) -> Result<()> {
    stream
        .set_write_timeout(Some(remaining(deadline)?))
        .map_err(|e| Error::io("write frame", "cannot set a write timeout", e))?;
    stream
        .write_all(&msg.encode())
        .map_err(|e| Error::io("write frame", "writing to the peer failed", e))
}

/// Opens a control-plane connection to `addr` before `deadline`.
pub(crate) fn dial(addr: &str, deadline: Instant) -> Result<TcpStream> {
    let unreachable = |m: String| {
        Error::new(ErrorKind::PeerUnreachable, m)
            .with_operation("connect")
            .with_context("peer", addr)
    };
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| {
            unreachable("cannot resolve the address (expected HOST:PORT)".into()).with_source(e)
        })?
        .collect();
    let mut last = None;
    for a in addrs {
        let left = remaining(deadline).map_err(|e| e.with_context("peer", addr))?;
        match TcpStream::connect_timeout(&a, left) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(match last {
        Some(e) => Error::io(
            "connect",
            "cannot reach the peer's control plane; is it running?",
            e,
        )
        .with_context("peer", addr),
        None => unreachable("the address resolves to nothing".into()),
    })
}

/// One request, one reply, on a fresh connection.
pub(crate) fn call(addr: &str, msg: &Msg, deadline: Instant) -> Result<Msg> {
    let mut s = dial(addr, deadline)?;
    write_msg(&mut s, msg, deadline)?;
    read_msg(&mut s, deadline).map_err(|e| e.with_context("peer", addr))
}

/// What the server asks of its engine.
pub(crate) trait Handler: Send + Sync + 'static {
    /// The current segment descriptor.
    fn segment(&self) -> SegmentDesc;
    /// Accepts a notification.
    fn notify(&self, notice: Notice) -> Result<()>;
}

/// The control-plane listener and its connection threads.
pub(crate) struct Server {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

struct Shared {
    stop: AtomicBool,
    active: AtomicUsize,
    next_id: AtomicU64,
    streams: Mutex<HashMap<u64, TcpStream>>,
}

impl Server {
    /// Binds `listen` and serves `handler` until dropped.
    pub(crate) fn start(listen: &str, handler: Weak<dyn Handler>) -> Result<Server> {
        let listener = TcpListener::bind(listen).map_err(|e| {
            Error::io(
                "start control plane",
                format!("cannot listen on {listen}"),
                e,
            )
            .with_context("listen", listen)
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("start control plane", "no local address", e))?;
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            next_id: AtomicU64::new(0),
            streams: Mutex::new(HashMap::new()),
        });
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("te-control".into())
            .spawn(move || accept_loop(listener, s, handler))
            .map_err(|e| Error::io("start control plane", "cannot spawn a thread", e))?;
        Ok(Server {
            addr,
            shared,
            accept: Some(accept),
        })
    }

    /// The address peers connect to.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept; it sees the flag and returns.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        for s in self
            .shared
            .streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
        {
            let _ = s.shutdown(Shutdown::Both);
        }
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>, handler: Weak<dyn Handler>) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = conn else { continue };
        if shared.active.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            shared.active.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!("control plane: too many connections, closing a new one");
            continue;
        }
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        if let Ok(clone) = stream.try_clone() {
            shared
                .streams
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(id, clone);
        }
        let s = shared.clone();
        let h = handler.clone();
        let spawned = std::thread::Builder::new()
            .name("te-control-conn".into())
            .spawn(move || {
                serve(stream, &s, &h);
                s.streams
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&id);
                s.active.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            shared
                .streams
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
            shared.active.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

fn serve(mut stream: TcpStream, shared: &Shared, handler: &Weak<dyn Handler>) {
    let _ = stream.set_nodelay(true);
    while !shared.stop.load(Ordering::SeqCst) {
        let msg = match read_msg(&mut stream, Instant::now() + IDLE_TIMEOUT) {
            Ok(m) => m,
            Err(e) => {
                if e.kind() == ErrorKind::Protocol {
                    tracing::debug!(error = %e, "control plane: malformed frame, closing");
                    let reply = Msg::Error(e);
                    let _ = write_msg(&mut stream, &reply, Instant::now() + Duration::from_secs(1));
                }
                return;
            }
        };
        let Some(h) = handler.upgrade() else { return };
        let reply = match msg {
            Msg::GetSegment => Msg::Segment(h.segment()),
            Msg::Notify(n) => match h.notify(n) {
                Ok(()) => Msg::Ack,
                Err(e) => Msg::Error(e),
            },
            other => Msg::Error(Error::new(
                ErrorKind::Protocol,
                format!("message kind {} is a reply, not a request", other.kind()),
            )),
        };
        drop(h);
        let close = matches!(reply, Msg::Error(ref e) if e.kind() == ErrorKind::Protocol);
        if write_msg(&mut stream, &reply, Instant::now() + IDLE_TIMEOUT).is_err() || close {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let n = Notice {
            to_epoch: 7,
            from_engine: "a".into(),
            from_epoch: 9,
            message: b"hi".to_vec(),
        };
        for msg in [Msg::GetSegment, Msg::Ack, Msg::Notify(n)] {
            let f = msg.encode();
            let (kind, len) = Msg::parse_header(f[..8].try_into().unwrap()).unwrap();
            assert_eq!(len, f.len() - 8);
            assert_eq!(Msg::decode(kind, &f[8..]).unwrap().encode(), f);
        }
    }

    #[test]
    fn bad_headers_are_protocol_errors() {
        let mut h = Msg::Ack.encode()[..8].to_vec();
        h[0] = b'X';
        assert_eq!(
            Msg::parse_header(h[..].try_into().unwrap())
                .unwrap_err()
                .kind(),
            ErrorKind::Protocol
        );
        let mut h = Msg::Ack.encode()[..8].to_vec();
        h[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Msg::parse_header(h[..].try_into().unwrap())
            .unwrap_err()
            .to_string()
            .contains("limit"));
        assert!(Msg::decode(42, &[]).is_err());
        assert!(Msg::decode(4, &[1]).is_err());
    }

    proptest::proptest! {
        #[test]
        fn decoding_random_payloads_never_panics(kind in 0u8..8, payload in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256)) {
            let _ = Msg::decode(kind, &payload);
        }
    }
}
