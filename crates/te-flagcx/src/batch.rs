//! Turning a batch into shim transfers: its requests checked and split into
//! descriptors, its local regions counted in (see `regions`), its WRITEs and READs
//! posted as one vector each. The buffers for all of that are reused from batch to
//! batch, so a post allocates nothing once they have grown.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use te_core::sync::Mutex;

use te_core::kit::fits;
use te_core::{BatchStage, Completion, Error, ErrorKind, Op, Result, TransferRequest};

use crate::ffi::{Desc, E_STALE, E_UNREACHABLE, OP_READ, OP_WRITE};
use crate::peers::Link;
use crate::regions::{Pin, Regions};

/// Descriptors a scratch buffer holds before it has to grow.
const SCRATCH_DESCS: usize = 256;

/// A batch's descriptors and the regions it counted itself in on.
#[derive(Debug)]
pub(crate) struct Scratch {
    writes: Vec<Desc>,
    reads: Vec<Desc>,
    held: Vec<Pin>,
}

impl Scratch {
    fn new() -> Scratch {
        Scratch {
            writes: Vec::with_capacity(SCRATCH_DESCS),
            reads: Vec::with_capacity(SCRATCH_DESCS),
            held: Vec::with_capacity(8),
        }
    }
}

/// One batch in flight: up to two shim transfers (its WRITEs and its READs).
///
/// Dropped without [`Poster::finish`] (at shutdown) it reports cancelled: whoever drops
/// it first closes its link ([`InFlight::cancel`]), since other batches may keep the
/// connection, and with it this batch's transfers, alive.
pub(crate) struct InFlight {
    pub(crate) link: Arc<Link>,
    /// Transfers not yet reported finished.
    xfers: [Option<u64>; 2],
    /// The batch's first failure.
    error: Option<Error>,
    scratch: Scratch,
    done: Completion,
}

impl InFlight {
    /// Closes the batch's connection, ending every transfer on it (this batch's and
    /// any other's), so that once this returns nothing touches the batch's memory;
    /// then drops the batch, whose completion reports it cancelled.
    pub(crate) fn cancel(self) {
        self.link.conn.close();
        drop(self);
    }

    /// When the thread must look at the batch again to end it: the time left to its
    /// deadline once it was aborted (see [`InFlight::end_if_expired`]).
    pub(crate) fn abort_due(&self) -> Option<std::time::Duration> {
        self.done.is_aborted().then(|| self.done.remaining())
    }

    /// Ends an aborted batch whose deadline passed while its transfers are still in
    /// flight (a peer that stopped taking bytes, say): FlagCX cannot cancel a
    /// transfer, so the batch's connection is closed, which ends every transfer on it
    /// (other batches on it fail, and the next submit renews it). Once this returned
    /// nothing of the batch touches its memory, and its next [`InFlight::poll`]
    /// finishes it. True if it closed the connection.
    pub(crate) fn end_if_expired(&mut self) -> bool {
        if !self.done.is_aborted() || !self.done.remaining().is_zero() {
            return false;
        }
        if self.error.is_none() {
            self.error = Some(
                Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "aborted at its deadline with its transfers still in flight; their FlagCX connection to {} was closed to end them",
                        self.link.conn.peer()
                    ),
                )
                .with_operation("transfer"),
            );
        }
        self.link.stale.store(true, Ordering::Release);
        self.link.conn.close();
        true
    }

    /// Queries the batch's unfinished transfers; true once all have finished.
    pub(crate) fn poll(&mut self) -> bool {
        let mut pending = false;
        for slot in &mut self.xfers {
            let Some(xfer) = *slot else { continue };
            match self.link.conn.query(xfer) {
                Ok(false) => pending = true,
                Ok(true) => *slot = None,
                Err(e) => {
                    *slot = None;
                    if matches!(e.code(), Some(E_STALE | E_UNREACHABLE)) {
                        self.link.stale.store(true, Ordering::Release);
                    }
                    if self.error.is_none() {
                        self.error = Some(Error::from(e).with_operation("transfer"));
                    }
                }
            }
        }
        !pending
    }
}

/// Plans, posts and finishes batches; shared by the submitting threads and the
/// completion thread (which posts batches that waited for a connection).
#[derive(Debug)]
pub(crate) struct Poster {
    pub(crate) regions: Arc<Regions>,
    max_desc: u64,
    pool: Mutex<Vec<Scratch>>,
}

impl Poster {
    pub(crate) fn new(regions: Arc<Regions>, max_desc: u64) -> Poster {
        Poster {
            regions,
            max_desc,
            pool: Mutex::new(vec![Scratch::new()]),
        }
    }

    fn take(&self) -> Scratch {
        self.pool.lock().pop().unwrap_or_else(Scratch::new)
    }

    /// Unpins the batch's regions and keeps its buffers for the next one.
    fn put(&self, mut s: Scratch) {
        s.held.clear();
        s.writes.clear();
        s.reads.clear();
        self.pool.lock().push(s);
    }

    /// Checks `batch` against the local regions and `link`'s snapshot of the peer's,
    /// counts it in on its local regions and posts it.
    ///
    /// # Errors
    /// Whatever makes the whole batch fail before any byte moved, with its completion
    /// handed back uncompleted.
    pub(crate) fn start(
        &self,
        link: Arc<Link>,
        batch: &[TransferRequest],
        done: Completion,
    ) -> std::result::Result<InFlight, Box<(Error, Completion)>> {
        let mut scratch = self.take();
        if let Err(e) = self.plan(&link, batch, &mut scratch) {
            self.put(scratch);
            return Err(Box::new((e, done)));
        }
        let mut xfers = [None, None];
        let mut error = None;
        // The wire: from the first transfer posted until the last one finished.
        done.stage_began(BatchStage::Wire);
        for (op, descs) in [(OP_WRITE, &scratch.writes), (OP_READ, &scratch.reads)] {
            if descs.is_empty() {
                continue;
            }
            match link.conn.post(op, descs) {
                Ok(x) => {
                    let slot = if xfers[0].is_none() { 0 } else { 1 };
                    xfers[slot] = Some(x);
                }
                Err(e) => {
                    if matches!(e.code(), Some(E_STALE | E_UNREACHABLE)) {
                        link.stale.store(true, Ordering::Release);
                    }
                    // The WRITEs may be in flight: then the batch fails once they
                    // finished, and keeps its regions counted in until then.
                    error = Some(Error::from(e));
                    break;
                }
            }
        }
        if xfers[0].is_none() {
            self.put(scratch);
            let e = error.unwrap_or_else(|| {
                Error::new(ErrorKind::InvalidRequest, "the batch has no requests")
            });
            return Err(Box::new((e, done)));
        }
        Ok(InFlight {
            link,
            xfers,
            error,
            scratch,
            done,
        })
    }

    /// Completes a batch whose transfers all finished.
    pub(crate) fn finish(&self, b: InFlight) {
        let InFlight {
            link,
            error,
            scratch,
            done,
            ..
        } = b;
        self.put(scratch);
        drop(link);
        done.stage_ended(BatchStage::Wire);
        done.complete(match error {
            Some(e) => Err(e),
            None => Ok(()),
        });
    }

    /// Fills `scratch` with the batch's descriptors, split at the shim's limit, and
    /// counts the batch in on each local region it uses.
    fn plan(&self, link: &Link, batch: &[TransferRequest], scratch: &mut Scratch) -> Result<()> {
        for (i, r) in batch.iter().enumerate() {
            let fail = |kind, m: String| Err(Error::new(kind, m).with_context("request", i));
            // The engine checked the request against the local region; pinned once.
            let (mr, addr) = match scratch.held.iter().find(|h| h.id == r.local) {
                Some(h) => (h.data, h.addr),
                None => {
                    let h = self
                        .regions
                        .pin(r.local)
                        .map_err(|e| e.with_context("request", i))?;
                    let at = (h.data, h.addr);
                    scratch.held.push(h);
                    at
                }
            };
            // FlagCX's own table of the peer's regions, which the engine does not see.
            let Some(&(remote_addr, remote_len)) = link.remote.get(&r.remote) else {
                link.stale.store(true, Ordering::Release);
                return fail(
                    ErrorKind::NotRegistered,
                    format!(
                        "the peer's region {} is not in the connection's region table; the connection will be renewed",
                        r.remote
                    ),
                );
            };
            if !fits(r.remote_offset, r.len, remote_len) {
                return fail(
                    ErrorKind::OutOfBounds,
                    format!(
                        "{} of {} bytes at remote {}+{} does not fit the peer's region in FlagCX's table",
                        r.op, r.len, r.remote, r.remote_offset
                    ),
                );
            }
            let out = match r.op {
                Op::Write => &mut scratch.writes,
                Op::Read => &mut scratch.reads,
            };
            // Both ranges must lie inside the address space: a peer's descriptor is
            // checked at connect, but a range is never trusted to fit.
            let (Some(local), Some(remote)) = (
                addr.checked_add(r.local_offset),
                remote_addr.checked_add(r.remote_offset),
            ) else {
                return fail(
                    ErrorKind::OutOfBounds,
                    format!(
                        "{} of {} bytes at local {}+{} or remote {}+{} runs past the end of the address space",
                        r.op, r.len, r.local, r.local_offset, r.remote, r.remote_offset
                    ),
                );
            };
            if split(out, mr, local, remote, r.len, self.max_desc).is_none() {
                return fail(
                    ErrorKind::OutOfBounds,
                    format!(
                        "{} of {} bytes at local {:#x} or remote {:#x} runs past the end of the address space",
                        r.op, r.len, local, remote
                    ),
                );
            }
        }
        Ok(())
    }
}

/// Appends descriptors covering `len` bytes, none longer than `max`. `None`, with
/// nothing appended, if either range runs past the end of the address space or `max`
/// is 0.
pub(crate) fn split(
    out: &mut Vec<Desc>,
    mr: u64,
    local_addr: u64,
    remote_addr: u64,
    len: u64,
    max: u64,
) -> Option<()> {
    local_addr.checked_add(len)?;
    remote_addr.checked_add(len)?;
    if max == 0 {
        return None;
    }
    // No sum below overflows: both ends were checked above.
    let mut done = 0;
    while done < len {
        let n = max.min(len - done);
        out.push(Desc {
            local_mr: mr,
            local_addr: local_addr + done,
            remote_addr: remote_addr + done,
            len: n,
        });
        done += n;
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_over_the_limit_is_split_into_contiguous_descriptors_that_cover_it_exactly() {
        const GIB: u64 = 1 << 30;
        for (len, max, expect) in [
            (5 * GIB, GIB, 5),
            (5 * GIB + 1, GIB, 6),
            (4 * GIB, u32::MAX as u64, 2),
            (4096, 4096, 1),
            (1, GIB, 1),
        ] {
            let mut out = Vec::new();
            split(&mut out, 7, 0x1000, 0x9000_0000, len, max).expect("in the address space");
            assert_eq!(out.len(), expect, "{len} bytes at most {max} each");
            assert_eq!(out.iter().map(|d| d.len).sum::<u64>(), len);
            assert!(out
                .iter()
                .all(|d| d.len <= max && d.len > 0 && d.local_mr == 7));
            for (i, d) in out.iter().enumerate() {
                let at = i as u64 * max;
                assert_eq!(
                    (d.local_addr, d.remote_addr),
                    (0x1000 + at, 0x9000_0000 + at)
                );
            }
        }
    }

    #[test]
    fn a_range_running_past_the_address_space_is_refused_not_split() {
        let mut out = Vec::new();
        assert!(split(&mut out, 7, 0x1000, u64::MAX - 4095, 8192, 4096).is_none());
        assert!(split(&mut out, 7, u64::MAX - 10, 0x1000, 100, 4096).is_none());
        assert!(split(&mut out, 7, 0x1000, 0x2000, 100, 0).is_none());
        assert!(out.is_empty());
        assert!(split(&mut out, 7, 0x1000, u64::MAX - 8191, 4096, 4096).is_some());
        assert_eq!(out.len(), 1);
    }
}
