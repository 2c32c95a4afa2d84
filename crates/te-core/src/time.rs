//! Time: the [`Deadline`] every call and batch carries, on the process's monotonic
//! clock. A leaf of te-core: it depends on errors only, so every layer can take one.

use std::fmt;
use std::time::{Duration, Instant};

use abi_stable::StableAbi;

use crate::error::{Error, ErrorKind, Result};

/// Nanoseconds on the process's monotonic clock (the clock `Instant` uses on Linux).
pub(crate) fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// When a call or a batch must be over: a point on the process's monotonic clock.
///
/// One deadline is drawn per user call and handed down to everything under it
/// (handshake, connect, the batch, its notification), each using the time that is
/// left. It is plain data, so it crosses the plugin boundary as it is.
#[repr(transparent)]
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, StableAbi)]
pub struct Deadline(u64);

impl Deadline {
    /// The deadline `timeout` from now (saturating: a huge timeout never wraps).
    pub fn after(timeout: Duration) -> Deadline {
        let ns = u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX);
        Deadline(monotonic_ns().saturating_add(ns))
    }

    /// The deadline at `instant`.
    pub fn at(instant: Instant) -> Deadline {
        let (now, now_ns) = (Instant::now(), monotonic_ns());
        match instant.checked_duration_since(now) {
            Some(ahead) => {
                Deadline(now_ns.saturating_add(u64::try_from(ahead.as_nanos()).unwrap_or(u64::MAX)))
            }
            None => Deadline(
                now_ns
                    .saturating_sub(u64::try_from((now - instant).as_nanos()).unwrap_or(u64::MAX)),
            ),
        }
    }

    /// The deadline as an `Instant` (far-future deadlines are capped at a century).
    pub fn instant(self) -> Instant {
        let now = Instant::now();
        let left = self
            .remaining()
            .min(Duration::from_secs(100 * 365 * 86_400));
        now.checked_add(left).unwrap_or(now)
    }

    /// The time left; zero once it has passed.
    pub fn remaining(self) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(monotonic_ns()))
    }

    /// Whether it has passed.
    pub fn is_past(self) -> bool {
        self.remaining().is_zero()
    }

    /// The time left, or a `Timeout` error for `operation` once it has passed.
    ///
    /// # Errors
    /// `Timeout` once the deadline has passed.
    pub fn left(self, operation: &'static str) -> Result<Duration> {
        let left = self.remaining();
        if left.is_zero() {
            Err(Error::new(
                ErrorKind::Timeout,
                "the deadline passed before the operation could finish; raise the timeout or check the peer",
            )
            .with_operation(operation))
        } else {
            Ok(left)
        }
    }
}

impl fmt::Debug for Deadline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Deadline(in {:?})", self.remaining())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_count_down_and_convert_to_instants() {
        // Far in the future, so no stall of this thread reaches it; every bound below
        // is measured on the same monotonic clock, so only a wrong deadline misses it.
        let timeout = Duration::from_secs(60);
        let t0 = Instant::now();
        let d = Deadline::after(timeout);
        let left = d.remaining();
        assert!(
            left <= timeout && left >= timeout - t0.elapsed(),
            "{left:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
        assert!(d.remaining() <= left - Duration::from_millis(10));
        // The round trip through an `Instant` is off by no more than the time it took.
        let t1 = Instant::now();
        let back = Deadline::at(d.instant());
        let took = u64::try_from(t1.elapsed().as_nanos()).unwrap();
        assert!(
            back.0.abs_diff(d.0) <= took,
            "off by {}ns",
            back.0.abs_diff(d.0)
        );
        let past = Deadline::at(Instant::now() - Duration::from_secs(1));
        assert!(past.is_past());
        assert_eq!(past.left("test").unwrap_err().kind(), ErrorKind::Timeout);
        assert!(!Deadline::after(Duration::MAX).is_past());
    }
}
