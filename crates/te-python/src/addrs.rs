//! Raw addresses to regions, for callers that name memory by address (Mooncake's
//! `transfer_addrs`): local addresses through the map an engine keeps of the
//! registrations made through it, the peer's through its descriptor.

use std::collections::BTreeMap;
use std::sync::Arc;
use te_core::sync::RwLock;

use te::{Peer, RegionDesc, RegionId};

/// Local regions by start address, for callers that name memory by raw address.
pub(crate) type AddrMap = Arc<RwLock<BTreeMap<u64, Vec<(u64, RegionId)>>>>;

/// The local region that holds `addr .. addr + len`, and the offset of `addr` in it.
pub(crate) fn local_region(addrs: &AddrMap, addr: u64, len: u64) -> Option<(RegionId, u64)> {
    let map = addrs.read();
    map.range(..=addr).rev().find_map(|(start, regions)| {
        regions
            .iter()
            .find(|(rlen, _)| {
                addr.checked_add(len)
                    .is_some_and(|end| end <= start.saturating_add(*rlen))
            })
            .map(|(_, id)| (*id, addr - start))
    })
}

/// The peer's regions, as last fetched, by start address.
pub(crate) fn remote_regions(peer: &Peer) -> Vec<RegionDesc> {
    let mut r = peer.segment().regions.clone();
    r.sort_by_key(|r| r.addr);
    r
}

/// The region of `regions` (sorted by address) that holds `addr .. addr + len`, and the
/// offset of `addr` in it.
pub(crate) fn find(regions: &[RegionDesc], addr: u64, len: u64) -> Option<(RegionId, u64)> {
    let end = addr.checked_add(len)?;
    let upto = regions.partition_point(|r| r.addr <= addr);
    regions[..upto]
        .iter()
        .rev()
        .find(|r| end <= r.addr.saturating_add(r.len))
        .map(|r| (r.id, addr - r.addr))
}
