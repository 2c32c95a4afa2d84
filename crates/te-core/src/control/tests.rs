//! The control plane's own checks: what `Ready` announces and what a sender refuses
//! before anything is sent.

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
