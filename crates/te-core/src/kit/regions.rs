//! A backend's table of registered regions, each behind a [`Gate`], and the [`Pin`]
//! that holds one open while a transfer touches it.
//!
//! A transfer pins every region it touches for as long as it touches it: the side that
//! serves a peer for one request, the initiator for as long as its fabric may still
//! move bytes (which can outlast the batch: a device copy in flight, a work request a
//! QP has not flushed). [`Regions::retire`] closes the region's gate, so no new pin is
//! taken, and waits for the pins there are; only after it returns `Ok` may the backend
//! forget the memory. A region whose wait reached the deadline stays in the table,
//! closed: new transfers are refused, and a later `retire` waits again.

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Instant;

use super::fits;
use super::gate::Gate;
use crate::desc::{Access, RegionId};
use crate::error::{Error, ErrorKind, Result};
use crate::sync::RwLock;

/// One registered region, with what its backend keeps beside it (`data`).
#[derive(Debug)]
pub struct Region<T> {
    /// The engine's id of the region.
    pub id: RegionId,
    /// Its first byte's address.
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
    /// What peers may do with it.
    pub access: Access,
    /// The backend's own state for the region (its device, memory handles, NICs).
    pub data: T,
    gate: Gate,
}

impl<T> Region<T> {
    /// The pins held on the region now.
    pub fn pins(&self) -> usize {
        self.gate.users()
    }
}

/// A region held open: while it lives, [`Regions::retire`] of the region waits.
#[derive(Debug)]
pub struct Pin<T>(Arc<Region<T>>);

impl<T> Pin<T> {
    /// The region pinned.
    pub fn region(&self) -> &Arc<Region<T>> {
        &self.0
    }
}

impl<T> Deref for Pin<T> {
    type Target = Region<T>;
    fn deref(&self) -> &Region<T> {
        &self.0
    }
}

impl<T> Clone for Pin<T> {
    /// One more pin on the same region, even a closing one: the closer waits for
    /// this pin's original anyway.
    fn clone(&self) -> Pin<T> {
        self.0.gate.enter_again();
        Pin(self.0.clone())
    }
}

impl<T> Drop for Pin<T> {
    fn drop(&mut self) {
        self.0.gate.leave();
    }
}

/// Every registered region of one backend instance.
#[derive(Debug)]
pub struct Regions<T> {
    /// The backend's name, for errors.
    backend: &'static str,
    map: RwLock<HashMap<RegionId, Arc<Region<T>>>>,
}

impl<T> Regions<T> {
    /// An empty table; `backend` names the backend in its errors.
    pub fn new(backend: &'static str) -> Regions<T> {
        Regions {
            backend,
            map: RwLock::new(HashMap::new()),
        }
    }

    /// Adds region `id` (replacing a region of that id, which the engine never
    /// reuses).
    pub fn insert(&self, id: RegionId, addr: u64, len: u64, access: Access, data: T) {
        let region = Arc::new(Region {
            id,
            addr,
            len,
            access,
            data,
            gate: Gate::new(),
        });
        self.map.write().insert(id, region);
    }

    /// Region `id`, open or closing, without pinning it.
    pub fn get(&self, id: RegionId) -> Option<Arc<Region<T>>> {
        self.map.read().get(&id).cloned()
    }

    /// Pins region `id`.
    ///
    /// # Errors
    /// `NotRegistered` for an unknown region or one being deregistered.
    pub fn pin(&self, id: RegionId) -> Result<Pin<T>> {
        let region = self.map.read().get(&id).cloned();
        match region {
            Some(r) if r.gate.enter() => Ok(Pin(r)),
            Some(_) => Err(Error::new(
                ErrorKind::NotRegistered,
                format!(
                    "region {id} is being deregistered from the {} backend",
                    self.backend
                ),
            )),
            None => Err(Error::new(
                ErrorKind::NotRegistered,
                format!(
                    "region {id} is not registered with the {} backend",
                    self.backend
                ),
            )),
        }
    }

    /// Pins region `id` if `offset..offset + len` lies inside it.
    ///
    /// # Errors
    /// As [`Regions::pin`]; `OutOfBounds` for a range outside the region.
    pub fn pin_range(&self, id: RegionId, offset: u64, len: u64) -> Result<Pin<T>> {
        let pin = self.pin(id)?;
        if !fits(offset, len, pin.len) {
            return Err(Error::new(
                ErrorKind::OutOfBounds,
                format!(
                    "range {offset}+{len} is outside region {id} of {} bytes",
                    pin.len
                ),
            ));
        }
        Ok(pin)
    }

    /// Closes region `id` to new pins, waits until none holds it (at most until
    /// `deadline`), then takes it out of the table and returns it, for the backend to
    /// release what it holds for the memory; `None` if a concurrent call for the same
    /// region took it first (and releases it).
    ///
    /// # Errors
    /// `NotRegistered` if `id` is unknown; `Timeout` if pins still hold it at
    /// `deadline`: it stays in the table, refused to new transfers, its memory must
    /// stay allocated, and a later call waits again.
    pub fn retire(&self, id: RegionId, deadline: Instant) -> Result<Option<Arc<Region<T>>>> {
        let region = self.get(id).ok_or_else(|| {
            Error::new(
                ErrorKind::NotRegistered,
                format!(
                    "region {id} is not registered with the {} backend",
                    self.backend
                ),
            )
        })?;
        region.gate.close();
        let pins = region.gate.wait_empty(Some(deadline));
        if pins > 0 {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "{pins} transfer(s) of the {} backend still hold region {id} at the deadline (a peer that stopped reading, or a fabric still flushing?); new transfers are refused and the memory must stay allocated: deregister it again once they finished",
                    self.backend
                ),
            ));
        }
        let mut map = self.map.write();
        if !map.get(&id).is_some_and(|r| Arc::ptr_eq(r, &region)) {
            return Ok(None);
        }
        map.remove(&id);
        Ok(Some(region))
    }

    /// Forgets every region (a backend closing): each is dropped once its last pin
    /// goes.
    pub fn clear(&self) {
        self.map.write().clear();
    }

    /// Runs `f` on every region in the table.
    pub fn for_each(&self, mut f: impl FnMut(&Arc<Region<T>>)) {
        for r in self.map.read().values() {
            f(r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    fn table() -> Arc<Regions<()>> {
        let regions = Arc::new(Regions::new("test"));
        regions.insert(RegionId(1), 0x1000, 100, Access::REMOTE_READ_WRITE, ());
        regions
    }

    #[test]
    fn retiring_waits_for_the_last_pin_and_refuses_new_ones() {
        let regions = table();
        let pin = regions.pin_range(RegionId(1), 0, 100).unwrap();
        let again = pin.clone();
        let r = regions.clone();
        let t = std::thread::spawn(move || r.retire(RegionId(1), soon()).map(|r| r.is_some()));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!t.is_finished(), "retire returned while a pin was held");
        let e = regions.pin(RegionId(1)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotRegistered);
        assert!(e.message().contains("being deregistered"), "{e}");
        drop(pin);
        std::thread::sleep(Duration::from_millis(20));
        assert!(
            !t.is_finished(),
            "retire returned while a cloned pin was held"
        );
        drop(again);
        assert!(
            t.join().unwrap().unwrap(),
            "the only retire did not get the region"
        );
        assert!(regions.get(RegionId(1)).is_none());
        assert_eq!(
            regions.retire(RegionId(1), soon()).unwrap_err().kind(),
            ErrorKind::NotRegistered
        );
    }

    #[test]
    fn a_region_still_pinned_at_the_deadline_stays_closed_and_is_waited_for_again() {
        let regions = table();
        let pin = regions.pin(RegionId(1)).unwrap();
        let e = regions
            .retire(RegionId(1), Instant::now() + Duration::from_millis(10))
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout);
        assert!(regions.get(RegionId(1)).is_some());
        assert_eq!(
            regions.pin(RegionId(1)).unwrap_err().kind(),
            ErrorKind::NotRegistered
        );
        drop(pin);
        regions.retire(RegionId(1), soon()).unwrap();
    }

    #[test]
    fn ranges_outside_the_region_are_refused() {
        let regions = table();
        for (off, len) in [(0, 101), (100, 1), (u64::MAX, 2)] {
            assert_eq!(
                regions.pin_range(RegionId(1), off, len).unwrap_err().kind(),
                ErrorKind::OutOfBounds
            );
        }
        let pin = regions.pin_range(RegionId(1), 99, 1).unwrap();
        assert_eq!(pin.pins(), 1);
    }
}
