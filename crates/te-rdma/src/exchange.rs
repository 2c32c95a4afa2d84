//! The connect exchange: the messages that swap queue-pair numbers over the engine's
//! control-plane hook. (The endpoint and region-key bytes are in module `endpoint`.)
//!
//! The format is little-endian, starts with a magic and a version, and is decoded
//! strictly: wrong versions, short or trailing bytes, and out-of-range fields are
//! `Protocol` errors naming what was wrong.
//!
//! **Connect exchange** (a request and its answer, each one backend message on the
//! engines' authenticated control plane; at most [`MAX_MESSAGE`] bytes): a body is
//! `magic "TERC" · version u16 = 3 · kind u8` and then
//! - kind 1, request (initiator → target): `initiator instance u64 · target instance
//!   u64 · set u64 · n u16 · n × path`; `set` names this set of QPs (the initiator's
//!   choice, unique among its sets towards the target);
//! - kind 2, accept (target → initiator): `n u16 · n × path`, one per requested path,
//!   in the same order;
//! - kind 4, release (initiator → target): `initiator instance u64 · target instance
//!   u64 · set u64`; the answer is an empty body.
//!
//! A refusal is the hook's error answer (kind and message), not a message of its own.
//!
//! A path is `sender's device u8 · receiver's device u8 · qpn u32 · psn u32 · lid u16
//! · gid [16] · mtu u8 (IBV_MTU_256 = 1 … IBV_MTU_4096 = 5) · link_layer u8 · port u8 ·
//! gid_type u8 (0 InfiniBand, 1 RoCE v1, 2 RoCE v2; both ends use the same) ·
//! rd_atomic u8 (the RDMA READs the sender serves at once, 1–255: the receiver's
//! `max_rd_atomic` is capped by it)`. QP numbers and PSNs are 24-bit. The target keeps
//! its side of a set until the initiator releases it, its engine leaves or restarts, or
//! it asks for more sets than a peer may hold (module `connect` has the whole rule).

use te_core::Result;

use crate::endpoint::{LinkLayer, ROCE_V1, ROCE_V2};
use crate::reader::{protocol, Reader};

/// The connect exchange's version.
pub(crate) const EXCHANGE_VERSION: u16 = 3;
/// The connect exchange's magic.
pub(crate) const MAGIC: [u8; 4] = *b"TERC";
/// The largest connect-exchange frame body.
pub(crate) const MAX_MESSAGE: usize = 64 << 10;
/// The most paths any message may carry; a target allows far fewer per request
/// (`qps_per_path` × device pairs).
pub(crate) const MAX_PATHS: usize = 1024;
const PATH_LEN: usize = 1 + 1 + 4 + 4 + 2 + 16 + 1 + 1 + 1 + 1 + 1;

/// The GID type a path uses; both of its QPs use the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GidType {
    InfiniBand = 0,
    RoceV1 = 1,
    RoceV2 = 2,
}

impl GidType {
    fn from_u8(v: u8) -> Option<GidType> {
        match v {
            0 => Some(GidType::InfiniBand),
            1 => Some(GidType::RoceV1),
            2 => Some(GidType::RoceV2),
            _ => None,
        }
    }
}

/// The GID type two devices agree on: InfiniBand between InfiniBand ports; RoCE v2 when
/// both offer it (routable, what fabrics are configured for), else RoCE v1; `None` for
/// devices that cannot talk (another link layer, no common RoCE version).
pub(crate) fn negotiate(a: (LinkLayer, u8), b: (LinkLayer, u8)) -> Option<GidType> {
    match (a.0, b.0) {
        (LinkLayer::InfiniBand, LinkLayer::InfiniBand) => Some(GidType::InfiniBand),
        (LinkLayer::Ethernet, LinkLayer::Ethernet) => {
            let both = a.1 & b.1;
            if both & ROCE_V2 != 0 {
                Some(GidType::RoceV2)
            } else if both & ROCE_V1 != 0 {
                Some(GidType::RoceV1)
            } else {
                None
            }
        }
        _ => None,
    }
}

/// One QP's half of a path, as the sender describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PathInfo {
    /// The sender's device index (in its endpoint).
    pub(crate) local_device: u8,
    /// The receiver's device index (in its endpoint).
    pub(crate) remote_device: u8,
    pub(crate) qpn: u32,
    pub(crate) psn: u32,
    pub(crate) lid: u16,
    pub(crate) gid: [u8; 16],
    /// `ibv_mtu` value, 1–5.
    pub(crate) mtu: u8,
    pub(crate) link_layer: LinkLayer,
    pub(crate) port: u8,
    pub(crate) gid_type: GidType,
    /// The RDMA READs the sender serves at once as the responder.
    pub(crate) rd_atomic: u8,
}

/// A connect-exchange message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Message {
    Request {
        initiator: u64,
        target: u64,
        set: u64,
        paths: Vec<PathInfo>,
    },
    Accept {
        paths: Vec<PathInfo>,
    },
    Release {
        initiator: u64,
        target: u64,
        set: u64,
    },
}

fn put_path(v: &mut Vec<u8>, p: &PathInfo) {
    v.push(p.local_device);
    v.push(p.remote_device);
    v.extend_from_slice(&p.qpn.to_le_bytes());
    v.extend_from_slice(&p.psn.to_le_bytes());
    v.extend_from_slice(&p.lid.to_le_bytes());
    v.extend_from_slice(&p.gid);
    v.push(p.mtu);
    v.push(p.link_layer as u8);
    v.push(p.port);
    v.push(p.gid_type as u8);
    v.push(p.rd_atomic);
}

fn get_path(r: &mut Reader<'_>) -> Result<PathInfo> {
    let local_device = r.u8("device")?;
    let remote_device = r.u8("peer device")?;
    let qpn = r.u32("qpn")?;
    let psn = r.u32("psn")?;
    let lid = r.u16("lid")?;
    let gid = r.take::<16>("gid")?;
    let mtu = r.u8("mtu")?;
    let ll = r.u8("link layer")?;
    let port = r.u8("port")?;
    let gt = r.u8("gid type")?;
    let rd_atomic = r.u8("rd_atomic")?;
    if qpn >= 1 << 24 || psn >= 1 << 24 {
        return Err(protocol(
            "connect exchange",
            format!("qpn {qpn:#x} or psn {psn:#x} is wider than 24 bits"),
        ));
    }
    if !(1..=5).contains(&mtu) {
        return Err(protocol("connect exchange", format!("mtu code {mtu}")));
    }
    let link_layer = LinkLayer::from_u8(ll)
        .ok_or_else(|| protocol("connect exchange", format!("link layer {ll}")))?;
    if port == 0 {
        return Err(protocol("connect exchange", "port 0"));
    }
    let gid_type = GidType::from_u8(gt)
        .filter(|g| (*g == GidType::InfiniBand) == (link_layer == LinkLayer::InfiniBand))
        .ok_or_else(|| {
            protocol(
                "connect exchange",
                format!("gid type {gt} on {link_layer:?}"),
            )
        })?;
    if rd_atomic == 0 {
        return Err(protocol("connect exchange", "rd_atomic 0"));
    }
    Ok(PathInfo {
        local_device,
        remote_device,
        qpn,
        psn,
        lid,
        gid,
        mtu,
        link_layer,
        port,
        gid_type,
        rd_atomic,
    })
}

fn put_paths(v: &mut Vec<u8>, paths: &[PathInfo]) {
    v.extend_from_slice(&(paths.len() as u16).to_le_bytes());
    for p in paths {
        put_path(v, p);
    }
}

fn get_paths(r: &mut Reader<'_>) -> Result<Vec<PathInfo>> {
    let n = r.u16("path count")? as usize;
    if n == 0 || n > MAX_PATHS {
        return Err(protocol(
            "connect exchange",
            format!("{n} paths (1–{MAX_PATHS})"),
        ));
    }
    if r.b.len() < n * PATH_LEN {
        return Err(protocol("connect exchange", "truncated at paths"));
    }
    (0..n).map(|_| get_path(r)).collect()
}

/// Encodes a message body (without the frame's length).
pub(crate) fn encode(m: &Message) -> Vec<u8> {
    let mut v = MAGIC.to_vec();
    v.extend_from_slice(&EXCHANGE_VERSION.to_le_bytes());
    match m {
        Message::Request {
            initiator,
            target,
            set,
            paths,
        } => {
            v.push(1);
            v.extend_from_slice(&initiator.to_le_bytes());
            v.extend_from_slice(&target.to_le_bytes());
            v.extend_from_slice(&set.to_le_bytes());
            put_paths(&mut v, paths);
        }
        Message::Accept { paths } => {
            v.push(2);
            put_paths(&mut v, paths);
        }
        Message::Release {
            initiator,
            target,
            set,
        } => {
            v.push(4);
            v.extend_from_slice(&initiator.to_le_bytes());
            v.extend_from_slice(&target.to_le_bytes());
            v.extend_from_slice(&set.to_le_bytes());
        }
    }
    v
}

/// Decodes a message body.
///
/// # Errors
/// `Protocol`: a body over [`MAX_MESSAGE`], wrong magic or version, unknown kind,
/// out-of-range fields, bad lengths.
pub(crate) fn decode(b: &[u8]) -> Result<Message> {
    if b.len() > MAX_MESSAGE {
        return Err(protocol(
            "connect exchange",
            format!(
                "a {}-byte message exceeds the {MAX_MESSAGE}-byte limit",
                b.len()
            ),
        ));
    }
    let mut r = Reader::new(b, "connect exchange");
    if r.take::<4>("magic")? != MAGIC {
        return Err(protocol(
            "connect exchange",
            "bad magic: the message is not from a te rdma backend",
        ));
    }
    let version = r.u16("version")?;
    if version != EXCHANGE_VERSION {
        return Err(protocol(
            "connect exchange",
            format!("version {version}, this build speaks {EXCHANGE_VERSION}"),
        ));
    }
    let m = match r.u8("kind")? {
        1 => Message::Request {
            initiator: r.u64("initiator instance")?,
            target: r.u64("target instance")?,
            set: r.u64("set")?,
            paths: get_paths(&mut r)?,
        },
        2 => Message::Accept {
            paths: get_paths(&mut r)?,
        },
        4 => Message::Release {
            initiator: r.u64("initiator instance")?,
            target: r.u64("target instance")?,
            set: r.u64("set")?,
        },
        k => return Err(protocol("connect exchange", format!("message kind {k}"))),
    };
    r.end()?;
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use te_core::ErrorKind;

    fn path(i: u8) -> PathInfo {
        PathInfo {
            local_device: i,
            remote_device: i + 1,
            qpn: 0x00ab_cdef,
            psn: 0x0012_3456,
            lid: 0x1234,
            gid: [i; 16],
            mtu: 5,
            link_layer: LinkLayer::Ethernet,
            port: 1,
            gid_type: GidType::RoceV2,
            rd_atomic: 16,
        }
    }

    #[test]
    fn messages_round_trip() {
        for m in [
            Message::Request {
                initiator: 1,
                target: u64::MAX,
                set: 7,
                paths: vec![path(0), path(3)],
            },
            Message::Accept {
                paths: vec![path(2)],
            },
            Message::Release {
                initiator: 1,
                target: 2,
                set: 7,
            },
        ] {
            let b = encode(&m);
            assert_eq!(&b[..4], b"TERC");
            assert_eq!(&b[4..6], &3u16.to_le_bytes());
            assert_eq!(decode(&b).unwrap(), m);
        }
    }

    #[test]
    fn a_path_is_encoded_field_by_field_little_endian() {
        let b = encode(&Message::Accept {
            paths: vec![path(1)],
        });
        let p = &b[4 + 2 + 1 + 2..];
        assert_eq!(p.len(), PATH_LEN);
        assert_eq!(&p[..2], &[1, 2]);
        assert_eq!(&p[2..6], &[0xef, 0xcd, 0xab, 0]);
        assert_eq!(&p[6..10], &[0x56, 0x34, 0x12, 0]);
        assert_eq!(&p[10..12], &[0x34, 0x12]);
        assert_eq!(&p[12..28], &[1; 16]);
        assert_eq!(&p[28..], &[5, 2, 1, 2, 16]);
    }

    #[test]
    fn devices_agree_on_roce_v2_else_v1_and_never_across_link_layers() {
        let eth = |roce| (LinkLayer::Ethernet, roce);
        let ib = (LinkLayer::InfiniBand, 0);
        assert_eq!(negotiate(eth(3), eth(3)), Some(GidType::RoceV2));
        assert_eq!(negotiate(eth(3), eth(ROCE_V1)), Some(GidType::RoceV1));
        assert_eq!(negotiate(eth(ROCE_V2), eth(ROCE_V1)), None);
        assert_eq!(negotiate(ib, ib), Some(GidType::InfiniBand));
        assert_eq!(negotiate(ib, eth(3)), None);
    }

    #[test]
    fn invalid_messages_are_refused_with_what_was_wrong() {
        let good = encode(&Message::Accept {
            paths: vec![path(0)],
        });
        let field = 4 + 2 + 1 + 2; // the path's start
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (b"XXXX".to_vec(), "magic"),
            ([&good[..4], &[1, 0], &good[6..]].concat(), "version"),
            ([&good[..6], &[9]].concat(), "kind"),
            (good[..good.len() - 1].to_vec(), "truncated"),
            ([&good[..], &[0]].concat(), "trailing"),
            ([&good[..7], &[0, 0]].concat(), "0 paths"),
            (
                {
                    let mut v = good.clone();
                    v[field + 5] = 1; // qpn's fourth byte
                    v
                },
                "24 bits",
            ),
            (
                {
                    let mut v = good.clone();
                    v[field + 28] = 6;
                    v
                },
                "mtu",
            ),
            (
                {
                    let mut v = good.clone();
                    v[field + 29] = 3;
                    v
                },
                "link layer",
            ),
            (
                {
                    let mut v = good.clone();
                    v[field + 30] = 0;
                    v
                },
                "port 0",
            ),
            (
                {
                    let mut v = good.clone();
                    v[field + 31] = 0; // InfiniBand's GID type on an Ethernet path
                    v
                },
                "gid type",
            ),
            (
                {
                    let mut v = good.clone();
                    v[field + 32] = 0;
                    v
                },
                "rd_atomic 0",
            ),
        ];
        for (bytes, what) in cases {
            let e = decode(&bytes).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Protocol, "{what}");
            assert!(e.to_string().contains(what), "{what}: {e}");
        }
        let mut huge = good.clone();
        huge.resize(MAX_MESSAGE + 1, 0);
        let e = decode(&huge).unwrap_err();
        assert!(e.to_string().contains("limit"), "{e}");
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode(&b);
        }
    }
}
