//! Posting work requests to a queue pair's send and receive queues.

use std::ffi::{c_int, c_void};
use std::sync::atomic::Ordering;

use crate::nic::{self, lock};
use crate::qp::QpBox;
use crate::verbs::*;

pub(crate) unsafe extern "C" fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: a live QP.
    let q = &unsafe { &*(qp as *const QpBox) }.qp;
    let mut st = lock(&q.st);
    let mut cur = wr;
    let mut rc = 0;
    while !cur.is_null() {
        // SAFETY: the caller's chain of valid work requests.
        let w = unsafe { &*cur };
        let sges = usize::try_from(w.num_sge)
            .ok()
            .filter(|&n| n <= q.max_send_sge as usize);
        let usable = st.state == IBV_QPS_RTS || st.state == IBV_QPS_ERR;
        let rdma = w.opcode == IBV_WR_RDMA_WRITE || w.opcode == IBV_WR_RDMA_READ;
        let listed = sges.is_some() && (w.num_sge == 0 || !w.sg_list.is_null());
        rc = if !usable || !rdma || !listed {
            libc::EINVAL
        } else if st.in_flight >= q.max_send_wr {
            libc::ENOMEM
        } else {
            0
        };
        if rc != 0 {
            if !bad.is_null() {
                // SAFETY: the caller's out-parameter.
                unsafe { *bad = cur };
            }
            break;
        }
        let sges = match sges {
            // SAFETY: `num_sge` entries at `sg_list`, checked non-null above.
            Some(n) if n > 0 => unsafe { std::slice::from_raw_parts(w.sg_list, n) }.to_vec(),
            _ => Vec::new(),
        };
        // SAFETY: `rdma` is the member RDMA opcodes use.
        let rdma = unsafe { w.wr.rdma };
        st.sq.push_back(nic::Wr {
            wr_id: w.wr_id,
            write: w.opcode == IBV_WR_RDMA_WRITE,
            sges,
            remote_addr: rdma.remote_addr,
            rkey: rdma.rkey,
            signaled: q.sig_all || w.send_flags & IBV_SEND_SIGNALED != 0,
        });
        st.in_flight += 1;
        nic::OUTSTANDING.fetch_add(1, Ordering::AcqRel);
        cur = w.next;
    }
    drop(st);
    q.cv.notify_all();
    rc
}

pub(crate) unsafe extern "C" fn post_recv(
    _qp: *mut ibv_qp,
    _wr: *mut c_void,
    _bad: *mut *mut c_void,
) -> c_int {
    // The fake carries RDMA WRITE and READ only; nothing consumes receives.
    libc::EOPNOTSUPP
}
