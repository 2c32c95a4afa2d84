//! `te bench`: throughput and latency over loopback or against a `te serve`.
//!
//! By default a target engine and an initiator engine run in this process and talk
//! over the loopback control plane; `--target HOST:PORT` measures against a remote
//! `te serve` instead. Each initiator thread submits batches of `--batch` requests of
//! `--block-size` bytes to its own range of the target's buffer and waits for each;
//! throughput counts every byte moved (GB/s, decimal), latency is per batch, from
//! submission to completion. `--baseline` measures memcpy and a raw loopback socket
//! in the same run, so the numbers can be read against the machine itself.

use std::path::PathBuf;

mod baseline;
mod kv;

pub(crate) use kv::{cache_side, KvArgs};
mod pattern;
mod plan;
mod plot;
mod report;
mod runner;
pub(crate) mod stats;

/// Options of `te bench`.
///
/// Values are checked by [`plan::Plan::from_args`], so a bad one is a one-line error.
#[derive(clap::Args, Debug, Default)]
pub(crate) struct BenchArgs {
    /// Configuration file (default: $TE_CONFIG, else built-in defaults).
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    /// Backend name, overriding the configuration (`te info` lists them).
    #[arg(long, value_name = "NAME")]
    pub(crate) backend: Option<String>,
    /// Serve the initiator engine's metrics on this address (`GET /metrics`) while the
    /// bench runs; `te stats ADDR` shows them live. The in-process target serves none.
    #[arg(long, value_name = "HOST:PORT")]
    pub(crate) metrics_listen: Option<String>,
    /// Operation: `write` pushes local blocks to the target, `read` pulls them [default: write].
    #[arg(long, value_name = "write|read")]
    pub(crate) op: Option<String>,
    /// Bytes per request: 4096, 4KiB, 64KiB, 1MiB, … [default: 64KiB].
    #[arg(long, value_name = "SIZE", conflicts_with = "block_sizes")]
    pub(crate) block_size: Option<String>,
    /// Requests per batch; at most 1048576 in flight, over all threads [default: 32].
    #[arg(long, value_name = "N", conflicts_with = "batch_sizes")]
    pub(crate) batch: Option<String>,
    /// Initiator threads, each with its own range of the buffers [default: 1].
    #[arg(long, value_name = "N")]
    pub(crate) threads: Option<String>,
    /// How long each point is measured, at most 1 day: 5s, 500ms [default: 5s; 250ms
    /// per sweep point].
    #[arg(long, value_name = "TIME", conflicts_with = "iters")]
    pub(crate) duration: Option<String>,
    /// Measure this many batches per thread instead of a duration.
    #[arg(long, value_name = "N")]
    pub(crate) iters: Option<String>,
    /// Unmeasured run before each point, at most 1 day; 0s for none [default: 1s; 50ms
    /// per sweep point].
    #[arg(long, value_name = "TIME")]
    pub(crate) warmup: Option<String>,
    /// Measure every block size from 4KiB to 64MiB (doubling) with every batch size from 1 to 128 (doubling).
    #[arg(long)]
    pub(crate) sweep: bool,
    /// Block sizes of a sweep: a comma list, items may be doubling ranges (4KiB..1MiB).
    #[arg(long, value_name = "LIST")]
    pub(crate) block_sizes: Option<String>,
    /// Batch sizes of a sweep: a comma list, items may be doubling ranges (1..64).
    #[arg(long, value_name = "LIST")]
    pub(crate) batch_sizes: Option<String>,
    /// Fill the sources with a pattern and check every destination byte after each point.
    #[arg(long)]
    pub(crate) verify: bool,
    /// Print one JSON object per result line instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
    /// Write an SVG plot of throughput against block size, one line per batch size.
    #[arg(long, value_name = "FILE.svg")]
    pub(crate) plot: Option<PathBuf>,
    /// Measure against a `te serve` at HOST:PORT (or by its name, with an etcd
    /// `metadata` store) instead of a target in this process.
    #[arg(long, value_name = "HOST:PORT|NAME")]
    pub(crate) target: Option<String>,
    /// The most each side allocates; batches that need more reuse block slots [default: 1GiB].
    #[arg(long, value_name = "SIZE")]
    pub(crate) buffer_size: Option<String>,
    /// Memory of both sides' buffers: host, fakedev:0, cuda:0, … (`te info` lists the
    /// runtimes); with --target the remote buffer is what `te serve --mem` allocated [default: host].
    #[arg(long, value_name = "KIND")]
    pub(crate) mem: Option<String>,
    /// Also measure single-thread memcpy, a loopback TCP socket pump and (if installed) qperf.
    #[arg(long)]
    pub(crate) baseline: bool,
    /// Move a simulated model's KV cache by block id (contiguous, random, and as plain
    /// 1 MiB requests); --batch is blocks per batch, --op read (default) pulls them.
    /// Refused with --threads, --iters, --warmup, --verify, --sweep, --block-size(s),
    /// --batch-sizes, --plot and --buffer-size, which it does not use.
    #[arg(long)]
    pub(crate) kv: bool,
    /// --kv: the simulated model's geometry.
    #[command(flatten)]
    pub(crate) kv_model: kv::KvArgs,
}

/// Runs `te bench`.
///
/// # Errors
/// `InvalidRequest` for bad options; the engine's error if the backend cannot start,
/// the target cannot be reached or a batch fails; `InvalidRequest` if `--verify` finds
/// a byte that differs from the pattern.
pub(crate) fn run(args: BenchArgs) -> te::Result<()> {
    if args.kv {
        return kv::run(&args);
    }
    let plan = plan::Plan::from_args(&args)?;
    runner::run(&plan)
}
