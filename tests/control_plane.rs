//! The control plane under hostile input: random, truncated and oversized frames get an
//! error or a closed connection, and the engine keeps serving good peers.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use te::{Access, Config, Engine, TransferRequest};

/// Sends `bytes`, half-closes, and reads whatever comes back until the server closes.
fn poke(addr: &str, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).expect("connect to the control plane");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(bytes);
    let _ = s.shutdown(Shutdown::Write);
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply);
    reply
}

fn header(version: u8, kind: u8, len: u32) -> Vec<u8> {
    let mut h = b"TE".to_vec();
    h.push(version);
    h.push(kind);
    h.extend_from_slice(&len.to_le_bytes());
    h.extend_from_slice(&1u64.to_le_bytes());
    h
}

#[test]
fn random_and_truncated_frames_do_not_disturb_good_peers() {
    let target = Engine::from_config(&Config::defaults()).unwrap();
    let dst = target
        .alloc("dst", 4096, Access::REMOTE_READ_WRITE)
        .unwrap();
    let addr = target.address().to_string();
    // Some clients connect and say nothing; they must not block anyone.
    let idle: Vec<TcpStream> = (0..32)
        .map(|_| TcpStream::connect(&addr).unwrap())
        .collect();

    let mut rng = rand::rngs::StdRng::seed_from_u64(0x7e);
    let good_get = header(2, 6, 0);
    let mut frames: Vec<Vec<u8>> = Vec::new();
    for i in 0..3000 {
        let frame = match i % 6 {
            0 => (0..rng.random_range(0..64)).map(|_| rng.random()).collect(),
            1 => good_get[..rng.random_range(0..good_get.len())].to_vec(),
            2 => header(rng.random(), rng.random(), rng.random()),
            3 => header(2, rng.random_range(0..16), u32::MAX),
            4 => {
                let mut f = header(2, rng.random_range(1..15), 40);
                f.extend((0..40).map(|_| rng.random::<u8>()));
                f
            }
            _ => {
                let mut f = header(2, 1, 1000);
                f.extend((0..rng.random_range(0..999)).map(|_| rng.random::<u8>()));
                f
            }
        };
        frames.push(frame);
    }
    let mut replies = 0;
    for f in &frames {
        let reply = poke(&addr, f);
        if !reply.is_empty() {
            assert_eq!(&reply[..2], b"TE", "a reply is a frame");
            replies += 1;
        }
    }
    assert!(
        replies > 0,
        "malformed frames should get an error reply before the close"
    );

    // A good peer is still served, with data moving.
    let initiator = Engine::from_config(&Config::defaults()).unwrap();
    let src = initiator.alloc("src", 4096, Access::LOCAL).unwrap();
    src.write(0, &[0xab; 4096]).unwrap();
    let peer = initiator.connect(&addr).unwrap();
    let rid = peer.region("dst").unwrap().id;
    initiator
        .transfer(&peer, &[TransferRequest::write(src.id(), 0, rid, 0, 4096)])
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(dst.to_vec().unwrap(), vec![0xab; 4096]);
    drop(idle);
}

#[test]
fn a_descriptor_request_without_a_handshake_is_refused_and_says_nothing() {
    let target = Engine::from_config(&Config::defaults()).unwrap();
    let _dst = target
        .alloc("secret-region", 4096, Access::REMOTE_READ_WRITE)
        .unwrap();
    let reply = poke(&target.address().to_string(), &header(2, 6, 0));
    assert!(reply.len() >= 16, "an error frame comes back: {reply:?}");
    assert_eq!(&reply[..4], &[b'T', b'E', 2, 5], "an Error frame");
    let text = String::from_utf8_lossy(&reply);
    assert!(text.contains("hello"), "{text}");
    assert!(
        !text.contains("secret-region"),
        "the descriptor leaked: {text}"
    );
}

#[test]
fn connecting_to_nothing_fails_fast_with_peer_unreachable() {
    let initiator = Engine::from_config(&Config::defaults()).unwrap();
    // Bind and drop a listener to find a port nobody serves.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let e = initiator.connect(&format!("127.0.0.1:{port}")).unwrap_err();
    assert_eq!(e.kind(), te::ErrorKind::PeerUnreachable, "{e}");
    assert!(e.to_string().contains("is it running"), "{e}");
    let e = initiator.connect("not an address").unwrap_err();
    assert_eq!(e.kind(), te::ErrorKind::PeerUnreachable, "{e}");
}

#[test]
fn a_peer_that_restarts_is_noticed_and_old_handles_refuse_its_new_life() {
    let config = Config::defaults();
    let initiator = Engine::from_config(&config).unwrap();
    let src = initiator.alloc("src", 4096, Access::LOCAL).unwrap();
    let mut c = config.clone();
    let first = Engine::from_config(&c).unwrap();
    let addr = first.address().to_string();
    let dst = first.alloc("dst", 4096, Access::REMOTE_READ_WRITE).unwrap();
    let peer = initiator.connect(&addr).unwrap();
    let rid = peer.region("dst").unwrap().id;
    let req = [TransferRequest::write(src.id(), 0, rid, 0, 64)];
    initiator.transfer(&peer, &req).unwrap().wait().unwrap();
    drop(dst);
    drop(first);
    // The same address, a new life.
    c.engine.listen = addr.clone();
    let second = Engine::from_config(&c).unwrap();
    let dst2 = second
        .alloc("dst", 4096, Access::REMOTE_READ_WRITE)
        .unwrap();
    src.write(0, &[7; 64]).unwrap();
    // The old peer's batch fails (its endpoint is gone), invalidating the cache.
    let first_try = initiator.transfer(&peer, &req).map(|h| h.wait());
    assert!(
        matches!(first_try, Ok(Err(_)) | Err(_)),
        "a write reached the old life: {first_try:?}"
    );
    let again = initiator.transfer(&peer, &req).map(|h| h.wait());
    match again {
        Err(e) => assert_eq!(e.kind(), te::ErrorKind::PeerRestarted, "{e}"),
        other => panic!("expected PeerRestarted, got {other:?}"),
    }
    assert_eq!(
        dst2.to_vec().unwrap(),
        vec![0; 4096],
        "the new life received a write meant for the old one"
    );
    // Connecting again gives the new life.
    let fresh = initiator.connect(&addr).unwrap();
    assert_eq!(fresh.epoch(), second.epoch());
    let rid = fresh.region("dst").unwrap().id;
    initiator
        .transfer(&fresh, &[TransferRequest::write(src.id(), 0, rid, 0, 64)])
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(&dst2.to_vec().unwrap()[..64], &[7; 64]);
}

#[test]
fn refresh_makes_regions_registered_after_connect_visible() {
    let config = Config::defaults();
    let target = Engine::from_config(&config).unwrap();
    let initiator = Engine::from_config(&config).unwrap();
    let peer = initiator.connect(&target.address().to_string()).unwrap();
    assert!(peer.region("late").is_none());
    let _late = target
        .alloc("late", 4096, Access::REMOTE_READ_WRITE)
        .unwrap();
    assert!(
        peer.region("late").is_none(),
        "a peer's descriptor is a snapshot"
    );
    initiator.refresh(&peer, Duration::from_secs(5)).unwrap();
    assert_eq!(peer.region("late").expect("refreshed").len, 4096);
    drop(target);
    let e = initiator
        .refresh(&peer, Duration::from_secs(2))
        .expect_err("the target is gone");
    assert!(
        matches!(
            e.kind(),
            te::ErrorKind::PeerUnreachable | te::ErrorKind::PeerRestarted | te::ErrorKind::Timeout
        ),
        "{e}"
    );
}
