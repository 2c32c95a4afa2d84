//! Plugins that misbehave are contained: a plugin whose calls panic, that completes a
//! batch twice, that uses a copy of a completion after completing it, or whose backend
//! panics when dropped costs its caller an error (or a logged bug), never an abort of
//! the host, never undefined behaviour; a plugin te cannot use is refused with a
//! message that says what was wrong and what to do.
//!
//! The misbehaving plugins are compiled here at run time with `rustc` (nothing is
//! added to the workspace): `tests/plugin_misbehaviour/misbehaving.rs` against the
//! te-core rlib this test binary itself was built with (found in `target/<profile>/deps`
//! by te-core's `SCHEMA`, so run `cargo build --workspace` first), and te's
//! ABI-mismatch fixture (`tests/plugins/te-abi-mismatch`) made to claim te-core 0.2.0,
//! against abi_stable alone. A scenario that could take the process down runs in a
//! child process (this test binary again, with `TE_PLUGIN_MISBEHAVIOUR_CHILD` set), and
//! the parent checks that it ended normally.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use te_core::{Access, Config, Engine, ErrorKind, TransferRequest};

const CHILD: &str = "TE_PLUGIN_MISBEHAVIOUR_CHILD";
const PLUGIN_DIR: &str = "TE_PLUGIN_MISBEHAVIOUR_DIR";
const SCRATCH: &str = "te-plugin-misbehaviour-";

fn deps_dir() -> PathBuf {
    std::env::current_exe()
        .expect("test executable")
        .parent()
        .expect("target/<profile>/deps")
        .to_path_buf()
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The newest `lib<name>-*.rlib` in deps, for which `accept` holds.
fn rlib(name: &str, accept: impl Fn(&Path) -> bool) -> PathBuf {
    let mut found: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(deps_dir())
        .expect("deps dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy().to_string();
            n.starts_with(&format!("lib{name}-")) && n.ends_with(".rlib")
        })
        .filter_map(|p| Some((p.metadata().ok()?.modified().ok()?, p)))
        .collect();
    found.sort();
    found
        .into_iter()
        .rev()
        .map(|(_, p)| p)
        .find(|p| accept(p))
        .unwrap_or_else(|| {
            panic!(
                "no usable lib{name}-*.rlib in {} (run `cargo build --workspace` first)",
                deps_dir().display()
            )
        })
}

/// Compiles the fixture `src` as the cdylib `lib<krate>.so` in `out_dir`.
fn rustc(src: &str, krate: &str, externs: &[(&str, PathBuf)], out_dir: &Path) -> PathBuf {
    let out = out_dir.join(format!("lib{krate}{}", std::env::consts::DLL_SUFFIX));
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(src);
    let mut cmd = Command::new(std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into()));
    cmd.args([
        "--edition",
        "2021",
        "--crate-type",
        "cdylib",
        "--crate-name",
        krate,
    ])
    .args(["-C", "debuginfo=0", "-L"])
    .arg(format!("dependency={}", deps_dir().display()))
    .env("CARGO_PKG_VERSION", "0.1.0")
    .env("CARGO_CRATE_NAME", krate)
    .arg("-o")
    .arg(&out)
    .arg(&src);
    for (name, path) in externs {
        cmd.arg("--extern")
            .arg(format!("{name}={}", path.display()));
    }
    let status = cmd.status().expect("run rustc");
    assert!(status.success(), "building {} failed", src.display());
    out
}

/// A directory holding the fixture plugins, built once per process (children reuse
/// their parent's).
fn plugins() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(d) = std::env::var_os(PLUGIN_DIR) {
            return PathBuf::from(d);
        }
        sweep_stale_scratch();
        let dir = scratch("plugins");
        let schema = te_core::plugin::SCHEMA.as_bytes().to_vec();
        let te_core = rlib("te_core", |p| {
            std::fs::read(p)
                .map(|b| contains(&b, &schema))
                .unwrap_or(false)
        });
        rustc(
            "tests/plugin_misbehaviour/misbehaving.rs",
            "te_misbehaving",
            &[("te_core", te_core)],
            &dir,
        );
        // te's ABI-mismatch fixture, claiming a newer te-core under its own name.
        let base =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/plugins/te-abi-mismatch/src/lib.rs");
        let base = std::fs::read_to_string(base).expect("the ABI-mismatch fixture");
        let newer = base
            .replace(
                r#"VersionStrings::new("0.1.0")"#,
                r#"VersionStrings::new("0.2.0")"#,
            )
            .replace("te_plugin_te_abi_mismatch", "te_plugin_te_newer_core");
        assert!(
            newer.contains(r#"new("0.2.0")"#) && newer.contains("te_plugin_te_newer_core"),
            "the ABI-mismatch fixture changed: update the newer-core one made from it"
        );
        let src = dir.join("newer_core.rs");
        std::fs::write(&src, newer).unwrap();
        rustc(
            src.to_str().expect("a UTF-8 scratch path"),
            "te_newer_core",
            &[("abi_stable", rlib("abi_stable", |_| true))],
            &dir,
        );
        dir
    })
}

/// A fresh scratch directory of this process, tagged `tag`.
fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("{SCRATCH}{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Removes the scratch directories of earlier runs whose process is gone (each holds
/// a 50+ MB plugin).
fn sweep_stale_scratch() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let pid = name
            .strip_prefix(SCRATCH)
            .and_then(|rest| rest.rsplit_once('-'))
            .and_then(|(_, pid)| pid.parse::<u32>().ok());
        if let Some(pid) = pid {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

fn is_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// Runs test `name` of this binary in a child process; its exit status and output.
fn child(name: &str) -> (std::process::ExitStatus, String) {
    let dir = plugins();
    let mut c = Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env("RUST_BACKTRACE", "0")
        .env(PLUGIN_DIR, dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = c.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = c.kill();
            let s = c.wait().unwrap();
            let mut out = String::new();
            let _ = c.stderr.take().unwrap().read_to_string(&mut out);
            panic!("{name} hung in the child past 60 s ({s}): {out}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut out = String::new();
    let _ = c.stdout.take().unwrap().read_to_string(&mut out);
    let _ = c.stderr.take().unwrap().read_to_string(&mut out);
    (status, out)
}

/// An engine configuration on the misbehaving plugin, misbehaving as `misbehave` says.
fn misbehaving(misbehave: &str) -> Config {
    let text = format!(
        "[engine]\nbackend = \"misbehaving\"\nplugin_dirs = [{:?}]\nlisten = \"127.0.0.1:0\"\ndefault_timeout = \"5s\"\n\n[backends.misbehaving]\nmisbehave = {misbehave:?}\n",
        plugins().display().to_string()
    );
    Config::from_toml(&text, "misbehaviour.toml", Path::new(".")).expect("config")
}

/// Runs test `name` in a child and asserts that the child ended normally (the host
/// survived the plugin, and the child's own assertions passed).
fn assert_contained(name: &str) {
    let (status, out) = child(name);
    let tail: String = out
        .lines()
        .filter(|l| !l.trim().is_empty())
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        status.success(),
        "the host process did not survive the plugin ({status}); its output:\n{tail}"
    );
}

/// A backend whose `info` panics fails the engine's creation with a `Backend` error
/// that says so.
#[test]
fn a_plugin_whose_info_panics_fails_engine_creation_with_an_error() {
    if !is_child() {
        return assert_contained("a_plugin_whose_info_panics_fails_engine_creation_with_an_error");
    }
    let e = Engine::from_config(&misbehaving("info")).expect_err("info panicked");
    println!("refused: {e}");
    assert_eq!(e.kind(), ErrorKind::Backend, "{e}");
    assert!(e.to_string().contains("panicked in info"), "{e}");
}

/// A backend whose `endpoint` panics fails the engine's creation (te asks for the
/// endpoint once there), so no peer's handshake ever reaches the panic.
#[test]
fn a_plugin_whose_endpoint_panics_fails_engine_creation_with_an_error() {
    if !is_child() {
        return assert_contained(
            "a_plugin_whose_endpoint_panics_fails_engine_creation_with_an_error",
        );
    }
    let e = Engine::from_config(&misbehaving("endpoint")).expect_err("endpoint panicked");
    println!("refused: {e}");
    assert_eq!(e.kind(), ErrorKind::Backend, "{e}");
    assert!(e.to_string().contains("panicked in endpoint"), "{e}");
}

/// Panics in `register`, `connect` and `submit` come back as the call's error.
#[test]
fn a_plugin_whose_register_connect_and_submit_panic_returns_errors() {
    if !is_child() {
        return assert_contained("a_plugin_whose_register_connect_and_submit_panic_returns_errors");
    }
    let e = Engine::from_config(&misbehaving("register")).unwrap();
    let err = e
        .alloc("kv", 4096, Access::LOCAL)
        .expect_err("register panicked");
    assert!(err.to_string().contains("panicked in register"), "{err}");

    let target = Engine::from_config(&misbehaving("")).unwrap();
    let e = Engine::from_config(&misbehaving("connect")).unwrap();
    let err = e
        .connect(&target.address().to_string())
        .expect_err("connect panicked");
    assert!(err.to_string().contains("panicked in connect"), "{err}");

    let _dst = target.alloc("kv", 4096, Access::REMOTE_READ_WRITE).unwrap();
    let e = Engine::from_config(&misbehaving("submit")).unwrap();
    let src = e.alloc("kv", 4096, Access::LOCAL).unwrap();
    let peer = e.connect(&target.address().to_string()).unwrap();
    let remote = peer.region("kv").unwrap();
    let r = e
        .transfer(
            &peer,
            &[TransferRequest::write(src.id(), 0, remote.id, 0, 64)],
        )
        .and_then(|h| h.wait());
    let err = r.expect_err("submit panicked");
    assert!(err.to_string().contains("panicked in submit"), "{err}");
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Engines on a backend loaded as a plugin (the stub's) leave no thread behind when
/// they close, a batch in flight at close included.
#[test]
fn closing_engines_on_the_stub_plugin_leaks_no_threads() {
    if !is_child() {
        return assert_contained("closing_engines_on_the_stub_plugin_leaks_no_threads");
    }
    let dir = scratch("stub");
    let lib = dir.join(format!("libte_stub{}", std::env::consts::DLL_SUFFIX));
    std::fs::copy(te_core::testkit::built_plugin("te_stub"), &lib).unwrap();
    let text = format!(
        "[engine]\nbackend = \"stub\"\nplugin_dirs = [{:?}]\nlisten = \"127.0.0.1:0\"\ndefault_timeout = \"5s\"\n\n[backends.stub]\ndelay = \"20ms\"\n",
        dir.display().to_string()
    );
    let config = Config::from_toml(&text, "misbehaviour.toml", Path::new(".")).unwrap();
    let round = || {
        let target = Engine::from_config(&config).expect("stub plugin engine");
        assert_eq!(
            target.backend_origin(),
            &te_core::Origin::Plugin(lib.clone())
        );
        let _dst = target
            .alloc("kv", 1 << 16, Access::REMOTE_READ_WRITE)
            .unwrap();
        let e = Engine::from_config(&config).unwrap();
        let src = e.alloc("kv", 1 << 16, Access::LOCAL).unwrap();
        let peer = e.connect(&target.address().to_string()).unwrap();
        let remote = peer.region("kv").unwrap();
        e.transfer(
            &peer,
            &[TransferRequest::write(src.id(), 0, remote.id, 0, 4096)],
        )
        .unwrap()
        .wait()
        .unwrap();
        // One batch left in flight at close.
        let _h = e.transfer(
            &peer,
            &[TransferRequest::write(src.id(), 0, remote.id, 0, 4096)],
        );
        drop(peer);
        drop(e);
        drop(target);
    };
    round();
    std::thread::sleep(Duration::from_millis(300));
    let base = threads();
    for _ in 0..5 {
        round();
    }
    std::thread::sleep(Duration::from_millis(500));
    let after = threads();
    println!("threads: {base} after one round, {after} after five more");
    assert!(after <= base, "threads leaked: {base} -> {after}");
}

/// A backend whose `Drop` panics is dropped at engine close with the panic logged
/// (and what it held leaked); the host goes on.
#[test]
fn a_plugin_whose_backend_panics_when_dropped_does_not_abort_the_host() {
    if !is_child() {
        return assert_contained(
            "a_plugin_whose_backend_panics_when_dropped_does_not_abort_the_host",
        );
    }
    let e = Engine::from_config(&misbehaving("drop")).unwrap();
    drop(e);
    println!("survived closing the engine");
}

/// A message handler whose `Drop` panics is dropped at engine close with the panic
/// logged; the host goes on.
#[test]
fn a_plugin_whose_message_handler_panics_when_dropped_does_not_abort_the_host() {
    if !is_child() {
        return assert_contained(
            "a_plugin_whose_message_handler_panics_when_dropped_does_not_abort_the_host",
        );
    }
    let e = Engine::from_config(&misbehaving("handler_drop")).unwrap();
    drop(e);
    println!("survived closing the engine");
}

/// A backend whose `Debug` panics is formatted as a note that it did.
#[test]
fn a_plugin_whose_debug_panics_is_formatted_as_a_note_not_an_abort() {
    if !is_child() {
        return assert_contained("a_plugin_whose_debug_panics_is_formatted_as_a_note_not_an_abort");
    }
    let config = misbehaving("debug");
    let registry = te_core::Registry::discover(&config.engine.plugin_dirs);
    let entry = registry.get("misbehaving").expect("the misbehaving plugin");
    let backend = entry
        .create(&config.backend_context("misbehaving"))
        .expect("created");
    let text = format!("{backend:?}");
    println!("{text}");
    assert!(text.contains("panicked in Debug"), "{text}");
}

/// A plugin that completes a batch a second time (through a copy of its completion)
/// has the first completion count as the batch's result and the second ignored
/// (logged as a bug in the backend): it touches nothing of the batch, nor of the
/// batches whose completions reuse its slot.
#[test]
fn a_plugin_that_completes_a_batch_twice_has_the_second_completion_ignored() {
    if !is_child() {
        return assert_contained(
            "a_plugin_that_completes_a_batch_twice_has_the_second_completion_ignored",
        );
    }
    let target = Engine::from_config(&misbehaving("")).unwrap();
    let _dst = target.alloc("kv", 4096, Access::REMOTE_READ_WRITE).unwrap();
    let e = Engine::from_config(&misbehaving("double")).unwrap();
    let src = e.alloc("kv", 4096, Access::LOCAL).unwrap();
    let peer = e.connect(&target.address().to_string()).unwrap();
    let remote = peer.region("kv").unwrap();
    let write = [TransferRequest::write(src.id(), 0, remote.id, 0, 64)];
    let h = e.transfer(&peer, &write).unwrap();
    assert!(
        h.wait().is_ok(),
        "the first completion is the batch's result"
    );
    // The plugin completes each batch a second time 100 ms after the first (with an
    // error): the batches posted meanwhile, which may reuse the first one's slot, still
    // get their own first result.
    for _ in 0..20 {
        let h = e.transfer(&peer, &write).unwrap();
        h.wait()
            .expect("each batch's own first completion is its result");
    }
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..50 {
        let _ = src.write(0, &[1u8; 64]);
        drop(e.alloc("more", 1 << 16, Access::LOCAL));
    }
    println!("survived the second completions");
}

/// A plugin built against another te-core version is refused with a message that
/// names the file, says which te-core it was built for and which this te uses (before
/// abi_stable's long layout report), and says to rebuild it.
#[test]
fn a_plugin_built_against_a_newer_te_core_is_refused_naming_the_versions_and_file() {
    let dir = plugins();
    let registry = te_core::Registry::discover(&[dir.to_path_buf()]);
    let path = dir.join(format!("libte_newer_core{}", std::env::consts::DLL_SUFFIX));
    let problem = registry
        .problems()
        .iter()
        .find(|p| p.path == path)
        .unwrap_or_else(|| panic!("the newer plugin was not refused: {registry:?}"));
    let msg = problem.error.to_string();
    println!("{msg}");
    assert_eq!(problem.error.kind(), ErrorKind::Unavailable, "{msg}");
    assert!(msg.contains("rebuild"), "says what to do: {msg}");
    assert!(
        msg.contains(&path.display().to_string()),
        "names the file: {msg}"
    );
    let ours = format!("this te uses te-core {}", env!("CARGO_PKG_VERSION"));
    let versions = msg.find("te-core 0.2.0").zip(msg.find(&ours));
    let layout = msg.find("Type Layout").unwrap_or(usize::MAX);
    assert!(
        versions.is_some_and(|(theirs, ours)| theirs < layout && ours < layout),
        "says which te-core the plugin was built for, and which this te uses, first: {msg}"
    );
}

/// An engine whose backend's plugin file was refused says why (the file, the reason,
/// what to rebuild), not only that no backend has the name.
#[test]
fn an_engine_whose_backend_plugin_was_refused_says_why() {
    // `libte_newer_core.so` is the plugin of backend `newer_core` (its file name is all
    // te can know of a refused plugin), refused at load.
    let dir = plugins();
    let text = format!(
        "[engine]\nbackend = \"newer_core\"\nplugin_dirs = [{:?}]\nlisten = \"127.0.0.1:0\"\n",
        dir.display().to_string()
    );
    let config = Config::from_toml(&text, "misbehaviour.toml", Path::new(".")).unwrap();
    let e = Engine::from_config(&config).expect_err("the plugin was refused");
    let msg = e.to_string();
    println!("{msg}");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{msg}");
    assert!(
        msg.contains("libte_newer_core")
            && msg.contains("te-core 0.2.0")
            && msg.contains("rebuild"),
        "the refusal of the plugin file is passed on: {msg}"
    );
}

/// A plugin file that was refused is tried again at the next discovery, so a plugin
/// rebuilt (or put right) as the refusal asks is used without restarting the process.
#[test]
fn a_refused_plugin_file_put_right_is_loaded_at_the_next_discovery() {
    let dir = scratch("retry");
    let lib = dir.join(format!("libte_stub{}", std::env::consts::DLL_SUFFIX));
    std::fs::write(&lib, b"not a library yet").unwrap();
    let registry = te_core::Registry::discover(std::slice::from_ref(&dir));
    assert!(
        registry.problems().iter().any(|p| p.path == lib),
        "the broken file was refused: {registry:?}"
    );
    std::fs::remove_file(&lib).unwrap();
    std::fs::copy(te_core::testkit::built_plugin("te_stub"), &lib).unwrap();
    let registry = te_core::Registry::discover(std::slice::from_ref(&dir));
    assert!(registry.problems().is_empty(), "{:?}", registry.problems());
    let stub = registry.get("stub").expect("the stub plugin");
    assert_eq!(stub.origin(), &te_core::Origin::Plugin(lib));
}

/// A plugin that keeps a copy of a batch's completion and uses it after completing the
/// batch (a C plugin can copy the struct) reads and writes nothing of any other batch:
/// the copy says its batch is aborted (it is over), and the stage it times reaches no
/// batch's telemetry. Before, the copy pointed at the batch's signals, which were freed
/// with the batch: it read and wrote whatever the allocator had put there since.
#[test]
fn a_plugin_that_uses_a_copy_of_a_completed_completion_touches_no_other_batch() {
    if !is_child() {
        return assert_contained(
            "a_plugin_that_uses_a_copy_of_a_completed_completion_touches_no_other_batch",
        );
    }
    let target = Engine::from_config(&misbehaving("")).unwrap();
    let _dst = target.alloc("kv", 4096, Access::REMOTE_READ_WRITE).unwrap();
    let e = Engine::from_config(&misbehaving("stale")).unwrap();
    let src = e.alloc("kv", 4096, Access::LOCAL).unwrap();
    let peer = e.connect(&target.address().to_string()).unwrap();
    let remote = peer.region("kv").unwrap();
    let write = [TransferRequest::write(src.id(), 0, remote.id, 0, 64)];
    // Each submit uses the copy of the batch before, which is over and whose handle is
    // dropped: its memory is free for this batch to reuse.
    for i in 0..50 {
        let h = e.transfer(&peer, &write).unwrap();
        h.wait().unwrap_or_else(|err| panic!("batch {i}: {err}"));
        let t = h.telemetry().expect("metrics are on");
        assert!(
            t.wire.is_none(),
            "batch {i} shows a wire stage its backend never timed: a copy of an earlier batch's completion wrote into it ({t:?})"
        );
        drop(h);
    }
    println!("no batch saw another's signals");
}
