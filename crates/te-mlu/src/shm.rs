//! The region table: a small shared-memory block, one per backend instance, that says
//! which of its regions are live and counts the batches using each, in this process
//! and in peers' processes alike.
//!
//! MLU-Link copies are one-sided: the initiator writes into the target's memory through
//! a mapped IPC handle and the target sees nothing. So that a target's `deregister`
//! still means "no transfer touches this region any more", every batch *enters* each
//! region it uses (an atomic count in the owner's table, shared through a memfd the
//! owner hands to the peer over a Unix socket, see `handoff`) and *leaves* it when its
//! copies are done; the owner marks the region dead and waits (on a futex, no spinning)
//! until the count is zero. Past its timeout the region stays dead and counted, so a
//! later `retire` waits again: it is never freed while a batch may still copy.
//! The mark and the count are sequentially consistent atomics, so either the batch sees
//! the region dead and fails with `NotRegistered`, or `deregister` sees the batch and
//! waits for it.
//!
//! Peers that map the owner's allocations learn of a deregistration at once: `retire`
//! bumps a word in the table's header and wakes whoever sleeps on it (a futex), and
//! each peer has a thread asleep there that lets go of the regions no longer live
//! (`peers`), so a freed allocation does not stay mapped until the peer's next batch
//! or refresh.
//!
//! The table is also the owner's word on each region's extent: its address, its
//! allocation's IPC handle, the export's generation and its offset there, its length
//! and its rights, written before the region goes live.
//! An initiator checks every request against these, not against the descriptor it was
//! sent, so a forged or stale descriptor cannot reach outside a region (or a KV slot,
//! which is a region of its own).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

use te_core::{local, Error, ErrorKind, Result};

use crate::endpoint::Ipc;

const MAGIC: u64 = 0x7465_6d6c_7574_6235; // "temlutb5"
/// Regions one backend instance can register.
pub(crate) const SLOTS: usize = 8192;

const FREE: u32 = 0;
const CLAIMED: u32 = 1;
const LIVE: u32 = 2;
const DEAD: u32 = 3;

#[repr(C)]
struct Header {
    magic: AtomicU64,
    instance: AtomicU64,
    /// Bumped at every retirement (and by a peer stopping its watcher); watchers sleep
    /// on it ([`Table::wait_for_change`]).
    changes: AtomicU32,
    _pad: AtomicU32,
}

#[repr(C)]
struct Slot {
    region: AtomicU64,
    state: AtomicU32,
    inflight: AtomicU32,
    waiters: AtomicU32,
    access: AtomicU32,
    addr: AtomicU64,
    offset: AtomicU64,
    len: AtomicU64,
    handle: AtomicU64,
    generation: AtomicU64,
}

/// A live region's extent, as its owner registered it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Extent {
    /// Start address in the owner's address space.
    pub(crate) addr: u64,
    /// Offset in its allocation (what the IPC handle maps), 0 for host memory.
    pub(crate) offset: u64,
    /// Length in bytes.
    pub(crate) len: u64,
    /// The IPC handle of its allocation (its 8 bytes as a native-order word, see
    /// [`handle_word`]), 0 for host memory: a descriptor naming another allocation's
    /// handle for this region is refused.
    pub(crate) handle: u64,
    /// The generation of its allocation's export (see `endpoint::Ipc`), 0 for host
    /// memory: a descriptor naming another allocation that had the same handle value
    /// is refused.
    pub(crate) generation: u64,
    /// Peers may read it.
    pub(crate) read: bool,
    /// Peers may write it.
    pub(crate) write: bool,
}

impl Extent {
    /// What a peer's descriptor must agree with: the address, the offset in the
    /// allocation, its IPC handle and the export's generation.
    pub(crate) fn origin(&self) -> (u64, u64, u64, u64) {
        (self.addr, self.offset, self.handle, self.generation)
    }
}

/// A region key's IPC handle as the word the table keeps: its bytes in native order,
/// 0 without one.
pub(crate) fn handle_word(ipc: Option<Ipc>) -> u64 {
    ipc.map_or(0, |i| u64::from_ne_bytes(i.handle))
}

const SIZE: usize = std::mem::size_of::<Header>() + SLOTS * std::mem::size_of::<Slot>();

/// One instance's table, mapped into this process.
#[derive(Debug)]
pub(crate) struct Table {
    base: *mut u8,
    fd: OwnedFd,
}

// SAFETY: the mapping is only accessed through atomics.
unsafe impl Send for Table {}
// SAFETY: as above.
unsafe impl Sync for Table {}

fn io(what: String) -> Error {
    Error::new(ErrorKind::Io, what).with_source(std::io::Error::last_os_error())
}

fn map(fd: &OwnedFd) -> Result<*mut u8> {
    // SAFETY: a fresh shared mapping of a memfd of SIZE bytes that is sealed against
    // shrinking (`create` seals it, `open` checks the seal), so no access faults.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            SIZE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io("cannot map an mlu region table".into()));
    }
    Ok(p.cast())
}

impl Table {
    /// A new, empty table for backend instance `instance`, sealed against any change
    /// of size: every peer of this user may receive it, and one that shrank it would
    /// make this process's next touch of its own table fault.
    pub(crate) fn create(instance: u64) -> Result<Table> {
        let fd = local::sealed_memfd(c"te-mlu-regions", SIZE).map_err(|e| {
            Error::new(
                ErrorKind::Io,
                format!("cannot create the mlu region table: {e}"),
            )
            .with_source(e)
        })?;
        let t = Table {
            base: map(&fd)?,
            fd,
        };
        t.header().instance.store(instance, SeqCst);
        t.header().magic.store(MAGIC, SeqCst);
        Ok(t)
    }

    /// Maps the table of instance `instance`, received from its owner as `fd`: only a
    /// memfd of the table's size sealed against shrinking, so the owner cannot make
    /// this process fault by shrinking it under the mapping.
    pub(crate) fn open(fd: OwnedFd, instance: u64) -> Result<Table> {
        local::check_sealed(fd.as_fd(), SIZE).map_err(|e| {
            Error::new(
                ErrorKind::Protocol,
                format!(
                    "the peer's region table is refused: {e} (not a te-mlu peer of this version?)"
                ),
            )
            .with_source(e)
        })?;
        let t = Table {
            base: map(&fd)?,
            fd,
        };
        if t.header().magic.load(SeqCst) != MAGIC || t.header().instance.load(SeqCst) != instance {
            return Err(Error::new(
                ErrorKind::PeerRestarted,
                "the peer's region table belongs to another backend instance (the peer restarted)",
            ));
        }
        Ok(t)
    }

    /// The table's descriptor, which `handoff` serves to peers.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping starts with a Header and lives as long as `self`.
        unsafe { &*(self.base as *const Header) }
    }

    fn slot(&self, i: u32) -> Option<&Slot> {
        let i = i as usize;
        if i >= SLOTS {
            return None;
        }
        // SAFETY: in bounds of the mapping, which holds SLOTS slots after the header.
        Some(unsafe {
            &*(self
                .base
                .add(std::mem::size_of::<Header>() + i * std::mem::size_of::<Slot>())
                as *const Slot)
        })
    }

    /// Claims a free slot for `region` with its extent and marks it live.
    pub(crate) fn claim(&self, region: u64, extent: Extent) -> Result<u32> {
        for i in 0..SLOTS as u32 {
            let Some(s) = self.slot(i) else { break };
            if s.state
                .compare_exchange(FREE, CLAIMED, SeqCst, SeqCst)
                .is_ok()
            {
                s.region.store(region, SeqCst);
                s.addr.store(extent.addr, SeqCst);
                s.offset.store(extent.offset, SeqCst);
                s.len.store(extent.len, SeqCst);
                s.handle.store(extent.handle, SeqCst);
                s.generation.store(extent.generation, SeqCst);
                s.access.store(
                    u32::from(extent.read) | u32::from(extent.write) << 1,
                    SeqCst,
                );
                s.state.store(LIVE, SeqCst);
                return Ok(i);
            }
        }
        Err(Error::new(
            ErrorKind::Busy,
            format!("the mlu backend holds {SLOTS} regions already; deregister some first"),
        ))
    }

    /// Counts a batch in on `region`'s slot. False if the region is not live there.
    pub(crate) fn enter(&self, slot: u32, region: u64) -> bool {
        let Some(s) = self.slot(slot) else {
            return false;
        };
        s.inflight.fetch_add(1, SeqCst);
        if s.state.load(SeqCst) == LIVE && s.region.load(SeqCst) == region {
            return true;
        }
        self.leave(slot);
        false
    }

    /// The extent of `region` in `slot`, if it is live there. A batch reads it after
    /// entering the slot, so the slot cannot be reused under it.
    pub(crate) fn extent(&self, slot: u32, region: u64) -> Option<Extent> {
        let s = self.slot(slot)?;
        if s.state.load(SeqCst) != LIVE || s.region.load(SeqCst) != region {
            return None;
        }
        let access = s.access.load(SeqCst);
        Some(Extent {
            addr: s.addr.load(SeqCst),
            offset: s.offset.load(SeqCst),
            len: s.len.load(SeqCst),
            handle: s.handle.load(SeqCst),
            generation: s.generation.load(SeqCst),
            read: access & 1 != 0,
            write: access & 2 != 0,
        })
    }

    /// Counts a batch out again.
    pub(crate) fn leave(&self, slot: u32) {
        let Some(s) = self.slot(slot) else { return };
        if s.inflight.fetch_sub(1, SeqCst) == 1 && s.waiters.load(SeqCst) > 0 {
            futex_wake(&s.inflight);
        }
    }

    /// The count of changes peers watch for: it moves at every retirement.
    pub(crate) fn changes(&self) -> u32 {
        self.header().changes.load(SeqCst)
    }

    /// Sleeps (on a futex, no timeout) until the count of changes is no longer `seen`,
    /// or a spurious wake-up: the caller checks what it waits for again.
    pub(crate) fn wait_for_change(&self, seen: u32) {
        futex_wait(&self.header().changes, seen, None);
    }

    /// Moves the count of changes and wakes everyone asleep on it, in every process.
    pub(crate) fn signal_change(&self) {
        self.header().changes.fetch_add(1, SeqCst);
        futex_wake(&self.header().changes);
    }

    /// Marks `slot` dead, waits until no batch uses it (at most `timeout`), frees it.
    /// Returns false if batches were still counted in when the time ran out (a peer
    /// still copying, or one that died holding them): the slot then stays dead and
    /// counted, and a later call waits again.
    pub(crate) fn retire(&self, slot: u32, timeout: Duration) -> bool {
        let Some(s) = self.slot(slot) else {
            return true;
        };
        s.state.store(DEAD, SeqCst);
        // Peers let go of the region now: their batches in flight hold what they use.
        self.signal_change();
        let end = Instant::now() + timeout;
        loop {
            s.waiters.fetch_add(1, SeqCst);
            let n = s.inflight.load(SeqCst);
            if n == 0 {
                s.waiters.fetch_sub(1, SeqCst);
                break;
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                s.waiters.fetch_sub(1, SeqCst);
                return false;
            }
            futex_wait(&s.inflight, n, Some(left));
            s.waiters.fetch_sub(1, SeqCst);
        }
        s.region.store(0, SeqCst);
        s.state.store(FREE, SeqCst);
        true
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        // SAFETY: the mapping was made with SIZE bytes and nothing refers to it now.
        unsafe { libc::munmap(self.base.cast(), SIZE) };
    }
}

/// Sleeps while `word` holds `expected`, at most `timeout` (for ever with `None`).
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: t.as_secs().min(libc::time_t::MAX as u64) as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: a shared (not private) futex on a live, aligned u32 in a shared mapping;
    // the kernel compares it with `expected` before sleeping; the timeout is null (no
    // limit) or a live timespec.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            ts_ptr,
        )
    };
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: wakes waiters on a live, aligned u32 in a shared mapping.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
}
