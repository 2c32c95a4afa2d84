//! Staging device memory through pinned host buffers.
//!
//! Sockets cannot read or write device memory, so a slice of a device region travels
//! through a pinned host buffer: on the sending side the device→host copies of a slice
//! fill a buffer the socket then sends from, on the receiving side the socket fills a
//! buffer host→device copies then empty. A slice may gather many small blocks (a
//! scatter-gather frame): they are packed one after another in its buffer and copied as
//! one group, which synchronises once rather than once per block. Each direction of each connection has its
//! own small [`Pool`] of buffers per runtime, allocated once with the runtime's
//! `alloc_pinned` and reused, so no slice allocates; while copies of some buffers run,
//! the socket works on others, which is the pipeline. A direction's buffers are only
//! ever waited for by that direction, and are freed by copies or by the socket alone,
//! so the two directions cannot wait on each other.

use std::sync::Arc;

use te_core::sync::Mutex;
use tokio::sync::Notify;

use te_core::device::{DeviceCopy, DeviceRuntime};
use te_core::Result;

/// A device region's runtime and device ordinal.
pub(crate) type Dev = (Arc<dyn DeviceRuntime>, u32);

/// Staged bytes kept in flight per direction and runtime, at most.
const POOL_BYTES: usize = 8 << 20;

/// Pinned host buffers of one runtime, each `size` bytes.
pub(crate) struct Pool {
    rt: Arc<dyn DeviceRuntime>,
    size: usize,
    all: Vec<usize>,
    free: Mutex<Vec<usize>>,
    /// Wakes the one task of this pool's direction waiting for a buffer.
    returned: Notify,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("runtime", &self.rt.name())
            .field("buffers", &self.all.len())
            .field("size", &self.size)
            .finish()
    }
}

impl Pool {
    fn new(rt: Arc<dyn DeviceRuntime>, count: usize, size: usize) -> Result<Pool> {
        let mut pool = Pool {
            rt,
            size,
            all: Vec::with_capacity(count),
            free: Mutex::new(Vec::with_capacity(count)),
            returned: Notify::new(),
        };
        for _ in 0..count {
            // On an error `pool` drops and frees what was allocated.
            let p = pool.rt.alloc_pinned(size)? as usize;
            pool.all.push(p);
        }
        *pool.free.get_mut() = pool.all.clone();
        Ok(pool)
    }

    /// A free buffer, if there is one.
    pub(crate) fn try_take(self: &Arc<Self>) -> Option<StageBuf> {
        let p = self.free.lock().pop()?;
        Some(StageBuf {
            pool: self.clone(),
            ptr: p,
        })
    }

    /// A free buffer, waiting until a copy or a send returns one. Only one task (the
    /// direction that owns the pool) waits at a time.
    pub(crate) async fn take(self: &Arc<Self>) -> StageBuf {
        loop {
            if let Some(b) = self.try_take() {
                return b;
            }
            // A buffer returned since `try_take` left a permit: this returns at once.
            self.returned.notified().await;
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        for &p in &self.all {
            // SAFETY: every buffer came from this runtime's `alloc_pinned(size)`; the
            // pool drops only when no `StageBuf` (which holds an `Arc` of it) is left.
            unsafe { self.rt.free_pinned(p as *mut u8, self.size) };
        }
    }
}

/// One buffer taken from a [`Pool`]; dropping it gives it back.
#[derive(Debug)]
pub(crate) struct StageBuf {
    pool: Arc<Pool>,
    ptr: usize,
}

impl StageBuf {
    /// The buffer's start; it holds the pool's `size` bytes (at least `slice_size`).
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr as *mut u8
    }
}

impl Drop for StageBuf {
    fn drop(&mut self) {
        self.pool.free.lock().push(self.ptr);
        self.pool.returned.notify_one();
    }
}

/// One direction's pools, one per runtime, made on first use.
#[derive(Debug)]
pub(crate) struct Pools {
    size: usize,
    count: usize,
    pools: Mutex<Vec<Arc<Pool>>>,
}

impl Pools {
    /// Pools of buffers of `slice` bytes.
    pub(crate) fn new(slice: u64) -> Pools {
        let size = usize::try_from(slice).unwrap_or(usize::MAX);
        Pools {
            size,
            count: (POOL_BYTES / size.max(1)).clamp(2, 8),
            pools: Mutex::new(Vec::new()),
        }
    }

    /// The pool of `rt`, allocating its buffers the first time.
    ///
    /// # Errors
    /// The runtime's error if pinned memory cannot be allocated.
    pub(crate) fn get(&self, rt: &Arc<dyn DeviceRuntime>) -> Result<Arc<Pool>> {
        let mut pools = self.pools.lock();
        if let Some(p) = pools.iter().find(|p| p.rt.name() == rt.name()) {
            return Ok(p.clone());
        }
        let p = Arc::new(Pool::new(rt.clone(), self.count, self.size)?);
        pools.push(p.clone());
        Ok(p)
    }
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
    use super::packed;

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
