//! The initiator's side of a same-host channel: opening it, sharing allocations, and
//! sending a batch's requests and receiving their answers.

use super::*;

/// A request on the channel, waiting for its answer: the batch of each frame it carries.
type Waiting = Vec<Arc<Batch>>;

struct ChannelState {
    next_id: u64,
    waiting: HashMap<u64, Waiting>,
    /// Keys of the allocations shared on this channel.
    sent: std::collections::HashSet<u64>,
    /// Per key shared: whether the target could map it (`None` until it has said).
    acks: HashMap<u64, Option<std::result::Result<(), Error>>>,
    dead: Option<Error>,
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

/// An initiator's channel to one same-host target.
pub(crate) struct Channel {
    stream: UnixStream,
    /// Held while a message is written, so shares, requests and unshares go out in
    /// order; taken before `state` and never under it, so a write that blocks on a
    /// peer that stopped reading never holds up the thread receiving answers.
    send: Mutex<()>,
    state: Mutex<ChannelState>,
    /// Signalled when the target answers a share, and when the channel dies.
    acked: Condvar,
    exports: Arc<Mutex<Exports>>,
    /// The target can copy host memory with this process (cross-memory attach).
    pub(crate) cma: bool,
    dead: AtomicBool,
    /// Answers received: unchanged between two looks means the channel stalled.
    progress: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel").field("cma", &self.cma).finish()
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
    pub(crate) fn open(
        instance: u64,
        nonce: [u8; NONCE_LEN],
        timeout: Duration,
        exports: &Arc<Mutex<Exports>>,
    ) -> Result<Arc<Channel>> {
        let s = local::connect(&socket_name(instance), timeout)
            .map_err(|e| io_error("no same-host listener for the peer", e))?;
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
        (&mut &s)
            .write_all(&hello)
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
        s.set_read_timeout(None)
            .map_err(|e| io_error("cannot set timeouts", e))?;
        let reader = s.try_clone().map_err(|e| io_error("cannot clone", e))?;
        let ch = Arc::new(Channel {
            send: Mutex::new(()),
            stream: s,
            state: Mutex::new(ChannelState {
                next_id: 1,
                waiting: HashMap::new(),
                sent: Default::default(),
                acks: HashMap::new(),
                dead: None,
            }),
            acked: Condvar::new(),
            exports: exports.clone(),
            cma,
            dead: AtomicBool::new(false),
            progress: std::sync::atomic::AtomicU64::new(0),
        });
        let weak = Arc::downgrade(&ch);
        std::thread::Builder::new()
            .name("te-tcp-channel-rx".into())
            .spawn(move || receive(&reader, &weak))
            .map_err(|e| {
                Error::new(ErrorKind::Io, format!("cannot start a channel thread: {e}"))
            })?;
        Ok(ch)
    }

    /// Tells the target that the allocation shared under `key` is gone (its region was
    /// deregistered here, so no request names it any more): the target unmaps it once
    /// none of this peer's channels holds it.
    pub(crate) fn unshare(&self, key: u64) {
        let _order = self.send.lock();
        let mut st = self.state.lock();
        st.acks.remove(&key);
        if !st.sent.remove(&key) || st.dead.is_some() {
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
        let sent = (&mut &self.stream).write_all(&msg);
        if let Err(e) = sent {
            self.fail(io_error("send failed", e));
        }
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
    /// `region`), shared with the target first if it is not yet, and mapped there;
    /// `None` where `rt` cannot export it, or the target cannot map it, or says
    /// neither before `deadline` (the frame then goes over the socket).
    pub(crate) fn key(
        &self,
        rt: &Arc<dyn DeviceRuntime>,
        region: RegionId,
        addr: u64,
        deadline: Instant,
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
        {
            let _order = self.send.lock();
            let mut st = self.state.lock();
            if st.dead.is_some() {
                return None;
            }
            if !st.sent.contains(&key) {
                st.sent.insert(key);
                st.acks.insert(key, None);
                drop(st);
                self.share(rt, key, &export)?;
            }
        }
        match self.ack(key, deadline) {
            Some(Ok(())) => Some(key),
            Some(Err(e)) => {
                // The target cannot map it: this region's frames take the socket. The
                // export stays known, so the region's deregistration still unshares it
                // on every channel it was sent on (the target forgets its refusal then).
                tracing::info!(runtime = rt.name(), %region, error = %e, "the same-host peer cannot map this memory; this region's frames go over the socket");
                let id = (rt.name().to_string(), region);
                self.exports.lock().unshareable.insert(id);
                None
            }
            None => None,
        }
    }

    /// Sends the share of `export` under `key`; `None` if the channel broke.
    fn share(
        &self,
        rt: &Arc<dyn DeviceRuntime>,
        key: u64,
        export: &te_core::device::IpcExport,
    ) -> Option<()> {
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
        let sent = local::send_with_fd(&self.stream, &msg, export.fd.as_ref().map(|f| f.as_fd()));
        if let Err(e) = sent {
            self.fail(io_error("send failed", e));
            return None;
        }
        Some(())
    }

    /// Waits until the target has said whether it mapped the allocation shared under
    /// `key`: its answer, or `None` if the channel died or `deadline` passed first.
    fn ack(&self, key: u64, deadline: Instant) -> Option<std::result::Result<(), Error>> {
        let mut st = self.state.lock();
        loop {
            if let Some(Some(answer)) = st.acks.get(&key) {
                return Some(answer.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if st.dead.is_some() || left.is_zero() {
                return None;
            }
            st = self.acked.wait_timeout(st, left).0;
        }
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
        let _order = self.send.lock();
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
        // Written under `send` alone: requests and shares keep their order, and the
        // receiving thread can take answers meanwhile.
        let sent = (&mut &self.stream).write_all(&msg);
        if let Err(e) = sent {
            self.fail(io_error("send failed", e));
        }
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

    /// Marks the channel dead and fails every request waiting on it.
    fn fail(&self, e: Error) {
        self.dead.store(true, Ordering::Release);
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        let waiting: Vec<Waiting> = {
            let mut st = self.state.lock();
            st.dead.get_or_insert(e.clone());
            st.waiting.drain().map(|(_, w)| w).collect()
        };
        self.acked.notify_all();
        for b in waiting.into_iter().flatten() {
            b.finish_slice(Err(e.clone()));
        }
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// The channel's answers, until it closes.
fn receive(s: &UnixStream, ch: &Weak<Channel>) {
    let end = loop {
        let mut h = [0u8; HEADER_LEN];
        if let Err(e) = (&mut &*s).read_exact(&mut h) {
            break io_error("the same-host peer closed the channel", e);
        }
        let m = Msg::decode(&h);
        let result = match m.kind {
            DONE | SHARED if m.code == 0 => Ok(()),
            FAIL | SHARED if m.b as usize <= MAX_MESSAGE => {
                let mut text = vec![0u8; m.b as usize];
                if let Err(e) = (&mut &*s).read_exact(&mut text) {
                    break io_error("receive failed", e);
                }
                Err(Error::from_peer(
                    ErrorKind::from_code(m.code),
                    "the same-host peer refused a request",
                    &String::from_utf8_lossy(&text),
                ))
            }
            _ => break protocol("an answer of an unknown kind"),
        };
        let Some(ch) = ch.upgrade() else { return };
        ch.progress.fetch_add(1, Ordering::AcqRel);
        if m.kind == SHARED {
            // An answer to a share, by its key.
            let mut st = ch.state.lock();
            match st.acks.get_mut(&m.id) {
                Some(answer @ None) => *answer = Some(result),
                _ => {
                    drop(st);
                    ch.fail(protocol("an answer to no share"));
                    return;
                }
            }
            drop(st);
            ch.acked.notify_all();
            continue;
        }
        let waiting = ch.state.lock().waiting.remove(&m.id);
        match waiting {
            Some(batches) => {
                for (i, b) in batches.iter().enumerate() {
                    if batches.get(i + 1).is_none_or(|next| !Arc::ptr_eq(b, next)) {
                        b.stage_ended(BatchStage::Wire);
                    }
                    b.finish_slice(result.clone());
                }
            }
            None => {
                ch.fail(protocol("an answer to no request"));
                return;
            }
        }
    };
    if let Some(ch) = ch.upgrade() {
        ch.fail(end);
    }
}
