//! The optional metrics endpoint (`[engine] metrics_listen`): `GET /metrics` answers
//! the engine's [`Metrics`] in the OpenMetrics text format, encoded by the Prometheus
//! project's `prometheus-client` crate.
//!
//! It runs on a thread of its own with a small event-driven runtime, and expects
//! hostile peers like every listener of te: a request must arrive whole, at most
//! [`MAX_REQUEST`] bytes, within [`REQUEST_TIMEOUT`]; at most [`MAX_PENDING`]
//! connections wait for theirs, and a new one closes the oldest
//! ([`PendingSlots`](crate::kit::net::PendingSlots)), so idle sockets cannot keep a scraper
//! out; anything but `GET /metrics` is answered with an error status and closed.

use crate::signals::SpawnMasked as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::error::{Error, Result};
use crate::kit::net::PendingSlots;
use crate::metrics::{Histogram, Metrics};

/// The longest request head accepted.
const MAX_REQUEST: usize = 8 << 10;
/// How long a connection may take to send its request, and to take the answer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// Connections waiting for their request, at most; a new one closes the oldest.
const MAX_PENDING: usize = 64;

/// What the endpoint answers with: the engine's metrics, `None` once it is gone.
pub(super) type Snapshot = Arc<dyn Fn() -> Option<Metrics> + Send + Sync>;

/// The running endpoint; stopped (and its thread joined) when dropped.
pub(super) struct Exporter {
    address: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Exporter {
    /// Listens on `listen` and serves `snapshot`.
    ///
    /// # Errors
    /// `Io` if the address cannot be bound or the thread cannot start.
    pub(super) fn start(listen: &str, snapshot: Snapshot) -> Result<Exporter> {
        // Nobody is told this address, so unlike the other listeners it needs no
        // advertised one: bound as given.
        let listener = std::net::TcpListener::bind(listen).map_err(|e| {
            Error::io(
                "start metrics endpoint",
                format!("cannot listen on {listen}"),
                e,
            )
        })?;
        let address = listener
            .local_addr()
            .map_err(|e| Error::io("start metrics endpoint", "the listener has no address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("start metrics endpoint", "cannot configure the listener", e))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            // Blocking threads take none of the process's signals (`kit::thread`).
            .on_thread_start(crate::signals::mask_signals)
            .build()
            .map_err(|e| Error::io("start metrics endpoint", "cannot build its runtime", e))?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("te-metrics".into())
            .spawn_masked(move || {
                rt.block_on(async move {
                    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                        return;
                    };
                    tokio::select! {
                        () = accept_loop(listener, snapshot) => {}
                        _ = stopped => {}
                    }
                });
            })
            .map_err(|e| Error::io("start metrics endpoint", "cannot spawn its thread", e))?;
        tracing::info!(%address, "metrics endpoint listening");
        Ok(Exporter {
            address,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Where it listens.
    pub(super) fn address(&self) -> SocketAddr {
        self.address
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

async fn accept_loop(listener: tokio::net::TcpListener, snapshot: Snapshot) {
    let pending = Arc::new(PendingSlots::default());
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let slot = pending.admit(peer.ip(), MAX_PENDING, MAX_PENDING);
                let snapshot = snapshot.clone();
                tokio::spawn(async move {
                    tokio::select! {
                        () = serve(stream, snapshot) => {}
                        () = slot.evicted() => {}
                    }
                });
            }
            Err(e) => {
                // Out of descriptors, most likely: the oldest waiting connection goes,
                // and the loop pauses instead of spinning.
                tracing::debug!(error = %e, "metrics endpoint: accept failed");
                pending.evict_oldest();
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Reads one request and answers it, all within [`REQUEST_TIMEOUT`] each way.
async fn serve(mut stream: tokio::net::TcpStream, snapshot: Snapshot) {
    let head = tokio::time::timeout(REQUEST_TIMEOUT, read_head(&mut stream)).await;
    let (status, body) = match head {
        Err(_) => return,
        Ok(Err(status)) => (status, String::new()),
        Ok(Ok(head)) => answer(&head, &snapshot),
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/openmetrics-text; version=1.0.0; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(REQUEST_TIMEOUT, stream.write_all(reply.as_bytes())).await;
}

/// The request head (up to the blank line), or the status refusing it.
async fn read_head(
    stream: &mut tokio::net::TcpStream,
) -> std::result::Result<String, &'static str> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let n = stream
            .read(&mut chunk)
            .await
            .map_err(|_| "400 Bad Request")?;
        if n == 0 {
            return Err("400 Bad Request");
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            buf.truncate(end);
            return String::from_utf8(buf).map_err(|_| "400 Bad Request");
        }
        if buf.len() > MAX_REQUEST {
            return Err("431 Request Header Fields Too Large");
        }
    }
}

fn answer(head: &str, snapshot: &Snapshot) -> (&'static str, String) {
    let line = head.lines().next().unwrap_or("");
    let mut parts = line.split(' ');
    match (parts.next(), parts.next()) {
        (Some("GET"), Some("/metrics")) => match snapshot() {
            Some(m) => ("200 OK", encode(&m)),
            None => ("503 Service Unavailable", String::new()),
        },
        (Some("GET"), Some(_)) => ("404 Not Found", String::new()),
        _ => ("405 Method Not Allowed", String::new()),
    }
}

/// Histograms already counted (te's own buckets), for the encoder: one, or one per
/// value of a label (`stage`).
#[derive(Debug)]
enum Buckets {
    One(Histogram),
    ByLabel(&'static str, Vec<(String, Histogram)>),
}

fn encode_histogram(
    h: &Histogram,
    encoder: &mut MetricEncoder,
) -> std::result::Result<(), std::fmt::Error> {
    let bounds = h
        .bounds_us
        .iter()
        .map(|b| *b as f64 / 1e6)
        .chain([f64::INFINITY]);
    let buckets: Vec<(f64, u64)> = bounds.zip(h.counts.iter().copied()).collect();
    encoder.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
        h.sum_us as f64 / 1e6,
        h.count,
        &buckets,
        None,
    )
}

impl TypedMetric for Buckets {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Buckets {
    fn encode(&self, mut encoder: MetricEncoder) -> std::result::Result<(), std::fmt::Error> {
        match self {
            Buckets::One(h) => encode_histogram(h, &mut encoder),
            Buckets::ByLabel(key, hs) => {
                for (value, h) in hs {
                    let l = labels(&[(key, value)]);
                    encode_histogram(h, &mut encoder.encode_family(&l)?)?;
                }
                Ok(())
            }
        }
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

type Labels = Vec<(String, String)>;

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn counter(value: u64) -> Counter<u64> {
    let c = Counter::default();
    c.inc_by(value);
    c
}

fn gauge(value: u64) -> Gauge<i64> {
    let g = Gauge::default();
    g.set(i64::try_from(value).unwrap_or(i64::MAX));
    g
}

/// The snapshot in the OpenMetrics text format; every name is prefixed `te_`, and a
/// metric with labels is one family (one `# TYPE` line) with a sample per label set.
pub(crate) fn encode(m: &Metrics) -> String {
    let mut r = Registry::with_prefix("te");
    r.register(
        "batches_submitted",
        "Batches submitted",
        counter(m.batches_submitted),
    );
    r.register(
        "batches_completed",
        "Batches completed",
        counter(m.batches_completed),
    );
    let failed = Family::<Labels, Counter<u64>>::default();
    for (kind, n) in &m.batches_failed {
        failed.get_or_create(&labels(&[("kind", kind)])).inc_by(*n);
    }
    r.register("batches_failed", "Batches failed, by error kind", failed);
    r.register(
        "batches_in_flight",
        "Batches submitted and not yet ended",
        gauge(m.batches_in_flight),
    );
    r.register(
        "bytes_in_flight",
        "Bytes of the batches in flight",
        gauge(m.bytes_in_flight),
    );
    let (bytes, requests) = (
        Family::<Labels, Counter<u64>>::default(),
        Family::<Labels, Counter<u64>>::default(),
    );
    for (op, b, n) in [
        ("write", m.bytes_written, m.requests_written),
        ("read", m.bytes_read, m.requests_read),
    ] {
        bytes.get_or_create(&labels(&[("op", op)])).inc_by(b);
        requests.get_or_create(&labels(&[("op", op)])).inc_by(n);
    }
    r.register("bytes", "Bytes moved by completed batches", bytes);
    r.register("requests", "Requests of completed batches", requests);
    r.register(
        "batch_latency_seconds",
        "Completed batches, submission to end",
        Buckets::One(m.latency.clone()),
    );
    r.register(
        "batch_stage_seconds",
        "Completed batches' time queued, on the wire and in device copies, where their backend times it",
        Buckets::ByLabel("stage", m.stages.clone()),
    );
    for (name, value) in &m.backend {
        // A backend names its gauges; only names Prometheus accepts are exported.
        if !name.is_empty() && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') {
            r.register(
                format!("backend_{name}"),
                format!("The backend's {}", name.replace('_', " ")),
                gauge(*value),
            );
        }
    }
    let (count, size) = (
        Family::<Labels, Gauge<i64>>::default(),
        Family::<Labels, Gauge<i64>>::default(),
    );
    for reg in &m.registrations {
        let l = labels(&[("memory", &reg.kind)]);
        count
            .get_or_create(&l)
            .set(i64::try_from(reg.count).unwrap_or(i64::MAX));
        size.get_or_create(&l)
            .set(i64::try_from(reg.bytes).unwrap_or(i64::MAX));
    }
    r.register("registrations", "Registrations live, by memory kind", count);
    r.register("registered_bytes", "Registered bytes, by memory kind", size);
    r.register(
        "notifications_sent",
        "Notifications sent and accepted",
        counter(m.notifications_sent),
    );
    r.register(
        "notifications_received",
        "Notifications received and kept",
        counter(m.notifications_received),
    );
    r.register(
        "notifications_refused",
        "Notifications refused",
        counter(m.notifications_refused),
    );
    let (done, failed, moved) = (
        Family::<Labels, Counter<u64>>::default(),
        Family::<Labels, Counter<u64>>::default(),
        Family::<Labels, Counter<u64>>::default(),
    );
    for p in &m.peers {
        let who = [("peer", p.address.as_str()), ("peer_name", p.name.as_str())];
        done.get_or_create(&labels(&who))
            .inc_by(p.batches_completed);
        failed.get_or_create(&labels(&who)).inc_by(p.batches_failed);
        for (op, b) in [("write", p.bytes_written), ("read", p.bytes_read)] {
            let l = labels(&[who[0], who[1], ("op", op)]);
            moved.get_or_create(&l).inc_by(b);
        }
    }
    r.register(
        "peers_connected",
        "Peer engines with a session up",
        gauge(m.peers_connected),
    );
    let events = Family::<Labels, Counter<u64>>::default();
    for (kind, n) in [
        ("lost", m.peers_lost),
        ("restarted", m.peers_restarted),
        ("left", m.peers_left),
    ] {
        events.get_or_create(&labels(&[("kind", kind)])).inc_by(n);
    }
    r.register(
        "peer_events",
        "Peers lost, restarted or gone, by kind",
        events,
    );
    let refused = Family::<Labels, Counter<u64>>::default();
    for (reason, n) in &m.control_refusals {
        refused
            .get_or_create(&labels(&[("reason", reason)]))
            .inc_by(*n);
    }
    r.register(
        "control_refusals",
        "Control-plane connections refused, by reason",
        refused,
    );
    r.register(
        "control_request_bytes",
        "Bytes of peers' backend requests read and not yet answered",
        gauge(m.control_request_bytes),
    );
    r.register(
        "peer_batches_completed",
        "Batches to a peer completed",
        done,
    );
    r.register("peer_batches_failed", "Batches to a peer failed", failed);
    r.register(
        "peer_bytes",
        "Bytes moved with a peer by completed batches",
        moved,
    );
    let mut out = String::new();
    let _ = prometheus_client::encoding::text::encode(&mut out, &r);
    out
}
