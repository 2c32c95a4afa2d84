//! `--baseline`: what this machine does without te, measured in the same run.
//!
//! - memcpy: one thread copying blocks of the same size over the same working set
//!   (what an in-process backend can at best reach);
//! - a socket pump: one loopback TCP connection per thread, the writer writing
//!   block-sized chunks, the reader reading them (what a TCP backend can at best reach);
//! - qperf `tcp_bw` / `tcp_lat` at the same message size, where qperf is installed.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use te::{Error, ErrorKind, Op, Result};

use super::plan::{Layout, Plan, Stop};
use super::report::Progress;
use super::stats::{self, Record};

/// The backend name of the memcpy baseline's records.
pub(crate) const MEMCPY: &str = "baseline-memcpy";
/// The backend name of the socket pump's records.
pub(crate) const SOCKET: &str = "baseline-socket";
/// The backend name of qperf's records.
pub(crate) const QPERF: &str = "baseline-qperf";

/// How long each baseline runs: as long as a te point, or 1 s for `--iters` runs.
fn time(plan: &Plan) -> Duration {
    match plan.stop {
        Stop::After(d) => d,
        Stop::Iters(_) => Duration::from_secs(1),
    }
}

/// memcpy over the working set of one te point (its block size and batch size).
pub(crate) fn memcpy_like(plan: &Plan, layout: Layout) -> Record {
    memcpy(layout, time(plan))
}

/// The wire's baselines at a block size: the socket pump with one connection per
/// thread, and qperf if installed (a one-line note if not).
///
/// # Errors
/// `Io` if the loopback sockets cannot be set up.
pub(crate) fn wire(plan: &Plan, layout: Layout, progress: &Progress) -> Result<Vec<Record>> {
    let time = time(plan);
    let mut out = vec![socket_pump(layout, time)?];
    match qperf_path() {
        Some(path) => match qperf(&path, layout.block, time) {
            Ok(r) => out.push(r),
            Err(e) => progress.note(&format!("baseline: qperf failed: {e}")),
        },
        None => progress.note(
            "baseline: qperf is not installed, so its tcp_bw/tcp_lat are not measured (apt-get install qperf)",
        ),
    }
    Ok(out)
}

/// One thread copies `layout.batch` blocks per batch over the whole working set of the
/// te point (every thread's range), timing each batch.
fn memcpy(layout: Layout, time: Duration) -> Record {
    let len = layout.bytes() as usize;
    let src = vec![0x5au8; len];
    let mut dst = vec![0xa5u8; len];
    let block = layout.block as usize;
    let mut latencies = Vec::with_capacity(1 << 16);
    let mut batches = 0u64;
    let start = Instant::now();
    let end = loop {
        let t = batches % layout.threads;
        let t0 = Instant::now();
        for i in 0..layout.batch {
            let off = layout.offset(t, i) as usize;
            dst[off..off + block].copy_from_slice(&src[off..off + block]);
        }
        std::hint::black_box(&mut dst);
        let t1 = Instant::now();
        latencies.push(super::stats::nanos(t1 - t0));
        batches += 1;
        if t1 - start >= time {
            break t1;
        }
    };
    Record::measured(
        MEMCPY,
        Op::Write,
        layout.block,
        layout.batch,
        1,
        batches * layout.batch * layout.block,
        (end - start).as_secs_f64(),
        stats::summarise(&mut latencies),
    )
}

/// One loopback TCP connection per thread; each writer writes `block`-byte chunks as
/// fast as it can, each reader counts what arrives before the deadline.
fn socket_pump(layout: Layout, time: Duration) -> Result<Record> {
    let io = |what: &str, e: std::io::Error| {
        Error::new(ErrorKind::Io, format!("socket baseline: {what}"))
            .with_operation("bench")
            .with_source(e)
    };
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| io("cannot listen", e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| io("no local address", e))?;
    let conns = layout.threads as usize;
    let block = layout.block as usize;
    let stops: Vec<AtomicBool> = (0..conns).map(|_| AtomicBool::new(false)).collect();
    let barrier = Barrier::new(2 * conns);
    let mut pairs = Vec::with_capacity(conns);
    for _ in 0..conns {
        let w = TcpStream::connect(addr).map_err(|e| io("cannot connect", e))?;
        let (r, _) = listener.accept().map_err(|e| io("cannot accept", e))?;
        pairs.push((w, r));
    }
    let barrier = &barrier;
    let results: Vec<(u64, Duration)> = std::thread::scope(|s| {
        let handles: Vec<_> = pairs
            .into_iter()
            .zip(&stops)
            .map(|((mut w, mut r), stop)| {
                s.spawn(move || {
                    let buf = vec![0x5au8; block];
                    barrier.wait();
                    while !stop.load(Ordering::Relaxed) {
                        if w.write_all(&buf).is_err() {
                            break;
                        }
                    }
                });
                s.spawn(move || {
                    let mut buf = vec![0u8; block];
                    let mut counted = 0u64;
                    barrier.wait();
                    let start = Instant::now();
                    let mut elapsed = Duration::ZERO;
                    loop {
                        match r.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                let now = start.elapsed();
                                // The first read counts even if this thread ran late,
                                // so a loaded machine still measures something.
                                if now < time || counted == 0 {
                                    counted += n as u64;
                                    elapsed = now;
                                } else {
                                    stop.store(true, Ordering::Relaxed);
                                }
                            }
                        }
                    }
                    (counted, elapsed)
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    let bytes: u64 = results.iter().map(|r| r.0).sum();
    let seconds = results
        .iter()
        .map(|r| r.1)
        .max()
        .unwrap_or_default()
        .as_secs_f64();
    Ok(Record::measured(
        SOCKET,
        Op::Write,
        layout.block,
        1,
        layout.threads,
        bytes,
        seconds,
        None,
    ))
}

/// qperf on the search path, if any.
fn qperf_path() -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join("qperf"))
        .find(|p| p.is_file())
}

/// Kills and reaps a child process when dropped.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `qperf` as a server on a free loopback port and as a client against it.
fn qperf(path: &PathBuf, block: u64, time: Duration) -> std::result::Result<Record, String> {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port: {e}"))?
        .port();
    let _server = Reaped(
        Command::new(path)
            .args(["-lp", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start the qperf server: {e}"))?,
    );
    // qperf takes whole seconds; 0 would mean "forever".
    let secs = time.as_secs_f64().ceil().max(1.0) as u64;
    let limit = Duration::from_secs(4 * secs + 10);
    let mut last = String::new();
    for _ in 0..10 {
        let client = Command::new(path)
            .args([
                "127.0.0.1",
                "-lp",
                &port.to_string(),
                "-t",
                &secs.to_string(),
            ])
            .args(["-m", &block.to_string(), "tcp_bw", "tcp_lat"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start the qperf client: {e}"))?;
        let out = wait_with_limit(client, limit)?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() {
            let (bw, lat) = parse_qperf(&text)
                .ok_or_else(|| format!("unexpected qperf output: {}", text.trim()))?;
            return Ok(Record {
                backend: QPERF.to_string(),
                op: Op::Write.to_string(),
                block_size: block,
                batch_size: 1,
                threads: 1,
                bytes: None,
                seconds: Some(secs as f64),
                gb_per_s: bw,
                lat_us_avg: Some(lat),
                lat_us_p50: None,
                lat_us_p99: None,
                lat_us_p999: None,
                device_calls_per_batch: None,
                device_copies_per_batch: None,
                device_syncs_per_batch: None,
                stages: super::stats::StageSummary::default(),
            });
        }
        // The server may not listen yet.
        last = String::from_utf8_lossy(&out.stderr).trim().to_string();
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(format!("the qperf client kept failing: {last}"))
}

/// Waits for `child`, killing it after `limit` (qperf retries a dead server forever).
fn wait_with_limit(
    child: Child,
    limit: Duration,
) -> std::result::Result<std::process::Output, String> {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(r) => r.map_err(|e| format!("qperf client: {e}")),
        Err(_) => {
            if let Ok(pid) = libc::pid_t::try_from(pid) {
                // SAFETY: kill(2) on the pid of our own child, which has not been reaped
                // (its waiter is still blocked in wait), so the pid cannot be reused.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            let _ = rx.recv_timeout(Duration::from_secs(5));
            Err(format!(
                "the qperf client did not finish within {} s",
                limit.as_secs()
            ))
        }
    }
}

/// Parses `bw = 1.27 GB/sec` (to decimal GB/s) and `latency = 202 us` (to µs).
fn parse_qperf(text: &str) -> Option<(f64, f64)> {
    let value = |key: &str| -> Option<(f64, String)> {
        text.lines().find_map(|l| {
            let (k, v) = l.split_once('=')?;
            if k.trim() != key {
                return None;
            }
            let mut parts = v.split_whitespace();
            let n = parts.next()?.replace(',', "").parse().ok()?;
            Some((n, parts.next()?.to_string()))
        })
    };
    let (bw, unit) = value("bw")?;
    let bw = bw
        * match unit.as_str() {
            "GB/sec" => 1.0,
            "MB/sec" => 1e-3,
            "KB/sec" => 1e-6,
            "bytes/sec" | "B/sec" => 1e-9,
            _ => return None,
        };
    let (lat, unit) = value("latency")?;
    let lat = lat
        * match unit.as_str() {
            "ns" => 1e-3,
            "us" => 1.0,
            "ms" => 1e3,
            "sec" => 1e6,
            _ => return None,
        };
    Some((bw, lat))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qperf_output_is_read_in_decimal_gigabytes_and_microseconds() {
        let text = "tcp_bw:\n    bw  =  1.27 GB/sec\ntcp_lat:\n    latency  =  202 us\n";
        assert_eq!(parse_qperf(text), Some((1.27, 202.0)));
        let text = "tcp_bw:\n    bw  =  870 MB/sec\ntcp_lat:\n    latency  =  33.7 ms\n";
        let (bw, lat) = parse_qperf(text).unwrap();
        assert!((bw - 0.87).abs() < 1e-9 && (lat - 33_700.0).abs() < 1e-6);
        assert_eq!(parse_qperf("tcp_bw:\nfailed to receive port\n"), None);
    }

    #[test]
    fn the_socket_pump_moves_bytes_and_reports_them() {
        let layout = Layout {
            block: 64 << 10,
            batch: 1,
            slots: 1,
            threads: 2,
        };
        let r = socket_pump(layout, Duration::from_millis(100)).unwrap();
        assert_eq!(r.backend, SOCKET);
        assert!(r.bytes.unwrap() > 0 && r.gb_per_s > 0.0, "{r:?}");
        assert!(r.lat_us_p50.is_none());
    }

    #[test]
    fn memcpy_reports_per_batch_latencies() {
        let layout = Layout {
            block: 4096,
            batch: 4,
            slots: 4,
            threads: 1,
        };
        let r = memcpy(layout, Duration::from_millis(20));
        assert!(
            r.bytes.unwrap() >= 4 * 4096 && r.lat_us_p50.is_some(),
            "{r:?}"
        );
    }
}
