//! Results: per-batch latencies, their summary, and the record printed for a point.

use std::time::Duration;

use serde::Serialize;

/// Per-batch latency summary, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Summary {
    /// Mean.
    pub(crate) avg: f64,
    /// Median.
    pub(crate) p50: f64,
    /// 99th percentile.
    pub(crate) p99: f64,
    /// 99.9th percentile.
    pub(crate) p999: f64,
}

/// Summarises latencies given in nanoseconds; sorts them in place. `None` if empty.
///
/// Percentiles are nearest-rank: p99 of 100 samples is the 99th smallest.
pub(crate) fn summarise(ns: &mut [u64]) -> Option<Summary> {
    if ns.is_empty() {
        return None;
    }
    ns.sort_unstable();
    let rank = |p: f64| {
        let r = (p * ns.len() as f64).ceil() as usize;
        ns[r.clamp(1, ns.len()) - 1] as f64 / 1e3
    };
    let sum: u128 = ns.iter().map(|&n| u128::from(n)).sum();
    Some(Summary {
        avg: sum as f64 / ns.len() as f64 / 1e3,
        p50: rank(0.50),
        p99: rank(0.99),
        p999: rank(0.999),
    })
}

/// One result line: a measured te point, or a baseline.
///
/// These are exactly the fields of `--json`; baselines use the same fields, with
/// `null` where a number was not measured (a socket pump has no per-batch latency).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Record {
    /// The backend, or `baseline-memcpy`, `baseline-socket`, `baseline-qperf`.
    pub(crate) backend: String,
    /// `write` or `read` (`write` for baselines: bytes flow one way).
    pub(crate) op: String,
    /// Bytes per request (per copy, per socket write).
    pub(crate) block_size: u64,
    /// Requests per batch.
    pub(crate) batch_size: u64,
    /// Initiator threads (connections for the socket pump).
    pub(crate) threads: u64,
    /// Bytes moved in the measured time.
    pub(crate) bytes: Option<u64>,
    /// The measured time.
    pub(crate) seconds: Option<f64>,
    /// `bytes / seconds / 1e9`.
    pub(crate) gb_per_s: f64,
    /// Mean per-batch latency.
    pub(crate) lat_us_avg: Option<f64>,
    /// Median per-batch latency.
    pub(crate) lat_us_p50: Option<f64>,
    /// 99th percentile per-batch latency.
    pub(crate) lat_us_p99: Option<f64>,
    /// 99.9th percentile per-batch latency.
    pub(crate) lat_us_p999: Option<f64>,
    /// Device driver calls (or fake launches) per batch in the measured time, both
    /// sides where the target is in this process (`te_core::device::stats`).
    pub(crate) device_calls_per_batch: Option<f64>,
    /// Device copies (ranges) per batch.
    pub(crate) device_copies_per_batch: Option<f64>,
    /// Device synchronisations per batch.
    pub(crate) device_syncs_per_batch: Option<f64>,
    /// Where a batch's time went, from its telemetry.
    #[serde(flatten)]
    pub(crate) stages: StageSummary,
}

/// Medians of where batches' time went, in microseconds, from each batch's
/// [`te::BatchTelemetry`] and the bench's own clock; `None` where nothing timed it.
/// The stages may overlap (a backend that sends while it posts starts the wire before
/// posting ends), so they need not add up to the latency.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub(crate) struct StageSummary {
    /// Submission until the backend had taken the batch (checks, pins, posting).
    pub(crate) post_us_p50: Option<f64>,
    /// The backend having taken it until its first byte went out.
    pub(crate) queued_us_p50: Option<f64>,
    /// First byte out until the last answer.
    pub(crate) wire_us_p50: Option<f64>,
    /// First device copy submitted until the last completed.
    pub(crate) device_us_p50: Option<f64>,
    /// The batch's end until the thread waiting for it had it back.
    pub(crate) wake_us_p50: Option<f64>,
}

/// The most per-batch samples one point keeps over all its threads (each thread
/// `MAX_SAMPLES / threads`): at most about 100 MiB, however long the point runs.
pub(crate) const MAX_SAMPLES: usize = 1 << 21;

/// One thread's per-batch latencies and stages, at most `cap` of each: when full,
/// every other sample is dropped and from then on one batch in twice as many is kept,
/// so a long run keeps samples spread evenly over its whole time in bounded memory.
/// A run of fewer batches keeps every one.
#[derive(Debug)]
pub(crate) struct Samples {
    /// Latencies, in nanoseconds.
    pub(crate) latencies_ns: Vec<u64>,
    /// Where the kept batches' time went.
    pub(crate) stages: Stages,
    /// Even, so that halving keeps the batches one in `2 × every` keeps.
    cap: usize,
    /// One batch in this many is kept.
    every: u64,
    /// Batches offered.
    seen: u64,
}

impl Samples {
    /// No samples yet, at most about `cap` to be kept.
    pub(crate) fn new(cap: usize) -> Samples {
        let cap = cap.max(2) & !1;
        Samples {
            latencies_ns: Vec::with_capacity(cap.min(1 << 16)),
            stages: Stages::default(),
            cap,
            every: 1,
            seen: 0,
        }
    }

    /// Offers a batch that took `latency_ns` on the waiting thread's clock.
    pub(crate) fn add(&mut self, latency_ns: u64, telemetry: Option<&te::BatchTelemetry>) {
        if self.keep() {
            self.latencies_ns.push(latency_ns);
            if let Some(t) = telemetry {
                self.stages.add(latency_ns, t);
            }
        }
    }

    /// Whether to keep the next batch; when the samples are full, halves them first.
    fn keep(&mut self) -> bool {
        let index = self.seen;
        self.seen += 1;
        if index % self.every != 0 {
            return false;
        }
        if self.latencies_ns.len() >= self.cap {
            halve(&mut self.latencies_ns);
            self.stages.halve();
            self.every *= 2;
        }
        index % self.every == 0
    }

    /// Adds another thread's samples.
    pub(crate) fn extend(&mut self, o: Samples) {
        self.latencies_ns.extend(o.latencies_ns);
        self.stages.extend(o.stages);
    }
}

/// Keeps the values at even positions.
fn halve(v: &mut Vec<u64>) {
    let mut i = 0;
    v.retain(|_| {
        i += 1;
        i % 2 == 1
    });
}

/// Per-batch samples of [`StageSummary`]'s parts, in nanoseconds.
#[derive(Debug, Default)]
pub(crate) struct Stages {
    post: Vec<u64>,
    queued: Vec<u64>,
    wire: Vec<u64>,
    device: Vec<u64>,
    wake: Vec<u64>,
}

impl Stages {
    /// Adds a batch that took `latency_ns` on the waiting thread's clock.
    pub(crate) fn add(&mut self, latency_ns: u64, t: &te::BatchTelemetry) {
        self.push(latency_ns, t.post, t.duration, [t.queued, t.wire, t.device]);
    }

    /// Adds a batch: its latency, its telemetry's `post` and `duration`, and its
    /// timed stages (queued, wire, device).
    fn push(
        &mut self,
        latency_ns: u64,
        post: Duration,
        duration: Duration,
        stages: [Option<Duration>; 3],
    ) {
        self.post.push(nanos(post));
        self.wake.push(latency_ns.saturating_sub(nanos(duration)));
        for (d, v) in stages
            .into_iter()
            .zip([&mut self.queued, &mut self.wire, &mut self.device])
        {
            if let Some(d) = d {
                v.push(nanos(d));
            }
        }
    }

    /// Keeps every other sample of each part.
    fn halve(&mut self) {
        for v in [
            &mut self.post,
            &mut self.queued,
            &mut self.wire,
            &mut self.device,
            &mut self.wake,
        ] {
            halve(v);
        }
    }

    /// Adds another thread's samples.
    pub(crate) fn extend(&mut self, o: Stages) {
        self.post.extend(o.post);
        self.queued.extend(o.queued);
        self.wire.extend(o.wire);
        self.device.extend(o.device);
        self.wake.extend(o.wake);
    }

    /// The medians.
    pub(crate) fn summary(mut self) -> StageSummary {
        let p50 = |v: &mut Vec<u64>| summarise(v).map(|s| s.p50);
        StageSummary {
            post_us_p50: p50(&mut self.post),
            queued_us_p50: p50(&mut self.queued),
            wire_us_p50: p50(&mut self.wire),
            device_us_p50: p50(&mut self.device),
            wake_us_p50: p50(&mut self.wake),
        }
    }
}

impl Record {
    /// A record of `bytes` moved in `seconds`, with latencies if measured.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn measured(
        backend: &str,
        op: te::Op,
        block_size: u64,
        batch_size: u64,
        threads: u64,
        bytes: u64,
        seconds: f64,
        lat: Option<Summary>,
    ) -> Record {
        Record {
            backend: backend.to_string(),
            op: op.to_string(),
            block_size,
            batch_size,
            threads,
            bytes: Some(bytes),
            seconds: Some(seconds),
            gb_per_s: gb_per_s(bytes, seconds),
            lat_us_avg: lat.map(|l| l.avg),
            lat_us_p50: lat.map(|l| l.p50),
            lat_us_p99: lat.map(|l| l.p99),
            lat_us_p999: lat.map(|l| l.p999),
            device_calls_per_batch: None,
            device_copies_per_batch: None,
            device_syncs_per_batch: None,
            stages: StageSummary::default(),
        }
    }

    /// The record with what the device runtimes counted over its `batches` batches.
    pub(crate) fn with_device(
        mut self,
        device: &te_core::device::CopyStats,
        batches: u64,
    ) -> Record {
        let per = |n: u64| Some(n as f64 / batches.max(1) as f64);
        self.device_calls_per_batch = per(device.calls);
        self.device_copies_per_batch = per(device.copies);
        self.device_syncs_per_batch = per(device.syncs);
        self
    }

    /// The record with the medians of where its batches' time went.
    pub(crate) fn with_stages(mut self, stages: Stages) -> Record {
        self.stages = stages.summary();
        self
    }

    /// Whether this is a baseline rather than a te measurement.
    pub(crate) fn is_baseline(&self) -> bool {
        self.backend.starts_with("baseline-")
    }
}

/// Decimal gigabytes per second, as Mooncake and NIXL report; 0 for no time.
pub(crate) fn gb_per_s(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 / seconds / 1e9
    } else {
        0.0
    }
}

/// `d` in nanoseconds, as a sample: the largest sample where it does not fit.
pub(crate) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank_in_microseconds() {
        let mut ns: Vec<u64> = (1..=1000).rev().map(|i| i * 1000).collect();
        let s = summarise(&mut ns).unwrap();
        assert_eq!(s.p50, 500.0);
        assert_eq!(s.p99, 990.0);
        assert_eq!(s.p999, 999.0);
        assert_eq!(s.avg, 500.5);
        let one = summarise(&mut [2500]).unwrap();
        assert_eq!((one.p50, one.p999), (2.5, 2.5));
        assert!(summarise(&mut []).is_none());
    }

    #[test]
    fn a_long_run_keeps_a_bounded_sample_spread_over_its_whole_time() {
        let mut s = Samples::new(64);
        let add = |s: &mut Samples, i: u64| {
            if s.keep() {
                s.latencies_ns.push(i);
                let us = Duration::from_micros(i);
                s.stages.push(i, us, us, [None; 3]);
            }
        };
        for i in 0..64 {
            add(&mut s, i);
        }
        assert_eq!(
            s.latencies_ns,
            (0..64).collect::<Vec<_>>(),
            "a short run keeps all"
        );
        for i in 64..100_000 {
            add(&mut s, i);
        }
        assert!(s.latencies_ns.len() <= 64, "{}", s.latencies_ns.len());
        assert!(s.latencies_ns.len() >= 32, "{}", s.latencies_ns.len());
        assert_eq!(s.stages.post.len(), s.latencies_ns.len());
        // Evenly spread: from the first batch to near the last, at equal steps.
        let steps: Vec<u64> = s.latencies_ns.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(s.latencies_ns[0], 0);
        assert!(steps.iter().all(|&d| d == steps[0]), "{steps:?}");
        assert!(
            *s.latencies_ns.last().unwrap() >= 100_000 - steps[0],
            "{s:?}"
        );
    }

    #[test]
    fn throughput_is_decimal_gigabytes_per_second() {
        assert_eq!(gb_per_s(3_000_000_000, 1.5), 2.0);
        assert_eq!(gb_per_s(1, 0.0), 0.0);
    }

    #[test]
    fn a_record_serialises_to_exactly_the_documented_fields() {
        let r = Record::measured("stub", te::Op::Write, 4096, 8, 1, 1 << 20, 0.5, None);
        let v = serde_json::to_value(&r).unwrap();
        let keys: Vec<_> = v.as_object().unwrap().keys().cloned().collect();
        let mut want = vec![
            "backend",
            "op",
            "block_size",
            "batch_size",
            "threads",
            "bytes",
            "seconds",
            "gb_per_s",
            "lat_us_avg",
            "lat_us_p50",
            "lat_us_p99",
            "lat_us_p999",
            "device_calls_per_batch",
            "device_copies_per_batch",
            "device_syncs_per_batch",
            "post_us_p50",
            "queued_us_p50",
            "wire_us_p50",
            "device_us_p50",
            "wake_us_p50",
        ];
        want.sort_unstable();
        let mut keys = keys;
        keys.sort_unstable();
        assert_eq!(keys, want);
        assert!(v["lat_us_p99"].is_null());
        assert!(v["device_calls_per_batch"].is_null());
        assert_eq!(v["op"], "write");
        let device = te_core::device::CopyStats {
            calls: 30,
            copies: 1280,
            syncs: 20,
            bytes: 1 << 20,
        };
        let v = serde_json::to_value(r.with_device(&device, 10)).unwrap();
        assert_eq!(v["device_calls_per_batch"], 3.0);
        assert_eq!(v["device_copies_per_batch"], 128.0);
        assert_eq!(v["device_syncs_per_batch"], 2.0);
    }

    #[test]
    fn stages_split_a_batch_by_its_telemetry_and_the_waiting_threads_clock() {
        let us = Duration::from_micros;
        let mut s = Stages::default();
        s.push(
            70_000,
            us(5),
            us(50),
            [Some(us(2)), Some(us(30)), Some(us(10))],
        );
        let mut other = Stages::default();
        other.push(20_000, us(5), us(50), [None; 3]);
        s.extend(other);
        let v = s.summary();
        assert_eq!(v.post_us_p50, Some(5.0));
        assert_eq!(v.queued_us_p50, Some(2.0));
        assert_eq!(v.wire_us_p50, Some(30.0));
        assert_eq!(v.device_us_p50, Some(10.0));
        // Nearest rank of [0, 20]: the waiting thread had one batch back 20 µs after
        // its end, the other (its clock shorter than the engine's) at once.
        assert_eq!(v.wake_us_p50, Some(0.0));
        assert_eq!(Stages::default().summary(), StageSummary::default());
    }
}
