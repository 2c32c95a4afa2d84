//! Peers in this process: device memory moves device to device, not through sockets.
//!
//! When an initiator and its target are tcp backends of one process (a test, a
//! benchmark, or two engines that share a process), a frame from device memory to
//! device memory of the same runtime and device need not be staged to the host, sent
//! over loopback and staged back: it is one group of device-to-device copies. Every
//! other frame (host memory, another device or runtime) still goes over the socket.
//!
//! A backend publishes itself here with its endpoint. An initiator's peer is this
//! process's backend when the peer's endpoint is, byte for byte, one published here:
//! the same advertised address and port and the same 64-bit instance, which is random
//! per engine start, so another process cannot hold it by chance, and a descriptor that
//! copies it names an address that reaches this process anyway. The data connections
//! are still opened and authenticated as for any peer; only their frames are skipped.
//!
//! The target's checks stay the target's: the frame is admitted against the target's
//! registrations exactly as a served frame is (`serve::admit`: region, rights, every
//! entry's bounds), a refusal fails the batch with the target's error, and the target's
//! pin holds its region until the copies end, so deregistration there waits for them
//! as it waits for a served request. The initiator's pins hold its region likewise.
//!
//! The copies of one device group may run at once (a list-copy kernel runs them in
//! parallel), so they must not overlap. A part whose own two ranges overlap goes over
//! the socket, staged; and where a batch moves a region into itself so that a part
//! writes bytes an earlier part of the group reads or writes (or reads bytes it
//! writes), that part starts the group's next **wave** (`crate::waves`): a group of its
//! own, started once the one before it has ended. So overlapping parts run one after
//! another, in the order of the batch's frames (request order for one op and remote
//! region), and a batch without such overlaps is still one group.

use std::collections::VecDeque;
use std::sync::{Arc, Weak};

use te_core::device::{DeviceCopy, DeviceRuntime};
use te_core::sync::Mutex;
use te_core::{BatchStage, Op, Result};

use crate::completion::Batch;
use crate::errors::timeout_error;
use crate::initiator::slice::{Part, Slice};
use crate::regions::Pin;
use crate::stage;
use crate::state::Shared;
use crate::waves::{Span, Waves};
use crate::wire::{Entry, Header, Kind};

/// Backends of this process, by endpoint.
static PUBLISHED: Mutex<Vec<(Vec<u8>, Weak<Shared>)>> = Mutex::new(Vec::new());

/// Makes `shared` findable by its `endpoint` for initiators of this process.
pub(crate) fn publish(shared: &Arc<Shared>, endpoint: &[u8]) {
    let mut all = PUBLISHED.lock();
    all.retain(|(_, w)| w.strong_count() > 0);
    all.push((endpoint.to_vec(), Arc::downgrade(shared)));
}

/// The backend of this process that published `endpoint`, if it is still open.
pub(crate) fn find(endpoint: &[u8]) -> Option<Weak<Shared>> {
    PUBLISHED
        .lock()
        .iter()
        .find(|(e, w)| e == endpoint && w.upgrade().is_some_and(|s| s.is_open()))
        .map(|(_, w)| w.clone())
}

/// The device-to-device copies of a batch's frames to a peer in this process, started
/// as one group per runtime once every frame has been admitted: a batch of random KV
/// block ids (many frames of scattered parts) costs the device one call per runtime
/// and direction, not one per frame or per block.
#[derive(Default)]
pub(crate) struct Local {
    groups: Vec<LocalGroup>,
}

/// One runtime's share of a batch's local frames.
struct LocalGroup {
    rt: Arc<dyn DeviceRuntime>,
    /// The copies in waves, each one device group, started once the wave before it
    /// has ended; all in one address space, this process's.
    waves: Waves,
    /// Per frame: its batch (finished when the group ends), the target's pin on its
    /// region and the batch's pins on the local ones, held until then.
    frames: Vec<(Arc<Batch>, Pin, Arc<Vec<Pin>>)>,
}

impl Local {
    /// Plans `slice` (local device memory) as device-to-device copies into or out of
    /// `target`'s region, if that region is on the same runtime and device; `Err(slice)`
    /// hands it back to go over the socket. A frame the target refuses, or one of a
    /// batch that has stopped, is finished at once with its error.
    pub(crate) fn add(
        &mut self,
        target: &Shared,
        mut slice: Slice,
    ) -> std::result::Result<(), Slice> {
        let Some((rt, ordinal)) = slice.device.clone() else {
            return Err(slice);
        };
        // The parts are taken out of the slice, and put back if it goes to the socket.
        let gathered = !slice.parts.is_empty();
        let parts: Vec<Part> = if gathered {
            std::mem::take(&mut slice.parts)
        } else {
            vec![Part {
                local: slice.local,
                remote_offset: slice.remote_offset,
                len: slice.len,
            }]
        };
        let entries: Vec<Entry> = parts
            .iter()
            .map(|p| Entry {
                offset: p.remote_offset,
                len: p.len,
            })
            .collect();
        let kind = match slice.op {
            Op::Write => Kind::WriteV,
            Op::Read => Kind::ReadV,
        };
        let h = Header::request(kind, 0, slice.remote.0, 0, slice.len);
        let batch: &Arc<Batch> = &slice.batch;
        let pin = match crate::target::serve::admit(target, &h, &entries, "this process") {
            Ok(pin) => pin,
            Err(e) => {
                batch.finish_slice(Err(e));
                return Ok(());
            }
        };
        let region = pin.region();
        let same = region
            .data
            .as_ref()
            .is_some_and(|(r, o)| r.name() == rt.name() && *o == ordinal);
        // Both ends in one allocation, overlapping (an engine moving a region into
        // itself): a device copy of overlapping ranges is undefined; staging is not.
        let overlap = parts.iter().any(|p| {
            let (here, there) = (p.local as u64, region.addr + p.remote_offset);
            here < there.saturating_add(p.len) && there < here.saturating_add(p.len)
        });
        if !same || overlap {
            if gathered {
                slice.parts = parts;
            }
            return Err(slice);
        }
        if batch.stopped() {
            batch.finish_slice(Err(timeout_error()));
            return Ok(());
        }
        let Some(pins) = batch.hold() else {
            batch.finish_slice(Err(timeout_error()));
            return Ok(());
        };
        let group = match self.groups.iter_mut().position(|g| Arc::ptr_eq(&g.rt, &rt)) {
            Some(i) => &mut self.groups[i],
            None => {
                self.groups.push(LocalGroup {
                    rt,
                    waves: Waves::default(),
                    frames: Vec::new(),
                });
                let last = self.groups.len() - 1;
                &mut self.groups[last]
            }
        };
        for p in &parts {
            let (here, there) = (p.local as u64, region.addr + p.remote_offset);
            let (src, dst) = match slice.op {
                Op::Write => (here, there),
                Op::Read => (there, here),
            };
            let copy = DeviceCopy::DeviceToDevice {
                src_ordinal: ordinal,
                src,
                dst_ordinal: ordinal,
                dst,
                len: p.len as usize,
            };
            // Adjacent pieces are one copy, as staging merges them: a frame of adjacent
            // blocks is one copy, not one per block.
            let span = |addr| Span {
                space: 0,
                addr,
                len: p.len,
            };
            group.waves.add(copy, span(src), span(dst), true);
        }
        group.frames.push((batch.clone(), pin, pins));
        Ok(())
    }

    /// Starts every group planned; each frame's batch learns the result when its
    /// group's copies end.
    pub(crate) fn start(self) {
        for g in self.groups {
            let frames = g.frames;
            let mut batches: Vec<Arc<Batch>> = frames.iter().map(|f| f.0.clone()).collect();
            // A batch's frames come together: once deduplicated, each batch is listed
            // once, and its stage noted once.
            batches.dedup_by(|a, b| Arc::ptr_eq(a, b));
            for batch in &batches {
                batch.stage_began(BatchStage::Device);
            }
            let done = move |r: Result<()>| {
                let mut frames = frames.into_iter().peekable();
                while let Some((batch, pin, pins)) = frames.next() {
                    drop(pin);
                    drop(pins);
                    if frames
                        .peek()
                        .is_none_or(|next| !Arc::ptr_eq(&batch, &next.0))
                    {
                        batch.stage_ended(BatchStage::Device);
                    }
                    batch.finish_slice(r.clone());
                }
            };
            let waves = g.waves.into_groups();
            // SAFETY: the initiator's ranges lie in its regions, checked at submission
            // and kept registered by the batch's pins; the target's were admitted
            // against its regions, which the frames' pins keep registered; `done` owns
            // every pin until the last wave's copies end. No two copies of one wave
            // overlap (`Waves::add`; the pieces' own two ranges were checked apart above),
            // and a wave starts only once the one before it has ended.
            unsafe { in_waves(g.rt, waves, batches, Box::new(done)) };
        }
    }
}

/// Starts the first of `waves` as one device group, and each next one once the one
/// before it has ended; `done` runs once, with the first failure or once the last has
/// ended — or, where one of `batches` stopped meanwhile, instead of the next wave.
///
/// # Safety
/// As [`stage::start_all`], for every wave: `done` keeps every range valid until it
/// runs; no two copies of one wave overlap.
unsafe fn in_waves(
    rt: Arc<dyn DeviceRuntime>,
    mut waves: VecDeque<Vec<DeviceCopy>>,
    batches: Vec<Arc<Batch>>,
    done: Box<dyn FnOnce(Result<()>) + Send>,
) {
    let Some(copies) = waves.pop_front() else {
        return done(Ok(()));
    };
    let next = rt.clone();
    let after = move |r: Result<()>| match r {
        Ok(()) if !waves.is_empty() => {
            if batches.iter().any(|b| b.stopped()) {
                return done(Err(timeout_error()));
            }
            // SAFETY: forwarded from the caller; the wave before has ended.
            unsafe { in_waves(next, waves, batches, done) }
        }
        r => done(r),
    };
    // SAFETY: forwarded from the caller.
    unsafe { stage::start_all(&rt, copies, after) };
}
