//! The initiator's side of one data connection: its handshake, the queue of slices,
//! who writes them, and the receiver task that matches responses to slices and
//! completes batches.
//!
//! Writing: a submitting thread that finds the connection idle sends its frames itself
//! with non-blocking `sendmsg` (up to `inline_send` bytes), so a small request costs no
//! thread hand-off; whatever does not fit is left to the connection's sender task on
//! te-tcp's I/O threads, which writes whenever the socket has room. At most one of
//! them writes at a time (`busy`).
//!
//! Failure: whoever sees the connection break marks it dead and shuts the socket down;
//! every slice on it then fails, exactly once, by whichever of the writer and the
//! receiver leaves last, so no slice is failed (and its memory released) while a
//! task still reads or writes that memory.

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;
use te_core::sync::Mutex;
use tokio::sync::Notify;

use te_core::device::DeviceCopy;
use te_core::{Deadline, Error, ErrorKind, Op, Result};

use crate::carry::Carry;
use crate::config::TcpConfig;
use crate::handshake::handshake;
use crate::io::{Sock, Tasks};
use crate::regions::Pin;
use crate::slice::{Batch, Slice, Stage};
use crate::sock::{self, Inbound};
use crate::stage::{self, Dev, Pools, StageBuf};
use crate::wire::{Header, Kind, HEADER_LEN, MAX_MESSAGE};

/// Frames gathered into one `sendmsg`.
const MAX_FRAMES: usize = 32;

struct Tx {
    /// Slices not yet handed to a writer.
    unsent: VecDeque<Slice>,
    /// Slices written (or being written, see `carry`), in wire order, awaiting responses.
    sent: VecDeque<Slice>,
    carry: Carry,
    busy: bool,
    dead: Option<Error>,
    next_id: u64,
    /// The batch of the response being received, whose memory the receiver may be
    /// writing.
    receiving: Option<Arc<Batch>>,
    /// Device WRITE slices waiting for a staging buffer, in queue order; entries whose
    /// slice has gone (failed, cut) are skipped when reached.
    to_stage: VecDeque<ToStage>,
    /// The staging of device WRITE frames in `carry`: their buffers go back to the
    /// pool once the socket has taken the whole carry, not at the acknowledgement.
    out_staged: Vec<Arc<Mutex<Stage>>>,
}

/// What starting a device WRITE slice's staging copy needs.
struct ToStage {
    slot: Arc<Mutex<Stage>>,
    dev: Dev,
    /// The device ranges (address, bytes), packed one after another into the buffer.
    pieces: Vec<(usize, usize)>,
    batch: Arc<Batch>,
}

impl Tx {
    /// Everything still on the connection, once it is dead and nobody writes.
    fn drain(&mut self) -> Vec<Slice> {
        self.carry.clear();
        self.to_stage.clear();
        self.out_staged.clear();
        self.sent.drain(..).chain(self.unsent.drain(..)).collect()
    }
}

/// One data connection to a peer.
pub(crate) struct Conn {
    sock: Arc<Sock>,
    label: String,
    tx: Mutex<Tx>,
    /// Wakes the sender task: work queued, a staging copy done, a buffer returned, or
    /// the connection died.
    wake: Notify,
    io_timeout: Duration,
    dead: AtomicBool,
    inflight: AtomicUsize,
    /// Counts answers received and sends that moved bytes: unchanged between two looks
    /// means the connection stalled.
    progress: AtomicU64,
    /// This connection, for device copies' completions.
    me: Weak<Conn>,
    /// Pinned buffers for device WRITEs (device → host → socket).
    send_pools: Pools,
    /// Pinned buffers for device READs (socket → host → device).
    recv_pools: Pools,
    /// The longest payload the target accepts in one frame (from its terms).
    max_payload: u64,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("peer", &self.label)
            .field("dead", &self.is_dead())
            .finish()
    }
}

pub(crate) fn unreachable(label: &str, what: &str, e: std::io::Error) -> Error {
    Error::new(
        ErrorKind::PeerUnreachable,
        format!("data connection to {label}: {what}"),
    )
    .with_source(e)
}

impl Conn {
    /// Opens, tunes and authenticates a data connection to `addr`, which must be the
    /// target instance `instance`, and starts its sender and receiver tasks.
    ///
    /// # Errors
    /// `PeerUnreachable` if it cannot be reached in `connect_timeout` (or before the
    /// caller's `deadline`, whichever is sooner); `Timeout` if the deadline has passed;
    /// `PeerRestarted`
    /// if another instance answers; `Unauthorized` if the tokens differ; `Protocol`
    /// if it is not a te-tcp target.
    pub(crate) fn open(
        addr: SocketAddr,
        instance: u64,
        config: &TcpConfig,
        tasks: &Arc<Tasks>,
        deadline: Deadline,
    ) -> Result<Arc<Conn>> {
        let label = addr.to_string();
        let limit = config.connect_timeout.min(deadline.left("connect")?);
        let mut s = TcpStream::connect_timeout(&addr, limit)
            .map_err(|e| unreachable(&label, "cannot connect", e))?;
        sock::tune(&s, config).map_err(|e| unreachable(&label, "cannot set options", e))?;
        sock::timeouts(&s, limit).map_err(|e| unreachable(&label, "cannot set timeouts", e))?;
        let terms = handshake(
            &mut s,
            &label,
            instance,
            config.auth_token.as_deref().map(str::as_bytes),
        )?;
        let s = Sock::new(s).map_err(|e| unreachable(&label, "cannot register the socket", e))?;
        let conn = Arc::new_cyclic(|me| Conn {
            sock: s,
            io_timeout: config.io_timeout,
            label,
            tx: Mutex::new(Tx {
                unsent: VecDeque::new(),
                sent: VecDeque::new(),
                carry: Carry::default(),
                busy: false,
                dead: None,
                next_id: 1,
                receiving: None,
                to_stage: VecDeque::new(),
                out_staged: Vec::new(),
            }),
            wake: Notify::new(),
            dead: AtomicBool::new(false),
            inflight: AtomicUsize::new(0),
            progress: AtomicU64::new(0),
            me: me.clone(),
            send_pools: Pools::new(config.slice_size),
            recv_pools: Pools::new(config.slice_size),
            max_payload: terms.max_payload,
        });
        let (c1, c2) = (conn.clone(), conn.clone());
        let started = tasks
            .spawn(c1.receive())
            .and_then(|()| tasks.spawn(c2.send_loop()));
        if let Err(e) = started {
            conn.kill(e.clone());
            return Err(e);
        }
        Ok(conn)
    }

    /// The longest payload the target accepts in one frame, as it announced.
    pub(crate) fn max_payload(&self) -> u64 {
        self.max_payload
    }

    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    fn lock(&self) -> te_core::sync::MutexGuard<'_, Tx> {
        self.tx.lock()
    }

    /// Queues slices and, if the connection is idle and `budget` allows, starts writing
    /// them in this thread without blocking. Returns the bytes written here.
    pub(crate) fn submit(&self, slices: impl Iterator<Item = Slice>, budget: usize) -> usize {
        let mut tx = self.lock();
        if let Some(e) = tx.dead.clone() {
            drop(tx);
            for s in slices {
                s.batch.finish_slice(Err(e.clone()));
            }
            return 0;
        }
        let before = tx.next_id;
        for mut s in slices {
            s.id = tx.next_id;
            tx.next_id += 1;
            if let (Some(slot), Some(dev)) = (&s.stage, &s.device) {
                let t = ToStage {
                    slot: slot.clone(),
                    dev: dev.clone(),
                    pieces: s.pieces(),
                    batch: s.batch.clone(),
                };
                tx.to_stage.push_back(t);
            }
            tx.unsent.push_back(s);
        }
        self.inflight
            .fetch_add((tx.next_id - before) as usize, Ordering::Relaxed);
        if tx.busy {
            return 0;
        }
        tx.busy = true;
        drop(tx);
        if budget == 0 {
            self.hand_off();
            return 0;
        }
        self.pump(Some(budget)).0
    }

    /// Gives up writing; the sender task takes over whatever is left.
    fn hand_off(&self) {
        let mut tx = self.lock();
        tx.busy = false;
        let dead = tx.dead.is_some();
        let left = if dead { tx.drain() } else { Vec::new() };
        drop(tx);
        self.wake.notify_one();
        self.fail(left, self.dead_error());
    }

    fn dead_error(&self) -> Error {
        self.lock().dead.clone().unwrap_or_else(|| {
            Error::new(
                ErrorKind::PeerUnreachable,
                format!("data connection to {} is closed", self.label),
            )
        })
    }

    /// Writes queued frames, never waiting, while the caller holds `busy`: until none
    /// are left, the socket is full, the next frame's staging copy is not done, or (a
    /// submitting thread's `budget`) enough bytes are out. Returns the bytes written
    /// and how it stopped: `Idle` gave `busy` up (a submitting thread also gives it up
    /// when the socket is full or the next frame not staged, handing the rest to the
    /// sender task); the sender task keeps it on `Full` and `Waiting`.
    fn pump(&self, budget: Option<usize>) -> (usize, Pumped) {
        let blocking = budget.is_none();
        let budget = budget.unwrap_or(usize::MAX);
        let mut written = 0usize;
        let mut expired = Vec::new();
        let mut failed = Vec::new();
        loop {
            let copies = self.stage_next();
            self.start_copies(copies);
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
                        let Some(s) = tx.unsent.pop_front() else {
                            break;
                        };
                        if s.batch.stopped() {
                            expired.push(s);
                            continue;
                        }
                        s.push_frame(&mut c, payload);
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
            let sent = sock::send(self.sock.fd(), &v[..n], true);
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
            });
        }
        copies
    }

    /// Starts device → host copies, one group per slice; each group's completion makes
    /// its slice ready (or failed) and wakes the writer.
    fn start_copies(&self, copies: Vec<Staging>) {
        for c in copies {
            let me = self.me.clone();
            let Staging {
                copies,
                rt,
                buf,
                slot,
                pins,
            } = c;
            let done = move |r: Result<()>| {
                drop(pins);
                if let Some(slot) = slot {
                    *slot.lock() = match r {
                        Ok(()) => Stage::Ready(buf),
                        Err(e) => Stage::Failed(e),
                    };
                }
                if let Some(conn) = me.upgrade() {
                    conn.wake.notify_one();
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
    async fn send_loop(self: Arc<Self>) {
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

    /// Ends `batch`'s use of this connection after its deadline. Its slices not yet
    /// written are dropped from the queue. If one is written and unanswered, or its
    /// answer is being received, the connection is closed once it has stalled, so that
    /// no late byte lands in the caller's memory (every slice on it fails; the engine
    /// reconnects on next use): `seen` is the progress count at the previous look,
    /// `None` at the first. Returns the count to look again with later, or `None` when
    /// the connection no longer holds the batch.
    pub(crate) fn cut(&self, batch: &Arc<Batch>, seen: Option<u64>) -> Option<u64> {
        let mut tx = self.lock();
        if tx.dead.is_some() {
            return None;
        }
        let mine = |s: &Slice| Arc::ptr_eq(&s.batch, batch);
        // A slice whose device copy runs stays: the writer drops it once the copy ends.
        let copying = |s: &Slice| {
            s.stage
                .as_ref()
                .is_some_and(|st| matches!(*st.lock(), Stage::Copying))
        };
        let (gone, kept): (VecDeque<Slice>, VecDeque<Slice>) = std::mem::take(&mut tx.unsent)
            .into_iter()
            .partition(|s| mine(s) && !copying(s));
        tx.unsent = kept;
        let on_wire = tx.sent.iter().any(mine)
            || tx.receiving.as_ref().is_some_and(|b| Arc::ptr_eq(b, batch));
        drop(tx);
        self.fail(gone.into_iter().collect(), timeout_error());
        if !on_wire {
            return None;
        }
        let now = self.progress.load(Ordering::Acquire);
        if seen != Some(now) {
            // Answers are still moving: the batch's own arrive soon, and are dropped.
            return Some(now);
        }
        tracing::warn!(peer = %self.label, "a batch's deadline passed and its connection stalled; closing the data connection that carries it");
        self.kill(Error::new(
            ErrorKind::PeerUnreachable,
            format!(
                "data connection to {} was closed: it stalled with a batch past its deadline on it; connect again",
                self.label
            ),
        ));
        None
    }

    /// Marks the connection dead and shuts the socket, waking both threads; the slices
    /// on it fail with `e` as soon as no writer holds them.
    pub(crate) fn kill(&self, e: Error) {
        let left = {
            let mut tx = self.lock();
            if tx.dead.is_none() {
                tx.dead = Some(e.clone());
            }
            self.dead.store(true, Ordering::Release);
            if tx.busy {
                Vec::new()
            } else {
                tx.drain()
            }
        };
        self.sock.shutdown();
        self.wake.notify_one();
        let e = self.dead_error();
        self.fail(left, e);
    }

    /// The receiver task: matches each response to the oldest written slice.
    async fn receive(self: Arc<Self>) {
        let mut inb = Inbound::new(self.sock.clone(), self.io_timeout);
        let e = loop {
            match self.receive_one(&mut inb).await {
                Ok(()) => {}
                Err(e) => break e,
            }
        };
        if !self.is_dead() && e.kind() == ErrorKind::Protocol {
            tracing::warn!(peer = %self.label, error = %e, "closing a data connection");
        }
        self.kill(e);
    }

    async fn receive_one(&self, inb: &mut Inbound) -> Result<()> {
        let mut on_timeout = |_mid: bool| self.lock().sent.is_empty();
        inb.fill(HEADER_LEN, &mut on_timeout)
            .await
            .map_err(|e| unreachable(&self.label, "receive failed", e))?;
        let h = Header::decode(&inb.buffered()[..HEADER_LEN]).map_err(|e| self.protocol(e))?;
        inb.consume(HEADER_LEN);
        self.progress.fetch_add(1, Ordering::Release);
        let slice = {
            let mut tx = self.lock();
            let Some(slice) = tx.sent.pop_front() else {
                return Err(self.protocol(format!("a {:?} answering no request", h.kind)));
            };
            tx.receiving = Some(slice.batch.clone());
            slice
        };
        let result = self.answer(inb, &h, &slice).await;
        self.lock().receiving = None;
        self.progress.fetch_add(1, Ordering::Release);
        let fatal = match &result {
            Err(e) if matches!(e.kind(), ErrorKind::PeerUnreachable | ErrorKind::Protocol) => {
                Some(e.clone())
            }
            _ => None,
        };
        self.inflight.fetch_sub(1, Ordering::Relaxed);
        match result {
            // A host → device copy finishes the slice when it completes.
            Ok(Answer::Copying) => {}
            Ok(Answer::Done) => slice.batch.finish_slice(Ok(())),
            Err(e) => slice.batch.finish_slice(Err(e)),
        }
        if slice.stage.is_some() {
            // Its staging buffer goes back to the pool: wake a writer waiting for one.
            drop(slice);
            self.wake.notify_one();
        }
        match fatal {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Handles the response `h` to `slice`; an error here fails the slice.
    async fn answer(&self, inb: &mut Inbound, h: &Header, slice: &Slice) -> Result<Answer> {
        if h.id != slice.id {
            return Err(self.protocol(format!(
                "response {} while request {} was next",
                h.id, slice.id
            )));
        }
        let mut on_timeout = |_mid: bool| false;
        match (h.kind, slice.op) {
            (Kind::WriteAck, Op::Write) => Ok(Answer::Done),
            (Kind::ReadData, Op::Read) if h.len == slice.len && slice.batch.stopped() => {
                // Late data for a batch handed back to its caller: it must not land.
                inb.discard(slice.len, &mut on_timeout)
                    .await
                    .map_err(|e| unreachable(&self.label, "receive failed", e))?;
                Err(timeout_error())
            }
            (Kind::ReadData, Op::Read) if h.len == slice.len && slice.device.is_some() => {
                self.receive_staged(inb, slice).await
            }
            (Kind::ReadData, Op::Read) if h.len == slice.len && !slice.parts.is_empty() => {
                // Each part's destination is registered host memory pinned by the
                // slice's batch; the slice is out of `sent`, so only this thread
                // touches it.
                let dst = slice.parts.iter().map(|p| (p.local, p.len as usize));
                inb.read_scattered(dst, &mut on_timeout)
                    .await
                    .map_err(|e| unreachable(&self.label, "receive failed", e))?;
                Ok(Answer::Done)
            }
            (Kind::ReadData, Op::Read) if h.len == slice.len => {
                // The destination is registered memory pinned by the slice's batch; the
                // slice is out of `sent`, so only this thread touches it.
                inb.read_into(slice.local, slice.len as usize, &mut on_timeout)
                    .await
                    .map_err(|e| unreachable(&self.label, "receive failed", e))?;
                Ok(Answer::Done)
            }
            (Kind::Error, _) => {
                let len = h.len.min(MAX_MESSAGE) as usize;
                inb.fill(len, &mut on_timeout)
                    .await
                    .map_err(|e| unreachable(&self.label, "receive failed", e))?;
                let msg = String::from_utf8_lossy(&inb.buffered()[..len]).into_owned();
                inb.consume(len);
                Err(Error::new(
                    ErrorKind::from_code(h.code),
                    format!("the target refused the request: {msg}"),
                )
                .with_context("peer", &self.label))
            }
            _ => Err(self.protocol(format!(
                "a {:?} of {} bytes answering a {} of {} bytes",
                h.kind, h.len, slice.op, slice.len
            ))),
        }
    }

    /// Receives a device READ's data into a staging buffer and starts its copies to the
    /// device (one per run of adjacent parts, from successive parts of the buffer) as
    /// one group; the group's completion finishes the slice. The next response is
    /// received while the copies run.
    async fn receive_staged(&self, inb: &mut Inbound, slice: &Slice) -> Result<Answer> {
        let Some((rt, ordinal)) = &slice.device else {
            return Err(self.protocol("a staged read without a device"));
        };
        let pool = self.recv_pools.get(rt)?;
        // Waits only for this direction's own copies to finish.
        let len = slice.len as usize;
        let buf = pool.take(len).await?;
        let mut on_timeout = |_mid: bool| false;
        // The range is ours and holds `len` bytes.
        inb.read_into(buf.ptr() as usize, len, &mut on_timeout)
            .await
            .map_err(|e| unreachable(&self.label, "receive failed", e))?;
        let pieces = slice.pieces().into_iter().map(|(d, l)| (d as u64, l));
        let copies = stage::packed(pieces, buf.ptr())
            .into_iter()
            .map(|(device, host, len)| DeviceCopy::ToDevice {
                ordinal: *ordinal,
                device,
                host,
                len,
            })
            .collect();
        let batch = slice.batch.clone();
        let done = move |r: Result<()>| {
            drop(buf);
            batch.finish_slice(r);
        };
        // SAFETY: the device ranges lie in a region the batch pins until this slice
        // finishes, which `done` does after the copies; the buffer is owned by `done`
        // and its first `len` bytes, the parts' total, were just received.
        unsafe { stage::start_all(rt, copies, done) };
        Ok(Answer::Copying)
    }

    /// Fails slices that were queued on this connection, each with its own error.
    fn fail_each(&self, slices: Vec<(Slice, Error)>) {
        self.inflight.fetch_sub(slices.len(), Ordering::Relaxed);
        for (s, e) in slices {
            s.batch.finish_slice(Err(e));
        }
    }

    /// Fails slices that were queued on this connection.
    fn fail(&self, slices: Vec<Slice>, e: Error) {
        self.inflight.fetch_sub(slices.len(), Ordering::Relaxed);
        for s in slices {
            s.batch.finish_slice(Err(e.clone()));
        }
    }

    /// Slices queued on this connection and not yet answered.
    pub(crate) fn load(&self) -> usize {
        self.inflight.load(Ordering::Relaxed)
    }

    fn protocol(&self, what: impl std::fmt::Display) -> Error {
        Error::new(
            ErrorKind::Protocol,
            format!(
                "{} broke the te-tcp protocol ({what}); the connection was closed",
                self.label
            ),
        )
    }
}

/// How [`Conn::pump`] stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pumped {
    /// Nothing left to write now; the writer gave `busy` up.
    Idle,
    /// The socket is full; the sender task keeps `busy` and waits for room.
    Full,
    /// The next frame waits for its staging copy; the sender task keeps `busy` and
    /// waits for the copy's wake.
    Waiting,
}

/// How a response ended its slice.
enum Answer {
    /// The slice is done.
    Done,
    /// A copy to the device finishes it.
    Copying,
}

/// The device → host copies about to start for a WRITE slice.
struct Staging {
    copies: Vec<DeviceCopy>,
    rt: Arc<dyn te_core::device::DeviceRuntime>,
    buf: StageBuf,
    slot: Option<Arc<Mutex<Stage>>>,
    pins: Arc<Vec<Pin>>,
}

pub(crate) fn timeout_error() -> Error {
    Error::new(
        ErrorKind::Timeout,
        "the batch was aborted (its deadline, a cancel or a deregistration) before this slice was done",
    )
}
