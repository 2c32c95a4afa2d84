//! Protection domains and the memory regions registered in them.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use crate::device::ctx_box;
use crate::nic::{AsyncQueue, Device, Mr};
use crate::verbs::*;
use crate::{fail, handle};

/// A protection domain as handed out: the `ibv_pd` first; `refs` counts the regions
/// and QPs in it.
#[repr(C)]
pub(crate) struct PdBox {
    pub(crate) ibv: ibv_pd,
    pub(crate) dev: Arc<Device>,
    pub(crate) events: Arc<AsyncQueue>,
    pub(crate) refs: AtomicUsize,
}

/// A registered region as handed out: the `ibv_mr` first, then the fake's region.
#[repr(C)]
struct MrBox {
    ibv: ibv_mr,
    mr: Arc<Mr>,
    key: u32,
    dev: Arc<Device>,
}

/// Protection domains whose `ibv_dealloc_pd` was refused because memory regions were
/// still registered in them (a consumer that closes a device before deregistering
/// its memory; a real provider would then deregister into a closed device).
pub(crate) static BUSY_PDS: AtomicUsize = AtomicUsize::new(0);

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
    // SAFETY: an open context.
    let c = unsafe { ctx_box(ctx) };
    Box::into_raw(Box::new(PdBox {
        ibv: ibv_pd {
            context: ctx,
            handle: handle(),
        },
        dev: c.dev.clone(),
        events: c.events.clone(),
        refs: AtomicUsize::new(0),
    }))
    .cast()
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    // SAFETY: `pd` came from ibv_alloc_pd.
    if unsafe { &*(pd as *const PdBox) }
        .refs
        .load(Ordering::Acquire)
        > 0
    {
        BUSY_PDS.fetch_add(1, Ordering::AcqRel);
        return libc::EBUSY;
    }
    // SAFETY: as above, freed once.
    drop(unsafe { Box::from_raw(pd as *mut PdBox) });
    0
}

/// Whether every page of `addr..addr+len` is mapped.
fn mapped(addr: u64, len: u64) -> bool {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
    let start = addr & !(page - 1);
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    let span = end - start;
    let mut vec = vec![0u8; span.div_ceil(page) as usize];
    // SAFETY: mincore only inspects the mapping of the range and writes one byte per
    // page into `vec`, which is that long; it fails with ENOMEM for unmapped pages.
    unsafe { libc::mincore(start as *mut c_void, span as usize, vec.as_mut_ptr()) == 0 }
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: `pd` came from ibv_alloc_pd.
    let p = unsafe { &*(pd as *const PdBox) };
    let remote = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC;
    if len == 0 || (access & remote != 0 && access & IBV_ACCESS_LOCAL_WRITE == 0) {
        return fail(libc::EINVAL);
    }
    if addr.is_null() || !mapped(addr as u64, len as u64) {
        return fail(libc::EFAULT);
    }
    let key = p.dev.new_key();
    let mr = Arc::new(Mr {
        addr: addr as u64,
        len: len as u64,
        access,
        pd: p.ibv.handle,
        live: RwLock::new(true),
    });
    p.dev
        .mrs
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, mr.clone());
    p.refs.fetch_add(1, Ordering::AcqRel);
    Box::into_raw(Box::new(MrBox {
        ibv: ibv_mr {
            context: p.ibv.context,
            pd,
            addr,
            length: len,
            handle: handle(),
            lkey: key,
            rkey: key,
        },
        mr,
        key,
        dev: p.dev.clone(),
    }))
    .cast()
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_reg_dmabuf_mr(
    _pd: *mut ibv_pd,
    _offset: u64,
    _len: usize,
    _iova: u64,
    _fd: c_int,
    _access: c_int,
) -> *mut ibv_mr {
    fail(libc::EOPNOTSUPP)
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    // SAFETY: `mr` came from ibv_reg_mr and is deregistered once.
    let b = unsafe { Box::from_raw(mr as *mut MrBox) };
    b.dev
        .mrs
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&b.key);
    // Waits for copies in progress; none starts afterwards.
    *b.mr.live.write().unwrap_or_else(|e| e.into_inner()) = false;
    // SAFETY: the region's PD outlives it (ibv_dealloc_pd refuses while it is counted).
    unsafe { &*(b.ibv.pd as *const PdBox) }
        .refs
        .fetch_sub(1, Ordering::AcqRel);
    0
}
