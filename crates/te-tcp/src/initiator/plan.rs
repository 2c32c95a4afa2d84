//! How a batch becomes frames: every request cut into pieces of at most the frame limit,
//! and the pieces going to one remote region with one op from one kind of local memory
//! gathered into scatter-gather frames.

use std::sync::Arc;

use te_core::{RegionId, TransferRequest};

use crate::completion::Batch;
use crate::initiator::slice::{Part, Slice};
use crate::stage::Dev;
use crate::wire;

/// One frame a batch is cut into, before it becomes a [`Slice`]: one piece of one
/// request, or pieces of several requests to one remote region gathered together.
pub(crate) struct Frame {
    op: te_core::Op,
    remote: RegionId,
    /// The local region's device, when the parts are device memory (all on it).
    device: Option<Dev>,
    parts: Vec<Part>,
    bytes: u64,
}

/// Which local memory a piece is in: host memory, or a runtime's device (the runtime
/// by its address: each is one instance per process).
type DevKey = Option<(*const (), u32)>;

/// Cuts `batch` into frames: every request into pieces of at most `slice` bytes, and
/// the pieces going to the same remote region with the same op from the same kind of
/// local memory (host, or one device) gathered into frames of at most `slice` bytes and
/// [`wire::MAX_ENTRIES`] entries. Frames come out in the order they are opened. `bases`
/// holds each request's local region address and device.
///
/// Device pieces are gathered too: a frame's pieces are staged packed in one pinned
/// buffer of `slice` bytes by one group of copies, so a batch of small device blocks
/// pays one synchronisation per frame rather than one per block.
///
/// A batch smaller than the frame limit becomes one frame on one connection rather than
/// one per connection: fewer, fuller frames measured faster (see docs/decisions.md),
/// and batches larger than that still spread over the pool.
pub(crate) fn plan(
    batch: &[TransferRequest],
    bases: &[(usize, Option<&Dev>)],
    slice: u64,
) -> Vec<Frame> {
    let mut frames: Vec<Frame> = Vec::new();
    // The open frame of each (op, remote region, local device): few per batch, so a
    // list.
    let mut open: Vec<(te_core::Op, RegionId, DevKey, usize)> = Vec::new();
    // The open frame used last: a batch's requests come grouped by region, so it is
    // the likely one, and the list is searched only when the region changes.
    let mut last = 0;
    for (r, (base, dev)) in batch.iter().zip(bases) {
        let mut off = 0;
        while off < r.len {
            let len = slice.min(r.len - off);
            let part = Part {
                local: base + (r.local_offset + off) as usize,
                remote_offset: r.remote_offset + off,
                len,
            };
            off += len;
            let key: DevKey = dev.map(|d| (Arc::as_ptr(&d.0).cast::<()>(), d.1));
            let is = |o: &(te_core::Op, RegionId, DevKey, usize)| {
                o.0 == r.op && o.1 == r.remote && o.2 == key
            };
            let slot = match open.get(last) {
                Some(o) if is(o) => Some(last),
                _ => open.iter().position(is),
            };
            last = slot.unwrap_or(open.len());
            if let Some(f) = slot.map(|i| &mut frames[open[i].3]) {
                if f.bytes + len <= slice && f.parts.len() < wire::MAX_ENTRIES {
                    f.bytes += len;
                    f.parts.push(part);
                    continue;
                }
            }
            let at = frames.len();
            frames.push(Frame {
                op: r.op,
                remote: r.remote,
                device: dev.cloned(),
                parts: vec![part],
                bytes: len,
            });
            match slot {
                Some(i) => open[i].3 = at,
                None => open.push((r.op, r.remote, key, at)),
            }
        }
    }
    frames
}

impl Frame {
    pub(crate) fn into_slice(self, b: &Arc<Batch>) -> Slice {
        Slice::gathered(b.clone(), self.op, self.remote, self.parts, self.device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_core::Op;

    fn req(op: Op, remote: u64, remote_offset: u64, len: u64) -> TransferRequest {
        TransferRequest {
            op,
            local: RegionId(1),
            local_offset: remote_offset,
            remote: RegionId(remote),
            remote_offset,
            len,
        }
    }

    #[test]
    fn a_batch_is_gathered_per_region_and_op_within_the_frame_and_entry_limits() {
        let mut batch = Vec::new();
        // 1500 blocks of 4 KiB to region 1: the entry limit cuts them at 1024.
        batch.extend((0..1500).map(|i| req(Op::Write, 1, i * 4096, 4096)));
        // Interleaved reads of region 1 and writes to region 2 gather apart.
        batch.extend((0..10).map(|i| req(Op::Read, 1, i * 4096, 4096)));
        batch.extend((0..10).map(|i| req(Op::Write, 2, i * 4096, 4096)));
        // A request longer than the frame limit is sliced; its last piece may be
        // gathered with what follows.
        batch.push(req(Op::Write, 3, 0, (8 << 20) + 100));
        batch.push(req(Op::Write, 3, 9 << 20, 100));
        let bases = vec![(0x10000usize, None); batch.len()];
        let slice = 8 << 20;
        let frames = plan(&batch, &bases, slice);
        let shape: Vec<(Op, u64, usize, u64)> = frames
            .iter()
            .map(|f| (f.op, f.remote.0, f.parts.len(), f.bytes))
            .collect();
        assert_eq!(
            shape,
            [
                (Op::Write, 1, 1024, 1024 * 4096),
                (Op::Write, 1, 476, 476 * 4096),
                (Op::Read, 1, 10, 10 * 4096),
                (Op::Write, 2, 10, 10 * 4096),
                (Op::Write, 3, 1, 8 << 20),
                (Op::Write, 3, 2, 200),
            ]
        );
        for f in &frames {
            assert!(f.bytes <= slice && f.parts.len() <= wire::MAX_ENTRIES);
            assert_eq!(f.parts.iter().map(|p| p.len).sum::<u64>(), f.bytes);
        }
        // Every byte of every request is in exactly one part, at the same offsets.
        let total: u64 = frames.iter().map(|f| f.bytes).sum();
        assert_eq!(total, batch.iter().map(|r| r.len).sum::<u64>());
        let p = frames[4].parts[0];
        assert_eq!((p.local, p.remote_offset), (0x10000, 0));
    }

    #[test]
    fn device_blocks_gather_into_frames_of_their_own_device_apart_from_host_ones() {
        let rt = te_core::device::runtime(te_core::device::fakedev::NAME).unwrap();
        // 128 blocks of 32 KiB from device 0, 4 from host memory, 4 from device 1, all
        // written to region 1.
        let mut batch: Vec<TransferRequest> = (0..128)
            .map(|i| req(Op::Write, 1, i * 32768, 32768))
            .collect();
        batch.extend((128..132).map(|i| req(Op::Write, 1, i * 32768, 32768)));
        batch.extend((132..136).map(|i| req(Op::Write, 1, i * 32768, 32768)));
        let (dev0, dev1) = ((rt.clone(), 0), (rt.clone(), 1));
        let mut bases = vec![(0x10000usize, Some(&dev0)); 128];
        bases.extend((0..4).map(|_| (0x20000usize, None)));
        bases.extend((0..4).map(|_| (0x30000usize, Some(&dev1))));
        let frames = plan(&batch, &bases, 512 << 10);
        let shape: Vec<(Option<u32>, usize)> = frames
            .iter()
            .map(|f| (f.device.as_ref().map(|d| d.1), f.parts.len()))
            .collect();
        let mut want = vec![(Some(0), 16); 8];
        want.extend([(None, 4), (Some(1), 4)]);
        assert_eq!(shape, want);
        let p = frames[1].parts[0];
        assert_eq!(
            (p.local, p.remote_offset),
            (0x10000 + 16 * 32768, 16 * 32768)
        );
    }
}
