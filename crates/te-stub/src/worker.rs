//! The stub's completion machinery: the worker thread that runs due batches, copies
//! their bytes (through device runtimes where a side is device memory) and completes
//! each exactly once.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};

use te_core::device::{DeviceCopy, DeviceRuntime};
use te_core::peer_table::PeerTable;
use te_core::worker::DueQueue;
use te_core::{BatchStage, Completion, Error, ErrorKind, Op, PeerId, Result};

use crate::backend::*;
use crate::config::{Mode, StubConfig};

pub(crate) fn run(
    queue: &DueQueue<Job>,
    local: &Endpoint,
    config: &StubConfig,
    peers: &PeerTable<Weak<Endpoint>>,
) {
    let mut scratch = Vec::new();
    while let Some(job) = queue.next(config.reorder) {
        // The stub's fabric is its worker's copy (and its `delay`): the wire.
        job.done.stage_began(BatchStage::Wire);
        let result = execute(&job, local, config, &mut scratch);
        job.done.stage_ended(BatchStage::Wire);
        if job.fault == Fault::Restart {
            let id = job.peer.upgrade().map(|p| PeerId(p.id));
            if let Some(id) = id {
                let _ = peers.remove(id);
            }
        }
        job.done.complete(result);
    }
}

pub(crate) fn execute(
    job: &Job,
    local: &Endpoint,
    config: &StubConfig,
    scratch: &mut Vec<u8>,
) -> Result<()> {
    let stops = |done: &Completion| done.is_aborted() && !config.ignore_abort;
    if stops(&job.done) {
        return Err(aborted());
    }
    match job.fault {
        Fault::Fail => {
            return Err(Error::new(
                ErrorKind::Backend,
                "injected failure (stub fail_every)",
            ))
        }
        Fault::Restart => {
            return Err(Error::new(
                ErrorKind::PeerRestarted,
                "injected restart (stub restart_every): the peer's stub endpoint restarted",
            ))
        }
        Fault::None | Fault::FailPartway => {}
    }
    let Some(remote) = job.peer.upgrade() else {
        return Err(Error::new(
            ErrorKind::PeerUnreachable,
            "the peer's stub endpoint is gone (its engine was dropped)",
        ));
    };
    // One engine connected to itself: one read lock serves both sides. Two tables are
    // locked in the order of their ids: a worker of each of two stubs writing to each
    // other, with a deregistration (a writer, which new readers queue behind) waiting
    // on each side, would otherwise hold one table each and wait for the other's.
    let (local_regions, remote_guard) = if remote.id == local.id {
        (read(local), None)
    } else if remote.id < local.id {
        let first = read(&remote);
        (read(local), Some(first))
    } else {
        let first = read(local);
        let second = read(&remote);
        (first, Some(second))
    };
    let remote_regions = remote_guard.as_ref().unwrap_or(&local_regions);
    let total: u64 = job.requests.iter().map(|r| r.len).sum();
    let mut groups = Groups::default();
    let mut budget = match job.fault {
        Fault::FailPartway => total / 2,
        _ => u64::MAX,
    };
    for r in &job.requests {
        // The target's own check, against its own registrations.
        let l = region(&local_regions, r.local, r.local_offset, r.len, "local")?;
        let p = region(remote_regions, r.remote, r.remote_offset, r.len, "remote")?;
        if !p.access.allows(r.op) {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                format!(
                    "the target refused a {} of region {}: no right",
                    r.op, r.remote
                ),
            ));
        }
        if stops(&job.done) {
            return Err(aborted());
        }
        if config.mode == Mode::Noop {
            continue;
        }
        let len = r.len.min(budget);
        let (src, dst) = match r.op {
            Op::Write => ((&l, r.local_offset), (&p, r.remote_offset)),
            Op::Read => ((&p, r.remote_offset), (&l, r.local_offset)),
        };
        copy(src, dst, len as usize, scratch, &mut groups)?;
        budget -= len;
        if budget == 0 {
            groups.run()?;
            return Err(Error::new(
                ErrorKind::Backend,
                "injected failure after part of the data moved (stub fail_partway_every)",
            ));
        }
    }
    groups.run()
}

/// The batch's device copies, one group per runtime: each group is enqueued at once
/// and synchronised once, as a fabric's copy engine would. A device runs a group's
/// copies in no order, so the bytes the pending copies read and write are noted, and a
/// copy that depends on one of them (writes bytes one reads or writes, or reads bytes
/// one writes) first runs the pending groups to their end: a batch's requests take
/// effect whole, in request order where they overlap, never torn.
#[derive(Default)]
pub(crate) struct Groups {
    groups: Vec<(Arc<dyn DeviceRuntime>, Vec<DeviceCopy>)>,
    reads: Spans,
    writes: Spans,
}

/// Byte ranges `[start, end)` of the address space, merged where they touch.
#[derive(Default)]
struct Spans(BTreeMap<u64, u64>);

impl Spans {
    fn overlaps(&self, (start, end): (u64, u64)) -> bool {
        // The spans are apart: only the last one starting before `end` can reach past
        // `start`.
        start < end && (self.0.range(..end).next_back()).is_some_and(|(_, &e)| e > start)
    }

    fn insert(&mut self, (mut start, mut end): (u64, u64)) {
        if start >= end {
            return;
        }
        while let Some((&s, &e)) = self.0.range(..=end).next_back() {
            if e < start {
                break;
            }
            self.0.remove(&s);
            (start, end) = (start.min(s), end.max(e));
        }
        self.0.insert(start, end);
    }
}

impl Groups {
    /// Whether a copy reading `read` and writing `write` depends on a pending one.
    fn depends(&self, read: (u64, u64), write: (u64, u64)) -> bool {
        self.writes.overlaps(read) || self.writes.overlaps(write) || self.reads.overlaps(write)
    }

    fn add(
        &mut self,
        rt: &Arc<dyn DeviceRuntime>,
        c: DeviceCopy,
        read: (u64, u64),
        write: (u64, u64),
    ) {
        self.reads.insert(read);
        self.writes.insert(write);
        match self.groups.iter_mut().find(|(r, _)| Arc::ptr_eq(r, rt)) {
            Some((_, v)) => v.push(c),
            None => self.groups.push((rt.clone(), vec![c])),
        }
    }

    /// Runs every group and waits until all have completed.
    fn run(&mut self) -> Result<()> {
        self.reads = Spans::default();
        self.writes = Spans::default();
        let groups = std::mem::take(&mut self.groups);
        let (tx, rx) = std::sync::mpsc::channel();
        let mut started = 0;
        let mut first = Ok(());
        for (rt, copies) in &groups {
            let tx = tx.clone();
            // SAFETY: every range was checked against a live registration whose read
            // lock the caller holds until this returns, which is after every started
            // group has completed.
            match unsafe { rt.copy_group(copies, Box::new(move |r| drop(tx.send(r)))) } {
                Ok(()) => started += 1,
                Err(e) => first = first.and(Err(e)),
            }
        }
        for _ in 0..started {
            let r = rx.recv().unwrap_or_else(|_| {
                Err(Error::new(
                    ErrorKind::Backend,
                    "a device runtime dropped a copy group",
                ))
            });
            first = first.and(r);
        }
        first
    }
}

/// Largest piece of a copy between devices staged through the scratch buffer.
pub(crate) const STAGE: usize = 4 << 20;

/// Copies `len` bytes between two checked regions: host to host at once; through their
/// runtimes where they are device memory, into `groups` (device to device, not
/// through the host, on one device of one runtime).
pub(crate) fn copy(
    src: (&Region, u64),
    dst: (&Region, u64),
    len: usize,
    scratch: &mut Vec<u8>,
    groups: &mut Groups,
) -> Result<()> {
    let (s, d) = (src.0.addr + src.1, dst.0.addr + dst.1);
    let (read, write) = ((s, s + len as u64), (d, d + len as u64));
    if groups.depends(read, write) {
        groups.run()?;
    }
    let mut add = |rt, c| groups.add(rt, c, read, write);
    match (&src.0.device, &dst.0.device) {
        // SAFETY: both ranges were checked against live registrations whose read locks
        // the caller holds; host ranges are only reached through raw pointers; `copy`
        // allows overlap (one engine writing into itself).
        (None, None) => unsafe { std::ptr::copy(s as *const u8, d as *mut u8, len) },
        (None, Some((rt, ordinal))) => add(
            rt,
            DeviceCopy::ToDevice {
                ordinal: *ordinal,
                device: d,
                host: s as *const u8,
                len,
            },
        ),
        (Some((rt, ordinal)), None) => add(
            rt,
            DeviceCopy::ToHost {
                ordinal: *ordinal,
                device: s,
                host: d as *mut u8,
                len,
            },
        ),
        (Some((srt, so)), Some((drt, dord))) if Arc::ptr_eq(srt, drt) && so == dord => add(
            srt,
            DeviceCopy::DeviceToDevice {
                src_ordinal: *so,
                src: s,
                dst_ordinal: *dord,
                dst: d,
                len,
            },
        ),
        (Some((srt, so)), Some((drt, dord))) => {
            scratch.resize(len.min(STAGE), 0);
            let mut done = 0;
            while done < len {
                let n = (len - done).min(STAGE);
                let (from, to, host) = (s + done as u64, d + done as u64, scratch.as_mut_ptr());
                // SAFETY: as above; `scratch` is ours, at least `n` bytes long, and
                // each copy has completed (`copy_sync`) before the next reuses it.
                unsafe {
                    srt.copy_sync(DeviceCopy::ToHost {
                        ordinal: *so,
                        device: from,
                        host,
                        len: n,
                    })?;
                    drt.copy_sync(DeviceCopy::ToDevice {
                        ordinal: *dord,
                        device: to,
                        host,
                        len: n,
                    })?;
                }
                done += n;
            }
        }
    }
    Ok(())
}
