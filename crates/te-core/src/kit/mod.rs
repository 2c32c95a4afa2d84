//! The kit every backend builds on: mechanisms each backend needs and none should
//! write again.
//!
//! - [`Regions`] and [`Pin`]: the table of registered regions, each behind a [`Gate`]
//!   that deregistration closes and waits on, so no byte moves after `deregister`.
//! - [`Countdown`]: a batch split into slices completes once, with its first error,
//!   when its last slice is accounted for.
//! - [`fits`] and [`Access::allows`](crate::Access::allows): the range and rights
//!   checks of a request against a region.
//! - [`net`]: binding a listener and the address peers are told, a socket address in
//!   endpoint bytes, and the slots of connections still in their handshake.
//! - [`thread`]: threads that take none of the process's signals, for every thread a
//!   backend starts.
//!
//! The engine already checks every request against the regions it knows (local and
//! the peer's descriptor) and pins its local regions until the backend releases the
//! batch. A backend checks again only what it alone can see: requests a peer sends it
//! (the serving side), and its own tables where they may disagree with the engine's.

mod countdown;
mod gate;
pub mod net;
mod regions;
pub mod thread;

pub use countdown::Countdown;
pub use gate::Gate;
pub use regions::{Pin, Region, Regions};

pub use crate::request::fits;

#[cfg(test)]
mod tests {
    #[test]
    fn a_range_fits_only_inside_its_region_and_never_overflows() {
        assert!(super::fits(0, 100, 100));
        assert!(super::fits(100, 0, 100));
        assert!(!super::fits(1, 100, 100));
        assert!(!super::fits(u64::MAX, 2, u64::MAX));
    }
}
