//! Device copies in **waves**, for the paths that copy device memory themselves (a peer
//! in this process, a same-host channel's target).
//!
//! The copies of one device group may run at once (a list-copy kernel runs them in
//! parallel), so no two of them may overlap: none may write a byte another reads or
//! writes. Copies are added in the order they are to take effect; one that meets the
//! bytes of the last wave opens the next wave, a group of its own, started once the one
//! before it has ended. So overlapping copies run one after another, in order, and
//! copies that do not overlap stay one group: one device call.

use std::collections::{BTreeMap, VecDeque};

use te_core::device::DeviceCopy;

/// `len` bytes at `addr` of address space `space`, as overlap is judged: ranges of two
/// spaces never meet, so two ranges share a space only where their addresses name the
/// same bytes (one process's addresses), and a caller that cannot tell keeps them in
/// one space, where at worst a copy waits that need not.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    pub(crate) space: u8,
    pub(crate) addr: u64,
    pub(crate) len: u64,
}

impl Span {
    /// `[start, end)` in the span's space.
    fn key(self) -> (u8, u64, u64) {
        (self.space, self.addr, self.addr.saturating_add(self.len))
    }
}

/// A batch's copies in waves, each one device group (see the module's docs).
#[derive(Default)]
pub(crate) struct Waves(Vec<Wave>);

/// Copies that may run at once: none writes a byte another reads or writes.
#[derive(Default)]
struct Wave {
    copies: Vec<DeviceCopy>,
    /// The bytes the copies read, and those they write.
    reads: Spans,
    writes: Spans,
}

impl Waves {
    /// Adds `copy`, which reads `reads` and writes `writes`, to the last wave, or to a
    /// new one where it meets that wave's bytes. A copy whose own two spans overlap is
    /// the caller's to keep out: no wave makes one copy onto itself defined.
    /// With `merge`, a device-to-device copy that follows the wave's last one on both
    /// sides (same devices) extends it instead, as staging merges adjacent pieces.
    pub(crate) fn add(&mut self, copy: DeviceCopy, reads: Span, writes: Span, merge: bool) {
        let (r, w) = (reads.key(), writes.key());
        let fits = self
            .0
            .last()
            .is_some_and(|v| !v.writes.meet(w) && !v.reads.meet(w) && !v.writes.meet(r));
        if !fits {
            self.0.push(Wave::default());
        }
        let Some(v) = self.0.last_mut() else {
            return;
        };
        v.reads.add(r);
        v.writes.add(w);
        if let (
            true,
            Some(DeviceCopy::DeviceToDevice {
                src_ordinal: from,
                src: a,
                dst_ordinal: to,
                dst: b,
                len: n,
            }),
            DeviceCopy::DeviceToDevice {
                src_ordinal,
                src,
                dst_ordinal,
                dst,
                len,
            },
        ) = (merge, v.copies.last_mut(), copy)
        {
            if (*from, *to) == (src_ordinal, dst_ordinal)
                && a.checked_add(*n as u64) == Some(src)
                && b.checked_add(*n as u64) == Some(dst)
            {
                *n += len;
                return;
            }
        }
        v.copies.push(copy);
    }

    /// The waves' copies, first wave first.
    pub(crate) fn into_groups(self) -> VecDeque<Vec<DeviceCopy>> {
        self.0.into_iter().map(|v| v.copies).collect()
    }
}

/// Byte ranges `[start, end)` by space, merged where they meet or touch, by start.
#[derive(Default)]
struct Spans(BTreeMap<(u8, u64), u64>);

impl Spans {
    /// Whether `[start, end)` of `space` shares a byte with a range here.
    fn meet(&self, (space, start, end): (u8, u64, u64)) -> bool {
        self.0
            .range((space, 0)..(space, end))
            .next_back()
            .is_some_and(|(_, &e)| e > start)
    }

    /// Adds `[start, end)` of `space`, merged with the ranges it meets or touches.
    fn add(&mut self, (space, mut start, mut end): (u8, u64, u64)) {
        while let Some((&(s, a), &b)) = self.0.range((space, 0)..=(space, end)).next_back() {
            if b < start {
                break;
            }
            self.0.remove(&(s, a));
            (start, end) = (start.min(a), end.max(b));
        }
        self.0.insert((space, start), end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d2d(src: u64, dst: u64, len: usize) -> DeviceCopy {
        DeviceCopy::DeviceToDevice {
            src_ordinal: 0,
            src,
            dst_ordinal: 0,
            dst,
            len,
        }
    }

    fn span(space: u8, addr: u64, len: u64) -> Span {
        Span { space, addr, len }
    }

    /// The waves of `copies` (src, dst, len), each in `spaces` (read's, write's).
    fn waves(copies: &[(u64, u64, u64)], spaces: (u8, u8), merge: bool) -> Vec<Vec<DeviceCopy>> {
        let mut w = Waves::default();
        for &(s, d, n) in copies {
            w.add(
                d2d(s, d, n as usize),
                span(spaces.0, s, n),
                span(spaces.1, d, n),
                merge,
            );
        }
        w.into_groups().into()
    }

    #[test]
    fn copies_apart_are_one_wave_and_adjacent_ones_merge_where_asked() {
        let apart = [(0, 100, 10), (10, 110, 10), (50, 200, 5)];
        assert_eq!(
            waves(&apart, (0, 0), true),
            vec![vec![d2d(0, 100, 20), d2d(50, 200, 5)]]
        );
        assert_eq!(waves(&apart, (0, 0), false).len(), 1);
        assert_eq!(waves(&apart, (0, 0), false)[0].len(), 3);
    }

    #[test]
    fn a_copy_meeting_the_last_waves_bytes_opens_the_next() {
        // Writes what the one before wrote; reads what it wrote; writes what it read.
        for pair in [
            [(0, 100, 10), (20, 105, 10)],
            [(0, 100, 10), (105, 200, 10)],
            [(0, 100, 10), (200, 5, 10)],
        ] {
            assert_eq!(waves(&pair, (0, 0), true).len(), 2, "{pair:?}");
        }
        // Reading what another reads is no overlap; touching is not meeting.
        assert_eq!(waves(&[(0, 100, 10), (5, 200, 10)], (0, 0), true).len(), 1);
        assert_eq!(
            waves(&[(0, 100, 10), (110, 200, 10)], (0, 0), true).len(),
            1
        );
        // A chain of three: each waits for the one before.
        assert_eq!(
            waves(&[(0, 10, 10), (10, 20, 10), (20, 30, 10)], (0, 0), true).len(),
            3
        );
    }

    #[test]
    fn ranges_of_two_spaces_never_meet() {
        // The source in space 0, the destination in space 1: the second copy reads
        // addresses the first writes, but in the other space.
        assert_eq!(waves(&[(0, 100, 10), (100, 0, 10)], (0, 1), true).len(), 1);
        assert_eq!(waves(&[(0, 100, 10), (50, 100, 10)], (0, 1), true).len(), 2);
    }
}
