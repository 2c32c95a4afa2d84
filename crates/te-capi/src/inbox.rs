//! What peers send: notifications and peer events.

use std::ffi::{c_char, c_int, CString};
use std::time::Duration;

use te_facade::{Notification, PeerEvent, PeerEventKind};

use crate::args::{free_box, obj, wait_timeout, Out};
use crate::engine::TeEngine;
use crate::error::{guard, TE_OK, TE_PENDING};

/// `te_notification`: a received notification and C strings of its sender.
#[derive(Debug)]
pub struct TeNotification {
    notification: Notification,
    sender: CString,
    address: CString,
}

/// `te_peer_event`: what happened to a peer, as C lays it out.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct TePeerEvent {
    /// `TE_PEER_LOST`, `TE_PEER_RESTARTED`, `TE_PEER_LEFT` or `TE_PEER_TORN_WRITE`.
    pub kind: i32,
    /// Always 0.
    pub reserved: u32,
    /// The peer's epoch (the new one, for `TE_PEER_RESTARTED`).
    pub epoch: u64,
    /// Its epoch before a restart; 0 otherwise.
    pub previous_epoch: u64,
    /// The peer's engine name, NUL-terminated (cut at 255 bytes).
    pub name: [c_char; 256],
    /// The peer's control-plane address, NUL-terminated (cut at 255 bytes).
    pub address: [c_char; 256],
    /// For `TE_PEER_TORN_WRITE`: the region whose bytes may be torn; 0 otherwise.
    pub torn_region: u64,
    /// For `TE_PEER_TORN_WRITE`: the first byte that may be torn; 0 otherwise.
    pub torn_start: u64,
    /// For `TE_PEER_TORN_WRITE`: one past the last; 0 otherwise.
    pub torn_end: u64,
}

fn c_string(s: &str) -> CString {
    CString::new(s.replace('\0', "")).unwrap_or_default()
}

fn copy_into(dst: &mut [c_char; 256], s: &str) {
    let bytes = s.as_bytes();
    let n = bytes.len().min(dst.len() - 1);
    for (d, b) in dst.iter_mut().zip(&bytes[..n]) {
        *d = *b as c_char;
    }
    dst[n] = 0;
}

/// Waits as asked: negative without limit (in slices of a day, so that
/// `Instant + timeout` cannot overflow), else at most `timeout_ms`.
fn wait<T>(timeout_ms: i64, mut attempt: impl FnMut(Duration) -> Option<T>) -> Option<T> {
    match wait_timeout(timeout_ms) {
        Some(t) => attempt(t),
        None => loop {
            if let Some(v) = attempt(Duration::from_secs(86_400)) {
                return Some(v);
            }
        },
    }
}

/// `int te_engine_recv_notification(te_engine *, int64_t timeout_ms,
/// te_notification **out)`.
///
/// # Safety
/// `engine` live; `out` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn te_engine_recv_notification(
    engine: *mut TeEngine,
    timeout_ms: i64,
    out: *mut *mut TeNotification,
) -> c_int {
    const OP: &str = "te_engine_recv_notification";
    guard(OP, || {
        // SAFETY: te.h asks for a live engine and an out-parameter.
        let (engine, out) = unsafe { (obj(engine, OP, "engine")?, Out::new(out, OP, "out")?) };
        let Some(notification) = wait(timeout_ms, |t| engine.engine.recv_notification(t)) else {
            return Ok(TE_PENDING);
        };
        let boxed = Box::new(TeNotification {
            sender: c_string(&notification.from),
            address: c_string(&notification.from_address),
            notification,
        });
        out.set(Box::into_raw(boxed));
        Ok(TE_OK)
    })
}

/// `const uint8_t *te_notification_data(const te_notification *, size_t *len)`.
///
/// # Safety
/// `notification` live; `len` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn te_notification_data(
    notification: *const TeNotification,
    len: *mut usize,
) -> *const u8 {
    let mut data = std::ptr::null();
    const OP: &str = "te_notification_data";
    guard(OP, || {
        // SAFETY: te.h asks for a live notification and an out-parameter.
        let (n, len) = unsafe {
            (
                obj(notification, OP, "notification")?,
                Out::new(len, OP, "len")?,
            )
        };
        len.set(n.notification.message.len());
        data = n.notification.message.as_ptr();
        Ok(TE_OK)
    });
    data
}

/// `const char *te_notification_sender(const te_notification *, const char **address)`:
/// the sender's engine name; its control-plane address in `*address` if not NULL.
///
/// # Safety
/// `notification` live; `address` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn te_notification_sender(
    notification: *const TeNotification,
    address: *mut *const c_char,
) -> *const c_char {
    let mut name = std::ptr::null();
    const OP: &str = "te_notification_sender";
    guard(OP, || {
        // SAFETY: te.h asks for a live notification.
        let n = unsafe { obj(notification, OP, "notification") }?;
        // SAFETY: te.h asks for NULL or a pointer valid for a write.
        if let Some(out) = unsafe { Out::optional(address, OP, "address") }? {
            out.set(n.address.as_ptr());
        }
        name = n.sender.as_ptr();
        Ok(TE_OK)
    });
    name
}

/// `void te_notification_free(te_notification *)`.
///
/// # Safety
/// `notification` NULL or one not freed yet.
#[no_mangle]
pub unsafe extern "C" fn te_notification_free(notification: *mut TeNotification) {
    // SAFETY: NULL or the box `te_engine_recv_notification` leaked, by the contract above.
    unsafe { free_box(notification, "te_notification_free") }
}

fn event_kind(kind: PeerEventKind) -> i32 {
    match kind {
        PeerEventKind::Lost => 1,
        PeerEventKind::Restarted => 2,
        PeerEventKind::Left => 3,
        PeerEventKind::TornWrite => 4,
    }
}

/// `int te_engine_recv_event(te_engine *, int64_t timeout_ms, te_peer_event *out)`.
///
/// # Safety
/// `engine` live; `out` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn te_engine_recv_event(
    engine: *mut TeEngine,
    timeout_ms: i64,
    out: *mut TePeerEvent,
) -> c_int {
    const OP: &str = "te_engine_recv_event";
    guard(OP, || {
        // SAFETY: te.h asks for a live engine and an out-parameter.
        let (engine, out) = unsafe { (obj(engine, OP, "engine")?, Out::new(out, OP, "out")?) };
        let Some(event): Option<PeerEvent> = wait(timeout_ms, |t| engine.engine.recv_event(t))
        else {
            return Ok(TE_PENDING);
        };
        let mut c = TePeerEvent {
            kind: event_kind(event.kind),
            reserved: 0,
            epoch: event.epoch,
            previous_epoch: event.previous_epoch.unwrap_or(0),
            name: [0; 256],
            address: [0; 256],
            torn_region: event.torn.map_or(0, |t| t.region.0),
            torn_start: event.torn.map_or(0, |t| t.start),
            torn_end: event.torn.map_or(0, |t| t.end),
        };
        copy_into(&mut c.name, &event.name);
        copy_into(&mut c.address, &event.address);
        out.set(c);
        Ok(TE_OK)
    })
}
