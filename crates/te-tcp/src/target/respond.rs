//! The responses of a served connection that has seen device memory: a responder task
//! sends them in request order, each once it is ready (a device request once its copies
//! complete), at most [`MAX_QUEUED`] held; and the device requests themselves, staged
//! through pinned buffers with one copy group per frame.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use te_core::sync::Mutex;
use tokio::sync::Notify;

use te_core::device::{DeviceCopy, DeviceRuntime};
use te_core::{Error, ErrorKind, Result};

use crate::errors::{io_err, protocol};
use crate::regions::Pin;
use crate::sock::Inbound;
use crate::sock::Sock;
use crate::stage::{self, Pools, StageBuf};
use crate::state::Shared;
use crate::target::serve::refuse;
use crate::wire::{Entry, Header, Kind, HEADER_LEN};

/// A response the responder task sends, in request order.
pub(crate) enum Item {
    /// Ready frames (acknowledgements, refusals).
    Bytes(Vec<u8>),
    /// A READ of host memory, sent straight from the ranges (address, length) of the
    /// region the pin holds.
    HostRead {
        header: [u8; HEADER_LEN],
        pin: Pin,
        spans: Vec<(usize, usize)>,
    },
    /// A request on device memory, answered once its copy completes.
    Staged { h: Header, slot: Arc<Slot> },
}

/// A device copy's result and, for a READ, the staged bytes.
type Slot = Mutex<Option<(Result<()>, Option<StageBuf>)>>;

/// Responses one connection's responder holds at most; beyond them the serving task
/// stops reading requests (the peer is throttled by TCP) until the responder catches
/// up, and a peer that reads nothing for `io_timeout` is cut off.
pub(crate) const MAX_QUEUED: usize = 256;

/// The most responses any responder of this process has held (for tests).
#[cfg(test)]
pub(crate) static HIGH_WATER: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);

/// The responses of one served connection that has seen device memory.
pub(crate) struct Responder {
    queue: Mutex<Queue>,
    /// Wakes the responder task: an item is queued, a copy completed, or it closes.
    ready: Notify,
    /// Wakes the serving task: the queue has room again, or it closed.
    room: Notify,
    /// How long a full queue may stay full, and a send may wait for room.
    limit: Duration,
    peer: String,
}

struct Queue {
    items: VecDeque<Item>,
    closed: bool,
    /// Send what is queued, then stop.
    draining: bool,
}

impl Responder {
    fn new(peer: &str, limit: Duration) -> Responder {
        Responder {
            queue: Mutex::new(Queue {
                items: VecDeque::new(),
                closed: false,
                draining: false,
            }),
            ready: Notify::new(),
            room: Notify::new(),
            limit,
            peer: peer.to_string(),
        }
    }

    /// Queues a response, waiting while [`MAX_QUEUED`] are queued.
    ///
    /// # Errors
    /// `PeerUnreachable` if the queue stays full for `limit` (the peer does not read
    /// its responses) or the responder has stopped; the item is dropped (releasing its
    /// pin or buffer).
    pub(crate) async fn push(&self, item: Item) -> Result<()> {
        let end = tokio::time::Instant::now() + self.limit;
        loop {
            {
                let mut q = self.queue.lock();
                if q.closed {
                    return Err(Error::new(
                        ErrorKind::PeerUnreachable,
                        format!(
                            "data connection from {}: sending responses failed",
                            self.peer
                        ),
                    ));
                }
                if q.items.len() < MAX_QUEUED {
                    q.items.push_back(item);
                    #[cfg(test)]
                    HIGH_WATER.fetch_max(q.items.len(), Ordering::Relaxed);
                    drop(q);
                    self.ready.notify_one();
                    return Ok(());
                }
            }
            // Room made since the look above left a permit: this returns at once.
            if tokio::time::timeout_at(end, self.room.notified())
                .await
                .is_err()
            {
                return Err(Error::new(
                    ErrorKind::PeerUnreachable,
                    format!(
                        "data connection from {}: the peer read no response for {:?} with {MAX_QUEUED} waiting; closed",
                        self.peer, self.limit
                    ),
                ));
            }
        }
    }

    /// Stops the responder and drops what it still holds, releasing pins and buffers.
    fn close(&self) {
        let left = {
            let mut q = self.queue.lock();
            q.closed = true;
            std::mem::take(&mut q.items)
        };
        self.ready.notify_one();
        self.room.notify_one();
        drop(left);
    }

    /// A copy completed: wake the responder if it waits for that one.
    fn copied(&self) {
        self.ready.notify_one();
    }

    /// The next response once it is ready; `None` once closed.
    async fn next(&self) -> Option<Item> {
        loop {
            {
                let mut q = self.queue.lock();
                if q.closed {
                    return None;
                }
                let ready = match q.items.front() {
                    Some(Item::Staged { slot, .. }) => slot.lock().is_some(),
                    Some(_) => true,
                    None => false,
                };
                if ready {
                    let item = q.items.pop_front();
                    drop(q);
                    self.room.notify_one();
                    return item;
                }
                if q.draining && q.items.is_empty() {
                    return None;
                }
            }
            self.ready.notified().await;
        }
    }

    /// The responder task: sends responses in order until closed or the socket fails.
    async fn run(&self, s: &Sock) {
        while let Some(item) = self.next().await {
            let sent = match item {
                Item::Bytes(b) => {
                    s.send_all(&[(b.as_ptr() as usize, b.len())], self.limit)
                        .await
                }
                Item::HostRead { header, pin, spans } => {
                    // The source ranges were checked by `admit` and stay registered
                    // while the pin lives.
                    let mut v = Vec::with_capacity(spans.len() + 1);
                    v.push((header.as_ptr() as usize, HEADER_LEN));
                    v.extend(spans);
                    let r = s.send_all(&v, self.limit).await;
                    drop(pin);
                    r
                }
                Item::Staged { h, slot } => {
                    let taken = slot.lock().take();
                    match taken {
                        Some((Ok(()), Some(buf))) => {
                            let header = Header::response(Kind::ReadData, 0, h.id, h.len).encode();
                            // The copy filled `h.len` bytes of the buffer, ours until
                            // it drops after this send.
                            let v = [
                                (header.as_ptr() as usize, HEADER_LEN),
                                (buf.ptr() as usize, h.len as usize),
                            ];
                            s.send_all(&v, self.limit).await
                        }
                        Some((Ok(()), None)) => {
                            let ack = Header::response(Kind::WriteAck, 0, h.id, 0).encode();
                            s.send_all(&[(ack.as_ptr() as usize, HEADER_LEN)], self.limit)
                                .await
                        }
                        Some((Err(e), _)) => {
                            tracing::warn!(peer = %self.peer, op = ?h.kind, region = h.region, error = %e, "a device copy failed");
                            let mut b = Vec::new();
                            refuse(&mut b, &h, &e);
                            s.send_all(&[(b.as_ptr() as usize, b.len())], self.limit)
                                .await
                        }
                        None => Ok(()),
                    }
                }
            };
            if let Err(e) = sent {
                tracing::debug!(peer = %self.peer, error = %e, "sending a response failed");
                self.close();
                // Wake the serving task; it ends the connection.
                s.shutdown();
                return;
            }
        }
    }
}

/// The responder of one served connection; dropping it stops the task (which holds
/// the socket open until it has ended, so it never writes to a reused descriptor).
pub(crate) struct ResponderGuard {
    responder: Arc<Responder>,
    sock: Arc<Sock>,
    /// Ends when the responder task does.
    ended: Arc<Notify>,
    done: Arc<std::sync::atomic::AtomicBool>,
}

impl std::ops::Deref for ResponderGuard {
    type Target = Arc<Responder>;
    fn deref(&self) -> &Arc<Responder> {
        &self.responder
    }
}

impl ResponderGuard {
    /// Queues `last`, lets the responder send everything queued, then stops it. Bounded:
    /// each send gives up after `io_timeout`, and copies complete on their own.
    pub(crate) async fn finish(self, last: Item) {
        // A responder that cannot take it is already gone: the connection closes anyway.
        let _ = self.responder.push(last).await;
        self.responder.queue.lock().draining = true;
        self.responder.ready.notify_one();
        while !self.done.load(Ordering::Acquire) {
            self.ended.notified().await;
        }
    }
}

impl Drop for ResponderGuard {
    fn drop(&mut self) {
        self.responder.close();
        // A responder waiting in a send returns.
        self.sock.shutdown();
    }
}

/// The connection's responder, started at its first device request; what `out` holds
/// goes first.
pub(crate) async fn responder_for(
    responder: &mut Option<ResponderGuard>,
    s: &Arc<Sock>,
    peer: &str,
    shared: &Shared,
    out: &mut Vec<u8>,
) -> Result<Arc<Responder>> {
    let r = match responder {
        Some(g) => g.responder.clone(),
        None => {
            let r = Arc::new(Responder::new(peer, shared.config.io_timeout));
            let ended = Arc::new(Notify::new());
            let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let (theirs, sock, e, d) = (r.clone(), s.clone(), ended.clone(), done.clone());
            shared.tasks.spawn(async move {
                theirs.run(&sock).await;
                d.store(true, Ordering::Release);
                e.notify_one();
            })?;
            *responder = Some(ResponderGuard {
                responder: r.clone(),
                sock: s.clone(),
                ended,
                done,
            });
            r
        }
    };
    if !out.is_empty() {
        r.push(Item::Bytes(std::mem::take(out))).await?;
    }
    Ok(r)
}

/// Refuses `h` through the responder with `e`.
async fn refuse_later(r: &Responder, h: &Header, e: &Error) -> Result<()> {
    let mut b = Vec::new();
    refuse(&mut b, h, e);
    r.push(Item::Bytes(b)).await
}

/// A WRITE to device memory: its payload lands in a staging buffer, and copies (one per
/// run of adjacent entries, from successive parts of the buffer, started as one group
/// with one synchronisation) move it to the device while the next request is received;
/// the acknowledgement follows the group.
pub(crate) async fn write_staged(
    pools: &Pools,
    r: &Arc<Responder>,
    inb: &mut Inbound,
    h: &Header,
    entries: &[Entry],
    pin: Pin,
    peer: &str,
) -> Result<()> {
    let Some((rt, ordinal)) = pin.region().data.clone() else {
        return Err(protocol(peer, "a staged write to host memory"));
    };
    // The request's header is in: it is halfway, and a wait that times out ends it.
    let mut on_timeout = |_mid: bool| false;
    let pool = match pools.get(&rt) {
        Ok(p) => p,
        Err(e) => {
            inb.discard(h.len, &mut on_timeout)
                .await
                .map_err(|e| io_err(peer, "receive failed", e))?;
            return refuse_later(r, h, &e).await;
        }
    };
    // Waits only for this direction's own copies to finish.
    let len = h.len as usize;
    let buf = match pool.take(len).await {
        Ok(b) => b,
        Err(e) => {
            inb.discard(h.len, &mut on_timeout)
                .await
                .map_err(|e| io_err(peer, "receive failed", e))?;
            return refuse_later(r, h, &e).await;
        }
    };
    // The range is ours and holds `len` bytes.
    inb.read_into(buf.ptr() as usize, len, &mut on_timeout)
        .await
        .map_err(|e| io_err(peer, "receive failed", e))?;
    let copies = staged_copies(entries, buf.ptr(), pin.region().addr, ordinal, true);
    // Entries that write some device bytes twice (a batch writing them twice) are
    // copied in waves, one after another, in entry order.
    let waves = staged_waves(copies);
    if len <= stage::INLINE_COPY && waves.len() == 1 {
        // Small: copied here, so no runtime thread wakes the responder for it.
        // SAFETY: as below; the buffer and the pin live until the copies have ended.
        let res = unsafe { stage::run_now(&rt, &waves[0]) };
        drop(pin);
        drop(buf);
        let slot: Arc<Slot> = Arc::new(Mutex::new(Some((res, None))));
        return r.push(Item::Staged { h: *h, slot }).await;
    }
    let slot = push_staged(r, h).await?;
    let r = r.clone();
    let done = move |res: Result<()>| {
        drop(pin);
        drop(buf);
        *slot.lock() = Some((res, None));
        r.copied();
    };
    // SAFETY: `admit` checked every entry inside the region, which the pin (owned by
    // `done`) keeps registered until the copies end; the buffer is owned by `done`, and
    // the entries' parts of it add up to `h.len`, which it holds. No copy of a wave
    // depends on another of it.
    unsafe { start_waves(&rt, waves, Box::new(done)) };
    Ok(())
}

/// Starts the first of `waves` as one device group ([`stage::start_all`]), and each
/// next one once the one before it has ended; `done` runs once, with the first failure
/// or once the last has ended.
///
/// # Safety
/// As [`stage::start_all`], for every wave: `done` keeps every range valid until it
/// runs; no copy of a wave depends on another of it.
pub(crate) unsafe fn start_waves(
    rt: &Arc<dyn DeviceRuntime>,
    mut waves: VecDeque<Vec<DeviceCopy>>,
    done: Box<dyn FnOnce(Result<()>) + Send>,
) {
    let Some(copies) = waves.pop_front() else {
        return done(Ok(()));
    };
    let next = rt.clone();
    let after = move |r: Result<()>| match r {
        // SAFETY: forwarded from the caller; the wave before has ended.
        Ok(()) if !waves.is_empty() => unsafe { start_waves(&next, waves, done) },
        r => done(r),
    };
    // SAFETY: forwarded from the caller.
    unsafe { stage::start_all(rt, copies, after) };
}

/// Staged copies in waves (`crate::waves`), in order: each wave is one device group,
/// whose copies a device runs in no order, so a copy that writes bytes an earlier one
/// reads or writes (a batch writing some device bytes twice) waits, in the next wave,
/// for that one to end. One wave where no copy depends on another.
pub(crate) fn staged_waves(copies: Vec<DeviceCopy>) -> VecDeque<Vec<DeviceCopy>> {
    use crate::waves::Span;
    // Host addresses in space 0, device addresses in space 1.
    let span = |space, addr, len: usize| Span {
        space,
        addr,
        len: len as u64,
    };
    let mut waves = crate::waves::Waves::default();
    for c in copies {
        let (reads, writes) = match c {
            DeviceCopy::ToDevice {
                device, host, len, ..
            } => (span(0, host as u64, len), span(1, device, len)),
            DeviceCopy::ToHost {
                device, host, len, ..
            } => (span(1, device, len), span(0, host as u64, len)),
            DeviceCopy::DeviceToDevice { src, dst, len, .. } => {
                (span(1, src, len), span(1, dst, len))
            }
        };
        waves.add(c, reads, writes, false);
    }
    waves.into_groups()
}

/// Queues the answer to `h`, which its staged copies fill in when they complete; returns
/// the slot they fill.
async fn push_staged(r: &Responder, h: &Header) -> Result<Arc<Slot>> {
    let slot: Arc<Slot> = Arc::new(Mutex::new(None));
    r.push(Item::Staged {
        h: *h,
        slot: slot.clone(),
    })
    .await?;
    Ok(slot)
}

/// The copies staging `entries` of the region at `base` on device `ordinal`, packed one
/// after another in `buf` (adjacent entries share a copy): to the device for a WRITE
/// (`to_device`), from it for a READ.
fn staged_copies(
    entries: &[Entry],
    buf: *mut u8,
    base: u64,
    ordinal: u32,
    to_device: bool,
) -> Vec<DeviceCopy> {
    let pieces = entries.iter().map(|e| (base + e.offset, e.len as usize));
    stage::packed(pieces, buf)
        .into_iter()
        .map(|(device, host, len)| {
            if to_device {
                DeviceCopy::ToDevice {
                    ordinal,
                    device,
                    host,
                    len,
                }
            } else {
                DeviceCopy::ToHost {
                    ordinal,
                    device,
                    host,
                    len,
                }
            }
        })
        .collect()
}

/// A READ of device memory: copies stage its entries, packed, as one group (one
/// synchronisation) while other requests are served; the responder sends them once the
/// group completes.
pub(crate) async fn read_staged(
    pools: &Pools,
    r: &Arc<Responder>,
    h: &Header,
    entries: &[Entry],
    pin: Pin,
) -> Result<()> {
    let Some((rt, ordinal)) = pin.region().data.clone() else {
        return Err(Error::new(
            ErrorKind::Protocol,
            "a staged read of host memory",
        ));
    };
    let pool = match pools.get(&rt) {
        Ok(p) => p,
        Err(e) => {
            return refuse_later(r, h, &e).await;
        }
    };
    // Waits for the responder to send earlier staged reads.
    let len: usize = entries.iter().map(|e| e.len as usize).sum();
    let buf = match pool.take(len).await {
        Ok(b) => b,
        Err(e) => return refuse_later(r, h, &e).await,
    };
    let copies = staged_copies(entries, buf.ptr(), pin.region().addr, ordinal, false);
    if len <= stage::INLINE_COPY {
        // Small: copied here, so no runtime thread wakes the responder for it.
        // SAFETY: as below; the buffer and the pin live until the copies have ended.
        let res = unsafe { stage::run_now(&rt, &copies) };
        drop(pin);
        let slot: Arc<Slot> = Arc::new(Mutex::new(Some((res, Some(buf)))));
        return r.push(Item::Staged { h: *h, slot }).await;
    }
    let slot = push_staged(r, h).await?;
    let r = r.clone();
    let done = move |res: Result<()>| {
        drop(pin);
        *slot.lock() = Some((res, Some(buf)));
        r.copied();
    };
    // SAFETY: `admit` checked every entry inside the region, which the pin (owned by
    // `done`) keeps registered until the copies end; the buffer is owned by `done` and
    // holds `h.len`, the entries' total.
    unsafe { stage::start_all(&rt, copies, done) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_full_responder_queue_refuses_more_after_its_limit_and_a_closed_one_at_once() {
        let rt = crate::runtime::runtime().expect("runtime");
        let r = Responder::new("peer", Duration::from_millis(100));
        for _ in 0..MAX_QUEUED {
            rt.block_on(r.push(Item::Bytes(vec![0; 8]))).expect("room");
        }
        let start = Instant::now();
        let e = rt.block_on(r.push(Item::Bytes(vec![0; 8]))).unwrap_err();
        assert!(start.elapsed() >= Duration::from_millis(100));
        assert_eq!(e.kind(), ErrorKind::PeerUnreachable);
        assert!(e.to_string().contains("read no response"), "{e}");
        r.close();
        assert!(r.queue.lock().items.is_empty(), "close drops what is held");
        assert!(rt.block_on(r.push(Item::Bytes(vec![0; 8]))).is_err());
    }
}
