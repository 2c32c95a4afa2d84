//! The bytes a peer needs to reach this backend's data listener: its address and the
//! backend's instance id, as they travel in the segment descriptor's endpoint.
//!
//! `version u8 = 1 · family u8 (4 or 6) · port u16 · IP (4 or 16 bytes) · instance
//! u64`, little-endian, decoded strictly: a wrong version or family, or short or
//! trailing bytes, are a `Protocol` error.

use std::net::{IpAddr, SocketAddr};

use te_core::{Error, ErrorKind, Result};

/// The endpoint format's version (its first byte).
const ENDPOINT_VERSION: u8 = 1;

/// Encodes a data endpoint: version, address family, port, IP, instance; little-endian.
pub(crate) fn encode_endpoint(addr: SocketAddr, instance: u64) -> Vec<u8> {
    let mut v = vec![ENDPOINT_VERSION];
    match addr.ip() {
        IpAddr::V4(ip) => {
            v.push(4);
            v.extend_from_slice(&addr.port().to_le_bytes());
            v.extend_from_slice(&ip.octets());
        }
        IpAddr::V6(ip) => {
            v.push(6);
            v.extend_from_slice(&addr.port().to_le_bytes());
            v.extend_from_slice(&ip.octets());
        }
    }
    v.extend_from_slice(&instance.to_le_bytes());
    v
}

/// Decodes [`encode_endpoint`]'s bytes.
///
/// # Errors
/// `Protocol` for anything else.
pub(crate) fn decode_endpoint(b: &[u8]) -> Result<(SocketAddr, u64)> {
    let bad = || {
        Error::new(
            ErrorKind::Protocol,
            format!(
                "the peer's tcp endpoint ({} bytes) is not one this version understands",
                b.len()
            ),
        )
    };
    let (&[version, family, p0, p1], rest) = b.split_first_chunk::<4>().ok_or_else(bad)?;
    if version != ENDPOINT_VERSION {
        return Err(bad());
    }
    let port = u16::from_le_bytes([p0, p1]);
    let (ip, rest): (IpAddr, &[u8]) = match family {
        4 => {
            let (ip, rest) = rest.split_first_chunk::<4>().ok_or_else(bad)?;
            ((*ip).into(), rest)
        }
        6 => {
            let (ip, rest) = rest.split_first_chunk::<16>().ok_or_else(bad)?;
            ((*ip).into(), rest)
        }
        _ => return Err(bad()),
    };
    let instance: [u8; 8] = rest.try_into().map_err(|_| bad())?;
    Ok((SocketAddr::new(ip, port), u64::from_le_bytes(instance)))
}
