//! The seam between the engine and a fabric: [`TransferBackend`] and [`Completion`].

use std::cell::UnsafeCell;
use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use abi_stable::std_types::{RResult, RString};
use abi_stable::StableAbi;
use serde::de::DeserializeOwned;

use crate::desc::{
    BackendInfo, Capabilities, MemoryDesc, PeerId, RegionId, SegmentDesc, TransferRequest,
};
use crate::error::{Error, ErrorKind, Result};
use crate::hook::ControlHook;
use crate::sync::Mutex;
pub use crate::time::Deadline;

/// One fabric, implemented once per backend crate.
///
/// The engine calls it from many threads at once. No method waits for a peer's data:
/// `submit` posts work and returns, and the backend later completes the batch's
/// [`Completion`] from its own progress (a completion thread, an event fd, an I/O
/// thread). There is no poll method; nobody spins.
///
/// # The contract
///
/// **Memory.** After a batch's [`Completion`] is consumed ([`Completion::complete`], or
/// dropped), the backend touches none of the batch's local memory again: no byte is
/// read from a WRITE's source, none lands in a READ's destination. A WRITE is completed
/// with `Ok` only when its data is visible at the target (a peer that reads the region
/// after being notified sees it); a READ only when its data is in local memory.
///
/// **Abort.** At the batch's deadline, or when its caller cancels it, or when one of its
/// local regions is being deregistered, the engine sets the completion's abort flag
/// ([`Completion::is_aborted`]) and then calls [`TransferBackend::abort`]. Abort *asks*
/// the backend to stop: it posts nothing more of the batch, discards data that arrives
/// for it, and completes the completion as soon as nothing of the batch can touch its
/// local memory any more. The batch's handle resolves (`Timeout`, `Cancelled`) only
/// when that completion arrives, so a backend that cannot stop DMA at once makes the
/// handle wait for it: the contract is about memory, not the clock. The backend's own
/// result is then replaced by the reason of the abort.
///
/// **Regions.** The engine checks every request against both sides' descriptors
/// (region exists, rights, bounds) and *pins* the batch's local regions from that check
/// until the batch is released, so a local region named by a batch in flight is never
/// deregistered under it: the engine waits for (then aborts) pinned batches before it
/// calls [`TransferBackend::deregister`]. A backend that receives data itself (on
/// behalf of a peer) must still check every request on the receiving side, against its
/// own registrations, before a byte lands.
///
/// **Deadlines.** Every method that can wait receives the [`Deadline`] of the caller's
/// one deadline, never a fixed timeout of its own, and returns `Timeout` once it has
/// passed.
///
/// **Lives.** [`BackendContext::epoch`] is the engine's identity for this life; a
/// backend names itself to peers with it (rather than minting an id of its own), and
/// binds each peer to the epoch of the descriptor it connected with, so that a
/// restarted peer is a new peer.
///
/// **Threads.** The engine never drops a backend on one of the backend's own threads
/// (its completion callbacks hold no strong reference to the engine); a backend may
/// join its threads in `Drop`. Completions may be completed from any thread, and the
/// callbacks they run do little (they never block on the backend).
pub trait TransferBackend: Send + Sync + fmt::Debug + 'static {
    /// Name, version and capabilities.
    fn info(&self) -> &BackendInfo;

    /// The bytes a peer's backend needs to reach this one (published in the descriptor).
    fn endpoint(&self) -> Vec<u8>;

    /// Makes `mem` usable as region `id` (engine-assigned, unique across engine lives)
    /// and returns the remote key bytes peers need to reach it (may be empty). The range
    /// may lie inside a region registered before (the engine registers each slot of a
    /// KV layout as a region of its own, so the receiving side enforces slot bounds);
    /// the key bytes must carry no right `mem.access` lacks.
    ///
    /// # Errors
    /// `Unsupported` for a memory kind the backend cannot move; `Backend` if the fabric
    /// refuses the memory.
    fn register(&self, id: RegionId, mem: &MemoryDesc) -> Result<Vec<u8>>;

    /// Forgets region `id`. Returning `Ok` is a barrier: no transfer of this backend —
    /// local, or a peer's transfer this backend serves — touches the region's memory
    /// any more, so its owner may free it. A backend that cannot promise that by
    /// `deadline` returns an error, and the engine then never frees the memory.
    ///
    /// # Errors
    /// `NotRegistered` if `id` is unknown; `Timeout` if transfers on it are still
    /// running at `deadline`.
    fn deregister(&self, id: RegionId, deadline: Deadline) -> Result<()>;

    /// Connects to the peer the descriptor describes, before `deadline`. Idempotent:
    /// connecting to an endpoint again updates its descriptor (new regions) and returns
    /// the same id; a descriptor of another epoch is another peer.
    ///
    /// # Errors
    /// `PeerUnreachable` if the peer cannot be reached; `Timeout` at the deadline;
    /// `Unsupported` if the backend cannot reach it from here (another process, host).
    fn connect(&self, peer: &SegmentDesc, deadline: Deadline) -> Result<PeerId>;

    /// Drops a peer and whatever connections it holds. Batches in flight to it fail
    /// (and are released as the memory contract says).
    ///
    /// # Errors
    /// `PeerUnreachable` if `peer` is unknown.
    fn disconnect(&self, peer: PeerId, deadline: Deadline) -> Result<()>;

    /// Posts a batch. On `Ok`, `done` is completed exactly once, later or already. On
    /// `Err`, the batch failed as a whole before any byte moved, and `done` is dropped
    /// without completing.
    ///
    /// # Errors
    /// Anything that makes the whole batch impossible before any byte moves.
    fn submit(&self, peer: PeerId, batch: &[TransferRequest], done: Completion) -> Result<()>;

    /// Asks the backend to stop batch `batch` to `peer` (its completion's abort flag is
    /// already set): see "Abort" above. Called from an engine thread; must not block.
    /// The default does nothing, for backends that look at [`Completion::is_aborted`]
    /// often enough on their own.
    fn abort(&self, peer: PeerId, batch: BatchId) {
        let _ = (peer, batch);
    }

    /// Gauges of the backend's own state, by name (`staging_bytes_in_use`), for the
    /// engine's metrics; read when a snapshot is taken, so it may take a short lock but
    /// must not block. The default reports none.
    fn gauges(&self) -> Vec<(String, u64)> {
        Vec::new()
    }

    /// How bytes to `peer` travel, in words, where the backend has more than one way
    /// (te-tcp: over its sockets, device copies to a peer in this process, or a
    /// same-host peer's channel); `None` for an unknown peer or a backend with one way.
    fn path_to(&self, peer: PeerId) -> Option<String> {
        let _ = peer;
        None
    }

    /// Lends the calling thread, which is about to wait for batch `batch` to `peer`, to
    /// the backend until the batch is released or `until` passes, whichever is first.
    /// A backend whose progress would end in waking this thread from one of its own
    /// (an answer read on a receiving thread, then handed over) can let this thread do
    /// that work itself and save the hand-off: te-tcp, with `caller_reads`, reads a
    /// same-host channel's answer on the waiting thread.
    ///
    /// Returns whether the thread waited for work of the batch here; `false` (the
    /// default) when the backend has none this thread can wait for, and the engine
    /// then waits for the completion as usual. It must block, never spin, and return by
    /// `until`, and must not block on anything a slow peer or connect can hold (the
    /// caller's own timeout may be short); the completion is still completed exactly
    /// once, by whichever thread does the work, and other batches' completions it runs
    /// run their callbacks on this (the application's) thread.
    fn drive(&self, peer: PeerId, batch: BatchId, until: Deadline) -> bool {
        let _ = (peer, batch, until);
        false
    }
}

/// The context a backend is created in: the engine's identity, the backend's own
/// configuration table and where it came from.
#[derive(Debug, Clone, Default)]
pub struct BackendContext {
    /// The engine's name.
    pub engine: String,
    /// The engine's epoch: random and non-zero, new at every start. Backends name
    /// themselves to peers with it rather than minting an instance id of their own.
    pub epoch: u64,
    /// The engine's `auth_token`: a backend's own connections (te-tcp's data plane)
    /// prove it too.
    pub auth_token: Option<String>,
    /// The engine's control plane, for the backend's side traffic.
    pub hook: ControlHook,
    /// The backend's table (`[backends.NAME]`), empty if the configuration has none.
    pub table: toml::Table,
    /// Where the table came from (a file path, or `defaults`), for messages.
    pub source: String,
    /// The host of `[engine] listen` (without its port): a backend that opens a
    /// listener of its own binds that host too unless its table says otherwise.
    /// `None` outside an engine's configuration.
    pub listen_host: Option<String>,
    /// `[engine] advertise`: the host peers reach this engine at, where `listen` binds
    /// every interface.
    pub advertise: Option<String>,
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

    /// Parses the backend's table into its config and validates it
    /// ([`BackendConfig::validate`]): what the registry does before `create`.
    ///
    /// # Errors
    /// `ConfigInvalid`, naming the offending key and the file.
    pub fn config<C: BackendConfig>(&self, backend: &str) -> Result<C> {
        let c: C = self.parse(backend)?;
        c.validate()
            .map_err(|e| e.with_context("file", &self.source))?;
        Ok(c)
    }

    /// The epoch, or a fresh random one where the context has none (a backend created
    /// outside an engine, in a test).
    pub fn epoch_or_random(&self) -> u64 {
        if self.epoch != 0 {
            self.epoch
        } else {
            random_nonzero()
        }
    }
}

/// A random non-zero `u64`: epochs, instance ids, region-id bases.
pub fn random_nonzero() -> u64 {
    loop {
        let v: u64 = rand::random();
        if v != 0 {
            return v;
        }
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

/// Identifies a batch within one engine, for [`TransferBackend::abort`].
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, StableAbi)]
pub struct BatchId(pub u64);

impl fmt::Display for BatchId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A stage of a batch that a backend may time ([`Completion::stage_began`] and
/// [`Completion::stage_ended`]); the engine reports each stage timed in the batch's
/// telemetry, in the metrics' stage histograms and in its trace.
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BatchStage {
    /// On the fabric: from the first byte of the batch sent or posted until the last
    /// answer or work completion came back.
    Wire = 0,
    /// Device copies (staging, device to device): from the first submitted until the
    /// last completed.
    Device = 1,
}

impl BatchStage {
    /// Every stage, in order.
    pub const ALL: [BatchStage; 2] = [BatchStage::Wire, BatchStage::Device];

    /// The stage's name in metrics and traces.
    pub fn name(self) -> &'static str {
        match self {
            BatchStage::Wire => "wire",
            BatchStage::Device => "device",
        }
    }
}

/// What the engine and the backend share of one batch besides its result: the abort
/// flag, and the first and last instants (monotonic nanoseconds) of each stage the
/// backend timed. It lives in a never-freed [`Slot`], reset for each batch the slot
/// serves, so a completion's pointer to it stays valid whatever a backend does with
/// copies of the completion; C layout, so a plugin's copy of te-core reads and writes
/// it the same way.
#[repr(C)]
#[derive(Debug, StableAbi)]
pub(crate) struct Signals {
    /// The slot's ticket (a multiple of [`TICKET`]) plus the abort reason in the low
    /// byte (non-zero once the batch is to be aborted), in one word, so that a
    /// completion reads its ticket and its batch's abort flag together.
    state: AtomicU64,
    first_ns: [AtomicU64; 2],
    last_ns: [AtomicU64; 2],
}

/// One step of a slot's ticket; the bits below it hold the abort reason.
const TICKET: u64 = 1 << 8;
const ABORT: u64 = TICKET - 1;

impl Signals {
    /// Each stage the backend timed, with its first and last instants.
    pub(crate) fn stages(&self) -> impl Iterator<Item = (BatchStage, u64, u64)> + '_ {
        BatchStage::ALL.into_iter().filter_map(|s| {
            let first = self.first_ns[s as usize].load(Ordering::Acquire);
            let last = self.last_ns[s as usize].load(Ordering::Acquire);
            (first != u64::MAX && last >= first).then_some((s, first, last))
        })
    }
}

/// The one-shot signal a backend completes when a batch is released.
///
/// It must be completed exactly once; [`Completion::complete`] takes `self` by value,
/// and dropping it uncompleted (a backend shutting down with work in flight) completes
/// it with `Cancelled`. Either way the backend promises, by consuming it, that nothing
/// of the batch touches its local memory any more. It is plain data with a C layout,
/// so a backend loaded as a plugin completes it the same way a built-in one does.
///
/// A copy of it (which only unsafe code, or a plugin not written in Rust, can make) is
/// harmless once the first is consumed, though still a bug in the backend: completing
/// it again is ignored and logged, [`Completion::is_aborted`] says `true` (the batch is
/// over), and its stage notes are dropped; it reads and writes nothing of the batches
/// that come after.
#[repr(C)]
#[derive(StableAbi)]
pub struct Completion {
    /// The [`Slot`] holding the batch's context and signals; slots are never freed.
    ctx: *mut (),
    /// Which use of the slot this completion is: a copy used after the slot moved on
    /// (at this completion, and at each reuse) no longer matches it.
    ticket: u64,
    call: unsafe extern "C" fn(
        ctx: *mut (),
        ticket: u64,
        result: RResult<(), FfiError>,
        dropped: bool,
    ),
    /// The slot's signals; they belong to this completion's batch while `ticket` is
    /// the slot's.
    signals: *const Signals,
    batch: BatchId,
    deadline: Deadline,
}

// SAFETY: the context is a boxed `FnOnce + Send` closure, taken at most once (by the
// ticket's compare-exchange), from whichever thread completes; the signals are atomics
// in a slot that is never freed.
unsafe impl Send for Completion {}
// SAFETY: `&Completion` only touches the atomic signals and reads plain data.
unsafe impl Sync for Completion {}

type Callback = Box<dyn FnOnce(Result<()>, bool) + Send>;

/// Where a batch's signals and its completion's context live. Slots are leaked and
/// reused, never freed, so a completion's `ctx` and `signals` stay valid pointers for
/// the life of the process, whatever a backend does with copies of it; the pool grows
/// to the most batches alive at once (per shard) and stays there.
struct Slot {
    signals: Signals,
    /// Who holds the slot's current use: its [`BatchSignals`] and its completion until
    /// that is consumed. The last to let go puts the slot back on its free list.
    holders: AtomicUsize,
    /// The free list the slot goes back to.
    shard: usize,
    /// Written only by the slot's owner: the thread that builds the completion (before
    /// the completion exists, so before its ticket can be matched), then the one whose
    /// compare-exchange of the ticket succeeded.
    context: UnsafeCell<Option<Callback>>,
}

// SAFETY: `context` is only touched by the slot's one owner at a time, as its doc
// says; the completion's hand-over to the backend, and the ticket's acquiring
// compare-exchange, order each owner's accesses before the next one's.
unsafe impl Sync for Slot {}

const SHARDS: usize = 16;

/// Free slots, in shards so that threads building completions rarely share a lock.
static FREE: [Mutex<Vec<&'static Slot>>; SHARDS] = [const { Mutex::new(Vec::new()) }; SHARDS];

/// This thread's shard of [`FREE`].
fn shard() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
    }
    SHARD.try_with(|s| *s).unwrap_or(0)
}

impl Slot {
    /// The context of the completion with `ticket`, once: `None` if that completion
    /// was completed (or dropped) before. Moves the ticket on and lets the completion's
    /// hold on the slot go.
    fn take(&'static self, ticket: u64) -> Option<Callback> {
        self.signals
            .state
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |s| {
                (s & !ABORT == ticket).then_some(s.wrapping_add(TICKET))
            })
            .ok()?;
        // SAFETY: the compare-exchange made this thread the slot's owner, after the
        // thread that built the completion (which handed it over since).
        let f = unsafe { (*self.context.get()).take() };
        self.release();
        f
    }

    /// Lets one holder go; the last puts the slot back on its free list.
    fn release(&'static self) {
        if self.holders.fetch_sub(1, Ordering::AcqRel) == 1 {
            FREE[self.shard].lock().push(self);
        }
    }
}

/// A batch's signals, held by the engine (or an [`Aborter`]) for as long as it needs
/// them: the slot is not reused before its holders let it go.
pub(crate) struct BatchSignals {
    slot: &'static Slot,
    ticket: u64,
}

impl BatchSignals {
    /// Takes a free slot (or leaks a new one) and resets its signals for a new batch.
    pub(crate) fn new() -> BatchSignals {
        let shard = shard();
        let slot = FREE[shard].lock().pop().unwrap_or_else(|| {
            Box::leak(Box::new(Slot {
                signals: Signals {
                    state: AtomicU64::new(0),
                    first_ns: [AtomicU64::new(u64::MAX), AtomicU64::new(u64::MAX)],
                    last_ns: [AtomicU64::new(0), AtomicU64::new(0)],
                },
                holders: AtomicUsize::new(0),
                shard,
                context: UnsafeCell::new(None),
            }))
        });
        let s = &slot.signals;
        for i in 0..BatchStage::ALL.len() {
            s.first_ns[i].store(u64::MAX, Ordering::Relaxed);
            s.last_ns[i].store(0, Ordering::Relaxed);
        }
        slot.holders.store(1, Ordering::Relaxed);
        // A new ticket and no abort; published after the reset, so that a completion
        // that sees its ticket sees its batch's signals.
        let ticket = (s.state.load(Ordering::Relaxed) & !ABORT).wrapping_add(TICKET);
        s.state.store(ticket, Ordering::Release);
        BatchSignals { slot, ticket }
    }

    /// The signals (the holder may read them whatever the completion did).
    pub(crate) fn signals(&self) -> &Signals {
        &self.slot.signals
    }

    /// Sets the abort reason `why` (non-zero) unless one is set; returns whether this
    /// call set it.
    pub(crate) fn abort(&self, why: u8) -> bool {
        self.slot
            .signals
            .state
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |s| {
                (s & ABORT == 0).then_some(s | u64::from(why))
            })
            .is_ok()
    }

    /// The abort reason; zero while there is none.
    pub(crate) fn aborted(&self) -> u8 {
        (self.slot.signals.state.load(Ordering::SeqCst) & ABORT) as u8
    }
}

impl Drop for BatchSignals {
    fn drop(&mut self) {
        self.slot.release();
    }
}

impl fmt::Debug for BatchSignals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BatchSignals")
            .field("ticket", &self.ticket)
            .field("aborted", &self.aborted())
            .finish()
    }
}

unsafe extern "C" fn call_slot(
    ctx: *mut (),
    ticket: u64,
    result: RResult<(), FfiError>,
    dropped: bool,
) {
    // SAFETY: `ctx` is the `&'static Slot` `Completion::build` stored, or a copy of
    // it: slots are never freed, so it is valid however often it is called.
    let slot = unsafe { &*(ctx as *const Slot) };
    match slot.take(ticket) {
        Some(f) => f(from_ffi(result), dropped),
        None => tracing::error!(
            dropped,
            "the backend completed a batch that it had completed (or dropped) before; the second completion is ignored; this is a bug in the backend"
        ),
    }
}

/// Aborts the [`Completion`] it was made with (for backends' own tests; the engine
/// aborts through its batches).
#[derive(Debug, Clone)]
pub struct Aborter(Arc<BatchSignals>);

impl Aborter {
    /// Sets the completion's abort flag.
    pub fn abort(&self) {
        self.0.abort(1);
    }
}

impl Completion {
    /// A completion that runs `f` once with the batch's result and whether the backend
    /// dropped it without completing. `timeout` is the time the batch has left.
    pub fn new(timeout: Duration, f: impl FnOnce(Result<()>, bool) + Send + 'static) -> Completion {
        let signals = BatchSignals::new();
        Completion::build(BatchId(0), Deadline::after(timeout), &signals, Box::new(f))
    }

    /// As [`Completion::new`], with a deadline, and the [`Aborter`] that sets its flag.
    pub fn abortable(
        deadline: Deadline,
        f: impl FnOnce(Result<()>, bool) + Send + 'static,
    ) -> (Completion, Aborter) {
        let signals = BatchSignals::new();
        let c = Completion::build(BatchId(0), deadline, &signals, Box::new(f));
        (c, Aborter(Arc::new(signals)))
    }

    /// The engine's completion for batch `batch`, on `signals`, which no completion was
    /// built on before (the slot's context is this completion's alone).
    pub(crate) fn build(
        batch: BatchId,
        deadline: Deadline,
        signals: &BatchSignals,
        f: Callback,
    ) -> Completion {
        let slot = signals.slot;
        slot.holders.fetch_add(1, Ordering::Relaxed);
        // SAFETY: no completion with the slot's ticket exists yet (this makes the one),
        // so nothing else can take the context: this thread owns it.
        let context = unsafe { &mut *slot.context.get() };
        debug_assert!(context.is_none(), "a second completion on one BatchSignals");
        *context = Some(f);
        Completion {
            ctx: slot as *const Slot as *mut (),
            ticket: signals.ticket,
            call: call_slot,
            signals: &slot.signals,
            batch,
            deadline,
        }
    }

    /// Completes the batch with its result: the backend is done with its memory.
    pub fn complete(self, result: Result<()>) {
        let this = ManuallyDrop::new(self);
        // SAFETY: `call` and `ctx` are as `build` made them; `this` is never dropped, so
        // this completion is consumed exactly here.
        unsafe { (this.call)(this.ctx, this.ticket, to_ffi(result), false) }
    }

    /// The batch's id, as [`TransferBackend::abort`] names it.
    pub fn batch(&self) -> BatchId {
        self.batch
    }

    /// The batch's deadline.
    pub fn deadline(&self) -> Deadline {
        self.deadline
    }

    /// The time left before the batch's deadline; zero once it has passed.
    pub fn remaining(&self) -> Duration {
        self.deadline.remaining()
    }

    /// Whether the engine asked to stop the batch (deadline, cancel, deregistration):
    /// post nothing more of it, discard what arrives for it, and complete it once
    /// nothing of it touches local memory. Always `true` for a copy of a completion
    /// that was consumed: its batch is over.
    pub fn is_aborted(&self) -> bool {
        let s = self.signals().state.load(Ordering::Acquire);
        s & !ABORT != self.ticket || s & ABORT != 0
    }

    /// Notes that `stage` of the batch began now (the earliest of such notes counts):
    /// call it as each slice enters the stage, or once.
    pub fn stage_began(&self, stage: BatchStage) {
        let now = crate::time::monotonic_ns();
        if self.is_current() {
            self.signals().first_ns[stage as usize].fetch_min(now, Ordering::AcqRel);
        }
    }

    /// Notes that `stage` of the batch ended now (the latest of such notes counts).
    pub fn stage_ended(&self, stage: BatchStage) {
        let now = crate::time::monotonic_ns();
        if self.is_current() {
            self.signals().last_ns[stage as usize].fetch_max(now, Ordering::AcqRel);
        }
    }

    /// Whether the slot's signals are still this completion's batch's (only a copy
    /// used after the completion was consumed finds they are not).
    ///
    /// A copy's note that passes this check just before the first completion is
    /// consumed still lands: in its own batch's times, or, should its thread stall
    /// past that batch's end and the slot's reuse, in a later batch's, with an instant
    /// from before that batch began. That costs one batch's stage telemetry, never
    /// memory, an abort or a result, and only where a backend already broke the rule;
    /// closing it would cost every note a reference count.
    fn is_current(&self) -> bool {
        self.signals().state.load(Ordering::Acquire) & !ABORT == self.ticket
    }

    fn signals(&self) -> &Signals {
        // SAFETY: `signals` points into a slot, and slots are never freed; whose batch
        // the signals are is for the caller to check against the ticket.
        unsafe { &*self.signals }
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        let e = Error::new(
            ErrorKind::Cancelled,
            "the backend dropped the batch without completing it (it is shutting down)",
        );
        // SAFETY: `call` and `ctx` are as `build` made them; `drop` runs only when
        // `complete` did not.
        unsafe { (self.call)(self.ctx, self.ticket, to_ffi(Err(e)), true) }
    }
}

impl fmt::Debug for Completion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completion")
            .field("batch", &self.batch)
            .field("remaining", &self.remaining())
            .field("aborted", &self.is_aborted())
            .finish()
    }
}

impl Capabilities {
    /// `host` and every device runtime linked into this process, for a backend that
    /// moves device memory through the runtimes' own copies (staging or device to
    /// device) rather than through its fabric.
    pub fn host_and_runtimes() -> Vec<String> {
        std::iter::once("host".to_string())
            .chain(
                crate::device::runtimes()
                    .into_iter()
                    .map(|r| r.0.to_string()),
            )
            .collect()
    }
}

/// A backend's `[backends.NAME]` table, parsed (unknown keys refused) and then
/// validated before the backend is created — by the registry for the engine's
/// backend, and by `te check` for every table a file names.
pub trait BackendConfig: serde::de::DeserializeOwned {
    /// Refuses values that parse but cannot work (a zero count, a limit below its
    /// floor), naming the key and what to write instead. The default accepts all.
    ///
    /// # Errors
    /// `ConfigInvalid`, naming the key.
    fn validate(&self) -> Result<()> {
        Ok(())
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

    #[test]
    fn a_copy_of_a_completion_completed_again_is_ignored() {
        let (tx, rx) = mpsc::channel();
        let tx2 = tx.clone();
        let first = Completion::new(Duration::from_secs(1), move |r, _| {
            tx.send(("first", r.is_ok())).unwrap()
        });
        // SAFETY (deliberately broken, as a C plugin might): a second owner of the same
        // completion. Only `complete` is called on it, which must be ignored.
        let copy = unsafe { std::ptr::read(&first) };
        first.complete(Ok(()));
        // The slot is likely reused by the next completion on this thread: the copy
        // must not complete that one either.
        let second = Completion::new(Duration::from_secs(1), move |r, _| {
            tx2.send(("second", r.is_ok())).unwrap()
        });
        copy.complete(Err(Error::new(ErrorKind::Backend, "completed twice")));
        assert_eq!(rx.try_recv().unwrap(), ("first", true));
        assert!(rx.try_recv().is_err(), "the copy completed something");
        second.complete(Ok(()));
        assert_eq!(rx.try_recv().unwrap(), ("second", true));
    }

    #[test]
    fn a_copy_used_after_its_completion_says_its_batch_is_over_and_sees_no_other_batch() {
        let first = Completion::new(Duration::from_secs(1), |_, _| {});
        // SAFETY (deliberately broken, as a C plugin might): a second owner of the same
        // completion, used after the first is completed.
        let copy = unsafe { std::ptr::read(&first) };
        first.complete(Ok(()));
        // Later batches, which may reuse what the first one's signals were in.
        let next: Vec<_> = (0..8)
            .map(|_| Completion::abortable(Deadline::after(Duration::from_secs(1)), |_, _| {}))
            .collect();
        let before = copy.is_aborted();
        copy.stage_began(BatchStage::Wire);
        copy.stage_ended(BatchStage::Wire);
        for (_, aborter) in &next {
            aborter.abort();
        }
        let after = copy.is_aborted();
        assert_eq!(
            (before, after),
            (true, true),
            "the copy of a completed completion must say its batch is over, whatever later batches do"
        );
        for (done, _) in next {
            assert!(done.is_aborted());
            done.complete(Ok(()));
        }
        copy.complete(Ok(()));
    }

    #[test]
    fn a_copys_notes_after_its_completion_reach_no_later_batch_on_its_slot() {
        let deadline = Deadline::after(Duration::from_secs(1));
        // The free list is per thread and last-in first-out, so the next batch almost
        // always takes the slot the first left; another test's thread on the same
        // shard may take it first, hence the retries.
        for _ in 0..100 {
            let first = Completion::new(Duration::from_secs(1), |_, _| {});
            // SAFETY (deliberately broken, as a C plugin might): a second owner of the
            // same completion, used after the first is completed.
            let copy = unsafe { std::ptr::read(&first) };
            first.complete(Ok(()));
            let next = BatchSignals::new();
            if !std::ptr::eq(next.slot, copy.ctx as *const Slot) {
                std::mem::forget(copy);
                continue;
            }
            let done = Completion::build(BatchId(1), deadline, &next, Box::new(|_, _| {}));
            copy.stage_began(BatchStage::Wire);
            copy.stage_ended(BatchStage::Wire);
            assert_eq!(
                next.signals().stages().count(),
                0,
                "the copy's notes landed"
            );
            assert!(copy.is_aborted() && !done.is_aborted());
            done.stage_began(BatchStage::Device);
            done.stage_ended(BatchStage::Device);
            assert!(next.abort(2));
            assert!(done.is_aborted() && next.aborted() == 2);
            copy.complete(Ok(()));
            let stages: Vec<_> = next.signals().stages().map(|s| s.0).collect();
            assert_eq!(stages, [BatchStage::Device]);
            done.complete(Ok(()));
            // The engine still reads its batch's signals after the completion.
            assert_eq!(next.aborted(), 2);
            assert_eq!(next.signals().stages().count(), 1);
            return;
        }
        panic!("no later batch took the first one's slot in 100 tries");
    }

    #[test]
    fn an_aborter_raises_its_completions_flag() {
        let (done, aborter) =
            Completion::abortable(Deadline::after(Duration::from_secs(1)), |_, _| {});
        assert!(!done.is_aborted());
        aborter.abort();
        assert!(done.is_aborted());
        done.complete(Ok(()));
    }
}
