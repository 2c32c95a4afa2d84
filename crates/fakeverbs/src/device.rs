//! Devices and their contexts: listing, opening, closing and querying them.

use std::ffi::{c_char, c_int};
use std::os::fd::AsRawFd;
use std::ptr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use crate::cq::{poll_cq, req_notify_cq};
use crate::nic::{self, lock, AsyncQueue, Device, EventPipe};
use crate::post::{post_recv, post_send};
use crate::verbs::*;
use crate::{fail, set_errno};

/// An open context as handed out: the `ibv_context` first, then its device and async
/// event queue.
#[repr(C)]
pub(crate) struct CtxBox {
    pub(crate) ibv: ibv_context,
    pub(crate) dev: Arc<Device>,
    pub(crate) events: Arc<AsyncQueue>,
}

/// The device behind `ctx`.
///
/// # Safety
/// `ctx` came from [`ibv_open_device`] and is open.
pub(crate) unsafe fn ctx_box<'a>(ctx: *mut ibv_context) -> &'a CtxBox {
    // SAFETY: per the contract, `ctx` is the first field of a live `CtxBox`.
    unsafe { &*(ctx as *const CtxBox) }
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_get_device_list(num: *mut c_int) -> *mut *mut ibv_device {
    let fabric = nic::fabric();
    if let Some(e) = &fabric.error {
        eprintln!("fakeverbs: {e}");
        return fail(libc::EINVAL);
    }
    let n = fabric.devices.len();
    // SAFETY: calloc with a valid size; freed by ibv_free_device_list.
    let list = unsafe { libc::calloc(n + 1, std::mem::size_of::<*mut ibv_device>()) }
        as *mut *mut ibv_device;
    if list.is_null() {
        return fail(libc::ENOMEM);
    }
    for (i, d) in fabric.devices.iter().enumerate() {
        // SAFETY: `list` has n + 1 slots; the devices live for the process's life.
        unsafe { *list.add(i) = Arc::as_ptr(d) as *mut ibv_device };
    }
    if !num.is_null() {
        // SAFETY: the caller's out-parameter.
        unsafe { *num = n as c_int };
    }
    list
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_free_device_list(list: *mut *mut ibv_device) {
    // SAFETY: `list` came from calloc in ibv_get_device_list.
    unsafe { libc::free(list.cast()) };
}

fn device(dev: *mut ibv_device) -> Option<&'static Arc<Device>> {
    nic::fabric()
        .devices
        .iter()
        .find(|d| Arc::as_ptr(d) as *mut ibv_device == dev)
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_get_device_name(dev: *mut ibv_device) -> *const c_char {
    device(dev).map_or(ptr::null(), |d| d.cname.as_ptr())
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_open_device(dev: *mut ibv_device) -> *mut ibv_context {
    let Some(dev) = device(dev) else {
        return fail(libc::ENODEV);
    };
    let Some(pipe) = EventPipe::new() else {
        return fail(libc::EMFILE);
    };
    let events = Arc::new(AsyncQueue {
        pipe,
        events: Mutex::new(Default::default()),
    });
    lock(&dev.contexts).push(Arc::downgrade(&events));
    let ops = ibv_context_ops {
        poll_cq: Some(poll_cq),
        req_notify_cq: Some(req_notify_cq),
        post_send: Some(post_send),
        post_recv: Some(post_recv),
        ..Default::default()
    };
    let b = Box::new(CtxBox {
        ibv: ibv_context {
            device: Arc::as_ptr(dev) as *mut ibv_device,
            ops,
            cmd_fd: -1,
            async_fd: events.pipe.rd.as_raw_fd(),
            num_comp_vectors: dev.spec.vectors,
            // SAFETY: an all-zero pthread mutex is PTHREAD_MUTEX_INITIALIZER on Linux.
            mutex: unsafe { std::mem::zeroed() },
            abi_compat: ptr::null_mut(),
        },
        dev: dev.clone(),
        events,
    });
    Box::into_raw(b).cast()
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_close_device(ctx: *mut ibv_context) -> c_int {
    // SAFETY: `ctx` came from ibv_open_device and is closed once.
    drop(unsafe { Box::from_raw(ctx as *mut CtxBox) });
    0
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_query_device(
    ctx: *mut ibv_context,
    attr: *mut ibv_device_attr,
) -> c_int {
    // SAFETY: an open context.
    let dev = &unsafe { ctx_box(ctx) }.dev;
    let mut a = ibv_device_attr::default();
    for (d, s) in a.fw_ver.iter_mut().zip(b"fakeverbs 1\0") {
        *d = *s as c_char;
    }
    a.node_guid = u64::from(dev.node);
    a.max_mr_size = u64::MAX;
    a.page_size_cap = 0xffff_f000;
    a.max_qp = 1 << 16;
    a.max_qp_wr = 16384;
    a.max_sge = 30;
    a.max_sge_rd = 30;
    a.max_cq = 1 << 16;
    a.max_cqe = 1 << 22;
    a.max_mr = 1 << 20;
    a.max_pd = 1 << 16;
    a.max_qp_rd_atom = dev.spec.rd_atom;
    a.max_qp_init_rd_atom = dev.spec.rd_atom;
    a.max_pkeys = 1;
    a.phys_port_cnt = 1;
    // SAFETY: the caller's out-parameter.
    unsafe { *attr = a };
    0
}

/// Writes the older `ibv_port_attr` layout (every field up to `link_layer`), as the
/// exported `ibv_query_port` of libibverbs does.
#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
) -> c_int {
    // SAFETY: an open context.
    let dev = &unsafe { ctx_box(ctx) }.dev;
    if port != 1 {
        return libc::EINVAL;
    }
    let active = dev.active.load(Ordering::Acquire);
    // SAFETY: `attr` is the caller's out-parameter; only fields up to link_layer are
    // written, each through its own pointer.
    unsafe {
        ptr::addr_of_mut!((*attr).state).write(if active {
            IBV_PORT_ACTIVE
        } else {
            IBV_PORT_DOWN
        });
        ptr::addr_of_mut!((*attr).max_mtu).write(IBV_MTU_4096);
        ptr::addr_of_mut!((*attr).active_mtu).write(dev.spec.mtu);
        ptr::addr_of_mut!((*attr).gid_tbl_len).write(dev.gids().len() as c_int);
        ptr::addr_of_mut!((*attr).max_msg_sz).write(1 << 31);
        ptr::addr_of_mut!((*attr).pkey_tbl_len).write(1);
        ptr::addr_of_mut!((*attr).lid).write(dev.lid());
        ptr::addr_of_mut!((*attr).phys_state).write(if active { 5 } else { 3 });
        ptr::addr_of_mut!((*attr).link_layer).write(if dev.spec.infiniband {
            IBV_LINK_LAYER_INFINIBAND
        } else {
            IBV_LINK_LAYER_ETHERNET
        });
    }
    0
}

#[no_mangle]
pub(crate) unsafe extern "C" fn ibv_query_gid(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    gid: *mut ibv_gid,
) -> c_int {
    // SAFETY: an open context.
    let dev = &unsafe { ctx_box(ctx) }.dev;
    match dev.gids().get(index as usize) {
        Some((g, _)) if port == 1 && index >= 0 => {
            // SAFETY: the caller's out-parameter.
            unsafe { (*gid).raw = *g };
            0
        }
        _ => {
            set_errno(libc::EINVAL);
            -1
        }
    }
}

#[no_mangle]
pub(crate) unsafe extern "C" fn _ibv_query_gid_ex(
    ctx: *mut ibv_context,
    port: u32,
    index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    // SAFETY: an open context.
    let dev = &unsafe { ctx_box(ctx) }.dev;
    if port != 1 || flags != 0 || entry_size < std::mem::size_of::<ibv_gid_entry>() {
        return libc::EINVAL;
    }
    let Some((g, kind)) = dev.gids().get(index as usize).copied() else {
        return libc::ENODATA;
    };
    // SAFETY: the caller's out-parameter, at least `ibv_gid_entry` long.
    unsafe {
        *entry = ibv_gid_entry {
            gid: ibv_gid { raw: g },
            gid_index: index,
            port_num: port,
            gid_type: kind,
            ndev_ifindex: 0,
        }
    };
    0
}
