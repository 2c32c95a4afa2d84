//! The fake through its own ABI, as a verbs consumer calls it.

use std::ffi::{c_int, c_void};
use std::ptr;
use std::time::{Duration, Instant};

use crate::control::fakeverbs_qp_state;
use crate::cq::*;
use crate::device::*;
use crate::events::*;
use crate::memory::*;
use crate::post::*;
use crate::qp::*;
use crate::verbs::*;

const E: c_int = libc::EINVAL;

struct Loop {
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    ch: *mut ibv_comp_channel,
    cq: *mut ibv_cq,
}

/// An open device with a PD, a channel and a CQ on it.
unsafe fn open() -> Loop {
    // SAFETY: the calls a verbs consumer makes, in order, on live objects.
    unsafe {
        let mut n = 0;
        let list = ibv_get_device_list(&mut n);
        assert!(n >= 1);
        let ctx = ibv_open_device(*list);
        ibv_free_device_list(list);
        let pd = ibv_alloc_pd(ctx);
        let ch = ibv_create_comp_channel(ctx);
        assert!(
            ibv_create_cq(ctx, 16, ptr::null_mut(), ch, 99).is_null(),
            "a completion vector the device lacks is refused"
        );
        let cq = ibv_create_cq(ctx, 16, ptr::null_mut(), ch, 1);
        assert!(!cq.is_null());
        Loop { ctx, pd, ch, cq }
    }
}

unsafe fn qp(l: &Loop) -> *mut ibv_qp {
    let mut init = ibv_qp_init_attr {
        send_cq: l.cq,
        recv_cq: l.cq,
        qp_type: IBV_QPT_RC,
        ..Default::default()
    };
    init.cap.max_send_wr = 8;
    init.cap.max_send_sge = 1;
    // SAFETY: a live PD and CQ.
    unsafe { ibv_create_qp(l.pd, &mut init) }
}

unsafe fn modify(qp: *mut ibv_qp, a: &mut ibv_qp_attr, mask: c_int) -> c_int {
    // SAFETY: a live QP.
    unsafe { ibv_modify_qp(qp, a, mask) }
}

/// Brings `qp` to RTS towards `peer` on the same device (RoCE v2 GID, index 1).
unsafe fn connect(l: &Loop, qp: *mut ibv_qp, peer: *mut ibv_qp) {
    // SAFETY: live QPs of `l`'s context.
    unsafe {
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_INIT,
            port_num: 1,
            qp_access_flags: (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) as u32,
            ..Default::default()
        };
        let init = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
        assert_eq!(modify(qp, &mut a, init), 0);
        let mut gid = ibv_gid::default();
        assert_eq!(ibv_query_gid(l.ctx, 1, 1, &mut gid), 0);
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_RTR,
            path_mtu: 6,
            dest_qp_num: (*peer).qp_num,
            max_dest_rd_atomic: 1,
            ..Default::default()
        };
        a.ah_attr.port_num = 1;
        a.ah_attr.is_global = 1;
        a.ah_attr.grh.dgid = gid;
        a.ah_attr.grh.sgid_index = 1;
        a.ah_attr.grh.hop_limit = 64;
        let rtr = IBV_QP_STATE
            | IBV_QP_AV
            | IBV_QP_PATH_MTU
            | IBV_QP_DEST_QPN
            | IBV_QP_RQ_PSN
            | IBV_QP_MAX_DEST_RD_ATOMIC
            | IBV_QP_MIN_RNR_TIMER;
        assert_eq!(modify(qp, &mut a, rtr), E, "an MTU above the port's");
        a.path_mtu = IBV_MTU_1024;
        assert_eq!(
            modify(qp, &mut a, rtr | IBV_QP_SQ_PSN),
            E,
            "an attribute RTR does not take"
        );
        assert_eq!(modify(qp, &mut a, rtr), 0);
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_RTS,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 1,
            ..Default::default()
        };
        let rts = IBV_QP_STATE
            | IBV_QP_SQ_PSN
            | IBV_QP_TIMEOUT
            | IBV_QP_RETRY_CNT
            | IBV_QP_RNR_RETRY
            | IBV_QP_MAX_QP_RD_ATOMIC;
        assert_eq!(modify(qp, &mut a, rts), 0);
    }
}

/// Waits (bounded) for a completion event, takes and acknowledges it, and polls
/// one completion.
unsafe fn next(l: &Loop) -> ibv_wc {
    // SAFETY: live CQ and channel.
    unsafe {
        let mut p = libc::pollfd {
            fd: (*l.ch).fd,
            events: libc::POLLIN,
            revents: 0,
        };
        assert_eq!(libc::poll(&mut p, 1, 5000), 1, "an event within 5 s");
        let (mut cq, mut ctx) = (ptr::null_mut(), ptr::null_mut());
        assert_eq!(ibv_get_cq_event(l.ch, &mut cq, &mut ctx), 0);
        assert_eq!(cq, l.cq);
        ibv_ack_cq_events(cq, 1);
        let mut wc = ibv_wc::default();
        assert_eq!(poll_cq(l.cq, 1, &mut wc), 1);
        assert_eq!(req_notify_cq(l.cq, 0), 0);
        wc
    }
}

#[test]
fn a_write_lands_a_bad_key_is_a_remote_access_error_and_later_requests_are_flushed() {
    // SAFETY: the test is a verbs consumer; every object is live where used.
    unsafe {
        let l = open();
        let (a, b) = (qp(&l), qp(&l));
        let mut st = ibv_qp_attr {
            qp_state: IBV_QPS_RTR,
            ..Default::default()
        };
        assert_eq!(
            modify(a, &mut st, IBV_QP_STATE),
            E,
            "RESET to RTR is no transition"
        );
        connect(&l, a, b);
        connect(&l, b, a);
        let src = vec![7u8; 4096];
        let mut dst = vec![0u8; 4096];
        let mr_src = ibv_reg_mr(l.pd, src.as_ptr() as *mut c_void, 4096, 0);
        let rw = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
        let mr_dst = ibv_reg_mr(l.pd, dst.as_mut_ptr().cast(), 4096, rw);
        assert!(!mr_src.is_null() && !mr_dst.is_null());
        assert!(ibv_reg_mr(l.pd, dst.as_mut_ptr().cast(), 4096, IBV_ACCESS_REMOTE_WRITE).is_null());
        assert_eq!(ibv_dealloc_pd(l.pd), libc::EBUSY, "the PD is in use");
        assert_eq!(req_notify_cq(l.cq, 0), 0);
        let mut sge = ibv_sge {
            addr: src.as_ptr() as u64,
            length: 4096,
            lkey: (*mr_src).lkey,
        };
        let mut wr = ibv_send_wr {
            wr_id: 1,
            sg_list: &mut sge,
            num_sge: 1,
            opcode: IBV_WR_RDMA_WRITE,
            send_flags: IBV_SEND_SIGNALED,
            ..Default::default()
        };
        wr.wr.rdma = ibv_rdma_info {
            remote_addr: dst.as_ptr() as u64,
            rkey: (*mr_dst).rkey,
        };
        let mut bad = ptr::null_mut();
        assert_eq!(post_send(a, &mut wr, &mut bad), 0);
        let wc = next(&l);
        assert_eq!((wc.wr_id, wc.status), (1, IBV_WC_SUCCESS));
        assert!(dst.iter().all(|&x| x == 7), "the bytes landed");

        dst.fill(0);
        wr.wr_id = 2;
        wr.wr.rdma.rkey ^= 0x100;
        let mut wr3 = wr;
        wr3.wr_id = 3;
        wr3.send_flags = 0;
        wr.next = &mut wr3;
        assert_eq!(post_send(a, &mut wr, &mut bad), 0);
        let wc = next(&l);
        assert_eq!((wc.wr_id, wc.status), (2, IBV_WC_REM_ACCESS_ERR));
        let mut wc = ibv_wc::default();
        let until = Instant::now() + Duration::from_secs(5);
        while poll_cq(l.cq, 1, &mut wc) == 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            (wc.wr_id, wc.status),
            (3, IBV_WC_WR_FLUSH_ERR),
            "an unsignalled request after the error is flushed, with a completion"
        );
        assert!(dst.iter().all(|&x| x == 0), "nothing landed");
        assert_eq!(fakeverbs_qp_state((*a).qp_num), IBV_QPS_ERR as c_int);
        assert_eq!(
            fakeverbs_qp_state((*b).qp_num),
            IBV_QPS_ERR as c_int,
            "the responder too"
        );
        let mut ev = ibv_async_event::default();
        assert_eq!(ibv_get_async_event(l.ctx, &mut ev), 0);
        assert_eq!((ev.event_type, ev.element.qp), (IBV_EVENT_QP_ACCESS_ERR, b));
        ibv_ack_async_event(&mut ev);

        assert_eq!(ibv_destroy_cq(l.cq), libc::EBUSY, "QPs still use the CQ");
        assert_eq!(ibv_destroy_qp(a), 0);
        assert_eq!(ibv_destroy_qp(b), 0);
        assert_eq!(ibv_dereg_mr(mr_src), 0);
        assert_eq!(ibv_dereg_mr(mr_dst), 0);
        assert_eq!(ibv_destroy_cq(l.cq), 0);
        assert_eq!(ibv_destroy_comp_channel(l.ch), 0);
        assert_eq!(ibv_dealloc_pd(l.pd), 0);
        assert_eq!(ibv_close_device(l.ctx), 0);
    }
}

#[test]
fn posting_before_rts_is_refused_and_names_the_request() {
    // SAFETY: as above.
    unsafe {
        let l = open();
        let q = qp(&l);
        let mut wr = ibv_send_wr {
            opcode: IBV_WR_RDMA_WRITE,
            ..Default::default()
        };
        let mut bad = ptr::null_mut();
        assert_eq!(post_send(q, &mut wr, &mut bad), E);
        assert_eq!(bad, &mut wr as *mut _);
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_INIT,
            port_num: 1,
            ..Default::default()
        };
        assert_eq!(
            modify(q, &mut a, IBV_QP_STATE | IBV_QP_PORT),
            E,
            "INIT needs pkey and access"
        );
        assert_eq!(ibv_destroy_qp(q), 0);
        assert_eq!(ibv_destroy_cq(l.cq), 0);
        assert_eq!(ibv_destroy_comp_channel(l.ch), 0);
        assert_eq!(ibv_dealloc_pd(l.pd), 0);
        assert_eq!(ibv_close_device(l.ctx), 0);
    }
}

#[test]
fn a_devices_qps_are_listed_by_number_until_destroyed() {
    use crate::control::fakeverbs_device_qps;
    // SAFETY: as above; `out` has room for the numbers asked for.
    unsafe {
        let l = open();
        let name = ibv_get_device_name((*l.ctx).device);
        let listed = |qpn: u32| {
            // Other tests make QPs on the same device meanwhile: ask for room enough.
            let mut out = vec![0u32; 4096];
            let n = fakeverbs_device_qps(name, out.as_mut_ptr(), out.len());
            assert!(n >= 0 && (n as usize) <= out.len());
            out.truncate(n as usize);
            assert!(out.windows(2).all(|w| w[0] < w[1]), "lowest first");
            out.contains(&qpn)
        };
        let q = qp(&l);
        let qpn = (*q).qp_num;
        assert!(listed(qpn));
        assert!(
            fakeverbs_device_qps(name, ptr::null_mut(), 0) >= 1,
            "counted"
        );
        assert_eq!(
            fakeverbs_device_qps(c"nosuch".as_ptr(), ptr::null_mut(), 0),
            -1
        );
        assert_eq!(ibv_destroy_qp(q), 0);
        assert!(!listed(qpn));
        assert_eq!(ibv_destroy_cq(l.cq), 0);
        assert_eq!(ibv_destroy_comp_channel(l.ch), 0);
        assert_eq!(ibv_dealloc_pd(l.pd), 0);
        assert_eq!(ibv_close_device(l.ctx), 0);
    }
}
