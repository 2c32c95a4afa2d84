//! What a person sees: progress on stderr while points run, a table at the end.
//!
//! On a terminal the progress is an indicatif bar; otherwise (a pipe, a CI log) it is
//! one plain line when a point starts and one when it ends.

use std::io::IsTerminal;
use std::time::Duration;
use te_core::sync::Mutex;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use te::MemoryKind;

use super::baseline::{MEMCPY, QPERF, SOCKET};
use super::plan::{human_size, Layout, Plan, Stop};
use super::stats::Record;

/// Progress of a run, on stderr.
#[derive(Debug)]
pub(crate) struct Progress {
    bar: Option<ProgressBar>,
    total: usize,
    sweep: bool,
    label: Mutex<String>,
}

impl Progress {
    /// A bar when stderr is a terminal, plain lines otherwise.
    pub(crate) fn new(plan: &Plan, total: usize) -> Progress {
        let sweep = plan.is_sweep();
        let bar = std::io::stderr().is_terminal().then(|| {
            let (len, template) = if sweep {
                (
                    total as u64,
                    "{spinner} [{bar:30}] {pos}/{len} points  {msg}",
                )
            } else {
                (1000, "{spinner} [{bar:30}] {percent:>3}%  {msg}")
            };
            let style = ProgressStyle::with_template(template)
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> ");
            let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr())
                .with_style(style);
            bar.enable_steady_tick(Duration::from_millis(120));
            bar
        });
        Progress {
            bar,
            total,
            sweep,
            label: Mutex::new(String::new()),
        }
    }

    /// The current point's label.
    fn label(&self) -> String {
        self.label.lock().clone()
    }

    /// A point begins.
    pub(crate) fn start(&self, index: usize, layout: Layout, plan: &Plan) {
        let label = format!(
            "[{}/{}] {} {} × {}, {} thread{}",
            index + 1,
            self.total,
            plan.op,
            human_size(layout.block),
            layout.batch,
            layout.threads,
            if layout.threads == 1 { "" } else { "s" }
        );
        *self.label.lock() = label.clone();
        let what = match plan.stop {
            Stop::After(d) => format!("{:.2} s", d.as_secs_f64()),
            Stop::Iters(n) => format!("{n} batches per thread"),
        };
        match &self.bar {
            Some(bar) => {
                if !self.sweep {
                    bar.set_position(0);
                }
                bar.set_message(label);
            }
            None => eprintln!(
                "te bench: {label}: {} warm-up, then {what}",
                format_args!("{:.2} s", plan.warmup.as_secs_f64())
            ),
        }
    }

    /// The point's warm-up runs.
    pub(crate) fn warming(&self) {
        if let Some(bar) = &self.bar {
            bar.set_message(format!("{}  warming up", self.label()));
        }
    }

    /// The point's measured phase runs.
    pub(crate) fn measuring(&self) {
        if let Some(bar) = &self.bar {
            bar.set_message(format!("{}  measuring", self.label()));
        }
    }

    /// Live numbers while a point is measured.
    pub(crate) fn tick(&self, batches: u64, layout: Layout, elapsed: Duration, stop: Stop) {
        let Some(bar) = &self.bar else { return };
        let bytes = batches
            .saturating_mul(layout.batch)
            .saturating_mul(layout.block);
        let gbps = super::stats::gb_per_s(bytes, elapsed.as_secs_f64());
        if !self.sweep {
            let done = match stop {
                Stop::After(d) => elapsed.as_secs_f64() / d.as_secs_f64().max(1e-9),
                Stop::Iters(n) => batches as f64 / (n as f64 * layout.threads as f64),
            };
            bar.set_position((done.min(1.0) * 1000.0) as u64);
        }
        bar.set_message(format!("{}  {gbps:.2} GB/s", self.label()));
    }

    /// A result is in.
    pub(crate) fn finished(&self, r: &Record) {
        match &self.bar {
            Some(bar) => {
                if self.sweep && !r.is_baseline() {
                    bar.inc(1);
                } else if !self.sweep {
                    bar.set_position(1000);
                }
            }
            None => {
                let label = if r.is_baseline() {
                    format!("{} at {}", r.backend, human_size(r.block_size))
                } else {
                    self.label()
                };
                let lat = r
                    .lat_us_p50
                    .map(|p| format!(", p50 {p:.1} µs per batch"))
                    .unwrap_or_default();
                eprintln!("te bench: {label}: {:.3} GB/s{lat}", r.gb_per_s);
            }
        }
    }

    /// A message for the person watching, above the bar.
    pub(crate) fn note(&self, message: &str) {
        match &self.bar {
            Some(bar) => bar.println(message),
            None => eprintln!("te bench: {message}"),
        }
    }

    /// Every point is done.
    pub(crate) fn done(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.done();
    }
}

/// The lines above the table: what is measured, where, how long.
pub(crate) fn header(plan: &Plan, backend: &str, target: String) {
    println!("te bench: backend {backend}, op {}, {target}", plan.op);
    let sizes = |v: &[u64], f: &dyn Fn(u64) -> String| {
        v.iter().map(|&n| f(n)).collect::<Vec<_>>().join(", ")
    };
    let stop = match plan.stop {
        Stop::After(d) => format!("{:.2} s per point", d.as_secs_f64()),
        Stop::Iters(n) => format!("{n} batches per thread per point"),
    };
    println!(
        "  blocks: {}; batch sizes: {}; {} thread(s); {stop} after {:.2} s warm-up{}{}",
        sizes(&plan.block_sizes, &human_size),
        sizes(&plan.batch_sizes, &|n| n.to_string()),
        plan.threads,
        plan.warmup.as_secs_f64(),
        if plan.verify { "; verify on" } else { "" },
        match plan.mem {
            MemoryKind::Host => String::new(),
            ref m => format!("; {m} memory"),
        }
    );
}

/// The baseline of `kind` that `r` is compared with: memcpy of the same block and
/// batch size (the same working set), the wire's baselines of the same block size.
fn baseline<'r>(records: &'r [Record], kind: &str, r: &Record) -> Option<&'r Record> {
    records.iter().find(|b| {
        b.backend == kind
            && b.block_size == r.block_size
            && (kind != MEMCPY || b.batch_size == r.batch_size)
    })
}

/// A number cell, `-` where not measured.
fn opt(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "-".to_string(), |v| format!("{v:.decimals$}"))
}

/// The rows of the table, as text cells (header first).
pub(crate) fn rows(records: &[Record]) -> Vec<Vec<String>> {
    let has = |kind: &str| records.iter().any(|r| r.backend == kind);
    let ratios: Vec<&str> = [MEMCPY, SOCKET, QPERF]
        .into_iter()
        .filter(|k| has(k))
        .collect();
    let mut head: Vec<String> = [
        "BACKEND",
        "OP",
        "BLOCK",
        "BATCH",
        "THREADS",
        "GB/S",
        "AVG µs",
        "P50 µs",
        "P99 µs",
        "P99.9 µs",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    head.extend(
        ratios
            .iter()
            .map(|k| format!("×{}", k.trim_start_matches("baseline-").to_uppercase())),
    );
    let mut out = vec![head];
    for r in records {
        let mut row = vec![
            r.backend.clone(),
            if r.is_baseline() {
                "-".into()
            } else {
                r.op.clone()
            },
            human_size(r.block_size),
            r.batch_size.to_string(),
            r.threads.to_string(),
            format!("{:.3}", r.gb_per_s),
            opt(r.lat_us_avg, 1),
            opt(r.lat_us_p50, 1),
            opt(r.lat_us_p99, 1),
            opt(r.lat_us_p999, 1),
        ];
        for kind in &ratios {
            let cell = match baseline(records, kind, r) {
                Some(b) if !r.is_baseline() && b.gb_per_s > 0.0 => {
                    format!("{:.2}", r.gb_per_s / b.gb_per_s)
                }
                _ => "-".to_string(),
            };
            row.push(cell);
        }
        out.push(row);
    }
    out
}

/// Prints the results as an aligned table on stdout.
pub(crate) fn table(records: &[Record]) {
    let rows = rows(records);
    let cols = rows.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..cols)
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    println!();
    for row in &rows {
        let line: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(c, cell)| {
                let pad = widths[c] - cell.chars().count();
                // Names left, numbers right.
                if c < 2 {
                    format!("{cell}{}", " ".repeat(pad))
                } else {
                    format!("{}{cell}", " ".repeat(pad))
                }
            })
            .collect();
        println!("{}", line.join("  ").trim_end());
    }
}

/// Sentences comparing each te result with the baselines at its block size (only for
/// a run of one point; a sweep's table has the ratio columns).
pub(crate) fn ratios(records: &[Record]) {
    let te: Vec<&Record> = records.iter().filter(|r| !r.is_baseline()).collect();
    let [r] = te.as_slice() else { return };
    let block = human_size(r.block_size);
    if let Some(m) = baseline(records, MEMCPY, r) {
        println!(
            "\n{} moves {:.3} GB/s = {:.0}% of single-thread memcpy ({:.3} GB/s) at {block} blocks",
            r.backend,
            r.gb_per_s,
            100.0 * r.gb_per_s / m.gb_per_s,
            m.gb_per_s
        );
    }
    if let Some(s) = baseline(records, SOCKET, r) {
        println!(
            "{} moves {:.2}× a raw loopback TCP socket pump ({:.3} GB/s over {} connection(s)) at {block} writes",
            r.backend,
            r.gb_per_s / s.gb_per_s,
            s.gb_per_s,
            s.threads
        );
    }
    if let Some(q) = baseline(records, QPERF, r) {
        println!(
            "{} moves {:.2}× qperf tcp_bw ({:.3} GB/s; tcp_lat {:.1} µs) at {block} messages",
            r.backend,
            r.gb_per_s / q.gb_per_s,
            q.gb_per_s,
            q.lat_us_avg.unwrap_or(f64::NAN)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_shows_ratios_to_the_baselines_of_the_same_block_size() {
        let te = Record::measured(
            "stub",
            te::Op::Write,
            1 << 20,
            64,
            1,
            8_000_000_000,
            1.0,
            None,
        );
        let mem = Record::measured(
            MEMCPY,
            te::Op::Write,
            1 << 20,
            64,
            1,
            10_000_000_000,
            1.0,
            None,
        );
        let other = Record::measured(SOCKET, te::Op::Write, 4096, 1, 1, 1_000_000_000, 1.0, None);
        let rows = rows(&[te, mem, other]);
        assert_eq!(rows[0].last().unwrap(), "×SOCKET");
        assert_eq!(rows[0][10], "×MEMCPY");
        assert_eq!(rows[1][10], "0.80");
        assert_eq!(rows[1][11], "-", "no socket baseline at 1 MiB");
        assert_eq!(rows[1][5], "8.000");
        assert_eq!(rows[2][1], "-");
    }
}
