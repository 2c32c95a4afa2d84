//! Raw addresses to regions, for callers that name memory by address (Mooncake's
//! `transfer_addrs`): local addresses through the map an engine keeps of the
//! registrations made through it, the peer's through its descriptor.

use std::collections::BTreeMap;
use std::sync::Arc;
use te_core::sync::RwLock;

use te::{Peer, RegionId};

/// Local regions by start address, for callers that name memory by raw address.
pub(crate) type AddrMap = Arc<RwLock<BTreeMap<u64, Vec<(u64, RegionId)>>>>;

/// The local region of `map` (an [`AddrMap`]'s contents) that holds `addr .. addr +
/// len`, and the offset of `addr` in it.
pub(crate) fn local_region(
    map: &BTreeMap<u64, Vec<(u64, RegionId)>>,
    addr: u64,
    len: u64,
) -> Option<(RegionId, u64)> {
    map.range(..=addr).rev().find_map(|(start, regions)| {
        regions
            .iter()
            .find(|(rlen, _)| te::backend::kit::fits(addr - start, len, *rlen))
            .map(|(_, id)| (*id, addr - start))
    })
}

/// The peer's regions as last fetched: (start, length, id), by start address.
pub(crate) fn remote_regions(peer: &Peer) -> Vec<(u64, u64, RegionId)> {
    let mut r: Vec<_> = peer
        .segment()
        .regions
        .iter()
        .map(|r| (r.addr, r.len, r.id))
        .collect();
    r.sort_unstable_by_key(|r| r.0);
    r
}

/// The region of `regions` (from [`remote_regions`]) that holds `addr .. addr + len`,
/// and the offset of `addr` in it.
pub(crate) fn find(
    regions: &[(u64, u64, RegionId)],
    addr: u64,
    len: u64,
) -> Option<(RegionId, u64)> {
    let end = addr.checked_add(len)?;
    let upto = regions.partition_point(|r| r.0 <= addr);
    regions[..upto]
        .iter()
        .rev()
        .find(|r| end <= r.0.saturating_add(r.1))
        .map(|r| (r.2, addr - r.0))
}
