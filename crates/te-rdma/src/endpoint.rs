//! The bytes a peer needs to reach this backend: the endpoint (in the segment
//! descriptor) and the per-region key bytes (rkeys).
//!
//! Both formats are little-endian, start with a version, and are decoded strictly:
//! wrong versions, short or trailing bytes, and out-of-range fields are `Protocol`
//! errors naming what was wrong. They are written by hand rather than with
//! `te_core::codec`; `docs/decisions.md` says why.
//!
//! **Endpoint** (`SegmentDesc::endpoint`):
//! `version u8 = 3 · instance u64 · devices u8 (1–32) · per device: link_layer u8
//! (1 = InfiniBand, 2 = Ethernet) · roce u8 (the GID types it offers: bit 0 RoCE v1,
//! bit 1 RoCE v2; 0 on InfiniBand) · name_len u8 · name`. The instance is the engine's
//! epoch; the peer's engine is reached at the descriptor's `address`.
//!
//! **Region key** (`RegionDesc::key`): `version u8 = 1 · n u8 · n × rkey u32`, one
//! rkey per device of the owner, in its endpoint's device order.

use te_core::Result;

use crate::reader::{protocol, Reader};

/// The endpoint format's version.
pub(crate) const ENDPOINT_VERSION: u8 = 3;
/// The region-key format's version.
pub(crate) const KEY_VERSION: u8 = 1;
/// The most devices an endpoint may name.
pub(crate) const MAX_DEVICES: usize = 32;
/// RoCE GID-type bits of [`DeviceInfo::roce`].
pub(crate) const ROCE_V1: u8 = 1;
pub(crate) const ROCE_V2: u8 = 2;

/// A device's link layer; the two ends of a path must agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LinkLayer {
    /// InfiniBand: addressed by LID.
    InfiniBand = 1,
    /// Ethernet (RoCE): addressed by GID.
    Ethernet = 2,
}

impl LinkLayer {
    pub(crate) fn from_u8(v: u8) -> Option<LinkLayer> {
        match v {
            1 => Some(LinkLayer::InfiniBand),
            2 => Some(LinkLayer::Ethernet),
            _ => None,
        }
    }
}

/// One device as a peer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeviceInfo {
    pub(crate) name: String,
    pub(crate) link_layer: LinkLayer,
    /// The RoCE GID types it offers ([`ROCE_V1`] | [`ROCE_V2`]); 0 on InfiniBand.
    pub(crate) roce: u8,
}

/// A backend's endpoint: its instance (the engine's epoch) and devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Endpoint {
    pub(crate) instance: u64,
    pub(crate) devices: Vec<DeviceInfo>,
}

/// Encodes an endpoint.
pub(crate) fn encode_endpoint(e: &Endpoint) -> Vec<u8> {
    let mut v = vec![ENDPOINT_VERSION];
    v.extend_from_slice(&e.instance.to_le_bytes());
    v.push(e.devices.len() as u8);
    for d in &e.devices {
        v.push(d.link_layer as u8);
        v.push(d.roce);
        let name = &d.name.as_bytes()[..d.name.len().min(255)];
        v.push(name.len() as u8);
        v.extend_from_slice(name);
    }
    v
}

/// Decodes [`encode_endpoint`]'s bytes.
///
/// # Errors
/// `Protocol` for anything else (another version, another backend's bytes).
pub(crate) fn decode_endpoint(b: &[u8]) -> Result<Endpoint> {
    let mut r = Reader::new(b, "endpoint");
    r.version(ENDPOINT_VERSION)?;
    let instance = r.u64("instance")?;
    let n = r.u8("device count")? as usize;
    if n == 0 || n > MAX_DEVICES {
        return Err(protocol(
            "endpoint",
            format!("{n} devices (1–{MAX_DEVICES})"),
        ));
    }
    let mut devices = Vec::with_capacity(n);
    for _ in 0..n {
        let ll = r.u8("link layer")?;
        let link_layer = LinkLayer::from_u8(ll)
            .ok_or_else(|| protocol("endpoint", format!("link layer {ll}")))?;
        let roce = r.u8("roce types")?;
        if roce & !(ROCE_V1 | ROCE_V2) != 0 || (link_layer == LinkLayer::InfiniBand && roce != 0) {
            return Err(protocol("endpoint", format!("roce types {roce:#x}")));
        }
        let len = r.u8("device name length")? as usize;
        let name = std::str::from_utf8(r.bytes(len, "device name")?)
            .map_err(|_| protocol("endpoint", "a device name is not UTF-8"))?;
        devices.push(DeviceInfo {
            name: name.to_string(),
            link_layer,
            roce,
        });
    }
    r.end()?;
    Ok(Endpoint { instance, devices })
}

/// Encodes a region's rkeys, one per device.
pub(crate) fn encode_key(rkeys: &[u32]) -> Vec<u8> {
    let mut v = Vec::with_capacity(2 + 4 * rkeys.len());
    v.push(KEY_VERSION);
    v.push(rkeys.len() as u8);
    for k in rkeys {
        v.extend_from_slice(&k.to_le_bytes());
    }
    v
}

/// Decodes [`encode_key`]'s bytes, expecting one rkey per device of the owner.
///
/// # Errors
/// `Protocol` for another version, a count that does not match `devices`, or bad length.
pub(crate) fn decode_key(b: &[u8], devices: usize) -> Result<Vec<u32>> {
    let mut r = Reader::new(b, "region key");
    r.version(KEY_VERSION)?;
    let n = r.u8("count")? as usize;
    if n != devices {
        return Err(protocol(
            "region key",
            format!("{n} rkeys for a peer with {devices} devices"),
        ));
    }
    let keys = (0..n).map(|_| r.u32("rkey")).collect::<Result<Vec<_>>>()?;
    r.end()?;
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use te_core::ErrorKind;

    fn endpoint() -> Endpoint {
        Endpoint {
            instance: 0x0102_0304_0506_0708,
            devices: vec![
                DeviceInfo {
                    name: "mlx5_0".into(),
                    link_layer: LinkLayer::Ethernet,
                    roce: ROCE_V1 | ROCE_V2,
                },
                DeviceInfo {
                    name: "mlx5_1".into(),
                    link_layer: LinkLayer::InfiniBand,
                    roce: 0,
                },
            ],
        }
    }

    #[test]
    fn an_endpoint_round_trips_and_its_layout_is_little_endian() {
        let e = endpoint();
        let b = encode_endpoint(&e);
        assert_eq!(b[0], 3, "version");
        assert_eq!(&b[1..9], &0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(b[9], 2);
        assert_eq!(
            &b[10..13],
            &[2, 3, 6],
            "link layer, roce types, name length"
        );
        assert_eq!(decode_endpoint(&b).unwrap(), e);
    }

    #[test]
    fn a_malformed_endpoint_is_a_protocol_error() {
        let good = encode_endpoint(&endpoint());
        let mut cases: Vec<Vec<u8>> = (0..good.len()).map(|n| good[..n].to_vec()).collect();
        let mut v = good.clone();
        v[0] = 1;
        cases.push(v);
        let mut v = good.clone();
        v[11] = 4; // the first device's RoCE types: an unknown bit
        cases.push(v);
        let mut v = good.clone();
        v.push(0);
        cases.push(v);
        let mut v = good.clone();
        v[9] = 0;
        cases.push(v);
        let mut v = good.clone();
        v[10] = 9;
        cases.push(v);
        for c in cases {
            let e = decode_endpoint(&c).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Protocol, "{c:?}");
        }
    }

    #[test]
    fn region_keys_carry_one_rkey_per_device() {
        let b = encode_key(&[0x11223344, 7]);
        assert_eq!(b, [1, 2, 0x44, 0x33, 0x22, 0x11, 7, 0, 0, 0]);
        assert_eq!(decode_key(&b, 2).unwrap(), [0x11223344, 7]);
        let e = decode_key(&b, 3).unwrap_err();
        assert!(e.to_string().contains("3 devices"), "{e}");
        assert!(decode_key(&b[..9], 2).is_err());
        assert!(decode_key(&[2, 0], 0).is_err());
        assert!(decode_key(&[], 0).is_err(), "a tcp or stub key is refused");
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode_endpoint(&b);
            let _ = decode_key(&b, 2);
        }
    }
}
