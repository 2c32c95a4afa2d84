//! Queue pairs: creating and destroying them and their RESET → INIT → RTR → RTS state
//! machine.

use std::ffi::c_int;
use std::ptr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::cq::CqBox;
use crate::memory::PdBox;
use crate::nic::{self, lock, Qp};
use crate::verbs::*;
use crate::{fail, handle};

/// A queue pair as handed out: the `ibv_qp` first.
#[repr(C)]
pub(crate) struct QpBox {
    pub(crate) ibv: ibv_qp,
    pub(crate) qp: Arc<Qp>,
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_create_qp(
    pd: *mut ibv_pd,
    init: *mut ibv_qp_init_attr,
) -> *mut ibv_qp {
    // SAFETY: `pd` came from ibv_alloc_pd; `init` is the caller's attribute.
    let (p, a) = unsafe { (&*(pd as *const PdBox), &mut *init) };
    if a.qp_type != IBV_QPT_RC {
        return fail(libc::EOPNOTSUPP);
    }
    let cap = a.cap;
    if a.send_cq.is_null()
        || a.recv_cq.is_null()
        || !a.srq.is_null()
        || !(1..=16384).contains(&cap.max_send_wr)
        || !(1..=30).contains(&cap.max_send_sge)
        || cap.max_recv_wr > 16384
        || cap.max_recv_sge > 30
        || cap.max_inline_data > 256
    {
        return fail(libc::EINVAL);
    }
    // SAFETY: CQs from ibv_create_cq.
    let (scq, rcq) = unsafe { (&*(a.send_cq as *const CqBox), &*(a.recv_cq as *const CqBox)) };
    if scq.ibv.context != p.ibv.context || rcq.ibv.context != p.ibv.context {
        return fail(libc::EINVAL);
    }
    let Some(qp) = Qp::create(
        p.dev.clone(),
        p.ibv.handle,
        scq.cq.clone(),
        cap,
        a.sq_sig_all != 0,
        p.events.clone(),
    ) else {
        return fail(libc::ENOMEM);
    };
    scq.cq.qps.fetch_add(1, Ordering::AcqRel);
    rcq.cq.qps.fetch_add(1, Ordering::AcqRel);
    p.refs.fetch_add(1, Ordering::AcqRel);
    let b = Box::into_raw(Box::new(QpBox {
        ibv: ibv_qp {
            context: p.ibv.context,
            qp_context: a.qp_context,
            pd,
            send_cq: a.send_cq,
            recv_cq: a.recv_cq,
            srq: ptr::null_mut(),
            handle: handle(),
            qp_num: qp.qpn,
            state: IBV_QPS_RESET,
            qp_type: IBV_QPT_RC,
            // SAFETY: all-zero pthread objects are their static initialisers on Linux.
            mutex: unsafe { std::mem::zeroed() },
            // SAFETY: as above.
            cond: unsafe { std::mem::zeroed() },
            events_completed: 0,
        },
        qp: qp.clone(),
    }));
    qp.ibv.store(b as usize, Ordering::Relaxed);
    b.cast()
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
    // SAFETY: `qp` came from ibv_create_qp and is destroyed once.
    let b = unsafe { Box::from_raw(qp as *mut QpBox) };
    b.qp.destroy();
    for cq in [b.ibv.send_cq, b.ibv.recv_cq] {
        // SAFETY: a QP's CQs outlive it (ibv_destroy_cq refuses while it is counted).
        unsafe { &*(cq as *const CqBox) }
            .cq
            .qps
            .fetch_sub(1, Ordering::AcqRel);
    }
    // SAFETY: as above, for its PD.
    unsafe { &*(b.ibv.pd as *const PdBox) }
        .refs
        .fetch_sub(1, Ordering::AcqRel);
    0
}

const ALT_PATH: c_int = 1 << 14;
const PATH_MIG_STATE: c_int = 1 << 18;
const CUR_STATE: c_int = 1 << 1;

/// The attribute masks a transition requires and allows (besides `IBV_QP_STATE`).
fn masks(from: u32, to: u32) -> Option<(c_int, c_int)> {
    let init = IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
    let rts_optional =
        IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER | ALT_PATH | PATH_MIG_STATE | CUR_STATE;
    Some(match (from, to) {
        (_, IBV_QPS_RESET) | (_, IBV_QPS_ERR) => (0, 0),
        (IBV_QPS_RESET, IBV_QPS_INIT) => (init, 0),
        (IBV_QPS_INIT, IBV_QPS_INIT) => (0, init),
        (IBV_QPS_INIT, IBV_QPS_RTR) => (
            IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER,
            IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX | ALT_PATH,
        ),
        (IBV_QPS_RTR, IBV_QPS_RTS) => (
            IBV_QP_SQ_PSN
                | IBV_QP_TIMEOUT
                | IBV_QP_RETRY_CNT
                | IBV_QP_RNR_RETRY
                | IBV_QP_MAX_QP_RD_ATOMIC,
            rts_optional,
        ),
        (IBV_QPS_RTS, IBV_QPS_RTS) => (0, rts_optional),
        _ => return None,
    })
}

/// Applies a transition to `qp`'s state; an errno if it is refused.
fn modify(q: &Qp, a: &ibv_qp_attr, mask: c_int) -> Result<u32, c_int> {
    let dev = &q.dev;
    let mut st = lock(&q.st);
    if mask & IBV_QP_STATE == 0 {
        return Err(libc::EINVAL);
    }
    let to = a.qp_state;
    let (required, optional) = masks(st.state, to).ok_or(libc::EINVAL)?;
    let given = mask & !IBV_QP_STATE;
    if given & required != required || given & !(required | optional) != 0 {
        return Err(libc::EINVAL);
    }
    let mut attrs = st.attrs;
    if mask & IBV_QP_PORT != 0 && a.port_num != 1 {
        return Err(libc::EINVAL);
    }
    if mask & IBV_QP_PKEY_INDEX != 0 && a.pkey_index != 0 {
        return Err(libc::EINVAL);
    }
    if mask & IBV_QP_ACCESS_FLAGS != 0 {
        let known = IBV_ACCESS_LOCAL_WRITE
            | IBV_ACCESS_REMOTE_WRITE
            | IBV_ACCESS_REMOTE_READ
            | IBV_ACCESS_REMOTE_ATOMIC;
        if a.qp_access_flags & !(known as u32) != 0 {
            return Err(libc::EINVAL);
        }
        attrs.access = a.qp_access_flags;
    }
    if mask & IBV_QP_PATH_MTU != 0 {
        if !(1..=dev.spec.mtu).contains(&a.path_mtu) {
            return Err(libc::EINVAL);
        }
        attrs.mtu = a.path_mtu;
    }
    if mask & IBV_QP_DEST_QPN != 0 {
        if a.dest_qp_num >= 1 << 24 {
            return Err(libc::EINVAL);
        }
        attrs.dest_qpn = a.dest_qp_num;
    }
    if mask & IBV_QP_RQ_PSN != 0 && a.rq_psn >= 1 << 24 {
        return Err(libc::EINVAL);
    }
    if mask & IBV_QP_SQ_PSN != 0 && a.sq_psn >= 1 << 24 {
        return Err(libc::EINVAL);
    }
    if mask & IBV_QP_MIN_RNR_TIMER != 0 && a.min_rnr_timer > 31 {
        return Err(libc::EINVAL);
    }
    if mask & IBV_QP_MAX_DEST_RD_ATOMIC != 0 {
        if i32::from(a.max_dest_rd_atomic) > dev.spec.rd_atom {
            return Err(libc::EINVAL);
        }
        attrs.max_dest_rd_atomic = a.max_dest_rd_atomic;
    }
    if mask & IBV_QP_MAX_QP_RD_ATOMIC != 0 {
        if i32::from(a.max_rd_atomic) > dev.spec.rd_atom {
            return Err(libc::EINVAL);
        }
        attrs.max_rd_atomic = a.max_rd_atomic;
    }
    if mask & IBV_QP_TIMEOUT != 0 {
        if a.timeout > 31 {
            return Err(libc::EINVAL);
        }
        attrs.timeout = a.timeout;
    }
    if mask & IBV_QP_RETRY_CNT != 0 {
        if a.retry_cnt > 7 {
            return Err(libc::EINVAL);
        }
        attrs.retry_cnt = a.retry_cnt;
    }
    if mask & IBV_QP_RNR_RETRY != 0 {
        if a.rnr_retry > 7 {
            return Err(libc::EINVAL);
        }
        attrs.rnr_retry = a.rnr_retry;
    }
    if mask & IBV_QP_AV != 0 {
        let ah = &a.ah_attr;
        if ah.port_num != 1 {
            return Err(libc::EINVAL);
        }
        if dev.spec.infiniband {
            if ah.dlid == 0 {
                return Err(libc::EINVAL);
            }
            attrs.remote_node = ah.dlid;
            attrs.gid_type = IBV_GID_TYPE_IB;
        } else {
            // RoCE has no LIDs: the address vector must carry the GRH.
            let gids = dev.gids();
            let Some((_, kind)) = gids.get(usize::from(ah.grh.sgid_index)) else {
                return Err(libc::EINVAL);
            };
            if ah.is_global != 1 || ah.grh.hop_limit == 0 {
                return Err(libc::EINVAL);
            }
            // SAFETY: every bit pattern is a valid `raw`.
            let dgid = unsafe { ah.grh.dgid.raw };
            attrs.remote_node = u16::from_be_bytes([dgid[14], dgid[15]]);
            attrs.gid_type = *kind;
        }
        if attrs.remote_node == 0 {
            return Err(libc::EINVAL);
        }
    }
    st.attrs = attrs;
    match to {
        IBV_QPS_RESET => {
            let dropped = st.sq.len();
            st.sq.clear();
            st.in_flight -= dropped as u32;
            nic::OUTSTANDING.fetch_sub(dropped, Ordering::AcqRel);
            st.attrs = Default::default();
        }
        IBV_QPS_RTR => st.generation += 1,
        _ => {}
    }
    st.state = to;
    drop(st);
    q.cv.notify_all();
    Ok(to)
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_modify_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    mask: c_int,
) -> c_int {
    // SAFETY: a live QP and the caller's attribute.
    let (b, a) = unsafe { (&mut *(qp as *mut QpBox), &*attr) };
    match modify(&b.qp, a, mask) {
        Ok(state) => {
            b.ibv.state = state;
            0
        }
        Err(e) => e,
    }
}
