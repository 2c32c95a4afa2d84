//! KV-cache layouts, and the plans that turn block-id lists into transfer requests.
//!
//! A [`KvLayout`] names, per group (a layer, or a group of layers), the buffers of that
//! group — slots such as `key`, `value`, `index` — each with its region, start offset,
//! bytes per block and number of blocks. Layouts travel in the segment descriptor, so a
//! peer learns them in the handshake; two sides are compatible when they have the same
//! groups, the same slots and the same bytes per block (block counts may differ).
//!
//! [`plan`] turns `(remote ids, local ids)` into one request per run of consecutive ids
//! per slot, with every id range-checked and every offset overflow-checked.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};
use crate::request::{Op, RegionId, TransferRequest};

/// One buffer of a group: `blocks` blocks of `bytes_per_block` bytes, contiguous from
/// `offset` in `region`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvSlot {
    /// The slot's name (`key`, `value`, `index`, …), unique in its group.
    pub name: String,
    /// The registered region holding it.
    pub region: RegionId,
    /// Where block 0 starts in the region.
    pub offset: u64,
    /// Bytes of one block.
    pub bytes_per_block: u64,
    /// Number of blocks.
    pub blocks: u64,
}

/// A layer or group of layers, with its slots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvGroup {
    /// The group's name, unique in its layout.
    pub name: String,
    /// Its buffers.
    pub slots: Vec<KvSlot>,
}

/// A named KV-cache layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    /// The layout's name, by which a peer looks it up.
    pub name: String,
    /// Its groups.
    pub groups: Vec<KvGroup>,
}

/// Which groups and slots a block transfer moves; all of them by default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvSelection {
    /// Only these groups (e.g. one layer group, for layer-wise pipelining).
    pub groups: Option<Vec<String>>,
    /// Only these slots of each selected group.
    pub slots: Option<Vec<String>>,
}

impl KvSelection {
    fn group(&self, name: &str) -> bool {
        self.groups
            .as_ref()
            .is_none_or(|g| g.iter().any(|n| n == name))
    }
    fn slot(&self, name: &str) -> bool {
        self.slots
            .as_ref()
            .is_none_or(|s| s.iter().any(|n| n == name))
    }
}

impl KvSelection {
    /// Refuses a group or slot name the layout lacks: a typo among good names would
    /// otherwise leave that slot's blocks behind without a word.
    fn check(&self, layout: &KvLayout) -> Result<()> {
        let groups: Vec<&KvGroup> = layout
            .groups
            .iter()
            .filter(|g| self.group(&g.name))
            .collect();
        let unknown = |what: &str, name: &str, known: Vec<&str>| {
            Err(invalid(format!(
                "the selection names {what} `{name}`, which layout `{}` lacks; it has {}",
                layout.name,
                known.join(", ")
            )))
        };
        for name in self.groups.iter().flatten() {
            if !layout.groups.iter().any(|g| &g.name == name) {
                return unknown(
                    "group",
                    name,
                    layout.groups.iter().map(|g| g.name.as_str()).collect(),
                );
            }
        }
        for name in self.slots.iter().flatten() {
            if !groups
                .iter()
                .any(|g| g.slots.iter().any(|s| &s.name == name))
            {
                let mut known: Vec<&str> = groups
                    .iter()
                    .flat_map(|g| g.slots.iter().map(|s| s.name.as_str()))
                    .collect();
                known.sort_unstable();
                known.dedup();
                return unknown("slot", name, known);
            }
        }
        Ok(())
    }
}

fn invalid(m: String) -> Error {
    Error::new(ErrorKind::InvalidRequest, m)
}

impl KvLayout {
    /// A layout with separate `key` and `value` slots per layer, each slot its own
    /// region — the most common shape; a convenience for tests and benchmarks.
    pub fn per_layer_kv(
        name: &str,
        regions: &[(RegionId, RegionId)],
        bytes_per_block: u64,
        blocks: u64,
    ) -> KvLayout {
        KvLayout {
            name: name.to_string(),
            groups: regions
                .iter()
                .enumerate()
                .map(|(i, (k, v))| KvGroup {
                    name: format!("layer{i}"),
                    slots: [("key", *k), ("value", *v)]
                        .into_iter()
                        .map(|(n, region)| KvSlot {
                            name: n.to_string(),
                            region,
                            offset: 0,
                            bytes_per_block,
                            blocks,
                        })
                        .collect(),
                })
                .collect(),
        }
    }

    /// Checks the layout's own shape: names present and unique, sizes non-zero, and
    /// every slot's byte range computable without overflow. Region bounds are checked
    /// by the engine, which knows the regions.
    ///
    /// # Errors
    /// `InvalidRequest`, naming the group and slot.
    pub fn validate(&self) -> Result<()> {
        if self.name.is_empty() {
            return Err(invalid("a KV layout needs a name".into()));
        }
        if self.groups.is_empty() {
            return Err(invalid(format!("layout `{}` has no groups", self.name)));
        }
        let mut groups = HashSet::new();
        for g in &self.groups {
            if !groups.insert(&g.name) {
                return Err(invalid(format!(
                    "layout `{}` has group `{}` twice",
                    self.name, g.name
                )));
            }
            if g.slots.is_empty() {
                return Err(invalid(format!(
                    "layout `{}` group `{}` has no slots",
                    self.name, g.name
                )));
            }
            let mut slots = HashSet::new();
            for s in &g.slots {
                let at = || {
                    format!(
                        "layout `{}` group `{}` slot `{}`",
                        self.name, g.name, s.name
                    )
                };
                if !slots.insert(&s.name) {
                    return Err(invalid(format!("{} appears twice", at())));
                }
                if s.bytes_per_block == 0 || s.blocks == 0 {
                    return Err(invalid(format!(
                        "{} has zero bytes per block or zero blocks",
                        at()
                    )));
                }
                s.end().ok_or_else(|| {
                    invalid(format!(
                        "{}: offset + blocks × bytes per block overflows",
                        at()
                    ))
                })?;
            }
        }
        Ok(())
    }

    /// Checks that a peer's layout of the same name can exchange blocks with this one.
    ///
    /// # Errors
    /// `InvalidRequest` saying exactly which group, slot or size differs.
    pub fn check_compatible(&self, peer: &KvLayout) -> Result<()> {
        let name = &self.name;
        let incompatible = |m: String| {
            Err(invalid(format!(
                "KV layout `{name}` is incompatible with the peer's: {m}"
            )))
        };
        for g in &self.groups {
            let Some(pg) = peer.groups.iter().find(|p| p.name == g.name) else {
                return incompatible(format!("the peer has no group `{}`", g.name));
            };
            for s in &g.slots {
                let Some(ps) = pg.slots.iter().find(|p| p.name == s.name) else {
                    return incompatible(format!(
                        "the peer's group `{}` has no slot `{}`",
                        g.name, s.name
                    ));
                };
                if ps.bytes_per_block != s.bytes_per_block {
                    return incompatible(format!(
                        "group `{}` slot `{}` has {} bytes per block here and {} on the peer",
                        g.name, s.name, s.bytes_per_block, ps.bytes_per_block
                    ));
                }
            }
            if let Some(extra) = pg
                .slots
                .iter()
                .find(|p| !g.slots.iter().any(|s| s.name == p.name))
            {
                return incompatible(format!(
                    "the peer's group `{}` has slot `{}`, which this side lacks",
                    g.name, extra.name
                ));
            }
        }
        if let Some(extra) = peer
            .groups
            .iter()
            .find(|p| !self.groups.iter().any(|g| g.name == p.name))
        {
            return incompatible(format!(
                "the peer has group `{}`, which this side lacks",
                extra.name
            ));
        }
        Ok(())
    }
}

impl KvSlot {
    /// The end of the slot's bytes in its region, if it does not overflow.
    fn end(&self) -> Option<u64> {
        self.blocks
            .checked_mul(self.bytes_per_block)?
            .checked_add(self.offset)
    }

    fn block_offset(&self, id: u64) -> Option<u64> {
        id.checked_mul(self.bytes_per_block)?
            .checked_add(self.offset)
    }
}

/// Turns block-id lists into requests: block `remote_ids[i]` of the peer's layout
/// pairs with block `local_ids[i]` of the local one, for every selected group and slot.
/// Runs of ids consecutive on both sides become one request per slot.
///
/// # Errors
/// `InvalidRequest` if the lists differ in length, hold an id twice (on either side),
/// name an id out of range on either side, select nothing, select a group or slot the
/// local layout lacks, or the layouts are
/// incompatible; `OutOfBounds` if an offset overflows.
pub fn plan(
    op: Op,
    local: &KvLayout,
    remote: &KvLayout,
    remote_ids: &[u64],
    local_ids: &[u64],
    selection: &KvSelection,
) -> Result<Vec<TransferRequest>> {
    if remote_ids.len() != local_ids.len() {
        return Err(invalid(format!(
            "{} remote block ids but {} local ones; the lists pair up and must be the same length",
            remote_ids.len(),
            local_ids.len()
        )));
    }
    local.check_compatible(remote)?;
    selection.check(local)?;
    for (ids, side) in [(remote_ids, "remote"), (local_ids, "local")] {
        let mut seen = HashSet::with_capacity(ids.len());
        if let Some(d) = ids.iter().find(|&&id| !seen.insert(id)) {
            return Err(invalid(format!(
                "{side} block id {d} appears twice in one transfer"
            )));
        }
    }
    let mut pairs: Vec<(u64, u64)> = remote_ids
        .iter()
        .copied()
        .zip(local_ids.iter().copied())
        .collect();
    pairs.sort_unstable();
    // At most one request per pair and slot (runs of consecutive ids merge).
    let slots: usize = local.groups.iter().map(|g| g.slots.len()).sum();
    let mut requests = Vec::with_capacity(pairs.len().saturating_mul(slots).min(1 << 16));
    let mut selected = 0;
    for g in local.groups.iter().filter(|g| selection.group(&g.name)) {
        let pg = remote
            .groups
            .iter()
            .find(|p| p.name == g.name)
            .ok_or_else(|| invalid(format!("the peer has no group `{}`", g.name)))?;
        for s in g.slots.iter().filter(|s| selection.slot(&s.name)) {
            let ps = pg
                .slots
                .iter()
                .find(|p| p.name == s.name)
                .ok_or_else(|| invalid(format!("the peer has no slot `{}`", s.name)))?;
            selected += 1;
            plan_slot(op, s, ps, &g.name, &pairs, &mut requests)?;
        }
    }
    if selected == 0 {
        return Err(invalid(format!(
            "the selection matches no group and slot of layout `{}`",
            local.name
        )));
    }
    Ok(requests)
}

/// `requests` with each one longer than `max` bytes cut into pieces of at most `max`
/// (a run of blocks [`plan`] merged, for a backend with a request size limit).
pub(crate) fn split_to(requests: Vec<TransferRequest>, max: u64) -> Vec<TransferRequest> {
    if max == 0 || requests.iter().all(|r| r.len <= max) {
        return requests;
    }
    let mut out = Vec::with_capacity(requests.len());
    for r in requests {
        let mut done = 0;
        while done < r.len {
            let len = (r.len - done).min(max);
            out.push(TransferRequest {
                local_offset: r.local_offset + done,
                remote_offset: r.remote_offset + done,
                len,
                ..r
            });
            done += len;
        }
    }
    out
}

fn plan_slot(
    op: Op,
    local: &KvSlot,
    remote: &KvSlot,
    group: &str,
    pairs: &[(u64, u64)],
    out: &mut Vec<TransferRequest>,
) -> Result<()> {
    for &(r, l) in pairs {
        for (id, slot, side) in [(r, remote, "remote"), (l, local, "local")] {
            if id >= slot.blocks {
                return Err(invalid(format!(
                    "{side} block id {id} is out of range: group `{group}` slot `{}` has {} blocks there",
                    slot.name, slot.blocks
                )));
            }
        }
    }
    let overflow = || {
        Error::new(
            ErrorKind::OutOfBounds,
            format!(
                "block offsets in group `{group}` slot `{}` overflow",
                local.name
            ),
        )
    };
    let bpb = local.bytes_per_block;
    let mut i = 0;
    while i < pairs.len() {
        let (r0, l0) = pairs[i];
        let mut run = 1;
        while i + run < pairs.len() && pairs[i + run] == (r0 + run as u64, l0 + run as u64) {
            run += 1;
        }
        let len = (run as u64).checked_mul(bpb).ok_or_else(overflow)?;
        let local_offset = local.block_offset(l0).ok_or_else(overflow)?;
        let remote_offset = remote.block_offset(r0).ok_or_else(overflow)?;
        if local_offset.checked_add(len).is_none() || remote_offset.checked_add(len).is_none() {
            return Err(overflow());
        }
        out.push(TransferRequest {
            op,
            local: local.region,
            local_offset,
            remote: remote.region,
            remote_offset,
            len,
        });
        i += run;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(name: &str, bpb: u64, blocks: u64) -> KvLayout {
        KvLayout::per_layer_kv(
            name,
            &[(RegionId(1), RegionId(2)), (RegionId(3), RegionId(4))],
            bpb,
            blocks,
        )
    }

    fn err(r: Result<Vec<TransferRequest>>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn requests_past_the_backends_largest_are_cut_into_pieces_that_fit() {
        let r = TransferRequest {
            op: Op::Write,
            local: RegionId(1),
            local_offset: 100,
            remote: RegionId(2),
            remote_offset: 1000,
            len: 10,
        };
        let short = TransferRequest { len: 4, ..r };
        let cut = split_to(vec![r, short], 4);
        let pieces: Vec<_> = cut
            .iter()
            .map(|p| (p.local_offset, p.remote_offset, p.len))
            .collect();
        assert_eq!(
            pieces,
            [
                (100, 1000, 4),
                (104, 1004, 4),
                (108, 1008, 2),
                (100, 1000, 4)
            ]
        );
        assert_eq!(split_to(vec![r], u64::MAX), vec![r]);
    }

    #[test]
    fn runs_of_consecutive_ids_on_both_sides_merge_into_one_request_per_slot() {
        let (l, r) = (layout("m", 100, 50), layout("m", 100, 80));
        let reqs = plan(
            Op::Read,
            &l,
            &r,
            &[17, 18, 19, 40],
            &[3, 4, 5, 9],
            &KvSelection::default(),
        )
        .unwrap();
        // 2 groups × 2 slots × 2 runs.
        assert_eq!(reqs.len(), 8);
        assert_eq!(
            reqs[0],
            TransferRequest::read(RegionId(1), 300, RegionId(1), 1700, 300)
        );
        assert_eq!(
            reqs[1],
            TransferRequest::read(RegionId(1), 900, RegionId(1), 4000, 100)
        );
    }

    #[test]
    fn runs_break_where_only_one_side_is_consecutive() {
        let l = layout("m", 10, 50);
        let reqs = plan(
            Op::Write,
            &l,
            &l,
            &[1, 2, 3],
            &[1, 2, 7],
            &KvSelection::default(),
        )
        .unwrap();
        assert_eq!(reqs.len(), 2 * 4);
    }

    #[test]
    fn mismatched_lengths_are_refused() {
        let l = layout("m", 10, 50);
        assert!(err(plan(
            Op::Read,
            &l,
            &l,
            &[1, 2],
            &[1],
            &KvSelection::default()
        ))
        .contains("same length"));
    }

    #[test]
    fn ids_out_of_range_on_either_side_are_refused() {
        let (l, r) = (layout("m", 10, 50), layout("m", 10, 20));
        let e = err(plan(Op::Read, &l, &r, &[20], &[0], &KvSelection::default()));
        assert!(
            e.contains("remote block id 20") && e.contains("20 blocks"),
            "{e}"
        );
        let e = err(plan(Op::Read, &l, &r, &[0], &[50], &KvSelection::default()));
        assert!(e.contains("local block id 50"), "{e}");
    }

    #[test]
    fn duplicate_ids_are_refused() {
        let l = layout("m", 10, 50);
        assert!(err(plan(
            Op::Read,
            &l,
            &l,
            &[1, 1],
            &[2, 3],
            &KvSelection::default()
        ))
        .contains("remote block id 1 appears twice"));
        assert!(err(plan(
            Op::Read,
            &l,
            &l,
            &[1, 2],
            &[3, 3],
            &KvSelection::default()
        ))
        .contains("local block id 3 appears twice"));
    }

    #[test]
    fn bytes_per_block_mismatch_names_group_slot_and_sizes() {
        let l = layout("m", 100, 50);
        let mut r = layout("m", 100, 50);
        r.groups[1].slots[1].bytes_per_block = 64;
        let e = l.check_compatible(&r).unwrap_err().to_string();
        assert!(
            e.contains("`layer1` slot `value` has 100 bytes per block here and 64"),
            "{e}"
        );
    }

    #[test]
    fn missing_or_extra_slots_and_groups_are_incompatible() {
        let l = layout("m", 100, 50);
        let mut r = layout("m", 100, 50);
        r.groups[0].slots.pop();
        assert!(l
            .check_compatible(&r)
            .unwrap_err()
            .to_string()
            .contains("has no slot `value`"));
        assert!(r
            .check_compatible(&l)
            .unwrap_err()
            .to_string()
            .contains("which this side lacks"));
        let mut r = layout("m", 100, 50);
        r.groups.pop();
        assert!(l
            .check_compatible(&r)
            .unwrap_err()
            .to_string()
            .contains("no group `layer1`"));
    }

    #[test]
    fn offsets_that_overflow_are_refused() {
        let mut l = layout("m", 1 << 40, 1 << 30);
        assert!(l.validate().unwrap_err().to_string().contains("overflows"));
        l.groups[0].slots[0].offset = u64::MAX;
        l.groups[0].slots[0].blocks = 1;
        l.groups[0].slots[0].bytes_per_block = 1;
        assert!(l.validate().is_err());
        // A peer's layout is not trusted: a plan over one that overflows never wraps.
        let mut big = layout("m", u64::MAX / 2 + 1, 2);
        big.groups[0].slots[0].offset = u64::MAX / 2;
        let r = plan(Op::Read, &big, &big, &[1], &[1], &KvSelection::default());
        assert_eq!(r.unwrap_err().kind(), ErrorKind::OutOfBounds);
    }

    #[test]
    fn a_selection_moves_only_the_chosen_groups_and_slots() {
        let l = layout("m", 10, 50);
        let sel = KvSelection {
            groups: Some(vec!["layer1".into()]),
            slots: Some(vec!["key".into()]),
        };
        let reqs = plan(Op::Read, &l, &l, &[1, 2], &[1, 2], &sel).unwrap();
        assert_eq!(
            reqs,
            vec![TransferRequest::read(RegionId(3), 10, RegionId(3), 10, 20)]
        );
        let none = KvSelection {
            groups: Some(vec![]),
            slots: None,
        };
        assert!(err(plan(Op::Read, &l, &l, &[1], &[1], &none)).contains("matches no group"));
    }

    #[test]
    fn a_selection_naming_a_group_or_slot_the_layout_lacks_is_refused() {
        let l = layout("m", 10, 50);
        // A typo among good names must not silently leave that slot's blocks behind.
        let typo = KvSelection {
            groups: None,
            slots: Some(vec!["key".into(), "valeu".into()]),
        };
        let e = err(plan(Op::Read, &l, &l, &[1], &[1], &typo));
        assert!(e.contains("`valeu`") && e.contains("key, value"), "{e}");
        let typo = KvSelection {
            groups: Some(vec!["layer0".into(), "layer7".into()]),
            slots: None,
        };
        let e = err(plan(Op::Read, &l, &l, &[1], &[1], &typo));
        assert!(
            e.contains("`layer7`") && e.contains("layer0, layer1"),
            "{e}"
        );
    }

    #[test]
    fn layouts_validate_their_names() {
        let mut l = layout("m", 10, 5);
        l.groups[1].name = "layer0".into();
        assert!(l
            .validate()
            .unwrap_err()
            .to_string()
            .contains("group `layer0` twice"));
        let mut l = layout("m", 10, 5);
        l.groups[0].slots[1].name = "key".into();
        assert!(l
            .validate()
            .unwrap_err()
            .to_string()
            .contains("appears twice"));
    }
}
