//! Local registrations in the kit's table (`te_core::kit::Regions`), each with its
//! FlagCX memory handle, so that `deregister` is a barrier: it waits until no batch
//! posted on the region can touch it any more, and only then destroys FlagCX's memory
//! region (which does not wait by itself).

/// The backend's registrations; each region's data is its FlagCX memory handle.
pub(crate) type Regions = te_core::kit::Regions<u64>;

/// A batch's hold on one of its local regions.
pub(crate) type Pin = te_core::kit::Pin<u64>;
