//! What a `te bench` run measures: its options turned into checked values.
//!
//! Values are parsed here rather than by clap, so that a bad value is a one-line
//! `te: error: …` with exit status 1, like every other bad input; clap only rejects
//! unknown flags and flags that exclude each other (usage errors, exit status 2).

use std::path::PathBuf;
use std::time::Duration;

use te::{Error, ErrorKind, MemoryKind, Op, Result};

use super::BenchArgs;

/// Block sizes of a sweep when `--block-sizes` is not given: 4 KiB to 64 MiB, doubling.
pub(crate) const SWEEP_BLOCK_SIZES: (u64, u64) = (4 << 10, 64 << 20);
/// Batch sizes of a sweep when `--batch-sizes` is not given: 1 to 128, doubling.
pub(crate) const SWEEP_BATCH_SIZES: (u64, u64) = (1, 128);

/// The largest thread count accepted; more is a typo, not a benchmark.
const MAX_THREADS: u64 = 1024;
/// The most requests in flight at once, over every thread (batch × threads): each is
/// built and kept for the whole point, so more would ask for gigabytes of requests.
pub(crate) const MAX_IN_FLIGHT: u64 = 1 << 20;
/// The longest `--duration` or `--warmup` accepted; more is a typo, not a benchmark.
pub(crate) const MAX_DURATION: Duration = Duration::from_secs(24 * 60 * 60);

/// When a measured phase ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// After this long (each thread finishes the batch it is waiting for).
    After(Duration),
    /// After this many batches per thread.
    Iters(u64),
}

/// A whole run, checked.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Plan {
    /// Configuration file, if given.
    pub(crate) config: Option<PathBuf>,
    /// Backend name overriding the configuration.
    pub(crate) backend: Option<String>,
    /// Where the initiator serves its metrics, overriding the configuration.
    pub(crate) metrics_listen: Option<String>,
    /// READ or WRITE.
    pub(crate) op: Op,
    /// Block sizes to measure, in bytes.
    pub(crate) block_sizes: Vec<u64>,
    /// Batch sizes to measure, in requests.
    pub(crate) batch_sizes: Vec<u64>,
    /// Initiator threads, each with its own range of the buffers.
    pub(crate) threads: u64,
    /// When each measured point ends.
    pub(crate) stop: Stop,
    /// Unmeasured time before each point.
    pub(crate) warmup: Duration,
    /// Fill sources with a pattern and check every destination byte after each point.
    pub(crate) verify: bool,
    /// One JSON object per result on stdout instead of a table.
    pub(crate) json: bool,
    /// Where to write an SVG plot of the results.
    pub(crate) plot: Option<PathBuf>,
    /// A remote `te serve` to measure against, instead of a target in this process.
    pub(crate) target: Option<String>,
    /// The most each side allocates (in-process target); larger batches reuse slots.
    pub(crate) buffer_size: u64,
    /// Also measure memcpy, a loopback socket pump and (if installed) qperf.
    pub(crate) baseline: bool,
    /// Memory of the buffers this process allocates (`host`, `fakedev:0`, `cuda:0`).
    pub(crate) mem: MemoryKind,
}

impl Plan {
    /// Checks and converts the command-line options.
    ///
    /// # Errors
    /// `InvalidRequest` naming the option for a malformed or zero size, count or
    /// duration, a block size that does not fit in `--buffer-size`, or a `--plot` path
    /// that could not be written (see [`super::plot::check`]).
    pub(crate) fn from_args(a: &BenchArgs) -> Result<Plan> {
        let sweep = a.sweep || a.block_sizes.is_some() || a.batch_sizes.is_some();
        let block_sizes = match (&a.block_sizes, &a.block_size) {
            (Some(list), _) => parse_size_list("--block-sizes", list)?,
            (None, Some(one)) => vec![nonzero("--block-size", parse_size(one))?],
            (None, None) if a.sweep => doubling(SWEEP_BLOCK_SIZES.0, SWEEP_BLOCK_SIZES.1),
            (None, None) => vec![64 << 10],
        };
        let batch_sizes = match (&a.batch_sizes, &a.batch) {
            (Some(list), _) => parse_count_list("--batch-sizes", list)?,
            (None, Some(one)) => vec![parse_count("--batch", one)?],
            (None, None) if a.sweep => doubling(SWEEP_BATCH_SIZES.0, SWEEP_BATCH_SIZES.1),
            (None, None) => vec![32],
        };
        let threads = a
            .threads
            .as_deref()
            .map_or(Ok(1), |t| parse_count("--threads", t))?;
        if threads > MAX_THREADS {
            return Err(bad(format!(
                "--threads {threads} is more than the {MAX_THREADS} te bench allows"
            )));
        }
        let too_many = |&&b: &&u64| b.checked_mul(threads).is_none_or(|n| n > MAX_IN_FLIGHT);
        if let Some(&b) = batch_sizes.iter().find(too_many) {
            return Err(bad(format!(
                "--batch {b} × --threads {threads} is more than the {MAX_IN_FLIGHT} requests in flight te bench allows; use smaller batches or fewer threads"
            )));
        }
        let stop = match (&a.iters, &a.duration) {
            (Some(n), _) => Stop::Iters(parse_count("--iters", n)?),
            (None, Some(d)) => {
                let d = parse_duration("--duration", d)?;
                if d.is_zero() {
                    return Err(bad("--duration must be longer than zero".into()));
                }
                Stop::After(d)
            }
            (None, None) if sweep => Stop::After(Duration::from_millis(250)),
            (None, None) => Stop::After(Duration::from_secs(5)),
        };
        let warmup = match &a.warmup {
            Some(w) => parse_duration("--warmup", w)?,
            None if sweep => Duration::from_millis(50),
            None => Duration::from_secs(1),
        };
        let buffer_size = match &a.buffer_size {
            Some(s) => nonzero("--buffer-size", parse_size(s))?,
            None => 1 << 30,
        };
        let backend = match &a.backend {
            Some(b) if b.trim().is_empty() => {
                return Err(bad(
                    "--backend is empty; `te info` lists the backends".into()
                ))
            }
            b => b.clone(),
        };
        let plan = Plan {
            config: a.config.clone(),
            backend,
            metrics_listen: a.metrics_listen.clone(),
            op: a.op.as_deref().unwrap_or("write").parse()?,
            block_sizes,
            batch_sizes,
            threads,
            stop,
            warmup,
            verify: a.verify,
            json: a.json,
            plot: a.plot.clone(),
            target: a.target.clone(),
            buffer_size,
            baseline: a.baseline,
            mem: match &a.mem {
                Some(m) => m.parse().map_err(|e: Error| {
                    Error::new(
                        ErrorKind::InvalidRequest,
                        format!("--mem {m}: {}", e.message()),
                    )
                })?,
                None => MemoryKind::Host,
            },
        };
        if plan.target.is_none() {
            plan.check_fits(plan.buffer_size, "--buffer-size")?;
        }
        if let Some(path) = &plan.plot {
            super::plot::check(path)?;
        }
        Ok(plan)
    }

    /// True when more than one point is measured.
    pub(crate) fn is_sweep(&self) -> bool {
        self.block_sizes.len() > 1 || self.batch_sizes.len() > 1
    }

    /// The largest block size.
    pub(crate) fn max_block(&self) -> u64 {
        self.block_sizes.iter().copied().max().unwrap_or(0)
    }

    /// The bytes each side needs for every point at once, capped to `cap`: each thread
    /// gets `batch` slots of `block` bytes, fewer when they do not fit.
    pub(crate) fn needed(&self, cap: u64) -> u64 {
        self.block_sizes
            .iter()
            .flat_map(|&block| {
                self.batch_sizes
                    .iter()
                    .map(move |&batch| self.layout(block, batch, cap).bytes())
            })
            .max()
            .unwrap_or(0)
    }

    /// Where each thread's requests go for one point, within `cap` bytes.
    pub(crate) fn layout(&self, block: u64, batch: u64, cap: u64) -> Layout {
        let per_thread = cap / self.threads;
        let slots = (per_thread / block).clamp(1, batch);
        Layout {
            block,
            batch,
            slots,
            threads: self.threads,
        }
    }

    /// Refuses a block size that does not fit `threads` times into `cap` bytes.
    ///
    /// # Errors
    /// `InvalidRequest` saying which sizes to change.
    pub(crate) fn check_fits(&self, cap: u64, what: &str) -> Result<()> {
        let block = self.max_block();
        match block.checked_mul(self.threads) {
            Some(n) if n <= cap => Ok(()),
            _ => Err(bad(format!(
                "block size {} × {} thread(s) does not fit in the {} {what}; use smaller blocks, fewer threads or a larger buffer",
                human_size(block),
                self.threads,
                human_size(cap)
            ))),
        }
    }
}

/// Where one point's requests go: thread `t`'s request `i` uses slot `i % slots` of its
/// own range, at the same offset on both sides. With `slots < batch` (the batch does
/// not fit in the buffer), a batch copies the same bytes to the same place more than
/// once, which moves the same number of bytes over the fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Bytes per request.
    pub(crate) block: u64,
    /// Requests per batch.
    pub(crate) batch: u64,
    /// Distinct block slots per thread.
    pub(crate) slots: u64,
    /// Threads.
    pub(crate) threads: u64,
}

impl Layout {
    /// Bytes of the buffers this point touches on each side.
    pub(crate) fn bytes(&self) -> u64 {
        self.block * self.slots * self.threads
    }

    /// Byte offset of thread `t`'s request `i`, on both sides.
    pub(crate) fn offset(&self, t: u64, i: u64) -> u64 {
        (t * self.slots + i % self.slots) * self.block
    }
}

/// An `InvalidRequest` error of the `bench` operation.
fn bad(message: String) -> Error {
    Error::new(ErrorKind::InvalidRequest, message).with_operation("bench")
}

/// Parses a size (`4096`, `4KiB`, `1MiB`, `1GB`).
///
/// # Errors
/// `InvalidRequest` with the accepted forms.
pub(crate) fn parse_size(s: &str) -> Result<u64> {
    te::config::parse_size(s).map_err(|e| bad(e.message().to_string()))
}

/// A parsed size that must not be zero, errors naming `option`.
fn nonzero(option: &str, n: Result<u64>) -> Result<u64> {
    match n {
        Ok(0) => Err(bad(format!("{option} must be greater than zero"))),
        Ok(n) => Ok(n),
        Err(e) => Err(bad(format!("{option}: {}", e.message()))),
    }
}

/// Parses a positive count.
///
/// # Errors
/// `InvalidRequest` naming `option` for zero, a negative number or not a number.
pub(crate) fn parse_count(option: &str, s: &str) -> Result<u64> {
    match s.trim().parse::<u64>() {
        Ok(0) => Err(bad(format!("{option} must be at least 1"))),
        Ok(n) => Ok(n),
        Err(_) => Err(bad(format!("{option}: `{s}` is not a whole number"))),
    }
}

/// Parses a duration (`5s`, `250ms`, `1m 30s`) of at most [`MAX_DURATION`]; zero is
/// allowed here.
///
/// # Errors
/// `InvalidRequest` naming `option`, with the accepted forms or the limit.
pub(crate) fn parse_duration(option: &str, s: &str) -> Result<Duration> {
    match te::config::parse_duration(s) {
        Ok(d) if d > MAX_DURATION => Err(bad(format!(
            "{option} {s} is longer than the 1 day te bench allows"
        ))),
        Ok(d) => Ok(d),
        Err(e) => Err(bad(format!("{option}: {}", e.message()))),
    }
}

/// Every power-of-two multiple of `from` up to `to`.
fn doubling(from: u64, to: u64) -> Vec<u64> {
    std::iter::successors(Some(from), |&n| n.checked_mul(2))
        .take_while(|&n| n <= to)
        .collect()
}

/// Parses a comma list whose items are single values or `FROM..TO` doubling ranges.
fn parse_list(option: &str, s: &str, one: &dyn Fn(&str) -> Result<u64>) -> Result<Vec<u64>> {
    let mut out = Vec::new();
    for item in s.split(',').map(str::trim) {
        if item.is_empty() {
            return Err(bad(format!("{option}: `{s}` has an empty item")));
        }
        match item.split_once("..") {
            Some((from, to)) => {
                let (from, to) = (one(from)?, one(to)?);
                if from > to {
                    return Err(bad(format!(
                        "{option}: range `{item}` runs backwards; write it smallest first"
                    )));
                }
                out.extend(doubling(from, to));
            }
            None => out.push(one(item)?),
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// Parses a list of sizes: `4KiB,64KiB,1MiB` or `4KiB..1MiB` (doubling).
///
/// # Errors
/// `InvalidRequest` naming `option` for an empty item, a bad or zero size, or a
/// backwards range.
pub(crate) fn parse_size_list(option: &str, s: &str) -> Result<Vec<u64>> {
    parse_list(option, s, &|item| nonzero(option, parse_size(item)))
}

/// Parses a list of counts: `1,8,64` or `1..128` (doubling).
///
/// # Errors
/// As [`parse_size_list`], for counts.
pub(crate) fn parse_count_list(option: &str, s: &str) -> Result<Vec<u64>> {
    parse_list(option, s, &|item| parse_count(option, item))
}

/// A size for people: `4 KiB`, `1 MiB`, `1.5 GiB`, `100 B`.
pub(crate) fn human_size(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut unit = 0;
    while unit + 1 < UNITS.len() && n >= 1 << (10 * (unit + 1)) {
        unit += 1;
    }
    let scale = (1u64 << (10 * unit)) as f64;
    if n % (1 << (10 * unit)) == 0 {
        format!("{} {}", n >> (10 * unit), UNITS[unit])
    } else {
        format!("{:.1} {}", n as f64 / scale, UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: BenchArgs,
    }

    fn plan(args: &[&str]) -> Result<Plan> {
        let cli = Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))
            .expect("clap accepts the flags");
        Plan::from_args(&cli.args)
    }

    #[test]
    fn the_defaults_are_one_point_of_64_kib_by_32_for_5_seconds() {
        let p = plan(&[]).unwrap();
        assert_eq!(p.block_sizes, vec![64 << 10]);
        assert_eq!(p.batch_sizes, vec![32]);
        assert_eq!(p.threads, 1);
        assert_eq!(p.op, Op::Write);
        assert_eq!(p.stop, Stop::After(Duration::from_secs(5)));
        assert_eq!(p.warmup, Duration::from_secs(1));
        assert!(!p.is_sweep());
    }

    #[test]
    fn sizes_are_accepted_in_bytes_and_binary_units() {
        for (text, n) in [
            ("4096", 4096),
            ("4KiB", 4096),
            ("1MiB", 1 << 20),
            ("1mb", 1_000_000),
        ] {
            assert_eq!(
                plan(&["--block-size", text]).unwrap().block_sizes,
                vec![n],
                "{text}"
            );
        }
    }

    #[test]
    fn lists_accept_items_and_doubling_ranges_sorted_without_repeats() {
        assert_eq!(
            parse_size_list("--block-sizes", "1MiB, 4KiB,4096,16KiB..64KiB").unwrap(),
            vec![4096, 16 << 10, 32 << 10, 64 << 10, 1 << 20]
        );
        assert_eq!(
            parse_count_list("--batch-sizes", "1..8").unwrap(),
            vec![1, 2, 4, 8]
        );
        for bad in ["", "1,,2", "8..1", "0", "1,x", "-1"] {
            assert!(parse_count_list("--batch-sizes", bad).is_err(), "{bad}");
        }
        let e = parse_size_list("--block-sizes", "4KiB,0").unwrap_err();
        assert!(e.to_string().contains("--block-sizes"), "{e}");
    }

    #[test]
    fn a_sweep_covers_4_kib_to_64_mib_and_batches_1_to_128_by_default() {
        let p = plan(&["--sweep"]).unwrap();
        assert_eq!(p.block_sizes.len(), 15);
        assert_eq!(p.block_sizes.first(), Some(&4096));
        assert_eq!(p.block_sizes.last(), Some(&(64 << 20)));
        assert_eq!(p.batch_sizes, vec![1, 2, 4, 8, 16, 32, 64, 128]);
        assert!(p.is_sweep());
        assert_eq!(p.stop, Stop::After(Duration::from_millis(250)));
        let p = plan(&["--batch-sizes", "1,4"]).unwrap();
        assert_eq!(
            p.block_sizes,
            vec![64 << 10],
            "a batch list alone keeps the block size"
        );
        assert!(p.is_sweep());
    }

    #[test]
    fn durations_and_iteration_counts_are_understood() {
        let p = plan(&["--duration", "250ms", "--warmup", "0s"]).unwrap();
        assert_eq!(p.stop, Stop::After(Duration::from_millis(250)));
        assert_eq!(p.warmup, Duration::ZERO);
        assert_eq!(plan(&["--iters", "10"]).unwrap().stop, Stop::Iters(10));
        assert_eq!(
            plan(&["--duration", "1m 30s"]).unwrap().stop,
            Stop::After(Duration::from_secs(90))
        );
    }

    #[test]
    fn zero_and_malformed_values_are_refused_naming_the_option() {
        for (args, needle) in [
            (&["--block-size", "0"][..], "--block-size"),
            (&["--block-size", "4XB"][..], "--block-size"),
            (&["--batch", "0"][..], "--batch"),
            (&["--threads", "0"][..], "--threads"),
            (&["--threads", "two"][..], "--threads"),
            (&["--iters", "0"][..], "--iters"),
            (&["--duration", "0s"][..], "--duration"),
            (&["--duration", "soon"][..], "--duration"),
            (&["--buffer-size", "0"][..], "--buffer-size"),
            (&["--op", "copy"][..], "copy"),
            (&["--backend", ""][..], "--backend"),
        ] {
            let e = plan(args).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{args:?}");
            assert!(e.to_string().contains(needle), "{args:?}: {e}");
        }
    }

    #[test]
    fn a_block_larger_than_the_buffer_is_refused_unless_the_target_decides() {
        let e = plan(&["--block-size", "2MiB", "--buffer-size", "1MiB"]).unwrap_err();
        assert!(e.to_string().contains("does not fit"), "{e}");
        let e = plan(&[
            "--block-size",
            "1MiB",
            "--threads",
            "2",
            "--buffer-size",
            "1MiB",
        ])
        .unwrap_err();
        assert!(e.to_string().contains("2 thread"), "{e}");
        assert!(plan(&[
            "--block-size",
            "2MiB",
            "--buffer-size",
            "1MiB",
            "--target",
            "h:1"
        ])
        .is_ok());
    }

    #[test]
    fn batches_that_do_not_fit_reuse_slots_of_each_threads_own_range() {
        let p = plan(&["--threads", "2"]).unwrap();
        let l = p.layout(1 << 20, 64, 8 << 20);
        assert_eq!(l.slots, 4);
        assert_eq!(l.bytes(), 8 << 20);
        assert_eq!(l.offset(0, 5), 1 << 20);
        assert_eq!(l.offset(1, 0), 4 << 20);
        let roomy = p.layout(4096, 8, 1 << 30);
        assert_eq!((roomy.slots, roomy.bytes()), (8, 2 * 8 * 4096));
        assert_eq!(p.needed(1 << 30), 2 * 32 * (64 << 10));
    }

    #[test]
    fn human_sizes_use_binary_units() {
        assert_eq!(human_size(4096), "4 KiB");
        assert_eq!(human_size(64 << 20), "64 MiB");
        assert_eq!(human_size(1536), "1.5 KiB");
        assert_eq!(human_size(100), "100 B");
    }
}
