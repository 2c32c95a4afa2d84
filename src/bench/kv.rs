//! `te bench --kv`: a model's KV cache moved by block id.
//!
//! Both sides register the same `KvLayout`: per layer, a `key` and a `value` buffer of
//! `--kv-blocks` blocks of `kv_heads × head_dim × block_tokens × dtype_bytes` bytes (an
//! 8B-class model by default: 32 layers, 8 KV heads × 128 × 16 tokens × 2 bytes = 32 KiB
//! per block per buffer). Each batch moves `--batch` blocks of every buffer with
//! `pull_blocks` (`--op read`, the decode side's view) or `push_blocks` (`--op write`),
//! three ways in one run: block ids in one contiguous run on both sides (merged into
//! one request per buffer), random distinct ids (one request per block per buffer),
//! and the same bytes as plain 1 MiB requests. With `--baseline`, one thread's `memcpy`
//! moves the same blocks between two host buffers of the cache's size, contiguous and
//! random, so a random ÷ contiguous ratio can be read against what the CPU's own copies
//! of those sizes allow.

use std::time::{Duration, Instant};

use te::{
    Access, BlockOptions, Config, Engine, KvGroup, KvLayout, KvSlot, Op, RegionId, TransferRequest,
};

use super::plan::{parse_duration, MAX_IN_FLIGHT};
use super::stats::{nanos, Samples, MAX_SAMPLES};
use super::BenchArgs;

/// The simulated model's geometry, as `te bench --kv` and `te serve --kv` take it
/// (the two must agree).
#[derive(clap::Args, Debug, Default)]
pub(crate) struct KvArgs {
    /// --kv: layers, at most 1024 [default: 32].
    #[arg(long, value_name = "N", requires = "kv")]
    pub(crate) kv_layers: Option<String>,
    /// --kv: KV heads [default: 8].
    #[arg(long, value_name = "N", requires = "kv")]
    pub(crate) kv_heads: Option<String>,
    /// --kv: head dimension [default: 128].
    #[arg(long, value_name = "N", requires = "kv")]
    pub(crate) kv_head_dim: Option<String>,
    /// --kv: tokens per block [default: 16].
    #[arg(long, value_name = "N", requires = "kv")]
    pub(crate) kv_block_tokens: Option<String>,
    /// --kv: bytes per element (2 for fp16/bf16) [default: 2].
    #[arg(long, value_name = "N", requires = "kv")]
    pub(crate) kv_dtype_bytes: Option<String>,
    /// --kv: blocks per buffer on each side, at most 1048576; the cache at most 16 GiB
    /// per side [default: 256].
    #[arg(long, value_name = "N", requires = "kv")]
    pub(crate) kv_blocks: Option<String>,
}

/// The simulated model.
#[derive(Debug, Clone, Copy)]
struct Model {
    layers: u64,
    kv_heads: u64,
    head_dim: u64,
    block_tokens: u64,
    dtype_bytes: u64,
}

impl Model {
    /// Bytes of one block of one buffer; [`KvArgs::model`] checked that the whole cache
    /// fits in [`MAX_CACHE`], so no product overflows.
    fn bytes_per_block(&self) -> u64 {
        self.kv_heads * self.head_dim * self.block_tokens * self.dtype_bytes
    }
}

/// The most bytes one side's simulated cache may have.
const MAX_CACHE: u64 = 16 << 30;
/// The most layers: each is a group of the layout, built and sent to the peer.
const MAX_LAYERS: u64 = 1024;
/// The most blocks per buffer: a batch picks its ids from a list of them all.
const MAX_BLOCKS: u64 = 1 << 20;

fn bad(m: String) -> te::Error {
    te::Error::new(te::ErrorKind::InvalidRequest, m).with_operation("bench --kv")
}

/// A whole number from 1 to `max` given as `--{what}`, or `default`.
fn number(value: &Option<String>, default: u64, what: &str, max: u64) -> te::Result<u64> {
    match value {
        None => Ok(default),
        Some(v) => match v.parse::<u64>() {
            Ok(n) if (1..=max).contains(&n) => Ok(n),
            _ if max == u64::MAX => Err(bad(format!(
                "--{what} must be a whole number greater than zero, not `{v}`"
            ))),
            _ => Err(bad(format!(
                "--{what} must be a whole number from 1 to {max}, not `{v}`"
            ))),
        },
    }
}

fn layout(model: &Model, region: RegionId, blocks: u64) -> KvLayout {
    let bpb = model.bytes_per_block();
    KvLayout {
        name: "bench".into(),
        groups: (0..model.layers)
            .map(|l| KvGroup {
                name: format!("layer{l}"),
                slots: ["key", "value"]
                    .iter()
                    .enumerate()
                    .map(|(i, name)| KvSlot {
                        name: (*name).to_string(),
                        region,
                        offset: (2 * l + i as u64) * blocks * bpb,
                        bytes_per_block: bpb,
                        blocks,
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// One measured way of moving blocks.
struct Outcome {
    mode: &'static str,
    /// Measured without te (`--baseline`): one thread's `memcpy` of the same blocks.
    baseline: bool,
    batches: u64,
    requests: usize,
    bytes: u64,
    seconds: f64,
    /// Per-batch latencies (a bounded sample of them, for a long run).
    latencies: Samples,
    /// What the device runtimes counted over the mode's batches.
    device: te_core::device::CopyStats,
}

impl Outcome {
    fn new(mode: &'static str, baseline: bool) -> Outcome {
        Outcome {
            mode,
            baseline,
            batches: 0,
            requests: 0,
            bytes: 0,
            seconds: 0.0,
            latencies: Samples::new(MAX_SAMPLES),
            device: Default::default(),
        }
    }
}

impl KvArgs {
    /// The model and the blocks per buffer, whose cache fits in [`MAX_CACHE`].
    fn model(&self) -> te::Result<(Model, u64)> {
        let any = u64::MAX;
        let model = Model {
            layers: number(&self.kv_layers, 32, "kv-layers", MAX_LAYERS)?,
            kv_heads: number(&self.kv_heads, 8, "kv-heads", any)?,
            head_dim: number(&self.kv_head_dim, 128, "kv-head-dim", any)?,
            block_tokens: number(&self.kv_block_tokens, 16, "kv-block-tokens", any)?,
            dtype_bytes: number(&self.kv_dtype_bytes, 2, "kv-dtype-bytes", any)?,
        };
        let blocks = number(&self.kv_blocks, 256, "kv-blocks", MAX_BLOCKS)?;
        cache_bytes(&model, blocks)?;
        Ok((model, blocks))
    }
}

/// The bytes of one side's cache.
fn cache_bytes(model: &Model, blocks: u64) -> te::Result<u64> {
    let m = model;
    [m.kv_heads, m.head_dim, m.block_tokens, m.dtype_bytes, 2, m.layers, blocks]
        .into_iter()
        .try_fold(1u64, u64::checked_mul)
        .filter(|&n| n <= MAX_CACHE)
        .ok_or_else(|| {
            bad("the simulated cache is larger than 16 GiB per side; lower --kv-blocks or the model's --kv-* sizes".into())
        })
}

/// A side of the cache in `engine`: its buffer of `mem`, registered as `kv` with the
/// layout `bench` over it; what `te serve --kv` serves.
///
/// # Errors
/// `InvalidRequest` for a bad geometry; the engine's if the memory cannot be had.
pub(crate) fn cache_side(
    engine: &Engine,
    args: &KvArgs,
    mem: &te::MemoryKind,
) -> te::Result<te::Buffer> {
    let (model, blocks) = args.model()?;
    let side = cache_bytes(&model, blocks)?;
    let buffer = engine.alloc_on(mem, "kv", side as usize, Access::REMOTE_READ_WRITE)?;
    engine.register_layout(layout(&model, buffer.id(), blocks))?;
    Ok(buffer)
}

/// Refuses the options of the other benches, which a `--kv` run would not use.
fn refuse_other_options(args: &BenchArgs) -> te::Result<()> {
    let given: Vec<&str> = [
        ("--threads", args.threads.is_some()),
        ("--iters", args.iters.is_some()),
        ("--warmup", args.warmup.is_some()),
        ("--verify", args.verify),
        ("--sweep", args.sweep),
        ("--block-size", args.block_size.is_some()),
        ("--block-sizes", args.block_sizes.is_some()),
        ("--batch-sizes", args.batch_sizes.is_some()),
        ("--plot", args.plot.is_some()),
        ("--buffer-size", args.buffer_size.is_some()),
    ]
    .into_iter()
    .filter_map(|(option, set)| set.then_some(option))
    .collect();
    if given.is_empty() {
        return Ok(());
    }
    Err(bad(format!(
        "--kv does not take {}: it moves the whole cache once, then measures each mode on one thread for --duration, --batch blocks of the --kv-* model per batch; leave {} out",
        given.join(", "),
        if given.len() == 1 { "it" } else { "them" }
    )))
}

pub(crate) fn run(args: &BenchArgs) -> te::Result<()> {
    refuse_other_options(args)?;
    let (model, blocks) = args.kv_model.model()?;
    let batch = number(&args.batch, 32, "batch", u64::MAX)?;
    if batch > blocks {
        return Err(bad(format!(
            "--batch {batch} is more blocks than the cache has (--kv-blocks {blocks})"
        )));
    }
    // At random, a batch is a request per block of every buffer.
    if 2 * model.layers * batch > MAX_IN_FLIGHT {
        return Err(bad(format!(
            "--batch {batch} blocks × 2 × --kv-layers {} is more than the {MAX_IN_FLIGHT} requests per batch te bench allows; use smaller batches or fewer layers",
            model.layers
        )));
    }
    let op = match args.op.as_deref().unwrap_or("read") {
        "read" => Op::Read,
        "write" => Op::Write,
        other => return Err(bad(format!("--op must be read or write, not `{other}`"))),
    };
    let duration = match &args.duration {
        Some(d) => match parse_duration("--duration", d)? {
            Duration::ZERO => return Err(bad("--duration must be longer than zero".into())),
            d => d,
        },
        None => Duration::from_secs(3),
    };
    let bpb = model.bytes_per_block();
    let side = cache_bytes(&model, blocks)?;

    let mut config = Config::resolve(args.config.as_deref())?;
    if let Some(b) = &args.backend {
        config.engine.backend = b.clone();
    }
    let mem: te::MemoryKind = match &args.mem {
        Some(m) => m
            .parse()
            .map_err(|e: te::Error| bad(format!("--mem {m}: {}", e.message())))?,
        None => te::MemoryKind::Host,
    };
    let mut own = config.clone();
    if let Some(m) = &args.metrics_listen {
        own.engine.metrics_listen = Some(m.clone());
    }
    // One endpoint per address: the target in this process serves none.
    config.engine.metrics_listen = None;
    let initiator = Engine::from_config(&own)?;
    if let Some(m) = initiator.metrics_address() {
        eprintln!("metrics at http://{m}/metrics (`te stats {m}` shows them live)");
    }
    // The target: a `te serve --kv` (another process, on this host or not), or an
    // engine in this process.
    let (_target, addr) = match &args.target {
        Some(addr) => (None, addr.clone()),
        None => {
            let target = Engine::from_config(&config)?;
            let buffer = cache_side(&target, &args.kv_model, &mem)?;
            let addr = target.address().to_string();
            (Some((target, buffer)), addr)
        }
    };
    let local = cache_side(&initiator, &args.kv_model, &mem)?;
    let peer = initiator.connect(&addr)?;
    let remote_id = peer.region("kv").map(|r| r.id).ok_or_else(|| {
        bad(format!(
            "{addr} serves no KV cache: start it with `te serve --kv` and the same --kv-* options"
        ))
    })?;
    // The engine refused another layout at connect (groups, slots, bytes per block);
    // what it leaves to the caller is whether the peer has the block ids used here.
    let short = peer.kv_layout("bench").is_none_or(|l| {
        l.groups
            .iter()
            .flat_map(|g| &g.slots)
            .any(|s| s.blocks < blocks)
    });
    if short {
        return Err(bad(format!(
            "the cache {addr} serves has fewer than {blocks} blocks per buffer (or no layout `bench`); start `te serve --kv` with the same --kv-* options"
        )));
    }
    if let Some(path) = initiator.path_to(&peer) {
        eprintln!("te bench --kv: the target at {addr} is reached by {path}");
    }

    let per_batch = batch * bpb * 2 * model.layers;
    eprintln!(
        "te bench --kv: backend {}, {mem} memory, {op}, {} layers × (key, value) × {blocks} blocks of {} bytes; {batch} blocks per batch ({:.1} MiB), {:?} per mode",
        initiator.backend_info().name,
        model.layers,
        bpb,
        per_batch as f64 / (1u64 << 20) as f64,
        duration
    );
    // Warm-up: the whole cache moved once, so no mode pays for first touches (page
    // faults, pinning) the others do not.
    let chunk = 1u64 << 20;
    let all: Vec<TransferRequest> = (0..side.div_ceil(chunk))
        .map(|i| {
            let (off, len) = (i * chunk, chunk.min(side - i * chunk));
            match op {
                Op::Read => TransferRequest::read(local.id(), off, remote_id, off, len),
                Op::Write => TransferRequest::write(local.id(), off, remote_id, off, len),
            }
        })
        .collect();
    for part in all.chunks(64) {
        initiator.transfer(&peer, part)?.wait()?;
    }
    let options = BlockOptions::default();
    let mut rng = Rng(super::runner::seed(0) | 1);
    let mut ids: Vec<u64> = (0..blocks).collect();
    let mut outcomes = Vec::new();
    for mode in ["contiguous", "random", "plain-1MiB"] {
        let mut o = Outcome::new(mode, false);
        let plain: Vec<TransferRequest> = {
            let chunk = 1u64 << 20;
            (0..per_batch.div_ceil(chunk))
                .map(|i| {
                    let off = i * chunk;
                    let len = chunk.min(per_batch - off);
                    match op {
                        Op::Read => TransferRequest::read(local.id(), off, remote_id, off, len),
                        Op::Write => TransferRequest::write(local.id(), off, remote_id, off, len),
                    }
                })
                .collect()
        };
        let start = Instant::now();
        let device = te_core::device::stats();
        // At least one batch, however short the duration, so every mode has numbers.
        while o.batches == 0 || start.elapsed() < duration {
            let (remote_ids, local_ids) = rng.pick(mode == "contiguous", &mut ids, batch);
            let t = Instant::now();
            let handle = match (mode, op) {
                ("plain-1MiB", _) => {
                    o.requests = plain.len();
                    initiator.transfer(&peer, &plain)?
                }
                (_, Op::Read) => {
                    initiator.pull_blocks(&peer, "bench", &remote_ids, &local_ids, &options)?
                }
                (_, Op::Write) => {
                    initiator.push_blocks(&peer, "bench", &remote_ids, &local_ids, &options)?
                }
            };
            handle.wait()?;
            o.latencies.add(nanos(t.elapsed()), None);
            o.batches += 1;
            o.bytes += per_batch;
            if mode != "plain-1MiB" {
                o.requests = 2 * model.layers as usize * runs(&remote_ids, &local_ids);
            }
        }
        o.seconds = start.elapsed().as_secs_f64();
        o.device = te_core::device::stats().since(&device);
        outcomes.push(o);
    }
    if args.baseline {
        let shape = Shape {
            buffers: 2 * model.layers,
            blocks,
            batch,
            bpb,
        };
        outcomes.extend(memcpy_baseline(&shape, duration, &mut rng)?);
    }
    // Memory the CPU copies (host, fakedev): the memcpy baseline is its ceiling.
    let cpu = matches!(&mem, te::MemoryKind::Host)
        || matches!(&mem, te::MemoryKind::Device { runtime, .. } if runtime == "fakedev");
    report(
        args.json,
        &initiator.backend_info().name,
        op,
        batch,
        bpb,
        &outcomes,
        cpu,
    );
    Ok(())
}

/// The blocks one batch moves: `batch` of each of `buffers` buffers of `blocks` blocks
/// of `bpb` bytes.
struct Shape {
    buffers: u64,
    blocks: u64,
    batch: u64,
    bpb: u64,
}

/// `--baseline`: the same batches as the contiguous and random modes, moved between
/// two host buffers by one thread's `memcpy`: one copy per buffer and run of blocks.
fn memcpy_baseline(shape: &Shape, duration: Duration, rng: &mut Rng) -> te::Result<Vec<Outcome>> {
    let side = (shape.buffers * shape.blocks * shape.bpb) as usize;
    let buffer = |fill: u8| -> te::Result<Vec<u8>> {
        let mut v = Vec::new();
        v.try_reserve_exact(side).map_err(|_| {
            bad(format!(
                "--baseline: cannot allocate two host buffers of {side} bytes; lower --kv-blocks"
            ))
        })?;
        v.resize(side, fill);
        Ok(v)
    };
    let (src, mut dst) = (buffer(1)?, buffer(2)?);
    let bpb = shape.bpb as usize;
    let mut ids: Vec<u64> = (0..shape.blocks).collect();
    let outcomes = ["memcpy-contiguous", "memcpy-random"]
        .into_iter()
        .map(|mode| {
            let mut o = Outcome::new(mode, true);
            let start = Instant::now();
            while o.batches == 0 || start.elapsed() < duration {
                // One copy per run of blocks, in every buffer, as te's plan merges them.
                let (from, to) = rng.pick(mode == "memcpy-contiguous", &mut ids, shape.batch);
                let copies = merged(&from, &to);
                let t = Instant::now();
                for b in 0..shape.buffers {
                    let base = (b * shape.blocks) as usize * bpb;
                    for &(from, to, n) in &copies {
                        let (from, to) = (base + from as usize * bpb, base + to as usize * bpb);
                        let len = n as usize * bpb;
                        dst[to..to + len].copy_from_slice(&src[from..from + len]);
                    }
                }
                std::hint::black_box(&mut dst);
                o.latencies.add(nanos(t.elapsed()), None);
                o.batches += 1;
                o.bytes += shape.buffers * shape.batch * shape.bpb;
                o.requests = shape.buffers as usize * copies.len();
            }
            o.seconds = start.elapsed().as_secs_f64();
            o
        })
        .collect();
    Ok(outcomes)
}

/// xorshift64: block ids only need to be scattered, not unpredictable.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn shuffle(&mut self, v: &mut [u64]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i as u64 + 1) as usize);
        }
    }
    /// A batch's block ids on either side (`ids` holds every id of a buffer): one run
    /// from the same random block on both, or `batch` distinct random ids on each.
    fn pick(&mut self, run: bool, ids: &mut [u64], batch: u64) -> (Vec<u64>, Vec<u64>) {
        if run {
            let first = self.below(ids.len() as u64 - batch + 1);
            let r: Vec<u64> = (first..first + batch).collect();
            return (r.clone(), r);
        }
        self.shuffle(ids);
        let a = ids[..batch as usize].to_vec();
        self.shuffle(ids);
        (a, ids[..batch as usize].to_vec())
    }
}

/// Runs consecutive on both sides, as the planner merges them (after sorting by remote id).
fn runs(remote: &[u64], local: &[u64]) -> usize {
    merged(remote, local).len()
}

/// The pairs of ids `(a[i], b[i])`, sorted by `a` and merged into runs consecutive on
/// both sides: `(first a, first b, blocks)` each.
fn merged(a: &[u64], b: &[u64]) -> Vec<(u64, u64, u64)> {
    let mut pairs: Vec<(u64, u64)> = a.iter().copied().zip(b.iter().copied()).collect();
    pairs.sort_unstable();
    let mut out: Vec<(u64, u64, u64)> = Vec::new();
    for (x, y) in pairs {
        match out.last_mut() {
            Some((f, t, n)) if *f + *n == x && *t + *n == y => *n += 1,
            _ => out.push((x, y, 1)),
        }
    }
    out
}

/// Prints the outcomes; `cpu`: te's copies were the CPU's, so one thread's memcpy of the
/// same blocks is a ceiling to compare with.
fn report(
    json: bool,
    backend: &str,
    op: Op,
    batch: u64,
    bpb: u64,
    outcomes: &[Outcome],
    cpu: bool,
) {
    if !json {
        println!(
            "MODE                BLOCKS/S      GB/S  REQUESTS/BATCH  AVG µs  P50 µs  P99 µs  DEV CALLS/BATCH"
        );
    }
    for o in outcomes {
        let mut lat: Vec<f64> = (o.latencies.latencies_ns.iter())
            .map(|&ns| ns as f64 / 1e3)
            .collect();
        lat.sort_by(f64::total_cmp);
        let pct = |p: f64| {
            lat.get(((lat.len() as f64 - 1.0) * p).round() as usize)
                .copied()
                .unwrap_or(0.0)
        };
        let avg = lat.iter().sum::<f64>() / lat.len().max(1) as f64;
        let gbps = o.bytes as f64 / o.seconds / 1e9;
        let blocks_per_s = (o.batches * batch) as f64 / o.seconds;
        let per = |n: u64| n as f64 / o.batches.max(1) as f64;
        if json {
            let backend = if o.baseline {
                super::baseline::MEMCPY
            } else {
                backend
            };
            let v = serde_json::json!({
                "backend": backend, "op": op.to_string(), "mode": o.mode, "block_size": bpb,
                "batch_size": batch, "requests_per_batch": o.requests, "bytes": o.bytes,
                "seconds": o.seconds, "blocks_per_s": blocks_per_s, "gb_per_s": gbps,
                "lat_us_avg": avg, "lat_us_p50": pct(0.5), "lat_us_p99": pct(0.99),
                "device_calls_per_batch": per(o.device.calls),
                "device_copies_per_batch": per(o.device.copies),
                "device_syncs_per_batch": per(o.device.syncs),
            });
            println!("{v}");
        } else {
            println!(
                "{:<18} {:>9.0} {:>9.3} {:>15} {:>7.1} {:>7.1} {:>7.1} {:>16.1}",
                o.mode,
                blocks_per_s,
                gbps,
                o.requests,
                avg,
                pct(0.5),
                pct(0.99),
                per(o.device.calls)
            );
        }
    }
    if !json {
        let rate = |mode: &str| {
            outcomes
                .iter()
                .find(|o| o.mode == mode)
                .map(|o| o.bytes as f64 / o.seconds)
        };
        for (who, c, r) in [
            ("te", "contiguous", "random"),
            ("memcpy", "memcpy-contiguous", "memcpy-random"),
        ] {
            if let (Some(c), Some(r)) = (rate(c), rate(r)) {
                println!("random ÷ contiguous, {who}: {:.2}", r / c);
            }
        }
        match (rate("random"), rate("memcpy-random")) {
            (Some(te), Some(memcpy)) if cpu => {
                println!("random, te ÷ memcpy of the same blocks: {:.2}", te / memcpy)
            }
            (Some(_), Some(_)) => {
                println!("(memcpy copied host memory; te moved device memory)")
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merged_runs_are_consecutive_on_both_sides() {
        assert_eq!(merged(&[3, 1, 2], &[7, 5, 6]), [(1, 5, 3)]);
        assert_eq!(merged(&[1, 2, 4], &[5, 6, 8]), [(1, 5, 2), (4, 8, 1)]);
        assert_eq!(merged(&[1, 2], &[6, 5]), [(1, 6, 1), (2, 5, 1)]);
    }

    #[test]
    fn runs_count_what_the_planner_merges() {
        assert_eq!(runs(&[1, 2, 3], &[5, 6, 7]), 1);
        assert_eq!(runs(&[3, 1, 2], &[7, 5, 6]), 1);
        assert_eq!(runs(&[1, 2, 3], &[5, 6, 9]), 2);
        assert_eq!(runs(&[9, 1], &[1, 9]), 2);
    }

    #[test]
    fn the_memcpy_baseline_moves_each_mode_s_blocks_as_te_would_ask_for_them() {
        let shape = Shape {
            buffers: 4,
            blocks: 16,
            batch: 8,
            bpb: 64,
        };
        let out = memcpy_baseline(&shape, Duration::from_millis(20), &mut Rng(7)).unwrap();
        let modes: Vec<_> = out.iter().map(|o| (o.mode, o.baseline)).collect();
        assert_eq!(
            modes,
            [("memcpy-contiguous", true), ("memcpy-random", true)]
        );
        // One copy per buffer for a run of blocks; at random, one per buffer and run of
        // ids consecutive on both sides (at most one per block).
        assert_eq!(out[0].requests, 4);
        assert!(out[1].requests % 4 == 0 && out[1].requests <= 4 * 8);
        for o in &out {
            assert!(o.batches > 0);
            assert_eq!(o.bytes, o.batches * 4 * 8 * 64);
            assert_eq!(o.latencies.latencies_ns.len() as u64, o.batches);
        }
    }

    #[test]
    fn the_default_model_has_32_kib_blocks() {
        let m = Model {
            layers: 32,
            kv_heads: 8,
            head_dim: 128,
            block_tokens: 16,
            dtype_bytes: 2,
        };
        assert_eq!(m.bytes_per_block(), 32 << 10);
        let l = layout(&m, RegionId(1), 4);
        assert_eq!(l.groups.len(), 32);
        assert_eq!(l.groups[31].slots[1].offset, 63 * 4 * (32 << 10));
        l.validate().unwrap();
    }
}
