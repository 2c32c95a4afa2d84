//! `te stats HOST:PORT`: a live table of a running engine's metrics, read from its
//! metrics endpoint (`[engine] metrics_listen`) once per interval.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use te::{Error, ErrorKind, Result};

/// Options of `te stats`.
#[derive(clap::Args, Debug)]
pub(crate) struct StatsArgs {
    /// The engine's metrics endpoint (its `[engine] metrics_listen`), `HOST:PORT`.
    pub(crate) address: String,
    /// Time between rows (at most 1 day).
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub(crate) interval: Duration,
    /// Rows to print, then stop (default: until interrupted).
    #[arg(long)]
    pub(crate) count: Option<u64>,
}

/// The longest one scrape may take, from connecting to the end of the answer: an
/// endpoint that trickles its answer, or never ends it, is given up on.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);
/// The most bytes of one answer, whatever the other side sends.
const MAX_ANSWER: usize = 16 << 20;
/// The longest interval accepted; more is a typo.
const MAX_INTERVAL: Duration = Duration::from_secs(24 * 60 * 60);

fn parse_duration(s: &str) -> std::result::Result<Duration, String> {
    match te::config::parse_duration(s) {
        Ok(d) if d.is_zero() => Err("the interval must be greater than zero".into()),
        Ok(d) if d > MAX_INTERVAL => Err(format!(
            "--interval {s} is longer than the 1 day te stats allows"
        )),
        Ok(d) => Ok(d),
        Err(e) => Err(e.message().to_string()),
    }
}

/// One scrape, within [`SCRAPE_TIMEOUT`]: each sample line's name with its labels,
/// and its value, where that is a finite number.
fn scrape(address: &str) -> Result<HashMap<String, f64>> {
    let deadline = Instant::now() + SCRAPE_TIMEOUT;
    let unreachable = |what: &str, e: std::io::Error| {
        Error::new(
            ErrorKind::PeerUnreachable,
            format!("{what} the metrics endpoint at {address}: {e}; is metrics_listen set there?"),
        )
    };
    let late = || {
        Error::new(
            ErrorKind::Timeout,
            format!(
                "the metrics endpoint at {address} did not answer within {} s; is it a te engine's metrics_listen?",
                SCRAPE_TIMEOUT.as_secs()
            ),
        )
    };
    let addrs = addresses(address, deadline, |a| {
        a.to_socket_addrs().map(Iterator::collect)
    })?;
    let mut stream = Err(std::io::Error::from(std::io::ErrorKind::AddrNotAvailable));
    for a in &addrs {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(late());
        }
        stream = TcpStream::connect_timeout(a, left);
        if stream.is_ok() {
            break;
        }
    }
    let mut s = stream.map_err(|e| unreachable("cannot reach", e))?;
    let left = deadline.saturating_duration_since(Instant::now());
    s.set_write_timeout(Some(left.max(Duration::from_millis(1))))
        .and_then(|()| {
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: te\r\nConnection: close\r\n\r\n")
        })
        .map_err(|e| unreachable("cannot ask", e))?;
    let mut answer = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    // Where the answer's head ends, once it is in; and the answer's whole length, once
    // the head announces one (without it, the answer ends when the endpoint closes the
    // connection).
    let mut head_end = None;
    let mut whole = None;
    while whole.is_none_or(|n| answer.len() < n) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(late());
        }
        s.set_read_timeout(Some(left))
            .map_err(|e| unreachable("cannot read", e))?;
        let searched = answer.len().saturating_sub(3);
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(late())
            }
            Err(e) => return Err(unreachable("cannot read", e)),
        }
        if answer.len() > MAX_ANSWER {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!("{address} answered more than 16 MiB; is it a te engine's metrics_listen?"),
            ));
        }
        if head_end.is_none() {
            head_end = answer[searched..]
                .windows(4)
                .position(|w| w == b"\r\n\r\n")
                .map(|i| searched + i + 4);
            whole = head_end.and_then(|end| {
                Some(end + content_length(&String::from_utf8_lossy(&answer[..end]))?)
            });
        }
    }
    let Some(end) = head_end else {
        return Err(Error::new(
            ErrorKind::Protocol,
            format!("{address} answered no HTTP"),
        ));
    };
    let head = String::from_utf8_lossy(&answer[..end]);
    let body_end = whole.map_or(answer.len(), |n| n.min(answer.len()));
    let body = String::from_utf8_lossy(&answer[end..body_end]);
    let status = head.lines().next().unwrap_or("");
    if !(status.starts_with("HTTP/1.") && status.split(' ').nth(1) == Some("200")) {
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
            let value: f64 = value.parse().ok()?;
            value.is_finite().then(|| (name.to_string(), value))
        })
        .collect())
}

/// The addresses `address` names, through `lookup`, by `deadline`: a host name is
/// looked up on a thread of its own, as `getaddrinfo` takes no deadline (a DNS server
/// that drops queries holds it 10 s and more).
fn addresses(
    address: &str,
    deadline: Instant,
    lookup: fn(&str) -> std::io::Result<Vec<SocketAddr>>,
) -> Result<Vec<SocketAddr>> {
    if let Ok(a) = address.parse::<SocketAddr>() {
        return Ok(vec![a]);
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let name = address.to_string();
    std::thread::Builder::new()
        .name("te-stats-lookup".into())
        .spawn(move || {
            let _ = tx.send(lookup(&name));
        })
        .map_err(|e| Error::new(ErrorKind::Io, format!("cannot start a thread: {e}")))?;
    match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        Ok(Ok(addrs)) => Ok(addrs),
        Ok(Err(e)) => Err(Error::new(
            ErrorKind::InvalidRequest,
            format!("`{address}` is not a metrics endpoint's HOST:PORT: {e}"),
        )),
        Err(_) => Err(Error::new(
            ErrorKind::Timeout,
            format!(
                "`{address}` did not resolve within {} s (is the DNS server in /etc/resolv.conf \
                 answering?); name the endpoint by IP address to need no lookup",
                SCRAPE_TIMEOUT.as_secs()
            ),
        )),
    }
}

/// The `Content-Length` of an answer's head, if it has one.
fn content_length(head: &str) -> Option<usize> {
    head.lines().skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case("content-length")
            .then(|| v.trim().parse().ok())?
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lookup_that_never_answers_is_given_up_on_at_the_deadline() {
        let t = Instant::now();
        let e = addresses(
            "metrics.example:9100",
            t + Duration::from_millis(200),
            |_| {
                std::thread::sleep(Duration::from_secs(30));
                Ok(Vec::new())
            },
        )
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        assert!(e.message().contains("by IP address"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }

    #[test]
    fn an_ip_address_needs_no_lookup_and_a_failed_lookup_says_what_to_pass() {
        let far = Instant::now() + Duration::from_secs(5);
        let a = addresses("127.0.0.1:9100", far, |_| panic!("looked up")).unwrap();
        assert_eq!(a, vec!["127.0.0.1:9100".parse().unwrap()]);
        let e = addresses("nonsense", far, |_| {
            Err(std::io::Error::other("invalid socket address"))
        })
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidRequest);
        assert!(e.message().contains("HOST:PORT"), "{e}");
    }
}
