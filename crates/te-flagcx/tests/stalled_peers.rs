//! Peers that stop answering, driven directly through `TransferBackend` over the FAKE
//! shim (or speaking its wire protocol by hand): what they may hold up, and for how
//! long. Every test is bounded; they run one at a time (a process-wide lock) because
//! some count this process's threads.

use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use te_core::{Access, ErrorKind, TransferBackend};

mod direct;
use direct::*;

/// A peer that accepts the TCP connection but never answers the handshake: `connect`
/// returns `Timeout` at its deadline while the attempt goes on, later connects wait for
/// that same attempt (one thread per peer), and dropping the backend cancels it: 1 s
/// later no attempt thread is left and the engine no longer listens.
#[test]
fn connect_attempts_to_a_silent_peer_do_not_outlive_the_backend() {
    let _g = serial();
    // Listening, never accepting: the kernel completes the TCP handshake, nobody answers.
    let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
    let seg = segment(
        silent.local_addr().expect("addr").to_string().into_bytes(),
        "127.0.0.1:7009",
        vec![region(1, 0x1000_0000, 4096, Access::REMOTE_READ_WRITE)],
    );
    let before = threads_named("te-flagcx-conn");
    let b = backend("");
    let endpoint = String::from_utf8(b.endpoint()).expect("text endpoint");
    for _ in 0..3 {
        let start = Instant::now();
        let r = b.connect_within(&seg, Instant::now() + Duration::from_millis(200));
        assert!(
            matches!(&r, Err(e) if e.kind() == ErrorKind::Timeout),
            "connect to a silent peer: {r:?}"
        );
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "connect overran its deadline"
        );
    }
    // The three connects shared one attempt: one thread per peer, not one per call.
    let attempts = threads_named("te-flagcx-conn").saturating_sub(before);
    assert!(
        attempts <= 1,
        "three connects to one silent peer left {attempts} te-flagcx-connect threads"
    );
    drop(b);
    std::thread::sleep(Duration::from_millis(1000));
    let leaked = threads_named("te-flagcx-conn").saturating_sub(before);
    let still_listening = TcpStream::connect_timeout(
        &endpoint.parse().expect("socket address"),
        Duration::from_millis(500),
    )
    .is_ok();
    // Unblock the attempts (their sockets get reset) so the test leaves nothing behind.
    drop(silent);
    assert!(
        leaked == 0 && !still_listening,
        "1 s after the backend was dropped, {leaked} te-flagcx-connect thread(s) are still blocked on the silent peer, and the dropped backend's FlagCX endpoint {endpoint} still accepts connections: {still_listening}"
    );
}
