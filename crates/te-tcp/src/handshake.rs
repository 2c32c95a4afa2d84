//! te-tcp's data-connection handshake, both sides: the initiator's hello, the target's
//! challenge and terms (frame limit), the proof of the shared token, the welcome.

use std::io::{Read, Write};
use std::net::TcpStream;

use te_core::{Error, ErrorKind, Result};

use crate::errors::unreachable;
use crate::errors::{io_err, protocol};
use crate::sock::Sock;
use crate::state::Shared;
use crate::wire::{self, Challenge, Hello, Proof, Status, Terms, Welcome};

/// Runs the initiator's side of the handshake on a fresh stream; returns the target's
/// terms and its challenge nonce (which a same-host channel presents, see `samehost`).
pub(crate) fn handshake(
    s: &mut TcpStream,
    label: &str,
    instance: u64,
    token: Option<&[u8]>,
) -> Result<(Terms, [u8; wire::NONCE_LEN])> {
    let io = |what: &str| {
        let what = what.to_string();
        move |e: std::io::Error| unreachable(label, &what, e)
    };
    let proto = |e: wire::WireError| {
        Error::new(
            ErrorKind::Protocol,
            format!("data connection to {label}: the peer's handshake is malformed: {e}"),
        )
    };
    let nonce: [u8; wire::NONCE_LEN] = rand::random();
    let hello = Hello {
        version: wire::VERSION,
        instance,
        nonce,
    };
    s.write_all(&hello.encode()).map_err(io("sending hello"))?;
    let mut b = [0u8; Challenge::LEN];
    s.read_exact(&mut b).map_err(io("reading the challenge"))?;
    let ch = Challenge::decode(&b).map_err(proto)?;
    match ch.status {
        Status::Ok => {}
        Status::WrongInstance => {
            return Err(Error::new(
                ErrorKind::PeerRestarted,
                format!(
                    "{label} is a new instance of the peer (it restarted); its old descriptor is void: connect again"
                ),
            ))
        }
        Status::Version => {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{label} speaks te-tcp protocol {} and this side {}; run the same te version on both",
                    ch.version,
                    wire::VERSION
                ),
            ))
        }
        Status::AuthFailed => return Err(proto(wire::WireError::Field("status"))),
    }
    let mut b = [0u8; Terms::LEN];
    s.read_exact(&mut b).map_err(io("reading the terms"))?;
    let terms = Terms::decode(&b).map_err(proto)?;
    let mac = match (token, ch.auth) {
        (Some(t), true) => te_core::auth::prove(t, &wire::role("initiator", instance), &nonce, &ch.nonce),
        (None, false) => [0; te_core::auth::LEN],
        (None, true) => {
            // Send a proof that cannot match, so the target logs the refusal too.
            [0; te_core::auth::LEN]
        }
        (Some(_), false) => {
            return Err(Error::new(
                ErrorKind::Unauthorized,
                format!(
                    "{label} does not require an auth_token but this side has one; set the same [engine] auth_token on both sides"
                ),
            ))
        }
    };
    s.write_all(&Proof { mac }.encode())
        .map_err(io("sending the proof"))?;
    let mut b = [0u8; Welcome::LEN];
    s.read_exact(&mut b).map_err(io("reading the welcome"))?;
    let w = Welcome::decode(&b).map_err(proto)?;
    if w.status == Status::AuthFailed {
        return Err(Error::new(
            ErrorKind::Unauthorized,
            format!(
                "{label} refused the data connection: {}; set the same [engine] auth_token on both sides",
                if token.is_some() { "wrong auth_token" } else { "it requires an auth_token and this side has none" }
            ),
        ));
    }
    if w.status != Status::Ok {
        return Err(proto(wire::WireError::Field("status")));
    }
    if let Some(t) = token {
        if !te_core::auth::verify(
            t,
            &wire::role("target", instance),
            &ch.nonce,
            &nonce,
            &w.mac,
        ) {
            return Err(Error::new(
                ErrorKind::Unauthorized,
                format!("{label} could not prove the auth_token: it is not the peer it claims to be, or its token differs"),
            ));
        }
    }
    Ok((terms, ch.nonce))
}

/// The target's side of the handshake. `Ok(false)`: refused (already answered).
pub(crate) async fn answer(shared: &Shared, s: &Sock, peer: &str) -> Result<bool> {
    let until = tokio::time::Instant::now() + shared.config.handshake_timeout;
    let mut b = [0u8; Hello::LEN];
    s.read_exact_by(&mut b, until)
        .await
        .map_err(|e| io_err(peer, "reading the hello", e))?;
    let hello = Hello::decode(&b).map_err(|e| protocol(peer, e))?;
    let nonce: [u8; wire::NONCE_LEN] = rand::random();
    let token = shared.config.auth_token.as_deref().map(str::as_bytes);
    let status = if hello.version != wire::VERSION {
        Status::Version
    } else if hello.instance != shared.instance {
        Status::WrongInstance
    } else {
        Status::Ok
    };
    let ch = Challenge {
        version: wire::VERSION,
        status,
        auth: token.is_some(),
        nonce,
    };
    let mut answer = ch.encode().to_vec();
    if status == Status::Ok {
        // Our staging memory is sized for `slice_size` frames: no frame may carry more.
        let terms = Terms {
            max_payload: shared.config.slice_size,
        };
        answer.extend_from_slice(&terms.encode());
    }
    s.write_all_by(&answer, until)
        .await
        .map_err(|e| io_err(peer, "sending the challenge", e))?;
    if status != Status::Ok {
        tracing::warn!(peer = %peer, ?status, version = hello.version, "refused a data connection");
        return Ok(false);
    }
    let mut b = [0u8; Proof::LEN];
    s.read_exact_by(&mut b, until)
        .await
        .map_err(|e| io_err(peer, "reading the proof", e))?;
    let proof = Proof::decode(&b).map_err(|e| protocol(peer, e))?;
    let (status, mac) = match token {
        None => (Status::Ok, [0; te_core::auth::LEN]),
        Some(t) => {
            let role = |side| wire::role(side, shared.instance);
            if te_core::auth::verify(t, &role("initiator"), &hello.nonce, &nonce, &proof.mac) {
                let mac = te_core::auth::prove(t, &role("target"), &nonce, &hello.nonce);
                (Status::Ok, mac)
            } else {
                (Status::AuthFailed, [0; te_core::auth::LEN])
            }
        }
    };
    if status == Status::Ok {
        // The initiator may present this nonce on our same-host channel: only a peer of
        // this connection knows it. Recorded before the welcome goes, so a channel it
        // opens as soon as it reads the welcome finds it.
        shared.nonces.record(nonce);
    }
    s.write_all_by(&Welcome { status, mac }.encode(), until)
        .await
        .map_err(|e| io_err(peer, "sending the welcome", e))?;
    if status != Status::Ok {
        tracing::warn!(peer = %peer, "refused a data connection: it did not prove the auth_token");
        return Ok(false);
    }
    Ok(true)
}
