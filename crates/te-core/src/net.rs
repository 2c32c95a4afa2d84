//! Network plumbing every listener of te shares: binding a listen address and choosing
//! the address peers are told, and the compact encoding of a socket address in
//! endpoint bytes.

use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};

use crate::error::{Error, ErrorKind, Result};

/// Binds `listen` and works out the address peers should use: `advertise` (a host or
/// IP, with the bound port) if given, else the bound address, which must then not be
/// the unspecified address.
///
/// # Errors
/// `Io` if the address cannot be bound; `ConfigInvalid` (naming `what`, the key's
/// table) if `advertise` does not resolve, or if the listener binds every interface
/// and nothing says which address peers should use.
pub fn bind(
    what: &str,
    listen: &str,
    advertise: Option<&str>,
) -> Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(listen).map_err(|e| {
        Error::new(ErrorKind::Io, format!("{what}: cannot listen on {listen}"))
            .with_source(e)
            .with_context("listen", listen)
    })?;
    let bound = listener.local_addr().map_err(|e| {
        Error::new(
            ErrorKind::Io,
            format!("{what}: the listener has no address"),
        )
        .with_source(e)
    })?;
    let advertised = advertised(what, bound, listen, advertise)?;
    Ok((listener, advertised))
}

/// The address peers are told, for a listener bound at `bound` (see [`bind`]).
///
/// # Errors
/// As [`bind`].
pub fn advertised(
    what: &str,
    bound: SocketAddr,
    listen: &str,
    advertise: Option<&str>,
) -> Result<SocketAddr> {
    match advertise {
        Some(host) => (host, bound.port())
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::ConfigInvalid,
                    format!("{what}: advertise = {host:?} does not resolve to an address"),
                )
            }),
        None if bound.ip().is_unspecified() => Err(Error::new(
            ErrorKind::ConfigInvalid,
            format!(
                "{what}: listen = {listen:?} binds every interface; set `advertise` to the address peers should use"
            ),
        )),
        None => Ok(bound),
    }
}

/// Appends `addr` as family (4 or 6), port, IP; little-endian.
pub fn encode_addr(addr: SocketAddr, out: &mut Vec<u8>) {
    match addr.ip() {
        IpAddr::V4(ip) => {
            out.push(4);
            out.extend_from_slice(&addr.port().to_le_bytes());
            out.extend_from_slice(&ip.octets());
        }
        IpAddr::V6(ip) => {
            out.push(6);
            out.extend_from_slice(&addr.port().to_le_bytes());
            out.extend_from_slice(&ip.octets());
        }
    }
}

/// Reads an address [`encode_addr`] wrote at the start of `b`; returns it and the rest.
pub fn decode_addr(b: &[u8]) -> Option<(SocketAddr, &[u8])> {
    let (&[family, p0, p1], rest) = b.split_first_chunk::<3>()?;
    let port = u16::from_le_bytes([p0, p1]);
    let (ip, rest): (IpAddr, &[u8]) = match family {
        4 => {
            let (ip, rest) = rest.split_first_chunk::<4>()?;
            ((*ip).into(), rest)
        }
        6 => {
            let (ip, rest) = rest.split_first_chunk::<16>()?;
            ((*ip).into(), rest)
        }
        _ => return None,
    };
    Some((SocketAddr::new(ip, port), rest))
}

/// Whether an accept error means the process (or the system) is out of a resource —
/// descriptors, memory, buffers — so the listener should back off, not spin or stop.
pub fn out_of_resources(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::ENOBUFS)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip() {
        for a in ["127.0.0.1:7000", "[::1]:9", "[fe80::1]:65535"] {
            let a: SocketAddr = a.parse().unwrap();
            let mut v = Vec::new();
            encode_addr(a, &mut v);
            v.push(42);
            assert_eq!(decode_addr(&v), Some((a, &[42u8][..])));
        }
        assert_eq!(decode_addr(&[5, 0, 0]), None);
        assert_eq!(decode_addr(&[4, 0]), None);
    }

    #[test]
    fn every_interface_needs_an_advertised_address() {
        let bound: SocketAddr = "0.0.0.0:5".parse().unwrap();
        let e = advertised("[engine]", bound, "0.0.0.0:0", None).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ConfigInvalid);
        assert!(e.to_string().contains("advertise"), "{e}");
        let a = advertised("[engine]", bound, "0.0.0.0:0", Some("127.0.0.1")).unwrap();
        assert_eq!(a, "127.0.0.1:5".parse().unwrap());
    }
}
