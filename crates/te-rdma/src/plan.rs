//! Slicing and striping: how a batch's requests become slices spread over paths.
//!
//! A request longer than `slice_size` is cut into slices of `slice_size` bytes (the last
//! one shorter). Slices are dealt round-robin over the usable paths, continuing across
//! requests and starting where the previous batch to this peer stopped, so one batch of
//! small requests spreads as well as one big request. Paths are ordered so that
//! consecutive indices lie on different NIC pairs (see [`path_order`]): dealing
//! round-robin stripes across NICs first and across the QPs of one NIC pair second.

/// One slice of one request, on one path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SliceSpec {
    /// The request's index in its batch.
    pub(crate) request: usize,
    /// Byte offset of the slice within its request.
    pub(crate) offset: u64,
    /// Bytes; never zero, never above the slice size.
    pub(crate) len: u64,
    /// The index into the `usable` paths handed to [`plan`].
    pub(crate) path: usize,
}

/// Cuts requests of lengths `lens` into slices of at most `slice_size` bytes and deals
/// them over `paths` usable paths, the first to path `start % paths`.
///
/// Returns nothing if `paths` or `slice_size` is zero; zero-length requests yield no
/// slice (the engine refuses them before they get here).
pub(crate) fn plan(
    lens: impl IntoIterator<Item = u64>,
    slice_size: u64,
    paths: usize,
    start: usize,
) -> Vec<SliceSpec> {
    let mut out = Vec::new();
    if paths == 0 || slice_size == 0 {
        return out;
    }
    let mut next = start % paths;
    for (request, len) in lens.into_iter().enumerate() {
        let mut offset = 0;
        while offset < len {
            let n = slice_size.min(len - offset);
            out.push(SliceSpec {
                request,
                offset,
                len: n,
                path: next,
            });
            next = (next + 1) % paths;
            offset += n;
        }
    }
    out
}

/// The number of slices [`plan`] makes, without making them.
pub(crate) fn slice_count(lens: impl IntoIterator<Item = u64>, slice_size: u64) -> u64 {
    lens.into_iter()
        .map(|l| l.div_ceil(slice_size.max(1)))
        .sum()
}

/// The NIC pairs of a peer: local device `i % local` with peer device `i % remote`, for
/// `i` in `0..max(local, remote)`, keeping only the pairs `compatible` accepts (same
/// link layer). Every NIC on both sides carries traffic when both sides have any.
pub(crate) fn nic_pairs(
    local: usize,
    remote: usize,
    compatible: impl Fn(usize, usize) -> bool,
) -> Vec<(usize, usize)> {
    if local == 0 || remote == 0 {
        return Vec::new();
    }
    let mut pairs: Vec<(usize, usize)> = (0..local.max(remote))
        .map(|i| (i % local, i % remote))
        .filter(|&(l, r)| compatible(l, r))
        .collect();
    if pairs.is_empty() {
        // The one-to-one pairing found nothing; fall back to any compatible pair.
        pairs = (0..local)
            .flat_map(|l| (0..remote).map(move |r| (l, r)))
            .filter(|&(l, r)| compatible(l, r))
            .collect();
    }
    pairs
}

/// The order of paths for `pairs` NIC pairs with `qps` QPs each, as (pair, qp): pair
/// varies fastest, so neighbouring paths are on different NICs.
pub(crate) fn path_order(pairs: usize, qps: usize) -> Vec<(usize, usize)> {
    (0..qps)
        .flat_map(|q| (0..pairs).map(move |p| (p, q)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_long_request_is_cut_into_slices_dealt_round_robin() {
        let s = plan([200u64], 64, 3, 0);
        let got: Vec<_> = s.iter().map(|s| (s.offset, s.len, s.path)).collect();
        assert_eq!(got, [(0, 64, 0), (64, 64, 1), (128, 64, 2), (192, 8, 0)]);
    }

    #[test]
    fn small_requests_continue_the_rotation_from_the_start_path() {
        let s = plan([10u64, 10, 10], 64, 2, 5);
        let got: Vec<_> = s.iter().map(|s| (s.request, s.path)).collect();
        assert_eq!(got, [(0, 1), (1, 0), (2, 1)]);
    }

    #[test]
    fn no_paths_or_no_slice_size_plans_nothing() {
        assert!(plan([10u64], 64, 0, 0).is_empty());
        assert!(plan([10u64], 0, 1, 0).is_empty());
    }

    #[test]
    fn nic_pairs_use_every_nic_and_respect_compatibility() {
        assert_eq!(nic_pairs(2, 2, |_, _| true), [(0, 0), (1, 1)]);
        assert_eq!(nic_pairs(1, 3, |_, _| true), [(0, 0), (0, 1), (0, 2)]);
        assert_eq!(
            nic_pairs(4, 2, |_, _| true),
            [(0, 0), (1, 1), (2, 0), (3, 1)]
        );
        // Local 0 is IB, local 1 Ethernet; the peer's only device is Ethernet.
        assert_eq!(nic_pairs(2, 1, |l, _| l == 1), [(1, 0)]);
        // One-to-one finds nothing compatible: any compatible pair is used.
        assert_eq!(nic_pairs(2, 2, |l, r| l == 0 && r == 1), [(0, 1)]);
        assert!(nic_pairs(2, 2, |_, _| false).is_empty());
        assert!(nic_pairs(0, 2, |_, _| true).is_empty());
    }

    #[test]
    fn neighbouring_paths_are_on_different_nic_pairs() {
        assert_eq!(
            path_order(2, 2),
            [(0, 0), (1, 0), (0, 1), (1, 1)],
            "pair varies fastest"
        );
    }

    proptest! {
        #[test]
        fn slices_tile_every_request_exactly_and_stay_balanced(
            lens in proptest::collection::vec(1u64..1_000_000, 1..20),
            slice in 1u64..100_000,
            paths in 1usize..9,
            start in 0usize..100,
        ) {
            let s = plan(lens.iter().copied(), slice, paths, start);
            prop_assert_eq!(s.len() as u64, slice_count(lens.iter().copied(), slice));
            for (i, &len) in lens.iter().enumerate() {
                let mut at = 0;
                for sl in s.iter().filter(|s| s.request == i) {
                    prop_assert_eq!(sl.offset, at);
                    prop_assert!(sl.len > 0 && sl.len <= slice);
                    at += sl.len;
                }
                prop_assert_eq!(at, len);
            }
            let mut per_path = vec![0usize; paths];
            for sl in &s {
                prop_assert!(sl.path < paths);
                per_path[sl.path] += 1;
            }
            let (lo, hi) = (per_path.iter().min().unwrap(), per_path.iter().max().unwrap());
            prop_assert!(hi - lo <= 1, "round-robin keeps paths within one slice");
        }
    }
}
