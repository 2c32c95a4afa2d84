//! Running a plan: the engines, the buffers, each point's threads, `--verify`.

use std::io::Write;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use te::{
    Access, Buffer, Config, Engine, Error, ErrorKind, Op, Peer, RegionDesc, Result,
    TransferOptions, TransferRequest,
};
use te_core::Registry;

use super::baseline;
use super::pattern::{self, Pattern};
use super::plan::{human_size, Layout, Plan, Stop};
use super::plot;
use super::report::{self, Progress};
use super::stats::{self, Record, Samples, Stages, MAX_SAMPLES};

/// How often the progress display is refreshed while a point runs.
const REFRESH: Duration = Duration::from_millis(100);
/// The largest request used to fill or read back a remote buffer for `--verify`.
const VERIFY_CHUNK: u64 = 16 << 20;

/// Everything a run holds: the initiator, the target (in process or remote), buffers.
struct Bench<'p> {
    plan: &'p Plan,
    /// The region named `buffer` on the target.
    remote: RegionDesc,
    peer: Peer,
    /// Source of WRITEs, destination of READs.
    local: Buffer,
    /// The in-process target's buffer, when there is no `--target`.
    target_buffer: Option<Buffer>,
    /// Bytes of each side usable for one point.
    cap: u64,
    backend: String,
    initiator: Engine,
    /// Kept alive for the run; dropped last.
    _target: Option<Engine>,
}

/// Runs every point of `plan`, printing results as they come (JSON) or as a table.
///
/// # Errors
/// The engine's error if the backend cannot start or the target cannot be reached;
/// `InvalidRequest` if the target's buffer is too small or `--verify` finds a wrong
/// byte; a failed batch's error.
pub(crate) fn run(plan: &Plan) -> Result<()> {
    let bench = Bench::new(plan)?;
    let points: Vec<(u64, u64)> = plan
        .block_sizes
        .iter()
        .flat_map(|&block| plan.batch_sizes.iter().map(move |&batch| (block, batch)))
        .collect();
    let progress = Progress::new(plan, points.len());
    if !plan.json {
        report::header(plan, &bench.backend, bench.describe_target());
    }
    let mut records: Vec<Record> = Vec::new();
    for (i, &(block, batch)) in points.iter().enumerate() {
        let layout = plan.layout(block, batch, bench.cap);
        let record = bench.point(layout, i, &progress)?;
        progress.finished(&record);
        emit(plan, &record);
        records.push(record);
        if plan.baseline {
            let mut found = vec![baseline::memcpy_like(plan, layout)];
            let last_of_block = points.get(i + 1).is_none_or(|&(next, _)| next != block);
            if last_of_block {
                found.extend(baseline::wire(plan, layout, &progress)?);
            }
            for record in found {
                progress.finished(&record);
                emit(plan, &record);
                records.push(record);
            }
        }
    }
    progress.done();
    if !plan.json {
        report::table(&records);
        report::ratios(&records);
        if plan.verify {
            println!("verify: every destination byte of every point matched the pattern");
        }
    }
    if let Some(path) = &plan.plot {
        plot::write(path, &records, &bench.backend, plan)?;
        if !plan.json {
            println!("plot: {}", path.display());
        }
    }
    Ok(())
}

/// Prints a record as a JSON line at once, so a script sees results as they come.
fn emit(plan: &Plan, record: &Record) {
    if plan.json {
        let mut out = std::io::stdout().lock();
        let _ = serde_json::to_writer(&mut out, record);
        let _ = writeln!(out);
        let _ = out.flush();
    }
}

/// What one measured (or warm-up) phase produced.
struct Phase {
    batches: u64,
    seconds: f64,
    latencies_ns: Vec<u64>,
    stages: Stages,
}

impl<'p> Bench<'p> {
    /// Starts the engines, connects, allocates and registers the buffers.
    fn new(plan: &'p Plan) -> Result<Bench<'p>> {
        let mut config = Config::resolve(plan.config.as_deref())?;
        if let Some(b) = &plan.backend {
            config.engine.backend = b.clone();
        }
        let registry = Registry::discover(&config.engine.plugin_dirs);
        let mut own = config.clone();
        if let Some(m) = &plan.metrics_listen {
            own.engine.metrics_listen = Some(m.clone());
        }
        let initiator = Engine::with_registry(&own, &registry)?;
        if let Some(m) = initiator.metrics_address() {
            eprintln!("metrics at http://{m}/metrics (`te stats {m}` shows them live)");
        }
        // One endpoint per address: the target in this process serves none.
        config.engine.metrics_listen = None;
        let (target, target_buffer, addr) = match &plan.target {
            Some(addr) => (None, None, addr.clone()),
            None => {
                let target = Engine::with_registry(&config, &registry)?;
                let len = usize::try_from(plan.needed(plan.buffer_size)).map_err(|_| {
                    Error::new(
                        ErrorKind::InvalidRequest,
                        "the buffer does not fit in memory",
                    )
                })?;
                let buffer =
                    target.alloc_on(&plan.mem, "buffer", len, Access::REMOTE_READ_WRITE)?;
                let addr = target.address().to_string();
                (Some(target), Some(buffer), addr)
            }
        };
        let peer = initiator.connect(&addr)?;
        // A `te serve` found by name may have been reached between publishing itself
        // and registering its buffer: look once more with a fresh descriptor.
        if peer.region("buffer").is_none() {
            initiator.refresh(&peer, initiator.config().default_timeout)?;
        }
        let remote = peer.region("buffer").ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidRequest,
                "the target has no region named `buffer`; point --target at a `te serve`",
            )
            .with_operation("bench")
            .with_context("target", &addr)
        })?;
        let cap = match &plan.target {
            Some(_) => {
                plan.check_fits(remote.len, "buffer of the target (te serve --buffer-size)")?;
                remote.len
            }
            None => plan.buffer_size,
        };
        let local_len = usize::try_from(plan.needed(cap)).map_err(|_| {
            Error::new(
                ErrorKind::InvalidRequest,
                "the buffer does not fit in memory",
            )
        })?;
        let local = initiator.alloc_on(&plan.mem, "bench", local_len, Access::LOCAL)?;
        let backend = initiator.backend_info().name.clone();
        let bench = Bench {
            plan,
            remote,
            peer,
            local,
            target_buffer,
            cap,
            backend,
            initiator,
            _target: target,
        };
        bench.prefault()?;
        Ok(bench)
    }

    /// Touches every page of the buffers in this process once, so the first point
    /// does not pay for page faults the others do not.
    fn prefault(&self) -> Result<()> {
        let p = Pattern::new(seed(0));
        pattern::fill(&self.local, 0..self.local.len() as u64, p)?;
        if let Some(t) = &self.target_buffer {
            pattern::fill(t, 0..t.len() as u64, p.inverted())?;
        }
        Ok(())
    }

    /// Where the target is, for the header.
    fn describe_target(&self) -> String {
        let path = match self.initiator.path_to(&self.peer) {
            Some(p) => format!(", path: {p}"),
            None => String::new(),
        };
        match &self.plan.target {
            Some(addr) => format!(
                "remote te serve at {addr} ({} buffer{path})",
                human_size(self.remote.len)
            ),
            None => format!(
                "target engine in this process over loopback ({} buffer per side{path})",
                human_size(self.remote.len)
            ),
        }
    }

    /// The requests of each thread for one point, built once and reused every batch.
    fn requests(&self, l: Layout) -> Vec<Vec<TransferRequest>> {
        (0..l.threads)
            .map(|t| {
                (0..l.batch)
                    .map(|i| {
                        let off = l.offset(t, i);
                        match self.plan.op {
                            Op::Write => TransferRequest::write(
                                self.local.id(),
                                off,
                                self.remote.id,
                                off,
                                l.block,
                            ),
                            Op::Read => TransferRequest::read(
                                self.local.id(),
                                off,
                                self.remote.id,
                                off,
                                l.block,
                            ),
                        }
                    })
                    .collect()
            })
            .collect()
    }

    /// Measures one point: optional verify set-up, warm-up, measured phase, check.
    fn point(&self, layout: Layout, index: usize, progress: &Progress) -> Result<Record> {
        let plan = self.plan;
        let requests = self.requests(layout);
        let pattern = Pattern::new(seed(index as u64 + 1));
        let range = 0..layout.bytes();
        if plan.verify {
            self.prepare(range.clone(), pattern)?;
        }
        progress.start(index, layout, plan);
        if !plan.warmup.is_zero() {
            progress.warming();
            self.phase(&requests, Stop::After(plan.warmup), None)?;
        }
        progress.measuring();
        let device = te_core::device::stats();
        let mut phase = self.phase(&requests, plan.stop, Some((progress, layout)))?;
        let device = te_core::device::stats().since(&device);
        if plan.verify {
            self.check(range, pattern)?;
        }
        let bytes = phase
            .batches
            .saturating_mul(layout.batch)
            .saturating_mul(layout.block);
        Ok(Record::measured(
            &self.backend,
            plan.op,
            layout.block,
            layout.batch,
            layout.threads,
            bytes,
            phase.seconds,
            stats::summarise(&mut phase.latencies_ns),
        )
        .with_device(&device, phase.batches)
        .with_stages(phase.stages))
    }

    /// Runs every thread's batches until `stop`; the time is from the first thread's
    /// start to the last thread's end.
    fn phase(
        &self,
        requests: &[Vec<TransferRequest>],
        stop: Stop,
        progress: Option<(&Progress, Layout)>,
    ) -> Result<Phase> {
        let abort = AtomicBool::new(false);
        let batches = AtomicU64::new(0);
        let barrier = Barrier::new(requests.len());
        let options = TransferOptions::default();
        let (tx, rx) = mpsc::channel::<()>();
        std::thread::scope(|s| {
            let workers: Vec<_> = requests
                .iter()
                .enumerate()
                .map(|(t, reqs)| {
                    let tx = tx.clone();
                    let (abort, batches, barrier, options) = (&abort, &batches, &barrier, &options);
                    std::thread::Builder::new()
                        .name(format!("te-bench-{t}"))
                        .spawn_scoped(s, move || {
                            let r = self.worker(reqs, options, stop, barrier, abort, batches);
                            let _ = tx.send(());
                            r.map_err(|e| e.with_context("thread", t))
                        })
                        .map_err(|e| {
                            Error::new(ErrorKind::Io, "cannot start a bench thread").with_source(e)
                        })
                })
                .collect::<Result<_>>()?;
            drop(tx);
            let begun = Instant::now();
            let mut left = workers.len();
            while left > 0 {
                match rx.recv_timeout(REFRESH) {
                    Ok(()) => left -= 1,
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => break,
                }
                if let Some((p, layout)) = progress {
                    p.tick(
                        batches.load(Ordering::Relaxed),
                        layout,
                        begun.elapsed(),
                        stop,
                    );
                }
            }
            let mut first = None::<Instant>;
            let mut last = None::<Instant>;
            let mut samples = Samples::new(MAX_SAMPLES);
            let mut error = None;
            for w in workers {
                match w.join() {
                    Ok(Ok((start, end, s))) => {
                        first = Some(first.map_or(start, |f| f.min(start)));
                        last = Some(last.map_or(end, |l| l.max(end)));
                        samples.extend(s);
                    }
                    Ok(Err(e)) => {
                        // The first failure is the cause; the others were told to stop.
                        if error.is_none() || e.kind() != ErrorKind::Cancelled {
                            error.get_or_insert(e);
                        }
                    }
                    Err(_) => {
                        error.get_or_insert(Error::new(
                            ErrorKind::Backend,
                            "a bench thread panicked",
                        ));
                    }
                }
            }
            if let Some(e) = error {
                return Err(e);
            }
            let seconds = match (first, last) {
                (Some(f), Some(l)) => l.duration_since(f).as_secs_f64(),
                _ => 0.0,
            };
            Ok(Phase {
                batches: batches.load(Ordering::Relaxed),
                seconds,
                latencies_ns: samples.latencies_ns,
                stages: samples.stages,
            })
        })
    }

    /// One thread: submit a batch, wait for it, record its latency, until `stop`.
    fn worker(
        &self,
        requests: &[TransferRequest],
        options: &TransferOptions,
        stop: Stop,
        barrier: &Barrier,
        abort: &AtomicBool,
        batches: &AtomicU64,
    ) -> Result<(Instant, Instant, Samples)> {
        let mut samples = Samples::new(MAX_SAMPLES / self.plan.threads as usize);
        barrier.wait();
        let start = Instant::now();
        let mut done = 0u64;
        loop {
            if abort.load(Ordering::Relaxed) {
                return Err(Error::new(ErrorKind::Cancelled, "another thread failed"));
            }
            let t0 = Instant::now();
            let result = self
                .initiator
                .transfer_with(&self.peer, requests, options)
                .and_then(|h| h.wait().map(|()| h));
            let t1 = Instant::now();
            let handle = match result {
                Ok(h) => h,
                Err(e) => {
                    abort.store(true, Ordering::Relaxed);
                    return Err(e.with_context("batch", done));
                }
            };
            let latency = stats::nanos(t1 - t0);
            samples.add(latency, handle.telemetry().as_ref());
            batches.fetch_add(1, Ordering::Relaxed);
            done += 1;
            let finished = match stop {
                Stop::Iters(n) => done >= n,
                Stop::After(d) => t1 - start >= d,
            };
            if finished {
                return Ok((start, t1, samples));
            }
        }
    }

    /// `--verify`, before a point: the pattern in the source, its complement in the
    /// destination, so every destination byte must change for the check to pass.
    fn prepare(&self, range: Range<u64>, p: Pattern) -> Result<()> {
        let (remote, local) = match self.plan.op {
            Op::Write => (p.inverted(), p),
            Op::Read => (p, p.inverted()),
        };
        // The remote side first: without an in-process target it is set through the
        // local buffer, which is then refilled.
        self.set_remote(range.clone(), remote)?;
        pattern::fill(&self.local, range, local)
    }

    /// `--verify`, after a point: every destination byte holds the pattern.
    fn check(&self, range: Range<u64>, p: Pattern) -> Result<()> {
        match (self.plan.op, &self.target_buffer) {
            (Op::Read, _) => {
                pattern::check(&self.local, range, p, "local buffer (READ destination)")
            }
            (Op::Write, Some(t)) => pattern::check(t, range, p, "target's buffer"),
            (Op::Write, None) => {
                // Read the remote bytes back over the backend into the local buffer,
                // first overwritten with the complement so that a read-back that moved
                // nothing cannot pass.
                pattern::fill(&self.local, range.clone(), p.inverted())?;
                self.copy_remote(Op::Read, range.clone())?;
                pattern::check(&self.local, range, p, "target's buffer (read back)")
            }
        }
    }

    /// Fills `range` of the target's buffer with `p`.
    fn set_remote(&self, range: Range<u64>, p: Pattern) -> Result<()> {
        match &self.target_buffer {
            Some(t) => pattern::fill(t, range, p),
            None => {
                pattern::fill(&self.local, range.clone(), p)?;
                self.copy_remote(Op::Write, range)
            }
        }
    }

    /// Moves `range` between the local and the remote buffer (same offsets).
    fn copy_remote(&self, op: Op, range: Range<u64>) -> Result<()> {
        let max = self.initiator.backend_info().capabilities.max_request_size;
        let chunk = VERIFY_CHUNK.min(max).max(1);
        let requests: Vec<TransferRequest> = range
            .clone()
            .step_by(chunk as usize)
            .map(|off| {
                let len = chunk.min(range.end - off);
                match op {
                    Op::Write => {
                        TransferRequest::write(self.local.id(), off, self.remote.id, off, len)
                    }
                    Op::Read => {
                        TransferRequest::read(self.local.id(), off, self.remote.id, off, len)
                    }
                }
            })
            .collect();
        self.initiator
            .transfer(&self.peer, &requests)?
            .wait()
            .map_err(|e| e.with_context("verify", op))
    }
}

/// A seed that differs between runs and between points.
pub(crate) fn seed(point: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(point);
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.finish()
}
