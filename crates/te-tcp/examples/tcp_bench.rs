//! A quick loopback measurement of the tcp backend next to a raw-socket pump, for
//! tuning (the official numbers come from `te bench --baseline`).
//!
//! ```text
//! cargo run --release -p te-tcp --example tcp_bench -- [SECONDS] [KEY=VALUE ...]
//! ```
//! Every `KEY=VALUE` goes into the `[backends.tcp]` table (`slice_size=1MiB`,
//! `connections_per_peer=2`, …). Prints GB/s for 1 MiB × 64 and 64 KiB × 128 writes and
//! reads, and the 4 KiB single-write latency, with the raw pump's numbers beside them.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use te_core::{Access, Config, Engine, EngineConfig, Op, Origin, TransferRequest};
use te_tcp::{TcpBackend, TcpConfig};

fn engine(table: &str, name: &str) -> Engine {
    let text = format!("[backends.tcp]\n{table}");
    let mut ctx = Config::from_toml(&text, "tcp_bench arguments", std::path::Path::new("."))
        .expect("valid options")
        .backend_context(te_tcp::NAME);
    ctx.epoch = te_core::random_nonzero();
    let config: TcpConfig = ctx.parse(te_tcp::NAME).expect("valid options");
    let backend = Arc::new(TcpBackend::new(config, &ctx).expect("backend"));
    let ec = EngineConfig {
        name: name.into(),
        backend: te_tcp::NAME.into(),
        ..EngineConfig::default()
    };
    Engine::with_backend(ec, backend, Origin::BuiltIn, ctx.epoch).expect("engine")
}

/// CPU time this process has used, all threads (both sides of every loopback pair).
fn cpu() -> f64 {
    // SAFETY: an all-zero rusage is valid; getrusage fills it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a live, writable rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// Runs `f` (which returns GB/s over about `secs`) and adds CPU seconds per GB moved.
fn with_cpu(secs: f64, f: impl FnOnce() -> f64) -> (f64, f64) {
    let c0 = cpu();
    let gbps = f();
    let used = cpu() - c0;
    (gbps, used / (gbps * secs))
}

/// What every measurement uses.
struct Setup {
    init: Engine,
    peer: te_core::Peer,
    local: te_core::Buffer,
    remote: te_core::RegionId,
}

fn throughput(s: &Setup, op: Op, block: u64, batch: u64, secs: f64) -> f64 {
    let (l, r) = (s.local.id(), s.remote);
    let reqs: Vec<TransferRequest> = (0..batch)
        .map(|i| match op {
            Op::Write => TransferRequest::write(l, i * block, r, i * block, block),
            Op::Read => TransferRequest::read(l, i * block, r, i * block, block),
        })
        .collect();
    // Two batches in flight, so the pipe never drains between batches.
    let mut bytes = 0u64;
    let start = Instant::now();
    let mut prev = s.init.transfer(&s.peer, &reqs).expect("submit");
    while start.elapsed().as_secs_f64() < secs {
        let next = s.init.transfer(&s.peer, &reqs).expect("submit");
        prev.wait().expect("batch");
        bytes += block * batch;
        prev = next;
    }
    prev.wait().expect("batch");
    bytes += block * batch;
    bytes as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn latency(s: &Setup, secs: f64) -> (f64, f64) {
    let req = [TransferRequest::write(s.local.id(), 0, s.remote, 0, 4096)];
    let mut samples = Vec::new();
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < secs {
        let t = Instant::now();
        s.init
            .transfer(&s.peer, &req)
            .expect("submit")
            .wait()
            .expect("batch");
        samples.push(t.elapsed().as_secs_f64() * 1e6);
    }
    samples.sort_by(f64::total_cmp);
    (
        samples[samples.len() / 2],
        samples[samples.len() * 99 / 100],
    )
}

/// The raw pump: one connection, `block`-byte writes, the receiver reads them. With
/// `working_set` = `block` both sides reuse one cache-hot buffer; with a larger one they
/// walk through it as te does through registered memory.
fn raw_pump(block: usize, working_set: usize, secs: f64) -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let rx = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = vec![0u8; working_set];
        let (mut total, mut at) = (0u64, 0usize);
        loop {
            match s.read(&mut buf[at..at + block]) {
                Ok(0) | Err(_) => return total,
                Ok(n) => {
                    total += n as u64;
                    at = (at + block) % working_set;
                }
            }
        }
    });
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    let buf = vec![1u8; working_set];
    let mut at = 0;
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < secs {
        s.write_all(&buf[at..at + block]).unwrap();
        at = (at + block) % working_set;
    }
    drop(s);
    let total = rx.join().unwrap();
    total as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// The raw pump with `MSG_ZEROCOPY` sends: the kernel pins the pages instead of
/// copying them, and reports on the socket's error queue when they are free again.
fn raw_pump_zerocopy(block: usize, secs: f64) -> f64 {
    use std::os::fd::AsRawFd;
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let rx = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut buf = vec![0u8; block];
        let mut total = 0u64;
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => return total,
                Ok(n) => total += n as u64,
            }
        }
    });
    let s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    let fd = s.as_raw_fd();
    let one: i32 = 1;
    // SAFETY: a valid fd and a live i32 of the size passed.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ZEROCOPY,
            (&one as *const i32).cast(),
            4,
        )
    };
    assert_eq!(rc, 0, "SO_ZEROCOPY");
    let buf = vec![1u8; block];
    let mut control = [0u8; 256];
    let drain = |control: &mut [u8; 256]| loop {
        // SAFETY: an all-zero msghdr is valid; the control buffer is ours.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = control.len() as _;
        // SAFETY: reads completion notices into our control buffer only.
        let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT) };
        if n < 0 {
            return;
        }
    };
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < secs {
        let mut off = 0;
        while off < block {
            // SAFETY: the buffer outlives the connection and is never written again.
            let n = unsafe {
                libc::send(
                    fd,
                    buf[off..].as_ptr().cast(),
                    block - off,
                    libc::MSG_ZEROCOPY | libc::MSG_NOSIGNAL,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                assert_eq!(e.raw_os_error(), Some(libc::ENOBUFS), "{e}");
            } else {
                off += n as usize;
            }
            drain(&mut control);
        }
    }
    drop(s);
    let total = rx.join().unwrap();
    total as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// Raw 4 KiB ping with a 40-byte answer, the shape of a tcp write and its ack.
fn raw_latency(secs: f64) -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_nodelay(true).unwrap();
        let mut buf = vec![0u8; 4096];
        while s.read_exact(&mut buf).is_ok() {
            if s.write_all(&buf[..40]).is_err() {
                return;
            }
        }
    });
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    let buf = vec![1u8; 4096];
    let mut ack = [0u8; 40];
    let mut samples = Vec::new();
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < secs {
        let t = Instant::now();
        s.write_all(&buf).unwrap();
        s.read_exact(&mut ack).unwrap();
        samples.push(t.elapsed().as_secs_f64() * 1e6);
    }
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1).peekable();
    let secs: f64 = match args.peek().and_then(|a| a.parse().ok()) {
        Some(s) => {
            args.next();
            s
        }
        None => 2.0,
    };
    let mut table = String::new();
    for kv in args {
        let (k, v) = kv.split_once('=').expect("KEY=VALUE");
        if v.parse::<i64>().is_ok() || v == "true" || v == "false" {
            table.push_str(&format!("{k} = {v}\n"));
        } else {
            table.push_str(&format!("{k} = \"{v}\"\n"));
        }
    }
    let len = 128usize << 20;
    let target = engine(&table, "bench-target");
    let init = engine(&table, "bench-init");
    let remote = target
        .alloc("dst", len, Access::REMOTE_READ_WRITE)
        .expect("alloc");
    let local = init.alloc("src", len, Access::LOCAL).expect("alloc");
    let peer = init
        .connect(&target.address().to_string())
        .expect("connect");
    let s = Setup {
        remote: remote.id(),
        init,
        peer,
        local,
    };
    println!("options: {}", table.replace('\n', " "));
    if std::env::var("TCP_BENCH_PROFILE").as_deref() == Ok("latency") {
        let (p50, p99) = latency(&s, secs);
        let raw = raw_latency(secs);
        println!(
            "4 KiB x 1 write p50 {p50:6.1} us  p99 {p99:6.1} us  raw ping-pong p50 {raw:6.1} us"
        );
        return;
    }
    if let Ok(only) = std::env::var("TCP_BENCH_PROFILE") {
        // One phase alone, for a profiler: `write` or `read` of 1 MiB x 64.
        let op = if only == "read" { Op::Read } else { Op::Write };
        let (g, c) = with_cpu(secs, || throughput(&s, op, 1 << 20, 64, secs));
        println!("{only} 1 MiB x 64: {g:.2} GB/s {c:.2} cpu-s/GB");
        return;
    }
    for (block, batch) in [(1u64 << 20, 64u64), (64 << 10, 128)] {
        let (w, wc) = with_cpu(secs, || throughput(&s, Op::Write, block, batch, secs));
        let (r, rc) = with_cpu(secs, || throughput(&s, Op::Read, block, batch, secs));
        let (raw, rawc) = with_cpu(secs, || raw_pump(block as usize, block as usize, secs));
        let (cold, coldc) = with_cpu(secs, || raw_pump(block as usize, 64 << 20, secs));
        let zc = if std::env::var_os("TCP_BENCH_ZEROCOPY").is_some() {
            format!(
                "  (MSG_ZEROCOPY pump {:5.2} GB/s)",
                raw_pump_zerocopy(block as usize, secs)
            )
        } else {
            String::new()
        };
        println!(
            "{:>5} KiB x {batch:<3}  write {w:5.2} GB/s {wc:4.2} cpu-s/GB  read {r:5.2} GB/s {rc:4.2} cpu-s/GB  raw pump {raw:5.2} GB/s {rawc:4.2} cpu-s/GB  cold {cold:5.2} GB/s {coldc:4.2} cpu-s/GB  write/raw {:3.0}%  write/cold {:3.0}%{zc}",
            block >> 10,
            100.0 * w / raw,
            100.0 * w / cold
        );
    }
    let (p50, p99) = latency(&s, secs);
    let raw = raw_latency(secs);
    println!(
        "    4 KiB x 1    write p50 {p50:6.1} us  p99 {p99:6.1} us  raw ping-pong p50 {raw:6.1} us"
    );
    drop(s);
    drop(remote);
    std::thread::sleep(Duration::from_millis(10));
}
