//! `te stats HOST:PORT`: a live table of a running engine's metrics, read from its
//! metrics endpoint (`[engine] metrics_listen`) once per interval.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use te::{Error, ErrorKind, Result};

/// Options of `te stats`.
#[derive(clap::Args, Debug)]
pub(crate) struct StatsArgs {
    /// The engine's metrics endpoint (its `[engine] metrics_listen`), `HOST:PORT`.
    pub(crate) address: String,
    /// Time between rows.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub(crate) interval: Duration,
    /// Rows to print, then stop (default: until interrupted).
    #[arg(long)]
    pub(crate) count: Option<u64>,
}

fn parse_duration(s: &str) -> std::result::Result<Duration, String> {
    match te::config::parse_duration(s) {
        Ok(d) if d.is_zero() => Err("the interval must be greater than zero".into()),
        Ok(d) => Ok(d),
        Err(e) => Err(e.message().to_string()),
    }
}

/// One scrape: each sample line's name with its labels, and its value.
fn scrape(address: &str) -> Result<HashMap<String, f64>> {
    let unreachable = |what: &str, e: std::io::Error| {
        Error::new(
            ErrorKind::PeerUnreachable,
            format!("{what} the metrics endpoint at {address}: {e}; is metrics_listen set there?"),
        )
    };
    let mut s = TcpStream::connect(address).map_err(|e| unreachable("cannot reach", e))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .and_then(|()| s.write_all(b"GET /metrics HTTP/1.1\r\nHost: te\r\n\r\n"))
        .map_err(|e| unreachable("cannot ask", e))?;
    let mut text = String::new();
    // At most 16 MiB, whatever the other side sends.
    s.take(16 << 20)
        .read_to_string(&mut text)
        .map_err(|e| unreachable("cannot read", e))?;
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return Err(Error::new(
            ErrorKind::Protocol,
            format!("{address} answered no HTTP"),
        ));
    };
    if !head.starts_with("HTTP/1.1 200") {
        let status = head.lines().next().unwrap_or("").to_string();
        return Err(Error::new(
            ErrorKind::Protocol,
            format!("{address} answered `{status}`, not metrics"),
        ));
    }
    Ok(body
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_string(), value.parse().ok()?))
        })
        .collect())
}

pub(crate) fn run(args: StatsArgs) -> Result<()> {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "{:>8} {:>10} {:>8} {:>11} {:>11} {:>9} {:>10}",
        "TIME s", "BATCHES/s", "FAILED", "WRITE MB/s", "READ MB/s", "IN FLIGHT", "MEAN µs"
    );
    let get = |m: &HashMap<String, f64>, k: &str| m.get(k).copied().unwrap_or(0.0);
    let failed = |m: &HashMap<String, f64>| {
        m.iter()
            .filter(|(k, _)| k.starts_with("te_batches_failed_total"))
            .map(|(_, v)| v)
            .sum::<f64>()
    };
    let start = Instant::now();
    let mut last = scrape(&args.address)?;
    let mut at = Instant::now();
    let mut rows = 0;
    while args.count.is_none_or(|c| rows < c) {
        std::thread::sleep(args.interval);
        let now = scrape(&args.address)?;
        let secs = at.elapsed().as_secs_f64();
        at = Instant::now();
        let d = |k: &str| get(&now, k) - get(&last, k);
        let count = d("te_batch_latency_seconds_count");
        let mean = if count > 0.0 {
            d("te_batch_latency_seconds_sum") / count * 1e6
        } else {
            0.0
        };
        let _ = writeln!(
            out,
            "{:>8.1} {:>10.1} {:>8} {:>11.1} {:>11.1} {:>9} {:>10.1}",
            start.elapsed().as_secs_f64(),
            d("te_batches_completed_total") / secs,
            failed(&now) - failed(&last),
            d("te_bytes_total{op=\"write\"}") / secs / 1e6,
            d("te_bytes_total{op=\"read\"}") / secs / 1e6,
            get(&now, "te_batches_in_flight"),
            mean
        );
        let _ = out.flush();
        last = now;
        rows += 1;
    }
    Ok(())
}
