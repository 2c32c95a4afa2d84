//! The initiator's side of one data connection: its handshake, the queue of slices, and
//! how a deadline or a failure ends what is on it. Who writes the slices is in `send`;
//! the receiver task that matches responses to slices and completes batches is in
//! `receive`.
//!
//! Failure: whoever sees the connection break marks it dead and shuts the socket down;
//! every slice on it then fails, exactly once, by whichever of the writer and the
//! receiver leaves last, so no slice is failed (and its memory released) while a
//! task still reads or writes that memory. A device WRITE slice whose staging copy
//! still reads the caller's memory fails when that copy ends.

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;
use te_core::sync::Mutex;
use tokio::sync::Notify;

use te_core::{Deadline, Error, ErrorKind, Result};

use crate::completion::Batch;
use crate::config::TcpConfig;
use crate::errors::{timeout_error, unreachable};
use crate::handshake::handshake;
use crate::initiator::carry::Carry;
use crate::initiator::slice::{Slice, Stage};
use crate::runtime::Tasks;
use crate::sock;
use crate::sock::Sock;
use crate::stage::{Dev, Pools, Usage};

mod receive;
mod send;

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
    /// Bytes of frames queued to be written since the connection opened.
    queued: u64,
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
    /// Everything still on the connection, once it is dead and nobody writes, but the
    /// slices whose staging copy runs: they stay in `unsent` until the copy ends
    /// ([`Conn::copy_ended`]).
    fn drain(&mut self) -> Vec<Slice> {
        self.carry.clear();
        self.to_stage.clear();
        self.out_staged.clear();
        let (copying, left): (VecDeque<Slice>, VecDeque<Slice>) = std::mem::take(&mut self.unsent)
            .into_iter()
            .partition(Slice::is_copying);
        self.unsent = copying;
        self.sent.drain(..).chain(left).collect()
    }

    /// What [`Tx::drain`] gives once the connection is dead and no writer holds it;
    /// nothing otherwise (a writer drains when it sees the connection dead).
    fn drain_if_idle(&mut self) -> Vec<Slice> {
        if self.dead.is_some() && !self.busy {
            self.drain()
        } else {
            Vec::new()
        }
    }
}

/// Runs the initiator's handshake on `s`, ended at `until` whatever the target does:
/// the handshake's reads and writes each wait at most the socket's timeouts, so a
/// target that trickles its answers a byte at a time would stretch it far past that,
/// and a watchdog on te-tcp's I/O threads shuts the socket down at `until`.
///
/// # Errors
/// `None` when the time ran out, else the handshake's own error.
fn handshake_by(
    s: &mut TcpStream,
    label: &str,
    instance: u64,
    token: Option<&[u8]>,
    until: std::time::Instant,
) -> std::result::Result<(crate::wire::Terms, [u8; crate::wire::NONCE_LEN]), Option<Error>> {
    // 0: the handshake runs; 1: it returned first; 2: the watchdog fired first.
    const RUNS: u8 = 0;
    const RETURNED: u8 = 1;
    const FIRED: u8 = 2;
    let state = Arc::new(AtomicU8::new(RUNS));
    let rt = crate::runtime::runtime().map_err(Some)?;
    let watch = s
        .try_clone()
        .map_err(|e| Some(unreachable(label, "cannot watch the handshake", e)))?;
    let fired = state.clone();
    let watchdog = rt.spawn(async move {
        tokio::time::sleep_until(tokio::time::Instant::from_std(until)).await;
        if fired
            .compare_exchange(RUNS, FIRED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            // Wakes the handshake's read or write with an error.
            let _ = watch.shutdown(std::net::Shutdown::Both);
        }
    });
    let r = handshake(s, label, instance, token);
    let late = state
        .compare_exchange(RUNS, RETURNED, Ordering::AcqRel, Ordering::Acquire)
        .is_err();
    // Drops its copy of the socket; the handshake's own stays open.
    watchdog.abort();
    // A handshake that failed at `until` failed for lack of time (a read's own
    // timeout may have ended it just before the watchdog ran).
    if late || (r.is_err() && std::time::Instant::now() >= until) {
        return Err(None);
    }
    r.map_err(Some)
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
    /// Bytes the socket has taken since the connection opened; held by the writer
    /// across each `sendmsg`, so that a reader waits for a send in progress.
    written: Mutex<u64>,
    /// Counts answers received, sends that moved bytes and staging copies that ended:
    /// unchanged between two looks means the connection stalled.
    progress: AtomicU64,
    /// Staging copies of this connection's frames started and not yet ended.
    copying: AtomicUsize,
    /// This connection, for device copies' completions.
    me: Weak<Conn>,
    /// Pinned buffers for device WRITEs (device → host → socket).
    send_pools: Pools,
    /// Pinned buffers for device READs (socket → host → device).
    recv_pools: Pools,
    /// The longest payload the target accepts in one frame (from its terms).
    max_payload: u64,
    /// The target's challenge nonce from the handshake, which opens its same-host
    /// channel (`samehost`).
    challenge: [u8; crate::wire::NONCE_LEN],
    challenge_taken: AtomicBool,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("peer", &self.label)
            .field("dead", &self.is_dead())
            .finish()
    }
}

impl Conn {
    /// Opens, tunes and authenticates a data connection to `addr`, which must be the
    /// target instance `instance`, and starts its sender and receiver tasks.
    ///
    /// # Errors
    /// `PeerUnreachable` if it cannot be reached and authenticated in `connect_timeout`;
    /// `Timeout` if that takes past the caller's `deadline` (the sooner of the two ends
    /// connecting and the handshake together, however the target trickles its answers);
    /// `PeerRestarted`
    /// if another instance answers; `Unauthorized` if the tokens differ; `Protocol`
    /// if it is not a te-tcp target.
    pub(crate) fn open(
        addr: SocketAddr,
        instance: u64,
        config: &TcpConfig,
        tasks: &Arc<Tasks>,
        staging: &Arc<Usage>,
        deadline: Deadline,
    ) -> Result<Arc<Conn>> {
        let label = addr.to_string();
        let left = deadline.left("connect")?;
        let limit = config.connect_timeout.min(left);
        // Connecting and the handshake together end by `until`.
        let until = std::time::Instant::now() + limit;
        let mut s = TcpStream::connect_timeout(&addr, limit)
            .map_err(|e| unreachable(&label, "cannot connect", e))?;
        sock::tune(&s, config).map_err(|e| unreachable(&label, "cannot set options", e))?;
        sock::timeouts(&s, limit).map_err(|e| unreachable(&label, "cannot set timeouts", e))?;
        let token = config.auth_token.as_deref().map(str::as_bytes);
        let (terms, challenge) = handshake_by(&mut s, &label, instance, token, until)
            .map_err(|e| match e {
                // The time ran out: the caller's deadline, or `connect_timeout`.
                None if left <= config.connect_timeout => Error::new(
                    ErrorKind::Timeout,
                    format!("data connection to {label}: the handshake did not finish before the deadline; raise the timeout or check the peer"),
                )
                .with_operation("connect"),
                None => Error::new(
                    ErrorKind::PeerUnreachable,
                    format!(
                        "data connection to {label}: the handshake did not finish within connect_timeout ({:?})",
                        config.connect_timeout
                    ),
                ),
                Some(e) => e,
            })?;
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
                queued: 0,
            }),
            wake: Notify::new(),
            dead: AtomicBool::new(false),
            inflight: AtomicUsize::new(0),
            written: Mutex::new(0),
            progress: AtomicU64::new(0),
            copying: AtomicUsize::new(0),
            me: me.clone(),
            send_pools: Pools::new(config.slice_size, staging),
            recv_pools: Pools::new(config.slice_size, staging),
            max_payload: terms.max_payload,
            challenge,
            challenge_taken: AtomicBool::new(false),
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

    /// The target's challenge nonce from this connection's handshake, once: the
    /// target accepts each on one same-host channel only.
    pub(crate) fn take_challenge(&self) -> Option<[u8; crate::wire::NONCE_LEN]> {
        (!self.challenge_taken.swap(true, Ordering::AcqRel)).then_some(self.challenge)
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

    fn dead_error(&self) -> Error {
        self.lock().dead.clone().unwrap_or_else(|| {
            Error::new(
                ErrorKind::PeerUnreachable,
                format!("data connection to {} is closed", self.label),
            )
        })
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
        let (gone, kept): (VecDeque<Slice>, VecDeque<Slice>) = std::mem::take(&mut tx.unsent)
            .into_iter()
            .partition(|s| mine(s) && !s.is_copying());
        tx.unsent = kept;
        let on_wire = tx.sent.iter().any(mine)
            || tx.receiving.as_ref().is_some_and(|b| Arc::ptr_eq(b, batch));
        drop(tx);
        self.fail(gone.into_iter().collect(), timeout_error());
        if !on_wire {
            return None;
        }
        let now = self.progress.load(Ordering::Acquire);
        if seen != Some(now) || self.copying.load(Ordering::Acquire) > 0 {
            // Answers are still moving, or wait for staging copies that run (a slow
            // device, not a stalled peer): the batch's own arrive soon, and are dropped.
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
            tx.drain_if_idle()
        };
        self.sock.shutdown();
        self.wake.notify_one();
        let e = self.dead_error();
        self.fail(left, e);
    }

    /// A device WRITE slice's staging copy has ended: wakes the writer, which sends
    /// its frame. On a dead connection that nobody writes on any more, the slices
    /// whose copy has ended fail here.
    fn copy_ended(&self) {
        self.copy_done();
        let left = self.lock().drain_if_idle();
        self.wake.notify_one();
        if !left.is_empty() {
            self.fail(left, self.dead_error());
        }
    }

    /// Counts a staging copy of this connection's frames in ([`Conn::copy_done`] counts
    /// it out): while one runs, the connection is not stalled, however slow the device.
    fn copy_started(&self) {
        self.copying.fetch_add(1, Ordering::AcqRel);
    }

    /// A staging copy ended: progress, as an answer or a send is.
    fn copy_done(&self) {
        self.progress.fetch_add(1, Ordering::Release);
        self.copying.fetch_sub(1, Ordering::AcqRel);
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
