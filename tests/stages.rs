//! What a backend times and reports of itself, through the backend interface: te-tcp
//! times a batch's wire and device stages (the handle's telemetry, the metrics' stage
//! histograms, a child span of the batch's per stage) and reports its pinned staging
//! memory (the metrics' backend gauges). Alone in its binary: it installs the
//! process's trace subscriber, since stages end on te-tcp's threads.

use std::time::Duration;

use te::{Access, Config, Engine, Metrics, TransferRequest};

/// Waits (at most 5 s) until `f` holds of `e`'s metrics.
fn eventually(e: &Engine, f: impl Fn(&Metrics) -> bool) -> Metrics {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let m = e.metrics();
        if f(&m) || std::time::Instant::now() >= deadline {
            return m;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn tcp(table: &str) -> Engine {
    let mut c = Config::from_toml(
        &format!(
            "[engine]\nbackend = \"tcp\"\nmetrics_listen = \"127.0.0.1:0\"\n[backends.tcp]\n{table}"
        ),
        "metrics test",
        std::path::Path::new("."),
    )
    .unwrap();
    c.engine.default_timeout = Duration::from_secs(10);
    Engine::from_config(&c).unwrap()
}

/// A span as the subscriber saw it open: its name, `duration_us` and `stage`.
type Seen = (String, Option<u64>, Option<String>);

/// The spans a subscriber saw open.
#[derive(Clone, Default)]
struct Spans(std::sync::Arc<std::sync::Mutex<Vec<Seen>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Spans {
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        struct Fields(Option<u64>, Option<String>);
        impl tracing::field::Visit for Fields {
            fn record_u64(&mut self, f: &tracing::field::Field, v: u64) {
                if f.name() == "duration_us" {
                    self.0 = Some(v);
                }
            }
            fn record_str(&mut self, f: &tracing::field::Field, v: &str) {
                if f.name() == "stage" {
                    self.1 = Some(v.to_string());
                }
            }
            fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
        }
        let mut fields = Fields(None, None);
        attrs.record(&mut fields);
        let name = attrs.metadata().name().to_string();
        self.0.lock().unwrap().push((name, fields.0, fields.1));
    }
}

#[test]
fn a_backend_times_its_stages_and_reports_its_staging_memory() {
    use tracing_subscriber::layer::SubscriberExt;
    let spans = Spans::default();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_subscriber::filter::LevelFilter::DEBUG)
        .with(spans.clone());
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
    let target = tcp("");
    let dev: te::MemoryKind = "fakedev:0".parse().unwrap();
    let dst = target
        .alloc_on(&dev, "dst", 1 << 20, Access::REMOTE_READ_WRITE)
        .unwrap();
    // Staged over the socket, not copied device to device in this process.
    let me = tcp("local_copies = false");
    let host = me.alloc("host", 1 << 20, Access::LOCAL).unwrap();
    let src = me.alloc_on(&dev, "src", 1 << 20, Access::LOCAL).unwrap();
    let peer = me.connect(&target.address().to_string()).unwrap();
    let rid = peer.region("dst").unwrap().id;
    // Host memory: on the wire only.
    let h = me
        .transfer(
            &peer,
            &[TransferRequest::write(host.id(), 0, rid, 0, 1 << 20)],
        )
        .unwrap();
    h.wait().unwrap();
    let t = h.telemetry().expect("ended");
    let wire = t.wire.expect("te-tcp times the wire");
    assert!(wire > Duration::ZERO && wire <= t.duration, "{t:?}");
    assert!(t.queued.is_some() && t.device.is_none(), "{t:?}");
    // Device memory, staged through pinned host memory: device copies too.
    let h = me
        .transfer(
            &peer,
            &[TransferRequest::write(src.id(), 0, rid, 0, 1 << 20)],
        )
        .unwrap();
    h.wait().unwrap();
    let t = h.telemetry().expect("ended");
    let (wire, device) = (t.wire.expect("wire"), t.device.expect("device copies"));
    assert!(wire <= t.duration && device <= t.duration, "{t:?}");
    let m = me.metrics();
    let stage = |name: &str| {
        m.stages
            .iter()
            .find(|(s, _)| s == name)
            .map(|(_, h)| h.count)
    };
    assert_eq!(stage("queued"), Some(2), "{:?}", m.stages);
    assert_eq!(stage("wire"), Some(2), "{:?}", m.stages);
    assert_eq!(stage("device"), Some(1), "{:?}", m.stages);
    let gauge =
        |m: &Metrics, name: &str| m.backend.iter().find(|(n, _)| n == name).map(|(_, v)| *v);
    assert!(
        gauge(&m, "staging_bytes_pinned").is_some_and(|v| v > 0),
        "{:?}",
        m.backend
    );
    // The staging memory is back once the batches ended (the target's answer may
    // still hold a buffer for a moment).
    let m = eventually(&me, |m| gauge(m, "staging_bytes_in_use") == Some(0));
    assert_eq!(
        gauge(&m, "staging_bytes_in_use"),
        Some(0),
        "{:?}",
        m.backend
    );
    let m = eventually(&target, |m| gauge(m, "staging_bytes_in_use") == Some(0));
    assert_eq!(
        gauge(&m, "staging_bytes_in_use"),
        Some(0),
        "{:?}",
        m.backend
    );
    // The endpoint exports both.
    let mut scrape = std::net::TcpStream::connect(me.metrics_address().unwrap()).unwrap();
    std::io::Write::write_all(&mut scrape, b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
    let mut text = String::new();
    std::io::Read::read_to_string(&mut scrape, &mut text).unwrap();
    for line in [
        "te_batch_stage_seconds_count{stage=\"wire\"} 2",
        "te_batch_stage_seconds_count{stage=\"device\"} 1",
        "te_backend_staging_bytes_in_use 0",
        "# TYPE te_backend_staging_bytes_pinned gauge",
    ] {
        assert!(text.contains(line), "missing `{line}` in {text}");
    }
    // Each stage was a child span of its batch's, carrying its duration.
    let seen = spans.0.lock().unwrap().clone();
    let stages: Vec<_> = seen.iter().filter(|s| s.0 == "stage").collect();
    assert!(
        stages
            .iter()
            .any(|s| s.2.as_deref() == Some("wire") && s.1.is_some()),
        "{seen:?}"
    );
    assert!(
        stages.iter().any(|s| s.2.as_deref() == Some("device")),
        "{seen:?}"
    );
    assert_eq!(
        seen.iter().filter(|s| s.0 == "batch").count(),
        2,
        "{seen:?}"
    );
    drop((dst, host, src));
}
