//! Idle means no wake-ups: an engine and a `te serve` in another process, connected and
//! having moved data (data connections, same-host channels and their threads open),
//! then left alone — every thread of both processes sleeps until the next heartbeat.

mod common;

use std::time::Duration;

use common::Serve;
use te::{Access, Config, Engine, TransferRequest};
use te_core::testkit::context_switches as switches;

/// Both processes' context switches over `idle`.
fn while_idle(server: &Serve, idle: Duration) -> (u64, u64) {
    let (me, it) = (std::process::id(), server.child.id());
    let before = (switches(me), switches(it));
    std::thread::sleep(idle);
    (switches(me) - before.0, switches(it) - before.1)
}

#[test]
fn an_idle_engine_and_its_peer_sleep_until_the_next_heartbeat() {
    // Heartbeats every 30 s, so none falls in the idle time measured.
    let quiet = "[engine]\nbackend = \"tcp\"\nheartbeat = \"30s\"\n";
    let dir = std::env::temp_dir().join(format!("te-idle-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("serve.toml");
    std::fs::write(&file, quiet).unwrap();
    let server = Serve::start(&[
        "--config",
        file.to_str().unwrap(),
        "--mem",
        "fakedev:0",
        "--buffer-size",
        "4MiB",
    ]);
    for tcp in [
        "local_ipc = true",
        "local_ipc = true\ncaller_reads = true",
        "local_ipc = false",
    ] {
        let text = format!("{quiet}[backends.tcp]\n{tcp}\n");
        let config = Config::from_toml(&text, "idle.toml", std::path::Path::new(".")).unwrap();
        let e = Engine::from_config(&config).unwrap();
        let kind: te::MemoryKind = "fakedev:0".parse().unwrap();
        let buf = e.alloc_on(&kind, "buf", 4 << 20, Access::LOCAL).unwrap();
        let host = e.alloc("host", 4 << 20, Access::LOCAL).unwrap();
        let peer = e.connect(&server.addr).unwrap();
        let remote = peer.region("buffer").unwrap().id;
        for id in [buf.id(), host.id()] {
            for r in [
                TransferRequest::write(id, 0, remote, 0, 4 << 20),
                TransferRequest::read(id, 0, remote, 0, 4 << 20),
            ] {
                e.transfer(&peer, &[r]).unwrap().wait().unwrap();
            }
        }
        // Let what the transfers set going settle, then measure.
        std::thread::sleep(Duration::from_millis(300));
        let (here, there) = while_idle(&server, Duration::from_secs(2));
        // A thread that polls, even every 100 ms, makes 20 or more in 2 s; a few come
        // from this test's own thread and the kernel's housekeeping.
        assert!(
            here <= 8 && there <= 8,
            "{tcp}: {here} context switches here and {there} in te serve in 2 s of idle"
        );
        drop(peer);
        drop(e);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
