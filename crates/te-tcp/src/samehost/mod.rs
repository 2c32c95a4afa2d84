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
//!   kernel on one GPU, not one driver call per block. A group's copies may run at
//!   once, so entries that overlap one another (one writes bytes another reads or
//!   writes: judged on the target's addresses for its side, on the initiator's for the
//!   initiator's, and on one for both where the initiator is the target's own process)
//!   are never in one group: such an entry starts the next **wave**, a group run once
//!   the one before has ended (`crate::waves`). So they take effect in the request's
//!   order, and a request without overlaps is still one group. No caller waits for the
//!   answer to a share: an allocation's frames go over the socket until the target has
//!   answered, then over the channel, or over the socket for good where the target
//!   could not map it (it also refuses a request naming such an allocation).
//!
//! Everything else (host on one side and device on the other, another runtime) goes over
//! the socket. A caller sends its request itself as far as the socket takes it without
//! waiting, and leaves the rest to the channel's writing thread: no caller waits for a
//! target that stopped reading, so a batch still ends at its deadline. With `caller_reads`, a caller waiting for its batch on the initiator reads
//! that batch's answers itself (`Link::drive`, through te-core's
//! `TransferBackend::drive`); otherwise the channel's receiving thread reads them all.
//! The initiator's memory is touched only while its batch waits for the
//! answer: the batch's pins hold its regions. A request carries its batch's deadline on
//! the host's monotonic clock, and the target refuses one it reads after it; at the
//! deadline the watcher (`watch`) stops a channel that answered nothing for a grace,
//! as it closes a stalled data connection. What the target mapped is unmapped when the
//! channel closes (the peer disconnected, exited or was killed), or when the initiator
//! deregisters it: its deregistration unshares the allocation on every channel that
//! has it and returns once each has answered that it let go (or stopped, its target
//! no longer copying: one that copies holds every mapping of the channel until it has
//! ended), so the memory may then be freed; past its deadline it fails and closes the
//! channel.
//!
//! **The fence.** Each channel shares one page (`local::SharedPage`, sent with the
//! hello) holding two words: `CLOSED`, which the initiator sets when it stops the
//! channel (a cut at a deadline, a failure, its owner's close), and `BUSY`, which the
//! target sets while it copies a request. Each side writes its word, then reads the
//! other's (both sequentially consistent), so they cannot both miss each other: a
//! target that sees `CLOSED` refuses the request without touching the initiator's
//! memory, and an initiator that sees `BUSY` hands nothing back until that copy has
//! ended — it reads the channel on (the target answers the request it ran, refuses the
//! rest, then closes its end) and hands back what waits once `BUSY` is clear or the
//! target's end closed. So no copy of the target's touches memory after its batch was
//! handed back, however late or stopped the target is; a target stopped in the middle
//! of a copy holds that batch until it resumes or exits.
//!
//! Channel messages (little-endian): the initiator's `Hello` (64 bytes: magic `TELC`,
//! version u16, flags u16, the target instance u64, the challenge nonce \[32\], the
//! address u64 of a copy of the nonce in the initiator's memory, the initiator's
//! random id u64, which with its pid names its allocation keys; the fence page's
//! descriptor attached) and the target's
//! `Welcome` (8 bytes: magic, status u16 (0 = open), flags u16 (1 = cross-memory
//! attach works)); then 40-byte headers (kind u8, 3 zero bytes, code u32, id u64, and
//! three u64 fields `a`, `b`, `c`):
//!
//! | kind | direction | code | id | a | b | c | then |
//! |---|---|---|---|---|---|---|---|
//! | 1 share | → target | handle bytes | key | base | length | ordinal << 32 · runtime name bytes | handle, runtime name (then a NUL and the device's host-wide name, `DeviceRuntime::device_id`, where the runtime has one: the target maps on its own ordinal of that device); a descriptor attached where the runtime's handles are descriptors |
//! | 2 write, 3 read | → target | entries n | request id | deadline, µs on the host's monotonic clock (0: none) | bytes in all | 0 | n × (region, offset, length, key, address), u64 each; key 0 is host memory |
//! | 4 done | → initiator | 0 | request id | 0 | 0 | 0 | — |
//! | 5 error | → initiator | error kind | request id | 0 | message bytes | 0 | the message |
//! | 6 unshare | → target | 0 | key | 0 | 0 | 0 | — (the initiator deregistered it: unmap) |
//! | 7 shared | → initiator | 0, or error kind | key | 0 | message bytes | 0 | the message, if refused |
//! | 8 unshared | → initiator | 0 | key | 0 | 0 | 0 | — (the channel let go of it; unmapped unless another channel holds it) |
//!
//! A malformed message closes the channel; a request the target refuses is answered
//! with an error and the channel goes on.
//!
//! A target reads a request's entries in steps no larger than what arrived already (64
//! KiB at first), its buffer growing with them, so a peer that announces the most
//! entries (2.6 MB) and sends few costs it at most twice what was sent (or the 64 KiB
//! first step, if more), not what was announced. What its channels hold for requests is the backend's gauge
//! `samehost_request_bytes`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use te_core::device::{DeviceCopy, DeviceRuntime};
use te_core::kit::fits;
use te_core::local;
use te_core::sync::{Condvar, Mutex};
use te_core::{BatchId, BatchStage, Error, ErrorKind, Op, RegionId, Result};

use crate::completion::Batch;
use crate::regions::Pin;
use crate::state::Shared;
use crate::wire::{Entry, Header, Kind, NONCE_LEN};

const MAGIC: [u8; 4] = *b"TELC";
pub(crate) const VERSION: u16 = 6;
const HELLO_LEN: usize = 64;
const WELCOME_LEN: usize = 8;
const HEADER_LEN: usize = 40;
const ENTRY_LEN: usize = 40;
/// The most entries one request carries (a batch of random KV blocks is one request).
pub(crate) const MAX_ENTRIES: usize = 1 << 16;
/// Entries whose buffers a target's channel keeps for its next request (a KV batch of
/// 64 blocks over 64 layer slots); a larger request's are freed after it.
const KEPT_ENTRIES: usize = 4096;
/// The first step in which a target's channel reads a request's entries; each next
/// step is at most what arrived already, so its buffer grows with what the peer sent.
const READ_STEP: usize = 64 << 10;
const MAX_HANDLE: usize = 256;
pub(crate) const MAX_NAME: usize = 128;
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
/// The target's answer to a share (by its key): mapped (code 0), or why not.
const SHARED: u8 = 7;
/// The target's answer to an unshare (by its key): this channel holds the mapping no
/// more, and it is unmapped unless another channel of the peer holds it.
const UNSHARED: u8 = 8;

/// The fence page's word the initiator sets (to 1) when it stops the channel: no
/// request of it may start copying after that.
const CLOSED: usize = 0;
/// The fence page's word the target sets (to 1) while it copies a request's bytes.
const BUSY: usize = 1;

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

/// Which of `events` (and of the hang-up and error events, always reported) `s` has,
/// waiting up to `wait` for one (zero: not at all); none where the wait ended first or
/// a signal interrupted it.
pub(crate) fn poll(s: &UnixStream, events: i16, wait: Duration) -> std::io::Result<i16> {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: s.as_raw_fd(),
        events,
        revents: 0,
    };
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(wait.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: wait.subsec_nanos().into(),
    };
    // SAFETY: one valid pollfd and a valid timespec, both live for the call; no
    // signal mask is passed.
    let n = unsafe { libc::ppoll(&mut p, 1, &ts, std::ptr::null()) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        return if e.kind() == std::io::ErrorKind::Interrupted {
            Ok(0)
        } else {
            Err(e)
        };
    }
    Ok(if n > 0 { p.revents } else { 0 })
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

mod initiator;
mod target;

pub(crate) use initiator::{Channel, Exports, Frame};
pub(crate) use target::{Imports, Server};
