//! Network plumbing every listener of te shares: binding a listen address and choosing
//! the address peers are told, the compact encoding of a socket address in endpoint
//! bytes, and the slots of connections still in their handshake.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::Arc;

use tokio::sync::Notify;

use crate::sync::Mutex;

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

/// A listener's connections that have not finished their handshake, oldest first.
///
/// Each accepted connection takes a slot ([`PendingSlots::admit`]); when the slots are
/// full, the oldest connection is told to close ([`PendingSlot::evicted`]) to make
/// room, so idle sockets cannot keep a genuine peer out: to delay one, an attacker
/// must open `max` connections within that peer's own handshake.
#[derive(Debug, Default)]
pub struct PendingSlots {
    book: Mutex<Book>,
}

#[derive(Debug, Default)]
struct Book {
    queue: VecDeque<(u64, IpAddr, Arc<Notify>)>,
    next: u64,
}

impl Book {
    fn evict(&mut self, i: usize) -> bool {
        match self.queue.remove(i) {
            Some((_, ip, evicted)) => {
                tracing::debug!(%ip, "evicting a connection that has not finished its handshake");
                evicted.notify_one();
                true
            }
            None => false,
        }
    }
}

/// The source a connection from `ip` counts against, for per-source limits: an IPv4
/// address (an IPv4-mapped IPv6 one too) is its own source, and an IPv6 address
/// counts as its /64 — the smallest prefix a host is usually given, which holds 2^64
/// addresses a peer could otherwise each make a fresh source of.
pub fn source_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        },
    }
}

impl PendingSlots {
    /// A slot for a new connection from `ip`, made by evicting the oldest connection of
    /// that source once it holds `per_source` slots, else the oldest of all once `max`
    /// are taken (both at least 1).
    ///
    /// A source is [`source_of`] `ip`: one IPv6 /64 is one source.
    pub fn admit(self: &Arc<Self>, ip: IpAddr, per_source: usize, max: usize) -> PendingSlot {
        let ip = source_of(ip);
        let mut b = self.book.lock();
        let from_source = b.queue.iter().filter(|p| p.1 == ip).count();
        if from_source >= per_source.max(1) {
            if let Some(i) = b.queue.iter().position(|p| p.1 == ip) {
                b.evict(i);
            }
        } else if b.queue.len() >= max.max(1) {
            b.evict(0);
        }
        b.next += 1;
        let id = b.next;
        let evicted = Arc::new(Notify::new());
        b.queue.push_back((id, ip, evicted.clone()));
        PendingSlot {
            slots: self.clone(),
            id,
            evicted,
        }
    }

    /// Evicts the oldest connection, if any (when the process runs out of
    /// descriptors); returns whether there was one.
    pub fn evict_oldest(&self) -> bool {
        self.book.lock().evict(0)
    }

    /// How many slots are taken.
    pub fn len(&self) -> usize {
        self.book.lock().queue.len()
    }

    /// Whether no slot is taken.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One connection's place among the pending ones, given up when dropped (its handshake
/// ended, either way).
#[derive(Debug)]
pub struct PendingSlot {
    slots: Arc<PendingSlots>,
    id: u64,
    evicted: Arc<Notify>,
}

impl PendingSlot {
    /// Resolves once a newer connection has taken this slot: the connection should
    /// close.
    pub async fn evicted(&self) {
        self.evicted.notified().await
    }
}

impl Drop for PendingSlot {
    fn drop(&mut self) {
        self.slots.book.lock().queue.retain(|p| p.0 != self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv6_64_is_one_source_and_an_ipv4_address_its_own() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(source_of(ip("10.0.0.7")), ip("10.0.0.7"));
        assert_eq!(source_of(ip("::ffff:10.0.0.7")), ip("10.0.0.7"));
        assert_eq!(source_of(ip("2001:db8:1:2:aaaa::1")), ip("2001:db8:1:2::"));
        assert_eq!(
            source_of(ip("2001:db8:1:2:ffff:ffff:ffff:ffff")),
            source_of(ip("2001:db8:1:2::9"))
        );
        assert_ne!(
            source_of(ip("2001:db8:1:3::1")),
            source_of(ip("2001:db8:1:2::1"))
        );
        // One /64 fills its source's pending slots, whatever the addresses it uses.
        let slots = Arc::new(PendingSlots::default());
        let first = slots.admit(ip("2001:db8::1"), 1, 8);
        let _second = slots.admit(ip("2001:db8::2"), 1, 8);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let evicted = rt.block_on(async {
            tokio::time::timeout(std::time::Duration::from_millis(50), first.evicted())
                .await
                .is_ok()
        });
        assert!(evicted, "a second address of one /64 got a slot of its own");
    }

    #[test]
    fn the_oldest_pending_connection_makes_room_for_a_new_one() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let slots = Arc::new(PendingSlots::default());
        let (a, b): (IpAddr, IpAddr) = ("127.0.0.1".parse().unwrap(), "127.0.0.2".parse().unwrap());
        let first = slots.admit(a, 2, 3);
        let second = slots.admit(b, 2, 3);
        let third = slots.admit(a, 2, 3);
        // Source `a` is at its cap: its oldest goes, `b`'s stays.
        let fourth = slots.admit(a, 2, 3);
        let soon = |s: &PendingSlot| {
            rt.block_on(async {
                tokio::time::timeout(std::time::Duration::from_millis(50), s.evicted())
                    .await
                    .is_ok()
            })
        };
        assert!(soon(&first));
        assert!(!soon(&second) && !soon(&third));
        drop(first);
        assert_eq!(slots.len(), 3);
        // All slots taken: the oldest of all goes.
        let fifth = slots.admit(b, 2, 3);
        assert!(soon(&second));
        drop((second, third));
        assert_eq!(slots.len(), 2);
        assert!(slots.evict_oldest());
        assert!(soon(&fourth));
        drop((fourth, fifth));
        assert!(slots.is_empty() && !slots.evict_oldest());
    }

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
