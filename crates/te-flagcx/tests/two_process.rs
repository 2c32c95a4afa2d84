//! The flagcx backend across two processes, over the FAKE shim (loopback TCP).
//!
//! Each test spawns this binary again as a target (`TE_FLAGCX_ROLE=target`): an engine
//! with a remotely writable 2 MiB region `dst`, driven by one-line commands on stdin.
//! The initiator runs here. Fault injection is the fake's (`shim_options`).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::{Arguments, Failed, Trial};
use te_core::{
    Access, Buffer, Config, Engine, ErrorKind, Peer, RegionId, TransferOptions, TransferRequest,
};

use te_flagcx as _;

const ROLE: &str = "TE_FLAGCX_ROLE";
const TARGET_OPTIONS: &str = "TE_FLAGCX_TARGET_OPTIONS";
const DST: usize = 2 << 20;

fn shim() -> &'static str {
    match option_env!("TE_FLAGCX_FAKE_SHIM_PATH") {
        Some(p) => p,
        None => {
            panic!("the fake FlagCX shim was not built (no C compiler?); see the build warnings")
        }
    }
}

fn config(options: &str) -> Config {
    let text = format!(
        "[engine]\nbackend = \"flagcx\"\ndefault_timeout = \"20s\"\n[backends.flagcx]\nshim = \"{}\"\nshim_options = \"{options}\"\n",
        shim()
    );
    Config::from_toml(&text, "flagcx-two-process.toml", Path::new(".")).expect("valid config")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

// ---------------------------------------------------------------- the target process

fn target_main() {
    let options = std::env::var(TARGET_OPTIONS).unwrap_or_default();
    let engine = Engine::from_config(&config(&options)).expect("target engine");
    let mut buffers: HashMap<String, Buffer> = HashMap::new();
    let dst = engine
        .alloc("dst", DST, Access::REMOTE_READ_WRITE)
        .expect("alloc dst");
    buffers.insert("dst".into(), dst);
    let mut out = std::io::stdout().lock();
    writeln!(out, "addr {}", engine.address()).expect("stdout");
    out.flush().expect("stdout");
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        let answer = match words.as_slice() {
            ["alloc", name, len] => {
                let len = len.parse().expect("length");
                let b = engine
                    .alloc(name, len, Access::REMOTE_READ_WRITE)
                    .expect("alloc");
                let id = b.id().0;
                buffers.insert(name.to_string(), b);
                format!("ok {id}")
            }
            ["free", name] => {
                buffers.remove(*name);
                "ok".into()
            }
            ["sum", name, off, len] => {
                let b = &buffers[*name];
                let mut bytes = vec![0; len.parse().expect("len")];
                b.read(off.parse().expect("offset"), &mut bytes)
                    .expect("read");
                format!("sum {:x}", fnv(&bytes))
            }
            ["fill", name, seed] => {
                let b = &buffers[*name];
                b.write(0, &pattern(b.len(), seed.parse().expect("seed")))
                    .expect("write");
                "ok".into()
            }
            ["notif", ms] => {
                match engine.recv_notification(Duration::from_millis(ms.parse().expect("ms"))) {
                    // The data must be there when the notification is: sum it at once.
                    Some(n) => format!(
                        "notif {} {:x}",
                        String::from_utf8_lossy(&n.message),
                        fnv(&buffers["dst"].to_vec().expect("read dst"))
                    ),
                    None => "none".into(),
                }
            }
            ["quit"] => break,
            _ => format!("error unknown command `{line}`"),
        };
        writeln!(out, "{answer}").expect("stdout");
        out.flush().expect("stdout");
    }
}

// ---------------------------------------------------------------- the initiator side

struct Target {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    addr: String,
}

impl Target {
    fn spawn(options: &str) -> Result<Target, Failed> {
        let mut child = Command::new(std::env::current_exe().map_err(|e| e.to_string())?)
            .env(ROLE, "target")
            .env(TARGET_OPTIONS, options)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot spawn the target process: {e}"))?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let mut stdout = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        let mut line = String::new();
        stdout.read_line(&mut line).map_err(|e| e.to_string())?;
        let addr = line
            .strip_prefix("addr ")
            .ok_or_else(|| format!("the target did not start: `{line}`"))?
            .trim()
            .to_string();
        Ok(Target {
            child,
            stdin,
            stdout,
            addr,
        })
    }

    fn cmd(&mut self, c: &str) -> Result<String, Failed> {
        writeln!(self.stdin, "{c}").map_err(|e| e.to_string())?;
        self.stdin.flush().map_err(|e| e.to_string())?;
        let mut line = String::new();
        self.stdout
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        if line.is_empty() {
            return Err(format!("the target exited during `{c}`").into());
        }
        Ok(line.trim().to_string())
    }

    fn sum(&mut self, name: &str, off: usize, len: usize) -> Result<String, Failed> {
        self.cmd(&format!("sum {name} {off} {len}"))
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Field order: the buffer deregisters before its engine goes.
struct Setup {
    peer: Peer,
    src: Buffer,
    dst: RegionId,
    initiator: Engine,
    target: Target,
}

fn setup(initiator_options: &str, target_options: &str) -> Result<Setup, Failed> {
    let target = Target::spawn(target_options)?;
    let initiator = Engine::from_config(&config(initiator_options)).map_err(e2f)?;
    let src = initiator.alloc("src", DST, Access::LOCAL).map_err(e2f)?;
    let peer = initiator.connect(&target.addr).map_err(e2f)?;
    let dst = peer
        .region("dst")
        .ok_or("the target's `dst` is not in its descriptor")?
        .id;
    Ok(Setup {
        peer,
        src,
        dst,
        initiator,
        target,
    })
}

fn e2f(e: te_core::Error) -> Failed {
    format!("{e:?}").into()
}

macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+).into());
        }
    };
}

type Test = fn() -> Result<(), Failed>;

type FakeCounter = unsafe extern "C" fn(*const std::ffi::c_char) -> u64;

/// A process-wide counter of the fake loaded in this process.
fn counter(name: &str) -> u64 {
    static LIB: std::sync::OnceLock<libloading::Library> = std::sync::OnceLock::new();
    // SAFETY: the fake shim's initializers do nothing; it is the library the backend
    // under test loads from the same path, so this shares its counters.
    let lib =
        LIB.get_or_init(|| unsafe { libloading::Library::new(shim()) }.expect("load the fake"));
    // SAFETY: `te_flagcx_fake_counter` has this signature in fake/fake_shim.c.
    let f = unsafe { lib.get::<FakeCounter>(b"te_flagcx_fake_counter\0") }
        .expect("fake counter symbol");
    let c = std::ffi::CString::new(name).expect("no NUL");
    // SAFETY: `c` is a valid C string for the duration of the call.
    unsafe { f(c.as_ptr()) }
}

// ---------------------------------------------------------------- tests

fn write_then_read_back_across_processes() -> Result<(), Failed> {
    let mut s = setup("", "")?;
    let data = pattern(DST, 11);
    s.src.write(0, &data).map_err(e2f)?;
    let q = (DST / 4) as u64;
    let writes: Vec<_> = [2u64, 0, 3, 1]
        .iter()
        .map(|&i| TransferRequest::write(s.src.id(), i * q, s.dst, i * q, q))
        .collect();
    s.initiator
        .transfer(&s.peer, &writes)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    ensure!(
        s.target.sum("dst", 0, DST)? == format!("sum {:x}", fnv(&data)),
        "the target's bytes differ from what was written"
    );
    s.src.write(0, &vec![0; DST]).map_err(e2f)?;
    let read = [TransferRequest::read(s.src.id(), 0, s.dst, 0, DST as u64)];
    s.initiator
        .transfer(&s.peer, &read)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    ensure!(
        s.src.to_vec().map_err(e2f)? == data,
        "the bytes read back differ"
    );
    Ok(())
}

fn notifications_arrive_after_the_data_across_processes() -> Result<(), Failed> {
    let mut s = setup("", "")?;
    for round in 0..4u8 {
        let data = pattern(DST, round);
        s.src.write(0, &data).map_err(e2f)?;
        let options = TransferOptions {
            notify: Some(format!("round{round}").into_bytes()),
            ..TransferOptions::default()
        };
        let req = [TransferRequest::write(s.src.id(), 0, s.dst, 0, DST as u64)];
        let handle = s
            .initiator
            .transfer_with(&s.peer, &req, &options)
            .map_err(e2f)?;
        let got = s.target.cmd("notif 10000")?;
        ensure!(
            got == format!("notif round{round} {:x}", fnv(&data)),
            "round {round}: the notification came before the data, or not at all: `{got}`"
        );
        handle.wait().map_err(e2f)?;
    }
    Ok(())
}

fn a_region_registered_after_connect_is_reachable_through_a_new_connection() -> Result<(), Failed> {
    let mut s = setup("", "")?;
    // One batch first, so the first connection is surely in use.
    let first = [TransferRequest::write(s.src.id(), 0, s.dst, 0, 64)];
    s.initiator
        .transfer(&s.peer, &first)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    let answer = s.target.cmd("alloc late 65536")?;
    let late = RegionId(
        answer
            .strip_prefix("ok ")
            .ok_or(answer.clone())?
            .parse()
            .map_err(|_| answer.clone())?,
    );
    let data = pattern(65536, 42);
    s.src.write(0, &data).map_err(e2f)?;
    let connects = counter("connects");
    let req = [TransferRequest::write(s.src.id(), 0, late, 0, 65536)];
    s.initiator
        .transfer(&s.peer, &req)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    ensure!(
        counter("connects") > connects,
        "the backend reached the late region without a new connection (the fake's snapshot would refuse it)"
    );
    ensure!(
        s.target.sum("late", 0, 65536)? == format!("sum {:x}", fnv(&data)),
        "the late region did not receive the bytes"
    );
    Ok(())
}

fn a_request_over_the_descriptor_limit_is_split_not_truncated() -> Result<(), Failed> {
    // The fake's 4 KiB limit stands in for FlagCX's 32-bit descriptor size: a
    // 1 MiB + 123 byte request is what a 4 GiB + 123 byte one is to FlagCX.
    let mut s = setup("max_desc=4096", "")?;
    let len = (1 << 20) + 123;
    let data = pattern(len, 5);
    s.src.write(0, &data).map_err(e2f)?;
    let descs = counter("descs");
    let req = [TransferRequest::write(s.src.id(), 0, s.dst, 77, len as u64)];
    s.initiator
        .transfer(&s.peer, &req)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    let posted = counter("descs") - descs;
    ensure!(
        posted >= 257,
        "only {posted} descriptors were posted for {len} bytes at 4 KiB each"
    );
    ensure!(
        s.target.sum("dst", 77, len)? == format!("sum {:x}", fnv(&data)),
        "the target's bytes differ: the request was truncated or misplaced"
    );
    ensure!(
        s.target.sum("dst", 77 + len, 4096)? == format!("sum {:x}", fnv(&[0; 4096])),
        "bytes landed past the end of the request"
    );
    s.src.write(0, &vec![0; len]).map_err(e2f)?;
    let req = [TransferRequest::read(s.src.id(), 0, s.dst, 77, len as u64)];
    s.initiator
        .transfer(&s.peer, &req)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    let mut back = vec![0; len];
    s.src.read(0, &mut back).map_err(e2f)?;
    ensure!(back == data, "the split READ brought back different bytes");
    Ok(())
}

fn an_injected_transfer_failure_fails_only_its_batch() -> Result<(), Failed> {
    let mut s = setup("fail_every=3", "")?;
    let block = 4096u64;
    s.src.write(0, &pattern(DST, 9)).map_err(e2f)?;
    for i in 0..6u64 {
        let req = [TransferRequest::write(
            s.src.id(),
            i * block,
            s.dst,
            i * block,
            block,
        )];
        let r = s.initiator.transfer(&s.peer, &req).map_err(e2f)?.wait();
        if (i + 1) % 3 == 0 {
            let e = r.err().ok_or(format!("batch {i} should have failed"))?;
            ensure!(
                e.kind() == ErrorKind::Backend && e.to_string().contains("failed slice"),
                "batch {i}: unclear error {e:?}"
            );
        } else {
            r.map_err(|e| format!("batch {i} failed: {e:?}"))?;
        }
    }
    ensure!(
        s.peer.is_valid(),
        "a failed transfer must not drop the peer"
    );
    let mut expect = vec![0u8; 6 * block as usize];
    let src = s.src.to_vec().map_err(e2f)?;
    for i in [0usize, 1, 3, 4] {
        let r = i * block as usize..(i + 1) * block as usize;
        expect[r.clone()].copy_from_slice(&src[r]);
    }
    ensure!(
        s.target.sum("dst", 0, expect.len())? == format!("sum {:x}", fnv(&expect)),
        "the target's bytes are not those of the successful batches only"
    );
    Ok(())
}

/// FlagCX reports a transfer whose slices failed as finished; te must fail the batch
/// and send no "data is visible" notification. The fake finishes the transfer with its
/// last descriptor failed, as FlagCX's transfer task would.
fn a_transfer_finished_with_a_failed_slice_fails_and_sends_no_notification() -> Result<(), Failed> {
    let mut s = setup("max_desc=4096,fail_every=1", "")?;
    let len = 4 * 4096;
    s.src.write(0, &pattern(len, 3)).map_err(e2f)?;
    let options = TransferOptions {
        notify: Some(b"landed".to_vec()),
        ..TransferOptions::default()
    };
    let req = [TransferRequest::write(s.src.id(), 0, s.dst, 0, len as u64)];
    let r = s
        .initiator
        .transfer_with(&s.peer, &req, &options)
        .map_err(e2f)?
        .wait();
    let e = r
        .err()
        .ok_or("a WRITE that finished with a failed slice was reported delivered")?;
    ensure!(
        e.kind() == ErrorKind::Backend && e.to_string().contains("1 failed slice(s) of 4"),
        "unclear error for a failed slice: {e:?}"
    );
    let got = s.target.cmd("notif 500")?;
    ensure!(
        got == "none",
        "the target was told the data is visible although a slice failed: `{got}`"
    );
    // The first three slices landed, the last did not: the batch really was partial.
    ensure!(
        s.target.sum("dst", 0, 3 * 4096)? == format!("sum {:x}", fnv(&pattern(len, 3)[..3 * 4096])),
        "the slices that did not fail are missing"
    );
    ensure!(
        s.target.sum("dst", 3 * 4096, 4096)? == format!("sum {:x}", fnv(&[0; 4096])),
        "the failed slice's bytes arrived after all"
    );
    Ok(())
}

fn an_injected_stale_registration_fails_its_batch_and_the_next_one_reconnects() -> Result<(), Failed>
{
    let s = setup("stale_every=2", "")?;
    let req = [TransferRequest::write(s.src.id(), 0, s.dst, 0, 4096)];
    s.initiator
        .transfer(&s.peer, &req)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    let connects = counter("connects");
    let e = s
        .initiator
        .transfer(&s.peer, &req)
        .map_err(e2f)?
        .wait()
        .err()
        .ok_or("the second batch should have failed")?;
    ensure!(
        e.kind() == ErrorKind::NotRegistered && e.to_string().contains("stale"),
        "unclear error for a stale registration: {e:?}"
    );
    s.initiator
        .transfer(&s.peer, &req)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    ensure!(
        counter("connects") > connects,
        "the third batch did not renew the connection"
    );
    Ok(())
}

fn an_injected_connect_failure_is_a_clear_error() -> Result<(), Failed> {
    let target = Target::spawn("")?;
    let initiator = Engine::from_config(&config("fail_connect=1")).map_err(e2f)?;
    match initiator.connect(&target.addr) {
        Err(e)
            if e.kind() == ErrorKind::PeerUnreachable
                && e.to_string().contains("injected connect failure") =>
        {
            Ok(())
        }
        Err(e) => Err(format!("unclear connect error: {e:?}").into()),
        Ok(_) => Err("connect succeeded despite the injected failure".into()),
    }
}

fn a_region_the_target_deregistered_fails_the_batch_with_not_registered() -> Result<(), Failed> {
    let mut s = setup("", "")?;
    let answer = s.target.cmd("alloc gone 4096")?;
    let gone = RegionId(
        answer
            .strip_prefix("ok ")
            .ok_or(answer.clone())?
            .parse()
            .map_err(|_| answer.clone())?,
    );
    let req = [TransferRequest::write(s.src.id(), 0, gone, 0, 4096)];
    s.initiator
        .transfer(&s.peer, &req)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    ensure!(
        s.target.cmd("free gone")? == "ok",
        "the target could not free the region"
    );
    let e = match s.initiator.transfer(&s.peer, &req) {
        Err(e) => e,
        Ok(h) => h
            .wait()
            .err()
            .ok_or("a write into a deregistered region succeeded")?,
    };
    ensure!(
        e.kind() == ErrorKind::NotRegistered,
        "expected NotRegistered, got {e:?}"
    );
    // The peer still works for its other regions.
    let ok = [TransferRequest::write(s.src.id(), 0, s.dst, 0, 4096)];
    s.initiator
        .transfer(&s.peer, &ok)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)
}

fn a_dead_target_fails_batches_with_peer_unreachable() -> Result<(), Failed> {
    let mut s = setup("", "")?;
    let req = [TransferRequest::write(s.src.id(), 0, s.dst, 0, 4096)];
    s.initiator
        .transfer(&s.peer, &req)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    s.target.child.kill().map_err(|e| e.to_string())?;
    s.target.child.wait().map_err(|e| e.to_string())?;
    let r = s.initiator.transfer(&s.peer, &req).and_then(|h| h.wait());
    let e = r.err().ok_or("a write to a dead process succeeded")?;
    ensure!(
        e.kind() == ErrorKind::PeerUnreachable,
        "expected PeerUnreachable, got {e:?}"
    );
    Ok(())
}

fn many_concurrent_batches_complete_and_no_transfer_is_queried_after_it_finished(
) -> Result<(), Failed> {
    let mut s = setup("max_desc=1024", "")?;
    let data = pattern(DST, 77);
    s.src.write(0, &data).map_err(e2f)?;
    let block = DST / 256;
    let s2 = Arc::new((s.initiator, s.peer.clone(), s.src.id(), s.dst));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let s2 = s2.clone();
            std::thread::spawn(move || -> Result<(), String> {
                let (initiator, peer, src, dst) = &*s2;
                let handles: Vec<_> = (0..64)
                    .map(|i| {
                        let off = ((t * 64 + i) * block) as u64;
                        initiator.transfer(
                            peer,
                            &[TransferRequest::write(*src, off, *dst, off, block as u64)],
                        )
                    })
                    .collect::<Result<_, _>>()
                    .map_err(|e| e.to_string())?;
                handles
                    .into_iter()
                    .try_for_each(|h| h.wait().map_err(|e| e.to_string()))
            })
        })
        .collect();
    for t in threads {
        t.join().map_err(|_| "a thread panicked")??;
    }
    ensure!(
        s.target.sum("dst", 0, DST)? == format!("sum {:x}", fnv(&data)),
        "the target's bytes differ"
    );
    ensure!(
        counter("misuse") == 0,
        "the backend queried {} transfer(s) after they finished",
        counter("misuse")
    );
    drop(s.src);
    drop(s2);
    Ok(())
}

fn main() {
    if std::env::var_os(ROLE).is_some() {
        target_main();
        return;
    }
    // The probe cannot see the configuration; it finds the shim through the variable.
    std::env::set_var(te_flagcx::SHIM_ENV, shim());
    let tests: Vec<(&str, Test)> = vec![
        (
            "write_then_read_back_across_processes",
            write_then_read_back_across_processes,
        ),
        (
            "notifications_arrive_after_the_data_across_processes",
            notifications_arrive_after_the_data_across_processes,
        ),
        (
            "a_region_registered_after_connect_is_reachable_through_a_new_connection",
            a_region_registered_after_connect_is_reachable_through_a_new_connection,
        ),
        (
            "a_request_over_the_descriptor_limit_is_split_not_truncated",
            a_request_over_the_descriptor_limit_is_split_not_truncated,
        ),
        (
            "an_injected_transfer_failure_fails_only_its_batch",
            an_injected_transfer_failure_fails_only_its_batch,
        ),
        (
            "a_transfer_finished_with_a_failed_slice_fails_and_sends_no_notification",
            a_transfer_finished_with_a_failed_slice_fails_and_sends_no_notification,
        ),
        (
            "an_injected_stale_registration_fails_its_batch_and_the_next_one_reconnects",
            an_injected_stale_registration_fails_its_batch_and_the_next_one_reconnects,
        ),
        (
            "an_injected_connect_failure_is_a_clear_error",
            an_injected_connect_failure_is_a_clear_error,
        ),
        (
            "a_region_the_target_deregistered_fails_the_batch_with_not_registered",
            a_region_the_target_deregistered_fails_the_batch_with_not_registered,
        ),
        (
            "a_dead_target_fails_batches_with_peer_unreachable",
            a_dead_target_fails_batches_with_peer_unreachable,
        ),
        (
            "many_concurrent_batches_complete_and_no_transfer_is_queried_after_it_finished",
            many_concurrent_batches_complete_and_no_transfer_is_queried_after_it_finished,
        ),
    ];
    let trials = tests
        .into_iter()
        .map(|(name, f)| Trial::test(format!("flagcx_fake_two_process::{name}"), f))
        .collect();
    libtest_mimic::run(&Arguments::from_args(), trials).exit();
}
