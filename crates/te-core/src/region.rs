//! Registered regions as the engine keeps them: their descriptors, and the batches
//! that pin them.
//!
//! A batch pins each of its local regions from the moment its requests are checked
//! until its backend releases it. Deregistration removes the region from the table
//! first (so no new batch can pin it), then waits for the pins to go, and only then
//! asks the backend to forget the region: so no batch in flight ever finds its memory
//! deregistered, let alone freed, under it.

use crate::sync::{Condvar, Mutex};
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::backend::BatchId;
use crate::batch::BatchState;
use crate::desc::RegionDesc;

/// One registered region.
pub(crate) struct Region {
    pub(crate) desc: RegionDesc,
    pins: Mutex<HashMap<BatchId, Weak<BatchState>>>,
    unpinned: Condvar,
}

impl Region {
    pub(crate) fn new(desc: RegionDesc) -> Arc<Region> {
        Arc::new(Region {
            desc,
            pins: Mutex::new(HashMap::new()),
            unpinned: Condvar::new(),
        })
    }

    /// The batches pinning the region now.
    pub(crate) fn pinned(&self) -> Vec<Arc<BatchState>> {
        self.pins
            .lock()
            .values()
            .filter_map(Weak::upgrade)
            .collect()
    }

    /// Waits until no batch pins the region, until `until` (or for good with `None`).
    /// Returns whether none does.
    pub(crate) fn wait_unpinned(&self, until: Option<Instant>) -> bool {
        let mut pins = self.pins.lock();
        while !pins.is_empty() {
            pins = match until {
                None => self.unpinned.wait(pins),
                Some(end) => {
                    let left = end.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return false;
                    }
                    self.unpinned
                        .wait_timeout(pins, left.min(Duration::from_secs(3600)))
                        .0
                }
            };
        }
        true
    }

    fn unpin(&self, batch: BatchId) {
        let mut pins = self.pins.lock();
        pins.remove(&batch);
        if pins.is_empty() {
            self.unpinned.notify_all();
        }
    }
}

/// A batch's pins on its local regions; dropped when the backend releases the batch.
pub(crate) struct Pins {
    batch: BatchId,
    regions: Vec<Arc<Region>>,
}

impl Pins {
    /// Pins each of `regions` (distinct) for `state`.
    pub(crate) fn new(state: &Arc<BatchState>, regions: Vec<Arc<Region>>) -> Pins {
        for r in &regions {
            r.pins.lock().insert(state.id(), Arc::downgrade(state));
        }
        Pins {
            batch: state.id(),
            regions,
        }
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        for r in &self.regions {
            r.unpin(self.batch);
        }
    }
}

/// Whether `offset + len` fits in `region_len`, without overflow.
pub(crate) fn fits(offset: u64, len: u64, region_len: u64) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= region_len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desc::{Access, MemoryKind, RegionId};
    use crate::time::Deadline;

    fn region() -> Arc<Region> {
        Region::new(RegionDesc {
            id: RegionId(1),
            name: "r".into(),
            addr: 4096,
            len: 4096,
            kind: MemoryKind::Host,
            access: Access::LOCAL,
            key: Vec::new(),
        })
    }

    #[test]
    fn a_region_is_unpinned_when_the_last_batch_releases_it() {
        let r = region();
        let a = BatchState::new(BatchId(1), Deadline::after(Duration::from_secs(9)));
        let b = BatchState::new(BatchId(2), Deadline::after(Duration::from_secs(9)));
        let pa = Pins::new(&a, vec![r.clone()]);
        let pb = Pins::new(&b, vec![r.clone()]);
        assert_eq!(r.pinned().len(), 2);
        assert!(!r.wait_unpinned(Some(Instant::now() + Duration::from_millis(10))));
        drop(pa);
        let r2 = r.clone();
        let waiter = std::thread::spawn(move || r2.wait_unpinned(None));
        std::thread::sleep(Duration::from_millis(20));
        drop(pb);
        assert!(waiter.join().unwrap());
        assert!(r.pinned().is_empty());
    }
}
