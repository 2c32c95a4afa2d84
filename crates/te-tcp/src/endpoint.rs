//! The bytes a peer needs to reach this backend's data listener: its address and the
//! backend's instance id, as they travel in the segment descriptor's endpoint.
//!
//! `version u8 · family u8 (4 or 6) · port u16 · IP (4 or 16 bytes) · instance u64`,
//! then for version 2 the host's boot id \[16\] (a backend with `local_ipc`, see
//! `samehost`); little-endian, decoded strictly: a wrong version or family, or short or
//! trailing bytes, are a `Protocol` error. Version 1 (no boot id) is still read.

use std::net::SocketAddr;

use te_core::kit::net;
use te_core::{Error, ErrorKind, Result};

/// A data endpoint, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Endpoint {
    pub(crate) addr: SocketAddr,
    pub(crate) instance: u64,
    /// The host's boot id, where the backend takes same-host peers (`local_ipc`).
    pub(crate) boot_id: Option<[u8; 16]>,
}

/// Encodes a data endpoint: version, the address ([`net::encode_addr`]), instance, and
/// the boot id where there is one; little-endian.
pub(crate) fn encode_endpoint(
    addr: SocketAddr,
    instance: u64,
    boot_id: Option<[u8; 16]>,
) -> Vec<u8> {
    let mut v = vec![if boot_id.is_some() { 2 } else { 1 }];
    net::encode_addr(addr, &mut v);
    v.extend_from_slice(&instance.to_le_bytes());
    if let Some(id) = boot_id {
        v.extend_from_slice(&id);
    }
    v
}

/// Decodes [`encode_endpoint`]'s bytes.
///
/// # Errors
/// `Protocol` for anything else.
pub(crate) fn decode_endpoint(b: &[u8]) -> Result<Endpoint> {
    let bad = || {
        Error::new(
            ErrorKind::Protocol,
            format!(
                "the peer's tcp endpoint ({} bytes) is not one this version understands",
                b.len()
            ),
        )
    };
    let (&version, rest) = b.split_first().ok_or_else(bad)?;
    let (addr, rest) = net::decode_addr(rest).ok_or_else(bad)?;
    let (instance, rest) = rest.split_first_chunk::<8>().ok_or_else(bad)?;
    let boot_id = match (version, rest.len()) {
        (1, 0) => None,
        (2, 16) => Some(<[u8; 16]>::try_from(rest).map_err(|_| bad())?),
        _ => return Err(bad()),
    };
    Ok(Endpoint {
        addr,
        instance: u64::from_le_bytes(*instance),
        boot_id,
    })
}
