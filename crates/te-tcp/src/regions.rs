//! Registered regions: the kit's table ([`te_core::kit::Regions`]), each region with the
//! runtime and device of device memory (`None` for host memory).
//!
//! A transfer holds a [`Pin`] on every region it touches while it touches it: the
//! initiator from submission until its batch ends (longer for a device copy in
//! flight, which cannot be stopped), the target for one request. Pins are per region,
//! so deregistering one region never waits for transfers of another.

use crate::stage::Dev;

/// Every region of one backend instance.
pub(crate) type Regions = te_core::kit::Regions<Option<Dev>>;

/// A region held open: while it lives, deregistration of the region waits.
pub(crate) type Pin = te_core::kit::Pin<Option<Dev>>;
