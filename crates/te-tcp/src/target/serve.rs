//! The target's side: the data listener, and a task per accepted connection on the
//! I/O threads, which authenticates the initiator, then serves its requests in order.
//!
//! Every request is checked against this backend's own registrations (region, rights,
//! bounds) before a byte of its payload is placed: a WRITE lands straight in the
//! registered region and is acknowledged only once it is there; a refused WRITE's
//! payload is received and dropped, so the connection stays usable; a READ streams
//! straight from the registered region. Device memory is answered through the
//! connection's responder (`respond.rs`).

use std::net::TcpListener;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::unix::AsyncFd;

use te_core::kit::fits;
use te_core::{Error, ErrorKind, Op, RegionId, Result};

use crate::errors::{io_err, protocol};
use crate::regions::Pin;
use crate::sock::Sock;
use crate::sock::{self, Inbound};
use crate::stage::Pools;
use crate::state::Shared;
use crate::target::respond::{read_staged, responder_for, write_staged, Item, ResponderGuard};
use crate::wire::{self, Entry, Header, Kind, HEADER_LEN};

/// The longest pause after a failed `accept`; short, so closing the backend is quick.
const MAX_BACKOFF: Duration = Duration::from_millis(200);

/// Accepts data connections until the backend closes. A failed `accept` (out of
/// descriptors or memory) never ends it: it backs off and tries again, logging once
/// per burst of failures.
pub(crate) async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    let listener = match listener
        .set_nonblocking(true)
        // SAFETY: the listener owns its open descriptor and the `AsyncFd` owns the
        // listener, so the descriptor stays open, the same socket, until it drops.
        .and_then(|()| unsafe { AsyncFd::register(listener) }.map_err(|e| e.into_parts().1))
    {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "the tcp data listener cannot wait for connections; none will be accepted");
            return;
        }
    };
    let mut backoff = Duration::ZERO;
    let mut full_logged = false;
    loop {
        let accepted = tokio::select! {
            r = async {
                loop {
                    let mut g = listener.readable().await?;
                    match g.try_io(|l| l.get_ref().accept()) {
                        Ok(r) => return r,
                        Err(_would_block) => continue,
                    }
                }
            } => r,
            () = shared.closing.notified() => return,
        };
        if !shared.is_open() {
            return;
        }
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                if e.kind() == std::io::ErrorKind::Interrupted
                    || e.kind() == std::io::ErrorKind::ConnectionAborted
                {
                    continue;
                }
                back_off(&shared, &mut backoff, &e).await;
                continue;
            }
        };
        if !backoff.is_zero() {
            tracing::info!("the tcp data listener accepts again");
            backoff = Duration::ZERO;
        }
        let Ok(from) = stream.peer_addr() else {
            continue;
        };
        let peer = from.to_string();
        let c = &shared.config;
        let serving = shared.serving.lock().len();
        if serving >= c.max_connections {
            // Closed at once: a flood of connections costs no task and no buffer.
            if !full_logged {
                tracing::warn!(peer = %peer, serving, max_connections = c.max_connections, "refusing data connections: too many open (more refusals are not logged until one is accepted)");
                full_logged = true;
            }
            drop(stream);
            continue;
        }
        full_logged = false;
        let clone = match stream.try_clone() {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors too: the connection is closed, and so is the next
                // `accept` until some are free again.
                back_off(&shared, &mut backoff, &e).await;
                continue;
            }
        };
        let key = shared.next_serving.fetch_add(1, Ordering::Relaxed);
        shared.serving.lock().insert(key, clone);
        // Pending from here until its handshake ends, however the task ends or if it
        // never starts; past `max_pending` the oldest pending connection is closed.
        let pending = shared
            .pending
            .admit(from.ip(), c.max_pending, c.max_pending);
        let s = shared.clone();
        let started = shared.tasks.spawn(async move {
            if let Err(e) = serve(&s, stream, &peer, pending).await {
                let quiet = matches!(e.kind(), ErrorKind::PeerUnreachable) || !s.is_open();
                if quiet {
                    tracing::debug!(peer = %peer, error = %e, "data connection ended");
                } else {
                    tracing::warn!(peer = %peer, error = %e, "data connection closed");
                }
            }
            s.serving.lock().remove(&key);
        });
        if started.is_err() {
            shared.serving.lock().remove(&key);
        }
    }
}

/// Waits a little longer after each resource error in a row (up to [`MAX_BACKOFF`]),
/// logging only the first one of a burst.
async fn back_off(shared: &Shared, backoff: &mut Duration, e: &std::io::Error) {
    shared.accept_errors.fetch_add(1, Ordering::Relaxed);
    if backoff.is_zero() {
        tracing::error!(error = %e, "the tcp data listener cannot accept; retrying with back-off until it can (raise the descriptor limit, `ulimit -n`, or lower [backends.tcp] max_connections)");
    }
    *backoff = (*backoff * 2).clamp(Duration::from_millis(5), MAX_BACKOFF);
    tokio::time::sleep(*backoff).await;
}

/// A WRITE's payload stopped arriving part way: the range may hold old and new bytes.
/// Said at the target (a warning naming region and range, and a counter) because the
/// initiator, whose batch fails, may be the side that died. For a scatter-gather frame
/// the range is the one its entries span.
fn torn(shared: &Shared, h: &Header, entries: &[Entry], peer: &str, e: std::io::Error) -> Error {
    shared.torn_writes.fetch_add(1, Ordering::Relaxed);
    let (start, end) = span(entries);
    tracing::warn!(
        peer = %peer,
        region = h.region,
        offset = start,
        len = end - start,
        entries = entries.len(),
        error = %e,
        "torn write: the connection broke in the middle of a WRITE; this range may hold part old, part new bytes"
    );
    let event = te_core::PeerEvent {
        kind: te_core::PeerEventKind::TornWrite,
        // The data connection names no engine; its address is what is known.
        name: String::new(),
        epoch: 0,
        previous_epoch: None,
        address: peer.to_string(),
        at: std::time::SystemTime::now(),
        torn: Some(te_core::TornRange {
            region: RegionId(h.region),
            start,
            end,
        }),
    };
    if let Err(e) = shared.hook.post_event(event) {
        // Outside an engine (a backend driven directly) the log line above is all.
        tracing::debug!(error = %e, "the torn write was not posted as a peer event");
    }
    io_err(
        peer,
        &format!(
            "the connection broke in the middle of a WRITE to region {} bytes {start}..{end}",
            h.region
        ),
        e,
    )
}

/// The range from the lowest entry's start to the highest entry's end (entries are
/// checked not to overflow).
fn span(entries: &[Entry]) -> (u64, u64) {
    let start = entries.iter().map(|e| e.offset).min().unwrap_or(0);
    let end = entries
        .iter()
        .map(|e| e.offset.saturating_add(e.len))
        .max()
        .unwrap_or(0);
    (start, end)
}

async fn serve(
    shared: &Shared,
    s: std::net::TcpStream,
    peer: &str,
    pending: te_core::kit::net::PendingSlot,
) -> Result<()> {
    let c = &shared.config;
    sock::tune(&s, c).map_err(|e| io_err(peer, "cannot set options", e))?;
    let s = Sock::new(s).map_err(|e| io_err(peer, "cannot register the socket", e))?;
    let answered = tokio::select! {
        r = crate::handshake::answer(shared, &s, peer) => r?,
        () = pending.evicted() => {
            tracing::debug!(peer = %peer, "closing a data connection still in its handshake to make room for a newer one");
            return Ok(());
        }
    };
    if !answered {
        return Ok(());
    }
    drop(pending);
    // An idle limit shorter than `io_timeout` needs waits that short.
    let wait = if !c.idle_timeout.is_zero() && c.idle_timeout < c.io_timeout {
        c.idle_timeout
    } else {
        c.io_timeout
    };
    let mut inb = Inbound::new(s.clone(), wait);
    // Device regions: staging buffers, and a responder task that sends responses in
    // order once their copies complete; both made at the first device request.
    let send_pools = Pools::new(c.slice_size, &shared.staging);
    let recv_pools = Pools::new(c.slice_size, &shared.staging);
    let mut responder: Option<ResponderGuard> = None;
    // Acknowledgements and refusals not yet sent: flushed before this task would
    // wait on a receive, and in front of the next READ's data.
    let mut out: Vec<u8> = Vec::with_capacity(64 * HEADER_LEN);
    let idle = c.idle_timeout;
    // The current request's entries: its one range, or a scatter-gather frame's list.
    let mut entries: Vec<Entry> = Vec::new();
    let mut refusals = Refusals { peer, count: 0 };
    loop {
        // Waiting for the next request may take forever (or `idle_timeout`); a request
        // stalled halfway may not.
        let last_request = Instant::now();
        let mut on_timeout =
            move |mid: bool| !mid && (idle.is_zero() || last_request.elapsed() < idle);
        if let Some(r) = &responder {
            if !out.is_empty() {
                r.push(Item::Bytes(std::mem::take(&mut out))).await?;
            }
        }
        // Refusals pile up only while requests arrive faster than this loop; a peer
        // that sends many refused requests and reads nothing is bounded here.
        if (inb.buffered().len() < HEADER_LEN || out.len() >= OUT_LIMIT) && !out.is_empty() {
            send_out(&s, &mut out, c.io_timeout, peer).await?;
        }
        inb.fill(HEADER_LEN, &mut on_timeout)
            .await
            .map_err(|e| io_err(peer, "receive failed", e))?;
        let h = Header::decode(&inb.buffered()[..HEADER_LEN]).map_err(|e| protocol(peer, e))?;
        inb.consume(HEADER_LEN);
        // From here on the request is halfway, even where no byte of the rest is
        // buffered yet: a wait that times out ends the connection.
        let mut on_timeout = |_mid: bool| false;
        let request = matches!(
            h.kind,
            Kind::Write | Kind::Read | Kind::WriteV | Kind::ReadV
        );
        if h.len > c.slice_size && request {
            return Err(refuse_oversize(&s, &mut responder, &mut out, &h, c, peer).await);
        }
        // The entry list is read and checked whole before any payload byte.
        match h.kind {
            Kind::WriteV | Kind::ReadV => {
                let n = h.entries_len();
                inb.fill(n, &mut on_timeout)
                    .await
                    .map_err(|e| io_err(peer, "receive failed", e))?;
                wire::decode_entries(&h, &inb.buffered()[..n], &mut entries)
                    .map_err(|e| protocol(peer, e))?;
                inb.consume(n);
            }
            _ => {
                entries.clear();
                entries.push(Entry {
                    offset: h.offset,
                    len: h.len,
                });
            }
        }
        if !c.debug_delay.is_zero() {
            tokio::time::sleep(c.debug_delay).await;
        }
        match h.kind {
            Kind::Write | Kind::WriteV => {
                match check(shared, &h, &entries) {
                    Ok(pin) if pin.region().data.is_some() => {
                        let r = responder_for(&mut responder, &s, peer, shared, &mut out).await?;
                        write_staged(&recv_pools, &r, &mut inb, &h, &entries, pin, peer).await?;
                    }
                    Ok(pin) => {
                        let base = pin.region().addr;
                        if !out.is_empty() && inb.buffered().len() < h.len as usize {
                            // This receive may wait: acknowledge what is done first.
                            send_out(&s, &mut out, c.io_timeout, peer).await?;
                        }
                        // `admit` checked every entry inside the region, and the pin
                        // keeps it registered until the bytes are in place.
                        let dst = entries
                            .iter()
                            .map(|e| ((base + e.offset) as usize, e.len as usize));
                        let got = inb.read_scattered(dst, &mut on_timeout).await;
                        got.map_err(|e| torn(shared, &h, &entries, peer, e))?;
                        drop(pin);
                        let ack = Header::response(Kind::WriteAck, 0, h.id, 0).encode();
                        match &responder {
                            Some(r) => r.push(Item::Bytes(ack.to_vec())).await?,
                            None => out.extend_from_slice(&ack),
                        }
                    }
                    Err(e) => {
                        refusals.note(&h, &entries, &e);
                        inb.discard(h.len, &mut on_timeout)
                            .await
                            .map_err(|e| io_err(peer, "receive failed", e))?;
                        refuse(&mut out, &h, &e);
                    }
                }
            }
            Kind::Read | Kind::ReadV => match check(shared, &h, &entries) {
                Ok(pin) if pin.region().data.is_some() => {
                    let r = responder_for(&mut responder, &s, peer, shared, &mut out).await?;
                    read_staged(&send_pools, &r, &h, &entries, pin).await?;
                }
                Ok(pin) => {
                    let base = pin.region().addr;
                    let spans: Vec<(usize, usize)> = entries
                        .iter()
                        .map(|e| ((base + e.offset) as usize, e.len as usize))
                        .collect();
                    let header = Header::response(Kind::ReadData, 0, h.id, h.len).encode();
                    match &responder {
                        Some(r) => r.push(Item::HostRead { header, spans, pin }).await?,
                        None => {
                            let mut v = Vec::with_capacity(spans.len() + 2);
                            v.push((out.as_ptr() as usize, out.len()));
                            v.push((header.as_ptr() as usize, HEADER_LEN));
                            v.extend(spans);
                            // Every source range was checked by `admit` and stays
                            // registered while the pin lives; `out` and `header` live
                            // until after the call.
                            s.send_all(&v, c.io_timeout)
                                .await
                                .map_err(|e| io_err(peer, "send failed", e))?;
                            drop(pin);
                            out.clear();
                        }
                    }
                }
                Err(e) => {
                    refusals.note(&h, &entries, &e);
                    refuse(&mut out, &h, &e);
                }
            },
            kind => return Err(protocol(peer, format!("a {kind:?} sent to the target"))),
        }
    }
}

/// Sends the buffered acknowledgements and refusals.
async fn send_out(s: &Sock, out: &mut Vec<u8>, limit: Duration, peer: &str) -> Result<()> {
    s.send_all(&[(out.as_ptr() as usize, out.len())], limit)
        .await
        .map_err(|e| io_err(peer, "send failed", e))?;
    out.clear();
    Ok(())
}

/// Answers a request longer than the frame limit this target announced with an
/// `InvalidRequest`, after the responses owed before it, and returns the error that
/// closes the connection: its payload cannot be placed, and a peer that ignores the
/// agreed terms is not trusted with the rest of the stream.
async fn refuse_oversize(
    s: &Sock,
    responder: &mut Option<ResponderGuard>,
    out: &mut Vec<u8>,
    h: &Header,
    c: &crate::config::TcpConfig,
    peer: &str,
) -> Error {
    let limit = c.slice_size;
    let e = Error::new(
        ErrorKind::InvalidRequest,
        format!(
            "a {:?} of {} bytes is longer than this target's frame limit of {limit} bytes \
             agreed in the handshake; slice requests to the announced limit",
            h.kind, h.len
        ),
    );
    tracing::warn!(peer = %peer, op = ?h.kind, len = h.len, limit, "refused an oversized frame; closing the connection");
    let mut b = std::mem::take(out);
    refuse(&mut b, h, &e);
    match responder.take() {
        Some(r) => r.finish(Item::Bytes(b)).await,
        None => {
            // Best effort: the connection closes whether or not the peer hears why.
            let _ = s
                .send_all(&[(b.as_ptr() as usize, b.len())], c.io_timeout)
                .await;
        }
    }
    protocol(peer, e.message())
}

/// Checks every entry of a request against the registrations (region, right, bounds)
/// and pins its region; a refusal is logged as a warning.
pub(crate) fn admit(shared: &Shared, h: &Header, entries: &[Entry], peer: &str) -> Result<Pin> {
    let result = check(shared, h, entries);
    if let Err(e) = &result {
        log_refusal(h, entries, peer, e, true);
    }
    result
}

/// Logs a refused request: as a warning, or (a connection's later refusals) at debug
/// level.
fn log_refusal(h: &Header, entries: &[Entry], peer: &str, e: &Error, warn: bool) {
    let offset = entries.first().map_or(h.offset, |e| e.offset);
    let n = entries.len();
    if warn {
        tracing::warn!(peer = %peer, op = ?h.kind, region = h.region, offset, len = h.len, entries = n, error = %e, "refused a request");
    } else {
        tracing::debug!(peer = %peer, op = ?h.kind, region = h.region, offset, len = h.len, entries = n, error = %e, "refused a request");
    }
}

/// The requests a served connection refused: the first is logged as a warning, the
/// rest at debug level and counted in one warning when the connection ends, so a peer
/// that floods refused requests cannot flood the log.
struct Refusals<'a> {
    peer: &'a str,
    count: u64,
}

impl Refusals<'_> {
    fn note(&mut self, h: &Header, entries: &[Entry], e: &Error) {
        self.count += 1;
        log_refusal(h, entries, self.peer, e, self.count == 1);
    }
}

impl Drop for Refusals<'_> {
    fn drop(&mut self) {
        if self.count > 1 {
            tracing::warn!(peer = %self.peer, refused = self.count, "a data connection ended after refusing requests (all but the first logged at debug level)");
        }
    }
}

/// [`admit`] without the log line.
fn check(shared: &Shared, h: &Header, entries: &[Entry]) -> Result<Pin> {
    let first = entries.first().copied().unwrap_or(Entry {
        offset: h.offset,
        len: h.len,
    });
    shared
        .regions
        .pin_range(RegionId(h.region), first.offset, first.len)
        .and_then(|pin| {
            let (op, right) = match h.kind {
                Kind::Write | Kind::WriteV => (Op::Write, "remotely writable"),
                _ => (Op::Read, "remotely readable"),
            };
            if !pin.access.allows(op) {
                return Err(Error::new(
                    ErrorKind::InvalidRequest,
                    format!("region {} is not {right}", h.region),
                ));
            }
            let size = pin.region().len;
            let outside = entries
                .iter()
                .enumerate()
                .find(|(_, e)| !fits(e.offset, e.len, size));
            if let Some((i, e)) = outside {
                return Err(Error::new(
                    ErrorKind::OutOfBounds,
                    format!(
                        "entry {i} of {} ({}+{}) is outside region {} of {size} bytes; nothing of the frame was placed",
                        entries.len(),
                        e.offset,
                        e.len,
                        h.region
                    ),
                ));
            }
            Ok(pin)
        })
}

pub(crate) fn refuse(out: &mut Vec<u8>, h: &Header, e: &Error) {
    let mut msg = e.message().as_bytes();
    msg = &msg[..msg.len().min(wire::MAX_MESSAGE as usize)];
    let msg: &[u8] = if msg.is_empty() { b"refused" } else { msg };
    out.extend_from_slice(
        &Header::response(Kind::Error, e.kind().code(), h.id, msg.len() as u64).encode(),
    );
    out.extend_from_slice(msg);
}

/// Refusals and acknowledgements buffered before they are sent, at most (bytes).
const OUT_LIMIT: usize = 64 << 10;
