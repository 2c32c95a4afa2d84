//! `te probe`: what the steps of a small transfer cost on this machine, each alone.
//!
//! A small transfer's round trip is made of a few steps that no backend can make
//! cheaper than the machine does: a thread waking another, a socket's round trip, a
//! device copy launched and waited for. `te probe` times each alone, in rounds, so a
//! transfer's latency can be read against them (docs/benchmarks.md, "What the steps
//! of a small transfer cost"): for instance, a staged 4 KiB write between two hosts
//! pays a TCP round trip, a device-to-host copy on the initiator and a host-to-device
//! copy on the target, each waited for.
//!
//! Device steps run on the runtime of `--mem` (none for `host`), through the same
//! runtime calls te's backends make: [`DeviceRuntime::copy_group_wait`] (the caller
//! waits for the group's completion itself) and [`DeviceRuntime::copy_group`] (a
//! runtime thread completes the group and wakes the caller).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::Instant;

use te::backend::device::{self, CopyStats, DeviceCopy, DeviceRuntime};
use te::{Config, Error, ErrorKind, MemoryKind, Result};

use crate::bench::stats::summarise;

/// Options of `te probe`.
#[derive(clap::Args, Debug)]
pub(crate) struct ProbeArgs {
    /// Configuration file, for its `[runtimes.NAME]` tables (default: $TE_CONFIG, else
    /// built-in defaults).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Device memory whose copies are probed: fakedev:0, cuda:0, … (`host`: only the
    /// thread and socket steps) [default: host].
    #[arg(long, value_name = "KIND")]
    mem: Option<String>,
    /// Rounds per step (at most 1000000), after a tenth as many unmeasured [default: 2000].
    #[arg(long, value_name = "N")]
    rounds: Option<usize>,
    /// Print one JSON object per step instead of a table.
    #[arg(long)]
    json: bool,
}

/// One measured step.
struct Step {
    what: String,
    /// Per round, ns.
    rounds_ns: Vec<u64>,
    /// Per round, ns until the submitting call returned (device steps).
    submit_ns: Vec<u64>,
    /// Bytes a round moves (device steps).
    bytes: usize,
    /// What the runtime counted over the measured rounds.
    device: CopyStats,
}

/// The most rounds per step: each round's time is kept until the step's summary.
const MAX_ROUNDS: usize = 1_000_000;
const SMALL: usize = 4 << 10;
const BLOCK: usize = 32 << 10;
const BLOCKS: usize = 128;
/// Device buffers: blocks at twice their size apart, so none is adjacent to another.
const SPAN: usize = 2 * BLOCK * BLOCKS;

/// Runs `te probe`.
///
/// # Errors
/// `InvalidRequest` for bad options; the runtime's error if its memory cannot be
/// allocated or a copy fails.
pub(crate) fn run(args: ProbeArgs) -> Result<()> {
    let config = Config::resolve(args.config.as_deref())?;
    device::configure(&config.runtimes);
    let rounds = args.rounds.unwrap_or(2000);
    if !(1..=MAX_ROUNDS).contains(&rounds) {
        return Err(Error::new(
            ErrorKind::InvalidRequest,
            format!("--rounds must be from 1 to {MAX_ROUNDS}, not {rounds}"),
        ));
    }
    let kind: MemoryKind = args
        .mem
        .as_deref()
        .unwrap_or("host")
        .parse()
        .map_err(|e: Error| {
            Error::new(ErrorKind::InvalidRequest, format!("--mem: {}", e.message()))
        })?;
    let mut steps = vec![
        wake(rounds),
        unix_round_trip(rounds)?,
        tcp_round_trip(rounds)?,
    ];
    let mut path = None;
    if let Some((rt, ordinal)) = device::of(&kind)? {
        path = Some(rt.copy_path());
        steps.extend(Memory::new(rt, ordinal)?.steps(rounds)?);
    }
    if args.json {
        for s in &steps {
            println!("{}", s.json(&kind));
        }
        return Ok(());
    }
    println!("te probe: {kind}, {rounds} rounds per step");
    if let Some(p) = path {
        println!("copies: {p}");
    }
    println!(
        "{:<64} {:>9} {:>9} {:>10} {:>8} {:>6} {:>6}",
        "step", "p50 µs", "p99 µs", "submit µs", "GB/s", "calls", "syncs"
    );
    for s in &steps {
        s.print();
    }
    Ok(())
}

impl Step {
    fn new(what: impl Into<String>, rounds: usize) -> Step {
        Step {
            what: what.into(),
            rounds_ns: Vec::with_capacity(rounds),
            submit_ns: Vec::new(),
            bytes: 0,
            device: CopyStats::default(),
        }
    }

    /// p50 and p99 of the rounds, p50 of the submissions, GB/s at the p50, and the
    /// runtime's calls and synchronisations per round.
    fn numbers(&self) -> (f64, f64, Option<f64>, Option<f64>, Option<f64>, Option<f64>) {
        let mut r = self.rounds_ns.clone();
        let s = summarise(&mut r).expect("at least one round");
        let mut sub = self.submit_ns.clone();
        let submit = summarise(&mut sub).map(|x| x.p50);
        let gbs = (self.bytes > 0).then(|| self.bytes as f64 / (s.p50 * 1e3));
        let per = |n: u64| (self.bytes > 0).then(|| n as f64 / self.rounds_ns.len() as f64);
        (
            s.p50,
            s.p99,
            submit,
            gbs,
            per(self.device.calls),
            per(self.device.syncs),
        )
    }

    fn print(&self) {
        let (p50, p99, submit, gbs, calls, syncs) = self.numbers();
        let opt = |v: Option<f64>, prec: usize| {
            v.map_or_else(|| "-".to_string(), |v| format!("{v:.prec$}"))
        };
        println!(
            "{:<64} {p50:>9.1} {p99:>9.1} {:>10} {:>8} {:>6} {:>6}",
            self.what,
            opt(submit, 1),
            opt(gbs, 2),
            opt(calls, 1),
            opt(syncs, 1)
        );
    }

    fn json(&self, kind: &MemoryKind) -> serde_json::Value {
        let (p50, p99, submit, gbs, calls, syncs) = self.numbers();
        serde_json::json!({
            "mem": kind.to_string(),
            "step": self.what,
            "rounds": self.rounds_ns.len(),
            "p50_us": p50,
            "p99_us": p99,
            "submit_us_p50": submit,
            "bytes": self.bytes,
            "gb_per_s": gbs,
            "device_calls_per_round": calls,
            "device_syncs_per_round": syncs,
        })
    }
}

/// Unmeasured rounds before the measured ones.
fn warmup(rounds: usize) -> usize {
    (rounds / 10).max(1)
}

/// Two threads hand a turn back and forth through a condition variable: a round is
/// two wake-ups.
fn wake(rounds: usize) -> Step {
    let mut step = Step::new(
        "thread wake-up, there and back (condition variable)",
        rounds,
    );
    let turn = Arc::new((Mutex::new(0u64), Condvar::new()));
    let total = (warmup(rounds) + rounds) as u64;
    let other = turn.clone();
    let echo = std::thread::spawn(move || {
        let (m, cv) = &*other;
        let mut n = m.lock().unwrap_or_else(|e| e.into_inner());
        for i in 0..total {
            while *n != 2 * i + 1 {
                n = cv.wait(n).unwrap_or_else(|e| e.into_inner());
            }
            *n += 1;
            cv.notify_one();
        }
    });
    let (m, cv) = &*turn;
    for i in 0..total {
        let t = Instant::now();
        let mut n = m.lock().unwrap_or_else(|e| e.into_inner());
        *n += 1;
        cv.notify_one();
        while *n != 2 * i + 2 {
            n = cv.wait(n).unwrap_or_else(|e| e.into_inner());
        }
        drop(n);
        if i >= warmup(rounds) as u64 {
            step.rounds_ns.push(t.elapsed().as_nanos() as u64);
        }
    }
    let _ = echo.join();
    step
}

/// 64 bytes there and back through a stream whose far end a thread echoes.
fn round_trips<S: Read + Write + Send + 'static>(
    what: &str,
    rounds: usize,
    mut near: S,
    mut far: S,
) -> Result<Step> {
    let total = warmup(rounds) + rounds;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let mut buf = [0u8; 64];
        for _ in 0..total {
            far.read_exact(&mut buf)?;
            far.write_all(&buf)?;
        }
        Ok(())
    });
    let mut step = Step::new(what, rounds);
    let mut buf = [7u8; 64];
    let io = |e: std::io::Error| Error::new(ErrorKind::Io, format!("{what}: {e}"));
    for i in 0..total {
        let t = Instant::now();
        near.write_all(&buf).map_err(io)?;
        near.read_exact(&mut buf).map_err(io)?;
        if i >= warmup(rounds) {
            step.rounds_ns.push(t.elapsed().as_nanos() as u64);
        }
    }
    match echo.join() {
        Ok(r) => r.map_err(io)?,
        Err(_) => return Err(Error::new(ErrorKind::Io, format!("{what}: echo panicked"))),
    }
    Ok(step)
}

fn unix_round_trip(rounds: usize) -> Result<Step> {
    let (a, b) = UnixStream::pair()
        .map_err(|e| Error::new(ErrorKind::Io, "cannot make a socket pair").with_source(e))?;
    round_trips("Unix socket round trip, 64 B", rounds, a, b)
}

fn tcp_round_trip(rounds: usize) -> Result<Step> {
    let io = |e: std::io::Error| Error::new(ErrorKind::Io, "loopback TCP").with_source(e);
    let listener = TcpListener::bind("127.0.0.1:0").map_err(io)?;
    let near = TcpStream::connect(listener.local_addr().map_err(io)?).map_err(io)?;
    let (far, _) = listener.accept().map_err(io)?;
    near.set_nodelay(true).map_err(io)?;
    far.set_nodelay(true).map_err(io)?;
    round_trips("TCP loopback round trip, 64 B", rounds, near, far)
}

/// Device and pinned host memory for the copy steps, freed when dropped.
struct Memory {
    rt: Arc<dyn DeviceRuntime>,
    ordinal: u32,
    src: u64,
    dst: u64,
    host: *mut u8,
}

impl Memory {
    fn new(rt: Arc<dyn DeviceRuntime>, ordinal: u32) -> Result<Memory> {
        let src = rt.alloc(ordinal, SPAN)?;
        let dst = match rt.alloc(ordinal, SPAN) {
            Ok(d) => d,
            Err(e) => {
                let _ = rt.free(ordinal, src);
                return Err(e);
            }
        };
        let host = match rt.alloc_pinned(BLOCK * BLOCKS) {
            Ok(h) => h,
            Err(e) => {
                let _ = rt.free(ordinal, src);
                let _ = rt.free(ordinal, dst);
                return Err(e);
            }
        };
        Ok(Memory {
            rt,
            ordinal,
            src,
            dst,
            host,
        })
    }

    /// The copy steps: one small copy each way and on the device, waited for by the
    /// caller; the same small copy completed by a runtime thread; and a staged frame's
    /// worth of scattered blocks, each way a backend groups them.
    fn steps(&self, rounds: usize) -> Result<Vec<Step>> {
        let o = self.ordinal;
        let to_host = |i: usize, at: usize| DeviceCopy::ToHost {
            ordinal: o,
            device: self.src + (2 * i * BLOCK) as u64,
            // In the pinned buffer, which is BLOCK * BLOCKS long.
            host: self.host.wrapping_add(at),
            len: BLOCK,
        };
        let small_out = DeviceCopy::ToHost {
            ordinal: o,
            device: self.src,
            host: self.host,
            len: SMALL,
        };
        let small_in = DeviceCopy::ToDevice {
            ordinal: o,
            device: self.dst,
            host: self.host,
            len: SMALL,
        };
        let d2d = |len: usize, i: usize, j: usize| DeviceCopy::DeviceToDevice {
            src_ordinal: o,
            src: self.src + (2 * i * BLOCK) as u64,
            dst_ordinal: o,
            dst: self.dst + (2 * j * BLOCK) as u64,
            len,
        };
        let scattered: Vec<DeviceCopy> =
            (0..BLOCKS).map(|i| d2d(BLOCK, i, BLOCKS - 1 - i)).collect();
        let gathered: Vec<DeviceCopy> = (0..BLOCKS).map(|i| to_host(i, i * BLOCK)).collect();
        let whole = [DeviceCopy::DeviceToDevice {
            src_ordinal: o,
            src: self.src,
            dst_ordinal: o,
            dst: self.dst,
            len: BLOCK * BLOCKS,
        }];
        let k = SMALL >> 10;
        Ok(vec![
            self.step(
                &format!("{k} KiB device → pinned host, caller waits"),
                rounds,
                &[small_out],
                true,
            )?,
            self.step(
                &format!("{k} KiB pinned host → device, caller waits"),
                rounds,
                &[small_in],
                true,
            )?,
            self.step(
                &format!("{k} KiB device → device, caller waits"),
                rounds,
                &[d2d(SMALL, 0, 0)],
                true,
            )?,
            self.step(
                &format!("{k} KiB device → pinned host, a runtime thread wakes the caller"),
                rounds,
                &[small_out],
                false,
            )?,
            self.step(
                &format!("{BLOCKS} × 32 KiB device → device, scattered, caller waits"),
                rounds,
                &scattered,
                true,
            )?,
            self.step(
                &format!("{BLOCKS} × 32 KiB device → pinned host, gathered, caller waits"),
                rounds,
                &gathered,
                true,
            )?,
            self.step(
                &format!(
                    "{} MiB device → device, one copy, caller waits",
                    (BLOCK * BLOCKS) >> 20
                ),
                rounds,
                &whole,
                true,
            )?,
        ])
    }

    /// Rounds of one group of copies, waited for by the caller (`wait`) or completed
    /// by a runtime thread that wakes the caller.
    fn step(&self, what: &str, rounds: usize, copies: &[DeviceCopy], wait: bool) -> Result<Step> {
        let mut step = Step::new(what, rounds);
        step.bytes = copies.iter().map(DeviceCopy::len).sum();
        let mut before = self.rt.stats();
        for i in 0..warmup(rounds) + rounds {
            if i == warmup(rounds) {
                before = self.rt.stats();
            }
            let t = Instant::now();
            if wait {
                // SAFETY: every copy lies in memory allocated above and alive until
                // `self` drops; nothing else touches it, and the call returns only
                // once the group has completed.
                unsafe { self.rt.copy_group_wait(copies)? };
            } else {
                let (tx, rx) = mpsc::sync_channel(1);
                // SAFETY: as above; this thread waits for `done` before going on.
                unsafe {
                    self.rt.copy_group(
                        copies,
                        Box::new(move |r| {
                            let _ = tx.send(r);
                        }),
                    )?
                };
                let submitted = t.elapsed().as_nanos() as u64;
                rx.recv().map_err(|_| {
                    Error::new(
                        ErrorKind::Backend,
                        "the runtime dropped a copy's completion",
                    )
                })??;
                if i >= warmup(rounds) {
                    step.submit_ns.push(submitted);
                }
            }
            if i >= warmup(rounds) {
                step.rounds_ns.push(t.elapsed().as_nanos() as u64);
            }
        }
        step.device = self.rt.stats().since(&before);
        Ok(step)
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        // Every group was waited for, so nothing copies into these any more.
        let _ = self.rt.free(self.ordinal, self.src);
        let _ = self.rt.free(self.ordinal, self.dst);
        // SAFETY: `host` came from `alloc_pinned(BLOCK * BLOCKS)` and no copy uses it.
        unsafe { self.rt.free_pinned(self.host, BLOCK * BLOCKS) };
    }
}
