//! The receiver task of one data connection, initiator side: it matches each response
//! to the oldest written slice, places a READ's data (straight into registered host
//! memory, or through staging memory and a copy to the device) and finishes the
//! slice's batch.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use te_core::device::DeviceCopy;
use te_core::{BatchStage, Error, ErrorKind, Op, Result};

use super::Conn;
use crate::errors::{timeout_error, unreachable};
use crate::initiator::slice::Slice;
use crate::sock::Inbound;
use crate::stage;
use crate::target::respond;
use crate::wire::{Header, Kind, HEADER_LEN, MAX_MESSAGE};

impl Conn {
    /// The receiver task: matches each response to the oldest written slice.
    pub(super) async fn receive(self: Arc<Self>) {
        let mut inb = Inbound::new(self.sock.clone(), self.io_timeout);
        let e = loop {
            match self.receive_one(&mut inb).await {
                Ok(()) => {}
                Err(e) => break e,
            }
        };
        if !self.is_dead() && e.kind() == ErrorKind::Protocol {
            tracing::warn!(peer = %self.label, error = %e, "closing a data connection");
        }
        self.kill(e);
    }

    async fn receive_one(&self, inb: &mut Inbound) -> Result<()> {
        let mut on_timeout = |_mid: bool| self.lock().sent.is_empty();
        inb.fill(HEADER_LEN, &mut on_timeout)
            .await
            .map_err(|e| unreachable(&self.label, "receive failed", e))?;
        let h = Header::decode(&inb.buffered()[..HEADER_LEN]).map_err(|e| self.protocol(e))?;
        inb.consume(HEADER_LEN);
        self.progress.fetch_add(1, Ordering::Release);
        let slice = {
            let mut tx = self.lock();
            let Some(slice) = tx.sent.pop_front() else {
                return Err(self.protocol(format!("a {:?} answering no request", h.kind)));
            };
            tx.receiving = Some(slice.batch.clone());
            slice
        };
        // A target answers a request once it has read all of it, so only after the
        // socket took the whole frame. An earlier answer (a broken or hostile target)
        // must not end the slice: its WRITE payload may still be read from the
        // caller's memory. It goes back on the queue, and fails with the connection
        // once no writer holds it.
        let written = *self.written.lock();
        if slice.end > written {
            let id = slice.id;
            let mut tx = self.lock();
            tx.receiving = None;
            tx.sent.push_front(slice);
            return Err(self.protocol(format!(
                "a {:?} answering request {id} before all of it was sent",
                h.kind
            )));
        }
        let result = self.answer(inb, &h, &slice).await;
        slice.batch.stage_ended(BatchStage::Wire);
        self.lock().receiving = None;
        self.progress.fetch_add(1, Ordering::Release);
        let fatal = match &result {
            Err(e) if matches!(e.kind(), ErrorKind::PeerUnreachable | ErrorKind::Protocol) => {
                Some(e.clone())
            }
            _ => None,
        };
        self.inflight.fetch_sub(1, Ordering::Relaxed);
        match result {
            // A host → device copy finishes the slice when it completes.
            Ok(Answer::Copying) => {}
            Ok(Answer::Done) => slice.batch.finish_slice(Ok(())),
            Err(e) => slice.batch.finish_slice(Err(e)),
        }
        if slice.stage.is_some() {
            // Its staging buffer goes back to the pool: wake a writer waiting for one.
            drop(slice);
            self.wake.notify_one();
        }
        match fatal {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Handles the response `h` to `slice`; an error here fails the slice.
    async fn answer(&self, inb: &mut Inbound, h: &Header, slice: &Slice) -> Result<Answer> {
        if h.id != slice.id {
            return Err(self.protocol(format!(
                "response {} while request {} was next",
                h.id, slice.id
            )));
        }
        let mut on_timeout = |_mid: bool| false;
        match (h.kind, slice.op) {
            (Kind::WriteAck, Op::Write) => Ok(Answer::Done),
            (Kind::ReadData, Op::Read) if h.len == slice.len && slice.batch.stopped() => {
                // Late data for a batch handed back to its caller: it must not land.
                inb.discard(slice.len, &mut on_timeout)
                    .await
                    .map_err(|e| unreachable(&self.label, "receive failed", e))?;
                Err(timeout_error())
            }
            (Kind::ReadData, Op::Read) if h.len == slice.len && slice.device.is_some() => {
                self.receive_staged(inb, slice).await
            }
            (Kind::ReadData, Op::Read) if h.len == slice.len && !slice.parts.is_empty() => {
                // Each part's destination is registered host memory pinned by the
                // slice's batch; the slice is out of `sent`, so only this thread
                // touches it.
                let dst = slice.parts.iter().map(|p| (p.local, p.len as usize));
                inb.read_scattered(dst, &mut on_timeout)
                    .await
                    .map_err(|e| unreachable(&self.label, "receive failed", e))?;
                Ok(Answer::Done)
            }
            (Kind::ReadData, Op::Read) if h.len == slice.len => {
                // The destination is registered memory pinned by the slice's batch; the
                // slice is out of `sent`, so only this thread touches it.
                inb.read_into(slice.local, slice.len as usize, &mut on_timeout)
                    .await
                    .map_err(|e| unreachable(&self.label, "receive failed", e))?;
                Ok(Answer::Done)
            }
            (Kind::Error, _) => {
                let len = h.len.min(MAX_MESSAGE) as usize;
                inb.fill(len, &mut on_timeout)
                    .await
                    .map_err(|e| unreachable(&self.label, "receive failed", e))?;
                let msg = String::from_utf8_lossy(&inb.buffered()[..len]).into_owned();
                inb.consume(len);
                let refused = "the target refused the request";
                Err(
                    Error::from_peer(ErrorKind::from_code(h.code), refused, &msg)
                        .with_context("peer", &self.label),
                )
            }
            _ => Err(self.protocol(format!(
                "a {:?} of {} bytes answering a {} of {} bytes",
                h.kind, h.len, slice.op, slice.len
            ))),
        }
    }

    /// Receives a device READ's data into a staging buffer and starts its copies to the
    /// device (one per run of adjacent parts, from successive parts of the buffer) as
    /// one group; the group's completion finishes the slice. The next response is
    /// received while the copies run.
    async fn receive_staged(&self, inb: &mut Inbound, slice: &Slice) -> Result<Answer> {
        let Some((rt, ordinal)) = &slice.device else {
            return Err(self.protocol("a staged read without a device"));
        };
        let len = slice.len as usize;
        let mut on_timeout = |_mid: bool| false;
        // Waits only for this direction's own copies to finish.
        let taken = match self.recv_pools.get(rt) {
            Ok(pool) => pool.take(len).await,
            Err(e) => Err(e),
        };
        let buf = match taken {
            Ok(b) => b,
            Err(e) => {
                // The payload is still in the stream: skip it, so the next header is
                // read where it starts, and fail this slice alone.
                inb.discard(slice.len, &mut on_timeout)
                    .await
                    .map_err(|e| unreachable(&self.label, "receive failed", e))?;
                return Err(e);
            }
        };
        // The range is ours and holds `len` bytes.
        inb.read_into(buf.ptr() as usize, len, &mut on_timeout)
            .await
            .map_err(|e| unreachable(&self.label, "receive failed", e))?;
        let pieces = slice.pieces().into_iter().map(|(d, l)| (d as u64, l));
        let copies: Vec<DeviceCopy> = stage::packed(pieces, buf.ptr())
            .into_iter()
            .map(|(device, host, len)| DeviceCopy::ToDevice {
                ordinal: *ordinal,
                device,
                host,
                len,
            })
            .collect();
        // Parts that write some device bytes twice (a batch reading into them twice)
        // are copied in waves, one after another, in order.
        let waves = respond::staged_waves(copies);
        slice.batch.stage_began(BatchStage::Device);
        if len <= stage::INLINE_COPY && waves.len() == 1 {
            // Small: this task copies it and finishes the slice, rather than a runtime
            // thread waking it and then the caller.
            // SAFETY: as below; `buf` lives until the copies have ended.
            let r = unsafe { stage::run_now(rt, &waves[0]) };
            slice.batch.stage_ended(BatchStage::Device);
            drop(buf);
            return r.map(|()| Answer::Done);
        }
        let batch = slice.batch.clone();
        // A copy that ends is the connection's progress too: answers waiting for the
        // ring that slow copies fill are not a stall.
        let conn = self.me.upgrade();
        self.copy_started();
        let done = move |r: Result<()>| {
            drop(buf);
            batch.stage_ended(BatchStage::Device);
            batch.finish_slice(r);
            if let Some(conn) = conn {
                conn.copy_done();
            }
        };
        // SAFETY: the device ranges lie in a region the batch pins until this slice
        // finishes, which `done` does after the copies; the buffer is owned by `done`
        // and its first `len` bytes, the parts' total, were just received. No copy of
        // a wave depends on another of it.
        unsafe { respond::start_waves(rt, waves, Box::new(done)) };
        Ok(Answer::Copying)
    }
}

/// How a response ended its slice.
enum Answer {
    /// The slice is done.
    Done,
    /// A copy to the device finishes it.
    Copying,
}
