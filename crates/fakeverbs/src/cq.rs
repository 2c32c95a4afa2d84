//! Completion channels and completion queues: creating them, their events, polling.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::device::ctx_box;
use crate::nic::{lock, Channel, Cq, CqState, Element, EventPipe};
use crate::verbs::*;
use crate::{fail, handle};

/// A completion channel as handed out: the `ibv_comp_channel` first.
#[repr(C)]
struct ChannelBox {
    ibv: ibv_comp_channel,
    ch: Arc<Channel>,
}

/// A completion queue as handed out: the `ibv_cq` first.
#[repr(C)]
pub(crate) struct CqBox {
    pub(crate) ibv: ibv_cq,
    pub(crate) cq: Arc<Cq>,
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_create_comp_channel(
    ctx: *mut ibv_context,
) -> *mut ibv_comp_channel {
    let Some(pipe) = EventPipe::new() else {
        return fail(libc::EMFILE);
    };
    let fd = pipe.rd.as_raw_fd();
    Box::into_raw(Box::new(ChannelBox {
        ibv: ibv_comp_channel {
            context: ctx,
            fd,
            refcnt: 0,
        },
        ch: Arc::new(Channel {
            pipe,
            ready: Mutex::new(Default::default()),
            cqs: AtomicUsize::new(0),
        }),
    }))
    .cast()
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int {
    // SAFETY: `ch` came from ibv_create_comp_channel.
    if unsafe { &*(ch as *const ChannelBox) }
        .ch
        .cqs
        .load(Ordering::Acquire)
        > 0
    {
        return libc::EBUSY;
    }
    // SAFETY: as above, destroyed once.
    drop(unsafe { Box::from_raw(ch as *mut ChannelBox) });
    0
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_create_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> *mut ibv_cq {
    // SAFETY: an open context.
    let c = unsafe { ctx_box(ctx) };
    if !(1..=1 << 22).contains(&cqe) || !(0..c.dev.spec.vectors).contains(&comp_vector) {
        return fail(libc::EINVAL);
    }
    let ch = if channel.is_null() {
        None
    } else {
        // SAFETY: a channel from ibv_create_comp_channel.
        let b = unsafe { &*(channel as *const ChannelBox) };
        if b.ibv.context != ctx {
            return fail(libc::EINVAL);
        }
        b.ch.cqs.fetch_add(1, Ordering::AcqRel);
        Some(b.ch.clone())
    };
    let cq = Arc::new(Cq {
        ibv: AtomicUsize::new(0),
        state: Mutex::new(CqState {
            queue: Default::default(),
            capacity: cqe as usize,
            armed: false,
            overrun: false,
        }),
        channel: ch,
        events: c.events.clone(),
        unacked: Mutex::new(0),
        acked: Condvar::new(),
        qps: AtomicUsize::new(0),
    });
    let b = Box::into_raw(Box::new(CqBox {
        ibv: ibv_cq {
            context: ctx,
            channel,
            cq_context,
            handle: handle(),
            cqe,
            // SAFETY: all-zero pthread objects are their static initialisers on Linux.
            mutex: unsafe { std::mem::zeroed() },
            // SAFETY: as above.
            cond: unsafe { std::mem::zeroed() },
            comp_events_completed: 0,
            async_events_completed: 0,
        },
        cq: cq.clone(),
    }));
    cq.ibv.store(b as usize, Ordering::Relaxed);
    b.cast()
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    // SAFETY: `cq` came from ibv_create_cq.
    let c = &unsafe { &*(cq as *const CqBox) }.cq;
    if c.qps.load(Ordering::Acquire) > 0 {
        return libc::EBUSY;
    }
    if let Some(ch) = &c.channel {
        lock(&ch.ready).retain(|a| *a != cq as usize);
    }
    c.events.purge(Element::Cq(cq as usize));
    // Like libibverbs, wait until every event handed out was acknowledged (bounded
    // here, so a test that forgets fails instead of hanging).
    let until = Instant::now() + Duration::from_secs(10);
    let mut unacked = lock(&c.unacked);
    while *unacked > 0 && Instant::now() < until {
        unacked = c
            .acked
            .wait_timeout(unacked, until - Instant::now())
            .map(|(g, _)| g)
            .unwrap_or_else(|p| p.into_inner().0);
    }
    if *unacked > 0 {
        return libc::EBUSY;
    }
    drop(unacked);
    if let Some(ch) = &c.channel {
        ch.cqs.fetch_sub(1, Ordering::AcqRel);
    }
    // SAFETY: destroyed once; no QP refers to it.
    drop(unsafe { Box::from_raw(cq as *mut CqBox) });
    0
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_get_cq_event(
    channel: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    // SAFETY: a channel from ibv_create_comp_channel.
    let ch = &unsafe { &*(channel as *const ChannelBox) }.ch;
    loop {
        if !ch.pipe.take() {
            return -1; // errno from read(2): EAGAIN on a non-blocking channel.
        }
        let mut ready = lock(&ch.ready);
        let Some(addr) = ready.pop_front() else {
            continue; // The event's CQ was destroyed before it was taken.
        };
        // SAFETY: the CQ is live: destroying it removes its entries under this lock.
        let c = unsafe { &*(addr as *const CqBox) };
        *lock(&c.cq.unacked) += 1;
        // SAFETY: the caller's out-parameters.
        unsafe {
            *cq = addr as *mut ibv_cq;
            *cq_context = c.ibv.cq_context;
        }
        return 0;
    }
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_ack_cq_events(cq: *mut ibv_cq, n: u32) {
    // SAFETY: a live CQ (it cannot be destroyed before its events are acknowledged).
    let c = &unsafe { &*(cq as *const CqBox) }.cq;
    let mut u = lock(&c.unacked);
    *u = u.saturating_sub(n);
    c.acked.notify_all();
}

pub(crate) unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: a live CQ.
    let c = &unsafe { &*(cq as *const CqBox) }.cq;
    let mut st = lock(&c.state);
    let k = (n.max(0) as usize).min(st.queue.len());
    for i in 0..k {
        let e = st.queue.pop_front().expect("counted");
        // SAFETY: the caller's array has room for `n` ≥ `k` entries.
        unsafe { *wc.add(i) = e };
    }
    k as c_int
}

pub(crate) unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, _solicited_only: c_int) -> c_int {
    // SAFETY: a live CQ.
    let c = &unsafe { &*(cq as *const CqBox) }.cq;
    lock(&c.state).armed = true;
    0
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_wc_status_str(status: u32) -> *const c_char {
    let s: &CStr = match status {
        IBV_WC_SUCCESS => c"success",
        IBV_WC_LOC_LEN_ERR => c"local length error",
        IBV_WC_LOC_QP_OP_ERR => c"local QP operation error",
        IBV_WC_LOC_PROT_ERR => c"local protection error",
        IBV_WC_WR_FLUSH_ERR => c"Work Request Flushed Error",
        IBV_WC_REM_INV_REQ_ERR => c"remote invalid request error",
        IBV_WC_REM_ACCESS_ERR => c"remote access error",
        IBV_WC_REM_OP_ERR => c"remote operation error",
        IBV_WC_RETRY_EXC_ERR => c"transport retry counter exceeded",
        IBV_WC_RNR_RETRY_EXC_ERR => c"RNR retry counter exceeded",
        _ => c"unknown",
    };
    s.as_ptr()
}
