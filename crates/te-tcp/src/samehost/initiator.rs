//! The initiator's side of a same-host channel: opening it, sharing allocations, and
//! sending a batch's requests and receiving their answers.

use super::*;
use te_core::kit::thread::SpawnMasked as _;

/// A request on the channel, waiting for its answer: the batch of each frame it carries.
type Waiting = Vec<Arc<Batch>>;

/// What waits to be written on a channel ([`Link::post`]).
#[derive(Default)]
struct Outbox {
    queue: VecDeque<Out>,
    /// The writing thread writes a message it took from the queue.
    writing: bool,
    /// The channel stopped: nothing more is written.
    stopped: bool,
}

/// A message for the target: its bytes, how many went out, and the allocation whose
/// descriptor goes with its first byte (a share of a runtime whose handles are
/// descriptors).
struct Out {
    bytes: Vec<u8>,
    sent: usize,
    fd: Option<Arc<te_core::device::IpcExport>>,
}

struct ChannelState {
    next_id: u64,
    waiting: HashMap<u64, Waiting>,
    /// Keys of the allocations shared on this channel.
    sent: std::collections::HashSet<u64>,
    /// Per key shared: whether the target could map it (`None` until it has said).
    acks: HashMap<u64, Option<std::result::Result<(), Error>>>,
    /// Keys unshared while the target's answer to their share was still due: that
    /// answer is still read (and dropped), not taken for an answer to no share.
    unshared_due: HashSet<u64>,
    /// Keys unshared whose answer (`UNSHARED`: the target let go of its mapping) is due;
    /// on a stopped channel, whose mapping the target holds until it has ended.
    unsharing: HashSet<u64>,
    dead: Option<Error>,
    /// Someone reads the socket now: the receiving thread, or a caller driving it.
    reading: bool,
    /// Callers driving the channel ([`Link::drive`]): reading it, or waiting to.
    drivers: usize,
    /// The owner let go of the channel: its receiving thread ends.
    closed: bool,
    /// The channel was stopped (`dead` or `closed`) while the target copied one of its
    /// requests: what waits on it is handed back only once that copy has ended, so the
    /// channel is read on until then ([`Link::settle`]).
    draining: bool,
    /// The target sent what breaks the protocol: the rest of the socket is no longer
    /// read as answers. Set by the reader that found it, before it lets go.
    broken: bool,
}

impl ChannelState {
    /// Whether an answer is due: a request or a share not yet answered.
    fn expecting(&self) -> bool {
        !self.waiting.is_empty()
            || !self.unshared_due.is_empty()
            || !self.unsharing.is_empty()
            || self.acks.values().any(Option::is_none)
    }

    /// Whether batch `batch` waits for an answer here.
    fn holds(&self, batch: BatchId) -> bool {
        self.waiting.values().flatten().any(|b| b.id() == batch)
    }

    /// Whether nothing more will be read from the channel.
    fn ended(&self) -> bool {
        (self.closed || self.dead.is_some()) && !self.draining
    }
}

/// The allocations exported from one local region: each one's key and export.
type Exported = Vec<(u64, Arc<te_core::device::IpcExport>)>;

/// What an initiator exported to one peer, for all of its channels: each allocation
/// once, under one key, sent on every channel that uses it.
pub(crate) struct Exports {
    /// Names this initiator to the target, with its pid, so that keys of two backends
    /// of one process never meet.
    id: u64,
    next_key: u64,
    /// (runtime, local region) → the allocations exported from it: key and export
    /// (whose base and length say which addresses it covers, so a batch finds its key
    /// without asking the runtime).
    by: HashMap<(String, RegionId), Exported>,
    /// Local regions whose memory the runtime would not export (memory-pool memory,
    /// a runtime that shares nothing): their frames take the socket without asking
    /// again. Other regions of the same runtime are still tried.
    unshareable: HashSet<(String, RegionId)>,
}

impl Exports {
    /// Forgets what was exported of local region `region`; returns its keys.
    pub(crate) fn forget(&mut self, region: RegionId) -> Vec<u64> {
        let mut keys = Vec::new();
        self.unshareable.retain(|(_, r)| *r != region);
        self.by.retain(|(_, r), exported| {
            let gone = *r == region;
            if gone {
                keys.extend(exported.iter().map(|(k, _)| *k));
            }
            !gone
        });
        keys
    }
}

impl std::fmt::Debug for Exports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exports")
            .field("regions", &self.by.len())
            .finish()
    }
}

impl Default for Exports {
    fn default() -> Self {
        Exports {
            id: rand::random(),
            next_key: 1,
            by: HashMap::new(),
            unshareable: HashSet::new(),
        }
    }
}

/// An initiator's channel to one same-host target, as its owner holds it: dropping it
/// closes the channel (and ends its receiving thread).
pub(crate) struct Channel(Arc<Link>);

impl std::ops::Deref for Channel {
    type Target = Link;
    fn deref(&self) -> &Link {
        &self.0
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        self.0.close();
    }
}

impl Channel {
    /// The channel's state for a caller driving it: it keeps the channel's memory, not
    /// the channel open, so the owner's drop (a disconnect) still frees that caller.
    pub(crate) fn link(&self) -> Arc<Link> {
        self.0.clone()
    }
}

/// A channel's socket and state, shared by its owner, its receiving thread and the
/// callers driving it.
///
/// **Who reads.** By default the receiving thread reads every answer, blocked on the
/// socket, and completes its batches (which wakes their waiting callers). With
/// `caller_reads`, one thread at a time reads the socket (`reading`): a caller waiting
/// for a batch with a request here reads the answers itself ([`Link::drive`]), so the
/// kernel wakes it when its answer comes, where otherwise the receiving thread would
/// wake first and then wake it; the receiving thread reads what comes while no caller
/// drives the channel (batches nobody waits for on a thread: awaited, polled, given a
/// callback), and sleeps in an edge-triggered epoll set (`bell`), so each arrival wakes
/// it once, whoever reads the bytes; a driver that leaves with an answer still due
/// rings it.
pub(crate) struct Link {
    stream: UnixStream,
    /// Messages for the target, in order (shares, requests, unshares): a caller
    /// sends its message itself while the socket takes it without waiting, and leaves
    /// what it does not take here for the channel's writing thread, so no caller
    /// waits for a target that stopped reading — the deadline watcher can then stop
    /// the channel under a batch whose request is still queued.
    outbox: Mutex<Outbox>,
    /// Signalled for the writing thread: messages queued, or the channel stopped.
    posted: Condvar,
    state: Mutex<ChannelState>,
    /// Signalled, for drivers waiting to read, when a reader let go, an answer was
    /// dispatched while several callers drive, a driver left, the channel died or
    /// closed.
    turn: Condvar,
    /// Signalled when the target answers an unshare, and when the channel stops.
    unshared: Condvar,
    /// Where the receiving thread sleeps, with `caller_reads`; `None`: it reads every
    /// answer, blocked on the socket, and no caller drives.
    bell: Option<Bell>,
    exports: Arc<Mutex<Exports>>,
    /// The page this channel shares with the target: the initiator sets
    /// [`CLOSED`] when it stops the channel, the target [`BUSY`] while it copies.
    fence: local::SharedPage,
    /// The target can copy host memory with this process (cross-memory attach).
    pub(crate) cma: bool,
    dead: AtomicBool,
    /// Answers received: unchanged between two looks means the channel stalled.
    progress: std::sync::atomic::AtomicU64,
    /// The bytes of an answer read in part by a driver whose deadline came first: the
    /// next reader goes on from them. Touched only by the thread holding `reading`.
    incoming: Mutex<Vec<u8>>,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link").field("cma", &self.cma).finish()
    }
}

/// One frame bound for a channel: its ranges and its batch.
pub(crate) struct Frame {
    pub(crate) op: Op,
    pub(crate) ranges: Vec<Range>,
    pub(crate) batch: Arc<Batch>,
}

impl Channel {
    /// Opens a channel to target instance `instance` of this host, presenting `nonce`
    /// (its challenge from one of our data connections' handshakes).
    ///
    /// # Errors
    /// `PeerUnreachable` where no process of this host listens for that instance (the
    /// peer is elsewhere), or it refuses the nonce.
    /// With `caller_reads`, callers waiting for their batches read their answers.
    pub(crate) fn open(
        instance: u64,
        nonce: [u8; NONCE_LEN],
        timeout: Duration,
        exports: &Arc<Mutex<Exports>>,
        caller_reads: bool,
    ) -> Result<Arc<Channel>> {
        let s = local::connect(&socket_name(instance), timeout)
            .map_err(|e| io_error("no same-host listener for the peer", e))?;
        let fence = local::SharedPage::new().map_err(|e| io_error("no shared page", e))?;
        // The target reads this copy of the nonce from our memory to learn whether it
        // can reach it; it lives until the welcome has come.
        let probe = Box::new(nonce);
        let mut hello = [0u8; HELLO_LEN];
        hello[..4].copy_from_slice(&MAGIC);
        hello[4..6].copy_from_slice(&VERSION.to_le_bytes());
        hello[8..16].copy_from_slice(&instance.to_le_bytes());
        hello[16..48].copy_from_slice(&nonce);
        hello[48..56].copy_from_slice(&(probe.as_ptr() as u64).to_le_bytes());
        hello[56..64].copy_from_slice(&exports.lock().id.to_le_bytes());
        local::send_with_fd(&s, &hello, Some(fence.fd()))
            .map_err(|e| io_error("sending the hello", e))?;
        let mut w = [0u8; WELCOME_LEN];
        (&mut &s)
            .read_exact(&mut w)
            .map_err(|e| io_error("reading the welcome", e))?;
        drop(probe);
        if w[..4] != MAGIC || u16::from_le_bytes([w[4], w[5]]) != 0 {
            return Err(Error::new(
                ErrorKind::PeerUnreachable,
                "the same-host peer refused the channel",
            ));
        }
        let cma = u16::from_le_bytes([w[6], w[7]]) & 1 != 0;
        // Nothing waits on the socket with a timeout of its own: the callers wait
        // until their deadlines, and the writing thread until the channel stops.
        s.set_read_timeout(None)
            .and_then(|()| s.set_write_timeout(None))
            .map_err(|e| io_error("cannot set timeouts", e))?;
        Channel::start(s, fence, cma, exports, caller_reads)
    }

    /// The channel over `s`, welcomed, sharing `fence` with the target, with its
    /// receiving thread started.
    pub(crate) fn start(
        s: UnixStream,
        fence: local::SharedPage,
        cma: bool,
        exports: &Arc<Mutex<Exports>>,
        caller_reads: bool,
    ) -> Result<Arc<Channel>> {
        let bell = match caller_reads {
            true => Some(Bell::new(&s).map_err(|e| io_error("cannot watch the channel", e))?),
            false => None,
        };
        let link = Arc::new(Link {
            outbox: Mutex::new(Outbox::default()),
            posted: Condvar::new(),
            stream: s,
            state: Mutex::new(ChannelState {
                next_id: 1,
                waiting: HashMap::new(),
                sent: Default::default(),
                acks: HashMap::new(),
                unshared_due: HashSet::new(),
                unsharing: HashSet::new(),
                dead: None,
                reading: false,
                drivers: 0,
                closed: false,
                draining: false,
                broken: false,
            }),
            turn: Condvar::new(),
            unshared: Condvar::new(),
            bell,
            exports: exports.clone(),
            fence,
            cma,
            dead: AtomicBool::new(false),
            progress: std::sync::atomic::AtomicU64::new(0),
            incoming: Mutex::new(Vec::new()),
        });
        let thread = |name: &str, run: fn(&Link), link: Arc<Link>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn_masked(move || run(&link))
                .map_err(|e| {
                    Error::new(ErrorKind::Io, format!("cannot start a channel thread: {e}"))
                })
        };
        thread("te-tcp-channel-rx", receive, link.clone())?;
        if let Err(e) = thread("te-tcp-channel-tx", write, link.clone()) {
            link.close();
            return Err(e);
        }
        Ok(Arc::new(Channel(link)))
    }
}

impl Link {
    /// Ends the channel for its owner: the receiving thread and any driver stop, once
    /// no copy of the target's can touch what waits here (whose batches then go with
    /// the channel, as `Cancelled`).
    fn close(&self) {
        let copying = self.fence_close();
        let hold = {
            let mut st = self.state.lock();
            st.closed = true;
            st.draining = copying && !st.waiting.is_empty();
            st.draining
        };
        self.stopped(hold);
    }

    /// Tells the target that no request here may start copying any more, and returns
    /// whether it copies one now. Each side writes its word before it reads the
    /// other's, so at least one sees the other's: a target that sees `CLOSED` refuses,
    /// and one that set `BUSY` first is seen copying.
    fn fence_close(&self) -> bool {
        self.fence.word(CLOSED).store(1, Ordering::SeqCst);
        self.fence.word(BUSY).load(Ordering::SeqCst) != 0
    }

    /// After the channel stopped: what reads it is told, and the socket shut — only
    /// our sending side where the channel drains (`hold`), so the target's answer to
    /// the copy it runs, and its end, still come.
    fn stopped(&self, hold: bool) {
        self.outbox.lock().stopped = true;
        self.posted.notify_all();
        self.turn.notify_all();
        self.unshared.notify_all();
        self.ring();
        let how = match hold {
            true => std::net::Shutdown::Write,
            false => std::net::Shutdown::Both,
        };
        let _ = self.stream.shutdown(how);
    }

    /// While the channel drains: once the target no longer copies (it answered the
    /// request it ran, or closed its end, or died), what waits here is handed back —
    /// with the error the channel died of, or dropped with a channel its owner closed.
    fn settle(&self, ended: bool) {
        if !ended && self.fence.word(BUSY).load(Ordering::SeqCst) != 0 {
            return;
        }
        let (waiting, dead) = {
            let mut st = self.state.lock();
            if !st.draining {
                return;
            }
            st.draining = false;
            let w: Vec<Waiting> = st.waiting.drain().map(|(_, w)| w).collect();
            (w, if st.closed { None } else { st.dead.clone() })
        };
        self.stopped(false);
        if let Some(e) = dead {
            for b in waiting.into_iter().flatten() {
                b.finish_slice(Err(e.clone()));
            }
        }
    }

    /// Tells the target that the allocation shared under `key` is gone (its region was
    /// deregistered here, so no request names it any more): the target unmaps it once
    /// none of this peer's channels holds it, and answers ([`Link::unshared`] waits for
    /// that).
    pub(crate) fn unshare(&self, key: u64) {
        let mut st = self.state.lock();
        if let Some(None) = st.acks.remove(&key) {
            // The target answers the share still (a draining channel reads it too).
            st.unshared_due.insert(key);
        }
        if !st.sent.remove(&key) {
            return;
        }
        // Due until answered, or, on a stopped channel, until it has ended.
        st.unsharing.insert(key);
        if st.dead.is_some() {
            return;
        }
        drop(st);
        let msg = Msg {
            kind: UNSHARE,
            code: 0,
            id: key,
            a: 0,
            b: 0,
            c: 0,
        }
        .encode();
        self.post(msg.to_vec(), None);
    }

    /// Waits until the target has let go of the allocations unshared under `keys` (it
    /// answered each unshare), or the channel stopped (a target whose channel ends
    /// unmaps everything of it when it reads the end) and no longer drains (a target
    /// still copying holds every mapping of the channel until it has ended), by
    /// `deadline`. Past it, the channel is failed, so that the target lets go when it
    /// reads that, and the error says the memory may still be mapped there: CUDA leaves
    /// freeing memory another process maps undefined.
    pub(crate) fn unshared(&self, keys: &[u64], deadline: te_core::Deadline) -> Result<()> {
        let mut st = self.state.lock();
        loop {
            let stopped = st.dead.is_some() || st.closed;
            let answered = keys.iter().all(|k| !st.unsharing.contains(k));
            if answered || (stopped && !st.draining) {
                return Ok(());
            }
            let left = deadline.remaining();
            if left.is_zero() {
                drop(st);
                let e = Error::new(
                    ErrorKind::Timeout,
                    "the same-host peer did not confirm by the deadline that it unmapped the \
                     region's device memory (freeing memory another process maps is undefined \
                     in CUDA); the channel to it was closed, so it unmaps it once it reads the \
                     close: free the memory once that peer has disconnected",
                );
                self.fail(e.clone());
                return Err(e);
            }
            st = self.unshared.wait_timeout(st, left).0;
        }
    }

    /// Sends `bytes` (with `fd`'s descriptor on the first byte) after every message
    /// posted before: at once, as far as the socket takes it without waiting, and the
    /// rest by the writing thread. A broken socket fails the channel.
    fn post(&self, bytes: Vec<u8>, fd: Option<Arc<te_core::device::IpcExport>>) {
        if let Err(e) = self.enqueue(bytes, fd) {
            self.fail(e);
        }
    }

    /// As [`Link::post`], but a broken socket is the caller's to fail the channel
    /// with, so the caller may hold the channel's state meanwhile.
    fn enqueue(&self, bytes: Vec<u8>, fd: Option<Arc<te_core::device::IpcExport>>) -> Result<()> {
        let mut out = self.outbox.lock();
        if out.stopped {
            return Ok(());
        }
        let mut sent = 0;
        if !out.writing && out.queue.is_empty() {
            let desc = fd.as_ref().and_then(|x| x.fd.as_ref()).map(|f| f.as_fd());
            match local::send_nowait(&self.stream, &bytes, desc) {
                Ok(n) if n == bytes.len() => return Ok(()),
                Ok(n) => sent = n,
                Err(e) => return Err(io_error("send failed", e)),
            }
        }
        // The descriptor went with the first byte, if any byte went.
        let fd = if sent == 0 { fd } else { None };
        out.queue.push_back(Out { bytes, sent, fd });
        drop(out);
        self.posted.notify_all();
        Ok(())
    }

    /// Requests waiting for their answers on this channel.
    pub(crate) fn waiting(&self) -> usize {
        self.state.lock().waiting.len()
    }

    /// Whether the channel still works.
    pub(crate) fn is_alive(&self) -> bool {
        !self.dead.load(Ordering::Acquire)
    }

    /// The key of the allocation holding `addr` (device memory of `rt` in local region
    /// `region`) once the target has mapped it; `None` (the frame then goes over the
    /// socket) where `rt` cannot export it, the target said it cannot map it, or has not
    /// answered yet. The first call shares it with the target; nothing waits for the
    /// answer, so a target that is slow or stopped never holds up a submission.
    pub(crate) fn key(
        &self,
        rt: &Arc<dyn DeviceRuntime>,
        region: RegionId,
        addr: u64,
    ) -> Option<u64> {
        let (key, export) = {
            let mut ex = self.exports.lock();
            let id = (rt.name().to_string(), region);
            if ex.unshareable.contains(&id) {
                return None;
            }
            let known = ex.by.get(&id).and_then(|v| {
                v.iter()
                    .find(|(_, x)| addr >= x.base && addr - x.base < x.len)
                    .map(|(k, x)| (*k, x.clone()))
            });
            match known {
                Some(found) => found,
                None => {
                    let export = match rt.ipc_export(addr) {
                        Ok(x) => Arc::new(x),
                        Err(e) => {
                            tracing::info!(runtime = rt.name(), %region, error = %e, "device memory cannot be shared with a same-host peer; this region's frames go over the socket");
                            ex.unshareable.insert(id);
                            return None;
                        }
                    };
                    let key = ex.next_key;
                    ex.next_key += 1;
                    ex.by.entry(id).or_default().push((key, export.clone()));
                    (key, export)
                }
            }
        };
        let mut st = self.state.lock();
        if st.dead.is_some() {
            return None;
        }
        if st.sent.insert(key) {
            st.acks.insert(key, None);
            let posted = self.share(rt, key, export);
            drop(st);
            if let Err(e) = posted {
                self.fail(e);
            }
            // Nothing waits for the target's answer: this frame takes the socket.
            return None;
        }
        match st.acks.get(&key) {
            Some(Some(Ok(()))) => Some(key),
            // Its answer is still due (the socket meanwhile), or the target cannot map
            // it ([`Link::refused`]).
            _ => None,
        }
    }

    /// The target could not map the allocation shared under `key` (`e`): the local
    /// region it is in takes the socket from now on, on every channel to the peer. The
    /// export stays known, so the region's deregistration still unshares it on every
    /// channel it was sent on (the target forgets its refusal then).
    fn refused(&self, key: u64, e: &Error) {
        let mut ex = self.exports.lock();
        let id = ex
            .by
            .iter()
            .find(|(_, exported)| exported.iter().any(|(k, _)| *k == key))
            .map(|(id, _)| id.clone());
        if let Some(id) = id {
            tracing::info!(runtime = %id.0, region = %id.1, error = %e, "the same-host peer cannot map this memory; this region's frames go over the socket");
            ex.unshareable.insert(id);
        }
    }

    /// Sends the share of `export` under `key` ([`Link::enqueue`]).
    fn share(
        &self,
        rt: &Arc<dyn DeviceRuntime>,
        key: u64,
        export: Arc<te_core::device::IpcExport>,
    ) -> Result<()> {
        // The runtime's name, then (after a NUL) the device's host-wide name where the
        // runtime has one: the target may number the device otherwise.
        let mut name = rt.name().as_bytes().to_vec();
        if let Some(id) = rt.device_id(export.ordinal) {
            name.push(0);
            name.extend_from_slice(id.as_bytes());
        }
        let mut msg = Msg {
            kind: SHARE,
            code: export.handle.len() as u32,
            id: key,
            a: export.base,
            b: export.len,
            c: (u64::from(export.ordinal) << 32) | name.len() as u64,
        }
        .encode()
        .to_vec();
        msg.extend_from_slice(&export.handle);
        msg.extend_from_slice(&name);
        self.enqueue(msg, Some(export))
    }

    /// Sends `frames` as requests, one op each, at most [`MAX_ENTRIES`] ranges each;
    /// each frame's batch learns the result when its request is answered.
    pub(crate) fn submit(&self, frames: Vec<Frame>) {
        let (writes, reads): (Vec<Frame>, Vec<Frame>) =
            frames.into_iter().partition(|f| f.op == Op::Write);
        self.submit_op(Op::Write, writes);
        self.submit_op(Op::Read, reads);
    }

    fn submit_op(&self, op: Op, frames: Vec<Frame>) {
        let mut at = 0;
        while at < frames.len() {
            let mut n = 0;
            let mut end = at;
            while end < frames.len() && (end == at || n + frames[end].ranges.len() <= MAX_ENTRIES) {
                n += frames[end].ranges.len();
                end += 1;
            }
            self.request(op, &frames[at..end]);
            at = end;
        }
    }

    fn request(&self, op: Op, frames: &[Frame]) {
        let batches: Waiting = frames.iter().map(|f| f.batch.clone()).collect();
        // The channel is the wire: the target copies, and answers when it has. (A
        // batch's frames come together: each batch is noted once.)
        for (i, b) in batches.iter().enumerate() {
            if i == 0 || !Arc::ptr_eq(b, &batches[i - 1]) {
                b.stage_began(BatchStage::Wire);
            }
        }
        let ranges = frames.iter().flat_map(|f| f.ranges.iter());
        let n: usize = frames.iter().map(|f| f.ranges.len()).sum();
        let total: u64 = frames.iter().flat_map(|f| &f.ranges).map(|r| r.len).sum();
        // The earliest deadline of the frames' batches.
        let now = Instant::now();
        let left = frames
            .iter()
            .map(|f| f.batch.deadline().saturating_duration_since(now))
            .min()
            .unwrap_or_default();
        let mut st = self.state.lock();
        if let Some(e) = st.dead.clone() {
            drop(st);
            for b in batches {
                b.finish_slice(Err(e.clone()));
            }
            return;
        }
        let id = st.next_id;
        st.next_id += 1;
        let mut msg = Vec::with_capacity(HEADER_LEN + n * ENTRY_LEN);
        msg.extend_from_slice(
            &Msg {
                kind: if op == Op::Write { WRITE } else { READ },
                code: n as u32,
                id,
                a: monotonic_us().saturating_add(left.as_micros() as u64),
                b: total,
                c: 0,
            }
            .encode(),
        );
        for r in ranges {
            for v in [r.region, r.offset, r.len, r.key, r.addr] {
                msg.extend_from_slice(&v.to_le_bytes());
            }
        }
        st.waiting.insert(id, batches);
        drop(st);
        self.post(msg, None);
    }

    /// At `batch`'s deadline (`seen`: `None` the first time, then what this returned):
    /// `None` once none of its requests waits here; else the progress count to look at
    /// again after a grace. A channel on which nothing was answered since the last look
    /// is closed, failing what waits on it, as a stalled data connection is: the
    /// target refuses what it reads after the deadline, so no copy of ours starts then.
    pub(crate) fn cut(&self, batch: &Arc<Batch>, seen: Option<u64>) -> Option<u64> {
        let waits = {
            let st = self.state.lock();
            st.waiting.values().flatten().any(|b| Arc::ptr_eq(b, batch))
        };
        if !waits {
            return None;
        }
        let now = self.progress.load(Ordering::Acquire);
        if seen == Some(now) {
            self.fail(Error::new(
                ErrorKind::Timeout,
                "the same-host peer answered nothing past the batch's deadline; the channel was closed",
            ));
            return None;
        }
        Some(now)
    }

    /// Marks the channel dead and fails every request waiting on it: at once, or,
    /// where the target copies one of them now, once it has finished (the channel
    /// drains: [`Link::settle`]).
    fn fail(&self, e: Error) {
        self.dead.store(true, Ordering::Release);
        let copying = self.fence_close();
        let (e, waiting, hold) = {
            let mut st = self.state.lock();
            let e = st.dead.get_or_insert(e).clone();
            st.draining = copying && !st.waiting.is_empty();
            let w: Vec<Waiting> = match st.draining {
                true => Vec::new(),
                false => st.waiting.drain().map(|(_, w)| w).collect(),
            };
            (e, w, st.draining)
        };
        self.stopped(hold);
        for b in waiting.into_iter().flatten() {
            b.finish_slice(Err(e.clone()));
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// The receiving thread: reads what comes while no caller drives the channel, until
/// the channel dies or its owner closes it.
fn receive(link: &Link) {
    let Some(bell) = &link.bell else {
        // Every answer is read here, blocked on the socket.
        loop {
            if let Err(e) = link.read_one(None) {
                link.end(e, true);
                return;
            }
        }
    };
    loop {
        loop {
            {
                let mut st = link.state.lock();
                if st.ended() {
                    return;
                }
                if st.broken {
                    // A driver found the target broke the protocol: the rest is
                    // read here, to the target's end.
                    drop(st);
                    link.read_to_end(true);
                    return;
                }
                if st.reading || st.drivers > 0 {
                    // A driver reads; it rings the bell if it leaves an answer due.
                    break;
                }
                match readable(&link.stream, Duration::ZERO) {
                    Ok(true) => st.reading = true,
                    Ok(false) => break,
                    Err(e) => {
                        drop(st);
                        link.end(io_error("waiting for answers", e), true);
                        return;
                    }
                }
            }
            // Drivers that came meanwhile take over.
            if let Err(e) = Reading::with(link, 0, || link.read_one(None)) {
                link.end(e, true);
                return;
            }
        }
        if let Err(e) = bell.wait() {
            link.end(io_error("waiting for answers", e), true);
            return;
        }
    }
}

/// The writing thread: writes what callers left in the outbox, in order, waiting for
/// the socket as long as it takes (the channel stops under it when a batch's deadline
/// passes), until the channel stops.
fn write(link: &Link) {
    let mut out = link.outbox.lock();
    loop {
        if out.stopped {
            return;
        }
        let Some(m) = out.queue.pop_front() else {
            out = link.posted.wait(out);
            continue;
        };
        out.writing = true;
        drop(out);
        let desc = m.fd.as_ref().and_then(|x| x.fd.as_ref()).map(|f| f.as_fd());
        if let Err(e) = local::send_with_fd(&link.stream, &m.bytes[m.sent..], desc) {
            link.fail(io_error("send failed", e));
            return;
        }
        out = link.outbox.lock();
        out.writing = false;
    }
}

impl Link {
    /// With `caller_reads`, reads the channel's answers on the calling thread while
    /// batch `batch` waits for one here, until `until` ([`TransferBackend::drive`](te_core::TransferBackend::drive)):
    /// the waiting caller is woken by its answer itself, not by the receiving thread.
    /// Answers for other batches it reads are dispatched as the receiving thread would.
    /// Returns whether the batch had a request here to wait for (never without
    /// `caller_reads`, nor once the target broke the protocol).
    pub(crate) fn drive(&self, batch: BatchId, until: te_core::Deadline) -> bool {
        if self.bell.is_none() {
            return false;
        }
        let mut st = self.state.lock();
        // A channel whose target broke the protocol has nothing left for a caller to
        // read (the receiving thread reads on to the target's end): the caller waits
        // on its batch, not here, or the engine would call again at once.
        if st.ended() || st.broken || until.is_past() || !st.holds(batch) {
            return false;
        }
        st.drivers += 1;
        drop(st);
        // Leaves however this returns (a panicking completion included), so the
        // channel is never left to a driver that is gone.
        let _driving = Driving(self);
        let mut st = self.state.lock();
        while !st.ended() && !st.broken && st.holds(batch) && !until.is_past() {
            if st.reading {
                // Another thread reads; it hands over when it has dispatched an answer.
                st = self.turn.wait_timeout(st, until.remaining()).0;
                continue;
            }
            st.reading = true;
            drop(st);
            // The answer may have been another driver's: they are told.
            let r = Reading::with(self, 1, || self.read_one(Some(until)));
            if let Err(e) = r {
                self.end(e, false);
                return true;
            }
            st = self.state.lock();
        }
        true
    }

    /// Reading the channel ended with `e` (the target closed its end or died, the read
    /// failed, or the target broke the protocol): the channel fails with `e`, unless it
    /// is stopped already (its owner closed it: its batches then go with it, as
    /// `Cancelled`, whoever was reading), and what waits is handed back once nothing
    /// more will be read: at once where the target closed its end or died (a target
    /// killed inside a copy leaves `BUSY` set, and the end of its socket is the end of
    /// that copy), and, where it broke the protocol, as [`Link::read_to_end`] says.
    /// `receiver`: called on the receiving thread, not by a driver.
    fn end(&self, e: Error, receiver: bool) {
        let broken = e.kind() == ErrorKind::Protocol;
        let stopped = {
            let st = self.state.lock();
            st.closed || st.dead.is_some()
        };
        if !stopped {
            // It may leave the channel draining (`BUSY` set): settled below.
            self.fail(e);
        }
        match broken {
            true => self.read_to_end(receiver),
            false => self.settle(true),
        }
    }

    /// After the target broke the protocol: what waits is handed back at once where
    /// the target does not copy; else only once the socket was read on to its end,
    /// what comes before it discarded (a message that broke the protocol is not the
    /// target's end: it may still be copying, and it ends after its copy). That read
    /// has no deadline, so it is the receiving thread's: a driver (`receiver` false)
    /// rings it and goes back to its caller.
    fn read_to_end(&self, receiver: bool) {
        if self.fence.word(BUSY).load(Ordering::SeqCst) != 0 {
            if !receiver {
                self.ring();
                return;
            }
            let mut skip = [0u8; 4096];
            loop {
                match (&self.stream).read(&mut skip) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        }
        self.settle(true);
    }

    /// Rings the receiving thread's bell, where it has one.
    fn ring(&self) {
        if let Some(b) = &self.bell {
            b.ring();
        }
    }

    /// A driver leaves: whoever reads next is woken, another driver, or the receiving
    /// thread where an answer is still due (its socket's edge may have come and gone
    /// while the driver was there).
    fn leave(&self, mut st: te_core::sync::MutexGuard<'_, ChannelState>) {
        st.drivers -= 1;
        let (others, due) = (st.drivers > 0, st.drivers == 0 && st.expecting());
        drop(st);
        if others {
            self.turn.notify_all();
        }
        if due {
            self.ring();
        }
    }

    /// Shares whose answer the target still owes (for tests).
    #[cfg(test)]
    pub(crate) fn answers_due(&self) -> usize {
        self.state
            .lock()
            .acks
            .values()
            .filter(|a| a.is_none())
            .count()
    }

    /// Callers driving the channel now (for tests).
    #[cfg(test)]
    pub(crate) fn drivers(&self) -> usize {
        self.state.lock().drivers
    }

    /// Counts the calling thread as a driver that reads nothing (for tests: the
    /// receiving thread then leaves the socket alone).
    #[cfg(test)]
    pub(crate) fn enter_idle(&self) {
        self.state.lock().drivers += 1;
    }

    /// Undoes [`Link::enter_idle`], as a driver leaving.
    #[cfg(test)]
    pub(crate) fn leave_idle(&self) {
        self.leave(self.state.lock());
    }

    /// Reads one answer and dispatches it (by the caller holding `reading`); with
    /// `until`, reads no later than that, and leaves an answer that has not come whole
    /// by then to the next reader. A message that breaks the protocol marks the
    /// channel `broken` before the caller lets go of the socket.
    fn read_one(&self, until: Option<te_core::Deadline>) -> Result<()> {
        let r = self.read_answer(until);
        if r.as_ref().is_err_and(|e| e.kind() == ErrorKind::Protocol) {
            self.state.lock().broken = true;
        }
        r
    }

    /// Takes the next whole message off the socket: its header and, for a refusal,
    /// its text; `None` where `until` came first (what was read waits in `incoming`).
    fn next_message(&self, until: Option<te_core::Deadline>) -> Result<Option<(Msg, Vec<u8>)>> {
        let mut buf = self.incoming.lock();
        loop {
            let want = match buf.first_chunk::<HEADER_LEN>() {
                None => HEADER_LEN,
                Some(h) => {
                    let m = Msg::decode(h);
                    let text = match m.kind {
                        DONE | SHARED | UNSHARED if m.code == 0 => 0,
                        FAIL | SHARED if m.b as usize <= MAX_MESSAGE => m.b as usize,
                        _ => return Err(protocol("an answer of an unknown kind")),
                    };
                    if buf.len() == HEADER_LEN + text {
                        let text = buf.split_off(HEADER_LEN);
                        buf.clear();
                        return Ok(Some((m, text)));
                    }
                    HEADER_LEN + text
                }
            };
            if let Some(until) = until {
                let left = until.remaining();
                if left.is_zero()
                    || !readable(&self.stream, left)
                        .map_err(|e| io_error("waiting for an answer", e))?
                {
                    return Ok(None);
                }
            }
            let have = buf.len();
            buf.resize(want, 0);
            match (&self.stream).read(&mut buf[have..]) {
                Ok(0) => {
                    buf.truncate(have);
                    return Err(io_error(
                        "the same-host peer closed the channel",
                        std::io::ErrorKind::UnexpectedEof.into(),
                    ));
                }
                Ok(n) => buf.truncate(have + n),
                Err(e) => {
                    buf.truncate(have);
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(io_error("receive failed", e));
                    }
                }
            }
        }
    }

    /// As [`Link::read_one`], without marking the channel.
    fn read_answer(&self, until: Option<te_core::Deadline>) -> Result<()> {
        let Some((m, text)) = self.next_message(until)? else {
            return Ok(());
        };
        // `next_message` let through only a `DONE` or `SHARED` of code 0, or a refusal.
        let result = match m.kind == FAIL || m.code != 0 {
            true => Err(Error::from_peer(
                ErrorKind::from_code(m.code),
                "the same-host peer refused a request",
                &String::from_utf8_lossy(&text),
            )),
            false => Ok(()),
        };
        self.progress.fetch_add(1, Ordering::AcqRel);
        if m.kind == UNSHARED {
            if !self.state.lock().unsharing.remove(&m.id) {
                return Err(protocol("an answer to no unshare"));
            }
            self.unshared.notify_all();
            return Ok(());
        }
        if m.kind == SHARED {
            // An answer to a share, by its key.
            let mut guard = self.state.lock();
            let st = &mut *guard;
            match st.acks.get_mut(&m.id) {
                Some(answer @ None) => *answer = Some(result.clone()),
                // Its region was deregistered meanwhile: nobody asks any more.
                _ if st.unshared_due.remove(&m.id) => return Ok(()),
                _ => return Err(protocol("an answer to no share")),
            }
            drop(guard);
            if let Err(e) = &result {
                self.refused(m.id, e);
            }
            return Ok(());
        }
        let (waiting, draining) = {
            let mut st = self.state.lock();
            (st.waiting.remove(&m.id), st.draining)
        };
        let Some(batches) = waiting else {
            return Err(protocol("an answer to no request"));
        };
        for (i, b) in batches.iter().enumerate() {
            if batches.get(i + 1).is_none_or(|next| !Arc::ptr_eq(b, next)) {
                b.stage_ended(BatchStage::Wire);
            }
            b.finish_slice(result.clone());
        }
        if draining {
            self.settle(false);
        }
        Ok(())
    }
}

/// A driver's presence on a channel: it leaves when this drops.
struct Driving<'a>(&'a Link);

impl Drop for Driving<'_> {
    fn drop(&mut self) {
        self.0.leave(self.0.state.lock());
    }
}

/// The reading role, taken (`reading` set) by the thread that holds this: let go when
/// it drops, waking the drivers waiting for it where there are more than `others`.
struct Reading<'a> {
    link: &'a Link,
    others: usize,
}

impl Reading<'_> {
    /// Runs `f` holding the role `link`'s caller has just taken.
    fn with<T>(link: &Link, others: usize, f: impl FnOnce() -> T) -> T {
        let _held = Reading { link, others };
        f()
    }
}

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        let mut st = self.link.state.lock();
        st.reading = false;
        let wake = st.drivers > self.others;
        drop(st);
        if wake {
            self.link.turn.notify_all();
        }
    }
}

/// Whether `s` has bytes to read (or has ended), waiting up to `wait` for them.
fn readable(s: &UnixStream, wait: Duration) -> std::io::Result<bool> {
    Ok(poll(s, libc::POLLIN, wait)? != 0)
}

/// Where a channel's receiving thread sleeps: an epoll set holding the channel's
/// socket edge-triggered (each arrival wakes it once, whoever then reads the bytes,
/// so a driver reading its own answer costs the thread one wake-up, not a busy loop)
/// and an eventfd that drivers, `fail` and `close` ring.
struct Bell {
    epoll: OwnedFd,
    event: OwnedFd,
}

impl Bell {
    fn new(s: &UnixStream) -> std::io::Result<Bell> {
        use std::os::fd::{AsRawFd, FromRawFd};
        let check = |fd: i32| {
            if fd < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                // SAFETY: `fd` was just opened by the call that returned it, and is
                // owned by nobody else.
                Ok(unsafe { OwnedFd::from_raw_fd(fd) })
            }
        };
        // SAFETY: plain system calls with constant flags; results checked.
        let epoll = check(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        // SAFETY: as above.
        let event = check(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })?;
        let edge = (libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLET) as u32;
        for (fd, events) in [
            (s.as_raw_fd(), edge),
            (event.as_raw_fd(), libc::EPOLLIN as u32),
        ] {
            let mut ev = libc::epoll_event {
                events,
                u64: fd as u64,
            };
            // SAFETY: both descriptors are open; `ev` is valid for the call.
            let r = unsafe { libc::epoll_ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) };
            if r < 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(Bell { epoll, event })
    }

    /// Wakes the thread sleeping in [`Bell::wait`] (or makes its next wait return).
    fn ring(&self) {
        use std::os::fd::AsRawFd;
        let one = 1u64.to_ne_bytes();
        // SAFETY: eight readable bytes; the eventfd is open. A full counter (never, at
        // one per ring) would only mean it is already rung.
        let _ = unsafe { libc::write(self.event.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    /// Sleeps until the socket has new bytes (or ended) or the bell was rung.
    fn wait(&self) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 2];
        // SAFETY: `evs` holds two events and lives for the call.
        let n = unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), evs.as_mut_ptr(), 2, -1) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            return if e.kind() == std::io::ErrorKind::Interrupted {
                Ok(())
            } else {
                Err(e)
            };
        }
        let mut count = [0u8; 8];
        // SAFETY: eight writable bytes; the eventfd is open and non-blocking, so this
        // resets a rung bell and returns at once otherwise.
        let _ = unsafe { libc::read(self.event.as_raw_fd(), count.as_mut_ptr().cast(), 8) };
        Ok(())
    }
}
