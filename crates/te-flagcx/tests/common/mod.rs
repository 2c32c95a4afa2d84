//! What the two-process test binaries share: the target process (this binary started
//! again with `TE_FLAGCX_ROLE=target`: an engine with a remotely writable 2 MiB region
//! `dst`, driven by one-line commands on stdin), the initiator's handle on it, the
//! fake's counters, and the `main` that picks the role.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use libtest_mimic::Failed;
pub use te_core::testkit::{self, pattern};
use te_core::{Access, Buffer, Config, Engine, Peer, RegionId};

use te_flagcx as _;

pub const ROLE: &str = "TE_FLAGCX_ROLE";
pub const TARGET_OPTIONS: &str = "TE_FLAGCX_TARGET_OPTIONS";
pub const DST: usize = 2 << 20;

pub fn shim() -> &'static str {
    match option_env!("TE_FLAGCX_FAKE_SHIM_PATH") {
        Some(p) => p,
        None => {
            panic!("the fake FlagCX shim was not built (no C compiler?); see the build warnings")
        }
    }
}

pub fn config(options: &str) -> Config {
    let text = format!(
        "[engine]\nbackend = \"flagcx\"\ndefault_timeout = \"20s\"\n[backends.flagcx]\nshim = \"{}\"\nshim_options = \"{options}\"\n",
        shim()
    );
    Config::from_toml(&text, "flagcx-two-process.toml", Path::new(".")).expect("valid config")
}

pub fn fnv(bytes: &[u8]) -> u64 {
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

pub struct Target {
    pub child: Child,
    pub stdin: ChildStdin,
    pub stdout: BufReader<ChildStdout>,
    pub addr: String,
}

impl Target {
    pub fn spawn(options: &str) -> Result<Target, Failed> {
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

    pub fn cmd(&mut self, c: &str) -> Result<String, Failed> {
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

    pub fn sum(&mut self, name: &str, off: usize, len: usize) -> Result<String, Failed> {
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
pub struct Setup {
    pub peer: Peer,
    pub src: Buffer,
    pub dst: RegionId,
    pub initiator: Engine,
    pub target: Target,
}

pub fn setup(initiator_options: &str, target_options: &str) -> Result<Setup, Failed> {
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

pub fn e2f(e: te_core::Error) -> Failed {
    format!("{e:?}").into()
}

macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+).into());
        }
    };
}
pub(crate) use ensure;

pub type Test = testkit::DirectTest;

type FakeCounter = unsafe extern "C" fn(*const std::ffi::c_char) -> u64;

/// A process-wide counter of the fake loaded in this process.
pub fn counter(name: &str) -> u64 {
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

/// The target's loop when this binary was started as the target; otherwise `tests`,
/// each named `flagcx_fake_two_process::NAME`.
pub fn run_tests(tests: Vec<(&'static str, Test)>) {
    if std::env::var_os(ROLE).is_some() {
        target_main();
        return;
    }
    // The probe cannot see the configuration; it finds the shim through the variable.
    std::env::set_var(te_flagcx::SHIM_ENV, shim());
    testkit::run_tests("flagcx_fake_two_process", tests, false)
}
