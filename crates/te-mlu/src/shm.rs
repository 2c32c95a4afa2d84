//! The region table: a small shared-memory block, one per backend instance, that says
//! which of its regions are live and counts the batches using each, in this process
//! and in peers' processes alike.
//!
//! MLU-Link copies are one-sided: the initiator writes into the target's memory through
//! a mapped IPC handle and the target sees nothing. So that a target's `deregister`
//! still means "no transfer touches this region any more", every batch *enters* each
//! region it uses (an atomic count in the owner's table, shared through a memfd the
//! peer opens via `/proc/PID/fd`) and *leaves* it when its copies are done; the owner
//! marks the region dead and waits (on a futex, no spinning) until the count is zero.
//! The mark and the count are sequentially consistent atomics, so either the batch sees
//! the region dead and fails with `NotRegistered`, or `deregister` sees the batch and
//! waits for it.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

use te_core::{Error, ErrorKind, Result};

const MAGIC: u64 = 0x7465_6d6c_7574_6231; // "temlutb1"
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
}

#[repr(C)]
struct Slot {
    region: AtomicU64,
    state: AtomicU32,
    inflight: AtomicU32,
    waiters: AtomicU32,
    _pad: u32,
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
    // SAFETY: a fresh shared mapping of a file of at least SIZE bytes.
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
    /// A new, empty table for backend instance `instance`.
    pub(crate) fn create(instance: u64) -> Result<Table> {
        // SAFETY: a NUL-terminated name; MFD_CLOEXEC keeps it out of child processes.
        let raw = unsafe { libc::memfd_create(c"te-mlu-regions".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(io(
                "cannot create the mlu region table (memfd_create)".into()
            ));
        }
        // SAFETY: `raw` is a new descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain call on our descriptor.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), SIZE as libc::off_t) } != 0 {
            return Err(io("cannot size the mlu region table".into()));
        }
        let t = Table {
            base: map(&fd)?,
            fd,
        };
        t.header().instance.store(instance, SeqCst);
        t.header().magic.store(MAGIC, SeqCst);
        Ok(t)
    }

    /// Opens the table of instance `instance`, held as descriptor `fd` by process `pid`.
    pub(crate) fn open(pid: u32, fd: u32, instance: u64) -> Result<Table> {
        let path = format!("/proc/{pid}/fd/{fd}\0");
        // SAFETY: a NUL-terminated path.
        let raw = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDWR | libc::O_CLOEXEC) };
        if raw < 0 {
            return Err(Error::new(
                ErrorKind::PeerUnreachable,
                format!("cannot open the peer's region table ({}): the peer process is gone, or runs as another user",
                    path.trim_end_matches('\0')),
            )
            .with_source(std::io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a new descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: `st` is a valid out-parameter.
        if unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) } != 0 {
            return Err(io("cannot inspect the peer's region table".into()));
        }
        // SAFETY: initialised by the successful fstat.
        if (unsafe { st.assume_init() }.st_size as usize) < SIZE {
            return Err(Error::new(
                ErrorKind::Protocol,
                "the peer's region table is too small: not a te-mlu peer of this version",
            ));
        }
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

    /// The descriptor number peers open through `/proc/PID/fd`.
    pub(crate) fn fd(&self) -> u32 {
        self.fd.as_raw_fd() as u32
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

    /// Claims a free slot for `region` and marks it live.
    pub(crate) fn claim(&self, region: u64) -> Result<u32> {
        for i in 0..SLOTS as u32 {
            let Some(s) = self.slot(i) else { break };
            if s.state
                .compare_exchange(FREE, CLAIMED, SeqCst, SeqCst)
                .is_ok()
            {
                s.region.store(region, SeqCst);
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

    /// Counts a batch out again.
    pub(crate) fn leave(&self, slot: u32) {
        let Some(s) = self.slot(slot) else { return };
        if s.inflight.fetch_sub(1, SeqCst) == 1 && s.waiters.load(SeqCst) > 0 {
            futex_wake(&s.inflight);
        }
    }

    /// Marks `slot` dead, waits until no batch uses it (at most `timeout`), frees it.
    /// Returns false if batches were still counted in when the time ran out (a peer
    /// process died holding them).
    pub(crate) fn retire(&self, slot: u32, timeout: Duration) -> bool {
        let Some(s) = self.slot(slot) else {
            return true;
        };
        s.state.store(DEAD, SeqCst);
        let end = Instant::now() + timeout;
        let mut clean = true;
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
                clean = false;
                break;
            }
            futex_wait(&s.inflight, n, left.min(Duration::from_millis(500)));
            s.waiters.fetch_sub(1, SeqCst);
        }
        s.region.store(0, SeqCst);
        s.inflight.store(0, SeqCst);
        s.state.store(FREE, SeqCst);
        clean
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        // SAFETY: the mapping was made with SIZE bytes and nothing refers to it now.
        unsafe { libc::munmap(self.base.cast(), SIZE) };
    }
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: a shared (not private) futex on a live, aligned u32 in a shared mapping;
    // the kernel compares it with `expected` before sleeping.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        )
    };
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: wakes waiters on a live, aligned u32 in a shared mapping.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
}
