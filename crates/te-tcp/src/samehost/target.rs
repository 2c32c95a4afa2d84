//! The target's side of a same-host channel: the listener, and the requests it serves
//! by copying itself (cross-memory attach, or device copies of imported allocations).

use super::*;
use crate::waves::{Span, Waves};
use te_core::kit::thread::SpawnMasked as _;

/// A target's channel listener and the channels it serves; dropping it closes them.
pub(crate) struct Server {
    stop: Arc<tokio::sync::Notify>,
    channels: Arc<Mutex<HashMap<u64, UnixStream>>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("samehost::Server")
    }
}

impl Server {
    /// Listens on `@te-tcp-<instance>` for `shared`'s channels; the listener waits on
    /// te-tcp's I/O threads, and each channel is served by a thread of its own.
    ///
    /// # Errors
    /// `Io` if the socket cannot be made or its task cannot start.
    pub(crate) fn start(shared: &Arc<Shared>) -> Result<Server> {
        let name = socket_name(shared.instance);
        let io = |what: &str, e: std::io::Error| {
            Error::new(ErrorKind::Io, format!("{what}: {e}")).with_source(e)
        };
        let listener = local::listen(&name)
            .map_err(|e| io(&format!("cannot listen on @{name} for same-host peers"), e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| io("cannot configure the same-host socket", e))?;
        let stop = Arc::new(tokio::sync::Notify::new());
        let channels: Arc<Mutex<HashMap<u64, UnixStream>>> = Arc::default();
        let (weak, chans, halt) = (Arc::downgrade(shared), channels.clone(), stop.clone());
        shared
            .tasks
            .spawn(async move { accept_loop(listener, &halt, &weak, &chans).await })?;
        Ok(Server { stop, channels })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.notify_one();
        // Only the reading side: a channel's thread inside a copy finishes it and
        // answers, then reads its end and closes the socket. The initiator takes that
        // close for the end of the copy (the fence), so it must not come before.
        for (_, s) in self.channels.lock().drain() {
            let _ = s.shutdown(std::net::Shutdown::Read);
        }
    }
}

async fn accept_loop(
    listener: std::os::unix::net::UnixListener,
    stop: &tokio::sync::Notify,
    shared: &Weak<Shared>,
    channels: &Arc<Mutex<HashMap<u64, UnixStream>>>,
) {
    // SAFETY: the listener owns its open descriptor and the `AsyncFd` owns the
    // listener, so the descriptor stays open, the same socket, until it drops.
    let listener = match unsafe { tokio::io::unix::AsyncFd::register(listener) } {
        Ok(l) => l,
        Err(e) => {
            let e = e.into_parts().1;
            tracing::warn!(error = %e, "same-host channels cannot be accepted; peers on this host use the socket");
            return;
        }
    };
    let open = Arc::new(AtomicUsize::new(0));
    let pending: Arc<Mutex<VecDeque<u64>>> = Arc::default();
    let mut next = 0u64;
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
            () = stop.notified() => return,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "same-host channel: accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Some(s) = shared.upgrade() else { return };
        if open.load(Ordering::Acquire) >= MAX_CHANNELS {
            tracing::warn!(
                max = MAX_CHANNELS,
                "same-host channel refused: too many open"
            );
            continue;
        }
        if stream.set_nonblocking(false).is_err() {
            continue;
        }
        let Ok(clone) = stream.try_clone() else {
            continue;
        };
        next += 1;
        let key = next;
        channels.lock().insert(key, clone);
        let evicted = {
            let mut p = pending.lock();
            p.push_back(key);
            (p.len() > MAX_PENDING).then(|| p.pop_front()).flatten()
        };
        if let Some(old) = evicted {
            if let Some(old) = channels.lock().get(&old) {
                tracing::debug!("closing a same-host channel still in its hello to make room");
                let _ = old.shutdown(std::net::Shutdown::Both);
            }
        }
        open.fetch_add(1, Ordering::AcqRel);
        let (count, all, waiting) = (open.clone(), channels.clone(), pending.clone());
        let started = std::thread::Builder::new()
            .name("te-tcp-channel".into())
            .spawn_masked(move || {
                let opened = || waiting.lock().retain(|k| *k != key);
                if let Err(e) = serve(&s, &stream, &opened) {
                    tracing::debug!(error = %e, "same-host channel ended");
                }
                opened();
                let _ = stream.shutdown(std::net::Shutdown::Both);
                all.lock().remove(&key);
                count.fetch_sub(1, Ordering::AcqRel);
            });
        if started.is_err() {
            channels.lock().remove(&key);
            pending.lock().retain(|k| *k != key);
            open.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// What a target mapped of its same-host peers, by (pid, initiator id, key): a
/// peer's channels share one mapping of each allocation, which goes when the last
/// channel that uses it closes.
#[derive(Default)]
pub(crate) struct Imports(Mutex<HashMap<(i32, u64, u64), Weak<Import>>>);

impl std::fmt::Debug for Imports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("samehost::Imports")
    }
}

/// An allocation of the initiator's mapped here.
struct Import {
    rt: Arc<dyn DeviceRuntime>,
    /// Where it is mapped here.
    addr: u64,
    /// Where it is in the initiator.
    base: u64,
    len: u64,
    ordinal: u32,
}

impl Drop for Import {
    fn drop(&mut self) {
        if let Err(e) = self.rt.ipc_close(self.addr) {
            tracing::warn!(error = %e, "same-host channel: unmapping a peer's memory failed");
        }
    }
}

/// The channel's handshake, then its messages until it closes. Requests are served one
/// at a time, so when this returns no copy of the channel's runs and its imports can
/// be unmapped.
fn serve(shared: &Shared, s: &UnixStream, opened: &dyn Fn()) -> Result<()> {
    let limit = shared.config.handshake_timeout;
    s.set_read_timeout(Some(limit))
        .and_then(|()| s.set_write_timeout(Some(shared.config.io_timeout)))
        .map_err(|e| io_error("cannot set timeouts", e))?;
    let (pid, uid) = local::peer_cred(s).map_err(|e| io_error("no peer credentials", e))?;
    let mut hello = [0u8; HELLO_LEN];
    let page = local::recv_with_fd(s, &mut hello).map_err(|e| io_error("reading the hello", e))?;
    opened();
    let instance = u64::from_le_bytes(hello[8..16].try_into().unwrap_or_default());
    let nonce: [u8; NONCE_LEN] = hello[16..48].try_into().unwrap_or_default();
    let probe = u64::from_le_bytes(hello[48..56].try_into().unwrap_or_default());
    let initiator = u64::from_le_bytes(hello[56..64].try_into().unwrap_or_default());
    let refused = if hello[..4] != MAGIC || u16::from_le_bytes([hello[4], hello[5]]) != VERSION {
        Some("not a te-tcp same-host hello")
    } else if uid != local::my_uid() {
        Some("another user's process")
    } else if instance != shared.instance {
        Some("meant for another instance")
    } else if !shared.nonces.take(&nonce) {
        Some("no data connection of this process gave it that nonce")
    } else {
        None
    };
    let fence = match (refused, page.map(local::SharedPage::open)) {
        (None, Some(Ok(f))) => Some(Fence(f)),
        _ => None,
    };
    let refused = match (refused, &fence) {
        (None, None) => Some("no shared page (a sealed memfd of one page) with the hello"),
        (r, _) => r,
    };
    let (None, Some(fence)) = (refused, fence) else {
        let why = refused.unwrap_or_default();
        tracing::warn!(pid, uid, why, "refused a same-host channel");
        let _ = (&mut &*s).write_all(&welcome(1, false));
        return Ok(());
    };
    // Cross-memory attach, tried once: the nonce must be where the initiator said.
    let mut seen = [0u8; NONCE_LEN];
    // SAFETY: `seen` is ours and untouched during the call.
    let cma = pid > 0
        && unsafe {
            local::cma_read(
                pid,
                &[(seen.as_mut_ptr() as usize, NONCE_LEN)],
                &[(probe, NONCE_LEN)],
            )
        }
        .is_ok()
        && seen == nonce;
    (&mut &*s)
        .write_all(&welcome(0, cma))
        .map_err(|e| io_error("sending the welcome", e))?;
    tracing::debug!(pid, cma, "same-host channel open");
    // Idle channels wait for their next message without a timeout (and without waking).
    s.set_read_timeout(None)
        .map_err(|e| io_error("cannot set timeouts", e))?;
    let mut imports: HashMap<u64, std::result::Result<Arc<Import>, Error>> = HashMap::new();
    // A request's entries, as read and as decoded: kept from one request to the next
    // (up to KEPT_ENTRIES of them).
    let (mut raw, mut entries): (Vec<u8>, Vec<Range>) = (Vec::new(), Vec::new());
    let mut held = Held {
        gauge: &shared.channel_bytes,
        mine: 0,
    };
    loop {
        let mut h = [0u8; HEADER_LEN];
        let fd = match local::recv_with_fd(s, &mut h) {
            Ok(fd) => fd,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(io_error("receive failed", e)),
        };
        let m = Msg::decode(&h);
        match m.kind {
            SHARE => {
                let (hl, nl) = (m.code as usize, (m.c & 0xffff_ffff) as usize);
                if hl > MAX_HANDLE || nl > MAX_NAME || nl == 0 {
                    return Err(protocol("a share with an oversize handle or name"));
                }
                if imports.len() >= MAX_IMPORTS && !imports.contains_key(&m.id) {
                    return Err(protocol(format!(
                        "more than {MAX_IMPORTS} shared allocations"
                    )));
                }
                let mut b = vec![0u8; hl + nl];
                (&mut &*s)
                    .read_exact(&mut b)
                    .map_err(|e| io_error("receive failed", e))?;
                let text = std::str::from_utf8(&b[hl..])
                    .map_err(|_| protocol("a runtime name that is not UTF-8"))?;
                // `runtime` or `runtime NUL device-id`: the device by its host-wide
                // name where the initiator gave one, else by the initiator's ordinal.
                let (name, device) = match text.split_once('\0') {
                    Some((n, d)) => (n, Some(d)),
                    None => (text, None),
                };
                let theirs = (m.c >> 32) as u32;
                let ordinal = match device {
                    None => Ok(theirs),
                    Some(d) => te_core::device::runtime(name)
                        .ok()
                        .and_then(|rt| rt.ordinal_of(d))
                        .ok_or_else(|| {
                            Error::new(
                                ErrorKind::Unsupported,
                                format!("the initiator's {name} device {d} (its ordinal {theirs}) is not one this process sees (CUDA_VISIBLE_DEVICES?): its memory cannot be mapped here"),
                            )
                        }),
                };
                let id = (pid, initiator, m.id);
                // Another channel of the same peer may have mapped it: share that one
                // (the handle or descriptor sent again is not opened twice).
                let mut all = shared.imports.0.lock();
                let known = all.get(&id).and_then(Weak::upgrade).filter(|i| {
                    i.base == m.a
                        && i.len == m.b
                        && ordinal.as_ref().is_ok_and(|&o| i.ordinal == o)
                        && i.rt.name() == name
                });
                let import = match known {
                    Some(i) => Ok(i),
                    None => ordinal.and_then(|ordinal| {
                        let rt = te_core::device::runtime(name)?;
                        let addr = rt.ipc_import(ordinal, &b[..hl], fd, m.b)?;
                        let i = Arc::new(Import {
                            rt,
                            addr,
                            base: m.a,
                            len: m.b,
                            ordinal,
                        });
                        all.retain(|_, w| w.strong_count() > 0);
                        all.insert(id, Arc::downgrade(&i));
                        Ok(i)
                    }),
                };
                drop(all);
                if let Err(e) = &import {
                    tracing::warn!(runtime = name, error = %e, "same-host channel: the peer's memory could not be mapped");
                }
                // The initiator does not wait for this: requests naming the allocation
                // may follow at once, and are refused where we could not map it (it
                // sends the later ones over the socket).
                let answer = answer(SHARED, SHARED, m.id, import.as_ref().map(|_| ()));
                imports.insert(m.id, import);
                (&mut &*s)
                    .write_all(&answer)
                    .map_err(|e| io_error("send failed", e))?;
            }
            WRITE | READ => {
                if fd.is_some() {
                    return Err(protocol("a descriptor with a request"));
                }
                let n = m.code as usize;
                if n == 0 || n > MAX_ENTRIES {
                    return Err(protocol(format!(
                        "a request of {n} entries (1..={MAX_ENTRIES})"
                    )));
                }
                // Read in steps of at most what arrived already (READ_STEP at first),
                // the buffer growing with them: a peer that announces the most entries
                // and sends few makes this channel hold at most the larger of READ_STEP
                // and twice what it sent (and never more than it announced), not the
                // 2.6 MB it announced.
                raw.clear();
                let want = n * ENTRY_LEN;
                while raw.len() < want {
                    let at = raw.len();
                    let next = want.min(at + at.max(READ_STEP));
                    raw.reserve_exact(next - at);
                    raw.resize(next, 0);
                    held.set(raw.capacity(), entries.capacity());
                    (&mut &*s)
                        .read_exact(&mut raw[at..])
                        .map_err(|e| io_error("receive failed", e))?;
                }
                entries.clear();
                entries.extend(raw.chunks_exact(ENTRY_LEN).map(|e| {
                    let u =
                        |i: usize| u64::from_le_bytes(e[i..i + 8].try_into().unwrap_or_default());
                    Range {
                        region: u(0),
                        offset: u(8),
                        len: u(16),
                        key: u(24),
                        addr: u(32),
                    }
                }));
                held.set(raw.capacity(), entries.capacity());
                let total = entries.iter().try_fold(0u64, |t, e| t.checked_add(e.len));
                if total != Some(m.b) || entries.iter().any(|e| e.len == 0) {
                    return Err(protocol(
                        "a request whose entries do not add up to its length",
                    ));
                }
                let op = if m.kind == WRITE { Op::Write } else { Op::Read };
                let r = run(shared, pid, cma, &imports, op, &entries, &|| {
                    fence.begin(m.a)
                });
                // What a channel keeps between requests stays small whatever a peer
                // sent: the buffers of a request larger than KEPT_ENTRIES go with it.
                if n > KEPT_ENTRIES {
                    (raw, entries) = (Vec::new(), Vec::new());
                    held.set(raw.capacity(), entries.capacity());
                }
                let reply = answer(DONE, FAIL, m.id, r.as_ref().map(|_| ()));
                (&mut &*s)
                    .write_all(&reply)
                    .map_err(|e| io_error("send failed", e))?;
            }
            UNSHARE => {
                if fd.is_some() {
                    return Err(protocol("a descriptor with an unshare"));
                }
                // Unmapped once no other channel of the peer holds it (requests run
                // one at a time and hold nothing of it past their answer, so this
                // channel's is the last hold unless another channel has one); then
                // the initiator is told, and its deregistration may return.
                imports.remove(&m.id);
                let reply = Msg {
                    kind: UNSHARED,
                    code: 0,
                    id: m.id,
                    a: 0,
                    b: 0,
                    c: 0,
                }
                .encode();
                (&mut &*s)
                    .write_all(&reply)
                    .map_err(|e| io_error("send failed", e))?;
            }
            k => return Err(protocol(format!("a message of kind {k}"))),
        }
    }
}

/// A channel's part of its backend's `samehost_request_bytes` gauge: what its request
/// buffers hold, given back when the channel ends.
struct Held<'a> {
    gauge: &'a AtomicU64,
    mine: u64,
}

impl Held<'_> {
    /// Notes the capacities of the raw request buffer and of its decoded entries.
    fn set(&mut self, raw: usize, entries: usize) {
        let now = (raw + entries * std::mem::size_of::<Range>()) as u64;
        if now >= self.mine {
            self.gauge.fetch_add(now - self.mine, Ordering::Relaxed);
        } else {
            self.gauge.fetch_sub(self.mine - now, Ordering::Relaxed);
        }
        self.mine = now;
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.gauge.fetch_sub(self.mine, Ordering::Relaxed);
    }
}

/// The target's side of a channel's fence page (see the module's docs).
struct Fence(local::SharedPage);

impl Fence {
    /// Marks a request with deadline `deadline_us` (0: none) copying, until the guard
    /// drops — unless its batch may have been handed back: its deadline passed (on the
    /// clock both processes share: this process was busy or stopped), or the initiator
    /// stopped the channel.
    fn begin(&self, deadline_us: u64) -> Result<Copying<'_>> {
        // `BUSY` first, then the checks: an initiator that stops the channel after
        // them sees the copy (`Link::fence_close`).
        self.0.word(BUSY).store(1, Ordering::SeqCst);
        let copying = Copying(self, deadline_us);
        copying.wanted("started")?;
        Ok(copying)
    }
}

/// A request's copies running, and its deadline: `BUSY` is cleared when this drops.
struct Copying<'a>(&'a Fence, u64);

impl Copying<'_> {
    /// Whether the request's next copies may start (`what` says which: "started", or
    /// "went on"): not after the initiator stopped the channel, nor after its batch's
    /// deadline, when it may have been handed back.
    fn wanted(&self, what: &str) -> Result<()> {
        if self.0 .0.word(CLOSED).load(Ordering::SeqCst) != 0 {
            return Err(Error::new(
                ErrorKind::Cancelled,
                format!("the initiator stopped the channel before the request's copies {what}"),
            ));
        }
        if self.1 != 0 && monotonic_us() >= self.1 {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!("the batch's deadline passed before the request's copies {what}"),
            ));
        }
        Ok(())
    }
}

impl Drop for Copying<'_> {
    fn drop(&mut self) {
        self.0 .0.word(BUSY).store(0, Ordering::SeqCst);
    }
}

/// The answer to message `id`: kind `ok` with code 0, or kind `failed` with the error's
/// kind as its code and its message after the header.
fn answer(ok: u8, failed: u8, id: u64, r: std::result::Result<(), &Error>) -> Vec<u8> {
    let (kind, code, text) = match r {
        Ok(()) => (ok, 0, &[][..]),
        Err(e) => {
            let text = e.message().as_bytes();
            (
                failed,
                e.kind().code(),
                &text[..text.len().min(MAX_MESSAGE)],
            )
        }
    };
    let mut v = Msg {
        kind,
        code,
        id,
        a: 0,
        b: text.len() as u64,
        c: 0,
    }
    .encode()
    .to_vec();
    v.extend_from_slice(text);
    v
}

fn welcome(status: u16, cma: bool) -> [u8; WELCOME_LEN] {
    let mut b = [0u8; WELCOME_LEN];
    b[..4].copy_from_slice(&MAGIC);
    b[4..6].copy_from_slice(&status.to_le_bytes());
    b[6..8].copy_from_slice(&u16::from(cma).to_le_bytes());
    b
}

/// One request: every entry admitted as a served frame's are (its region pinned), then
/// `begin` asked whether the request may still be copied (and told the initiator it
/// is, until its guard drops), then the copies, then the pins released.
fn run<'f>(
    shared: &Shared,
    pid: i32,
    cma: bool,
    imports: &HashMap<u64, std::result::Result<Arc<Import>, Error>>,
    op: Op,
    entries: &[Range],
    begin: &dyn Fn() -> Result<Copying<'f>>,
) -> Result<()> {
    // Each entry's region, as an index into the regions named (in the order first
    // named): a request's entries come grouped by region, so the last one is tried
    // first and the map is looked in only when the region changes (a peer naming a
    // new region at every entry costs a hash each, not a search).
    let mut by_region: Vec<(u64, Vec<Entry>)> = Vec::new();
    let mut named: HashMap<u64, usize> = HashMap::new();
    let mut index: Vec<usize> = Vec::with_capacity(entries.len());
    for e in entries {
        let last = by_region.last().map(|(r, _)| *r);
        let at = if last == Some(e.region) {
            by_region.len() - 1
        } else {
            *named.entry(e.region).or_insert_with(|| {
                by_region.push((e.region, Vec::new()));
                by_region.len() - 1
            })
        };
        by_region[at].1.push(Entry {
            offset: e.offset,
            len: e.len,
        });
        index.push(at);
    }
    let kind = match op {
        Op::Write => Kind::WriteV,
        Op::Read => Kind::ReadV,
    };
    let mut pins: Vec<Pin> = Vec::with_capacity(by_region.len());
    for (region, es) in &by_region {
        let len = es.iter().map(|e| e.len).sum();
        let h = Header::request(kind, 0, *region, 0, len);
        pins.push(crate::target::serve::admit(
            shared,
            &h,
            es,
            "a same-host peer",
        )?);
    }
    let mut host_here: Vec<(usize, usize)> = Vec::new();
    let mut host_there: Vec<(u64, usize)> = Vec::new();
    // Overlap is judged on this process's addresses for the region's side and on the
    // initiator's for its side (one allocation may be mapped here twice, under two
    // keys): two spaces, unless the initiator is this process, where they are one
    // (its memory mapped here aliases the region it moves into itself).
    let there_space = u8::from(u32::try_from(pid) != Ok(std::process::id()));
    let mut groups: Vec<(Arc<dyn DeviceRuntime>, Waves)> = Vec::new();
    let mut last_import: Option<(u64, &Arc<Import>)> = None;
    for (e, &at) in entries.iter().zip(&index) {
        let region = pins[at].region();
        let here = region.addr + e.offset;
        match (&region.data, e.key) {
            (None, 0) if cma => {
                host_here.push((here as usize, e.len as usize));
                host_there.push((e.addr, e.len as usize));
            }
            (Some((rt, ordinal)), key) if key != 0 => {
                let import = match (last_import, imports.get(&key)) {
                    (Some((k, i)), _) if k == key => i,
                    (_, Some(Ok(i))) => {
                        last_import = Some((key, i));
                        i
                    }
                    (_, Some(Err(err))) => {
                        return Err(Error::new(
                            err.kind(),
                            format!("the initiator's memory (shared allocation {key}) could not be mapped here: {}", err.message()),
                        ))
                    }
                    (_, None) => return Err(protocol(format!("a request naming allocation {key}, never shared"))),
                };
                if import.rt.name() != rt.name() {
                    return Err(Error::new(
                        ErrorKind::InvalidRequest,
                        format!("region {} is {} memory and the initiator's is {}: send it over the socket", e.region, rt.name(), import.rt.name()),
                    ));
                }
                let inside =
                    e.addr >= import.base && fits(e.addr - import.base, e.len, import.len);
                if !inside {
                    return Err(Error::new(
                        ErrorKind::OutOfBounds,
                        format!("the initiator's range {:#x}+{} is outside the allocation it shared ({:#x}+{})", e.addr, e.len, import.base, import.len),
                    ));
                }
                let there = import.addr + (e.addr - import.base);
                let (src, src_ordinal, dst, dst_ordinal) = match op {
                    Op::Write => (there, import.ordinal, here, *ordinal),
                    Op::Read => (here, *ordinal, there, import.ordinal),
                };
                let copy = DeviceCopy::DeviceToDevice {
                    src_ordinal,
                    src,
                    dst_ordinal,
                    dst,
                    len: e.len as usize,
                };
                let (ours, theirs) = (
                    Span {
                        space: 0,
                        addr: here,
                        len: e.len,
                    },
                    Span {
                        space: there_space,
                        addr: e.addr,
                        len: e.len,
                    },
                );
                let (reads, writes) = match op {
                    Op::Write => (theirs, ours),
                    Op::Read => (ours, theirs),
                };
                let g = match groups.iter().position(|g| Arc::ptr_eq(&g.0, rt)) {
                    Some(g) => g,
                    None => {
                        groups.push((rt.clone(), Waves::default()));
                        groups.len() - 1
                    }
                };
                groups[g].1.add(copy, reads, writes, false);
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidRequest,
                    format!("region {} and the initiator's memory cannot be copied here (host and device memory, or no cross-memory attach): send it over the socket", e.region),
                ))
            }
        }
    }
    let copying = begin()?;
    if !host_here.is_empty() {
        // SAFETY: every local range was admitted inside a region the pins keep
        // registered until after the call; for a READ we only read them.
        let r = unsafe {
            match op {
                Op::Write => local::cma_read(pid, &host_here, &host_there),
                Op::Read => local::cma_write(pid, &host_here, &host_there),
            }
        };
        r.map_err(|e| {
            Error::new(
                ErrorKind::Io,
                format!("copying with the peer process {pid} failed: {e}"),
            )
        })?;
    }
    let mut first = true;
    for (rt, waves) in groups {
        for copies in waves.into_groups() {
            // A request of many waves (entries that overlap one another) stops between
            // them once its batch is over, as it would not have started.
            if !std::mem::take(&mut first) {
                copying.wanted("went on")?;
            }
            // SAFETY: the region ranges were admitted and are pinned until after the
            // call; the initiator's ranges lie in allocations mapped here (checked
            // above), which stay mapped while this channel serves, and its batch keeps
            // them registered until this request is answered. No two copies of a wave
            // overlap (`Waves::add`), and a wave starts once the one before has ended.
            unsafe { rt.copy_group_wait(&copies) }?;
        }
    }
    drop(copying);
    drop(pins);
    Ok(())
}
