//! RC queue pairs: their attributes, state and send queue, injected faults, and the
//! completions and waits of the requester thread that runs them.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::requester::requester;
use super::{
    lock, qps, AsyncQueue, Cq, Device, Element, MAX_EMULATED_TIMEOUT, NEXT_QPN, OUTSTANDING,
};
use crate::verbs::*;

fn wait_until<'a, T>(cv: &Condvar, g: MutexGuard<'a, T>, until: Instant) -> MutexGuard<'a, T> {
    let left = until.saturating_duration_since(Instant::now());
    cv.wait_timeout(g, left)
        .map(|(g, _)| g)
        .unwrap_or_else(|p| p.into_inner().0)
}

/// The attributes a QP got from its transitions.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Attrs {
    pub(crate) access: u32,
    pub(crate) dest_qpn: u32,
    pub(crate) remote_node: u16,
    /// The type of the local GID the address vector uses (Ethernet).
    pub(crate) gid_type: u32,
    pub(crate) mtu: u32,
    pub(crate) timeout: u8,
    pub(crate) retry_cnt: u8,
    pub(crate) rnr_retry: u8,
    pub(crate) max_rd_atomic: u8,
    pub(crate) max_dest_rd_atomic: u8,
}

impl Attrs {
    /// The time a NIC spends retrying before `RETRY_EXC_ERR`: 4.096 µs × 2^timeout ×
    /// (retries + 1), capped so tests stay quick.
    pub(super) fn retry_time(&self) -> Duration {
        let ns = 4096u64 << self.timeout.min(31);
        Duration::from_nanos(ns.saturating_mul(u64::from(self.retry_cnt) + 1))
            .min(MAX_EMULATED_TIMEOUT)
    }
}

/// One posted work request, copied out of the caller's `ibv_send_wr`.
#[derive(Debug, Clone)]
pub(crate) struct Wr {
    pub(crate) wr_id: u64,
    pub(crate) write: bool,
    pub(crate) sges: Vec<ibv_sge>,
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
    pub(crate) signaled: bool,
}

/// An injected fault, applied to the next work requests a QP runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// Complete with this status (after the emulated transport timeout for
    /// `RETRY_EXC_ERR`), moving the QP to ERR.
    Status(u32),
    /// Wait this long before running.
    Delay(Duration),
}

/// What a QP's requester thread and the verbs calls share, under the QP's lock.
pub(crate) struct QpState {
    pub(crate) state: u32,
    pub(crate) attrs: Attrs,
    /// Bumped at every RTR, so the requester reconnects.
    pub(crate) generation: u64,
    pub(crate) sq: VecDeque<Wr>,
    /// Posted and not yet completed (queued or running).
    pub(crate) in_flight: u32,
    pub(crate) faults: VecDeque<(Fault, u32)>,
    pub(crate) shutdown: bool,
    /// Async events handed out (counted under the context's event lock) and not
    /// acknowledged.
    pub(crate) unacked_events: u32,
}

/// An RC queue pair.
pub(crate) struct Qp {
    pub(crate) qpn: u32,
    pub(crate) dev: Arc<Device>,
    pub(crate) pd: u32,
    pub(crate) cq: Arc<Cq>,
    pub(crate) max_send_wr: u32,
    pub(crate) max_send_sge: u32,
    pub(crate) sig_all: bool,
    pub(crate) ibv: AtomicUsize,
    pub(crate) events: Arc<AsyncQueue>,
    pub(crate) st: Mutex<QpState>,
    pub(crate) cv: Condvar,
    pub(crate) worker: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Qp {
    /// A new QP in RESET with its requester thread.
    pub(crate) fn create(
        dev: Arc<Device>,
        pd: u32,
        cq: Arc<Cq>,
        cap: ibv_qp_cap,
        sig_all: bool,
        events: Arc<AsyncQueue>,
    ) -> Option<Arc<Qp>> {
        let qpn = NEXT_QPN.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff;
        let qp = Arc::new(Qp {
            qpn,
            dev,
            pd,
            cq,
            max_send_wr: cap.max_send_wr,
            max_send_sge: cap.max_send_sge,
            sig_all,
            ibv: AtomicUsize::new(0),
            events,
            st: Mutex::new(QpState {
                state: IBV_QPS_RESET,
                attrs: Attrs::default(),
                generation: 0,
                sq: VecDeque::new(),
                in_flight: 0,
                faults: VecDeque::new(),
                shutdown: false,
                unacked_events: 0,
            }),
            cv: Condvar::new(),
            worker: Mutex::new(None),
        });
        let q = qp.clone();
        let h = std::thread::Builder::new()
            .name(format!("fakeverbs-qp-{qpn:x}"))
            .spawn(move || requester(&q))
            .ok()?;
        *lock(&qp.worker) = Some(h);
        lock(qps()).insert(qpn, qp.clone());
        Some(qp)
    }

    /// Moves the QP to ERR (its thread flushes what it holds).
    pub(crate) fn to_error(&self) {
        lock(&self.st).state = IBV_QPS_ERR;
        self.cv.notify_all();
    }

    /// Sends an async event about this QP to its context.
    pub(crate) fn event(&self, kind: u32) {
        self.events
            .push(kind, Element::Qp(self.ibv.load(Ordering::Relaxed)));
    }

    /// Stops the requester, drops what it had not run, and waits (bounded) for the
    /// async events about this QP to be acknowledged.
    pub(crate) fn destroy(&self) {
        self.events
            .purge(Element::Qp(self.ibv.load(Ordering::Relaxed)));
        {
            let mut st = lock(&self.st);
            st.shutdown = true;
            let dropped = st.sq.len();
            st.sq.clear();
            st.in_flight -= dropped as u32;
            OUTSTANDING.fetch_sub(dropped, Ordering::AcqRel);
        }
        self.cv.notify_all();
        if let Some(h) = lock(&self.worker).take() {
            let _ = h.join();
        }
        lock(qps()).remove(&self.qpn);
        let until = Instant::now() + Duration::from_secs(10);
        let mut st = lock(&self.st);
        while st.unacked_events > 0 && Instant::now() < until {
            st = wait_until(&self.cv, st, until);
        }
    }

    /// The next fault for this QP: its own first, else its device's.
    pub(super) fn take_fault(&self) -> Option<Fault> {
        fn take(q: &mut VecDeque<(Fault, u32)>) -> Option<Fault> {
            let (fault, left) = q.front_mut()?;
            let f = *fault;
            *left -= 1;
            if *left == 0 {
                q.pop_front();
            }
            Some(f)
        }
        take(&mut lock(&self.st).faults).or_else(|| take(&mut lock(&self.dev.faults)))
    }

    /// Waits `d`; false if the QP left RTS (ERR, destroyed) meanwhile.
    pub(super) fn pause(&self, d: Duration) -> bool {
        let until = Instant::now() + d;
        let mut st = lock(&self.st);
        loop {
            if st.shutdown || st.state != IBV_QPS_RTS {
                return false;
            }
            if Instant::now() >= until {
                return true;
            }
            st = wait_until(&self.cv, st, until);
        }
    }

    /// Completes `wr` with `status`; a failure (other than a flush) moves the QP to ERR.
    pub(super) fn finish(&self, wr: &Wr, status: u32, byte_len: u32) {
        let mut st = lock(&self.st);
        // Counted done before its completion is visible, so a consumer that saw the
        // completion never finds it outstanding.
        st.in_flight -= 1;
        OUTSTANDING.fetch_sub(1, Ordering::AcqRel);
        if status != IBV_WC_SUCCESS || wr.signaled {
            self.cq.push(ibv_wc {
                wr_id: wr.wr_id,
                status,
                opcode: if wr.write {
                    IBV_WC_RDMA_WRITE
                } else {
                    IBV_WC_RDMA_READ
                },
                vendor_err: if status == IBV_WC_SUCCESS { 0 } else { 0xfa },
                byte_len,
                qp_num: self.qpn,
                ..ibv_wc::default()
            });
        }
        if status != IBV_WC_SUCCESS && status != IBV_WC_WR_FLUSH_ERR {
            st.state = IBV_QPS_ERR;
        }
    }
}
