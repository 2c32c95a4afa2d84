//! What travels on a data connection: a batch's slices (a piece of one request, or
//! pieces of several gathered into one frame) and, for device memory, where a slice's
//! bytes are staged.

use std::sync::Arc;
use te_core::sync::Mutex;

use te_core::{Error, Op, RegionId};

use crate::completion::Batch;
use crate::stage::{Dev, StageBuf};
use crate::wire::{self, Header, Kind, HEADER_LEN};

use crate::initiator::carry::Carry;

/// A piece of one request, at most `slice_size` bytes, travelling as one frame; or
/// pieces of several requests to one remote region, gathered into one frame.
pub(crate) struct Slice {
    pub(crate) batch: Arc<Batch>,
    pub(crate) op: Op,
    /// Address of the local bytes (source of a WRITE, destination of a READ); kept
    /// valid by the batch's pin on the local region.
    pub(crate) local: usize,
    pub(crate) remote: RegionId,
    pub(crate) remote_offset: u64,
    pub(crate) len: u64,
    /// The local region's device, when it is device memory.
    pub(crate) device: Option<Dev>,
    /// A device WRITE's staging: its copy into a pinned buffer.
    pub(crate) stage: Option<Arc<Mutex<Stage>>>,
    /// A scatter-gather slice's parts (empty for a plain slice, whose one range is
    /// `local`, `remote_offset`, `len`). Device memory's parts are staged packed, one
    /// after another, in one pinned buffer, so their payload is one span.
    pub(crate) parts: Vec<Part>,
    pub(crate) id: u64,
    /// Where its frame ends in the connection's outgoing stream (bytes), once queued
    /// to be written: an answer before the socket took that much answers a request
    /// the target cannot have read whole.
    pub(crate) end: u64,
}

/// One part of a scatter-gather slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Part {
    /// Address of the local bytes.
    pub(crate) local: usize,
    /// Where they go (or come from) in the remote region.
    pub(crate) remote_offset: u64,
    pub(crate) len: u64,
}

/// Where a device WRITE slice's bytes are on their way to the socket.
pub(crate) enum Stage {
    /// Waiting for a buffer.
    Idle,
    /// Being copied from the device.
    Copying,
    /// In this buffer, ready to send.
    Ready(StageBuf),
    /// On the wire: the socket took every byte and the buffer went back to its pool,
    /// before the target's acknowledgement.
    Sent,
    /// The copy failed.
    Failed(Error),
}

impl Slice {
    pub(crate) fn new(
        batch: Arc<Batch>,
        op: Op,
        local: usize,
        remote: RegionId,
        remote_offset: u64,
        len: u64,
        device: Option<Dev>,
    ) -> Slice {
        let stage = match (&device, op) {
            (Some(_), Op::Write) => Some(Arc::new(Mutex::new(Stage::Idle))),
            _ => None,
        };
        Slice {
            batch,
            op,
            local,
            remote,
            remote_offset,
            len,
            device,
            stage,
            parts: Vec::new(),
            id: 0,
            end: 0,
        }
    }

    /// A slice that travels as one scatter-gather frame: `parts` (at most
    /// [`wire::MAX_ENTRIES`], adding up to at most the frame limit) of one remote region,
    /// all in host memory or all on `device`. One part makes a plain slice.
    pub(crate) fn gathered(
        batch: Arc<Batch>,
        op: Op,
        remote: RegionId,
        parts: Vec<Part>,
        device: Option<Dev>,
    ) -> Slice {
        let first = parts.first().copied().unwrap_or(Part {
            local: 0,
            remote_offset: 0,
            len: 0,
        });
        let mut s = Slice::new(
            batch,
            op,
            first.local,
            remote,
            first.remote_offset,
            parts.iter().map(|p| p.len).sum(),
            device,
        );
        if parts.len() > 1 {
            s.parts = parts;
        }
        s
    }

    pub(crate) fn header(&self) -> Header {
        let kind = match (self.op, self.parts.is_empty()) {
            (Op::Write, true) => Kind::Write,
            (Op::Read, true) => Kind::Read,
            (Op::Write, false) => Kind::WriteV,
            (Op::Read, false) => Kind::ReadV,
        };
        if self.parts.is_empty() {
            return Header::request(kind, self.id, self.remote.0, self.remote_offset, self.len);
        }
        Header {
            kind,
            code: self.parts.len() as u32,
            id: self.id,
            region: self.remote.0,
            offset: 0,
            len: self.len,
        }
    }

    /// Whether the slice's staging copy runs: until it ends, it reads the caller's
    /// device memory, so the slice may not end before it.
    pub(crate) fn is_copying(&self) -> bool {
        self.stage
            .as_ref()
            .is_some_and(|st| matches!(*st.lock(), Stage::Copying))
    }

    /// The local ranges (address, bytes) the slice moves, in wire order.
    pub(crate) fn pieces(&self) -> Vec<(usize, usize)> {
        if self.parts.is_empty() {
            return vec![(self.local, self.len as usize)];
        }
        self.parts
            .iter()
            .map(|p| (p.local, p.len as usize))
            .collect()
    }

    /// The bytes of this slice's frame on the wire, as [`Slice::push_frame`] adds them:
    /// its header, a scatter-gather frame's entry list, and a WRITE's payload.
    pub(crate) fn wire_len(&self) -> u64 {
        let entries = if self.parts.is_empty() {
            0
        } else {
            self.parts.len() * wire::ENTRY_LEN
        };
        let payload = match self.op {
            Op::Write => self.len,
            Op::Read => 0,
        };
        (HEADER_LEN + entries) as u64 + payload
    }

    /// Adds this slice's frame to `c`: its header (and entry list), then for a WRITE
    /// its payload, from `payload` (a plain slice's source, or a device slice's staging
    /// buffer holding every part packed) or from each part.
    pub(crate) fn push_frame(&self, c: &mut Carry, payload: usize) {
        let h = self.header().encode();
        if self.parts.is_empty() {
            let body = match self.op {
                Op::Write => (payload, self.len as usize),
                Op::Read => (0, 0),
            };
            c.push(&h, std::iter::once(body));
            return;
        }
        let mut head = Vec::with_capacity(HEADER_LEN + self.parts.len() * wire::ENTRY_LEN);
        head.extend_from_slice(&h);
        for p in &self.parts {
            wire::Entry {
                offset: p.remote_offset,
                len: p.len,
            }
            .encode_into(&mut head);
        }
        match (self.op, self.device.is_some()) {
            (Op::Write, true) => c.push(&head, std::iter::once((payload, self.len as usize))),
            (Op::Write, false) => {
                c.push(&head, self.parts.iter().map(|p| (p.local, p.len as usize)))
            }
            (Op::Read, _) => c.push(&head, std::iter::empty()),
        }
    }
}
