//! A test fixture: a te backend plugin that misbehaves on request. It is compiled by
//! `tests/plugin_misbehaviour.rs` at run time with `rustc`, against the te-core rlib the
//! workspace build left in `target/<profile>/deps` (so it is a plugin of *this* te),
//! as `libte_misbehaving.so`. `[backends.misbehaving] misbehave = "…"` picks the
//! misbehaviour:
//!
//! - `info`, `endpoint`, `register`, `connect`, `submit`, `drop`, `debug`: that call
//!   (`Drop`, `Debug`) panics;
//! - `handler_drop`: the backend serves a message handler whose `Drop` panics;
//! - `double`: `submit` completes its batch twice (a copy of the completion, as a C
//!   plugin or a buggy unsafe one would);
//! - `stale`: `submit` completes its batch at once but keeps a copy of its completion,
//!   and at the next `submit` uses that copy (asks whether it is aborted, which must
//!   say it is, or this panics; times a wire stage; drops it) before posting the new
//!   batch;
//! - anything else: a well-behaved no-op backend (completes every batch `Ok`).

use std::sync::{Arc, Mutex};

use te_core::{
    BackendContext, BackendInfo, BatchStage, Capabilities, Completion, Deadline, Error, ErrorKind,
    MemoryDesc, MessageHandler, PeerId, PeerInfo, RegionId, Result, SegmentDesc, TransferBackend,
    TransferRequest,
};

struct Misbehaving {
    info: BackendInfo,
    mode: String,
    epoch: u64,
    /// `stale`: the copy of the last batch's completion.
    stale: Mutex<Option<Completion>>,
}

impl Misbehaving {
    fn maybe_panic(&self, call: &str) {
        if self.mode == call {
            panic!("misbehaving plugin: {call} panics");
        }
    }
}

impl TransferBackend for Misbehaving {
    fn info(&self) -> &BackendInfo {
        self.maybe_panic("info");
        &self.info
    }

    fn endpoint(&self) -> Vec<u8> {
        self.maybe_panic("endpoint");
        self.epoch.to_le_bytes().to_vec()
    }

    fn register(&self, _id: RegionId, _mem: &MemoryDesc) -> Result<Vec<u8>> {
        self.maybe_panic("register");
        Ok(Vec::new())
    }

    fn deregister(&self, _id: RegionId, _deadline: Deadline) -> Result<()> {
        Ok(())
    }

    fn connect(&self, _peer: &SegmentDesc, _deadline: Deadline) -> Result<PeerId> {
        self.maybe_panic("connect");
        Ok(PeerId(7))
    }

    fn disconnect(&self, _peer: PeerId, _deadline: Deadline) -> Result<()> {
        Ok(())
    }

    fn submit(&self, _peer: PeerId, _batch: &[TransferRequest], done: Completion) -> Result<()> {
        self.maybe_panic("submit");
        if self.mode == "double" {
            // SAFETY (deliberately violated): a second owner of the same completion,
            // as a plugin written in C could make by copying the struct.
            let twin = unsafe { std::ptr::read(&done) };
            std::thread::spawn(move || {
                done.complete(Ok(()));
                std::thread::sleep(std::time::Duration::from_millis(100));
                twin.complete(Err(Error::new(
                    ErrorKind::Backend,
                    "misbehaving plugin: second completion of the same batch",
                )));
            });
        } else if self.mode == "stale" {
            let old = self.stale.lock().unwrap().take();
            if let Some(old) = old {
                // The batch `old` copies was completed: the copy must say it is over,
                // and its notes must not reach another batch.
                let aborted = old.is_aborted();
                old.stage_began(BatchStage::Wire);
                old.stage_ended(BatchStage::Wire);
                drop(old);
                assert!(
                    aborted,
                    "misbehaving plugin: a copy of a completed batch's completion says it is not aborted"
                );
            }
            // SAFETY (deliberately violated): a second owner of the same completion,
            // kept after the batch is completed, as a plugin written in C could.
            *self.stale.lock().unwrap() = Some(unsafe { std::ptr::read(&done) });
            done.complete(Ok(()));
        } else {
            std::thread::spawn(move || done.complete(Ok(())));
        }
        Ok(())
    }
}

impl std::fmt::Debug for Misbehaving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.maybe_panic("debug");
        write!(f, "Misbehaving({})", self.mode)
    }
}

/// A message handler whose `Drop` panics.
struct PanicsWhenDropped;

impl MessageHandler for PanicsWhenDropped {
    fn handle(&self, _from: &PeerInfo, _request: &[u8], _deadline: Deadline) -> Result<Vec<u8>> {
        Ok(Vec::new())
    }
}

impl Drop for PanicsWhenDropped {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            panic!("misbehaving plugin: the message handler's drop panics");
        }
    }
}

impl Drop for Misbehaving {
    fn drop(&mut self) {
        if self.mode == "drop" && !std::thread::panicking() {
            panic!("misbehaving plugin: drop panics");
        }
    }
}

fn probe() -> Result<()> {
    Ok(())
}

fn create(ctx: &BackendContext) -> Result<Arc<dyn TransferBackend>> {
    let mode = ctx
        .table
        .get("misbehave")
        .and_then(|v| v.as_str())
        .unwrap_or("")
        .to_string();
    if mode == "handler_drop" {
        ctx.hook.serve(Arc::new(PanicsWhenDropped))?;
    }
    Ok(Arc::new(Misbehaving {
        info: BackendInfo {
            name: "misbehaving".to_string(),
            version: "0.1.0".to_string(),
            capabilities: Capabilities {
                memory: vec!["host".to_string()],
                read: true,
                write: true,
                cross_process: false,
                same_host_only: true,
                max_request_size: u64::MAX,
                checks_at_target: true,
            },
        },
        mode,
        epoch: ctx.epoch,
        stale: Mutex::new(None),
    }))
}

te_core::register_backend!("misbehaving", probe, create);
