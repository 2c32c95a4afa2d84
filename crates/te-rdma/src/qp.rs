//! Queue-pair attributes for the INIT → RTR → RTS transitions, built as plain structs
//! (no verbs call), so every parameter is tested without a NIC.
//!
//! | state | attributes set | values |
//! |-------|----------------|--------|
//! | INIT | `pkey_index`, `port_num`, `qp_access_flags` | 0, the configured port, LOCAL_WRITE \| REMOTE_READ \| REMOTE_WRITE |
//! | RTR | `path_mtu`, `dest_qp_num`, `rq_psn`, `max_dest_rd_atomic`, `min_rnr_timer`, `ah_attr` | min(configured, local active, peer) MTU; the peer's QPN and PSN; the device's `max_qp_rd_atom` (≤ 16); 12 (0.64 ms); IB: `dlid` = peer LID; RoCE: `is_global` with the peer's GID, our GID index, hop limit 64, the configured traffic class; `sl` = configured service level |
//! | ERR | `qp_state` | a QP marked for reset, or to a peer that died: flushes what it holds |
//! | RTS | `sq_psn`, `timeout`, `retry_cnt`, `rnr_retry`, `max_rd_atomic` | our PSN; configured (default 14 ≈ 67 ms, 7, 7); the device's `max_qp_init_rd_atom` (≤ 16) |

use ibverbs_sys as ffi;

use crate::exchange::{LinkLayer, PathInfo};

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
    /// The local GID index (RoCE only).
    pub(crate) gid_index: u8,
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
    pub(crate) attr: ffi::ibv_qp_attr,
    pub(crate) mask: ffi::ibv_qp_attr_mask,
}

/// RESET → INIT.
pub(crate) fn init(p: &QpParams) -> Transition {
    let mut attr = ffi::ibv_qp_attr {
        qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
        pkey_index: 0,
        port_num: p.port,
        ..Default::default()
    };
    attr.qp_access_flags = (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
        | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ
        | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
        .0;
    Transition {
        attr,
        mask: ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ffi::ibv_qp_attr_mask::IBV_QP_PORT
            | ffi::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS,
    }
}

/// INIT → RTR, towards the peer's half of the path.
pub(crate) fn rtr(p: &QpParams, peer: &PathInfo) -> Transition {
    let mut attr = ffi::ibv_qp_attr {
        qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
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
            attr.ah_attr.grh.sgid_index = p.gid_index;
            attr.ah_attr.grh.hop_limit = HOP_LIMIT;
            attr.ah_attr.grh.traffic_class = p.traffic_class;
            attr.ah_attr.grh.flow_label = 0;
        }
    }
    Transition {
        attr,
        mask: ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_AV
            | ffi::ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ffi::ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ffi::ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ffi::ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ffi::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER,
    }
}

/// RTR → RTS, sending from `psn`.
pub(crate) fn rts(p: &QpParams, psn: u32) -> Transition {
    let attr = ffi::ibv_qp_attr {
        qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
        sq_psn: psn,
        timeout: p.timeout,
        retry_cnt: p.retry_count,
        rnr_retry: p.rnr_retry,
        max_rd_atomic: p.max_rd_atomic,
        ..Default::default()
    };
    Transition {
        attr,
        mask: ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_SQ_PSN
            | ffi::ibv_qp_attr_mask::IBV_QP_TIMEOUT
            | ffi::ibv_qp_attr_mask::IBV_QP_RETRY_CNT
            | ffi::ibv_qp_attr_mask::IBV_QP_RNR_RETRY
            | ffi::ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC,
    }
}

/// Any state → ERR: every outstanding work request completes, flushed, at once.
pub(crate) fn error() -> Transition {
    Transition {
        attr: ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_ERR,
            ..Default::default()
        },
        mask: ffi::ibv_qp_attr_mask::IBV_QP_STATE,
    }
}

/// Picks the GID index for RoCE from the port's table: the configured index, else the
/// first non-zero RoCE v2 GID preferring IPv4-mapped ones (routable, what most
/// deployments use), else the first non-zero GID. Entries are (index, gid, type as the
/// kernel names it in `gid_attrs/types`: `RoCE v2`, `IB/RoCE v1`).
pub(crate) fn pick_gid(
    configured: Option<u8>,
    table: &[(u8, [u8; 16], Option<String>)],
) -> Option<u8> {
    if configured.is_some() {
        return configured;
    }
    let nonzero = |g: &[u8; 16]| g.iter().any(|&b| b != 0);
    let v4mapped = |g: &[u8; 16]| g[..10].iter().all(|&b| b == 0) && g[10] == 0xff && g[11] == 0xff;
    let v2 = |t: &Option<String>| t.as_deref().is_some_and(|t| t.contains("v2"));
    table
        .iter()
        .find(|(_, g, t)| nonzero(g) && v2(t) && v4mapped(g))
        .or_else(|| table.iter().find(|(_, g, t)| nonzero(g) && v2(t)))
        .or_else(|| table.iter().find(|(_, g, _)| nonzero(g)))
        .map(|(i, _, _)| *i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> QpParams {
        QpParams {
            port: 1,
            gid_index: 3,
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
        }
    }

    #[test]
    fn mtus_map_to_verbs_codes() {
        assert_eq!(mtu_enum(256), Some(1));
        assert_eq!(mtu_enum(4096), Some(5));
        assert_eq!(mtu_enum(1500), None);
        assert_eq!(u32::from(mtu_enum(1024).unwrap()), ffi::IBV_MTU_1024);
    }

    #[test]
    fn init_sets_port_and_remote_access() {
        let t = init(&params());
        assert_eq!(t.attr.qp_state, ffi::ibv_qp_state::IBV_QPS_INIT);
        assert_eq!(t.attr.port_num, 1);
        let access = ffi::ibv_access_flags(t.attr.qp_access_flags);
        assert_eq!(
            access,
            ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
        );
        assert_eq!(
            t.mask,
            ffi::ibv_qp_attr_mask::IBV_QP_STATE
                | ffi::ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                | ffi::ibv_qp_attr_mask::IBV_QP_PORT
                | ffi::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS
        );
    }

    #[test]
    fn rtr_on_roce_addresses_the_peer_by_gid_with_the_smaller_mtu() {
        let t = rtr(&params(), &peer(LinkLayer::Ethernet));
        assert_eq!(t.attr.qp_state, ffi::ibv_qp_state::IBV_QPS_RTR);
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
        assert!(t.mask.0 & ffi::ibv_qp_attr_mask::IBV_QP_AV.0 != 0);
        assert!(t.mask.0 & ffi::ibv_qp_attr_mask::IBV_QP_DEST_QPN.0 != 0);
        assert!(t.mask.0 & ffi::ibv_qp_attr_mask::IBV_QP_SQ_PSN.0 == 0);
    }

    #[test]
    fn rtr_on_infiniband_addresses_the_peer_by_lid() {
        let t = rtr(&params(), &peer(LinkLayer::InfiniBand));
        assert_eq!(t.attr.ah_attr.is_global, 0);
        assert_eq!(t.attr.ah_attr.dlid, 7);
    }

    #[test]
    fn rts_sets_our_psn_and_the_retry_policy() {
        let t = rts(&params(), 0x42);
        assert_eq!(t.attr.qp_state, ffi::ibv_qp_state::IBV_QPS_RTS);
        assert_eq!(t.attr.sq_psn, 0x42);
        assert_eq!(
            (t.attr.timeout, t.attr.retry_cnt, t.attr.rnr_retry),
            (14, 7, 7)
        );
        assert_eq!(t.attr.max_rd_atomic, 16);
        assert!(t.mask.0 & ffi::ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC.0 != 0);
        assert!(t.mask.0 & ffi::ibv_qp_attr_mask::IBV_QP_AV.0 == 0);
        assert_eq!(error().attr.qp_state, ffi::ibv_qp_state::IBV_QPS_ERR);
    }

    #[test]
    fn the_gid_is_the_configured_one_else_roce_v2_ipv4_mapped() {
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
        let v1 = Some("IB/RoCE v1".to_string());
        let v2 = Some("RoCE v2".to_string());
        let table = vec![
            (0, ll, v1.clone()),
            (1, ll, v2.clone()),
            (2, v4, v1),
            (3, v4, v2),
            (4, [0; 16], None),
        ];
        assert_eq!(pick_gid(None, &table), Some(3));
        assert_eq!(pick_gid(Some(1), &table), Some(1));
        assert_eq!(pick_gid(None, &table[..3]), Some(1));
        assert_eq!(pick_gid(None, &[(5, ll, None)]), Some(5));
        assert_eq!(pick_gid(None, &[(0, [0; 16], None)]), None);
    }
}
