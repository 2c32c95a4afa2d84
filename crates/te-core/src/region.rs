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
use std::time::Instant;

use crate::backend::BatchId;
use crate::batch::BatchState;
use crate::desc::RegionDesc;
use crate::error::{Error, ErrorKind, Result};
use crate::kit::Gate;

/// One registered region.
pub(crate) struct Region {
    pub(crate) desc: RegionDesc,
    /// The batches pinning the region, to abort them if deregistration must.
    pins: Mutex<HashMap<BatchId, Weak<BatchState>>>,
    gate: Gate,
    /// Its deregistration: for a `Registration` whose engine closed, and so
    /// deregistered the region, while the `Registration` lived.
    release: Mutex<Release>,
    released: Condvar,
}

/// Where a region's deregistration is.
enum Release {
    Registered,
    Running,
    Done(Result<()>),
}

impl Region {
    pub(crate) fn new(desc: RegionDesc) -> Arc<Region> {
        Arc::new(Region {
            desc,
            pins: Mutex::new(HashMap::new()),
            gate: Gate::new(),
            release: Mutex::new(Release::Registered),
            released: Condvar::new(),
        })
    }

    /// Notes that the region's deregistration has begun (it is out of the table).
    pub(crate) fn releasing(&self) {
        *self.release.lock() = Release::Running;
    }

    /// Notes that the region's deregistration ended without a result (it unwound), if
    /// it was under way: whoever waits for it learns that te may still touch the memory.
    pub(crate) fn abandon(&self) {
        let mut st = self.release.lock();
        if matches!(*st, Release::Running) {
            *st = Release::Done(Err(Error::new(
                ErrorKind::Backend,
                format!("the deregistration of region {} did not finish (a panic); te may still touch its memory, which must never be freed", self.desc.id),
            )));
            self.released.notify_all();
        }
    }

    /// Notes how the region's deregistration ended.
    pub(crate) fn released(&self, result: &Result<()>) {
        *self.release.lock() = Release::Done(result.clone());
        self.released.notify_all();
    }

    /// How the region's deregistration ended, waiting for it if it is under way.
    ///
    /// # Errors
    /// Its error, or `NotRegistered` if none has begun.
    pub(crate) fn release_result(&self) -> Result<()> {
        let mut st = self.release.lock();
        loop {
            match &*st {
                Release::Done(r) => return r.clone(),
                Release::Running => {
                    st = self.released.wait(st);
                }
                Release::Registered => {
                    return Err(Error::new(
                        ErrorKind::NotRegistered,
                        format!(
                            "region {} is registered, not being deregistered",
                            self.desc.id
                        ),
                    ))
                }
            }
        }
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
        self.gate.wait_empty(until) == 0
    }

    /// Holds the region against its deregistration, which waits for a hold as for a
    /// batch's pin (and aborts nothing for it), while something is built over its
    /// memory: a KV layout's views, until they are published or undone.
    pub(crate) fn hold(self: &Arc<Self>) -> Hold {
        self.gate.enter_again();
        Hold(self.clone())
    }

    fn unpin(&self, batch: BatchId) {
        self.pins.lock().remove(&batch);
        self.gate.leave();
    }
}

/// A hold on a region ([`Region::hold`]), let go when dropped.
pub(crate) struct Hold(Arc<Region>);

impl Drop for Hold {
    fn drop(&mut self) {
        self.0.gate.leave();
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
            // The engine's table, not the gate, refuses batches on a region being
            // deregistered: it is out of the table before its gate is waited on.
            r.gate.enter_again();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desc::{Access, MemoryKind, RegionId};
    use crate::time::Deadline;
    use std::time::Duration;

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
