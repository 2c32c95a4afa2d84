//! Threads that take none of the process's signals, for every thread a backend starts:
//! see [`SpawnMasked`]. (The code lives in a module of its own, below the device
//! runtimes, which start threads too.)

pub use crate::signals::{mask_signals, masked, SpawnMasked};
