//! Threads te starts take none of the signals sent to the process (te-core's
//! `kit::thread`): an application's own threads get Ctrl-C and SIGTERM. One test in
//! this binary, so every thread that appears during it is te's.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::engine;
use te::{Access, TransferRequest};

/// The process's threads: (id, name).
fn threads() -> Vec<(u32, String)> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            let tid: u32 = e.file_name().to_str()?.parse().ok()?;
            let name = std::fs::read_to_string(e.path().join("comm")).ok()?;
            Some((tid, name.trim().to_string()))
        })
        .collect()
}

/// Thread `tid`'s blocked signals, from /proc (`None` once it has ended).
fn blocked(tid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("SigBlk:"))?;
    u64::from_str_radix(line["SigBlk:".len()..].trim(), 16).ok()
}

#[test]
fn every_thread_te_starts_blocks_the_signals_sent_to_the_process() {
    let before: HashSet<u32> = threads().into_iter().map(|t| t.0).collect();
    // Two engines of every part that starts threads here: the control plane and its
    // lookups, the metrics endpoint, tcp's runtime, transfers of host and device
    // memory, notifications.
    let target = engine(|c| {
        c.backend = "tcp".into();
        c.metrics_listen = Some("127.0.0.1:0".into());
    });
    let me = engine(|c| c.backend = "tcp".into());
    let dst = target
        .alloc("dst", 1 << 20, Access::REMOTE_READ_WRITE)
        .unwrap();
    let dev = target
        .alloc_on(
            &"fakedev:0".parse().unwrap(),
            "dev",
            1 << 20,
            Access::REMOTE_READ_WRITE,
        )
        .unwrap();
    let src = me.alloc("src", 1 << 20, Access::LOCAL).unwrap();
    let peer = me
        .connect_with(&target.address().to_string(), Duration::from_secs(10))
        .unwrap();
    for name in ["dst", "dev"] {
        let rid = peer.region(name).unwrap().id;
        for req in [
            TransferRequest::write(src.id(), 0, rid, 0, 1 << 20),
            TransferRequest::read(src.id(), 0, rid, 0, 1 << 20),
        ] {
            me.transfer(&peer, &[req]).unwrap().wait().unwrap();
        }
    }
    me.notify(&peer, b"hello".to_vec()).unwrap().wait().unwrap();
    // The stub backend's threads too.
    let (a, b) = (
        engine(|c| c.backend = "stub".into()),
        engine(|c| c.backend = "stub".into()),
    );
    let there = b.alloc("there", 4096, Access::REMOTE_READ_WRITE).unwrap();
    let here = a.alloc("here", 4096, Access::LOCAL).unwrap();
    let to_b = a
        .connect_with(&b.address().to_string(), Duration::from_secs(10))
        .unwrap();
    let rid = to_b.region("there").unwrap().id;
    a.transfer(&to_b, &[TransferRequest::write(here.id(), 0, rid, 0, 4096)])
        .unwrap()
        .wait()
        .unwrap();
    let _ = target.recv_notification(Duration::from_secs(5));
    let sigint = 1u64 << (libc::SIGINT - 1);
    let sigterm = 1u64 << (libc::SIGTERM - 1);
    let new: Vec<(u32, String)> = threads()
        .into_iter()
        .filter(|t| !before.contains(&t.0))
        .collect();
    assert!(!new.is_empty(), "te started no thread");
    let taking: Vec<&String> = new
        .iter()
        .filter(|(tid, _)| {
            blocked(*tid).is_some_and(|m| m & (sigint | sigterm) != sigint | sigterm)
        })
        .map(|(_, name)| name)
        .collect();
    println!(
        "te's threads: {:?}",
        new.iter().map(|t| &t.1).collect::<Vec<_>>()
    );
    assert!(
        taking.is_empty(),
        "these threads te started take SIGINT or SIGTERM: {taking:?}"
    );
    drop((dst, dev, src, peer, me, target, there, here, to_b, a, b));
}
