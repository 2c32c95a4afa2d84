//! The conformance suite: te's contract, as tests any backend runs.
//!
//! Each test is named as a sentence of the contract and selected by the backend's
//! capabilities. A backend's test target (with `harness = false`) runs it:
//!
//! ```ignore
//! use te_core::testkit::{self, Harness};
//! fn main() {
//!     let h = Harness::new("stub", config).with_slow(slow_config);
//!     testkit::run(testkit::trials(&h));
//! }
//! ```
//!
//! `slow` is a configuration of the same backend whose batches take about 200 ms (the
//! stub's `delay`); tests about deadlines, waiting and shutdown with work in flight need
//! it and are skipped, with the reason in their name, without it.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Failed, Trial};

use crate::{
    Access, Buffer, Completion, Config, Engine, ErrorKind, MemoryDesc, MemoryKind, Notification,
    Peer, RegionDesc, RegionId, Registry, SegmentDesc, TransferOptions, TransferRequest,
    TransferStatus,
};

/// How the suite makes engines of the backend under test.
#[derive(Debug, Clone)]
pub struct Harness {
    label: String,
    config: Config,
    slow: Option<Config>,
    memory: (MemoryKind, MemoryKind),
    remote: Option<(String, Option<String>)>,
}

/// The environment variable that turns a test binary into a remote target (see
/// [`serve_target_if_asked`]); it holds the target's configuration as TOML.
const TARGET_ENV: &str = "TE_TESTKIT_TARGET";
/// The target's memory kind, for a remote target.
const TARGET_MEMORY_ENV: &str = "TE_TESTKIT_TARGET_MEMORY";

impl Harness {
    /// A harness whose engines come from `config`.
    pub fn new(label: &str, config: Config) -> Harness {
        Harness {
            label: label.to_string(),
            config,
            slow: None,
            memory: (MemoryKind::Host, MemoryKind::Host),
            remote: None,
        }
    }

    /// Puts the initiator's buffers in `initiator` memory and the target's in `target`
    /// memory (`host`, `fakedev:0`, `cuda:0`, …) instead of host memory.
    pub fn with_memory(mut self, initiator: MemoryKind, target: MemoryKind) -> Harness {
        self.memory = (initiator, target);
        self
    }

    /// Adds a configuration whose batches take about 200 ms.
    pub fn with_slow(mut self, slow: Config) -> Harness {
        self.slow = Some(slow);
        self
    }

    /// Runs every target engine in a child process: this test binary again, started
    /// with the target's configuration (`config`, or `slow` for the slow tests) as TOML
    /// text. The test's `main` must call [`serve_target_if_asked`] first.
    pub fn with_remote_target(mut self, config: &str, slow: Option<&str>) -> Harness {
        self.remote = Some((config.to_string(), slow.map(str::to_string)));
        self
    }

    fn engine(&self, config: &Config, name: &str) -> Result<Engine, Failed> {
        let mut c = config.clone();
        c.engine.name = format!("{}-{name}", self.label);
        Engine::from_config(&c).map_err(|e| fail(format!("cannot create engine: {e}")))
    }

    fn target(&self, slow: bool) -> Result<Target, Failed> {
        match &self.remote {
            None => {
                let config = if slow {
                    self.slow.as_ref().unwrap_or(&self.config)
                } else {
                    &self.config
                };
                Ok(Target::Local(
                    self.engine(config, "target")?,
                    self.memory.1.clone(),
                ))
            }
            Some((normal, slow_toml)) => {
                let toml = if slow {
                    slow_toml.as_ref().unwrap_or(normal)
                } else {
                    normal
                };
                Ok(Target::Remote(Arc::new(RemoteTarget::spawn(
                    toml,
                    &self.memory.1,
                )?)))
            }
        }
    }

    /// A target with a remotely readable and writable buffer, an initiator with a local
    /// buffer, and the initiator's peer for the target.
    fn pair(&self, slow: bool, len: usize) -> Result<Pair, Failed> {
        let target = self.target(slow)?;
        let config = if slow {
            self.slow.as_ref().unwrap_or(&self.config)
        } else {
            &self.config
        };
        let initiator = self.engine(config, "initiator")?;
        let remote = target.alloc("dst", len, Access::REMOTE_READ_WRITE)?;
        let local = initiator
            .alloc_on(&self.memory.0, "src", len, Access::LOCAL)
            .map_err(e2f)?;
        let peer = initiator.connect(&target.address()).map_err(e2f)?;
        let remote_desc = peer
            .region("dst")
            .ok_or_else(|| fail("the target's region is not in its descriptor"))?;
        if remote_desc.kind != self.memory.1 {
            return Err(fail(format!(
                "the target's buffer is {} memory, not {}",
                remote_desc.kind, self.memory.1
            )));
        }
        Ok(Pair {
            remote_desc,
            peer,
            local,
            remote,
            initiator,
            target,
        })
    }
}

/// Field order matters: buffers deregister before their engines go.
struct Pair {
    remote_desc: RegionDesc,
    peer: Peer,
    local: Buffer,
    remote: TargetBuffer,
    initiator: Engine,
    target: Target,
}

/// The target engine: in this process, or in a child process.
enum Target {
    Local(Engine, MemoryKind),
    Remote(Arc<RemoteTarget>),
}

enum TargetBuffer {
    Local(Buffer),
    Remote(Arc<RemoteTarget>, RegionId),
}

impl Target {
    fn address(&self) -> String {
        match self {
            Target::Local(e, _) => e.address().to_string(),
            Target::Remote(r) => r.address.clone(),
        }
    }

    fn epoch(&self) -> u64 {
        match self {
            Target::Local(e, _) => e.epoch(),
            Target::Remote(r) => r.epoch,
        }
    }

    fn alloc(&self, name: &str, len: usize, access: Access) -> Result<TargetBuffer, Failed> {
        match self {
            Target::Local(e, kind) => e
                .alloc_on(kind, name, len, access)
                .map(TargetBuffer::Local)
                .map_err(e2f),
            Target::Remote(r) => {
                let access = format!(
                    "{}{}",
                    u8::from(access.remote_read),
                    u8::from(access.remote_write)
                );
                let id = r.call(&format!("alloc {name} {len} {access}"))?;
                let id = id
                    .parse()
                    .map_err(|_| fail(format!("bad region id from the target: {id}")))?;
                Ok(TargetBuffer::Remote(r.clone(), RegionId(id)))
            }
        }
    }

    fn recv_notification(&self, timeout: Duration) -> Result<Option<Notification>, Failed> {
        match self {
            Target::Local(e, _) => Ok(e.recv_notification(timeout)),
            Target::Remote(r) => {
                let reply = r.call(&format!("notification {}", timeout.as_millis()))?;
                if reply == "none" {
                    return Ok(None);
                }
                let mut parts = reply.split(' ');
                let (epoch, message) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
                Ok(Some(Notification {
                    from: String::new(),
                    from_epoch: epoch
                        .parse()
                        .map_err(|_| fail(format!("bad notification: {reply}")))?,
                    message: unhex(message)?,
                }))
            }
        }
    }
}

impl TargetBuffer {
    fn id(&self) -> RegionId {
        match self {
            TargetBuffer::Local(b) => b.id(),
            TargetBuffer::Remote(_, id) => *id,
        }
    }

    fn to_vec(&self) -> crate::Result<Vec<u8>> {
        match self {
            TargetBuffer::Local(b) => b.to_vec(),
            TargetBuffer::Remote(r, id) => r
                .call(&format!("read {}", id.0))
                .map_err(|e| crate::Error::new(ErrorKind::Io, format!("{e:?}")))
                .and_then(|hex| {
                    unhex(&hex)
                        .map_err(|e| crate::Error::new(ErrorKind::Protocol, format!("{e:?}")))
                }),
        }
    }

    fn read(&self, offset: usize, out: &mut [u8]) -> crate::Result<()> {
        let all = self.to_vec()?;
        let src = all
            .get(offset..offset + out.len())
            .ok_or_else(|| crate::Error::new(ErrorKind::OutOfBounds, "read past the buffer"))?;
        out.copy_from_slice(src);
        Ok(())
    }
}

impl Drop for TargetBuffer {
    fn drop(&mut self) {
        if let TargetBuffer::Remote(r, id) = self {
            let _ = r.call(&format!("free {}", id.0));
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>, Failed> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2).unwrap_or("zz"), 16))
        .collect::<Result<_, _>>()
        .map_err(|_| fail("the target sent malformed hex"))
}

/// A target engine in a child process, driven over its stdin and stdout, one line per
/// command and one per reply (`ok …` or `err …`).
struct RemoteTarget {
    io: Mutex<(ChildStdin, BufReader<ChildStdout>)>,
    child: Mutex<Child>,
    address: String,
    epoch: u64,
}

impl RemoteTarget {
    fn spawn(config: &str, memory: &MemoryKind) -> Result<RemoteTarget, Failed> {
        let exe = std::env::current_exe().map_err(|e| fail(format!("no test executable: {e}")))?;
        let mut child = Command::new(exe)
            .env(TARGET_ENV, config)
            .env(TARGET_MEMORY_ENV, memory.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| fail(format!("cannot start the target process: {e}")))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(fail("the target process has no pipes"));
        };
        let mut stdout = BufReader::new(stdout);
        let mut line = String::new();
        let _ = stdout.read_line(&mut line);
        let mut parts = line
            .trim()
            .strip_prefix("ready ")
            .unwrap_or_default()
            .split(' ');
        let (address, epoch) = (
            parts.next().unwrap_or_default().to_string(),
            parts.next().unwrap_or_default(),
        );
        let Ok(epoch) = epoch.parse() else {
            let _ = child.kill();
            return Err(fail(format!("the target process did not start: {line:?}")));
        };
        Ok(RemoteTarget {
            io: Mutex::new((stdin, stdout)),
            child: Mutex::new(child),
            address,
            epoch,
        })
    }

    fn call(&self, command: &str) -> Result<String, Failed> {
        let mut io = self.io.lock().unwrap_or_else(|p| p.into_inner());
        writeln!(io.0, "{command}")
            .map_err(|e| fail(format!("the target process is gone: {e}")))?;
        let mut line = String::new();
        io.1.read_line(&mut line)
            .map_err(|e| fail(format!("the target process is gone: {e}")))?;
        let line = line.trim_end();
        match line.strip_prefix("ok") {
            Some(rest) => Ok(rest.trim_start().to_string()),
            None => Err(fail(format!("the target refused `{command}`: {line}"))),
        }
    }
}

impl Drop for RemoteTarget {
    fn drop(&mut self) {
        let mut child = self.child.lock().unwrap_or_else(|p| p.into_inner());
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// If this process was started as a remote conformance target, serves as one and
/// exits; otherwise returns at once. Call it first in a test binary's `main`.
pub fn serve_target_if_asked() {
    let Ok(toml) = std::env::var(TARGET_ENV) else {
        return;
    };
    let code = match serve_target(&toml) {
        Ok(()) => 0,
        Err(e) => {
            println!("err {e}");
            1
        }
    };
    std::process::exit(code);
}

fn serve_target(toml: &str) -> crate::Result<()> {
    let config = Config::from_toml(toml, "remote target", std::path::Path::new("."))?;
    let memory: MemoryKind = std::env::var(TARGET_MEMORY_ENV)
        .unwrap_or_else(|_| "host".into())
        .parse()?;
    let engine = Engine::from_config(&config)?;
    let mut buffers: std::collections::HashMap<u64, Buffer> = std::collections::HashMap::new();
    let mut out = std::io::stdout();
    let _ = writeln!(out, "ready {} {}", engine.address(), engine.epoch());
    for line in std::io::stdin().lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split(' ').collect();
        let reply: crate::Result<String> = match words.as_slice() {
            ["alloc", name, len, access] => {
                let len = len.parse().unwrap_or(0);
                let access = Access {
                    remote_read: access.starts_with('1'),
                    remote_write: access.ends_with('1'),
                };
                engine.alloc_on(&memory, name, len, access).map(|b| {
                    let id = b.id().0;
                    buffers.insert(id, b);
                    id.to_string()
                })
            }
            ["read", id] => match buffers.get(&id.parse().unwrap_or(0)) {
                Some(b) => b.to_vec().map(|v| hex(&v)),
                None => Err(crate::Error::new(
                    ErrorKind::NotRegistered,
                    "no such buffer",
                )),
            },
            ["free", id] => {
                buffers.remove(&id.parse().unwrap_or(0));
                Ok(String::new())
            }
            ["notification", ms] => {
                let timeout = Duration::from_millis(ms.parse().unwrap_or(0));
                Ok(match engine.recv_notification(timeout) {
                    Some(n) => format!("{} {}", n.from_epoch, hex(&n.message)),
                    None => "none".into(),
                })
            }
            _ => Err(crate::Error::new(
                ErrorKind::InvalidRequest,
                format!("unknown command {line:?}"),
            )),
        };
        let _ = match reply {
            Ok(r) => writeln!(out, "ok {r}"),
            Err(e) => writeln!(out, "err {e}"),
        };
        let _ = out.flush();
    }
    Ok(())
}

fn fail(m: impl Into<String>) -> Failed {
    Failed::from(m.into())
}

fn e2f(e: crate::Error) -> Failed {
    fail(e.to_string())
}

macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(fail(format!($($msg)+)));
        }
    };
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn expect_kind(
    r: crate::Result<impl std::fmt::Debug>,
    kind: ErrorKind,
    what: &str,
) -> Result<(), Failed> {
    match r {
        Err(e) if e.kind() == kind => Ok(()),
        Err(e) => Err(fail(format!("{what}: expected {kind}, got {:?}", e))),
        Ok(v) => Err(fail(format!("{what}: expected {kind}, got Ok({v:?})"))),
    }
}

type Test = fn(&Harness) -> Result<(), Failed>;

/// Every contract test that applies to the harness's backend.
pub fn trials(h: &Harness) -> Vec<Trial> {
    let caps = match Registry::discover(&h.config.engine.plugin_dirs)
        .get(&h.config.engine.backend)
        .and_then(|e| e.create(&h.config.backend_context(&h.config.engine.backend)))
    {
        Ok(b) => b.info().capabilities.clone(),
        Err(e) => {
            let msg = e.to_string();
            return vec![Trial::test(
                format!("{}::backend_can_be_created", h.label),
                move || Err(fail(msg)),
            )];
        }
    };
    let mut tests: Vec<(&str, Test, bool)> = vec![
        ("an_empty_batch_completes", an_empty_batch_completes, true),
        (
            "completion_is_delivered_exactly_once",
            completion_is_delivered_exactly_once,
            true,
        ),
        (
            "out_of_bounds_requests_are_refused_before_posting",
            out_of_bounds_requests_are_refused_before_posting,
            true,
        ),
        (
            "unknown_region_requests_are_refused_before_posting",
            unknown_region_requests_are_refused_before_posting,
            true,
        ),
        (
            "zero_length_requests_are_refused",
            zero_length_requests_are_refused,
            true,
        ),
        (
            "deregistered_regions_are_refused",
            deregistered_regions_are_refused,
            caps.write,
        ),
        (
            "write_then_read_back_gives_the_same_bytes",
            write_then_read_back_gives_the_same_bytes,
            caps.read && caps.write,
        ),
        (
            "a_write_into_a_region_without_remote_write_is_refused",
            a_write_into_a_region_without_remote_write_is_refused,
            caps.write,
        ),
        (
            "a_read_of_a_region_without_remote_read_is_refused",
            a_read_of_a_region_without_remote_read_is_refused,
            caps.read,
        ),
        (
            "notifications_arrive_after_the_data",
            notifications_arrive_after_the_data,
            caps.write,
        ),
        (
            "many_concurrent_batches_from_several_threads_all_complete",
            many_concurrent_batches_from_several_threads_all_complete,
            caps.write,
        ),
        (
            "a_second_connect_returns_the_cached_peer",
            a_second_connect_returns_the_cached_peer,
            true,
        ),
        (
            "regions_registered_after_connect_are_reachable",
            regions_registered_after_connect_are_reachable,
            caps.write,
        ),
        (
            "requests_with_unsupported_memory_are_refused_at_register",
            requests_with_unsupported_memory_are_refused_at_register,
            true,
        ),
    ];
    let slow: Vec<(&str, Test)> = vec![
        (
            "a_batch_past_its_deadline_fails_with_timeout_and_is_released",
            a_batch_past_its_deadline_fails_with_timeout_and_is_released,
        ),
        (
            "a_waiting_thread_uses_almost_no_cpu",
            a_waiting_thread_uses_almost_no_cpu,
        ),
        (
            "dropping_the_engine_with_batches_in_flight_neither_hangs_nor_crashes",
            dropping_the_engine_with_batches_in_flight_neither_hangs_nor_crashes,
        ),
        (
            "a_handle_can_be_awaited_as_a_future",
            a_handle_can_be_awaited_as_a_future,
        ),
    ];
    for (name, test) in slow {
        tests.push((name, test, caps.write));
    }
    tests
        .into_iter()
        .map(|(name, test, applies)| {
            let h = h.clone();
            let needs_slow = h.slow.is_none() && SLOW_TESTS.contains(&name);
            Trial::test(format!("{}::{name}", h.label), move || test(&h))
                .with_ignored_flag(!applies || needs_slow)
        })
        .collect()
}

const SLOW_TESTS: &[&str] = &[
    "a_batch_past_its_deadline_fails_with_timeout_and_is_released",
    "a_waiting_thread_uses_almost_no_cpu",
    "dropping_the_engine_with_batches_in_flight_neither_hangs_nor_crashes",
    "a_handle_can_be_awaited_as_a_future",
];

/// Runs trials as a test binary's `main` does, exiting with the result.
pub fn run(trials: Vec<Trial>) -> ! {
    libtest_mimic::run(&Arguments::from_args(), trials).exit()
}

fn an_empty_batch_completes(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(false, 4096)?;
    let handle = p.initiator.transfer(&p.peer, &[]).map_err(e2f)?;
    ensure!(
        handle
            .wait_timeout(Duration::from_secs(5))
            .is_some_and(|r| r.is_ok()),
        "empty batch did not complete"
    );
    ensure!(
        matches!(handle.status(), TransferStatus::Done),
        "status is not Done"
    );
    Ok(())
}

fn write_then_read_back_gives_the_same_bytes(h: &Harness) -> Result<(), Failed> {
    let len = 1 << 20;
    let p = h.pair(false, len)?;
    let data = pattern(len, 7);
    p.local.write(0, &data).map_err(e2f)?;
    let rid = p.remote_desc.id;
    // Four requests, one per quarter, written out of order.
    let q = (len / 4) as u64;
    let writes: Vec<_> = [3u64, 0, 2, 1]
        .iter()
        .map(|&i| TransferRequest::write(p.local.id(), i * q, rid, i * q, q))
        .collect();
    p.initiator
        .transfer(&p.peer, &writes)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    ensure!(
        p.remote.to_vec().map_err(e2f)? == data,
        "the target's bytes differ from what was written"
    );
    p.local.write(0, &vec![0; len]).map_err(e2f)?;
    let reads = [TransferRequest::read(p.local.id(), 0, rid, 0, len as u64)];
    p.initiator
        .transfer(&p.peer, &reads)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    ensure!(
        p.local.to_vec().map_err(e2f)? == data,
        "bytes read back differ"
    );
    Ok(())
}

fn completion_is_delivered_exactly_once(h: &Harness) -> Result<(), Failed> {
    // Straight at the backend, below the engine, which would hide a second completion.
    let registry = Registry::discover(&h.config.engine.plugin_dirs);
    let entry = registry.get(&h.config.engine.backend).map_err(e2f)?;
    let ctx = h.config.backend_context(&h.config.engine.backend);
    let a = entry.create(&ctx).map_err(e2f)?;
    let b = entry.create(&ctx).map_err(e2f)?;
    let (mut src, mut dst) = (vec![1u8; 4096], vec![0u8; 4096]);
    let desc = |v: &mut Vec<u8>, access| MemoryDesc {
        name: "m".into(),
        addr: v.as_mut_ptr() as u64,
        len: v.len() as u64,
        kind: MemoryKind::Host,
        access,
    };
    a.register(RegionId(1), &desc(&mut src, Access::LOCAL))
        .map_err(e2f)?;
    let key = b
        .register(RegionId(1), &desc(&mut dst, Access::REMOTE_READ_WRITE))
        .map_err(e2f)?;
    let seg = SegmentDesc {
        engine: "b".into(),
        epoch: 1,
        backend: b.info().name.clone(),
        endpoint: b.endpoint(),
        regions: vec![RegionDesc {
            id: RegionId(1),
            name: "m".into(),
            addr: dst.as_ptr() as u64,
            len: 4096,
            kind: MemoryKind::Host,
            access: Access::REMOTE_READ_WRITE,
            key,
        }],
        layouts: Vec::new(),
    };
    let peer = a.connect(&seg).map_err(e2f)?;
    let n = 64;
    let counts: Arc<Vec<AtomicUsize>> = Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
    for i in 0..n {
        let c = counts.clone();
        let done = Completion::new(Duration::from_secs(10), move |_, _| {
            c[i].fetch_add(1, Ordering::SeqCst);
        });
        let req =
            TransferRequest::write(RegionId(1), 64 * i as u64, RegionId(1), 64 * i as u64, 64);
        if a.submit(peer, &[req], done).is_err() {
            return Err(fail(format!("submit {i} failed")));
        }
    }
    let end = Instant::now() + Duration::from_secs(10);
    while counts.iter().any(|c| c.load(Ordering::SeqCst) == 0) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(50));
    for (i, c) in counts.iter().enumerate() {
        let c = c.load(Ordering::SeqCst);
        ensure!(c == 1, "batch {i} completed {c} times");
    }
    a.deregister(RegionId(1)).map_err(e2f)?;
    b.deregister(RegionId(1)).map_err(e2f)?;
    Ok(())
}

fn out_of_bounds_requests_are_refused_before_posting(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(false, 4096)?;
    p.local.write(0, &[9; 4096]).map_err(e2f)?;
    let (l, r) = (p.local.id(), p.remote_desc.id);
    for (req, what) in [
        (
            TransferRequest::write(l, 0, r, 4000, 200),
            "remote end past the region",
        ),
        (
            TransferRequest::write(l, 4000, r, 0, 200),
            "local end past the region",
        ),
        (
            TransferRequest::write(l, 0, r, u64::MAX - 10, 100),
            "remote offset overflowing",
        ),
        (
            TransferRequest::read(l, 0, r, 0, 4097),
            "read longer than the region",
        ),
    ] {
        let good = TransferRequest::write(l, 0, r, 0, 16);
        expect_kind(
            p.initiator.transfer(&p.peer, &[good, req]),
            ErrorKind::OutOfBounds,
            what,
        )?;
    }
    ensure!(
        p.remote.to_vec().map_err(e2f)? == vec![0; 4096],
        "a refused batch changed the target's memory"
    );
    Ok(())
}

fn unknown_region_requests_are_refused_before_posting(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(false, 4096)?;
    let req = TransferRequest::write(p.local.id(), 0, RegionId(987_654), 0, 16);
    expect_kind(
        p.initiator.transfer(&p.peer, &[req]),
        ErrorKind::NotRegistered,
        "unknown remote region",
    )?;
    let req = TransferRequest::write(RegionId(987_654), 0, p.remote_desc.id, 0, 16);
    expect_kind(
        p.initiator.transfer(&p.peer, &[req]),
        ErrorKind::NotRegistered,
        "unknown local region",
    )
}

fn zero_length_requests_are_refused(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(false, 4096)?;
    let req = TransferRequest::write(p.local.id(), 0, p.remote_desc.id, 0, 0);
    expect_kind(
        p.initiator.transfer(&p.peer, &[req]),
        ErrorKind::InvalidRequest,
        "zero length",
    )
}

fn deregistered_regions_are_refused(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(false, 4096)?;
    let extra = p
        .initiator
        .alloc("extra", 4096, Access::LOCAL)
        .map_err(e2f)?;
    let gone = extra.id();
    drop(extra);
    let req = TransferRequest::write(gone, 0, p.remote_desc.id, 0, 16);
    expect_kind(
        p.initiator.transfer(&p.peer, &[req]),
        ErrorKind::NotRegistered,
        "deregistered local region",
    )?;
    // A remote region deregistered after the initiator fetched the descriptor is still
    // listed there; the target's own check refuses it and the batch fails.
    let target_extra = p.target.alloc("gone", 4096, Access::REMOTE_READ_WRITE)?;
    let peer = p
        .initiator
        .connect(&p.target.address().to_string())
        .map_err(e2f)?;
    let _ = peer.region("gone");
    let stale = p.initiator.transfer(&peer, &[]).map_err(e2f)?;
    stale.wait().map_err(e2f)?;
    let rid = target_extra.id();
    let probe = TransferRequest::write(p.local.id(), 0, rid, 0, 16);
    // Make sure the initiator knows the region before it goes away.
    p.initiator
        .transfer(&peer, &[probe])
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    drop(target_extra);
    match p.initiator.transfer(&peer, &[probe]) {
        Err(e) if e.kind() == ErrorKind::NotRegistered => Ok(()),
        Err(e) => Err(fail(format!("expected NotRegistered, got {e:?}"))),
        Ok(handle) => expect_kind(
            handle.wait(),
            ErrorKind::NotRegistered,
            "write into a deregistered remote region",
        ),
    }
}

fn a_write_into_a_region_without_remote_write_is_refused(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(false, 4096)?;
    let ro = p.target.alloc("ro", 4096, Access::REMOTE_READ)?;
    let peer = p
        .initiator
        .connect(&p.target.address().to_string())
        .map_err(e2f)?;
    let req = TransferRequest::write(p.local.id(), 0, ro.id(), 0, 16);
    expect_kind(
        p.initiator.transfer(&peer, &[req]),
        ErrorKind::InvalidRequest,
        "write into a read-only region",
    )
}

fn a_read_of_a_region_without_remote_read_is_refused(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(false, 4096)?;
    let wo = p.target.alloc(
        "wo",
        4096,
        Access {
            remote_read: false,
            remote_write: true,
        },
    )?;
    let peer = p
        .initiator
        .connect(&p.target.address().to_string())
        .map_err(e2f)?;
    let req = TransferRequest::read(p.local.id(), 0, wo.id(), 0, 16);
    expect_kind(
        p.initiator.transfer(&peer, &[req]),
        ErrorKind::InvalidRequest,
        "read of a write-only region",
    )
}

fn notifications_arrive_after_the_data(h: &Harness) -> Result<(), Failed> {
    let len = 256 << 10;
    let p = h.pair(false, len)?;
    for round in 0..8u8 {
        let data = pattern(len, round);
        p.local.write(0, &data).map_err(e2f)?;
        let options = TransferOptions {
            notify: Some(vec![round]),
            ..TransferOptions::default()
        };
        let req = TransferRequest::write(p.local.id(), 0, p.remote_desc.id, 0, len as u64);
        let handle = p
            .initiator
            .transfer_with(&p.peer, &[req], &options)
            .map_err(e2f)?;
        let n = p
            .target
            .recv_notification(Duration::from_secs(10))?
            .ok_or_else(|| fail("no notification within 10 s"))?;
        // The data must already be there when the notification is seen.
        ensure!(
            p.remote.to_vec().map_err(e2f)? == data,
            "round {round}: notification arrived before the data"
        );
        ensure!(
            n.message == [round] && n.from_epoch == p.initiator.epoch(),
            "round {round}: wrong notification {n:?}"
        );
        handle.wait().map_err(e2f)?;
    }
    Ok(())
}

fn many_concurrent_batches_from_several_threads_all_complete(h: &Harness) -> Result<(), Failed> {
    let threads = 4;
    let per_thread = 50;
    let block = 4096usize;
    let p = h.pair(false, threads * per_thread * block)?;
    p.local
        .write(0, &pattern(threads * per_thread * block, 3))
        .map_err(e2f)?;
    let errors = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for t in 0..threads {
            let (p, errors) = (&p, &errors);
            s.spawn(move || {
                let mut handles = Vec::new();
                for i in 0..per_thread {
                    let off = ((t * per_thread + i) * block) as u64;
                    let req = TransferRequest::write(
                        p.local.id(),
                        off,
                        p.remote_desc.id,
                        off,
                        block as u64,
                    );
                    match p.initiator.transfer(&p.peer, &[req]) {
                        Ok(hd) => handles.push(hd),
                        Err(e) => errors
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(e.to_string()),
                    }
                }
                for hd in handles {
                    if let Err(e) = hd.wait() {
                        errors
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(e.to_string());
                    }
                }
            });
        }
    });
    let errors = errors.into_inner().unwrap_or_else(|p| p.into_inner());
    ensure!(
        errors.is_empty(),
        "{} batches failed, first: {}",
        errors.len(),
        errors[0]
    );
    ensure!(
        p.remote.to_vec().map_err(e2f)? == p.local.to_vec().map_err(e2f)?,
        "the target's bytes differ"
    );
    Ok(())
}

fn a_second_connect_returns_the_cached_peer(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(false, 4096)?;
    let again = p
        .initiator
        .connect(&p.target.address().to_string())
        .map_err(e2f)?;
    ensure!(
        again.epoch() == p.peer.epoch() && again.epoch() == p.target.epoch(),
        "epochs differ"
    );
    ensure!(
        Arc::ptr_eq(&again.segment(), &p.peer.segment()),
        "a second connect did a new handshake"
    );
    Ok(())
}

fn regions_registered_after_connect_are_reachable(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(false, 4096)?;
    let late = p.target.alloc("late", 4096, Access::REMOTE_READ_WRITE)?;
    p.local.write(0, &[5; 64]).map_err(e2f)?;
    let req = TransferRequest::write(p.local.id(), 0, late.id(), 0, 64);
    p.initiator
        .transfer(&p.peer, &[req])
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    let mut got = [0u8; 64];
    late.read(0, &mut got).map_err(e2f)?;
    ensure!(got == [5; 64], "the late region did not receive the bytes");
    Ok(())
}

fn requests_with_unsupported_memory_are_refused_at_register(h: &Harness) -> Result<(), Failed> {
    let e = h.engine(&h.config, "mem")?;
    let desc = MemoryDesc {
        name: "dev".into(),
        addr: 0x1000,
        len: 4096,
        kind: MemoryKind::Device {
            runtime: "nosuchruntime".into(),
            ordinal: 0,
        },
        access: Access::LOCAL,
    };
    // SAFETY: the registration is refused before anything touches the address.
    expect_kind(
        unsafe { e.register(desc) },
        ErrorKind::Unsupported,
        "unknown device runtime",
    )
}

fn a_batch_past_its_deadline_fails_with_timeout_and_is_released(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(true, 4096)?;
    let req = TransferRequest::write(p.local.id(), 0, p.remote_desc.id, 0, 16);
    let options = TransferOptions {
        timeout: Some(Duration::from_millis(20)),
        ..TransferOptions::default()
    };
    let start = Instant::now();
    let handle = p
        .initiator
        .transfer_with(&p.peer, &[req], &options)
        .map_err(e2f)?;
    expect_kind(handle.wait(), ErrorKind::Timeout, "batch past its deadline")?;
    ensure!(
        start.elapsed() < Duration::from_millis(150),
        "the timeout fired late: {:?}",
        start.elapsed()
    );
    // The engine keeps working afterwards.
    let handle = p.initiator.transfer(&p.peer, &[req]).map_err(e2f)?;
    handle.wait().map_err(e2f)
}

fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec; the clock id is a constant Linux provides.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn a_waiting_thread_uses_almost_no_cpu(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(true, 4096)?;
    let req = TransferRequest::write(p.local.id(), 0, p.remote_desc.id, 0, 16);
    let handle = p.initiator.transfer(&p.peer, &[req]).map_err(e2f)?;
    let (cpu0, wall0) = (thread_cpu_time(), Instant::now());
    handle.wait().map_err(e2f)?;
    let (cpu, wall) = (thread_cpu_time() - cpu0, wall0.elapsed());
    ensure!(
        wall >= Duration::from_millis(100),
        "the slow batch took only {wall:?}; the slow config is not slow"
    );
    ensure!(
        cpu * 20 < wall,
        "the waiting thread used {cpu:?} of CPU in {wall:?} (more than 5%)"
    );
    Ok(())
}

fn dropping_the_engine_with_batches_in_flight_neither_hangs_nor_crashes(
    h: &Harness,
) -> Result<(), Failed> {
    let p = h.pair(true, 64 << 10)?;
    let mut handles = Vec::new();
    for i in 0..16u64 {
        let req = TransferRequest::write(p.local.id(), i * 4096, p.remote_desc.id, i * 4096, 4096);
        handles.push(p.initiator.transfer(&p.peer, &[req]).map_err(e2f)?);
    }
    let start = Instant::now();
    let Pair {
        remote_desc: _,
        peer,
        local,
        remote,
        initiator,
        target,
    } = p;
    drop(initiator);
    drop(target);
    drop(peer);
    drop(local);
    drop(remote);
    for hd in handles {
        // Each either completed or failed; none may hang.
        ensure!(
            hd.wait_timeout(Duration::from_secs(10)).is_some(),
            "a batch hung after the engines were dropped"
        );
    }
    ensure!(
        start.elapsed() < Duration::from_secs(10),
        "dropping took {:?}",
        start.elapsed()
    );
    Ok(())
}

fn a_handle_can_be_awaited_as_a_future(h: &Harness) -> Result<(), Failed> {
    use std::future::Future;
    use std::task::{Context, Poll, Wake, Waker};
    struct Flag(Mutex<bool>, std::sync::Condvar);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            *self.0.lock().unwrap_or_else(|p| p.into_inner()) = true;
            self.1.notify_all();
        }
    }
    let p = h.pair(true, 4096)?;
    let req = TransferRequest::write(p.local.id(), 0, p.remote_desc.id, 0, 16);
    let mut handle = p.initiator.transfer(&p.peer, &[req]).map_err(e2f)?;
    let flag = Arc::new(Flag(Mutex::new(false), std::sync::Condvar::new()));
    let waker = Waker::from(flag.clone());
    let mut cx = Context::from_waker(&waker);
    ensure!(
        std::pin::Pin::new(&mut handle).poll(&mut cx).is_pending(),
        "a slow batch was ready at once"
    );
    let woken = flag.0.lock().unwrap_or_else(|p| p.into_inner());
    let (woken, _) = flag
        .1
        .wait_timeout_while(woken, Duration::from_secs(10), |w| !*w)
        .unwrap_or_else(|p| p.into_inner());
    ensure!(*woken, "the waker was not called");
    drop(woken);
    match std::pin::Pin::new(&mut handle).poll(&mut cx) {
        Poll::Ready(r) => r.map_err(e2f),
        Poll::Pending => Err(fail("woken but still pending")),
    }
}
