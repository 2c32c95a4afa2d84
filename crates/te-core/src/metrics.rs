//! What an engine has done, counted as it happens: batches and their outcomes, bytes
//! and requests per direction and per peer, batch latency, registrations and
//! notifications. The data path only adds to atomic counters (no lock, no
//! allocation per request); [`Metrics`] is a snapshot taken when asked.
//!
//! docs/metrics.md lists every field; a test holds it to this file.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};

use crate::backend::{BatchStage, Signals};
use crate::error::{ErrorKind, Result};
use crate::request::{Op, TransferRequest};
use crate::sync::Mutex;

/// Upper bounds (µs) of the latency histogram's buckets; one more counts the rest.
pub(crate) const LATENCY_BOUNDS_US: [u64; 16] = [
    10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000,
    1_000_000, 10_000_000,
];

/// The stages of a batch the metrics count: `queued` (from the backend having taken it
/// until its first byte went out) and the backend's own ([`BatchStage`]), in order.
pub(crate) const STAGES: [&str; 3] = ["queued", "wire", "device"];

/// Error kinds by code, for the per-kind failure counters (codes are small).
const KINDS: usize = 32;

/// A histogram of durations in fixed buckets.
#[derive(Default)]
pub(crate) struct Hist {
    counts: [AtomicU64; LATENCY_BOUNDS_US.len() + 1],
    sum_us: AtomicU64,
}

impl Hist {
    fn record(&self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let i = LATENCY_BOUNDS_US.partition_point(|b| *b < us);
        self.counts[i].fetch_add(1, Relaxed);
        self.sum_us.fetch_add(us, Relaxed);
    }

    fn snapshot(&self) -> Histogram {
        let counts: Vec<u64> = self.counts.iter().map(|c| c.load(Relaxed)).collect();
        Histogram {
            bounds_us: LATENCY_BOUNDS_US.to_vec(),
            count: counts.iter().sum(),
            counts,
            sum_us: self.sum_us.load(Relaxed),
        }
    }
}

/// An engine's counters.
#[derive(Default)]
pub(crate) struct Counters {
    submitted: AtomicU64,
    completed: AtomicU64,
    failed: [AtomicU64; KINDS],
    in_flight: AtomicU64,
    in_flight_bytes: AtomicU64,
    bytes: [AtomicU64; 2],
    requests: [AtomicU64; 2],
    latency: Hist,
    /// Per stage ([`STAGES`]), the time completed batches spent in it.
    stages: [Hist; 3],
    pub(crate) notifications_sent: AtomicU64,
    pub(crate) notifications_received: AtomicU64,
    pub(crate) notifications_refused: AtomicU64,
    /// Per memory kind: registrations and their bytes.
    registered: Mutex<BTreeMap<String, (u64, u64)>>,
}

/// A peer's counters, kept with the engine's handle on it.
#[derive(Default)]
pub(crate) struct PeerCounters {
    bytes: [AtomicU64; 2],
    requests: [AtomicU64; 2],
    completed: AtomicU64,
    failed: AtomicU64,
}

fn dir(op: Op) -> usize {
    match op {
        Op::Write => 0,
        Op::Read => 1,
    }
}

impl Counters {
    /// A region of `kind` and `len` bytes was registered (`added`) or released.
    pub(crate) fn registered(&self, kind: &str, len: u64, added: bool) {
        let mut r = self.registered.lock();
        let e = r.entry(kind.to_string()).or_insert((0, 0));
        if added {
            *e = (e.0 + 1, e.1 + len);
        } else {
            *e = (e.0.saturating_sub(1), e.1.saturating_sub(len));
        }
    }

    /// The snapshot of these counters, with `peers` as the engine has them.
    pub(crate) fn snapshot(&self, peers: Vec<PeerMetrics>) -> Metrics {
        let failed = self
            .failed
            .iter()
            .enumerate()
            .filter_map(|(code, n)| {
                let n = n.load(Relaxed);
                (n > 0).then(|| (ErrorKind::from_code(code as u32).as_str().to_string(), n))
            })
            .collect();
        Metrics {
            batches_submitted: self.submitted.load(Relaxed),
            batches_completed: self.completed.load(Relaxed),
            batches_failed: failed,
            batches_in_flight: self.in_flight.load(Relaxed),
            bytes_in_flight: self.in_flight_bytes.load(Relaxed),
            bytes_written: self.bytes[0].load(Relaxed),
            bytes_read: self.bytes[1].load(Relaxed),
            requests_written: self.requests[0].load(Relaxed),
            requests_read: self.requests[1].load(Relaxed),
            latency: self.latency.snapshot(),
            stages: STAGES
                .iter()
                .zip(&self.stages)
                .map(|(s, h)| (s.to_string(), h.snapshot()))
                .collect(),
            registrations: self
                .registered
                .lock()
                .iter()
                .map(|(kind, (count, bytes))| RegisteredMemory {
                    kind: kind.clone(),
                    count: *count,
                    bytes: *bytes,
                })
                .collect(),
            notifications_sent: self.notifications_sent.load(Relaxed),
            notifications_received: self.notifications_received.load(Relaxed),
            notifications_refused: self.notifications_refused.load(Relaxed),
            peers,
            ..Metrics::default()
        }
    }
}

impl PeerCounters {
    /// The snapshot of one peer's counters.
    pub(crate) fn snapshot(&self, address: &str, name: &str) -> PeerMetrics {
        PeerMetrics {
            address: address.to_string(),
            name: name.to_string(),
            bytes_written: self.bytes[0].load(Relaxed),
            bytes_read: self.bytes[1].load(Relaxed),
            requests_written: self.requests[0].load(Relaxed),
            requests_read: self.requests[1].load(Relaxed),
            batches_completed: self.completed.load(Relaxed),
            batches_failed: self.failed.load(Relaxed),
        }
    }
}

/// Why the control plane refused a connection, as counted.
pub(crate) const REFUSALS: [&str; 6] = [
    "auth", "protocol", "limits", "deadline", "closed", "evicted",
];

/// The control plane's counters: peers and refusals.
#[derive(Default)]
pub(crate) struct ControlCounters {
    /// Peer lives with a session or connection up now.
    pub(crate) peers: AtomicU64,
    pub(crate) lost: AtomicU64,
    pub(crate) restarted: AtomicU64,
    pub(crate) left: AtomicU64,
    refused: [AtomicU64; REFUSALS.len()],
    /// Bytes of peers' backend requests read and not yet answered.
    pub(crate) request_bytes: AtomicU64,
}

impl ControlCounters {
    /// A connection refused before it became a session, for `error` (`None`: evicted
    /// to make room).
    pub(crate) fn refused(&self, error: Option<&crate::error::Error>) {
        let reason = match error.map(crate::error::Error::kind) {
            None => "evicted",
            Some(ErrorKind::Unauthorized) => "auth",
            Some(ErrorKind::Busy) => "limits",
            Some(ErrorKind::Timeout) => "deadline",
            Some(ErrorKind::PeerUnreachable | ErrorKind::Io) => "closed",
            Some(_) => "protocol",
        };
        if let Some(i) = REFUSALS.iter().position(|r| *r == reason) {
            self.refused[i].fetch_add(1, Relaxed);
        }
    }

    /// Writes these counters into `m`.
    pub(crate) fn fill(&self, m: &mut Metrics) {
        m.peers_connected = self.peers.load(Relaxed);
        m.peers_lost = self.lost.load(Relaxed);
        m.peers_restarted = self.restarted.load(Relaxed);
        m.peers_left = self.left.load(Relaxed);
        m.control_request_bytes = self.request_bytes.load(Relaxed);
        m.control_refusals = REFUSALS
            .iter()
            .zip(&self.refused)
            .map(|(r, n)| (r.to_string(), n.load(Relaxed)))
            .filter(|(_, n)| *n > 0)
            .collect();
    }
}

/// One batch's measure: what it moves, when it started, when the backend took it and
/// when it ended; counted into the engine's and its peer's counters once, at its end.
pub(crate) struct BatchMeter {
    engine: Arc<Counters>,
    peer: Arc<PeerCounters>,
    /// Bytes and requests per direction.
    bytes: [u64; 2],
    requests: [u64; 2],
    started: Instant,
    /// `started` on the monotonic clock the backends time stages with.
    started_ns: u64,
    started_at: SystemTime,
    posted: OnceLock<Duration>,
    ended: OnceLock<Duration>,
    /// The stages the backend timed, as offsets from `started` and durations.
    stages: OnceLock<Vec<(BatchStage, Duration, Duration)>>,
    /// The batch's trace span (disabled, and free, unless a subscriber wants it).
    span: tracing::Span,
}

impl BatchMeter {
    /// Starts measuring a batch of `requests` to a peer.
    pub(crate) fn start(
        engine: Arc<Counters>,
        peer: Arc<PeerCounters>,
        requests: &[TransferRequest],
        span: tracing::Span,
    ) -> BatchMeter {
        let (mut bytes, mut count) = ([0u64; 2], [0u64; 2]);
        for r in requests {
            bytes[dir(r.op)] += r.len;
            count[dir(r.op)] += 1;
        }
        engine.submitted.fetch_add(1, Relaxed);
        engine.in_flight.fetch_add(1, Relaxed);
        engine
            .in_flight_bytes
            .fetch_add(bytes[0] + bytes[1], Relaxed);
        BatchMeter {
            engine,
            peer,
            bytes,
            requests: count,
            started: Instant::now(),
            started_ns: crate::time::monotonic_ns(),
            started_at: SystemTime::now(),
            posted: OnceLock::new(),
            ended: OnceLock::new(),
            stages: OnceLock::new(),
            span,
        }
    }

    /// The batch's trace span, for what runs on its behalf.
    pub(crate) fn span(&self) -> &tracing::Span {
        &self.span
    }

    /// The backend has taken the batch.
    pub(crate) fn posted(&self) {
        let _ = self.posted.set(self.started.elapsed());
    }

    /// The batch ended with `result`, the backend having timed its stages in
    /// `signals`; counted once.
    pub(crate) fn end(&self, result: &Result<()>, signals: &Signals) {
        let took = self.started.elapsed();
        if self.ended.set(took).is_err() {
            return;
        }
        let ns = Duration::from_nanos;
        let stages: Vec<_> = signals
            .stages()
            .map(|(s, first, last)| {
                (
                    s,
                    ns(first.saturating_sub(self.started_ns)),
                    ns(last - first),
                )
            })
            .collect();
        // Each stage is a child span of the batch's, carrying its own times (tracing
        // opens spans now, not in the past, so the times are fields).
        for (s, at, took) in &stages {
            let _ = tracing::debug_span!(
                parent: &self.span,
                "stage",
                stage = s.name(),
                start_us = at.as_micros() as u64,
                duration_us = took.as_micros() as u64,
            );
        }
        let _ = self.stages.set(stages);
        self.span.in_scope(|| match result {
            Ok(()) => tracing::debug!(duration_us = took.as_micros() as u64, "batch completed"),
            Err(e) => {
                tracing::debug!(duration_us = took.as_micros() as u64, error = %e, "batch failed")
            }
        });
        let (e, p) = (&self.engine, &self.peer);
        e.in_flight.fetch_sub(1, Relaxed);
        e.in_flight_bytes
            .fetch_sub(self.bytes[0] + self.bytes[1], Relaxed);
        match result {
            Ok(()) => {
                e.completed.fetch_add(1, Relaxed);
                p.completed.fetch_add(1, Relaxed);
                for d in 0..2 {
                    e.bytes[d].fetch_add(self.bytes[d], Relaxed);
                    e.requests[d].fetch_add(self.requests[d], Relaxed);
                    p.bytes[d].fetch_add(self.bytes[d], Relaxed);
                    p.requests[d].fetch_add(self.requests[d], Relaxed);
                }
                e.latency.record(took);
                if let Some(t) = self.telemetry() {
                    for (h, took) in e.stages.iter().zip([t.queued, t.wire, t.device]) {
                        if let Some(took) = took {
                            h.record(took);
                        }
                    }
                }
            }
            Err(err) => {
                let code = (err.kind().code() as usize).min(KINDS - 1);
                e.failed[code].fetch_add(1, Relaxed);
                p.failed.fetch_add(1, Relaxed);
            }
        }
    }

    /// What the batch did, once it has ended.
    pub(crate) fn telemetry(&self) -> Option<BatchTelemetry> {
        let ended = *self.ended.get()?;
        let post = self.posted.get().copied().unwrap_or(Duration::ZERO);
        let stage = |want: BatchStage| {
            self.stages
                .get()
                .and_then(|v| v.iter().find(|(s, _, _)| *s == want))
                .map(|(_, at, took)| (*at, *took))
        };
        let wire = stage(BatchStage::Wire);
        Some(BatchTelemetry {
            requests: self.requests[0] + self.requests[1],
            bytes: self.bytes[0] + self.bytes[1],
            started_at: self.started_at,
            post,
            duration: ended,
            queued: wire.map(|(at, _)| at.saturating_sub(post)),
            wire: wire.map(|(_, took)| took),
            device: stage(BatchStage::Device).map(|(_, took)| took),
        })
    }
}

/// What one batch did, from [`TransferHandle::telemetry`](crate::TransferHandle::telemetry)
/// once it has ended: the numbers a connector logs per request (and NIXL's
/// `get_xfer_telemetry` returns).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchTelemetry {
    /// Requests in the batch.
    pub requests: u64,
    /// Bytes the batch moves (both directions).
    pub bytes: u64,
    /// When it was submitted (wall clock, for logs).
    pub started_at: SystemTime,
    /// From submission until the backend had taken it (checks, pins, posting).
    pub post: Duration,
    /// From submission until it ended (its notification delivered, if it had one).
    pub duration: Duration,
    /// From the backend having taken it until its first byte went on the fabric, where
    /// the backend times the wire ([`BatchStage::Wire`]).
    pub queued: Option<Duration>,
    /// On the fabric: first byte sent until the last answer, where the backend times it.
    pub wire: Option<Duration>,
    /// Device copies: first submitted until the last completed, where the backend
    /// times them ([`BatchStage::Device`]).
    pub device: Option<Duration>,
}

/// A snapshot of an engine's counters, from [`Engine::metrics`](crate::Engine::metrics).
/// Counts are since the engine started; bytes and requests count completed batches.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Metrics {
    /// Batches submitted (notifications sent alone included).
    pub batches_submitted: u64,
    /// Batches that completed.
    pub batches_completed: u64,
    /// Batches that failed, by error kind (`Timeout` for deadlines, `Cancelled` for
    /// cancellations), only kinds that occurred.
    pub batches_failed: Vec<(String, u64)>,
    /// Batches submitted and not yet ended.
    pub batches_in_flight: u64,
    /// Bytes of the batches in flight.
    pub bytes_in_flight: u64,
    /// Bytes written to peers by completed batches.
    pub bytes_written: u64,
    /// Bytes read from peers by completed batches.
    pub bytes_read: u64,
    /// WRITE requests of completed batches.
    pub requests_written: u64,
    /// READ requests of completed batches.
    pub requests_read: u64,
    /// Latency of completed batches, submission to end.
    pub latency: Histogram,
    /// Per backend stage (`wire`, `device`), the time completed batches spent in it,
    /// where the backend times it.
    pub stages: Vec<(String, Histogram)>,
    /// Gauges the backend reports of itself (te-tcp: `staging_bytes_in_use`).
    pub backend: Vec<(String, u64)>,
    /// Registered memory by kind (`host`, `cuda:0`, …).
    pub registrations: Vec<RegisteredMemory>,
    /// Notifications this engine sent that the peer accepted.
    pub notifications_sent: u64,
    /// Notifications this engine received and kept.
    pub notifications_received: u64,
    /// Notifications this engine refused (inbox full, wrong epoch, too large).
    pub notifications_refused: u64,
    /// Per connected peer.
    pub peers: Vec<PeerMetrics>,
    /// Peer engines with a control-plane session or connection up now.
    pub peers_connected: u64,
    /// Peers lost: a session broke without a goodbye, or went silent.
    pub peers_lost: u64,
    /// Peers that came back with a new epoch (restarted).
    pub peers_restarted: u64,
    /// Peers that said goodbye.
    pub peers_left: u64,
    /// Control-plane connections refused before they became sessions, by reason
    /// (`auth`, `protocol`, `limits`, `deadline`, `closed`, `evicted`), only reasons that
    /// occurred.
    pub control_refusals: Vec<(String, u64)>,
    /// Bytes of peers' backend requests the control plane holds now: read and not yet
    /// answered (at most 4 MiB per source address).
    pub control_request_bytes: u64,
}

/// Durations in fixed buckets.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Histogram {
    /// Upper bound of each bucket but the last, in µs.
    pub bounds_us: Vec<u64>,
    /// Count in each bucket (not cumulative): `counts[i]` counts durations up to
    /// `bounds_us[i]` and above the previous bound; the last counts the rest.
    pub counts: Vec<u64>,
    /// Sum of all durations counted, in µs.
    pub sum_us: u64,
    /// Durations counted.
    pub count: u64,
}

/// Registered memory of one kind.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RegisteredMemory {
    /// The memory kind (`host`, `cuda:0`, …).
    pub kind: String,
    /// Registrations live.
    pub count: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// One peer's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PeerMetrics {
    /// The peer's control-plane address.
    pub address: String,
    /// The peer engine's name.
    pub name: String,
    /// Bytes written to it by completed batches.
    pub bytes_written: u64,
    /// Bytes read from it by completed batches.
    pub bytes_read: u64,
    /// WRITE requests of completed batches.
    pub requests_written: u64,
    /// READ requests of completed batches.
    pub requests_read: u64,
    /// Batches to it that completed.
    pub batches_completed: u64,
    /// Batches to it that failed.
    pub batches_failed: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_fall_in_the_bucket_of_their_upper_bound() {
        let h = Hist::default();
        for us in [5, 10, 11, 999_999, 20_000_000] {
            h.record(Duration::from_micros(us));
        }
        let s = h.snapshot();
        assert_eq!((s.counts[0], s.counts[1]), (2, 1));
        assert_eq!(s.counts[LATENCY_BOUNDS_US.len() - 2], 1);
        assert_eq!(s.counts[LATENCY_BOUNDS_US.len()], 1);
        assert_eq!(s.count, 5);
        assert_eq!(s.sum_us, 5 + 10 + 11 + 999_999 + 20_000_000);
    }
}
