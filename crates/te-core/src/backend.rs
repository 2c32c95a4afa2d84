//! The seam between the engine and a fabric: [`TransferBackend`] and [`Completion`].

use std::fmt;
use std::mem::ManuallyDrop;
use std::time::Duration;

use abi_stable::std_types::{RResult, RString};
use abi_stable::StableAbi;
use serde::de::DeserializeOwned;

use crate::desc::{BackendInfo, MemoryDesc, PeerId, RegionId, SegmentDesc, TransferRequest};
use crate::error::{Error, ErrorKind, Result};

/// One fabric, implemented once per backend crate.
///
/// The engine calls it from many threads at once. Every method is non-blocking in the
/// sense that it never waits for a peer's data: `submit` posts work and returns, and the
/// backend later completes the batch's [`Completion`] from its own progress (a
/// completion thread, an event fd, an I/O thread). There is no poll method; nobody
/// spins.
///
/// The engine checks every request against both sides' descriptors (region exists,
/// rights, bounds) before `submit`, so a backend sees only requests that fit. A backend
/// that receives data itself must still check them again on the receiving side.
pub trait TransferBackend: Send + Sync + fmt::Debug + 'static {
    /// Name, version and capabilities.
    fn info(&self) -> &BackendInfo;

    /// The bytes a peer's backend needs to reach this one (published in the descriptor).
    fn endpoint(&self) -> Vec<u8>;

    /// Makes `mem` usable as region `id` (engine-assigned, never reused in one life)
    /// and returns the remote key bytes peers need to reach it (may be empty).
    ///
    /// # Errors
    /// `Unsupported` for a memory kind the backend cannot move; `Backend` if the fabric
    /// refuses the memory.
    fn register(&self, id: RegionId, mem: &MemoryDesc) -> Result<Vec<u8>>;

    /// Forgets region `id`. When this returns, no transfer of this backend touches the
    /// region's memory any more, so its owner may free it.
    ///
    /// # Errors
    /// `NotRegistered` if `id` is unknown.
    fn deregister(&self, id: RegionId) -> Result<()>;

    /// Connects to the peer the descriptor describes. Idempotent: connecting to an
    /// endpoint again updates its descriptor (new regions) and returns the same id.
    ///
    /// # Errors
    /// `PeerUnreachable` if the peer cannot be reached; `Unsupported` if the backend
    /// cannot reach it from here (another process, another host).
    fn connect(&self, peer: &SegmentDesc) -> Result<PeerId>;

    /// Drops a peer and whatever connections it holds. Batches in flight to it fail.
    ///
    /// # Errors
    /// `PeerUnreachable` if `peer` is unknown.
    fn disconnect(&self, peer: PeerId) -> Result<()>;

    /// Posts a batch. On `Ok`, `done` is completed exactly once, later or already. On
    /// `Err`, the batch failed as a whole and `done` is dropped without completing.
    ///
    /// # Errors
    /// Anything that makes the whole batch impossible before any byte moves.
    fn submit(&self, peer: PeerId, batch: &[TransferRequest], done: Completion) -> Result<()>;
}

/// The context a backend is created in: its own configuration table and where it came from.
#[derive(Debug, Clone, Default)]
pub struct BackendContext {
    /// The engine's name.
    pub engine: String,
    /// The backend's table (`[backends.NAME]`), empty if the configuration has none.
    pub table: toml::Table,
    /// Where the table came from (a file path, or `defaults`), for messages.
    pub source: String,
}

impl BackendContext {
    /// Deserializes the backend's table into its config struct (which should use
    /// `#[serde(deny_unknown_fields, default)]`).
    ///
    /// # Errors
    /// `ConfigInvalid`, naming the offending key and the file.
    pub fn parse<T: DeserializeOwned>(&self, backend: &str) -> Result<T> {
        T::deserialize(self.table.clone()).map_err(|e| {
            Error::new(
                ErrorKind::ConfigInvalid,
                format!("[backends.{backend}] in {}: {}", self.source, e.message()),
            )
            .with_operation("create backend")
        })
    }
}

/// An error as it crosses the plugin boundary: its code and its rendered message.
#[repr(C)]
#[derive(Debug, Clone, StableAbi)]
pub struct FfiError {
    /// [`ErrorKind::code`].
    pub code: u32,
    /// The error's one-line `Display`.
    pub message: RString,
}

impl From<Error> for FfiError {
    fn from(e: Error) -> FfiError {
        FfiError {
            code: e.kind().code(),
            message: e.to_string().into(),
        }
    }
}

impl From<FfiError> for Error {
    fn from(e: FfiError) -> Error {
        Error::from_parts(e.code, "", e.message.into())
    }
}

pub(crate) fn to_ffi<T>(r: Result<T>) -> RResult<T, FfiError> {
    r.map_err(FfiError::from).into()
}

pub(crate) fn from_ffi<T>(r: RResult<T, FfiError>) -> Result<T> {
    r.into_result().map_err(Error::from)
}

/// Nanoseconds on the process's monotonic clock (the clock `Instant` uses on Linux).
pub(crate) fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The one-shot signal a backend completes when a batch is done.
///
/// It must be completed exactly once; [`Completion::complete`] takes `self` by value,
/// and dropping it uncompleted (a backend shutting down with work in flight) completes
/// it with `Cancelled`. It is plain data with a C layout, so a backend loaded as a
/// plugin completes it the same way a built-in one does.
#[repr(C)]
#[derive(StableAbi)]
pub struct Completion {
    ctx: *mut (),
    call: unsafe extern "C" fn(ctx: *mut (), result: RResult<(), FfiError>, dropped: bool),
    deadline_ns: u64,
}

// SAFETY: the context is a boxed `FnOnce + Send` closure, called at most once, from
// whichever thread completes; nothing else touches it.
unsafe impl Send for Completion {}

type Callback = Box<dyn FnOnce(Result<()>, bool) + Send>;

unsafe extern "C" fn call_boxed(ctx: *mut (), result: RResult<(), FfiError>, dropped: bool) {
    // SAFETY: `ctx` came from `Box::into_raw` in `Completion::new`, and the
    // `ManuallyDrop` dance in `complete`/`drop` guarantees this runs once per context.
    let f = unsafe { Box::from_raw(ctx as *mut Callback) };
    f(from_ffi(result), dropped)
}

impl Completion {
    /// A completion that runs `f` once with the batch's result and whether the backend
    /// dropped it without completing. `timeout` is the time the batch has left.
    pub fn new(timeout: Duration, f: impl FnOnce(Result<()>, bool) + Send + 'static) -> Completion {
        let boxed: Callback = Box::new(f);
        let timeout_ns = u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX);
        Completion {
            ctx: Box::into_raw(Box::new(boxed)) as *mut (),
            call: call_boxed,
            deadline_ns: monotonic_ns().saturating_add(timeout_ns),
        }
    }

    /// Completes the batch with its result.
    pub fn complete(self, result: Result<()>) {
        let this = ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped, so the context is consumed exactly here.
        unsafe { (this.call)(this.ctx, to_ffi(result), false) }
    }

    /// The time left before the batch's deadline; zero once it has passed.
    pub fn remaining(&self) -> Duration {
        Duration::from_nanos(self.deadline_ns.saturating_sub(monotonic_ns()))
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        let e = Error::new(
            ErrorKind::Cancelled,
            "the backend dropped the batch without completing it (it is shutting down)",
        );
        // SAFETY: `drop` runs only when `complete` did not, so the context is live.
        unsafe { (self.call)(self.ctx, to_ffi(Err(e)), true) }
    }
}

impl fmt::Debug for Completion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completion")
            .field("remaining", &self.remaining())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn a_completion_delivers_its_result_once_and_a_dropped_one_cancels() {
        let (tx, rx) = mpsc::channel();
        let tx2 = tx.clone();
        Completion::new(Duration::from_secs(1), move |r, dropped| {
            tx.send((r.is_ok(), dropped)).unwrap()
        })
        .complete(Ok(()));
        drop(Completion::new(
            Duration::from_secs(1),
            move |r, dropped| {
                tx2.send((r.unwrap_err().kind() == ErrorKind::Cancelled, dropped))
                    .unwrap()
            },
        ));
        assert_eq!(rx.recv().unwrap(), (true, false));
        assert_eq!(rx.recv().unwrap(), (true, true));
        assert!(rx.try_recv().is_err());
    }
}
