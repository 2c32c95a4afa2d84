//! Queue-pair attributes for the INIT → RTR → RTS transitions, built as plain structs
//! (no verbs call), so every parameter is tested without a NIC.
//!
//! | state | attributes set | values |
//! |-------|----------------|--------|
//! | INIT | `pkey_index`, `port_num`, `qp_access_flags` | 0, the configured port, LOCAL_WRITE \| REMOTE_READ \| REMOTE_WRITE |
//! | RTR | `path_mtu`, `dest_qp_num`, `rq_psn`, `max_dest_rd_atomic`, `min_rnr_timer`, `ah_attr` | min(configured, local active, peer) MTU; the peer's QPN and PSN; the device's `max_qp_rd_atom` (≤ 16); 12 (0.64 ms); IB: `dlid` = peer LID; RoCE: `is_global` with the peer's GID, our GID index of the negotiated type (v2 or v1), hop limit 64, the configured traffic class; `sl` = configured service level |
//! | RTS | `sq_psn`, `timeout`, `retry_cnt`, `rnr_retry`, `max_rd_atomic` | our PSN; configured (default 14 ≈ 67 ms, 7, 7); the device's `max_qp_init_rd_atom` capped by the READs the peer serves (its `max_dest_rd_atomic`, from the exchange) |
//! | ERR | `qp_state` | a QP that failed, or to a peer that left: flushes what it holds |

use crate::endpoint::LinkLayer;
use crate::exchange::{GidType, PathInfo};
use crate::verbs as sys;

/// The `ibv_mtu` code of an MTU in bytes.
pub(crate) fn mtu_enum(bytes: u32) -> Option<u8> {
    match bytes {
        256 => Some(1),
        512 => Some(2),
        1024 => Some(3),
        2048 => Some(4),
        4096 => Some(5),
        _ => None,
    }
}

/// The parameters of one side of a path that do not come from the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QpParams {
    pub(crate) port: u8,
    /// The `ibv_mtu` code cap: min of the configured and the port's active MTU.
    pub(crate) mtu: u8,
    pub(crate) timeout: u8,
    pub(crate) retry_count: u8,
    pub(crate) rnr_retry: u8,
    pub(crate) service_level: u8,
    pub(crate) traffic_class: u8,
    /// RDMA READs this QP may have outstanding as the initiator.
    pub(crate) max_rd_atomic: u8,
    /// RDMA READs this QP may serve at once as the target.
    pub(crate) max_dest_rd_atomic: u8,
}

/// Minimum RNR NAK timer code (12 = 0.64 ms); we post no receives, so it only matters
/// for a misbehaving peer.
pub(crate) const MIN_RNR_TIMER: u8 = 12;
/// RoCE hop limit.
pub(crate) const HOP_LIMIT: u8 = 64;

/// One transition: the attributes and the mask naming the ones set.
pub(crate) struct Transition {
    pub(crate) attr: sys::ibv_qp_attr,
    pub(crate) mask: std::ffi::c_int,
}

/// RESET → INIT.
pub(crate) fn init(p: &QpParams) -> Transition {
    let mut attr = sys::ibv_qp_attr {
        qp_state: sys::IBV_QPS_INIT,
        pkey_index: 0,
        port_num: p.port,
        ..Default::default()
    };
    attr.qp_access_flags = (sys::IBV_ACCESS_LOCAL_WRITE
        | sys::IBV_ACCESS_REMOTE_READ
        | sys::IBV_ACCESS_REMOTE_WRITE) as u32;
    Transition {
        attr,
        mask: sys::IBV_QP_STATE
            | sys::IBV_QP_PKEY_INDEX
            | sys::IBV_QP_PORT
            | sys::IBV_QP_ACCESS_FLAGS,
    }
}

/// INIT → RTR, towards the peer's half of the path; `sgid_index` is our GID of the
/// path's type (RoCE only).
pub(crate) fn rtr(p: &QpParams, peer: &PathInfo, sgid_index: u8) -> Transition {
    let mut attr = sys::ibv_qp_attr {
        qp_state: sys::IBV_QPS_RTR,
        path_mtu: u32::from(p.mtu.min(peer.mtu)),
        dest_qp_num: peer.qpn,
        rq_psn: peer.psn,
        max_dest_rd_atomic: p.max_dest_rd_atomic,
        min_rnr_timer: MIN_RNR_TIMER,
        ..Default::default()
    };
    attr.ah_attr.port_num = p.port;
    attr.ah_attr.sl = p.service_level;
    attr.ah_attr.src_path_bits = 0;
    match peer.link_layer {
        LinkLayer::InfiniBand => {
            attr.ah_attr.dlid = peer.lid;
            attr.ah_attr.is_global = 0;
        }
        LinkLayer::Ethernet => {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid.raw = peer.gid;
            attr.ah_attr.grh.sgid_index = sgid_index;
            attr.ah_attr.grh.hop_limit = HOP_LIMIT;
            attr.ah_attr.grh.traffic_class = p.traffic_class;
            attr.ah_attr.grh.flow_label = 0;
        }
    }
    Transition {
        attr,
        mask: sys::IBV_QP_STATE
            | sys::IBV_QP_AV
            | sys::IBV_QP_PATH_MTU
            | sys::IBV_QP_DEST_QPN
            | sys::IBV_QP_RQ_PSN
            | sys::IBV_QP_MAX_DEST_RD_ATOMIC
            | sys::IBV_QP_MIN_RNR_TIMER,
    }
}

/// RTR → RTS, sending from `psn`, with at most as many READs outstanding as the peer
/// serves (`peer_rd_atomic`, its `max_dest_rd_atomic`).
pub(crate) fn rts(p: &QpParams, psn: u32, peer_rd_atomic: u8) -> Transition {
    let attr = sys::ibv_qp_attr {
        qp_state: sys::IBV_QPS_RTS,
        sq_psn: psn,
        timeout: p.timeout,
        retry_cnt: p.retry_count,
        rnr_retry: p.rnr_retry,
        max_rd_atomic: p.max_rd_atomic.min(peer_rd_atomic).max(1),
        ..Default::default()
    };
    Transition {
        attr,
        mask: sys::IBV_QP_STATE
            | sys::IBV_QP_SQ_PSN
            | sys::IBV_QP_TIMEOUT
            | sys::IBV_QP_RETRY_CNT
            | sys::IBV_QP_RNR_RETRY
            | sys::IBV_QP_MAX_QP_RD_ATOMIC,
    }
}

/// Any state → ERR: every outstanding work request completes, flushed, at once.
pub(crate) fn error() -> Transition {
    Transition {
        attr: sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_ERR,
            ..Default::default()
        },
        mask: sys::IBV_QP_STATE,
    }
}

/// Picks the GID index of type `kind` from the port's table (index, GID, type): the
/// configured index if it has that type, else the first non-zero GID of that type,
/// IPv4-mapped ones first (routable; what most deployments use).
pub(crate) fn pick_gid(
    configured: Option<u8>,
    table: &[(u8, [u8; 16], Option<GidType>)],
    kind: GidType,
) -> Option<u8> {
    let nonzero = |g: &[u8; 16]| g.iter().any(|&b| b != 0);
    let v4mapped = |g: &[u8; 16]| g[..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff;
    let of_kind = table
        .iter()
        .filter(|(i, g, t)| *t == Some(kind) && nonzero(g) && configured.is_none_or(|c| c == *i));
    of_kind
        .clone()
        .find(|(_, g, _)| v4mapped(g))
        .or_else(|| of_kind.clone().next())
        .map(|(i, _, _)| *i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> QpParams {
        QpParams {
            port: 1,
            mtu: 5,
            timeout: 14,
            retry_count: 7,
            rnr_retry: 7,
            service_level: 2,
            traffic_class: 106,
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
        }
    }

    fn peer(link_layer: LinkLayer) -> PathInfo {
        PathInfo {
            local_device: 0,
            remote_device: 0,
            qpn: 0x1234,
            psn: 0xabcdef,
            lid: 7,
            gid: [9; 16],
            mtu: 3,
            link_layer,
            port: 1,
            gid_type: if link_layer == LinkLayer::Ethernet {
                GidType::RoceV2
            } else {
                GidType::InfiniBand
            },
            rd_atomic: 4,
        }
    }

    #[test]
    fn mtus_map_to_verbs_codes() {
        assert_eq!(mtu_enum(256), Some(1));
        assert_eq!(mtu_enum(4096), Some(5));
        assert_eq!(mtu_enum(1500), None);
        assert_eq!(u32::from(mtu_enum(1024).unwrap()), sys::IBV_MTU_1024);
    }

    #[test]
    fn init_sets_port_and_remote_access() {
        let t = init(&params());
        assert_eq!(t.attr.qp_state, sys::IBV_QPS_INIT);
        assert_eq!(t.attr.port_num, 1);
        assert_eq!(
            t.attr.qp_access_flags as i32,
            sys::IBV_ACCESS_LOCAL_WRITE
                | sys::IBV_ACCESS_REMOTE_READ
                | sys::IBV_ACCESS_REMOTE_WRITE
        );
        assert_eq!(
            t.mask,
            sys::IBV_QP_STATE
                | sys::IBV_QP_PKEY_INDEX
                | sys::IBV_QP_PORT
                | sys::IBV_QP_ACCESS_FLAGS
        );
    }

    #[test]
    fn rtr_on_roce_addresses_the_peer_by_gid_with_the_smaller_mtu() {
        let t = rtr(&params(), &peer(LinkLayer::Ethernet), 3);
        assert_eq!(t.attr.qp_state, sys::IBV_QPS_RTR);
        assert_eq!(t.attr.path_mtu, 3, "the peer's 1024 beats our 4096");
        assert_eq!(t.attr.dest_qp_num, 0x1234);
        assert_eq!(t.attr.rq_psn, 0xabcdef);
        assert_eq!(t.attr.min_rnr_timer, MIN_RNR_TIMER);
        assert_eq!(t.attr.max_dest_rd_atomic, 16);
        let ah = t.attr.ah_attr;
        assert_eq!((ah.is_global, ah.port_num, ah.sl), (1, 1, 2));
        // SAFETY: reading the raw bytes of a plain-data union that was written as raw.
        assert_eq!(unsafe { ah.grh.dgid.raw }, [9; 16]);
        assert_eq!(ah.grh.sgid_index, 3);
        assert_eq!(ah.grh.hop_limit, HOP_LIMIT);
        assert_eq!(ah.grh.traffic_class, 106);
        assert!(t.mask & sys::IBV_QP_AV != 0);
        assert!(t.mask & sys::IBV_QP_DEST_QPN != 0);
        assert!(t.mask & sys::IBV_QP_SQ_PSN == 0);
    }

    #[test]
    fn rtr_on_infiniband_addresses_the_peer_by_lid() {
        let t = rtr(&params(), &peer(LinkLayer::InfiniBand), 0);
        assert_eq!(t.attr.ah_attr.is_global, 0);
        assert_eq!(t.attr.ah_attr.dlid, 7);
    }

    #[test]
    fn rts_sets_our_psn_and_the_retry_policy() {
        let t = rts(&params(), 0x42, 16);
        assert_eq!(t.attr.qp_state, sys::IBV_QPS_RTS);
        assert_eq!(t.attr.sq_psn, 0x42);
        assert_eq!(
            (t.attr.timeout, t.attr.retry_cnt, t.attr.rnr_retry),
            (14, 7, 7)
        );
        assert_eq!(t.attr.max_rd_atomic, 16);
        assert!(t.mask & sys::IBV_QP_MAX_QP_RD_ATOMIC != 0);
        assert!(t.mask & sys::IBV_QP_AV == 0);
        assert_eq!(error().attr.qp_state, sys::IBV_QPS_ERR);
    }

    #[test]
    fn max_rd_atomic_is_capped_by_the_reads_the_peer_serves() {
        assert_eq!(rts(&params(), 1, 4).attr.max_rd_atomic, 4);
        assert_eq!(rts(&params(), 1, 200).attr.max_rd_atomic, 16);
    }

    #[test]
    fn the_gid_is_of_the_negotiated_type_ipv4_mapped_first() {
        let mut v4 = [0u8; 16];
        v4[10] = 0xff;
        v4[11] = 0xff;
        v4[12..].copy_from_slice(&[10, 0, 0, 1]);
        let ll = {
            let mut g = [0u8; 16];
            g[0] = 0xfe;
            g[1] = 0x80;
            g[15] = 1;
            g
        };
        let (v1, v2) = (Some(GidType::RoceV1), Some(GidType::RoceV2));
        let table = vec![
            (0, ll, v1),
            (1, ll, v2),
            (2, v4, v1),
            (3, v4, v2),
            (4, [0; 16], v2),
        ];
        assert_eq!(pick_gid(None, &table, GidType::RoceV2), Some(3));
        assert_eq!(pick_gid(None, &table, GidType::RoceV1), Some(2));
        assert_eq!(pick_gid(Some(1), &table, GidType::RoceV2), Some(1));
        assert_eq!(
            pick_gid(Some(1), &table, GidType::RoceV1),
            None,
            "index 1 is v2"
        );
        assert_eq!(pick_gid(None, &table[..2], GidType::RoceV2), Some(1));
        assert_eq!(
            pick_gid(None, &table[4..], GidType::RoceV2),
            None,
            "zero GIDs are unusable"
        );
    }
}
