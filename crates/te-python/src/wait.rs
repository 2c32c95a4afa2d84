//! Waits with the GIL released that end when they should and not before: when what
//! they wait for happens, at their deadline, or when a signal reaches the waiting
//! thread, which then runs Python's handlers (Ctrl-C raises `KeyboardInterrupt`).
//!
//! Nothing wakes the thread to look in between. It sleeps in `ppoll(2)` on an eventfd
//! of its own, which the waker of what it awaits writes. A signal ends the sleep with
//! `EINTR`: CPython installs its handlers without `SA_RESTART`, and the kernel gives a
//! process-wide signal such as Ctrl-C's to the main thread when that thread can take
//! it, as when it sleeps here. Only the main thread runs Python's handlers; on others
//! the check finds nothing and the wait goes on.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;
use te_core::sync::Mutex;
use te_core::Deadline;

/// A thread's eventfd, which the wakers of its waits write.
struct EventFd(OwnedFd);

impl Wake for EventFd {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live u64 to an open eventfd. It cannot fail but
        // for a counter at its maximum, which still reads as readable.
        unsafe { libc::write(self.0.as_raw_fd(), (&raw const one).cast(), 8) };
    }
}

enum Slept {
    Woken,
    TimedOut,
    Interrupted,
}

impl EventFd {
    fn new() -> io::Result<Arc<EventFd>> {
        // SAFETY: plain flags; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor that nothing else owns.
        Ok(Arc::new(EventFd(unsafe { OwnedFd::from_raw_fd(fd) })))
    }

    /// Sleeps until a wake, `end`, or a signal; a wake is consumed. `mask` is the
    /// signal mask while it sleeps (the caller's own, from before it blocked signals).
    fn sleep(&self, end: Option<Deadline>, mask: &libc::sigset_t) -> io::Result<Slept> {
        let mut pfd = libc::pollfd {
            fd: self.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ts = end.map(|end| {
            let left = end.remaining();
            libc::timespec {
                tv_sec: left.as_secs().min(libc::time_t::MAX as u64) as libc::time_t,
                tv_nsec: left.subsec_nanos() as libc::c_long,
            }
        });
        let tsp = ts.as_ref().map_or(std::ptr::null(), |t| t as *const _);
        // SAFETY: one valid pollfd, a timespec that outlives the call (or none: no
        // limit), and a valid signal mask, in force only while the call sleeps.
        match unsafe { libc::ppoll(&mut pfd, 1, tsp, mask) } {
            0 => Ok(Slept::TimedOut),
            n if n > 0 => {
                let mut count = 0u64;
                // SAFETY: reads 8 bytes into a live u64 from an open, non-blocking
                // eventfd; a race that emptied it first only makes this fail.
                unsafe { libc::read(self.0.as_raw_fd(), (&raw mut count).cast(), 8) };
                Ok(Slept::Woken)
            }
            _ => match io::Error::last_os_error() {
                e if e.kind() == io::ErrorKind::Interrupted => Ok(Slept::Interrupted),
                e => Err(e),
            },
        }
    }
}

thread_local! {
    static EVENT: Option<Arc<EventFd>> = EventFd::new().ok();
}

/// Signals blocked on this thread while it looks whether it may sleep, and unblocked
/// only inside `ppoll`, atomically: a signal that comes after the look ends the sleep
/// instead of being missed by it. The caller's mask comes back when this drops.
/// Signals a fault raises synchronously stay unblocked.
struct Blocked(libc::sigset_t);

impl Blocked {
    fn new() -> Blocked {
        // SAFETY: sigset_t is plain data that the calls below initialise before use.
        let (mut all, mut old) = unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
        // SAFETY: valid sigset pointers; the mask changes on this thread only.
        unsafe {
            libc::sigfillset(&mut all);
            for s in [
                libc::SIGSEGV,
                libc::SIGBUS,
                libc::SIGFPE,
                libc::SIGILL,
                libc::SIGTRAP,
            ] {
                libc::sigdelset(&mut all, s);
            }
            libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
        }
        Blocked(old)
    }
}

impl Drop for Blocked {
    fn drop(&mut self) {
        // SAFETY: restores this thread's mask from before `Blocked::new`.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut()) };
    }
}

/// Polls `poll` until it is ready or `end` passes (`None`: no limit), sleeping with the
/// GIL released in between; `None` at the deadline (after one last poll). Raises what
/// Python's signal handlers raise when a signal ends a sleep.
pub(crate) fn block_on<T>(
    py: Python<'_>,
    end: Option<Deadline>,
    mut poll: impl FnMut(&mut Context<'_>) -> Poll<T>,
) -> PyResult<Option<T>> {
    let event = EVENT
        .with(Clone::clone)
        .ok_or_else(|| PyOSError::new_err("te cannot wait: eventfd failed for this thread"))?;
    let waker = Waker::from(event.clone());
    let mut cx = Context::from_waker(&waker);
    loop {
        // Signals that came before this look are handled here; later ones end the sleep.
        let blocked = Blocked::new();
        py.check_signals()?;
        if let Poll::Ready(v) = poll(&mut cx) {
            return Ok(Some(v));
        }
        let slept = py.allow_threads(|| event.sleep(end, &blocked.0));
        drop(blocked);
        match slept {
            Ok(Slept::Woken) => {}
            Ok(Slept::TimedOut) => {
                if end.is_some_and(|e| e.is_past()) {
                    return Ok(match poll(&mut cx) {
                        Poll::Ready(v) => Some(v),
                        Poll::Pending => None,
                    });
                }
            }
            Ok(Slept::Interrupted) => py.check_signals()?,
            Err(e) => return Err(PyOSError::new_err(format!("te's wait failed: {e}"))),
        }
    }
}

/// A switch thrown once, which wakes the waits that watch it.
#[derive(Default)]
pub(crate) struct Latch {
    state: Mutex<(bool, Vec<Waker>)>,
}

impl Latch {
    /// Throws the switch and wakes its watchers.
    pub(crate) fn set(&self) {
        let wakers = {
            let mut s = self.state.lock();
            s.0 = true;
            std::mem::take(&mut s.1)
        };
        for w in wakers {
            w.wake();
        }
    }

    /// Whether it is thrown; if not, `cx`'s waker is woken when it is.
    pub(crate) fn poll_set(&self, cx: &mut Context<'_>) -> bool {
        let mut s = self.state.lock();
        if !s.0 && !s.1.iter().any(|w| w.will_wake(cx.waker())) {
            s.1.push(cx.waker().clone());
        }
        s.0
    }
}
