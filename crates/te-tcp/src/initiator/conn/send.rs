//! The writer of one data connection, initiator side.
//!
//! A submitting thread that finds the connection idle sends its frames itself with
//! non-blocking `sendmsg` (up to `inline_send` bytes), so a small request costs no
//! thread hand-off; whatever does not fit is left to the connection's sender task on
//! te-tcp's I/O threads, which writes whenever the socket has room. At most one of
//! them writes at a time (`busy`). A device WRITE's bytes are first copied into
//! pinned staging memory; its frame goes out, in queue order, once that copy is done.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use te_core::sync::Mutex;

use te_core::device::DeviceCopy;
use te_core::{BatchStage, Result};

use super::Conn;
use crate::completion::Batch;
use crate::errors::{timeout_error, unreachable};
use crate::initiator::slice::Stage;
use crate::regions::Pin;
use crate::sock;
use crate::stage::{self, StageBuf};

/// Frames gathered into one `sendmsg`.
const MAX_FRAMES: usize = 32;

impl Conn {
    /// Gives up writing; the sender task takes over whatever is left.
    pub(super) fn hand_off(&self) {
        let mut tx = self.lock();
        tx.busy = false;
        let left = tx.drain_if_idle();
        drop(tx);
        self.wake.notify_one();
        self.fail(left, self.dead_error());
    }

    /// Writes queued frames, never waiting, while the caller holds `busy`: until none
    /// are left, the socket is full, the next frame's staging copy is not done, or (a
    /// submitting thread's `budget`) enough bytes are out. Returns the bytes written
    /// and how it stopped: `Idle` gave `busy` up (a submitting thread also gives it up
    /// when the socket is full or the next frame not staged, handing the rest to the
    /// sender task); the sender task keeps it on `Full` and `Waiting`.
    pub(super) fn pump(&self, budget: Option<usize>) -> (usize, Pumped) {
        let blocking = budget.is_none();
        let budget = budget.unwrap_or(usize::MAX);
        let mut written = 0usize;
        let mut expired = Vec::new();
        let mut failed = Vec::new();
        loop {
            let copies = self.stage_next();
            // A submitting thread copies small frames itself: it sends them next.
            self.start_copies(copies, !blocking);
            let carry = {
                let mut tx = self.lock();
                if tx.dead.is_some() {
                    tx.busy = false;
                    let left = tx.drain();
                    let e = tx.dead.clone();
                    drop(tx);
                    self.fail(left, e.unwrap_or_else(|| self.dead_error()));
                    self.fail(expired, timeout_error());
                    self.fail_each(failed);
                    return (written, Pumped::Idle);
                }
                let mut waiting = false;
                if tx.carry.is_empty() {
                    let mut c = std::mem::take(&mut tx.carry);
                    c.clear();
                    let mut frames = 0;
                    while frames < MAX_FRAMES && c.spans() < sock::IOV_MAX {
                        let Some(front) = tx.unsent.front() else {
                            break;
                        };
                        // A device WRITE goes out once its bytes are staged, in order.
                        let staged = match &front.stage {
                            None => Ok(Some(front.local)),
                            Some(st) => match &*st.lock() {
                                Stage::Ready(buf) => Ok(Some(buf.ptr() as usize)),
                                Stage::Failed(e) => Err(e.clone()),
                                Stage::Idle | Stage::Copying | Stage::Sent => Ok(None),
                            },
                        };
                        let staged = match staged {
                            Ok(staged) => staged,
                            Err(e) => {
                                if let Some(s) = tx.unsent.pop_front() {
                                    failed.push((s, e));
                                }
                                continue;
                            }
                        };
                        let Some(payload) = staged else {
                            waiting = frames == 0;
                            break;
                        };
                        let Some(mut s) = tx.unsent.pop_front() else {
                            break;
                        };
                        if s.batch.stopped() {
                            expired.push(s);
                            continue;
                        }
                        tx.queued += s.wire_len();
                        s.end = tx.queued;
                        s.push_frame(&mut c, payload);
                        s.batch.stage_began(BatchStage::Wire);
                        frames += 1;
                        if let Some(st) = &s.stage {
                            tx.out_staged.push(st.clone());
                        }
                        tx.sent.push_back(s);
                    }
                    tx.carry = c;
                }
                if waiting && blocking {
                    // The next slice's copy (or a buffer for it) is not done; its
                    // completion wakes the sender task.
                    drop(tx);
                    self.fail(expired, timeout_error());
                    self.fail_each(failed);
                    return (written, Pumped::Waiting);
                }
                if tx.carry.is_empty() || (!blocking && written >= budget) {
                    tx.busy = false;
                    let more = !tx.unsent.is_empty() || !tx.carry.is_empty();
                    drop(tx);
                    if more {
                        self.wake.notify_one();
                    }
                    self.fail(expired, timeout_error());
                    self.fail_each(failed);
                    return (written, Pumped::Idle);
                }
                std::mem::take(&mut tx.carry)
            };
            self.fail(std::mem::take(&mut expired), timeout_error());
            self.fail_each(std::mem::take(&mut failed));
            let mut v = [sock::iov(std::ptr::null(), 0); sock::IOV_MAX];
            let n = carry.iovecs(&mut v);
            // The payload spans are registered memory pinned by the slices' batches;
            // those slices sit in `sent` and cannot fail while this writer is `busy`.
            // The header spans point into `carry`, alive until after the call.
            // Counted under the lock the receiver takes to read the count, so an
            // answer to bytes this call sends finds them counted.
            let sent = {
                let mut w = self.written.lock();
                let sent = sock::send(self.sock.fd(), &v[..n], true);
                if let Ok(k) = sent {
                    *w += k as u64;
                }
                sent
            };
            let mut carry = carry;
            if let Ok(k) = sent {
                carry.advance(k);
            }
            // Back where the next writer finds it (only a `busy` writer touches it).
            let out = {
                let mut tx = self.lock();
                let done = carry.is_empty();
                tx.carry = carry;
                if done {
                    std::mem::take(&mut tx.out_staged)
                } else {
                    Vec::new()
                }
            };
            // Every staged byte of these frames is in the socket: their buffers can
            // take the next frames' copies (picked up at the top of the loop).
            for st in out {
                *st.lock() = Stage::Sent;
            }
            match sent {
                Ok(k) => {
                    written += k;
                    self.progress.fetch_add(1, Ordering::Release);
                }
                Err(e) if !blocking && e.kind() == std::io::ErrorKind::WouldBlock => {
                    self.hand_off();
                    return (written, Pumped::Idle);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    return (written, Pumped::Full);
                }
                Err(e) => self.kill(unreachable(&self.label, "send failed", e)),
            }
        }
    }

    /// Gives free staging memory to the next device WRITE slices waiting for it, in
    /// order, and returns the copies to start (outside the lock). Each waiting slice is
    /// looked at once when its turn comes, not on every call.
    fn stage_next(&self) -> Vec<Staging> {
        let mut copies = Vec::new();
        let mut tx = self.lock();
        while let Some(next) = tx.to_stage.front() {
            // Only this queue holds the slot: the slice has ended without being sent.
            let gone = Arc::strong_count(&next.slot) == 1;
            let idle = matches!(*next.slot.lock(), Stage::Idle);
            if gone || !idle {
                tx.to_stage.pop_front();
                continue;
            }
            let len = next.pieces.iter().map(|p| p.1).sum();
            let taken = self
                .send_pools
                .get(&next.dev.0)
                .and_then(|pool| pool.try_take(len));
            // The rest wait for staging memory that sends and copies give back.
            if let Ok(None) = taken {
                break;
            }
            let Some(t) = tx.to_stage.pop_front() else {
                break;
            };
            let mut st = t.slot.lock();
            let buf = match taken {
                Ok(Some(b)) => b,
                Ok(None) => break,
                Err(e) => {
                    *st = Stage::Failed(e);
                    continue;
                }
            };
            if t.batch.stopped() {
                *st = Stage::Failed(timeout_error());
                continue;
            }
            let Some(pins) = t.batch.hold() else {
                *st = Stage::Failed(timeout_error());
                continue;
            };
            *st = Stage::Copying;
            drop(st);
            let ordinal = t.dev.1;
            copies.push(Staging {
                copies: stage::packed(t.pieces.iter().map(|&(d, l)| (d as u64, l)), buf.ptr())
                    .into_iter()
                    .map(|(device, host, len)| DeviceCopy::ToHost {
                        ordinal,
                        device,
                        host,
                        len,
                    })
                    .collect(),
                rt: t.dev.0.clone(),
                buf,
                slot: Some(t.slot.clone()),
                pins,
                batch: t.batch.clone(),
            });
        }
        copies
    }

    /// Starts device → host copies, one group per slice; each group's completion makes
    /// its slice ready (or failed) and wakes the writer. With `inline`, a slice of at
    /// most [`stage::INLINE_COPY`] bytes is copied on this thread, which then sends it:
    /// no runtime thread hands it back.
    fn start_copies(&self, copies: Vec<Staging>, inline: bool) {
        for c in copies {
            let small = c.copies.iter().map(|c| c.len()).sum::<usize>() <= stage::INLINE_COPY;
            c.batch.stage_began(BatchStage::Device);
            if inline && small {
                // SAFETY: as for `start_all` below; this thread holds the buffer and
                // the pins until the copies have ended.
                let r = unsafe { stage::run_now(&c.rt, &c.copies) };
                c.batch.stage_ended(BatchStage::Device);
                drop(c.pins);
                if let Some(slot) = c.slot {
                    *slot.lock() = match r {
                        Ok(()) => Stage::Ready(c.buf),
                        Err(e) => Stage::Failed(e),
                    };
                }
                continue;
            }
            // The copy holds its connection until it ends, so that a connection let
            // go of meanwhile (dead, then dropped by a reconnect or a disconnect) still
            // fails the slice with its own error once the copy no longer reads.
            let conn = self.me.upgrade();
            self.copy_started();
            let Staging {
                copies,
                rt,
                buf,
                slot,
                pins,
                batch,
            } = c;
            let done = move |r: Result<()>| {
                batch.stage_ended(BatchStage::Device);
                drop(pins);
                if let Some(slot) = slot {
                    *slot.lock() = match r {
                        Ok(()) => Stage::Ready(buf),
                        Err(e) => Stage::Failed(e),
                    };
                }
                if let Some(conn) = conn {
                    conn.copy_ended();
                }
            };
            // SAFETY: the device ranges lie in a region the batch's pins (held by
            // `done` until the copies end) keep registered, and were checked against it
            // at submission; the staging range is this group's alone (owned by `done`)
            // and was taken for the slice's parts packed, their total.
            unsafe { stage::start_all(&rt, copies, done) };
        }
    }

    /// The sender task: writes whatever submitting threads left, whenever the socket
    /// has room; a peer that takes nothing for `io_timeout` is declared dead.
    pub(super) async fn send_loop(self: Arc<Self>) {
        loop {
            loop {
                {
                    let mut tx = self.lock();
                    if tx.dead.is_some() {
                        return;
                    }
                    if !tx.busy && (!tx.unsent.is_empty() || !tx.carry.is_empty()) {
                        tx.busy = true;
                        break;
                    }
                }
                // A wake since the look above left a permit: this returns at once.
                self.wake.notified().await;
            }
            let mut state = self.pump(None).1;
            loop {
                match state {
                    Pumped::Idle => break,
                    Pumped::Waiting => {
                        self.wake.notified().await;
                        state = self.pump(None).1;
                    }
                    Pumped::Full => {
                        // Back as soon as a write moved bytes, so the limit is on a
                        // peer taking nothing, not on a long transfer.
                        let r = self
                            .sock
                            .when_writable(self.io_timeout, || match self.pump(None) {
                                (0, Pumped::Full) => Err(std::io::ErrorKind::WouldBlock.into()),
                                (_, p) => Ok(p),
                            })
                            .await;
                        state = match r {
                            Ok(p) => p,
                            Err(e) => {
                                self.kill(unreachable(
                                    &self.label,
                                    "the peer took nothing for io_timeout",
                                    e,
                                ));
                                // Still the writer: drain what is left.
                                self.pump(None).1
                            }
                        };
                    }
                }
            }
        }
    }
}

/// How [`Conn::pump`] stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pumped {
    /// Nothing left to write now; the writer gave `busy` up.
    Idle,
    /// The socket is full; the sender task keeps `busy` and waits for room.
    Full,
    /// The next frame waits for its staging copy; the sender task keeps `busy` and
    /// waits for the copy's wake.
    Waiting,
}

/// The device → host copies about to start for a WRITE slice.
struct Staging {
    copies: Vec<DeviceCopy>,
    rt: Arc<dyn te_core::device::DeviceRuntime>,
    buf: StageBuf,
    slot: Option<Arc<Mutex<Stage>>>,
    pins: Arc<Vec<Pin>>,
    /// The slice's batch, which times its device stage.
    batch: Arc<Batch>,
}
