//! A real Prometheus server (Debian's `prometheus`, started by the test on loopback
//! with a scrape config of its own) scrapes an engine's metrics endpoint, and its query
//! API then answers te's counters: the endpoint speaks what the scrapers of the
//! operators who run te speak, not only what te's own tests parse.
//!
//! Skipped, saying so, where `prometheus` is not installed; `TE_REQUIRE=prometheus`
//! (set by scripts/test.sh, which installs it) makes that a failure.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use te::{Access, Config, Engine, TransferRequest};

/// A Prometheus server in a directory of its own, killed when dropped.
struct Prometheus {
    child: Child,
    dir: PathBuf,
    addr: String,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts Prometheus scraping `target` (HOST:PORT) every second; `None` (skipped) where
/// it is not installed.
fn prometheus(target: &str) -> Option<Prometheus> {
    let binary = ["/usr/bin/prometheus", "/usr/local/bin/prometheus"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists());
    let Some(binary) = binary else {
        te_core::require::skip("prometheus", "no prometheus (apt-get install prometheus)");
        return None;
    };
    let dir = std::env::temp_dir().join(format!("te-prometheus-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - job_name: te\n    static_configs:\n      - targets: ['{target}']\n"
        ),
    )
    .unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    let child = Command::new(binary)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address={addr}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start prometheus");
    Some(Prometheus { child, dir, addr })
}

/// GETs `path` from `addr`; the body, or `None` if the server does not answer.
fn get(addr: &str, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    out.split_once("\r\n\r\n").map(|(_, body)| body.to_string())
}

/// What Prometheus answers for the instant query `query` (its JSON), once a result
/// holding `want` comes, or the last answer at the time limit.
fn query_until(p: &Prometheus, query: &str, want: &str, limit: Duration) -> String {
    let end = Instant::now() + limit;
    let mut last = String::new();
    while Instant::now() < end {
        if let Some(body) = get(&p.addr, &format!("/api/v1/query?query={query}")) {
            if body.contains(want) {
                return body;
            }
            last = body;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    last
}

#[test]
fn a_prometheus_server_scrapes_the_endpoint_and_answers_tes_counters() {
    let target = Engine::from_config(&Config::defaults()).unwrap();
    let _dst = target
        .alloc("dst", 64 << 10, Access::REMOTE_READ_WRITE)
        .unwrap();
    let mut c = Config::defaults();
    c.engine.metrics_listen = Some("127.0.0.1:0".into());
    let me = Engine::from_config(&c).unwrap();
    let endpoint = me.metrics_address().expect("the endpoint runs").to_string();
    let src = me.alloc("src", 64 << 10, Access::LOCAL).unwrap();
    let peer = me.connect(&target.address().to_string()).unwrap();
    let rid = peer.region("dst").unwrap().id;
    for _ in 0..3 {
        me.transfer(
            &peer,
            &[TransferRequest::write(src.id(), 0, rid, 0, 64 << 10)],
        )
        .unwrap()
        .wait()
        .unwrap();
    }
    let Some(p) = prometheus(&endpoint) else {
        return;
    };
    // The scrape itself succeeded (`up` is 1), and the counters arrived with their
    // values and labels.
    let up = query_until(&p, "up", "\"1\"]", Duration::from_secs(60));
    assert!(up.contains("\"status\":\"success\""), "{up}");
    assert!(up.contains(&format!("\"instance\":\"{endpoint}\"")), "{up}");
    let completed = query_until(
        &p,
        "te_batches_completed_total",
        "\"3\"]",
        Duration::from_secs(30),
    );
    assert!(completed.contains("\"3\"]"), "{completed}");
    let bytes = query_until(
        &p,
        "te_bytes_total%7Bop%3D%22write%22%7D",
        "\"196608\"]",
        Duration::from_secs(30),
    );
    assert!(bytes.contains("\"196608\"]"), "{bytes}");
    let latency = query_until(
        &p,
        "te_batch_latency_seconds_count",
        "\"3\"]",
        Duration::from_secs(30),
    );
    assert!(latency.contains("\"3\"]"), "{latency}");
    println!("prometheus answered: {bytes}");
}
