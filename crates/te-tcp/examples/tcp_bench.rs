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
    let ctx = Config::from_toml(&text, "tcp_bench arguments", std::path::Path::new("."))
        .expect("valid options")
        .backend_context(te_tcp::NAME);
    let config: TcpConfig = ctx.parse(te_tcp::NAME).expect("valid options");
    let backend = Arc::new(TcpBackend::new(config).expect("backend"));
    let ec = EngineConfig {
        name: name.into(),
        backend: te_tcp::NAME.into(),
        ..EngineConfig::default()
    };
    Engine::with_backend(ec, backend, Origin::BuiltIn).expect("engine")
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

/// The raw pump: one connection, `block`-byte writes, the receiver reads into a buffer.
fn raw_pump(block: usize, secs: f64) -> f64 {
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
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    let buf = vec![1u8; block];
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < secs {
        s.write_all(&buf).unwrap();
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
    for (block, batch) in [(1u64 << 20, 64u64), (64 << 10, 128)] {
        let w = throughput(&s, Op::Write, block, batch, secs);
        let r = throughput(&s, Op::Read, block, batch, secs);
        let raw = raw_pump(block as usize, secs);
        println!(
            "{:>5} KiB x {batch:<3}  write {w:6.2} GB/s  read {r:6.2} GB/s  raw pump {raw:6.2} GB/s  write/raw {:4.0}%",
            block >> 10,
            100.0 * w / raw
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
