//! Peers in another process of this host: frames move without the socket.
//!
//! A backend with `local_ipc` advertises its host's boot id in its endpoint and listens
//! on the abstract Unix socket `@te-tcp-<instance>`. An initiator whose peer advertises
//! this host's boot id opens a **channel** there after its first data connection's
//! handshake, and presents the target's challenge nonce from that handshake: only the
//! process that answered that (authenticated) connection knows it, so a descriptor that
//! claims this host — or another local engine's instance — gets no channel, and its
//! frames go over the socket as for any peer. The target serves its own user only, and
//! learns the initiator's pid from the kernel (`SO_PEERCRED`), not from the peer.
//!
//! On a channel the **target** does the copies, after the checks it makes for a served
//! frame (`serve::admit`: region, rights, every entry's bounds, and a pin that makes its
//! deregistration wait), so its registrations are enforced exactly as over the socket:
//!
//! - host memory on both sides: one cross-memory-attach copy (`process_vm_readv` for a
//!   WRITE, `process_vm_writev` for a READ) between the initiator's ranges and the
//!   region. The target tries it once when the channel opens, reading the nonce from
//!   the initiator's memory; where the kernel refuses (another user, Yama), the channel
//!   says so and the initiator sends host frames over the socket.
//! - device memory of one runtime on both sides: the initiator exports each allocation
//!   it sends from once per channel (`DeviceRuntime::ipc_export`: CUDA's IPC handle,
//!   fakedev's memfd over `SCM_RIGHTS`), the target maps it once
//!   (`ipc_import`), and a request's copies run as one device group — CUDA's list-copy
//!   kernel on one GPU, not one driver call per block.
//!
//! Everything else (host on one side and device on the other, another runtime) goes over
//! the socket. The initiator's memory is touched only while its batch waits for the
//! answer: the batch's pins hold its regions. A request carries its batch's deadline on
//! the host's monotonic clock, and the target refuses one it reads after it; at the
//! deadline the watcher (`watch`) closes a channel that answered nothing for a grace,
//! as it closes a stalled data connection. What the target mapped is unmapped when the
//! channel closes (the peer disconnected, exited or was killed).
//!
//! Channel messages (little-endian): the initiator's `Hello` (64 bytes: magic `TELC`,
//! version u16, flags u16, the target instance u64, the challenge nonce \[32\], the
//! address u64 of a copy of the nonce in the initiator's memory, the initiator's
//! random id u64, which with its pid names its allocation keys) and the target's
//! `Welcome` (8 bytes: magic, status u16 (0 = open), flags u16 (1 = cross-memory
//! attach works)); then 40-byte headers (kind u8, 3 zero bytes, code u32, id u64, and
//! three u64 fields `a`, `b`, `c`):
//!
//! | kind | direction | code | id | a | b | c | then |
//! |---|---|---|---|---|---|---|---|
//! | 1 share | → target | handle bytes | key | base | length | ordinal << 32 · runtime name bytes | handle, runtime name; a descriptor attached where the runtime's handles are descriptors |
//! | 2 write, 3 read | → target | entries n | request id | deadline, µs on the host's monotonic clock (0: none) | bytes in all | 0 | n × (region, offset, length, key, address), u64 each; key 0 is host memory |
//! | 4 done | → initiator | 0 | request id | 0 | 0 | 0 | — |
//! | 5 error | → initiator | error kind | request id | 0 | message bytes | 0 | the message |
//! | 6 unshare | → target | 0 | key | 0 | 0 | 0 | — (the initiator deregistered it: unmap) |
//!
//! A malformed message closes the channel; a request the target refuses is answered
//! with an error and the channel goes on.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use te_core::device::{DeviceCopy, DeviceRuntime};
use te_core::kit::fits;
use te_core::local;
use te_core::sync::Mutex;
use te_core::{Error, ErrorKind, Op, RegionId, Result};

use crate::backend::Shared;
use crate::completion::Batch;
use crate::regions::Pin;
use crate::wire::{Entry, Header, Kind, NONCE_LEN};

const MAGIC: [u8; 4] = *b"TELC";
const VERSION: u16 = 2;
const HELLO_LEN: usize = 64;
const WELCOME_LEN: usize = 8;
const HEADER_LEN: usize = 40;
const ENTRY_LEN: usize = 40;
/// The most entries one request carries (a batch of random KV blocks is one request).
pub(crate) const MAX_ENTRIES: usize = 1 << 16;
const MAX_HANDLE: usize = 256;
const MAX_NAME: usize = 32;
const MAX_MESSAGE: usize = 4096;
/// Channels one target serves at once; more are closed at once.
const MAX_CHANNELS: usize = 256;
/// Channels still in their hello at once; a newer one closes the oldest, so sockets
/// that connect and say nothing cannot keep a good peer out.
const MAX_PENDING: usize = 16;
/// Allocations one channel maps at most.
const MAX_IMPORTS: usize = 4096;
/// Handshake nonces a target remembers for channels to present.
const MAX_NONCES: usize = 4096;

const SHARE: u8 = 1;
const WRITE: u8 = 2;
const READ: u8 = 3;
const DONE: u8 = 4;
const FAIL: u8 = 5;
const UNSHARE: u8 = 6;

/// The abstract socket name of backend instance `instance`'s channel listener.
pub(crate) fn socket_name(instance: u64) -> String {
    format!("te-tcp-{instance:016x}")
}

/// The challenge nonces of the data connections this target accepted lately: a channel
/// must present one, once.
#[derive(Debug, Default)]
pub(crate) struct Nonces(Mutex<VecDeque<[u8; NONCE_LEN]>>);

impl Nonces {
    pub(crate) fn record(&self, n: [u8; NONCE_LEN]) {
        let mut q = self.0.lock();
        if q.len() >= MAX_NONCES {
            q.pop_front();
        }
        q.push_back(n);
    }

    fn take(&self, n: &[u8; NONCE_LEN]) -> bool {
        let mut q = self.0.lock();
        match q.iter().position(|k| k == n) {
            Some(i) => {
                q.remove(i);
                true
            }
            None => false,
        }
    }
}

/// A 40-byte channel header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Msg {
    kind: u8,
    code: u32,
    id: u64,
    a: u64,
    b: u64,
    c: u64,
}

impl Msg {
    fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = self.kind;
        b[4..8].copy_from_slice(&self.code.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.a.to_le_bytes());
        b[24..32].copy_from_slice(&self.b.to_le_bytes());
        b[32..40].copy_from_slice(&self.c.to_le_bytes());
        b
    }

    fn decode(b: &[u8; HEADER_LEN]) -> Msg {
        let u = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
        Msg {
            kind: b[0],
            code: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            id: u(8),
            a: u(16),
            b: u(24),
            c: u(32),
        }
    }
}

/// One range of a request: `len` bytes at `offset` of the target's `region`, and the
/// initiator's bytes at `addr` (host memory where `key` is 0, else in the allocation
/// the initiator shared under `key`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Range {
    pub(crate) region: u64,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) key: u64,
    pub(crate) addr: u64,
}

/// Microseconds on this host's monotonic clock, which every process of the host shares
/// (a channel's peers share the boot): requests carry their deadline on it.
fn monotonic_us() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid out-parameter; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    (t.tv_sec as u64) * 1_000_000 + (t.tv_nsec as u64) / 1_000
}

fn io_error(what: &str, e: std::io::Error) -> Error {
    Error::new(
        ErrorKind::PeerUnreachable,
        format!("same-host channel: {what}: {e}"),
    )
    .with_source(e)
}

fn protocol(what: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorKind::Protocol,
        format!("same-host channel: {what}; closed"),
    )
}

// ------------------------------------------------------------------------------------
// The target's side.

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
        for (_, s) in self.channels.lock().drain() {
            let _ = s.shutdown(std::net::Shutdown::Both);
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
            .spawn(move || {
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
    (&mut &*s)
        .read_exact(&mut hello)
        .map_err(|e| io_error("reading the hello", e))?;
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
    if let Some(why) = refused {
        tracing::warn!(pid, uid, why, "refused a same-host channel");
        let _ = (&mut &*s).write_all(&welcome(1, false));
        return Ok(());
    }
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
    let mut entries: Vec<Range> = Vec::new();
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
                let name = std::str::from_utf8(&b[hl..])
                    .map_err(|_| protocol("a runtime name that is not UTF-8"))?;
                let ordinal = (m.c >> 32) as u32;
                let id = (pid, initiator, m.id);
                // Another channel of the same peer may have mapped it: share that one
                // (the handle or descriptor sent again is not opened twice).
                let mut all = shared.imports.0.lock();
                let known = all.get(&id).and_then(Weak::upgrade).filter(|i| {
                    i.base == m.a && i.len == m.b && i.ordinal == ordinal && i.rt.name() == name
                });
                let import = match known {
                    Some(i) => Ok(i),
                    None => te_core::device::runtime(name).and_then(|rt| {
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
                imports.insert(m.id, import);
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
                let mut b = vec![0u8; n * ENTRY_LEN];
                (&mut &*s)
                    .read_exact(&mut b)
                    .map_err(|e| io_error("receive failed", e))?;
                entries.clear();
                entries.extend(b.chunks_exact(ENTRY_LEN).map(|e| {
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
                let total = entries.iter().try_fold(0u64, |t, e| t.checked_add(e.len));
                if total != Some(m.b) || entries.iter().any(|e| e.len == 0) {
                    return Err(protocol(
                        "a request whose entries do not add up to its length",
                    ));
                }
                let op = if m.kind == WRITE { Op::Write } else { Op::Read };
                let r = run(shared, pid, cma, &imports, op, &entries, m.a);
                let reply = match r {
                    Ok(()) => Msg {
                        kind: DONE,
                        code: 0,
                        id: m.id,
                        a: 0,
                        b: 0,
                        c: 0,
                    }
                    .encode()
                    .to_vec(),
                    Err(e) => {
                        let text = e.message().as_bytes();
                        let text = &text[..text.len().min(MAX_MESSAGE)];
                        let mut v = Msg {
                            kind: FAIL,
                            code: e.kind().code(),
                            id: m.id,
                            a: 0,
                            b: text.len() as u64,
                            c: 0,
                        }
                        .encode()
                        .to_vec();
                        v.extend_from_slice(text);
                        v
                    }
                };
                (&mut &*s)
                    .write_all(&reply)
                    .map_err(|e| io_error("send failed", e))?;
            }
            UNSHARE => {
                if fd.is_some() {
                    return Err(protocol("a descriptor with an unshare"));
                }
                // Unmapped once no other channel of the peer holds it.
                imports.remove(&m.id);
            }
            k => return Err(protocol(format!("a message of kind {k}"))),
        }
    }
}

fn welcome(status: u16, cma: bool) -> [u8; WELCOME_LEN] {
    let mut b = [0u8; WELCOME_LEN];
    b[..4].copy_from_slice(&MAGIC);
    b[4..6].copy_from_slice(&status.to_le_bytes());
    b[6..8].copy_from_slice(&u16::from(cma).to_le_bytes());
    b
}

/// One request: every entry admitted as a served frame's are (its region pinned), then
/// the copies, then the pins released.
fn run(
    shared: &Shared,
    pid: i32,
    cma: bool,
    imports: &HashMap<u64, std::result::Result<Arc<Import>, Error>>,
    op: Op,
    entries: &[Range],
    deadline_us: u64,
) -> Result<()> {
    let mut by_region: BTreeMap<u64, Vec<Entry>> = BTreeMap::new();
    for e in entries {
        by_region.entry(e.region).or_default().push(Entry {
            offset: e.offset,
            len: e.len,
        });
    }
    let kind = match op {
        Op::Write => Kind::WriteV,
        Op::Read => Kind::ReadV,
    };
    let mut pins: HashMap<u64, Pin> = HashMap::new();
    for (region, es) in &by_region {
        let len = es.iter().map(|e| e.len).sum();
        let h = Header::request(kind, 0, *region, 0, len);
        pins.insert(
            *region,
            crate::serve::admit(shared, &h, es, "a same-host peer")?,
        );
    }
    let mut host_here: Vec<(usize, usize)> = Vec::new();
    let mut host_there: Vec<(u64, usize)> = Vec::new();
    let mut groups: Vec<(Arc<dyn DeviceRuntime>, Vec<DeviceCopy>)> = Vec::new();
    for e in entries {
        let region = pins[&e.region].region();
        let here = region.addr + e.offset;
        match (&region.data, e.key) {
            (None, 0) if cma => {
                host_here.push((here as usize, e.len as usize));
                host_there.push((e.addr, e.len as usize));
            }
            (Some((rt, ordinal)), key) if key != 0 => {
                let import = match imports.get(&key) {
                    Some(Ok(i)) => i,
                    Some(Err(err)) => return Err(err.clone()),
                    None => return Err(protocol(format!("a request naming allocation {key}, never shared"))),
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
                match groups.iter_mut().find(|g| Arc::ptr_eq(&g.0, rt)) {
                    Some(g) => g.1.push(copy),
                    None => groups.push((rt.clone(), vec![copy])),
                }
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidRequest,
                    format!("region {} and the initiator's memory cannot be copied here (host and device memory, or no cross-memory attach): send it over the socket", e.region),
                ))
            }
        }
    }
    // On the clock both processes share: a request read late (this process was busy or
    // stopped) is refused, never copied after its batch was handed back.
    if deadline_us != 0 && monotonic_us() >= deadline_us {
        return Err(Error::new(
            ErrorKind::Timeout,
            "the batch's deadline passed before its copies started",
        ));
    }
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
    for (rt, copies) in groups {
        // SAFETY: the region ranges were admitted and are pinned until after the call;
        // the initiator's ranges lie in allocations mapped here (checked above), which
        // stay mapped while this channel serves, and its batch keeps them registered
        // until this request is answered.
        unsafe { rt.copy_group_wait(&copies) }?;
    }
    drop(pins);
    Ok(())
}

// ------------------------------------------------------------------------------------
// The initiator's side.

/// A request on the channel, waiting for its answer: the batch of each frame it carries.
type Waiting = Vec<Arc<Batch>>;

struct ChannelState {
    next_id: u64,
    waiting: HashMap<u64, Waiting>,
    /// Keys of the allocations shared on this channel.
    sent: std::collections::HashSet<u64>,
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
    /// (runtime, local region, base) → key and export.
    /// (runtime, local region) → the allocations exported from it: key and export
    /// (whose base and length say which addresses it covers, so a batch finds its key
    /// without asking the runtime).
    by: HashMap<(String, RegionId), Exported>,
    /// Runtimes whose memory cannot be shared from here.
    unshareable: Vec<String>,
}

impl Exports {
    /// Forgets what was exported of local region `region`; returns its keys.
    pub(crate) fn forget(&mut self, region: RegionId) -> Vec<u64> {
        let mut keys = Vec::new();
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
            unshareable: Vec::new(),
        }
    }
}

/// An initiator's channel to one same-host target.
pub(crate) struct Channel {
    stream: UnixStream,
    state: Mutex<ChannelState>,
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
            stream: s,
            state: Mutex::new(ChannelState {
                next_id: 1,
                waiting: HashMap::new(),
                sent: Default::default(),
                dead: None,
            }),
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
        let mut st = self.state.lock();
        if !st.sent.remove(&key) || st.dead.is_some() {
            return;
        }
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
        drop(st);
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
    /// `region`), shared with the target first if it is not yet; `None` where `rt`
    /// cannot share memory (the frame then goes over the socket).
    pub(crate) fn key(
        &self,
        rt: &Arc<dyn DeviceRuntime>,
        region: RegionId,
        addr: u64,
    ) -> Option<u64> {
        let (key, export) = {
            let mut ex = self.exports.lock();
            let id = (rt.name().to_string(), region);
            let known = ex.by.get(&id).and_then(|v| {
                v.iter()
                    .find(|(_, x)| addr >= x.base && addr - x.base < x.len)
                    .map(|(k, x)| (*k, x.clone()))
            });
            match known {
                Some(found) => found,
                None => {
                    if ex.unshareable.iter().any(|n| n == rt.name()) {
                        return None;
                    }
                    let export = match rt.ipc_export(addr) {
                        Ok(x) => Arc::new(x),
                        Err(e) => {
                            tracing::info!(runtime = rt.name(), error = %e, "device memory cannot be shared with a same-host peer; it goes over the socket");
                            ex.unshareable.push(rt.name().to_string());
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
        if st.sent.contains(&key) {
            return Some(key);
        }
        if st.dead.is_some() {
            return None;
        }
        let name = rt.name().as_bytes();
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
        msg.extend_from_slice(name);
        let sent = local::send_with_fd(&self.stream, &msg, export.fd.as_ref().map(|f| f.as_fd()));
        if let Err(e) = sent {
            drop(st);
            self.fail(io_error("send failed", e));
            return None;
        }
        st.sent.insert(key);
        Some(key)
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
        let ranges = frames.iter().flat_map(|f| f.ranges.iter());
        let n: usize = frames.iter().map(|f| f.ranges.len()).sum();
        let total: u64 = frames.iter().flat_map(|f| &f.ranges).map(|r| r.len).sum();
        // The earliest deadline of the frames' batches.
        let left = frames
            .iter()
            .map(|f| f.batch.deadline().saturating_duration_since(Instant::now()))
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
        // Written under the lock, so requests and shares keep their order.
        let sent = (&mut &self.stream).write_all(&msg);
        drop(st);
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
            DONE => Ok(()),
            FAIL if m.b as usize <= MAX_MESSAGE => {
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
        let waiting = ch.state.lock().waiting.remove(&m.id);
        match waiting {
            Some(batches) => {
                for b in batches {
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
