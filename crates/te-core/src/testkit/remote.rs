//! A target engine in a child process.

use crate::sync::Mutex;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use libtest_mimic::Failed;

use super::fail;
use crate::{Access, Buffer, Config, Engine, ErrorKind, MemoryKind};

/// The environment variable that turns a test binary into a remote target (see
/// [`serve_target_if_asked`]); it holds the target's configuration as TOML.
const TARGET_ENV: &str = "TE_TESTKIT_TARGET";
/// The target's memory kind, for a remote target.
const TARGET_MEMORY_ENV: &str = "TE_TESTKIT_TARGET_MEMORY";

pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(super) fn unhex(s: &str) -> Result<Vec<u8>, Failed> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2).unwrap_or("zz"), 16))
        .collect::<Result<_, _>>()
        .map_err(|_| fail("the target sent malformed hex"))
}

/// A target engine in a child process, driven over its stdin and stdout, one line per
/// command and one per reply (`ok …` or `err …`).
pub(super) struct RemoteTarget {
    io: Mutex<(ChildStdin, BufReader<ChildStdout>)>,
    child: Mutex<Child>,
    pub(super) address: String,
    pub(super) epoch: u64,
}

impl RemoteTarget {
    pub(super) fn spawn(config: &str, memory: &MemoryKind) -> Result<RemoteTarget, Failed> {
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

    pub(super) fn call(&self, command: &str) -> Result<String, Failed> {
        let mut io = self.io.lock();
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
        let mut child = self.child.lock();
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
            ["layout", name, id, bpb, blocks] => {
                let (id, bpb, blocks) = (
                    id.parse().unwrap_or(0),
                    bpb.parse().unwrap_or(0),
                    blocks.parse().unwrap_or(0),
                );
                engine
                    .register_layout(super::harness::two_slots(
                        name,
                        crate::RegionId(id),
                        bpb,
                        blocks,
                    ))
                    .map(|()| String::new())
            }
            ["free", id] => {
                buffers.remove(&id.parse().unwrap_or(0));
                Ok(String::new())
            }
            ["notification", ms] => {
                let timeout = Duration::from_millis(ms.parse().unwrap_or(0));
                Ok(match engine.recv_notification(timeout) {
                    Some(n) => format!(
                        "{} {} {} {}",
                        n.from_epoch,
                        hex(&n.message),
                        n.from,
                        n.from_address
                    ),
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
