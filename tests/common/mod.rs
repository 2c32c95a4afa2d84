//! What the control-plane tests share: a raw peer that speaks the wire format by hand
//! (so it can lie, stall and misbehave), a heap counter, `te serve` as a child process
//! and the descriptor limit.
//!
//! Each test binary uses only part of it.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ciborium::value::Value;
use te::{Config, Engine, EngineConfig};

pub mod manual;

/// Holds a test binary's tests to one at a time (those that count the heap, or load
/// the machine, must not overlap).
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// An engine on the built-in defaults, with its `[engine]` table changed by `set`.
pub fn engine(set: impl FnOnce(&mut EngineConfig)) -> Engine {
    let mut c = Config::defaults();
    set(&mut c.engine);
    Engine::from_config(&c).unwrap()
}

/// Frame kinds, as `crates/te-core/src/control/wire.rs` numbers them.
pub mod kind {
    pub const HELLO: u8 = 1;
    pub const WELCOME: u8 = 2;
    pub const PROOF: u8 = 3;
    pub const READY: u8 = 4;
    pub const ERROR: u8 = 5;
    pub const GET_SEGMENT: u8 = 6;
    pub const SEGMENT: u8 = 7;
    pub const NOTIFY: u8 = 8;
    pub const ACK: u8 = 9;
    pub const PING: u8 = 10;
    pub const PONG: u8 = 11;
    pub const BACKEND: u8 = 12;
    pub const BACKEND_REPLY: u8 = 13;
    pub const BYE: u8 = 14;
}

/// A global allocator that counts the bytes live on the heap, so a test can show that
/// the engine in its process did not allocate what a hostile peer announced.
pub struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = LIVE.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to the system allocator unchanged; the counter is
// only arithmetic on the sizes it was given.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc` is passed on.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract for `realloc` is passed on.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            grew(new_size);
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }
}

/// Bytes live on the heap now (with `Counting` as the global allocator).
pub fn heap() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// How much the heap grew since `before`, in bytes (0 if it shrank).
pub fn heap_growth(before: usize) -> usize {
    heap().saturating_sub(before)
}

/// Starts measuring the heap's peak from now; returns the bytes live now.
pub fn reset_peak() -> usize {
    let now = heap();
    PEAK.store(now, Ordering::Relaxed);
    now
}

/// How far the heap's peak since `reset_peak` rose above `before`, in bytes.
pub fn peak_growth(before: usize) -> usize {
    PEAK.load(Ordering::Relaxed).saturating_sub(before)
}

pub const MIB: usize = 1 << 20;

/// Raises the soft limit on open descriptors to at least `want`, within the hard limit.
/// Returns why not, if it cannot.
pub fn raise_nofile(want: u64) -> Result<(), String> {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `l` is a valid, writable rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } != 0 {
        return Err("getrlimit(RLIMIT_NOFILE) failed".into());
    }
    if l.rlim_cur >= want {
        return Ok(());
    }
    if l.rlim_max < want {
        return Err(format!(
            "the hard limit on open files is {}, below the {want} this test needs",
            l.rlim_max
        ));
    }
    l.rlim_cur = want;
    // SAFETY: `l` is a valid rlimit within the hard limit.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &l) } != 0 {
        return Err(format!("setrlimit(RLIMIT_NOFILE, {want}) failed"));
    }
    Ok(())
}

/// A frame: the 16-byte header (`TE`, format 2, kind, length, id) and the payload.
pub fn frame(kind: u8, id: u64, payload: &[u8]) -> Vec<u8> {
    header(kind, payload.len() as u32, id)
        .into_iter()
        .chain(payload.iter().copied())
        .collect()
}

/// A header alone, announcing `len` bytes.
pub fn header(kind: u8, len: u32, id: u64) -> Vec<u8> {
    let mut h = b"TE".to_vec();
    h.push(2);
    h.push(kind);
    h.extend_from_slice(&len.to_le_bytes());
    h.extend_from_slice(&id.to_le_bytes());
    h
}

/// A CBOR map from text keys.
pub fn cbor(fields: Vec<(&str, Value)>) -> Vec<u8> {
    let map = Value::Map(
        fields
            .into_iter()
            .map(|(k, v)| (Value::Text(k.to_string()), v))
            .collect(),
    );
    let mut out = Vec::new();
    ciborium::into_writer(&map, &mut out).unwrap();
    out
}

pub fn int(v: u64) -> Value {
    Value::Integer(v.into())
}

/// The payload of a hello: the versions spoken, a nonce, and who the sender says it is.
pub fn hello(versions: (u16, u16), name: &str, epoch: u64) -> Vec<u8> {
    cbor(vec![
        (
            "versions",
            Value::Array(vec![int(versions.0.into()), int(versions.1.into())]),
        ),
        ("nonce", Value::Bytes(vec![7; 32])),
        ("name", Value::Text(name.into())),
        ("epoch", int(epoch)),
        ("address", Value::Text("127.0.0.1:9".into())),
        ("heartbeat_ms", int(60_000)),
    ])
}

/// A notification's payload, with any extra fields a forger may add.
pub fn notice(to_epoch: u64, message: &[u8], extra: Vec<(&str, Value)>) -> Vec<u8> {
    let mut fields = vec![
        ("to_epoch", int(to_epoch)),
        ("message", Value::Bytes(message.to_vec())),
    ];
    fields.extend(extra);
    cbor(fields)
}

/// A decoded CBOR map's field.
pub fn field(payload: &[u8], name: &str) -> Option<Value> {
    let v: Value = ciborium::from_reader(payload).ok()?;
    v.into_map()
        .ok()?
        .into_iter()
        .find(|(k, _)| k.as_text() == Some(name))
        .map(|(_, v)| v)
}

/// An error frame's message.
pub fn error_message(payload: &[u8]) -> String {
    field(payload, "message")
        .and_then(|v| v.into_text().ok())
        .unwrap_or_else(|| format!("(undecodable error payload {payload:?})"))
}

/// One frame read from a raw connection: kind, id, payload. Refuses payloads over
/// 1 MiB (a test never expects one).
pub fn read_frame(s: &mut TcpStream) -> std::io::Result<(u8, u64, Vec<u8>)> {
    let mut h = [0u8; 16];
    s.read_exact(&mut h)?;
    assert_eq!(&h[..3], b"TE\x02", "a frame from the engine: {h:?}");
    let len = u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize;
    assert!(len <= MIB, "a {len}-byte frame");
    let id = u64::from_le_bytes(h[8..].try_into().unwrap());
    let mut p = vec![0; len];
    s.read_exact(&mut p)?;
    Ok((h[3], id, p))
}

/// A raw connection to a control plane, with a read timeout.
pub fn raw(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect to the control plane");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// A raw peer's handshake with an engine that has no token: hello, welcome, ready.
/// Returns the stream and the ready payload, or the engine's error message.
pub fn handshake(addr: &str, name: &str, epoch: u64) -> Result<(TcpStream, Vec<u8>), String> {
    let mut s = raw(addr);
    s.write_all(&frame(kind::HELLO, 0, &hello((2, 2), name, epoch)))
        .map_err(|e| e.to_string())?;
    for expected in [kind::WELCOME, kind::READY] {
        let (k, _, p) = read_frame(&mut s).map_err(|e| e.to_string())?;
        if k == kind::ERROR {
            return Err(error_message(&p));
        }
        assert_eq!(k, expected, "the handshake's frames come in order");
        if k == kind::READY {
            return Ok((s, p));
        }
    }
    unreachable!()
}

/// Reads until the engine closes the connection (or 10 s pass); returns every frame
/// it sent before that.
pub fn frames_until_closed(s: &mut TcpStream) -> Vec<(u8, u64, Vec<u8>)> {
    let mut out = Vec::new();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        match read_frame(s) {
            Ok(f) => out.push(f),
            Err(_) => break,
        }
    }
    out
}

/// The `te` binary.
pub fn te() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_te"));
    c.env_remove("TE_CONFIG").env_remove("RUST_LOG");
    c
}

/// `te serve` in its own process, killed when dropped.
pub struct Serve {
    pub child: Child,
    pub addr: String,
}

impl Serve {
    /// Starts `te serve` with `args` and waits for the address it prints first.
    pub fn start(args: &[&str]) -> Serve {
        let mut child = te()
            .arg("serve")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start te serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line.trim().to_string();
        assert!(addr.contains(':'), "te serve printed `{addr}` first");
        Serve { child, addr }
    }

    /// Its resident set, in KiB.
    pub fn rss_kib(&self) -> u64 {
        self.status("VmRSS:")
    }

    /// Its threads.
    pub fn threads(&self) -> u64 {
        self.status("Threads:")
    }

    /// A number from its `/proc/PID/status`.
    fn status(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("read the server's /proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{field} in /proc status"))
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits (at most `bound`) until `f` holds.
pub fn eventually(bound: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < bound {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}
