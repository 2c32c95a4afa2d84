//! Async events: taking them from a context and acknowledging them.

use std::ffi::c_int;

use crate::device::ctx_box;
use crate::nic::{lock, Element};
use crate::qp::QpBox;
use crate::verbs::*;

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_get_async_event(
    ctx: *mut ibv_context,
    event: *mut ibv_async_event,
) -> c_int {
    // SAFETY: an open context.
    let q = &unsafe { ctx_box(ctx) }.events;
    loop {
        if !q.pipe.take() {
            return -1; // errno from read(2).
        }
        let mut events = lock(&q.events);
        let Some((kind, element)) = events.pop_front() else {
            continue; // Purged: its object was destroyed.
        };
        let element = match element {
            Element::Qp(addr) => {
                // SAFETY: the QP is live: destroying it purges its events under this
                // lock, then waits for the acknowledgement counted here.
                lock(&unsafe { &*(addr as *const QpBox) }.qp.st).unacked_events += 1;
                ibv_async_element {
                    qp: addr as *mut ibv_qp,
                }
            }
            Element::Cq(addr) => ibv_async_element {
                cq: addr as *mut ibv_cq,
            },
            Element::Port(port_num) => ibv_async_element { port_num },
        };
        // SAFETY: the caller's out-parameter.
        unsafe {
            *event = ibv_async_event {
                element,
                event_type: kind,
            }
        };
        return 0;
    }
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_ack_async_event(event: *mut ibv_async_event) {
    // SAFETY: an event from ibv_get_async_event.
    let e = unsafe { &*event };
    let qp_event = matches!(e.event_type, 1..=7 | 16);
    if qp_event {
        // SAFETY: the QP is live until this acknowledgement (see ibv_get_async_event).
        let q = &unsafe { &*(e.element.qp as *const QpBox) }.qp;
        let mut st = lock(&q.st);
        st.unacked_events = st.unacked_events.saturating_sub(1);
        q.cv.notify_all();
    }
}
