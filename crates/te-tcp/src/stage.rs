//! Staging device memory through pinned host memory.
//!
//! Sockets cannot read or write device memory, so a slice of a device region travels
//! through pinned host memory: on the sending side the device→host copies of a slice
//! fill a range the socket then sends from, on the receiving side the socket fills a
//! range host→device copies then empty. A slice may gather many small blocks (a
//! scatter-gather frame): they are packed one after another in its range and copied as
//! one group, which synchronises once rather than once per block.
//!
//! Each direction of each connection has, per runtime, one [`Pool`]: a pinned range
//! allocated once with the runtime's `alloc_pinned` and handed out by bytes as a ring,
//! so a frame of 4 KiB takes 4 KiB of it, not a whole slice's worth, and as many
//! frames are staged at once as their bytes allow. Ranges are taken in order and may
//! come back in any order; the space of one that comes back early is reused once those
//! taken before it are back too. While copies into some ranges run, the socket works
//! on others, which is the pipeline. A direction's pool is only ever waited for by that
//! direction, and its ranges are freed by copies or by the socket alone, so the two
//! directions cannot wait on each other.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use te_core::sync::Mutex;
use tokio::sync::Notify;

use te_core::device::{DeviceCopy, DeviceRuntime};
use te_core::{Error, ErrorKind, Result};

/// A device region's runtime and device ordinal.
pub(crate) type Dev = (Arc<dyn DeviceRuntime>, u32);

/// Staged bytes one direction keeps in flight per runtime, at most, unless two of the
/// largest slices need more; at least 16 slices' worth below that.
const RING_BYTES: usize = 4 << 20;

/// Every staged range starts on this boundary (a cache line; copy engines prefer it).
const ALIGN: usize = 64;

/// Which bytes of a ring are taken: the ranges (offset, length, back) in the order
/// they were taken. `first` numbers the oldest, so a range finds its entry at once.
#[derive(Debug, Default)]
struct Ring {
    live: VecDeque<(usize, usize, bool)>,
    first: u64,
}

impl Ring {
    /// Where `len` bytes (a multiple of [`ALIGN`], at most `cap`) fit after the newest
    /// range without reaching the oldest, and the range's number; `None` if they do not
    /// fit until older ranges come back.
    fn take(&mut self, len: usize, cap: usize) -> Option<(usize, u64)> {
        let at = match (self.live.front(), self.live.back()) {
            (Some(&(head, ..)), Some(&(off, n, _))) => {
                let tail = off + n;
                if head <= off {
                    // Taken: [head, tail). Free: [tail, cap) and [0, head).
                    if len <= cap - tail {
                        tail
                    } else if len <= head {
                        0
                    } else {
                        return None;
                    }
                } else if len <= head - tail {
                    // Wrapped: taken [head, cap) and [0, tail); free [tail, head).
                    tail
                } else {
                    return None;
                }
            }
            _ => 0,
        };
        self.live.push_back((at, len, false));
        Some((at, self.first + self.live.len() as u64 - 1))
    }

    /// Gives range `seq` back, and with it every range taken before it that is back.
    fn give(&mut self, seq: u64) {
        let i = usize::try_from(seq - self.first).unwrap_or(usize::MAX);
        if let Some(e) = self.live.get_mut(i) {
            e.2 = true;
        }
        while self.live.front().is_some_and(|e| e.2) {
            self.live.pop_front();
            self.first += 1;
        }
    }
}

/// A backend's staging memory, over all its connections: pinned, and taken now.
#[derive(Debug, Default)]
pub(crate) struct Usage {
    pinned: AtomicU64,
    in_use: AtomicU64,
}

impl Usage {
    /// The backend's gauges of it, as `TransferBackend::gauges` reports them.
    pub(crate) fn gauges(&self) -> Vec<(String, u64)> {
        vec![
            (
                "staging_bytes_pinned".into(),
                self.pinned.load(Ordering::Relaxed),
            ),
            (
                "staging_bytes_in_use".into(),
                self.in_use.load(Ordering::Relaxed),
            ),
        ]
    }
}

/// One runtime's pinned staging memory for one direction, handed out by bytes.
pub(crate) struct Pool {
    rt: Arc<dyn DeviceRuntime>,
    base: usize,
    cap: usize,
    usage: Arc<Usage>,
    ring: Mutex<Ring>,
    /// Wakes the one task of this pool's direction waiting for room.
    returned: Notify,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("runtime", &self.rt.name())
            .field("bytes", &self.cap)
            .finish()
    }
}

impl Pool {
    fn new(rt: Arc<dyn DeviceRuntime>, cap: usize, usage: Arc<Usage>) -> Result<Pool> {
        let base = rt.alloc_pinned(cap)? as usize;
        usage.pinned.fetch_add(cap as u64, Ordering::Relaxed);
        Ok(Pool {
            rt,
            base,
            cap,
            usage,
            ring: Mutex::new(Ring::default()),
            returned: Notify::new(),
        })
    }

    /// `len` bytes rounded up to [`ALIGN`], or an error if they could never fit.
    fn size(&self, len: usize) -> Result<usize> {
        let n = len.max(1).div_ceil(ALIGN).saturating_mul(ALIGN);
        if n > self.cap {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                format!(
                    "a staged frame of {len} bytes is larger than the {} bytes of pinned \
                     staging memory per connection; use a smaller slice_size",
                    self.cap
                ),
            ));
        }
        Ok(n)
    }

    /// `len` bytes of staging memory, if they are free now.
    ///
    /// # Errors
    /// `InvalidRequest` if `len` is larger than the whole pool.
    pub(crate) fn try_take(self: &Arc<Self>, len: usize) -> Result<Option<StageBuf>> {
        let n = self.size(len)?;
        let Some((off, seq)) = self.ring.lock().take(n, self.cap) else {
            return Ok(None);
        };
        self.usage.in_use.fetch_add(n as u64, Ordering::Relaxed);
        Ok(Some(StageBuf {
            pool: self.clone(),
            ptr: self.base + off,
            len: n,
            seq,
        }))
    }

    /// `len` bytes of staging memory, waiting until copies or sends give back enough.
    /// Only one task (the direction that owns the pool) waits at a time.
    ///
    /// # Errors
    /// `InvalidRequest` if `len` is larger than the whole pool.
    pub(crate) async fn take(self: &Arc<Self>, len: usize) -> Result<StageBuf> {
        loop {
            if let Some(b) = self.try_take(len)? {
                return Ok(b);
            }
            // A range given back since `try_take` left a permit: this returns at once.
            self.returned.notified().await;
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // SAFETY: `base` came from this runtime's `alloc_pinned(cap)`; the pool drops
        // only when no `StageBuf` (which holds an `Arc` of it) is left.
        unsafe { self.rt.free_pinned(self.base as *mut u8, self.cap) };
        self.usage
            .pinned
            .fetch_sub(self.cap as u64, Ordering::Relaxed);
    }
}

/// Staging memory taken from a [`Pool`]; dropping it gives it back.
#[derive(Debug)]
pub(crate) struct StageBuf {
    pool: Arc<Pool>,
    ptr: usize,
    /// Bytes taken (rounded up to [`ALIGN`]).
    len: usize,
    seq: u64,
}

impl StageBuf {
    /// The range's start; it holds the bytes asked for, no more.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr as *mut u8
    }
}

impl Drop for StageBuf {
    fn drop(&mut self) {
        self.pool.ring.lock().give(self.seq);
        let usage = &self.pool.usage;
        usage.in_use.fetch_sub(self.len as u64, Ordering::Relaxed);
        self.pool.returned.notify_one();
    }
}

/// One direction's pools, one per runtime, made on first use.
#[derive(Debug)]
pub(crate) struct Pools {
    cap: usize,
    pools: Mutex<Vec<Arc<Pool>>>,
    usage: Arc<Usage>,
}

impl Pools {
    /// Pools that hold 16 slices of `slice` bytes, but at most [`RING_BYTES`], and at
    /// least two slices: small slices pin little memory per connection.
    /// Their memory is counted in `usage`, the backend's.
    pub(crate) fn new(slice: u64, usage: &Arc<Usage>) -> Pools {
        let slice = usize::try_from(slice).unwrap_or(usize::MAX / 32);
        let slice = slice.div_ceil(ALIGN) * ALIGN;
        Pools {
            cap: slice.saturating_mul(16).min(RING_BYTES).max(slice * 2),
            pools: Mutex::new(Vec::new()),
            usage: usage.clone(),
        }
    }

    /// The pool of `rt`, allocating its memory the first time.
    ///
    /// # Errors
    /// The runtime's error if pinned memory cannot be allocated.
    pub(crate) fn get(&self, rt: &Arc<dyn DeviceRuntime>) -> Result<Arc<Pool>> {
        let mut pools = self.pools.lock();
        if let Some(p) = pools.iter().find(|p| p.rt.name() == rt.name()) {
            return Ok(p.clone());
        }
        let p = Arc::new(Pool::new(rt.clone(), self.cap, self.usage.clone())?);
        pools.push(p.clone());
        Ok(p)
    }
}

/// A staged frame of at most this many bytes is copied by the thread that holds it,
/// which waits for the device itself ([`DeviceRuntime::copy_group_wait`]), where that
/// thread would otherwise hand the frame to a runtime thread and be woken back: for a
/// small frame those two wake-ups cost more than the copy. Larger frames are copied
/// asynchronously, so the socket works on one while the device copies the next.
pub(crate) const INLINE_COPY: usize = 64 << 10;

/// Runs `copies` on `rt` as one group on this thread and returns its result.
///
/// # Safety
/// As [`DeviceRuntime::copy`], for every copy.
pub(crate) unsafe fn run_now(rt: &Arc<dyn DeviceRuntime>, copies: &[DeviceCopy]) -> Result<()> {
    // SAFETY: forwarded from the caller.
    unsafe { rt.copy_group_wait(copies) }
}

/// Starts `copies` on `rt` as one group ([`DeviceRuntime::copy_group`]): one
/// synchronisation per queue for all of them rather than one per copy. `done` runs
/// exactly once, after the last one has ended, with the first error if any failed —
/// from the runtime's thread, or here if the group cannot start.
///
/// # Safety
/// As [`DeviceRuntime::copy`], for every copy: whatever `done` owns (buffers, pins)
/// must keep all their ranges valid until it runs.
pub(crate) unsafe fn start_all(
    rt: &Arc<dyn DeviceRuntime>,
    copies: Vec<DeviceCopy>,
    done: impl FnOnce(Result<()>) + Send + 'static,
) {
    let once = Arc::new(Mutex::new(Some(done)));
    let theirs = once.clone();
    // SAFETY: forwarded from the caller.
    let started = unsafe {
        rt.copy_group(
            &copies,
            Box::new(move |r| {
                let f = theirs.lock().take();
                if let Some(f) = f {
                    f(r);
                }
            }),
        )
    };
    if let Err(e) = started {
        // The runtime will not run its callback: report the error ourselves.
        let f = once.lock().take();
        if let Some(f) = f {
            f(Err(e));
        }
    }
}

/// The copies that stage `pieces` (device address, bytes), packed one after another
/// from `buf`: each run of pieces that also follow one another on the device becomes
/// one copy (device address, its part of the buffer, bytes), so a frame of adjacent
/// blocks launches one copy rather than one per block.
pub(crate) fn packed(
    pieces: impl IntoIterator<Item = (u64, usize)>,
    buf: *mut u8,
) -> Vec<(u64, *mut u8, usize)> {
    let mut runs: Vec<(u64, *mut u8, usize)> = Vec::new();
    let mut at = 0usize;
    for (device, len) in pieces {
        match runs.last_mut() {
            Some(run) if run.0.checked_add(run.2 as u64) == Some(device) => run.2 += len,
            // The pieces add up to at most the buffer's length.
            _ => runs.push((device, buf.wrapping_add(at), len)),
        }
        at += len;
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::{packed, Pools, Ring, Usage, ALIGN};
    use std::sync::Arc;
    use std::time::Duration;

    /// Live ranges lie inside the ring, on the boundary, and apart.
    fn check(ring: &Ring, cap: usize) {
        let mut spans: Vec<(usize, usize)> = ring.live.iter().map(|&(o, n, _)| (o, n)).collect();
        spans.sort_unstable();
        for &(o, n) in &spans {
            assert!(o % ALIGN == 0 && n > 0 && o + n <= cap, "{o}+{n} in {cap}");
        }
        for w in spans.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "overlap: {spans:?}");
        }
    }

    #[test]
    fn ranges_given_back_in_any_order_are_never_handed_out_twice() {
        let cap = 64 * ALIGN;
        let mut ring = Ring::default();
        let mut held: Vec<u64> = Vec::new();
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut taken = 0;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if x % 3 != 0 || held.is_empty() {
                let len = ((x >> 8) as usize % 20 + 1) * ALIGN;
                if let Some((_, seq)) = ring.take(len, cap) {
                    held.push(seq);
                    taken += 1;
                }
            } else {
                let i = (x >> 16) as usize % held.len();
                ring.give(held.swap_remove(i));
            }
            check(&ring, cap);
        }
        assert!(taken > 5_000, "the ring refused too often: {taken}");
        for seq in held {
            ring.give(seq);
        }
        assert!(ring.live.is_empty());
    }

    #[test]
    fn space_given_back_early_waits_for_the_ranges_taken_before_it() {
        let cap = 8 * ALIGN;
        let mut ring = Ring::default();
        let (a, sa) = ring.take(4 * ALIGN, cap).unwrap();
        let (b, sb) = ring.take(4 * ALIGN, cap).unwrap();
        assert_eq!((a, b), (0, 4 * ALIGN));
        ring.give(sb);
        assert!(ring.take(ALIGN, cap).is_none(), "b's space is behind a");
        ring.give(sa);
        assert_eq!(ring.take(8 * ALIGN, cap).map(|t| t.0), Some(0));
    }

    #[test]
    fn a_ring_wraps_to_its_start_when_the_end_is_too_short() {
        let cap = 10 * ALIGN;
        let mut ring = Ring::default();
        let (_, s1) = ring.take(4 * ALIGN, cap).unwrap();
        let (_, s2) = ring.take(4 * ALIGN, cap).unwrap();
        ring.give(s1);
        // 2 free at the end, 4 at the start: 3 goes to the start.
        assert_eq!(ring.take(3 * ALIGN, cap).map(|t| t.0), Some(0));
        // Wrapped: only the one unit between the new range and s2 is free.
        assert_eq!(ring.take(ALIGN, cap).map(|t| t.0), Some(3 * ALIGN));
        assert!(ring.take(ALIGN, cap).is_none());
        ring.give(s2);
        check(&ring, cap);
    }

    #[tokio::test]
    async fn a_direction_waits_for_room_and_wakes_when_it_comes_back() {
        let rt = te_core::device::runtime(te_core::device::fakedev::NAME).expect("fakedev");
        let usage = Arc::new(Usage::default());
        let pools = Pools::new(4096, &usage);
        let pool = pools.get(&rt).unwrap();
        let cap = pool.cap;
        let small = pool.try_take(4096).unwrap().unwrap();
        // A frame of 4 KiB takes 4 KiB, not a slice's worth.
        let rest = pool.try_take(cap - 4096).unwrap().unwrap();
        assert!(pool.try_take(1).unwrap().is_none());
        let e = pool.try_take(cap + 1).unwrap_err();
        assert!(e.to_string().contains("slice_size"), "{e}");
        let p = pool.clone();
        let waiter = tokio::spawn(async move { p.take(8192).await.map(|b| b.ptr() as usize) });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "no room yet");
        let start = small.ptr() as usize;
        // 4 KiB back at the start is still too little for 8 KiB.
        drop(small);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "4 KiB free, 8 KiB wanted");
        drop(rest);
        let got = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("woken")
            .unwrap()
            .unwrap();
        assert_eq!(got, start);
        assert_eq!(Arc::strong_count(&pool), 2, "the pool and `pools`");
    }

    #[test]
    fn adjacent_pieces_stage_as_one_copy_and_the_rest_keep_their_place_in_the_buffer() {
        let buf = 0x1000 as *mut u8;
        let runs = packed([(100, 10), (110, 5), (200, 10), (50, 10), (60, 1)], buf);
        let runs: Vec<(u64, usize, usize)> = runs
            .into_iter()
            .map(|(d, h, l)| (d, h as usize - 0x1000, l))
            .collect();
        assert_eq!(runs, [(100, 0, 15), (200, 15, 10), (50, 25, 11)]);
    }
}
