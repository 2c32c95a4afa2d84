//! The target's side: the data listener and one thread per accepted connection, which
//! authenticates the initiator, then serves its requests in order.
//!
//! Every request is checked against this backend's own registrations (region, rights,
//! bounds) before a byte of its payload is placed: a WRITE lands straight in the
//! registered region and is acknowledged only once it is there; a refused WRITE's
//! payload is received and dropped, so the connection stays usable; a READ streams
//! straight from the registered region.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use te_core::{Error, ErrorKind, RegionId, Result};

use crate::backend::Shared;
use crate::regions::Pin;
use crate::sock::{self, Inbound};
use crate::wire::{self, Challenge, Header, Hello, Kind, Proof, Status, Welcome, HEADER_LEN};

/// Accepts data connections until the backend closes the listener.
pub(crate) fn accept_loop(shared: Arc<Shared>, listener: Arc<TcpListener>) {
    loop {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) => {
                if shared.closed.load(Ordering::Acquire) {
                    return;
                }
                if e.kind() == std::io::ErrorKind::Interrupted
                    || e.kind() == std::io::ErrorKind::ConnectionAborted
                {
                    continue;
                }
                tracing::error!(error = %e, "the tcp data listener failed; no more peers can connect");
                return;
            }
        };
        if shared.closed.load(Ordering::Acquire) {
            return;
        }
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        let Ok(clone) = stream.try_clone() else {
            continue;
        };
        let key = shared.next_serving.fetch_add(1, Ordering::Relaxed);
        shared
            .serving
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, clone);
        let s = shared.clone();
        let started = crate::conn::spawn(&shared.threads, "te-tcp-serve", move || {
            if let Err(e) = serve(&s, stream, &peer) {
                let quiet = matches!(e.kind(), ErrorKind::PeerUnreachable)
                    || s.closed.load(Ordering::Acquire);
                if quiet {
                    tracing::debug!(peer = %peer, error = %e, "data connection ended");
                } else {
                    tracing::warn!(peer = %peer, error = %e, "data connection closed");
                }
            }
            s.serving
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&key);
        });
        if started.is_err() {
            shared
                .serving
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&key);
        }
    }
}

fn io_err(peer: &str, what: &str, e: std::io::Error) -> Error {
    Error::new(
        ErrorKind::PeerUnreachable,
        format!("data connection from {peer}: {what}"),
    )
    .with_source(e)
}

fn protocol(peer: &str, e: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorKind::Protocol,
        format!("{peer} broke the te-tcp protocol ({e}); the connection was closed"),
    )
}

/// The target's side of the handshake. `Ok(false)`: refused (already answered).
fn handshake(shared: &Shared, s: &mut TcpStream, peer: &str) -> Result<bool> {
    let mut b = [0u8; Hello::LEN];
    s.read_exact(&mut b)
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
    s.write_all(&ch.encode())
        .map_err(|e| io_err(peer, "sending the challenge", e))?;
    if status != Status::Ok {
        tracing::warn!(peer = %peer, ?status, version = hello.version, "refused a data connection");
        return Ok(false);
    }
    let mut b = [0u8; Proof::LEN];
    s.read_exact(&mut b)
        .map_err(|e| io_err(peer, "reading the proof", e))?;
    let proof = Proof::decode(&b).map_err(|e| protocol(peer, e))?;
    let (status, mac) = match token {
        None => (Status::Ok, [0; crate::auth::MAC_LEN]),
        Some(t) => {
            let want = wire::mac(t, b"initiator", &hello.nonce, &nonce, shared.instance);
            if crate::auth::same(&want, &proof.mac) {
                let mac = wire::mac(t, b"target", &nonce, &hello.nonce, shared.instance);
                (Status::Ok, mac)
            } else {
                (Status::AuthFailed, [0; crate::auth::MAC_LEN])
            }
        }
    };
    s.write_all(&Welcome { status, mac }.encode())
        .map_err(|e| io_err(peer, "sending the welcome", e))?;
    if status != Status::Ok {
        tracing::warn!(peer = %peer, "refused a data connection: it did not prove the auth_token");
        return Ok(false);
    }
    Ok(true)
}

fn serve(shared: &Shared, mut s: TcpStream, peer: &str) -> Result<()> {
    let c = &shared.config;
    sock::tune(&s, c).map_err(|e| io_err(peer, "cannot set options", e))?;
    sock::timeouts(&s, c.connect_timeout).map_err(|e| io_err(peer, "cannot set timeouts", e))?;
    if !handshake(shared, &mut s, peer)? {
        return Ok(());
    }
    sock::timeouts(&s, c.io_timeout).map_err(|e| io_err(peer, "cannot set timeouts", e))?;
    let fd = s.as_raw_fd();
    let mut inb = Inbound::new(fd);
    // Acknowledgements and refusals not yet sent: flushed before this thread would
    // block on a receive, and in front of the next READ's data.
    let mut out: Vec<u8> = Vec::with_capacity(64 * HEADER_LEN);
    // Waiting for the next request may take forever; a request stalled halfway may not.
    let mut on_timeout = |mid: bool| !mid;
    loop {
        if inb.buffered().len() < HEADER_LEN && !out.is_empty() {
            sock::send_all(fd, &mut [sock::iov(out.as_ptr(), out.len())])
                .map_err(|e| io_err(peer, "send failed", e))?;
            out.clear();
        }
        inb.fill(HEADER_LEN, &mut on_timeout)
            .map_err(|e| io_err(peer, "receive failed", e))?;
        let h = Header::decode(&inb.buffered()[..HEADER_LEN]).map_err(|e| protocol(peer, e))?;
        inb.consume(HEADER_LEN);
        if !c.debug_delay.is_zero() {
            std::thread::sleep(c.debug_delay);
        }
        match h.kind {
            Kind::Write => {
                match admit(shared, &h, peer) {
                    Ok(pin) => {
                        let dst = pin.region().addr + h.offset;
                        if !out.is_empty() && inb.buffered().len() < h.len as usize {
                            // This receive may block: acknowledge what is done first.
                            sock::send_all(fd, &mut [sock::iov(out.as_ptr(), out.len())])
                                .map_err(|e| io_err(peer, "send failed", e))?;
                            out.clear();
                        }
                        // `admit` checked `offset + len` inside the region, and the pin
                        // keeps it registered until the bytes are in place.
                        inb.read_into(dst as *mut u8, h.len as usize, &mut on_timeout)
                            .map_err(|e| io_err(peer, "receive failed", e))?;
                        drop(pin);
                        out.extend_from_slice(
                            &Header::response(Kind::WriteAck, 0, h.id, 0).encode(),
                        );
                    }
                    Err(e) => {
                        inb.discard(h.len, &mut on_timeout)
                            .map_err(|e| io_err(peer, "receive failed", e))?;
                        refuse(&mut out, &h, &e);
                    }
                }
            }
            Kind::Read => match admit(shared, &h, peer) {
                Ok(pin) => {
                    let header = Header::response(Kind::ReadData, 0, h.id, h.len).encode();
                    let src = (pin.region().addr + h.offset) as *const u8;
                    let mut v = [
                        sock::iov(out.as_ptr(), out.len()),
                        sock::iov(header.as_ptr(), HEADER_LEN),
                        sock::iov(src, h.len as usize),
                    ];
                    // The source range was checked by `admit` and stays registered
                    // while the pin lives.
                    sock::send_all(fd, &mut v).map_err(|e| io_err(peer, "send failed", e))?;
                    drop(pin);
                    out.clear();
                }
                Err(e) => refuse(&mut out, &h, &e),
            },
            kind => return Err(protocol(peer, format!("a {kind:?} sent to the target"))),
        }
    }
}

/// Checks a request against the registrations and pins its region.
fn admit(shared: &Shared, h: &Header, peer: &str) -> Result<Pin> {
    let result = shared
        .regions
        .pin(RegionId(h.region), h.offset, h.len)
        .and_then(|pin| {
            let (ok, right) = match h.kind {
                Kind::Write => (pin.region().access.remote_write, "remotely writable"),
                _ => (pin.region().access.remote_read, "remotely readable"),
            };
            if ok {
                Ok(pin)
            } else {
                Err(Error::new(
                    ErrorKind::InvalidRequest,
                    format!("region {} is not {right}", h.region),
                ))
            }
        });
    if let Err(e) = &result {
        tracing::warn!(
            peer = %peer,
            op = ?h.kind,
            region = h.region,
            offset = h.offset,
            len = h.len,
            error = %e,
            "refused a request"
        );
    }
    result
}

fn refuse(out: &mut Vec<u8>, h: &Header, e: &Error) {
    let mut msg = e.message().as_bytes();
    msg = &msg[..msg.len().min(wire::MAX_MESSAGE as usize)];
    let msg: &[u8] = if msg.is_empty() { b"refused" } else { msg };
    out.extend_from_slice(
        &Header::response(Kind::Error, e.kind().code(), h.id, msg.len() as u64).encode(),
    );
    out.extend_from_slice(msg);
}
