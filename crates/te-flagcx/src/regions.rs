//! Local registrations, and the count of batches in flight on each, so that
//! `deregister` is a barrier: it waits until no transfer posted on the region can
//! touch it any more, and only then destroys FlagCX's memory region (which does not
//! wait by itself).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Instant;
use te_core::sync::{Condvar, Mutex, RwLock};

use te_core::{Error, ErrorKind, RegionId, Result};

/// One registration.
#[derive(Debug)]
pub(crate) struct Region {
    pub(crate) id: RegionId,
    pub(crate) mr: u64,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    /// Batches posted on the region and not yet finished.
    users: AtomicUsize,
    /// Set by `deregister`; no new batch may use the region from then on.
    retiring: AtomicBool,
}

/// The backend's registrations.
#[derive(Debug, Default)]
pub(crate) struct Regions {
    map: RwLock<HashMap<RegionId, Arc<Region>>>,
    idle: Mutex<()>,
    released: Condvar,
}

impl Regions {
    pub(crate) fn insert(&self, id: RegionId, mr: u64, addr: u64, len: u64) {
        let region = Arc::new(Region {
            id,
            mr,
            addr,
            len,
            users: AtomicUsize::new(0),
            retiring: AtomicBool::new(false),
        });
        self.map.write().insert(id, region);
    }

    /// Runs `f` with the live regions, under the read lock that `retire` excludes, so
    /// that a region [`Regions::enter`]ed there cannot be retired unseen.
    pub(crate) fn with<T>(&self, f: impl FnOnce(&Live<'_>) -> T) -> T {
        let map = self.map.read();
        f(&Live(&map))
    }

    /// Counts a batch out of `region`, waking a `retire` waiting for it.
    pub(crate) fn leave(&self, region: &Region) {
        if region.users.fetch_sub(1, SeqCst) == 1 && region.retiring.load(SeqCst) {
            let _idle = self.idle.lock();
            self.released.notify_all();
        }
    }

    /// Stops new batches from using region `id`, waits until those in flight on it
    /// finished (at most until `deadline`), then forgets it and returns its memory
    /// handle for the shim to destroy. `Ok(None)` if a concurrent call removed it.
    ///
    /// # Errors
    /// `NotRegistered` for an unknown id; `Timeout` if batches still use the region at
    /// `deadline`: it stays registered (and refused to new batches), its memory must
    /// stay allocated, and a later call waits again.
    pub(crate) fn retire(&self, id: RegionId, deadline: Instant) -> Result<Option<u64>> {
        let region = {
            let map = self.map.write();
            let Some(region) = map.get(&id) else {
                return Err(Error::new(
                    ErrorKind::NotRegistered,
                    format!("region {id} is not registered with the FlagCX backend"),
                ));
            };
            region.retiring.store(true, SeqCst);
            region.clone()
        };
        let mut idle = self.idle.lock();
        loop {
            let users = region.users.load(SeqCst);
            if users == 0 {
                break;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "region {id} still has {users} FlagCX batch(es) in flight at the deadline; it stays registered and its memory must stay allocated: deregister it again once they finished"
                    ),
                ));
            }
            idle = self.released.wait_timeout(idle, left).0;
        }
        drop(idle);
        let mut map = self.map.write();
        match map.get(&id) {
            Some(r) if Arc::ptr_eq(r, &region) => {
                map.remove(&id);
                Ok(Some(region.mr))
            }
            _ => Ok(None),
        }
    }
}

/// The live regions, as [`Regions::with`] lends them.
pub(crate) struct Live<'a>(&'a HashMap<RegionId, Arc<Region>>);

impl Live<'_> {
    /// The region `id`, counted in for one more batch, unless it is unknown or being
    /// deregistered.
    ///
    /// # Errors
    /// `NotRegistered`, saying which.
    pub(crate) fn enter(&self, id: RegionId) -> Result<Arc<Region>> {
        match self.0.get(&id) {
            Some(r) if !r.retiring.load(SeqCst) => {
                r.users.fetch_add(1, SeqCst);
                Ok(r.clone())
            }
            Some(_) => Err(Error::new(
                ErrorKind::NotRegistered,
                format!("local region {id} is being deregistered from the FlagCX backend"),
            )),
            None => Err(Error::new(
                ErrorKind::NotRegistered,
                format!("local region {id} is not registered with the FlagCX backend"),
            )),
        }
    }
}
