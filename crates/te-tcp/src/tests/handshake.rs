//! The handshake's refusals: a wrong or missing token, a token on the wire, a
//! restarted target, a peer of another protocol version.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use te_core::{ErrorKind, TransferBackend};

use super::{backend, read_until_closed, segment, soon};
use crate::endpoint::decode_endpoint;

#[test]
fn a_peer_without_the_right_auth_token_is_refused_before_any_data_moves() {
    let target = backend(|c| c.auth_token = Some("s3cret".into()));
    let seg = segment(&target);
    for token in [None, Some("wrong"), Some("s3cret ")] {
        let init = backend(|c| c.auth_token = token.map(String::from));
        let e = init.connect(&seg, soon()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unauthorized, "{token:?}: {e}");
        assert!(e.to_string().contains("auth_token"), "{e}");
    }
    // A target without a token cannot prove one to an initiator that has one.
    let open = backend(|_| {});
    let init = backend(|c| c.auth_token = Some("s3cret".into()));
    let e = init.connect(&segment(&open), soon()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unauthorized, "{e}");
    // The same token on both sides works.
    init.connect(&seg, soon()).expect("same token");
}

#[test]
fn the_token_never_travels_in_clear() {
    // Record what the initiator sends by standing in for the target.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let recorder = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut hello = [0u8; crate::wire::Hello::LEN];
        s.read_exact(&mut hello).unwrap();
        let ch = crate::wire::Challenge {
            version: crate::wire::VERSION,
            status: crate::wire::Status::Ok,
            auth: true,
            nonce: [9; 32],
        };
        s.write_all(&ch.encode()).unwrap();
        let terms = crate::wire::Terms { max_payload: 65536 };
        s.write_all(&terms.encode()).unwrap();
        let mut all = hello.to_vec();
        let mut proof = [0u8; crate::wire::Proof::LEN];
        if s.read_exact(&mut proof).is_ok() {
            all.extend(proof);
        }
        // No welcome: the initiator sees the end at once, gives up and closes; anything
        // else it sent on the way is recorded too.
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        all.extend(rest);
        all
    });
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let token = b"correct horse battery staple";
    let _ = crate::handshake::handshake(&mut s, "recorder", 7, Some(token));
    drop(s);
    let sent = recorder.join().unwrap();
    assert!(sent.len() >= crate::wire::Hello::LEN + crate::wire::Proof::LEN);
    assert!(
        !sent.windows(6).any(|w| token.windows(6).any(|t| t == w)),
        "part of the token appears on the wire"
    );
}

#[test]
fn a_restarted_target_refuses_connections_meant_for_its_previous_life() {
    let first = backend(|_| {});
    let old = segment(&first);
    let port = first.data_addr().port();
    drop(first);
    let second = backend(|c| c.listen = Some(format!("127.0.0.1:{port}")));
    assert_eq!(second.data_addr().port(), port, "rebound the same port");
    let init = backend(|_| {});
    let e = init.connect(&old, soon()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerRestarted, "{e}");
    init.connect(&segment(&second), soon())
        .expect("the new life");
}

#[test]
fn a_version_2_peer_is_refused_with_a_version_mismatch_on_both_sides() {
    use crate::wire::{Challenge, Hello, Status};
    // A version-2 initiator at a version-3 target: the challenge says `Version`, and
    // nothing else follows (no terms), so the old peer reports the mismatch.
    let target = backend(|_| {});
    let crate::endpoint::Endpoint { addr, instance, .. } =
        decode_endpoint(&target.endpoint()).unwrap();
    let mut s = TcpStream::connect(addr).unwrap();
    let hello = Hello {
        version: 2,
        instance,
        nonce: [1; 32],
    };
    s.write_all(&hello.encode()).unwrap();
    let mut b = [0u8; Challenge::LEN];
    s.read_exact(&mut b).unwrap();
    let ch = Challenge::decode(&b).unwrap();
    assert_eq!((ch.status, ch.version), (Status::Version, 3));
    let (rest, closed) = read_until_closed(&mut s);
    assert!(rest.is_empty() && closed, "the refusal is the last message");
    // A version-3 initiator at a version-2 target (a raw one) gets a clear error.
    let old = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let at = old.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (mut c, _) = old.accept().unwrap();
        let mut b = [0u8; Hello::LEN];
        c.read_exact(&mut b).unwrap();
        let ch = Challenge {
            version: 2,
            status: Status::Version,
            auth: false,
            nonce: [2; 32],
        };
        c.write_all(&ch.encode()).unwrap();
    });
    let mut s = TcpStream::connect(at).unwrap();
    let e = crate::handshake::handshake(&mut s, "old", 7, None).unwrap_err();
    t.join().unwrap();
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    assert!(e.to_string().contains("protocol 2 and this side 3"), "{e}");
}
