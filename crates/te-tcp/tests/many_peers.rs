//! Threads do not grow with peers: 200 initiators with 4 data connections each move
//! bytes to one target, all in this process, on te-tcp's fixed set of I/O threads.
//!
//! Its own test binary, so the threads counted are this test's alone.

mod common;

use std::sync::mpsc;
use std::time::Duration;

use te_core::{
    Access, BackendContext, Completion, Deadline, MemoryDesc, MemoryKind, Op, RegionId,
    TransferBackend, TransferRequest,
};
use te_tcp::{TcpBackend, TcpConfig};

const PEERS: usize = 200;
const CONNECTIONS: usize = 4;
const BLOCK: usize = 4096;

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .collect()
}

fn sockets() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| l.to_string_lossy().starts_with("socket:"))
        .count()
}

/// Room for every socket of both sides (about 2,600) whatever `ulimit -n` says.
fn raise_descriptor_limit(want: u64) {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `r` is a valid rlimit the call fills in.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) }, 0);
    if r.rlim_cur < want {
        r.rlim_cur = want.min(r.rlim_max);
        // SAFETY: `r` is a valid rlimit; only the soft limit changes, within the hard one.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &r) }, 0);
    }
    assert!(
        r.rlim_cur >= 4096,
        "this test needs 4096 descriptors; the hard limit is {}",
        r.rlim_max
    );
}

fn config() -> TcpConfig {
    let mut c = TcpConfig::default();
    c.connections_per_peer = CONNECTIONS;
    c
}

fn register(b: &TcpBackend, id: u64, v: &mut [u8]) {
    let mem = MemoryDesc {
        name: "m".into(),
        addr: v.as_mut_ptr() as u64,
        len: v.len() as u64,
        kind: MemoryKind::Host,
        access: Access::REMOTE_READ_WRITE,
    };
    b.register(RegionId(id), &mem).expect("register");
}

#[test]
fn two_hundred_peers_with_four_connections_each_run_on_a_fixed_set_of_io_threads() {
    raise_descriptor_limit(8192);
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let (threads_before, sockets_before) = (threads(), sockets());
    let ctx = BackendContext::default();
    let target = TcpBackend::new(config(), &ctx).expect("target");
    let mut dst = vec![0u8; PEERS * BLOCK];
    register(&target, 1, &mut dst);
    let seg = common::segment(&target);
    let mut peers = Vec::with_capacity(PEERS);
    let mut threads_one_peer = 0;
    for i in 0..PEERS {
        if i == 1 {
            // The runtimes every backend uses have started with the first peer.
            threads_one_peer = threads();
        }
        let b = TcpBackend::new(config(), &ctx).expect("initiator");
        let mut src = vec![i as u8 + 1; BLOCK];
        register(&b, 1, &mut src);
        let p = b
            .connect(&seg, Deadline::after(Duration::from_secs(20)))
            .expect("connect");
        peers.push((b, p, src));
    }
    // Every peer writes its block into its own part of the target, all at once.
    let (tx, rx) = mpsc::channel();
    for (i, (b, p, _)) in peers.iter().enumerate() {
        let tx = tx.clone();
        let done = Completion::new(Duration::from_secs(30), move |r, _| {
            let _ = tx.send(r);
        });
        let req = TransferRequest {
            op: Op::Write,
            local: RegionId(1),
            local_offset: 0,
            remote: RegionId(1),
            remote_offset: (i * BLOCK) as u64,
            len: BLOCK as u64,
        };
        b.submit(*p, &[req], done).expect("submit");
    }
    for _ in 0..PEERS {
        rx.recv_timeout(Duration::from_secs(30))
            .expect("every batch completes")
            .expect("every write succeeds");
    }
    let (threads_now, sockets_now) = (threads(), sockets());
    let names = thread_names();
    let io = names.iter().filter(|n| n.as_str() == "te-tcp-io").count();
    println!(
        "{PEERS} peers × {CONNECTIONS} connections: threads {threads_before} before, \
         {threads_one_peer} with one peer, {threads_now} with {PEERS} ({io} te-tcp I/O \
         threads, {cores} cores); sockets {sockets_before} → {sockets_now}; {names:?}"
    );
    // Both ends of every data connection live in this process.
    assert!(
        sockets_now - sockets_before >= 2 * PEERS * CONNECTIONS,
        "expected at least {} sockets, found {}",
        2 * PEERS * CONNECTIONS,
        sockets_now - sockets_before
    );
    assert!(
        (1..=2 * cores).contains(&io),
        "{io} te-tcp I/O threads; 1 to {} (2 × {cores} cores) were expected",
        2 * cores
    );
    assert_eq!(
        threads_now, threads_one_peer,
        "threads grew from {threads_one_peer} with one peer to {threads_now} with {PEERS}: {names:?}"
    );
    for (i, block) in dst.chunks(BLOCK).enumerate() {
        assert!(block.iter().all(|&x| x == i as u8 + 1), "block {i}");
    }
    drop(peers);
    drop(target);
}
