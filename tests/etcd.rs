//! Engines found by name through a real etcd (Debian's `etcd-server`, which the test
//! script installs): publish, resolve, lease expiry after `kill -9`, a restart under
//! the same name, an etcd restart, and etcd unreachable at start.
//!
//! Without an `etcd` binary on PATH each test says so and passes, unless
//! `TE_REQUIRE=etcd`, which makes a missing etcd a failure.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use te::{Access, Config, Engine, ErrorKind, TransferRequest};
use te_core::Deadline;

/// An etcd server on free loopback ports, killed when dropped.
struct Etcd {
    child: Child,
    dir: PathBuf,
    client: u16,
    peer: u16,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Etcd {
    /// Starts etcd, or `None` (with the reason printed) where there is none.
    fn start() -> Option<Etcd> {
        if Command::new("etcd").arg("--version").output().is_err() {
            te_core::require::skip("etcd", "no `etcd` on PATH (apt-get install etcd-server)");
            return None;
        }
        let dir =
            std::env::temp_dir().join(format!("te-etcd-{}-{}", std::process::id(), free_port()));
        Some(Etcd::run(dir, free_port(), free_port()))
    }

    fn run(dir: PathBuf, client: u16, peer: u16) -> Etcd {
        let client_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let mut child = Command::new("etcd")
            .args(["--name", "t", "--data-dir"])
            .arg(&dir)
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("t={peer_url}")])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start etcd");
        // etcd says when it serves; its log goes on being drained so it never blocks.
        let (tx, rx) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(|l| l.ok()) {
                if line.contains("ready to serve client requests") {
                    let _ = tx.send(());
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(30))
            .expect("etcd did not become ready within 30 s");
        Etcd {
            child,
            dir,
            client,
            peer,
        }
    }

    fn url(&self) -> String {
        format!("etcd://127.0.0.1:{}", self.client)
    }

    /// Kills etcd; starts it again on the same ports, with its data or without.
    fn restart(mut self, keep_data: bool) -> Etcd {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !keep_data {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
        let (dir, client, peer) = (self.dir.clone(), self.client, self.peer);
        std::mem::forget(self);
        Etcd::run(dir, client, peer)
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn config(etcd: &Etcd, name: &str, prefix: &str) -> Config {
    let mut c = Config::defaults();
    c.engine.name = name.to_string();
    c.engine.metadata = etcd.url();
    c.engine.metadata_prefix = prefix.to_string();
    c.engine.metadata_ttl = Duration::from_secs(2);
    c
}

fn names(c: &Config) -> Vec<(String, u64)> {
    te_core::metadata::open(&c.engine)
        .unwrap()
        .list(Deadline::after(Duration::from_secs(10)))
        .unwrap()
        .into_iter()
        .map(|e| (e.name, e.epoch))
        .collect()
}

/// Waits (bounded) until `f` holds.
fn eventually(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn engines_publish_themselves_and_are_reached_by_name() {
    let Some(etcd) = Etcd::start() else { return };
    let decode = Engine::from_config(&config(&etcd, "decode-0", "/a/")).unwrap();
    let dst = decode.alloc("kv", 4096, Access::REMOTE_READ_WRITE).unwrap();
    let prefill = Engine::from_config(&config(&etcd, "prefill-0", "/a/")).unwrap();
    let listed = names(&config(&etcd, "x", "/a/"));
    assert_eq!(
        listed,
        vec![
            ("decode-0".to_string(), decode.epoch()),
            ("prefill-0".to_string(), prefill.epoch())
        ]
    );
    // Another prefix is another deployment.
    assert!(names(&config(&etcd, "x", "/b/")).is_empty());

    let peer = prefill.connect("decode-0").unwrap();
    assert_eq!(peer.epoch(), decode.epoch());
    let src = prefill.alloc("src", 4096, Access::LOCAL).unwrap();
    src.write(0, &[9; 4096]).unwrap();
    let rid = peer.region("kv").unwrap().id;
    prefill
        .transfer(&peer, &[TransferRequest::write(src.id(), 0, rid, 0, 4096)])
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(dst.to_vec().unwrap(), vec![9; 4096]);
    // An address still works beside names.
    let by_addr = prefill.connect(&decode.address().to_string()).unwrap();
    assert_eq!(by_addr.epoch(), decode.epoch());

    let e = prefill.connect("decode-9").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerUnreachable, "{e}");
    assert!(e.to_string().contains("no engine named `decode-9`"), "{e}");

    // A clean exit takes the entry out at once.
    drop(dst);
    drop(decode);
    assert_eq!(
        names(&config(&etcd, "x", "/a/")),
        vec![("prefill-0".to_string(), prefill.epoch())]
    );
}

#[test]
fn a_restart_under_the_same_name_is_found_and_old_handles_refuse_it() {
    let Some(etcd) = Etcd::start() else { return };
    let first = Engine::from_config(&config(&etcd, "decode-0", "/r/")).unwrap();
    let first_kv = first.alloc("kv", 64, Access::REMOTE_READ_WRITE).unwrap();
    let prefill = Engine::from_config(&config(&etcd, "prefill-0", "/r/")).unwrap();
    let old = prefill.connect("decode-0").unwrap();
    assert_eq!(old.epoch(), first.epoch());
    let old_kv = old.region("kv").unwrap().id;
    let first_epoch = first.epoch();
    drop(first_kv);
    drop(first);
    let second = Engine::from_config(&config(&etcd, "decode-0", "/r/")).unwrap();
    let _dst = second.alloc("kv", 64, Access::REMOTE_READ_WRITE).unwrap();
    // The watch reports the old entry stale; the name then resolves to the new life.
    eventually("the new life is resolved", Duration::from_secs(15), || {
        prefill
            .connect("decode-0")
            .is_ok_and(|p| p.epoch() == second.epoch())
    });
    assert_ne!(second.epoch(), first_epoch);
    let src = prefill.alloc("src", 64, Access::LOCAL).unwrap();
    let e = prefill
        .transfer(&old, &[TransferRequest::write(src.id(), 0, old_kv, 0, 64)])
        .and_then(|h| h.wait())
        .unwrap_err();
    assert!(
        matches!(
            e.kind(),
            ErrorKind::PeerUnreachable | ErrorKind::PeerRestarted
        ),
        "{e}"
    );
}

#[test]
fn an_engine_killed_hard_leaves_the_store_when_its_lease_expires() {
    let Some(etcd) = Etcd::start() else { return };
    let dir = std::env::temp_dir().join(format!("te-etcd-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str| {
        let path = dir.join(format!("{name}.toml"));
        std::fs::write(
            &path,
            format!(
                "[engine]\nname = \"{name}\"\nbackend = \"tcp\"\nmetadata = \"{}\"\nmetadata_prefix = \"/cli/\"\nmetadata_ttl = \"2s\"\n",
                etcd.url()
            ),
        )
        .unwrap();
        path
    };
    let (serve_cfg, bench_cfg) = (write("decode-0"), write("bench-0"));
    let te = env!("CARGO_BIN_EXE_te");
    let mut serve = Command::new(te)
        .args(["serve", "--config"])
        .arg(&serve_cfg)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // te serve publishes itself when its engine starts and prints its address once its
    // buffer is registered: wait for that line (EOF if it died) before benching.
    let mut first = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(serve.stdout.take().unwrap()),
        &mut first,
    )
    .unwrap();
    assert!(!first.trim().is_empty(), "te serve printed no address");
    let bench = || {
        Command::new(te)
            .args(["bench", "--config"])
            .arg(&bench_cfg)
            .args(["--target", "decode-0", "--verify", "--duration", "300ms"])
            .args(["--block-size", "64KiB", "--batch", "4"])
            .output()
            .unwrap()
    };
    let peers = || {
        let out = Command::new(te)
            .args(["peers", "--config"])
            .arg(&bench_cfg)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    eventually("te serve published", Duration::from_secs(30), || {
        peers().contains("decode-0")
    });
    let out = bench();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serve.kill().unwrap();
    serve.wait().unwrap();
    eventually("the lease expired", Duration::from_secs(20), || {
        !peers().contains("decode-0")
    });
    let out = bench();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no engine named `decode-0`"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn engines_publish_again_after_etcd_restarts() {
    let Some(etcd) = Etcd::start() else { return };
    let c = config(&etcd, "decode-0", "/x/");
    let engine = Engine::from_config(&c).unwrap();
    let me = vec![("decode-0".to_string(), engine.epoch())];
    assert_eq!(names(&c), me);
    // Its data kept: the lease survives or is granted anew.
    let etcd = etcd.restart(true);
    eventually("published after a restart", Duration::from_secs(20), || {
        names(&c) == me
    });
    // Its data lost: the engine notices its lease is gone and publishes again.
    let etcd = etcd.restart(false);
    eventually(
        "published after a restart that lost everything",
        Duration::from_secs(20),
        || names(&c) == me,
    );
    drop(etcd);
}

#[test]
fn etcd_unreachable_at_start_is_a_clear_error_naming_it() {
    let mut c = Config::defaults();
    let port = free_port();
    c.engine.metadata = format!("etcd://127.0.0.1:{port}");
    c.engine.default_timeout = Duration::from_secs(5);
    let e = Engine::from_config(&c).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerUnreachable, "{e}");
    assert!(
        e.to_string().contains(&format!("etcd://127.0.0.1:{port}")),
        "{e}"
    );
}

/// A listener that takes connections and never answers (an etcd whose host froze, or a
/// proxy in front of a dead one). Returns its address and how many connections it took.
fn blackhole() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let taken = std::sync::Arc::new(AtomicUsize::new(0));
    let count = taken.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in l.incoming().take(64) {
            count.fetch_add(1, Ordering::SeqCst);
            held.push(c);
        }
    });
    (addr, taken)
}

/// The first of two endpoints accepts and never answers: a call given 3 s still gets
/// its answer from the second, and later calls go to the one that answered.
#[test]
fn an_endpoint_that_never_answers_leaves_time_for_the_next() {
    use std::sync::atomic::Ordering;
    let Some(etcd) = Etcd::start() else { return };
    let (hole, taken) = blackhole();
    let mut c = config(&etcd, "decode-0", "/h/");
    c.engine.metadata = format!("etcd://{hole},127.0.0.1:{}", etcd.client);
    let store = te_core::metadata::open(&c.engine).unwrap();
    let start = Instant::now();
    let first = store.list(Deadline::after(Duration::from_secs(3)));
    let took = start.elapsed();
    assert!(
        first.is_ok(),
        "with a silent endpoint first and etcd second, a call given 3 s failed after \
         {took:?}: {}",
        first.unwrap_err()
    );
    assert_eq!(taken.load(Ordering::SeqCst), 1);
    for _ in 0..3 {
        store
            .list(Deadline::after(Duration::from_secs(3)))
            .expect("etcd answers");
    }
    assert_eq!(
        taken.load(Ordering::SeqCst),
        1,
        "calls after etcd answered went to the silent endpoint first again"
    );
}
