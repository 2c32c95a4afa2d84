//! `fakedev`: a fake device runtime, so every device-memory path runs without a GPU.
//!
//! It is a fake: its "device memory" is host memory behind addresses the host cannot
//! dereference (non-canonical x86-64 addresses, `0x7e…`), so any code that touches a
//! device address directly instead of going through the runtime's copies faults at
//! once. It has two devices.
//!
//! It behaves like a GPU's copy engine where te's efficiency depends on it: each device
//! has a queue per direction (host → device, device → host, device → device), served by
//! a thread of its own; copies are enqueued without waiting and complete through their
//! callbacks; and it charges what a GPU charges — a cost per launch (`launch_cost`: a
//! group's copies of one device and direction are one launch, as one
//! `cuMemcpyBatchAsync` or one list-copy kernel is; with `batch = false`, one per copy,
//! as a driver without a batched call costs) and per synchronisation (`sync_cost`, once
//! per group of copies waited for together, once per single copy). So a pipeline that
//! synchronises or launches per small copy is slow here for the reason it would be slow
//! on a GPU, and the staging pipeline's efficiency is measured without one.
//!
//! Options (`[runtimes.fakedev]`): `launch_cost = "2us"`, `sync_cost = "10us"`,
//! `batch = true`, `completion_latency = "0us"`. The costs are paid on the runtime's own
//! threads (by spinning below 100 µs, where sleeps are too coarse, by sleeping above),
//! never on the caller's — except in [`DeviceRuntime::copy_group_wait`], which models a
//! caller waiting for the device on its own thread and pays them there. The costs hold
//! up the queue, as a GPU's copy engine is busy for a launch; `completion_latency` does
//! not: it delays only the report of a group's end (as a GPU's event wakes its waiter
//! late while the engine copies on), so a pipeline that waits for each group before it
//! starts the next is slow by it, and one that overlaps them is not.
//!
//! A group resolves each copy's allocation as it is submitted (the two used last
//! first, then the allocation table once per allocation), and its thread locks every
//! allocation a part touches once for all the part's copies, in address order: so a
//! group of thousands of scattered blocks costs little per block, as one list-copy
//! kernel over them does. A group two of whose copies depend on each other (one
//! writes host or device bytes the other reads or writes) is refused before anything
//! runs, rather than run in the order given: a GPU runs a group's copies in no order
//! (`cuMemcpyBatchAsync` leaves dependent copies in one batch undefined), so code that
//! relied on fakedev's order would tear bytes on one.
//!
//! It counts, per device, the launches ("calls"), copies, synchronisations and bytes it
//! was given ([`FakeDev::device_stats`]), so tests and `te bench --json` see how many
//! device calls a transfer took; and it fails groups on request
//! ([`FakeDev::fail_next`]), so a failed copy's path is tested.
//!
//! Its memory is shareable between processes, as CUDA's is through IPC memory handles:
//! each allocation is a memfd mapped shared, [`DeviceRuntime::ipc_export`] hands out a
//! duplicate of the descriptor (to pass over a Unix socket), and
//! [`DeviceRuntime::ipc_import`] maps one at a fresh fake address of this process, so
//! bytes one process copies in are the bytes the other copies out. Nothing orders two
//! processes' copies to the same bytes: as on a GPU, the transfer protocol must. Each
//! memfd is sealed when it is made (`F_SEAL_SHRINK`, `F_SEAL_GROW`, `F_SEAL_SEAL`), and
//! an import refuses a descriptor without `F_SEAL_SHRINK`: so no process, however
//! hostile, can shrink an allocation under another's mapping, whose next copy would
//! otherwise fault (`SIGBUS`) and kill that process.
//!
//! What it cannot prove: DMA behaviour, a real driver's alignment or pinning rules,
//! copy bandwidth, or anything about GPUDirect; nor a real driver's IPC rules — that
//! only `cudaMalloc`-style allocations have handles (not VMM or pool memory), that a
//! process opens a handle once (and never its own), or peer access between devices.
//! fakedev exports every allocation but those made with [`FakeDev::alloc_private`]
//! (which stand for memory-pool memory) and imports anything, its own exports included.

use crate::signals::SpawnMasked as _;
use crate::sync::Mutex;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::{Deref, DerefMut};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use serde::Deserialize;

use crate::device::{
    CopyCounters, CopyDone, CopyStats, DeviceCopy, DeviceRuntime, Group, IpcExport, PointerInfo,
};
use crate::error::{Error, ErrorKind, Result};

/// The runtime's name.
pub const NAME: &str = "fakedev";

const DEVICES: u32 = 2;
const BASE: u64 = 0x7e00_0000_0000_0000;

fn device_base(ordinal: u32) -> u64 {
    BASE + (u64::from(ordinal) << 44)
}

/// The device of an allocation's base.
fn ordinal_of(base: u64) -> u32 {
    ((base - BASE) >> 44) as u32
}

/// The `[runtimes.fakedev]` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FakeDevConfig {
    /// Charged for every copy launched.
    #[serde(deserialize_with = "crate::units::de::duration")]
    pub launch_cost: Duration,
    /// Charged for every synchronisation: once per group, once per single copy.
    #[serde(deserialize_with = "crate::units::de::duration")]
    pub sync_cost: Duration,
    /// How long after a group's copies have ended its completion is reported, while
    /// the queue goes on with the next group: the time a GPU's event takes to wake its
    /// waiter, which the copy engine does not wait for. Slept, never spun, by a thread
    /// of the queue's own (or by the caller, in [`DeviceRuntime::copy_group_wait`]), so
    /// it is at least the timer's slack; 0 (the default) reports at once.
    #[serde(deserialize_with = "crate::units::de::duration")]
    pub completion_latency: Duration,
    /// Whether a group's copies of one device and direction are one launch (as one
    /// batched driver call or one list-copy kernel is), or one launch each (as a loop
    /// of single-copy calls is, where a driver lacks the batched call).
    pub batch: bool,
    /// The devices this process sees, in ordinal order: `[1, 0]` numbers them the other
    /// way round, as `CUDA_VISIBLE_DEVICES=1,0` does, so two processes can disagree on
    /// ordinals and must name devices by [`DeviceRuntime::device_id`] (`fakedev-N`).
    pub visible: [u32; DEVICES as usize],
}

impl Default for FakeDevConfig {
    fn default() -> Self {
        FakeDevConfig {
            launch_cost: Duration::from_micros(2),
            sync_cost: Duration::from_micros(10),
            completion_latency: Duration::ZERO,
            batch: true,
            visible: std::array::from_fn(|i| i as u32),
        }
    }
}

/// One allocation's bytes: a memfd mapped shared, so that another process can map
/// the same bytes. Unmapped, and the descriptor closed, when dropped.
struct Mapping {
    ptr: *mut u8,
    len: usize,
    fd: OwnedFd,
}

// SAFETY: the mapping belongs to this value alone (no other handle to it exists in
// this process), and it is read and written only through `&`/`&mut` borrows of it.
unsafe impl Send for Mapping {}
// SAFETY: as above; a shared borrow only reads.
unsafe impl Sync for Mapping {}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping")
            .field("len", &self.len)
            .field("fd", &self.fd)
            .finish()
    }
}

/// The error of the libc call `what`, from `errno`.
fn os_error(what: &str) -> Error {
    Error::new(ErrorKind::Io, format!("fakedev: {what} failed"))
        .with_source(std::io::Error::last_os_error())
}

impl Mapping {
    /// `len` (non-zero) zeroed bytes in a new memfd, sealed: its size is final, so no
    /// process that holds it can shrink it under another's mapping (see the module's
    /// docs), nor add seals of its own.
    fn create(len: usize) -> Result<Mapping> {
        let fd = crate::local::sealed_memfd(c"te-fakedev", len).map_err(|e| {
            Error::new(
                ErrorKind::Io,
                format!("fakedev: cannot allocate {len} bytes in a memfd"),
            )
            .with_source(e)
        })?;
        Mapping::map(fd, len)
    }

    /// The first `len` (non-zero) bytes of `fd` mapped shared, read and write.
    fn map(fd: OwnedFd, len: usize) -> Result<Mapping> {
        // SAFETY: a new mapping chosen by the kernel, so nothing of this process is
        // replaced; the result is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(os_error("mmap of a memfd"));
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
            fd,
        })
    }
}

impl Deref for Mapping {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` maps `len` readable bytes until `self` is dropped.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl DerefMut for Mapping {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` maps `len` writable bytes until `self` is dropped, and `&mut
        // self` makes this the only borrow of them in this process.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once, here; no borrow of it
        // outlives `self`. The descriptor closes when `fd` drops.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

type Arena = Arc<Mutex<Mapping>>;

/// The allocations, by base address.
#[derive(Debug)]
struct Allocs {
    /// Each arena by its base, with its length (read without locking the arena, which
    /// a copy may hold).
    arenas: BTreeMap<u64, (usize, Arena)>,
    /// Per device: the next free address.
    next: [u64; DEVICES as usize],
    /// The bases of arenas mapped by `ipc_import` (closed with `ipc_close`, not freed).
    imported: BTreeSet<u64>,
    /// The bases of arenas no other process may map ([`FakeDev::alloc_private`]).
    private: BTreeSet<u64>,
}

impl Allocs {
    /// Places `arena` at a fresh address of device `ordinal`.
    fn place(&mut self, ordinal: u32, arena: Mapping) -> u64 {
        let len = arena.len;
        let next = &mut self.next[ordinal as usize];
        let addr = *next;
        *next = addr + (len as u64).next_multiple_of(4096);
        self.arenas.insert(addr, (len, Arc::new(Mutex::new(arena))));
        addr
    }
}

/// The arenas a group's copies resolved to, each once: its copies name them by index.
/// The two used last are tried first, as a group's copies mostly fall in the same few
/// arenas (and a GPU resolves nothing per copy either); then the table, by base.
struct Seen {
    arenas: Vec<(u64, usize, Arena)>,
    by_base: HashMap<u64, usize>,
    last: [usize; 2],
}

impl Default for Seen {
    fn default() -> Self {
        Seen {
            arenas: Vec::new(),
            by_base: HashMap::new(),
            last: [usize::MAX; 2],
        }
    }
}

impl Seen {
    /// The index, base and length of the arena holding `addr`.
    fn resolve(&mut self, dev: &FakeDev, addr: u64) -> Option<(usize, u64, usize)> {
        let inside = |a: &&(u64, usize, Arena)| addr >= a.0 && addr - a.0 < a.1 as u64;
        for i in self.last {
            if let Some(a) = self.arenas.get(i).filter(inside) {
                return Some((i, a.0, a.1));
            }
        }
        let (base, len, arena) = dev.find(addr)?;
        let i = match self.by_base.get(&base) {
            Some(&i) => i,
            None => {
                self.arenas.push((base, len, arena));
                self.by_base.insert(base, self.arenas.len() - 1);
                self.arenas.len() - 1
            }
        };
        self.last = [i, self.last[0]];
        Some((i, base, self.arenas[i].1))
    }

    /// The arenas, for the group's parts to hold.
    fn into_arenas(self) -> Arc<[Arena]> {
        self.arenas.into_iter().map(|(_, _, a)| a).collect()
    }
}

/// One copy with its arenas resolved: an index into its part's arenas, and an offset.
struct Planned {
    copy: DeviceCopy,
    src: Option<(usize, usize)>,
    dst: Option<(usize, usize)>,
}

// SAFETY: the host pointers in `copy` are covered by the `copy` contract (valid and
// owned by the copy until `done` runs).
unsafe impl Send for Planned {}

/// One device and direction's part of a group.
struct Part {
    /// The group's arenas (its copies' indices point here), kept alive until it ends.
    arenas: Arc<[Arena]>,
    /// The ones this part's copies touch, each once, in address order (once the part
    /// is whole): locked in that order while it runs.
    used: Vec<usize>,
    copies: Vec<Planned>,
    /// One launch for the part (a batched call), rather than one per copy.
    batched: bool,
    /// Fail the part without copying ([`FakeDev::fail_next`]).
    fail: bool,
}

impl Part {
    fn new(batched: bool) -> Part {
        Part {
            arenas: Arc::from([]),
            used: Vec::new(),
            copies: Vec::new(),
            batched,
            fail: false,
        }
    }

    /// Adds `p`, noting its arenas (sorted and deduplicated by `finish`).
    fn add(&mut self, p: Planned) {
        for (i, _) in p.src.into_iter().chain(p.dst) {
            if self.used.last() != Some(&i) {
                self.used.push(i);
            }
        }
        self.copies.push(p);
    }

    /// Hands the part the group's `arenas` and puts the ones it uses in address order,
    /// the order every part locks them in (so two parts sharing some cannot deadlock).
    fn finish(&mut self, arenas: Arc<[Arena]>) {
        self.used
            .sort_unstable_by_key(|&i| Arc::as_ptr(&arenas[i]) as usize);
        self.used.dedup();
        self.arenas = arenas;
    }
}

struct Job {
    part: Part,
    done: CopyDone,
}

/// The fake runtime.
#[derive(Debug)]
pub struct FakeDev {
    allocs: Mutex<Allocs>,
    /// A queue per device and direction.
    queues: Vec<Mutex<Sender<Job>>>,
    config: FakeDevConfig,
    /// Per device: what its copies cost.
    counters: Arc<Vec<CopyCounters>>,
    /// Over all queues: groups ended but not yet reported (`completion_latency`).
    unreported: Arc<Unreported>,
    /// Per device: how many of the next groups to fail.
    failing: Vec<AtomicU64>,
    /// How many of the next imports to refuse ([`FakeDev::refuse_imports`]).
    refusing: AtomicU64,
}

/// Pays `cost` on this (the runtime's) thread.
fn pay(cost: Duration) {
    if cost.is_zero() {
    } else if cost < Duration::from_micros(100) {
        let end = Instant::now() + cost;
        while Instant::now() < end {
            std::hint::spin_loop();
        }
    } else {
        std::thread::sleep(cost);
    }
}

fn run_queue(
    rx: mpsc::Receiver<Job>,
    config: FakeDevConfig,
    counters: &CopyCounters,
    late: Option<(Sender<Late>, Arc<Unreported>)>,
) {
    for job in rx {
        let r = run_part(&job.part, config, counters);
        match &late {
            Some((late, unreported)) => {
                // `start` bounds the latency, so this cannot overflow.
                let at = Instant::now() + config.completion_latency;
                unreported.add();
                // The reporting thread ends only once this queue has, unless a
                // completion panicked on it: then this one is reported here, at once.
                if let Err(mpsc::SendError((_, done, r))) = late.send((at, job.done, r)) {
                    unreported.now.fetch_sub(1, Ordering::AcqRel);
                    done(r);
                }
            }
            None => (job.done)(r),
        }
    }
}

/// The longest `completion_latency` fakedev takes.
const MAX_LATENCY: Duration = Duration::from_secs(3600);

/// A group's completion to report at the given time.
type Late = (Instant, CopyDone, Result<()>);

/// Groups whose copies have ended and whose completion is not reported yet: now, and
/// the most at once.
#[derive(Debug, Default)]
struct Unreported {
    now: AtomicU64,
    most: AtomicU64,
}

impl Unreported {
    fn add(&self) {
        let n = self.now.fetch_add(1, Ordering::AcqRel) + 1;
        self.most.fetch_max(n, Ordering::AcqRel);
    }
}

/// Reports each queued completion at its time, in order (their times only grow).
fn report_late(rx: mpsc::Receiver<Late>, unreported: &Unreported) {
    for (at, done, r) in rx {
        let left = at.saturating_duration_since(Instant::now());
        if !left.is_zero() {
            std::thread::sleep(left);
        }
        unreported.now.fetch_sub(1, Ordering::AcqRel);
        done(r);
    }
}

/// Pays for and runs one part of a group on this thread: a launch for the part (or
/// one per copy), the copies, then one synchronisation.
fn run_part(part: &Part, config: FakeDevConfig, counters: &CopyCounters) -> Result<()> {
    // A failed part was submitted, but moved nothing.
    let bytes = |p: &Planned| if part.fail { 0 } else { p.copy.len() as u64 };
    if part.batched {
        pay(config.launch_cost);
        counters.call(part.copies.len(), part.copies.iter().map(bytes).sum());
    }
    // Every arena the part touches, locked once for all its copies, in address order.
    let mut bases = vec![std::ptr::null_mut::<u8>(); part.arenas.len()];
    let held: Vec<_> = (part.used.iter())
        .map(|&i| {
            let mut a = part.arenas[i].lock();
            bases[i] = a.as_mut_ptr();
            a
        })
        .collect();
    for p in &part.copies {
        if !part.batched {
            pay(config.launch_cost);
            counters.call(1, bytes(p));
        }
        if !part.fail {
            // SAFETY: every arena of the copy is locked above and stays so until the
            // loop ends; its ranges were checked against them when it was planned.
            unsafe { execute(p, &bases) };
        }
    }
    drop(held);
    pay(config.sync_cost);
    counters.sync();
    if part.fail {
        return Err(Error::new(
            ErrorKind::Backend,
            "fakedev: a copy group failed (injected by FakeDev::fail_next)",
        ));
    }
    Ok(())
}

/// Runs one copy; `bases[i]` is the start of arena `i`.
///
/// # Safety
/// The copy's arenas are locked by this thread, and its arena ranges lie inside them;
/// its host range is valid (the `copy` contract).
unsafe fn execute(p: &Planned, bases: &[*mut u8]) {
    let len = p.copy.len();
    let at = |(i, off): (usize, usize)| bases[i].wrapping_add(off);
    match (p.copy, p.src, p.dst) {
        // SAFETY: forwarded from the caller.
        (DeviceCopy::ToDevice { host, .. }, _, Some(d)) => unsafe {
            std::ptr::copy_nonoverlapping(host, at(d), len)
        },
        // SAFETY: forwarded from the caller.
        (DeviceCopy::ToHost { host, .. }, Some(s), _) => unsafe {
            std::ptr::copy_nonoverlapping(at(s), host, len)
        },
        // SAFETY: forwarded from the caller; a copy within one arena may overlap, which
        // `copy` allows.
        (DeviceCopy::DeviceToDevice { .. }, Some(s), Some(d)) => unsafe {
            std::ptr::copy(at(s), at(d), len)
        },
        _ => {}
    }
}

/// The configuration a `[runtimes.fakedev]` table gives, checked.
fn config(table: &toml::Table) -> Result<FakeDevConfig> {
    let config = FakeDevConfig::deserialize(table.clone()).map_err(|e| {
        Error::new(
            ErrorKind::ConfigInvalid,
            format!("[runtimes.fakedev]: {}", e.message()),
        )
    })?;
    let mut seen = config.visible;
    seen.sort_unstable();
    if seen.iter().enumerate().any(|(i, &d)| d != i as u32) {
        return Err(Error::new(
            ErrorKind::ConfigInvalid,
            format!(
                "[runtimes.fakedev]: visible = {:?} must name each of fakedev's devices 0..{DEVICES} once",
                config.visible
            ),
        ));
    }
    Ok(config)
}

fn check(table: &toml::Table) -> Result<()> {
    config(table).map(drop)
}

fn create(table: &toml::Table) -> Result<Arc<dyn DeviceRuntime>> {
    let rt = FakeDev::start(config(table)?)?;
    // `device::runtime` creates one instance per process; keep it for `process`.
    let _ = PROCESS.set(rt.clone());
    Ok(rt as Arc<dyn DeviceRuntime>)
}

static PROCESS: OnceLock<Arc<FakeDev>> = OnceLock::new();

/// The process's instance, the one [`crate::device::runtime`] hands out for `fakedev`
/// memory, once it has been made; so a test can read its counters ([`FakeDev::syncs`])
/// after moving bytes through it.
pub fn process() -> Option<Arc<FakeDev>> {
    PROCESS.get().cloned()
}

impl FakeDev {
    /// A runtime with these costs and its queue threads. (The process's instance is
    /// made on first use, from `[runtimes.fakedev]`.)
    ///
    /// # Errors
    /// `Io` if its threads cannot start; `ConfigInvalid` for a `completion_latency` over
    /// an hour.
    pub fn start(config: FakeDevConfig) -> Result<Arc<FakeDev>> {
        if config.completion_latency > MAX_LATENCY {
            return Err(Error::new(
                ErrorKind::ConfigInvalid,
                format!(
                    "[runtimes.fakedev]: completion_latency = {:?} is over the {MAX_LATENCY:?} it may be",
                    config.completion_latency
                ),
            ));
        }
        let counters: Arc<Vec<CopyCounters>> =
            Arc::new((0..DEVICES).map(|_| CopyCounters::default()).collect());
        let mut queues = Vec::new();
        let thread_error =
            |e| Error::new(ErrorKind::Io, "cannot start a fakedev queue thread").with_source(e);
        let unreported = Arc::new(Unreported::default());
        for q in 0..DEVICES * 3 {
            let (tx, rx) = mpsc::channel::<Job>();
            let counters = counters.clone();
            let late = if config.completion_latency.is_zero() {
                None
            } else {
                let (late, reports) = mpsc::channel::<Late>();
                let counted = unreported.clone();
                std::thread::Builder::new()
                    .name(format!("te-fakedev-{}-{}-done", q / 3, q % 3))
                    .spawn_masked(move || report_late(reports, &counted))
                    .map_err(thread_error)?;
                Some((late, unreported.clone()))
            };
            std::thread::Builder::new()
                .name(format!("te-fakedev-{}-{}", q / 3, q % 3))
                .spawn_masked(move || run_queue(rx, config, &counters[(q / 3) as usize], late))
                .map_err(thread_error)?;
            queues.push(Mutex::new(tx));
        }
        let next = std::array::from_fn(|i| device_base(i as u32));
        Ok(Arc::new(FakeDev {
            allocs: Mutex::new(Allocs {
                arenas: BTreeMap::new(),
                next,
                imported: BTreeSet::new(),
                private: BTreeSet::new(),
            }),
            queues,
            config,
            counters,
            unreported,
            failing: (0..DEVICES).map(|_| AtomicU64::new(0)).collect(),
            refusing: AtomicU64::new(0),
        }))
    }

    /// Allocates `len` bytes on device `ordinal` that [`DeviceRuntime::ipc_export`]
    /// refuses to share with another process, as CUDA refuses memory-pool
    /// (`cudaMallocAsync`) allocations; freed with [`DeviceRuntime::free`].
    ///
    /// # Errors
    /// As [`DeviceRuntime::alloc`].
    pub fn alloc_private(&self, ordinal: u32, len: usize) -> Result<u64> {
        let addr = self.alloc(ordinal, len)?;
        self.allocs.lock().private.insert(addr);
        Ok(addr)
    }

    /// Allocations of other processes mapped here now ([`DeviceRuntime::ipc_import`]
    /// and not yet closed).
    pub fn imported(&self) -> usize {
        self.allocs.lock().imported.len()
    }

    /// Of those, the ones mapped on device `ordinal`.
    pub fn imported_on(&self, ordinal: u32) -> usize {
        let allocs = self.allocs.lock();
        allocs
            .imported
            .iter()
            .filter(|&&a| ordinal_of(a) == ordinal)
            .count()
    }

    /// Synchronisations paid so far on every device (one per group per queue, one per
    /// single copy).
    pub fn syncs(&self) -> u64 {
        self.counters.iter().map(|c| c.get().syncs).sum()
    }

    /// The most groups, over all devices and directions, whose copies had ended and
    /// whose completion was still to be reported (`completion_latency`) at one time
    /// since the last call: how many groups a pipeline kept in flight at once (1 where
    /// each waited for the one before). A group counts once per device and direction
    /// it copies on; groups a caller waits for itself
    /// ([`DeviceRuntime::copy_group_wait`]) are not counted.
    pub fn most_unreported(&self) -> u64 {
        let now = self.unreported.now.load(Ordering::Acquire);
        self.unreported.most.swap(now, Ordering::AcqRel)
    }

    /// What copies on device `ordinal` have cost so far (zeros for a device it does
    /// not have).
    pub fn device_stats(&self, ordinal: u32) -> CopyStats {
        self.counters
            .get(ordinal as usize)
            .map(CopyCounters::get)
            .unwrap_or_default()
    }

    /// Makes the next `imports` calls of [`DeviceRuntime::ipc_import`] fail with a
    /// `Backend` error, as a driver refuses to map a peer's memory it cannot reach.
    pub fn refuse_imports(&self, imports: u64) {
        self.refusing.fetch_add(imports, Ordering::Relaxed);
    }

    /// Makes the next `groups` parts of groups (a group's copies of one direction)
    /// submitted on device `ordinal` fail: nothing of them is copied, they still cost
    /// (and count) their launch and synchronisation but count no bytes, and each
    /// completes with a `Backend` error.
    pub fn fail_next(&self, ordinal: u32, groups: u64) {
        if let Some(f) = self.failing.get(ordinal as usize) {
            f.fetch_add(groups, Ordering::Relaxed);
        }
    }

    /// Whether the next part on device `ordinal` is to fail (and counts it off).
    fn take_failure(&self, ordinal: u32) -> bool {
        self.failing.get(ordinal as usize).is_some_and(|f| {
            f.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok()
        })
    }

    /// A group's copies planned and split into one part per device and direction (the
    /// queue's index, and the part).
    fn parts(&self, copies: &[DeviceCopy], batched: bool) -> Result<Vec<(usize, Part)>> {
        independent(copies)?;
        let mut parts: Vec<(usize, Part)> = Vec::new();
        let mut seen = Seen::default();
        for c in copies {
            let (ordinal, dir) = c.queue();
            self.queue(c)?;
            let key = ordinal as usize * 3 + dir;
            let planned = self.plan(*c, &mut seen)?;
            let at = match parts.iter().position(|p| p.0 == key) {
                Some(at) => at,
                None => {
                    parts.push((key, Part::new(batched)));
                    parts.len() - 1
                }
            };
            parts[at].1.add(planned);
        }
        let arenas = seen.into_arenas();
        for (key, part) in &mut parts {
            part.fail = self.take_failure((*key / 3) as u32);
            part.finish(arenas.clone());
        }
        Ok(parts)
    }
}

crate::register_runtime!(
    NAME,
    "a fake device for tests: host memory behind addresses the host cannot dereference, with a GPU-like cost per copy and per synchronisation",
    create,
    loaded_with = [],
    check = check
);

impl FakeDev {
    /// The base, length and arena of the allocation holding `addr`.
    fn find(&self, addr: u64) -> Option<(u64, usize, Arena)> {
        let allocs = self.allocs.lock();
        let (&base, (len, arena)) = allocs.arenas.range(..=addr).next_back()?;
        (addr - base < *len as u64).then(|| (base, *len, arena.clone()))
    }

    /// The costs in force.
    pub fn config(&self) -> FakeDevConfig {
        self.config
    }

    /// Resolves a device range to its arena (an index into `seen`) and offset,
    /// checking it fits.
    fn range(&self, seen: &mut Seen, device: u64, len: usize) -> Result<(usize, usize)> {
        let (i, base, size) = seen
            .resolve(self, device)
            .ok_or_else(|| not_device(device))?;
        let offset = (device - base) as usize;
        if !crate::request::fits(offset as u64, len as u64, size as u64) {
            return Err(Error::new(
                ErrorKind::OutOfBounds,
                format!("a copy of {len} bytes at {device:#x} runs past its {size}-byte fakedev allocation"),
            ));
        }
        Ok((i, offset))
    }

    fn plan(&self, copy: DeviceCopy, seen: &mut Seen) -> Result<Planned> {
        let len = copy.len();
        let (src, dst) = match copy {
            DeviceCopy::ToDevice { device, .. } => (None, Some(self.range(seen, device, len)?)),
            DeviceCopy::ToHost { device, .. } => (Some(self.range(seen, device, len)?), None),
            DeviceCopy::DeviceToDevice { src, dst, .. } => (
                Some(self.range(seen, src, len)?),
                Some(self.range(seen, dst, len)?),
            ),
        };
        Ok(Planned { copy, src, dst })
    }

    fn queue(&self, copy: &DeviceCopy) -> Result<&Mutex<Sender<Job>>> {
        let (ordinal, dir) = copy.queue();
        no_such_device(ordinal)?;
        Ok(&self.queues[ordinal as usize * 3 + dir])
    }

    fn send(&self, queue: &Mutex<Sender<Job>>, job: Job) -> Result<()> {
        queue
            .lock()
            .send(job)
            .map_err(|_| Error::new(ErrorKind::Unavailable, "a fakedev queue thread is gone"))
    }
}

/// Refuses a group two of whose copies depend on each other (one writes bytes the other
/// reads or writes, host or device), as fakedev would otherwise run them in the order
/// given: CUDA runs a batch's copies in no order (`cuMemcpyBatchAsync`: dependent
/// copies in one batch are undefined behaviour), and a list-copy kernel runs them at
/// once. Device bytes are told apart by address, so an import and its export mapped in
/// one process are not seen to alias.
fn independent(copies: &[DeviceCopy]) -> Result<()> {
    // (start, end, copy) of every range written, and of every range read.
    let mut writes = Vec::with_capacity(copies.len());
    let mut reads = Vec::with_capacity(copies.len());
    for (i, c) in copies.iter().enumerate() {
        let len = c.len() as u64;
        let (src, dst) = match *c {
            DeviceCopy::ToDevice { device, host, .. } => (host as usize as u64, device),
            DeviceCopy::ToHost { device, host, .. } => (device, host as usize as u64),
            DeviceCopy::DeviceToDevice { src, dst, .. } => (src, dst),
        };
        if len > 0 {
            reads.push((src, src.saturating_add(len), i));
            writes.push((dst, dst.saturating_add(len), i));
        }
    }
    let dependent = |a: usize, b: usize| {
        Err(Error::new(
            ErrorKind::InvalidRequest,
            format!(
                "fakedev: copies {} and {} of one group touch the same bytes, one of them writing: a device runs a group's copies in no order (cuMemcpyBatchAsync: dependent copies are undefined), so put them in groups one after the other",
                a.min(b),
                a.max(b)
            ),
        ))
    };
    writes.sort_unstable();
    if let Some(w) = writes.windows(2).find(|w| w[1].0 < w[0].1) {
        return dependent(w[0].2, w[1].2);
    }
    // The writes are apart and in order: those a read overlaps follow one another.
    for &(start, end, i) in &reads {
        let first = writes.partition_point(|w| w.1 <= start);
        let mut over = writes[first..].iter().take_while(|w| w.0 < end);
        if let Some(w) = over.find(|w| w.2 != i) {
            return dependent(w.2, i);
        }
    }
    Ok(())
}

fn not_device(addr: u64) -> Error {
    Error::new(
        ErrorKind::InvalidRequest,
        format!("{addr:#x} is not fakedev device memory (allocate it with the fakedev runtime; freed or closed memory is gone)"),
    )
}

/// Refuses an ordinal fakedev does not have.
fn no_such_device(ordinal: u32) -> Result<()> {
    if ordinal >= DEVICES {
        return Err(Error::new(
            ErrorKind::InvalidRequest,
            format!("fakedev has devices 0..{DEVICES}, not {ordinal}"),
        ));
    }
    Ok(())
}

impl DeviceRuntime for FakeDev {
    fn name(&self) -> &str {
        NAME
    }

    fn device_count(&self) -> Result<u32> {
        Ok(DEVICES)
    }

    fn pointer_info(&self, addr: u64) -> Result<PointerInfo> {
        let (base, len, _) = self.find(addr).ok_or_else(|| not_device(addr))?;
        Ok(PointerInfo {
            ordinal: ordinal_of(base),
            base,
            len: len as u64,
        })
    }

    fn alloc(&self, ordinal: u32, len: usize) -> Result<u64> {
        no_such_device(ordinal)?;
        if len == 0 {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                "cannot allocate zero bytes",
            ));
        }
        let arena = Mapping::create(len)?;
        Ok(self.allocs.lock().place(ordinal, arena))
    }

    fn free(&self, _ordinal: u32, addr: u64) -> Result<()> {
        let mut allocs = self.allocs.lock();
        // An imported base is closed with `ipc_close`, as CUDA's must be.
        if allocs.imported.contains(&addr) {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                format!("{addr:#x} is fakedev memory imported from another process: close it with ipc_close, not free"),
            ));
        }
        if allocs.arenas.remove(&addr).is_none() {
            let around = allocs.arenas.range(..=addr).next_back();
            return Err(match around {
                Some((&base, &(len, _))) if addr - base < len as u64 => Error::new(
                    ErrorKind::InvalidRequest,
                    format!("{addr:#x} is inside the fakedev allocation that starts at {base:#x}: free takes the address alloc returned, as cuMemFree does"),
                ),
                _ => not_device(addr),
            });
        }
        allocs.private.remove(&addr);
        Ok(())
    }

    fn ipc_export(&self, addr: u64) -> Result<IpcExport> {
        let (base, len, arena) = self.find(addr).ok_or_else(|| not_device(addr))?;
        if self.allocs.lock().private.contains(&base) {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("the fakedev allocation at {base:#x} cannot be shared with another process (allocated private, as CUDA's memory-pool allocations are)"),
            ));
        }
        let a = arena.lock();
        let fd = a.fd.try_clone().map_err(|e| {
            Error::new(ErrorKind::Io, "fakedev: cannot duplicate a memfd").with_source(e)
        })?;
        Ok(IpcExport {
            handle: Vec::new(),
            fd: Some(fd),
            ordinal: ordinal_of(base),
            base,
            len: len as u64,
        })
    }

    fn device_id(&self, ordinal: u32) -> Option<String> {
        let physical = self.config.visible.get(ordinal as usize)?;
        Some(format!("fakedev-{physical}"))
    }

    fn ipc_import(
        &self,
        ordinal: u32,
        _handle: &[u8],
        fd: Option<OwnedFd>,
        len: u64,
    ) -> Result<u64> {
        no_such_device(ordinal)?;
        let refused = self
            .refusing
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        if refused.is_ok() {
            return Err(Error::new(
                ErrorKind::Backend,
                "fakedev: an import refused (injected by FakeDev::refuse_imports)",
            ));
        }
        let fd = fd.ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidRequest,
                "fakedev imports memory through its memfd, and none came with the handle",
            )
        })?;
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l > 0)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidRequest,
                    format!("cannot import {len} bytes of fakedev memory"),
                )
            })?;
        // Sealed, its size cannot drop below what the check below sees.
        // SAFETY: `fd` is an open descriptor; the call only reads its seals.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                "cannot import fakedev memory whose descriptor is not a memfd sealed with \
                 F_SEAL_SHRINK: its owner could shrink it under the mapping",
            ));
        }
        // SAFETY: an all-zero `stat` is a valid value for the out-parameter.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is an open descriptor and `st` a valid out-parameter.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(os_error("fstat of an imported descriptor"));
        }
        if (st.st_size as u64) < len as u64 {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                format!(
                    "cannot import {len} bytes of fakedev memory: the exported allocation has {} bytes",
                    st.st_size
                ),
            ));
        }
        let arena = Mapping::map(fd, len)?;
        let mut allocs = self.allocs.lock();
        let addr = allocs.place(ordinal, arena);
        allocs.imported.insert(addr);
        Ok(addr)
    }

    fn ipc_close(&self, addr: u64) -> Result<()> {
        let mut allocs = self.allocs.lock();
        if !allocs.imported.remove(&addr) {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                format!("{addr:#x} is not fakedev memory imported with ipc_import"),
            ));
        }
        // Unmapped once no copy in flight holds the arena any more.
        allocs.arenas.remove(&addr);
        Ok(())
    }

    fn alloc_pinned(&self, len: usize) -> Result<*mut u8> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096).map_err(|_| {
            Error::new(
                ErrorKind::InvalidRequest,
                format!("cannot allocate {len} pinned bytes"),
            )
        })?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            return Err(Error::new(
                ErrorKind::Io,
                "out of memory for pinned buffers",
            ));
        }
        Ok(p)
    }

    unsafe fn free_pinned(&self, ptr: *mut u8, len: usize) {
        if let Ok(layout) = std::alloc::Layout::from_size_align(len.max(1), 4096) {
            // SAFETY: the caller passes a pointer from `alloc_pinned(len)`.
            unsafe { std::alloc::dealloc(ptr, layout) };
        }
    }

    unsafe fn copy(&self, copy: DeviceCopy, done: CopyDone) -> Result<()> {
        let queue = self.queue(&copy)?;
        let mut seen = Seen::default();
        let mut part = Part::new(true);
        part.add(self.plan(copy, &mut seen)?);
        part.finish(seen.into_arenas());
        part.fail = self.take_failure(copy.queue().0);
        self.send(queue, Job { part, done })
    }

    unsafe fn copy_group(&self, copies: &[DeviceCopy], done: CopyDone) -> Result<()> {
        // One job per queue the group touches: each launches and synchronises once.
        let parts = self.parts(copies, self.config.batch)?;
        if parts.is_empty() {
            done(Ok(()));
            return Ok(());
        }
        let group = Group::new(parts.len(), done);
        for (key, part) in parts {
            let g = group.clone();
            let job = Job {
                part,
                done: Box::new(move |r| g.arrive(r)),
            };
            if let Err(e) = self.send(&self.queues[key], job) {
                group.arrive(Err(e));
            }
        }
        Ok(())
    }

    unsafe fn copy_group_wait(&self, copies: &[DeviceCopy]) -> Result<()> {
        // The caller waits for the device itself: the group runs here, paying the same
        // launch and synchronisation a queue thread would, without a queue thread's
        // wake-up on either side.
        let mut first = Ok(());
        let parts = self.parts(copies, self.config.batch)?;
        let waits = !parts.is_empty();
        for (key, part) in parts {
            let r = run_part(&part, self.config, &self.counters[key / 3]);
            first = first.and(r);
        }
        // Waiting for the device's event wakes this thread that much later.
        if waits && !self.config.completion_latency.is_zero() {
            std::thread::sleep(self.config.completion_latency);
        }
        first
    }

    fn stats(&self) -> CopyStats {
        let mut sum = CopyStats::default();
        for c in self.counters.iter() {
            let s = c.get();
            sum.calls += s.calls;
            sum.copies += s.copies;
            sum.syncs += s.syncs;
            sum.bytes += s.bytes;
        }
        sum
    }

    fn copy_path(&self) -> String {
        if self.config.batch {
            "one fake launch per group and direction (a batched call or list-copy kernel), one synchronisation per group".into()
        } else {
            "one fake launch per copy (batch = false: a driver without a batched call), one synchronisation per group".into()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    fn fresh() -> Arc<FakeDev> {
        FakeDev::start(FakeDevConfig::default()).unwrap()
    }

    #[test]
    fn a_group_moves_every_copy_and_completes_once() {
        let rt = fresh();
        let dev = rt.alloc(0, 64 << 10).unwrap();
        let other = rt.alloc(1, 64 << 10).unwrap();
        let src: Vec<u8> = (0..64 << 10).map(|i| i as u8).collect();
        let copies: Vec<DeviceCopy> = (0..16)
            .map(|i| DeviceCopy::ToDevice {
                ordinal: 0,
                device: dev + i * 4096,
                host: src[(i * 4096) as usize..].as_ptr(),
                len: 4096,
            })
            .collect();
        let (tx, rx) = mpsc::channel();
        // SAFETY: `src` outlives the group (waited for below); ranges are inside.
        unsafe {
            rt.copy_group(&copies, Box::new(move |r| tx.send(r).unwrap()))
                .unwrap()
        };
        rx.recv().unwrap().unwrap();
        assert!(rx.try_recv().is_err());
        // SAFETY: both ranges lie in live allocations.
        unsafe {
            (&*rt as &dyn DeviceRuntime)
                .copy_sync(DeviceCopy::DeviceToDevice {
                    src_ordinal: 0,
                    src: dev,
                    dst_ordinal: 1,
                    dst: other,
                    len: 64 << 10,
                })
                .unwrap()
        };
        let back = read_back(&rt, 1, other, 64 << 10);
        assert_eq!(back, src);
    }

    #[test]
    fn a_group_pays_one_synchronisation_where_single_copies_pay_one_each() {
        let rt = fresh();
        let dev = rt.alloc(0, 4096 * 8).unwrap();
        let src = vec![7u8; 4096 * 8];
        let copies: Vec<DeviceCopy> = (0..8)
            .map(|i| DeviceCopy::ToDevice {
                ordinal: 0,
                device: dev + i * 4096,
                host: src[(i * 4096) as usize..].as_ptr(),
                len: 4096,
            })
            .collect();
        let before = rt.syncs();
        for c in &copies {
            // SAFETY: `src` outlives each copy; the ranges are inside.
            unsafe { (&*rt as &dyn DeviceRuntime).copy_sync(*c).unwrap() };
        }
        assert_eq!(rt.syncs() - before, 8);
        let (tx, rx) = mpsc::channel();
        // SAFETY: as above; the group is waited for below.
        unsafe {
            rt.copy_group(&copies, Box::new(move |r| tx.send(r).unwrap()))
                .unwrap()
        };
        rx.recv().unwrap().unwrap();
        assert_eq!(rt.syncs() - before, 9, "a group of 8 synchronised once");
        assert_eq!(rt.stats().calls, 9, "and launched once");
    }

    /// `len` bytes of device `ordinal`'s memory at `dev`, copied to the host.
    fn read_back(rt: &Arc<FakeDev>, ordinal: u32, dev: u64, len: usize) -> Vec<u8> {
        let mut back = vec![0u8; len];
        let copy = DeviceCopy::ToHost {
            ordinal,
            device: dev,
            host: back.as_mut_ptr(),
            len,
        };
        // SAFETY: `back` is borrowed until the copy completes (`copy_sync` waits).
        unsafe { (&**rt as &dyn DeviceRuntime).copy_sync(copy).unwrap() };
        back
    }

    /// 16 copies of 4 KiB from `src` to scattered places of device 0's `dev`.
    fn scattered(dev: u64, src: &[u8]) -> Vec<DeviceCopy> {
        (0..16u64)
            .map(|i| DeviceCopy::ToDevice {
                ordinal: 0,
                device: dev + ((i * 7) % 16) * 4096,
                host: src[(i * 4096) as usize..].as_ptr(),
                len: 4096,
            })
            .collect()
    }

    /// The 16 blocks of [`scattered`] landed in their places on device 0 at `dev`.
    fn assert_scattered(rt: &Arc<FakeDev>, dev: u64) {
        let back = read_back(rt, 0, dev, 16 * 4096);
        for i in 0..16usize {
            let at = (i * 7 % 16) * 4096;
            assert!(
                back[at..at + 4096].iter().all(|&b| b == i as u8),
                "copy {i}"
            );
        }
    }

    #[test]
    fn a_batched_group_is_one_launch_and_an_unbatched_one_a_launch_per_copy() {
        for batch in [true, false] {
            let rt = FakeDev::start(FakeDevConfig {
                batch,
                ..FakeDevConfig::default()
            })
            .unwrap();
            let dev = rt.alloc(0, 16 * 4096).unwrap();
            let src: Vec<u8> = (0..16 * 4096).map(|i| (i / 4096) as u8).collect();
            // SAFETY: `src` outlives the group, which is waited for here.
            unsafe { rt.copy_group_wait(&scattered(dev, &src)).unwrap() };
            let s = rt.device_stats(0);
            let calls = if batch { 1 } else { 16 };
            assert_eq!(
                (s.calls, s.copies, s.syncs),
                (calls, 16, 1),
                "batch = {batch}"
            );
            assert_eq!(s.bytes, 16 * 4096);
            assert_eq!(rt.device_stats(1), CopyStats::default());
            assert_scattered(&rt, dev);
        }
    }

    #[test]
    fn a_late_completion_holds_up_its_report_but_not_the_queue() {
        let latency = Duration::from_millis(50);
        let table: toml::Table = "completion_latency = \"50ms\"".parse().unwrap();
        let config = FakeDevConfig::deserialize(table).unwrap();
        assert_eq!(config.completion_latency, latency);
        let rt = FakeDev::start(config).unwrap();
        let dev = rt.alloc(0, 16 * 4096).unwrap();
        let src: Vec<u8> = (0..16 * 4096).map(|i| (i / 4096) as u8).collect();
        let (tx, rx) = mpsc::channel();
        let start = Instant::now();
        for copy in scattered(dev, &src) {
            let tx = tx.clone();
            // SAFETY: `src` outlives the groups, all waited for below.
            unsafe { rt.copy_group(&[copy], Box::new(move |r| tx.send(r).unwrap())) }.unwrap();
        }
        for _ in 0..16 {
            let r = rx.recv_timeout(Duration::from_secs(10)).expect("reported");
            r.unwrap();
            assert!(start.elapsed() >= latency, "reported late");
        }
        // The 16 groups ran one after another and waited for their reports together
        // (all of them, unless this thread was held up for most of a latency).
        assert!(rt.most_unreported() >= 8);
        assert!(start.elapsed() < latency * 8, "{:?}", start.elapsed());
        // A caller waiting for a group itself wakes that late too.
        let start = Instant::now();
        // SAFETY: `src` outlives the group, which is waited for here.
        unsafe { rt.copy_group_wait(&scattered(dev, &src)).unwrap() };
        assert!(start.elapsed() >= latency);
        assert_scattered(&rt, dev);
    }

    #[test]
    fn an_injected_failure_fails_its_group_alone_and_copies_nothing_of_it() {
        let rt = fresh();
        let dev = rt.alloc(0, 16 * 4096).unwrap();
        let src = vec![9u8; 16 * 4096];
        rt.fail_next(0, 1);
        let (tx, rx) = mpsc::channel();
        let t = tx.clone();
        // SAFETY: `src` outlives both groups, waited for below.
        unsafe {
            rt.copy_group(&scattered(dev, &src), Box::new(move |r| t.send(r).unwrap()))
                .unwrap()
        };
        let e = rx.recv().unwrap().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Backend);
        assert!(e.to_string().contains("injected"), "{e}");
        let back = read_back(&rt, 0, dev, 16 * 4096);
        assert!(
            back.iter().all(|&b| b == 0),
            "the failed group wrote nothing"
        );
        // SAFETY: as above.
        unsafe {
            rt.copy_group(
                &scattered(dev, &src),
                Box::new(move |r| tx.send(r).unwrap()),
            )
            .unwrap()
        };
        rx.recv().unwrap().expect("the next group is not failed");
    }

    #[test]
    fn a_failed_group_counts_its_launch_and_synchronisation_but_no_bytes() {
        let rt = fresh();
        let dev = rt.alloc(0, 16 * 4096).unwrap();
        let src = vec![9u8; 16 * 4096];
        rt.fail_next(0, 1);
        // SAFETY: `src` outlives the group, which is waited for here.
        let e = unsafe { rt.copy_group_wait(&scattered(dev, &src)) }.unwrap_err();
        assert!(e.to_string().contains("injected"), "{e}");
        let s = rt.device_stats(0);
        assert_eq!((s.calls, s.copies, s.syncs, s.bytes), (1, 16, 1, 0));
        // SAFETY: as above.
        unsafe { rt.copy_group_wait(&scattered(dev, &src)) }.unwrap();
        assert_eq!(rt.device_stats(0).bytes, 16 * 4096);
    }

    #[test]
    fn a_group_whose_copies_depend_on_one_another_is_refused_before_anything_moves() {
        let rt = fresh();
        let dev = rt.alloc(0, 4 * 4096).unwrap();
        let other = rt.alloc(0, 4096).unwrap();
        let mut src = vec![3u8; 4 * 4096];
        let host = src.as_mut_ptr();
        let mut back = vec![0u8; 4096];
        let to = |device: u64, at: usize, len: usize| DeviceCopy::ToDevice {
            ordinal: 0,
            device,
            host: host.wrapping_add(at),
            len,
        };
        let dtod = |from: u64, to: u64| DeviceCopy::DeviceToDevice {
            src_ordinal: 0,
            src: from,
            dst_ordinal: 0,
            dst: to,
            len: 4096,
        };
        let dependent: [Vec<DeviceCopy>; 3] = [
            // Two copies write some of the same bytes.
            vec![to(dev, 0, 4096), to(dev + 4095, 0, 2)],
            // One reads (on another queue) what another writes.
            vec![to(dev, 0, 4096), dtod(dev + 100, other)],
            // One writes host bytes another reads.
            vec![
                to(dev, 0, 4096),
                DeviceCopy::ToHost {
                    ordinal: 0,
                    device: other,
                    host: host.wrapping_add(4096),
                    len: 4096,
                },
                to(dev + 4096, 8000, 100),
            ],
        ];
        for group in dependent {
            // SAFETY: every range is inside `src`, `dev` or `other`; refused, nothing runs.
            let e =
                unsafe { rt.copy_group(&group, Box::new(|_| panic!("not started"))) }.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidRequest);
            assert!(e.to_string().contains("no order"), "{e}");
            // SAFETY: as above.
            let e = unsafe { rt.copy_group_wait(&group) }.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidRequest);
        }
        assert_eq!(rt.stats(), CopyStats::default(), "nothing ran");
        // Copies that only read the same bytes, or write bytes side by side, are
        // independent.
        let fine = [
            to(dev, 0, 4096),
            to(dev + 4096, 0, 4096),
            DeviceCopy::ToHost {
                ordinal: 0,
                device: other,
                host: back.as_mut_ptr(),
                len: 4096,
            },
            dtod(other, dev + 2 * 4096),
        ];
        // SAFETY: as above; the group is waited for here.
        unsafe { rt.copy_group_wait(&fine) }.unwrap();
        drop(src);
    }

    #[test]
    fn freeing_an_address_inside_an_allocation_names_its_start() {
        let rt = fresh();
        let dev = rt.alloc(1, 8192).unwrap();
        let e = rt.free(1, dev + 4096).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidRequest);
        assert!(
            e.to_string().contains(&format!("starts at {dev:#x}")),
            "{e}"
        );
        // Refused, it is still allocated.
        write(&rt, 1, dev, &[1; 16]).unwrap();
        rt.free(1, dev).unwrap();
        let e = rt.free(1, dev).unwrap_err();
        assert!(e.to_string().contains("not fakedev device memory"), "{e}");
    }

    /// Copies `bytes` to device `ordinal`'s memory at `dev`.
    fn write(rt: &Arc<FakeDev>, ordinal: u32, dev: u64, bytes: &[u8]) -> Result<()> {
        let copy = DeviceCopy::ToDevice {
            ordinal,
            device: dev,
            host: bytes.as_ptr(),
            len: bytes.len(),
        };
        // SAFETY: `bytes` is borrowed until the copy completes (`copy_sync` waits).
        unsafe { (&**rt as &dyn DeviceRuntime).copy_sync(copy) }
    }

    #[test]
    fn an_imported_export_is_the_same_memory_at_another_address() {
        let rt = fresh();
        let len = 3 * 4096 + 100;
        let dev = rt.alloc(0, len).unwrap();
        let export = rt.ipc_export(dev + 4096).unwrap();
        assert_eq!(
            (export.ordinal, export.base, export.len),
            (0, dev, len as u64)
        );
        assert!(export.handle.is_empty());
        let imported = rt
            .ipc_import(1, &export.handle, export.fd, export.len)
            .unwrap();
        assert_ne!(imported, dev);
        let info = rt.pointer_info(imported + 10).unwrap();
        assert_eq!(
            (info.ordinal, info.base, info.len),
            (1, imported, len as u64)
        );

        let ours: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        write(&rt, 0, dev, &ours).unwrap();
        assert_eq!(read_back(&rt, 1, imported, len), ours);
        write(&rt, 1, imported + 4096, &[7; 64]).unwrap();
        assert_eq!(read_back(&rt, 0, dev + 4096, 64), vec![7; 64]);

        // The exporter freeing its allocation leaves the importer's mapping whole.
        rt.free(0, dev).unwrap();
        assert_eq!(read_back(&rt, 1, imported, 100), ours[..100]);
        rt.ipc_close(imported).unwrap();
    }

    #[test]
    fn a_closed_import_is_gone_and_only_imports_are_closed() {
        let rt = fresh();
        let dev = rt.alloc(0, 4096).unwrap();
        let export = rt.ipc_export(dev).unwrap();
        let imported = rt.ipc_import(0, &[], export.fd, 4096).unwrap();
        let e = rt.free(0, imported).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidRequest);
        assert!(e.to_string().contains("ipc_close"), "{e}");
        let e = rt.ipc_close(dev).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidRequest);

        rt.ipc_close(imported).unwrap();
        let e = write(&rt, 0, imported, &[1; 16]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidRequest);
        assert!(e.to_string().contains("not fakedev device memory"), "{e}");
        assert!(rt.pointer_info(imported).is_err());
        assert_eq!(
            rt.ipc_close(imported).unwrap_err().kind(),
            ErrorKind::InvalidRequest
        );
        // The allocation itself is untouched.
        write(&rt, 0, dev, &[1; 16]).unwrap();
    }

    #[test]
    fn an_import_longer_than_the_export_or_without_its_memfd_is_refused() {
        let rt = fresh();
        let dev = rt.alloc(0, 4096).unwrap();
        let export = rt.ipc_export(dev).unwrap();
        let e = rt.ipc_import(0, &[], export.fd, 4097).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidRequest);
        assert!(e.to_string().contains("4096 bytes"), "{e}");
        let e = rt.ipc_import(0, &[], None, 4096).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidRequest);
        let fd = rt.ipc_export(dev).unwrap().fd;
        assert_eq!(
            rt.ipc_import(DEVICES, &[], fd, 4096).unwrap_err().kind(),
            ErrorKind::InvalidRequest
        );
        let e = rt.ipc_export(0x1000).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidRequest);
    }

    #[test]
    fn an_import_needs_a_memfd_sealed_against_shrinking_and_an_export_cannot_shrink() {
        let rt = fresh();
        // A peer's memfd that nothing stops it from shrinking.
        // SAFETY: the name is a valid C string; the call only creates a descriptor.
        let raw = unsafe { libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0, "{}", std::io::Error::last_os_error());
        // SAFETY: `raw` is a descriptor just opened and owned by nothing else.
        let unsealed = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: `unsealed` is an open memfd.
        assert_eq!(unsafe { libc::ftruncate(unsealed.as_raw_fd(), 4096) }, 0);
        let e = rt.ipc_import(0, &[], Some(unsealed), 4096).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidRequest);
        assert!(e.to_string().contains("F_SEAL_SHRINK"), "{e}");

        // fakedev's own export: the exporting peer cannot shrink it under the import.
        let dev = rt.alloc(0, 4096).unwrap();
        let fd = rt.ipc_export(dev).unwrap().fd.expect("a memfd");
        let peers = fd.try_clone().unwrap();
        let imported = rt.ipc_import(1, &[], Some(fd), 4096).unwrap();
        // SAFETY: `peers` is an open descriptor; a refused call changes nothing.
        let shrunk = unsafe { libc::ftruncate(peers.as_raw_fd(), 0) };
        let errno = std::io::Error::last_os_error().raw_os_error();
        assert_eq!((shrunk, errno), (-1, Some(libc::EPERM)));
        write(&rt, 1, imported, &[5; 4096]).unwrap();
        assert_eq!(read_back(&rt, 0, dev, 4096), vec![5; 4096]);
        rt.ipc_close(imported).unwrap();
        rt.free(0, dev).unwrap();
    }

    #[test]
    fn a_bad_table_is_refused_naming_the_key() {
        let table: toml::Table = "spin = 1".parse().unwrap();
        let e = create(&table).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ConfigInvalid);
        assert!(e.to_string().contains("spin"), "{e}");
        let table: toml::Table = "completion_latency = \"1000d\"".parse().unwrap();
        let e = create(&table).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ConfigInvalid);
        assert!(e.to_string().contains("completion_latency"), "{e}");
    }
}
