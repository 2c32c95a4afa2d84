//! Against the FAKE libcnrt: the conformance suite on the mlu backend (in one process,
//! directly and through IPC handles) and on the stub with `mlu:N` memory; two processes
//! exchanging MLU memory over the mlu backend, MLA caches moved with `pull_blocks`,
//! every byte verified; the tcp backend staging `mlu:N` memory, in one process and
//! across two.
//!
//! Run as `cargo test -p te-mlu --test fake_cnrt`. The binary re-executes itself with
//! `TE_MLU_TEST_ROLE=target` to serve as the second process.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use common::*;
use libtest_mimic::{Failed, Trial};
use te_core::testkit::{self, Harness};
use te_core::{Access, Engine, MemoryKind, TransferRequest};

fn mlu_harness(label: &str, table: &str, initiator: MemoryKind, target: MemoryKind) -> Harness {
    let slow = format!("{table}\ndebug_delay = \"200ms\"");
    Harness::new(label, config("mlu", table))
        .with_slow(config("mlu", &slow))
        .with_memory(initiator, target)
}

fn tcp_harness(label: &str, initiator: MemoryKind, target: MemoryKind) -> Harness {
    Harness::new(label, config("tcp", ""))
        .with_slow(config("tcp", "debug_delay = \"200ms\""))
        .with_memory(initiator, target)
}

fn an_mla_cache_in_mlu_memory_moves_over_tcp_with_pull_blocks() -> Result<(), Failed> {
    let target = Engine::from_config(&config("tcp", "")).map_err(e2f)?;
    let _cache = mla_target(&target, &mlu(0), &mlu(0));
    let initiator = Engine::from_config(&config("tcp", "")).map_err(e2f)?;
    pull_and_verify(&initiator, &target.address().to_string(), &mlu(0), &mlu(0))?;
    Ok(())
}

fn stub_harness(label: &str, initiator: MemoryKind, target: MemoryKind) -> Harness {
    Harness::new(label, config("stub", ""))
        .with_slow(config("stub", "delay = \"200ms\""))
        .with_memory(initiator, target)
}

/// The inodes of the fake libcnrt's allocations this process maps (memfds).
fn fake_inodes() -> std::collections::BTreeSet<u64> {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("/memfd:te-fake-cnrt-"))
        .filter_map(|l| l.split_whitespace().nth(4)?.parse().ok())
        .collect()
}

/// The second process: a target engine on the mlu backend, serving until stdin closes.
/// It prints `ADDR <control-plane address>`, then answers `CHECK <seed>` with `OK` if
/// its `dst` buffer holds the pattern of that seed, and `FREE` by dropping `dst`
/// (deregistered, then freed) with `FREED <inode>`, the inode of its allocation.
fn target_main() {
    let e = Engine::from_config(&config("mlu", "")).expect("target engine");
    let mut dst = Some(
        e.alloc_on(&mlu(0), "dst", 1 << 20, Access::REMOTE_READ_WRITE)
            .expect("dst"),
    );
    let _cache = mla_target(&e, &mlu(1), &mlu(0));
    println!("ADDR {}", e.address());
    std::io::stdout().flush().expect("stdout");
    for line in std::io::stdin().lock().lines() {
        let line = line.expect("stdin");
        if let Some(seed) = line.strip_prefix("CHECK ") {
            let seed: u8 = seed.trim().parse().expect("seed");
            let want = te_core::testkit::pattern(1 << 20, seed);
            let ok = dst
                .as_ref()
                .is_some_and(|d| d.to_vec().is_ok_and(|v| v == want));
            println!("{}", if ok { "OK" } else { "BAD" });
            std::io::stdout().flush().expect("stdout");
        } else if line == "FREE" {
            let before = fake_inodes();
            drop(dst.take());
            let gone: Vec<u64> = before.difference(&fake_inodes()).copied().collect();
            match gone[..] {
                [inode] => println!("FREED {inode}"),
                _ => println!("UNCLEAR {gone:?}"),
            }
            std::io::stdout().flush().expect("stdout");
        }
    }
}

struct Child {
    child: std::process::Child,
    out: BufReader<std::process::ChildStdout>,
    addr: String,
}

impl Child {
    fn spawn() -> Result<Child, Failed> {
        let mut child = Command::new(std::env::current_exe().map_err(|e| e.to_string())?)
            .env("TE_MLU_TEST_ROLE", "target")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start the target process: {e}"))?;
        let mut out = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        let mut line = String::new();
        out.read_line(&mut line).map_err(|e| e.to_string())?;
        let addr = line
            .strip_prefix("ADDR ")
            .ok_or_else(|| format!("the target process said {line:?}"))?
            .trim()
            .to_string();
        Ok(Child { child, out, addr })
    }

    fn ask(&mut self, line: &str) -> Result<String, Failed> {
        let stdin = self.child.stdin.as_mut().ok_or("no stdin")?;
        writeln!(stdin, "{line}").map_err(|e| e.to_string())?;
        stdin.flush().map_err(|e| e.to_string())?;
        let mut reply = String::new();
        self.out.read_line(&mut reply).map_err(|e| e.to_string())?;
        Ok(reply.trim().to_string())
    }

    fn finish(mut self) -> Result<(), Failed> {
        drop(self.child.stdin.take());
        let status = self.child.wait().map_err(|e| e.to_string())?;
        if status.success() {
            Ok(())
        } else {
            Err(format!("the target process exited with {status}").into())
        }
    }
}

fn e2f(e: te_core::Error) -> Failed {
    e.to_string().into()
}

fn writes_and_reads_cross_two_processes_with_every_byte_verified() -> Result<(), Failed> {
    let mut child = Child::spawn()?;
    let e = Engine::from_config(&config("mlu", "")).map_err(e2f)?;
    let len = 1u64 << 20;
    // The source on mlu:1 and the target's dst on its mlu:0: peer copies over MLU-Link.
    let src = filled(&e, &mlu(1), "src", len, Access::LOCAL, 5);
    let back = e
        .alloc_on(&mlu(0), "back", len as usize, Access::LOCAL)
        .map_err(e2f)?;
    let peer = e.connect(&child.addr).map_err(e2f)?;
    let dst = peer.region("dst").ok_or("the target has no `dst`")?;
    let q = len / 4;
    let writes: Vec<_> = [2u64, 0, 3, 1]
        .iter()
        .map(|&i| TransferRequest::write(src.id(), i * q, dst.id, i * q, q))
        .collect();
    e.transfer(&peer, &writes)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    let reply = child.ask("CHECK 5")?;
    if reply != "OK" {
        return Err(format!("the target process found other bytes in `dst`: {reply}").into());
    }
    let read = [TransferRequest::read(back.id(), 0, dst.id, 0, len)];
    e.transfer(&peer, &read).map_err(e2f)?.wait().map_err(e2f)?;
    if back.to_vec().map_err(e2f)? != src.to_vec().map_err(e2f)? {
        return Err("bytes read back from the other process differ".into());
    }
    drop((src, back, peer, e));
    child.finish()
}

fn an_allocation_freed_in_another_process_is_unmapped_here_at_once() -> Result<(), Failed> {
    let mut child = Child::spawn()?;
    let e = Engine::from_config(&config("mlu", "")).map_err(e2f)?;
    let _peer = e.connect(&child.addr).map_err(e2f)?;
    let mapped = fake_inodes();
    // The target deregisters `dst` and frees it; this process does nothing at all.
    let reply = child.ask("FREE")?;
    let inode: u64 = reply
        .strip_prefix("FREED ")
        .and_then(|i| i.parse().ok())
        .ok_or_else(|| format!("the target process said {reply:?}"))?;
    if !mapped.contains(&inode) {
        return Err("connect did not map the target's `dst`: the test proves nothing".into());
    }
    let start = std::time::Instant::now();
    while fake_inodes().contains(&inode) {
        if start.elapsed() > std::time::Duration::from_secs(5) {
            return Err("the allocation the target freed is still mapped here 5 s later, though no batch or refresh came".into());
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    drop(e);
    child.finish()
}

fn an_mla_cache_moves_between_two_processes_with_pull_blocks() -> Result<(), Failed> {
    let child = Child::spawn()?;
    let e = Engine::from_config(&config("mlu", "")).map_err(e2f)?;
    pull_and_verify(&e, &child.addr, &mlu(0), &mlu(1))?;
    drop(e);
    child.finish()
}

fn an_mla_cache_in_mlu_memory_moves_over_the_stub_with_pull_blocks() -> Result<(), Failed> {
    let target = Engine::from_config(&config("stub", "")).map_err(e2f)?;
    let _cache = mla_target(&target, &mlu(0), &mlu(0));
    let initiator = Engine::from_config(&config("stub", "")).map_err(e2f)?;
    pull_and_verify(&initiator, &target.address().to_string(), &mlu(0), &mlu(0))?;
    Ok(())
}

fn an_mla_cache_moves_over_the_mlu_backend_through_ipc_handles_in_one_process() -> Result<(), Failed>
{
    let table = "ipc = \"always\"";
    let target = Engine::from_config(&config("mlu", table)).map_err(e2f)?;
    let _cache = mla_target(&target, &mlu(0), &mlu(1));
    let initiator = Engine::from_config(&config("mlu", table)).map_err(e2f)?;
    pull_and_verify(&initiator, &target.address().to_string(), &mlu(1), &mlu(0))?;
    Ok(())
}

fn main() {
    use_fake_cnrt(&[]);
    testkit::serve_target_if_asked();
    if std::env::var("TE_MLU_TEST_ROLE").as_deref() == Ok("target") {
        target_main();
        return;
    }
    let mut trials = Vec::new();
    trials.extend(testkit::trials(&mlu_harness("mlu", "", mlu(0), mlu(0))));
    trials.extend(testkit::trials(&mlu_harness(
        "mlu_ipc_peer_devices",
        "ipc = \"always\"",
        mlu(0),
        mlu(1),
    )));
    trials.extend(testkit::trials(&mlu_harness(
        "mlu_ipc_host_to_mlu",
        "ipc = \"always\"",
        MemoryKind::Host,
        mlu(0),
    )));
    trials.extend(testkit::trials(&stub_harness("stub_mlu", mlu(0), mlu(0))));
    trials.extend(testkit::trials(&stub_harness(
        "stub_host_to_mlu",
        MemoryKind::Host,
        mlu(1),
    )));
    trials.extend(testkit::trials(&stub_harness(
        "stub_mlu_to_host",
        mlu(1),
        MemoryKind::Host,
    )));
    trials.extend(testkit::trials(&tcp_harness("tcp_mlu", mlu(0), mlu(0))));
    trials.extend(testkit::trials(&tcp_harness(
        "tcp_host_to_mlu",
        MemoryKind::Host,
        mlu(1),
    )));
    let tcp_toml = |table: &str| format!("[engine]\nbackend = \"tcp\"\n[backends.tcp]\n{table}\n");
    trials.extend(testkit::trials(
        &tcp_harness("tcp_mlu_two_processes", mlu(0), mlu(0))
            .with_remote_target(&tcp_toml(""), Some(&tcp_toml("debug_delay = \"200ms\""))),
    ));
    let mlu_toml = |table: &str| format!("[engine]\nbackend = \"mlu\"\n[backends.mlu]\n{table}\n");
    trials.extend(testkit::trials(
        &mlu_harness("mlu_two_processes", "", mlu(0), mlu(0))
            .with_remote_target(&mlu_toml(""), Some(&mlu_toml("debug_delay = \"200ms\""))),
    ));
    type Test = fn() -> Result<(), Failed>;
    let own: [(&str, Test); 6] = [
        (
            "mlu_two_processes::an_allocation_freed_in_another_process_is_unmapped_here_at_once",
            an_allocation_freed_in_another_process_is_unmapped_here_at_once,
        ),
        (
            "tcp_mlu::an_mla_cache_in_mlu_memory_moves_over_tcp_with_pull_blocks",
            an_mla_cache_in_mlu_memory_moves_over_tcp_with_pull_blocks,
        ),
        (
            "mlu_two_processes::writes_and_reads_cross_two_processes_with_every_byte_verified",
            writes_and_reads_cross_two_processes_with_every_byte_verified,
        ),
        (
            "mlu_two_processes::an_mla_cache_moves_between_two_processes_with_pull_blocks",
            an_mla_cache_moves_between_two_processes_with_pull_blocks,
        ),
        (
            "stub_mlu::an_mla_cache_in_mlu_memory_moves_over_the_stub_with_pull_blocks",
            an_mla_cache_in_mlu_memory_moves_over_the_stub_with_pull_blocks,
        ),
        (
            "mlu_ipc::an_mla_cache_moves_over_the_mlu_backend_through_ipc_handles_in_one_process",
            an_mla_cache_moves_over_the_mlu_backend_through_ipc_handles_in_one_process,
        ),
    ];
    for (name, f) in own {
        trials.push(Trial::test(name, f));
    }
    testkit::run(trials);
}
