//! Registered regions, each with a gate that deregistration closes and then waits on,
//! so that no byte is read from or written to a region after `deregister` returns.
//!
//! A transfer holds a [`Pin`] on every region it touches while it touches it: the
//! initiator from submission until its batch ends, the target for one request. Pins are
//! per region, so deregistering one region never waits for transfers of another.

use std::collections::HashMap;
use std::sync::Arc;
use te_core::sync::{Condvar, Mutex, RwLock};

use te_core::{Access, Deadline, Error, ErrorKind, MemoryDesc, RegionId, Result};

use crate::stage::Dev;

/// One registered region.
#[derive(Debug)]
pub(crate) struct Region {
    pub(crate) id: RegionId,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) access: Access,
    /// The runtime and device of a device region; `None` for host memory.
    pub(crate) device: Option<Dev>,
    gate: Mutex<Gate>,
    closed: Condvar,
}

#[derive(Debug)]
struct Gate {
    open: bool,
    users: usize,
}

/// A region held open: while it lives, deregistration of the region waits.
#[derive(Debug)]
pub(crate) struct Pin(Arc<Region>);

impl Pin {
    pub(crate) fn region(&self) -> &Region {
        &self.0
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        let mut g = self.0.gate.lock();
        g.users -= 1;
        if g.users == 0 && !g.open {
            self.0.closed.notify_all();
        }
    }
}

/// Every region of one backend instance.
#[derive(Debug, Default)]
pub(crate) struct Regions {
    map: RwLock<HashMap<RegionId, Arc<Region>>>,
}

impl Regions {
    pub(crate) fn insert(&self, id: RegionId, mem: &MemoryDesc, device: Option<Dev>) {
        let region = Arc::new(Region {
            id,
            addr: mem.addr,
            len: mem.len,
            access: mem.access,
            device,
            gate: Mutex::new(Gate {
                open: true,
                users: 0,
            }),
            closed: Condvar::new(),
        });
        self.map.write().insert(id, region);
    }

    /// How many pins hold region `id` (0 if it is not registered).
    #[cfg(test)]
    pub(crate) fn users(&self, id: RegionId) -> usize {
        self.map.read().get(&id).map_or(0, |r| r.gate.lock().users)
    }

    /// Forgets `id` and waits until no transfer holds it, at most until `deadline`.
    ///
    /// # Errors
    /// `NotRegistered` if `id` is unknown; `Timeout` if transfers (a peer's, served
    /// here) still hold it at the deadline.
    pub(crate) fn remove(&self, id: RegionId, deadline: Deadline) -> Result<()> {
        let region = self.map.write().remove(&id).ok_or_else(|| {
            Error::new(
                ErrorKind::NotRegistered,
                format!("region {id} is not registered with the tcp backend"),
            )
        })?;
        let mut g = region.gate.lock();
        g.open = false;
        while g.users > 0 {
            let left = deadline.remaining();
            if left.is_zero() {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "{} transfers still hold region {id} at the deadline (a peer that stopped reading?)",
                        g.users
                    ),
                ));
            }
            g = region.closed.wait_timeout(g, left).0;
        }
        Ok(())
    }

    /// Holds region `id` open if `offset..offset + len` lies inside it.
    ///
    /// # Errors
    /// `NotRegistered` for an unknown or deregistering region; `OutOfBounds` for a
    /// range outside it.
    pub(crate) fn pin(&self, id: RegionId, offset: u64, len: u64) -> Result<Pin> {
        let region = self
            .map
            .read()
            .get(&id)
            .cloned()
            .ok_or_else(|| not_registered(id))?;
        if offset.checked_add(len).is_none_or(|end| end > region.len) {
            return Err(Error::new(
                ErrorKind::OutOfBounds,
                format!(
                    "range {offset}+{len} is outside region {id} of {} bytes",
                    region.len
                ),
            ));
        }
        let mut g = region.gate.lock();
        if !g.open {
            return Err(not_registered(id));
        }
        g.users += 1;
        drop(g);
        Ok(Pin(region))
    }
}

fn not_registered(id: RegionId) -> Error {
    Error::new(
        ErrorKind::NotRegistered,
        format!("region {id} is not registered (or is being deregistered)"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn soon() -> Deadline {
        Deadline::after(std::time::Duration::from_secs(10))
    }
    use std::time::Duration;
    use te_core::MemoryKind;

    fn mem(len: u64) -> MemoryDesc {
        MemoryDesc {
            name: "m".into(),
            addr: 0x1000,
            len,
            kind: MemoryKind::Host,
            access: Access::REMOTE_READ_WRITE,
        }
    }

    #[test]
    fn deregistration_waits_for_the_last_pin() {
        let regions = Arc::new(Regions::default());
        regions.insert(RegionId(1), &mem(100), None);
        let pin = regions.pin(RegionId(1), 0, 100).unwrap();
        let r = regions.clone();
        let t = std::thread::spawn(move || r.remove(RegionId(1), soon()));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!t.is_finished(), "remove returned while a pin was held");
        assert_eq!(
            regions.pin(RegionId(1), 0, 1).unwrap_err().kind(),
            ErrorKind::NotRegistered
        );
        drop(pin);
        t.join().unwrap().unwrap();
        assert!(regions.remove(RegionId(1), soon()).is_err());
    }

    #[test]
    fn ranges_outside_the_region_are_refused() {
        let regions = Regions::default();
        regions.insert(RegionId(1), &mem(100), None);
        for (off, len) in [(0, 101), (100, 1), (u64::MAX, 2)] {
            assert_eq!(
                regions.pin(RegionId(1), off, len).unwrap_err().kind(),
                ErrorKind::OutOfBounds
            );
        }
        assert!(regions.pin(RegionId(1), 99, 1).is_ok());
    }
}
