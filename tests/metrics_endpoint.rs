//! The metrics endpoint (`[engine] metrics_listen`): a scrape answers the engine's
//! counters in the OpenMetrics text format, and hostile peers — oversize or malformed
//! requests, idle sockets by the hundred, a request trickled byte by byte — get a
//! refusal or are cut, while a genuine scraper is served.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use te::{Access, Config, Engine, TransferRequest};

fn engine(metrics: bool) -> Engine {
    let mut c = Config::defaults();
    if metrics {
        c.engine.metrics_listen = Some("127.0.0.1:0".into());
    }
    Engine::from_config(&c).unwrap()
}

/// Sends `request` and reads the whole answer (the endpoint closes after it).
fn ask(addr: &str, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

fn scrape(addr: &str) -> String {
    ask(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
}

#[test]
fn a_scrape_answers_the_engines_counters_in_openmetrics_text() {
    let target = engine(false);
    let _dst = target
        .alloc("dst", 8192, Access::REMOTE_READ_WRITE)
        .unwrap();
    let me = engine(true);
    assert!(engine(false).metrics_address().is_none());
    let addr = me.metrics_address().expect("the endpoint runs").to_string();
    let src = me.alloc("src", 8192, Access::LOCAL).unwrap();
    let peer = me.connect(&target.address().to_string()).unwrap();
    let rid = peer.region("dst").unwrap().id;
    me.transfer(&peer, &[TransferRequest::write(src.id(), 0, rid, 0, 8192)])
        .unwrap()
        .wait()
        .unwrap();
    let answer = scrape(&addr);
    println!("{answer}");
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    assert!(answer.contains("application/openmetrics-text"));
    for line in [
        "te_batches_submitted_total 1",
        "te_batches_completed_total 1",
        "te_bytes_total{op=\"write\"} 8192",
        "te_requests_total{op=\"write\"} 1",
        "te_batch_latency_seconds_count 1",
        "te_batch_latency_seconds_bucket{le=\"+Inf\"} 1",
        "te_registered_bytes{memory=\"host\"} 8192",
        "te_control_request_bytes 0",
        "# EOF",
    ] {
        assert!(answer.contains(line), "missing `{line}`");
    }
    let peer_line = format!("te_peer_bytes_total{{peer=\"{}\"", target.address());
    assert!(answer.contains(&peer_line), "missing `{peer_line}`");
}

#[test]
fn bad_requests_are_refused_with_a_status_and_idle_sockets_cannot_keep_a_scraper_out() {
    let me = engine(true);
    let addr = me.metrics_address().unwrap().to_string();
    assert!(ask(&addr, b"GET /other HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
    assert!(ask(&addr, b"POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
    assert!(ask(&addr, &[b'x'; 9000]).starts_with("HTTP/1.1 431"));
    assert!(ask(&addr, b"\xff\xfe\r\n\r\n").starts_with("HTTP/1.1 400"));

    // A request trickled byte by byte is cut at the request timeout (2 s).
    let mut slow = TcpStream::connect(&addr).unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let start = Instant::now();
    let mut cut = None;
    for b in b"GET /metrics HTTP/1.1\r\nHost: a-very-slow-client\r\n"
        .iter()
        .cycle()
        .take(200)
    {
        if slow.write_all(&[*b]).is_err() {
            cut = Some(start.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let cut = cut.unwrap_or_else(|| {
        let mut rest = Vec::new();
        let _ = slow.read_to_end(&mut rest);
        start.elapsed()
    });
    println!("a trickled request was cut after {cut:?}");
    assert!(cut < Duration::from_secs(5), "cut after {cut:?}");

    // Hundreds of idle sockets: the newest connection pushes the oldest out.
    if let Err(why) = common::raise_nofile(2048) {
        println!("SKIP the idle flood: {why}");
        return;
    }
    let idle: Vec<TcpStream> = (0..500)
        .map(|_| TcpStream::connect(&addr).unwrap())
        .collect();
    let start = Instant::now();
    let answer = scrape(&addr);
    println!(
        "scraped in {:?} with 500 idle sockets open",
        start.elapsed()
    );
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    assert!(start.elapsed() < Duration::from_secs(2));
    drop(idle);
}

#[test]
fn te_serve_serves_its_metrics_and_te_stats_prints_them_live() {
    use std::io::BufRead;
    let mut child = common::te()
        .args(["serve", "--backend", "tcp", "--buffer-size", "1MiB"])
        .args(["--metrics-listen", "127.0.0.1:0"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let metrics = lines
        .map_while(|l| l.ok())
        .take(3)
        .find_map(|l| {
            l.strip_prefix("metrics at http://")
                .and_then(|r| r.split_once("/metrics"))
                .map(|(a, _)| a.to_string())
        })
        .expect("te serve prints its metrics address");
    let out = common::te()
        .args(["stats", &metrics, "--interval", "200ms", "--count", "2"])
        .output()
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.starts_with("  TIME s  BATCHES/s"), "{text}");
    assert_eq!(text.lines().count(), 3, "a header and two rows");

    // Nothing listening: a clear error, not a hang.
    let out = common::te()
        .args(["stats", "127.0.0.1:9", "--count", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("metrics_listen"), "{err}");
}

#[test]
fn te_bench_serves_the_initiators_metrics_when_asked() {
    let out = common::te()
        .args([
            "bench",
            "--backend",
            "tcp",
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .args([
            "--duration",
            "200ms",
            "--warmup",
            "50ms",
            "--block-size",
            "4KiB",
            "--batch",
            "2",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("metrics at http://127.0.0.1:"), "{err}");
}

#[test]
fn docs_metrics_md_lists_every_metric_the_endpoint_exports() {
    let doc = std::fs::read_to_string("docs/metrics.md").expect("docs/metrics.md");
    // One write to a peer, so the per-peer and per-label families have samples.
    let target = engine(false);
    let _dst = target
        .alloc("dst", 4096, Access::REMOTE_READ_WRITE)
        .unwrap();
    let me = engine(true);
    let src = me.alloc("src", 4096, Access::LOCAL).unwrap();
    let peer = me.connect(&target.address().to_string()).unwrap();
    let rid = peer.region("dst").unwrap().id;
    me.transfer(&peer, &[TransferRequest::write(src.id(), 0, rid, 0, 4096)])
        .unwrap()
        .wait()
        .unwrap();
    let text = scrape(&me.metrics_address().unwrap().to_string());
    let mut families = 0;
    for line in text.lines().filter(|l| l.starts_with("# TYPE ")) {
        let mut parts = line["# TYPE ".len()..].split(' ');
        let (name, kind) = (parts.next().unwrap(), parts.next().unwrap());
        // Samples of a counter are named with `_total`, as the table names them.
        let named = match kind {
            "counter" => format!("`{name}_total`"),
            _ => format!("`{name}`"),
        };
        assert!(
            doc.contains(&named),
            "docs/metrics.md does not list {named} ({kind})"
        );
        families += 1;
    }
    assert!(families >= 18, "only {families} metric families in {text}");
}
