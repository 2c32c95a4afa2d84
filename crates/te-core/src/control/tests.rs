//! The control plane's own checks: what `Ready` announces, what a sender refuses
//! before anything is sent, and which peers' departures the backend's handler hears of.

use super::session::fits;
use super::wire::{self, Identity, Kind};
use crate::error::ErrorKind;

fn peer(notification_max: Option<u64>) -> Identity {
    Identity {
        name: "decode-0".into(),
        epoch: 7,
        address: "127.0.0.1:1".into(),
        heartbeat_ms: 1000,
        notification_max,
    }
}

#[test]
fn ready_announces_the_notification_limit_and_an_older_ready_without_it_decodes() {
    let announced: Identity = wire::decode(&wire::encode(&peer(Some(4096))), "ready").unwrap();
    assert_eq!(announced.notification_max, Some(4096));

    #[derive(serde::Serialize)]
    struct OlderReady {
        name: &'static str,
        epoch: u64,
        address: &'static str,
        heartbeat_ms: u64,
    }
    let older: Identity = wire::decode(
        &wire::encode(&OlderReady {
            name: "decode-0",
            epoch: 7,
            address: "127.0.0.1:1",
            heartbeat_ms: 1000,
        }),
        "ready",
    )
    .unwrap();
    assert_eq!(older.notification_max, None);
}

#[test]
fn a_notification_over_the_peers_limit_is_refused_before_it_is_sent() {
    let p = peer(Some(4096));
    assert!(fits(&p, Kind::Notify, 4096).is_ok());
    let e = fits(&p, Kind::Notify, 64 << 10).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Busy, "{e}");
    assert!(
        e.to_string().contains("notification_max (4096 bytes)"),
        "{e}"
    );
    let e = fits(&p, Kind::GetSegment, 1 << 20).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{e}");
    // A peer that announces nothing decides itself.
    assert!(fits(&peer(None), Kind::Notify, 64 << 20).is_ok());
}

/// Sends each departure the handler hears of.
struct Departures(std::sync::Mutex<std::sync::mpsc::Sender<(String, u64)>>);

impl crate::MessageHandler for Departures {
    fn handle(&self, _: &crate::PeerInfo, _: &[u8], _: crate::Deadline) -> crate::Result<Vec<u8>> {
        Ok(Vec::new())
    }
    fn peer_gone(&self, name: &str, epoch: u64) {
        let _ = self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send((name.to_string(), epoch));
    }
}

/// A control plane named `name` with `epoch` that has called the one at `to`.
fn caller(name: &str, epoch: u64, to: &str) -> super::StandaloneControl {
    let config = crate::EngineConfig {
        name: name.into(),
        ..Default::default()
    };
    let c = super::StandaloneControl::start(&config, epoch).unwrap();
    let deadline = crate::Deadline::after(std::time::Duration::from_secs(5));
    c.hook().call(to, b"hello", deadline).unwrap();
    c
}

#[test]
fn the_handler_hears_of_a_peer_life_that_restarted_or_left_once_it_is_gone() {
    let target = super::StandaloneControl::start(&crate::EngineConfig::default(), 1).unwrap();
    let (tx, heard) = std::sync::mpsc::channel();
    target
        .hook()
        .serve(std::sync::Arc::new(Departures(std::sync::Mutex::new(tx))))
        .unwrap();
    let to = target.address().to_string();
    let wait = std::time::Duration::from_secs(5);
    let first = caller("prefill", 11, &to);
    let second = caller("prefill", 12, &to);
    assert!(heard.try_recv().is_err(), "both lives are up");
    // The first life ends while a newer one of its name is up: it restarted.
    drop(first);
    assert_eq!(
        heard.recv_timeout(wait).unwrap(),
        ("prefill".to_string(), 11)
    );
    // The second ends with a goodbye and no other life up: it left.
    drop(second);
    assert_eq!(
        heard.recv_timeout(wait).unwrap(),
        ("prefill".to_string(), 12)
    );
    assert!(heard.try_recv().is_err(), "each life is reported once");
}
