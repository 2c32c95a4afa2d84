//! The control API for tests: the `fakeverbs_*` functions, which tests resolve with
//! `dlsym`, inject faults, take ports down and up, and read what the fake counted.

use std::ffi::{c_char, c_int, CStr};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::memory::BUSY_PDS;
use crate::nic::{self, lock, Device, Element, Fault};
use crate::verbs::*;

/// Makes the next `count` work requests that QP `qpn` runs complete with `status` (an
/// `IBV_WC_*` error, e.g. 12 for `RETRY_EXC_ERR`, 13 for `RNR_RETRY_EXC_ERR`, 10 for
/// `REM_ACCESS_ERR`); the first one moves the QP to ERR. Returns 0, or `ENOENT` for an
/// unknown QP, `EINVAL` for status 0.
#[no_mangle]
pub(crate) extern "C" fn fakeverbs_fail(qpn: u32, status: u32, count: u32) -> c_int {
    inject(qpn, Fault::Status(status), count, status != IBV_WC_SUCCESS)
}

/// Makes the next `count` work requests that QP `qpn` runs wait `micros` µs first.
/// Returns 0, or `ENOENT` for an unknown QP.
#[no_mangle]
pub(crate) extern "C" fn fakeverbs_delay(qpn: u32, micros: u64, count: u32) -> c_int {
    inject(
        qpn,
        Fault::Delay(Duration::from_micros(micros)),
        count,
        true,
    )
}

fn inject(qpn: u32, fault: Fault, count: u32, valid: bool) -> c_int {
    if !valid || count == 0 {
        return libc::EINVAL;
    }
    match nic::qp(qpn) {
        Some(q) => {
            lock(&q.st).faults.push_back((fault, count));
            0
        }
        None => libc::ENOENT,
    }
}

/// A fatal error on QP `qpn`: it moves to ERR, flushing what it holds, and its context
/// gets `IBV_EVENT_QP_FATAL`. Returns 0 or `ENOENT`.
#[no_mangle]
pub(crate) extern "C" fn fakeverbs_qp_fatal(qpn: u32) -> c_int {
    match nic::qp(qpn) {
        Some(q) => {
            q.to_error();
            q.event(IBV_EVENT_QP_FATAL);
            0
        }
        None => libc::ENOENT,
    }
}

/// Writes the numbers of device `name`'s live QPs, lowest first, to `out` (at most
/// `cap` of them) and returns how many it has (which may exceed `cap`), or -1 for an
/// unknown device: how a test finds the QPs to hand to [`fakeverbs_qp_fatal`] and
/// [`fakeverbs_qp_state`].
#[no_mangle]
pub(crate) unsafe extern "C" fn fakeverbs_device_qps(
    name: *const c_char,
    out: *mut u32,
    cap: usize,
) -> c_int {
    let Some(dev) = named(name) else {
        return -1;
    };
    let mut qpns: Vec<u32> = lock(nic::qps())
        .values()
        .filter(|q| Arc::ptr_eq(&q.dev, dev))
        .map(|q| q.qpn)
        .collect();
    qpns.sort_unstable();
    if !out.is_null() {
        for (i, qpn) in qpns.iter().take(cap).enumerate() {
            // SAFETY: the caller passes room for `cap` numbers at `out`, and `i < cap`.
            unsafe { out.add(i).write(*qpn) };
        }
    }
    qpns.len() as c_int
}

/// The state (`IBV_QPS_*`) of QP `qpn`, or -1 if there is none.
#[no_mangle]
pub(crate) extern "C" fn fakeverbs_qp_state(qpn: u32) -> c_int {
    nic::qp(qpn).map_or(-1, |q| lock(&q.st).state as c_int)
}

/// Takes device `name`'s port down (`active` = 0) or up: every open context of it gets
/// `IBV_EVENT_PORT_ERR` or `IBV_EVENT_PORT_ACTIVE`; while down, its work requests fail
/// with `RETRY_EXC_ERR` and requests to it are dropped. Returns 0 or `ENODEV`.
#[no_mangle]
pub(crate) unsafe extern "C" fn fakeverbs_set_port(name: *const c_char, active: c_int) -> c_int {
    let Some(dev) = named(name) else {
        return libc::ENODEV;
    };
    dev.active.store(active != 0, Ordering::Release);
    let kind = if active != 0 {
        IBV_EVENT_PORT_ACTIVE
    } else {
        IBV_EVENT_PORT_ERR
    };
    dev.broadcast(kind, Element::Port(1));
    0
}

fn named(name: *const c_char) -> Option<&'static Arc<Device>> {
    // SAFETY: the caller passes a C string.
    let name = unsafe { CStr::from_ptr(name) };
    nic::fabric()
        .devices
        .iter()
        .find(|d| d.cname.as_c_str() == name)
}

/// Makes the next `count` work requests run by any QP of device `name` complete with
/// `status` (as [`fakeverbs_fail`]). Returns 0, `ENODEV` or `EINVAL`.
#[no_mangle]
pub(crate) unsafe extern "C" fn fakeverbs_fail_device(
    name: *const c_char,
    status: u32,
    count: u32,
) -> c_int {
    let Some(dev) = named(name) else {
        return libc::ENODEV;
    };
    if status == IBV_WC_SUCCESS || count == 0 {
        return libc::EINVAL;
    }
    lock(&dev.faults).push_back((Fault::Status(status), count));
    0
}

/// Makes the next `count` work requests run by any QP of device `name` wait `micros`
/// µs first. Returns 0, `ENODEV` or `EINVAL`.
#[no_mangle]
pub(crate) unsafe extern "C" fn fakeverbs_delay_device(
    name: *const c_char,
    micros: u64,
    count: u32,
) -> c_int {
    let Some(dev) = named(name) else {
        return libc::ENODEV;
    };
    if count == 0 {
        return libc::EINVAL;
    }
    lock(&dev.faults).push_back((Fault::Delay(Duration::from_micros(micros)), count));
    0
}

/// The work requests device `name`'s faults still apply to (0 once all were hit), or
/// -1 for an unknown device.
#[no_mangle]
pub(crate) unsafe extern "C" fn fakeverbs_device_faults_left(name: *const c_char) -> i64 {
    named(name).map_or(-1, |d| {
        lock(&d.faults).iter().map(|(_, n)| i64::from(*n)).sum()
    })
}

/// Forgets the faults still pending on device `name`. Returns 0 or `ENODEV`.
#[no_mangle]
pub(crate) unsafe extern "C" fn fakeverbs_clear_faults(name: *const c_char) -> c_int {
    named(name).map_or(libc::ENODEV, |d| {
        lock(&d.faults).clear();
        0
    })
}

/// The key of device `name`'s memory region that covers `addr` (lkey and rkey are the
/// same in the fake), or 0: what a peer that guessed or stole a key would present.
#[no_mangle]
pub(crate) unsafe extern "C" fn fakeverbs_mr_key(name: *const c_char, addr: u64) -> u32 {
    let Some(dev) = named(name) else { return 0 };
    let mrs = dev.mrs.read().unwrap_or_else(|e| e.into_inner());
    mrs.iter()
        .find(|(_, m)| addr >= m.addr && addr < m.addr + m.len)
        .map_or(0, |(k, _)| *k)
}

/// How many `ibv_dealloc_pd` calls in this process were refused with `EBUSY`.
#[no_mangle]
pub(crate) extern "C" fn fakeverbs_busy_pds() -> u64 {
    BUSY_PDS.load(Ordering::Acquire) as u64
}

/// Work requests posted in this process and not yet completed or dropped.
#[no_mangle]
pub(crate) extern "C" fn fakeverbs_outstanding() -> u64 {
    nic::OUTSTANDING.load(Ordering::Acquire) as u64
}
