//! Threads te starts take none of the process's signals.
//!
//! The kernel gives a signal sent to the process (Ctrl-C's `SIGINT`, a `SIGTERM`) to any
//! one of its threads that does not block it. An application waits for those on threads
//! of its own — `sigwait`, a Python wait in `ppoll` with its mask, a runtime's signal
//! handler thread — so a te thread that takes one steals it: Python's handler runs
//! there, and the thread that should see `EINTR` sleeps on. Every thread te starts
//! therefore blocks the signals applications handle, from its first instruction (it is
//! started from a thread that blocks them for the start, and inherits that mask).
//! Signals a fault raises (`SIGSEGV`, …), profiling timers (`SIGPROF`), `SIGPIPE` and
//! the real-time signals libc uses for itself are left alone.

use std::io;
use std::thread::{Builder, JoinHandle};

/// The signals te's threads block: those sent to a process to tell it something.
const SIGNALS: [libc::c_int; 10] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
    libc::SIGALRM,
    libc::SIGCHLD,
    libc::SIGWINCH,
    libc::SIGTSTP,
];

/// Changes the calling thread's mask by `how` with [`SIGNALS`]; returns the mask before.
fn change(how: libc::c_int) -> libc::sigset_t {
    // SAFETY: sigset_t is plain data, initialised by sigemptyset before any other use.
    let (mut set, mut old) = unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
    // SAFETY: valid pointers to sets this function owns; the mask changes on the
    // calling thread only.
    unsafe {
        libc::sigemptyset(&mut set);
        for s in SIGNALS {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(how, &set, &mut old);
    }
    old
}

/// Blocks the signals te's threads block, on the calling thread, for good: for a
/// thread someone else starts for te (a tokio runtime's `on_thread_start`).
pub fn mask_signals() {
    change(libc::SIG_BLOCK);
}

/// Runs `f` with those signals blocked on the calling thread, then restores its mask:
/// every thread `f` starts inherits the blocked mask.
pub fn masked<T>(f: impl FnOnce() -> T) -> T {
    struct Restore(libc::sigset_t);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: restores this thread's mask from before `masked`.
            unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut()) };
        }
    }
    let _restore = Restore(change(libc::SIG_BLOCK));
    f()
}

/// Starting a thread that takes none of the process's signals.
pub trait SpawnMasked {
    /// As [`Builder::spawn`], the new thread blocking the signals applications handle
    /// from its start (see the module's docs).
    ///
    /// # Errors
    /// As [`Builder::spawn`].
    fn spawn_masked<F, T>(self, f: F) -> io::Result<JoinHandle<T>>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static;
}

impl SpawnMasked for Builder {
    fn spawn_masked<F, T>(self, f: F) -> io::Result<JoinHandle<T>>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        masked(|| self.spawn(f))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether the calling thread blocks `sig`.
    fn blocks(sig: libc::c_int) -> bool {
        // SAFETY: plain data, filled by the call.
        let mut now: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: reads this thread's mask into `now`; a null set changes nothing.
        unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut now) };
        // SAFETY: `now` was filled above.
        unsafe { libc::sigismember(&now, sig) == 1 }
    }

    #[test]
    fn a_masked_thread_blocks_the_signals_from_its_start_and_its_starter_keeps_its_mask() {
        let before = blocks(libc::SIGINT);
        let t = Builder::new()
            .name("te-masked-test".into())
            .spawn_masked(|| {
                (
                    blocks(libc::SIGINT),
                    blocks(libc::SIGTERM),
                    blocks(libc::SIGSEGV),
                    blocks(libc::SIGPROF),
                )
            })
            .unwrap();
        assert_eq!(t.join().unwrap(), (true, true, false, false));
        assert_eq!(blocks(libc::SIGINT), before, "the starter's mask came back");
        let plain = std::thread::spawn(|| blocks(libc::SIGINT)).join().unwrap();
        assert_eq!(plain, before, "a plain thread inherits its starter's mask");
    }
}
