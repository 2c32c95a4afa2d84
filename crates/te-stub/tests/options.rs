//! The stub's options: noop mode, fault injection, delay, and its refusals.

use std::path::Path;
use std::time::{Duration, Instant};

use te_core::{Access, Buffer, Config, Engine, ErrorKind, Peer, TransferRequest};

// Link the stub so its registration is in this test's registry.
use te_stub as _;

fn config(table: &str) -> Config {
    Config::from_toml(
        &format!("[backends.stub]\n{table}\n"),
        "stub-test.toml",
        Path::new("."),
    )
    .unwrap()
}

fn pair(c: &Config) -> (Engine, Engine, Buffer, Buffer, Peer) {
    let target = Engine::from_config(c).unwrap();
    let initiator = Engine::from_config(c).unwrap();
    let dst = target
        .alloc("dst", 4096, Access::REMOTE_READ_WRITE)
        .unwrap();
    let src = initiator.alloc("src", 4096, Access::LOCAL).unwrap();
    src.write(0, &[1; 4096]).unwrap();
    let peer = initiator.connect(&target.address().to_string()).unwrap();
    (target, initiator, dst, src, peer)
}

fn write_all(src: &Buffer, peer: &Peer) -> [TransferRequest; 1] {
    [TransferRequest::write(
        src.id(),
        0,
        peer.region("dst").unwrap().id,
        0,
        4096,
    )]
}

#[test]
fn noop_mode_completes_without_moving_bytes() {
    let (_t, initiator, dst, src, peer) = pair(&config("mode = \"noop\""));
    initiator
        .transfer(&peer, &write_all(&src, &peer))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(dst.to_vec().unwrap(), vec![0; 4096]);
}

#[test]
fn fail_every_fails_exactly_every_nth_batch_and_only_it() {
    let (_t, initiator, dst, src, peer) = pair(&config("fail_every = 3"));
    let req = write_all(&src, &peer);
    let results: Vec<_> = (0..9)
        .map(|_| initiator.transfer(&peer, &req).unwrap().wait())
        .collect();
    for (i, r) in results.iter().enumerate() {
        if (i + 1) % 3 == 0 {
            let e = r.as_ref().unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Backend);
            assert!(e.to_string().contains("injected"), "{e}");
        } else {
            assert!(r.is_ok(), "batch {i}: {r:?}");
        }
    }
    assert_eq!(dst.to_vec().unwrap(), vec![1; 4096]);
    assert!(
        peer.is_valid(),
        "an injected failure must not drop the peer"
    );
}

#[test]
fn delay_holds_each_batch_back() {
    let (_t, initiator, _dst, src, peer) = pair(&config("delay = \"50ms\""));
    let start = Instant::now();
    initiator
        .transfer(&peer, &write_all(&src, &peer))
        .unwrap()
        .wait()
        .unwrap();
    assert!(start.elapsed() >= Duration::from_millis(50));
}

#[test]
fn unknown_options_and_bad_values_are_refused_with_the_key() {
    for (table, needle) in [
        ("speed = 3", "speed"),
        ("mode = \"fast\"", "fast"),
        ("delay = \"soon\"", "soon"),
    ] {
        let e = Engine::from_config(&config(table)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ConfigInvalid);
        assert!(
            e.to_string().contains(needle) && e.to_string().contains("stub-test.toml"),
            "{e}"
        );
    }
}

#[test]
fn a_dropped_target_fails_batches_with_peer_unreachable() {
    let (target, initiator, dst, src, peer) = pair(&config(""));
    let req = write_all(&src, &peer);
    drop(dst);
    drop(target);
    let r = initiator.transfer(&peer, &req).and_then(|h| h.wait());
    assert_eq!(r.unwrap_err().kind(), ErrorKind::PeerUnreachable);
    assert!(!peer.is_valid());
}
