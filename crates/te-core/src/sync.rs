//! Locks that do not poison.
//!
//! A panic while a lock is held poisons a `std::sync` lock, and every later `lock()`
//! returns an error. te's locks guard plain state (queues, tables, flags) that stays
//! consistent between statements, and a panicking thread in te is already a bug
//! reported elsewhere; refusing every later caller would turn one bug into a dead
//! engine. These wrappers recover the guard instead, so callers write `m.lock()`
//! rather than repeating the recovery at every call site.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{self as std_sync, WaitTimeoutResult};
use std::time::Duration;

pub use std::sync::{MutexGuard, RwLockReadGuard, RwLockWriteGuard};

/// A mutual-exclusion lock whose `lock` never fails (see the module docs).
#[derive(Default)]
pub struct Mutex<T: ?Sized>(std_sync::Mutex<T>);

impl<T> Mutex<T> {
    /// A new unlocked mutex holding `value`.
    pub const fn new(value: T) -> Self {
        Self(std_sync::Mutex::new(value))
    }

    /// Consumes the mutex and returns its value.
    pub fn into_inner(self) -> T {
        self.0.into_inner().unwrap_or_else(|p| p.into_inner())
    }
}

impl<T: ?Sized> Mutex<T> {
    /// Blocks until the lock is held, and returns its guard.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The guard if the lock is free now, `None` if another thread holds it.
    pub fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        match self.0.try_lock() {
            Ok(g) => Some(g),
            Err(std_sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std_sync::TryLockError::WouldBlock) => None,
        }
    }

    /// The value, through an exclusive borrow: no locking needed.
    pub fn get_mut(&mut self) -> &mut T {
        self.0.get_mut().unwrap_or_else(|p| p.into_inner())
    }
}

impl<T: ?Sized + fmt::Debug> fmt::Debug for Mutex<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A reader-writer lock whose `read` and `write` never fail (see the module docs).
#[derive(Default)]
pub struct RwLock<T: ?Sized>(std_sync::RwLock<T>);

impl<T> RwLock<T> {
    /// A new unlocked lock holding `value`.
    pub const fn new(value: T) -> Self {
        Self(std_sync::RwLock::new(value))
    }

    /// Consumes the lock and returns its value.
    pub fn into_inner(self) -> T {
        self.0.into_inner().unwrap_or_else(|p| p.into_inner())
    }
}

impl<T: ?Sized> RwLock<T> {
    /// Blocks until shared access is held.
    pub fn read(&self) -> RwLockReadGuard<'_, T> {
        self.0.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks until exclusive access is held.
    pub fn write(&self) -> RwLockWriteGuard<'_, T> {
        self.0.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The value, through an exclusive borrow: no locking needed.
    pub fn get_mut(&mut self) -> &mut T {
        self.0.get_mut().unwrap_or_else(|p| p.into_inner())
    }
}

impl<T: ?Sized + fmt::Debug> fmt::Debug for RwLock<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A condition variable for [`Mutex`] guards whose waits never fail.
///
/// It counts its waiters, and a notification with none skips the system call that
/// `std`'s makes every time (a region's pin released, a batch finished with nobody
/// blocked on it): a waiter is counted while it still holds the lock, so a notifier
/// that changed the state under that lock (as every correct use does) sees it. One
/// that changes it outside the lock (an atomic flag) must take the lock once before
/// notifying, as with any condition variable.
#[derive(Debug, Default)]
pub struct Condvar {
    inner: std_sync::Condvar,
    waiters: AtomicUsize,
}

/// Counts a waiter from before its wait (its lock still held) until after it.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, SeqCst);
        Waiting(n)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, SeqCst);
    }
}

impl Condvar {
    /// A new condition variable.
    pub const fn new() -> Self {
        Self {
            inner: std_sync::Condvar::new(),
            waiters: AtomicUsize::new(0),
        }
    }

    /// Releases `guard`, blocks until notified (or a spurious wake-up), relocks.
    pub fn wait<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        let _counted = Waiting::new(&self.waiters);
        self.inner.wait(guard).unwrap_or_else(|p| p.into_inner())
    }

    /// As [`wait`](Self::wait), for at most `timeout`.
    pub fn wait_timeout<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        timeout: Duration,
    ) -> (MutexGuard<'a, T>, WaitTimeoutResult) {
        let _counted = Waiting::new(&self.waiters);
        self.inner
            .wait_timeout(guard, timeout)
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks while `condition` holds.
    pub fn wait_while<'a, T, F>(&self, guard: MutexGuard<'a, T>, condition: F) -> MutexGuard<'a, T>
    where
        F: FnMut(&mut T) -> bool,
    {
        let _counted = Waiting::new(&self.waiters);
        self.inner
            .wait_while(guard, condition)
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks while `condition` holds, for at most `timeout`.
    pub fn wait_timeout_while<'a, T, F>(
        &self,
        guard: MutexGuard<'a, T>,
        timeout: Duration,
        condition: F,
    ) -> (MutexGuard<'a, T>, WaitTimeoutResult)
    where
        F: FnMut(&mut T) -> bool,
    {
        let _counted = Waiting::new(&self.waiters);
        self.inner
            .wait_timeout_while(guard, timeout, condition)
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes one waiter, if any waits.
    pub fn notify_one(&self) {
        if self.waiters.load(SeqCst) > 0 {
            self.inner.notify_one()
        }
    }

    /// Wakes every waiter, if any waits.
    pub fn notify_all(&self) {
        if self.waiters.load(SeqCst) > 0 {
            self.inner.notify_all()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_panic_while_locked_does_not_lock_out_later_callers() {
        let m = Arc::new(Mutex::new(1));
        let m2 = Arc::clone(&m);
        let r = std::thread::spawn(move || {
            let mut g = m2.lock();
            *g = 2;
            panic!("while holding the lock");
        })
        .join();
        assert!(r.is_err());
        assert_eq!(*m.lock(), 2);
        let rw = RwLock::new(3);
        *rw.write() += 1;
        assert_eq!(*rw.read(), 4);
    }

    #[test]
    fn a_counted_waiter_is_woken_and_every_wait_uncounts_itself() {
        let pair = Arc::new((Mutex::new(false), Condvar::new()));
        let theirs = pair.clone();
        let waiter = std::thread::spawn(move || {
            let (m, cv) = &*theirs;
            let start = std::time::Instant::now();
            let (go, _) = cv.wait_timeout_while(m.lock(), Duration::from_secs(30), |go| !*go);
            (*go, start.elapsed() < Duration::from_secs(20))
        });
        let (m, cv) = &*pair;
        for _ in 0..10_000 {
            if cv.waiters.load(SeqCst) > 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(cv.waiters.load(SeqCst), 1, "the waiter is counted");
        *m.lock() = true;
        cv.notify_all();
        assert_eq!(waiter.join().unwrap(), (true, true), "woken, not timed out");
        assert_eq!(cv.waiters.load(SeqCst), 0);
        let (_g, r) = cv.wait_timeout(m.lock(), Duration::from_millis(1));
        assert!(r.timed_out());
        assert_eq!(cv.waiters.load(SeqCst), 0, "a timed-out wait is uncounted");
        // With nobody waiting, a notification is a no-op.
        cv.notify_one();
        cv.notify_all();
    }

    #[test]
    fn wait_timeout_while_reports_the_timeout() {
        let m = Mutex::new(false);
        let cv = Condvar::new();
        let (g, r) = cv.wait_timeout_while(m.lock(), Duration::from_millis(10), |done| !*done);
        assert!(r.timed_out());
        assert!(!*g);
    }
}
