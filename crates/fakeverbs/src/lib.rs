//! **fakeverbs: a FAKE libibverbs** for testing te's RDMA backend on machines without an
//! RDMA NIC. It is not a verbs provider for real use.
//!
//! The library exports the libibverbs functions te-rdma resolves by name (and the data
//! path te-rdma calls through `ibv_context::ops`), so te-rdma loads it through its normal
//! `dlopen` path when `TE_RDMA_VERBS_LIB` names it:
//!
//! ```sh
//! cargo build -p fakeverbs
//! TE_RDMA_VERBS_LIB=$PWD/target/debug/libfakeverbs.so te info
//! ```
//!
//! What it models (module `nic` says how):
//! - devices, one port each, with a GID table (RoCE v1 and v2 types, or InfiniBand with
//!   a LID), listed by `TE_FAKEVERBS_DEVICES` (module `spec`; default `fake0 fake1`);
//! - protection domains; memory regions with access flags and keys, refused for
//!   unmapped memory or REMOTE_WRITE without LOCAL_WRITE;
//! - completion queues with completion channels: `ibv_req_notify_cq` arms a CQ, the
//!   next completion puts one event on the channel (a pollable pipe),
//!   `ibv_get_cq_event` takes it and `ibv_ack_cq_events` acknowledges it;
//!   `ibv_destroy_cq` waits for the acknowledgements;
//! - RC queue pairs with the RESET → INIT → RTR → RTS (→ ERR) state machine; each
//!   transition refuses missing or unexpected attributes and out-of-range values
//!   (MTU above the port's, `max_rd_atomic` above the device's, a GID index the port
//!   lacks, …);
//! - RDMA WRITE and READ, carried out by a software NIC thread per QP across the
//!   fabric of abstract Unix sockets, in one process or between processes; the
//!   responder checks rkey, range, protection domain and rights, and answers a
//!   violation with `IBV_WC_REM_ACCESS_ERR`, moving both QPs to ERR;
//! - per-QP completion order, flush completions after an error, async events
//!   (`ibv_get_async_event`: port down and up, QP fatal, QP access error, CQ overrun);
//! - fault injection through the `fakeverbs_*` functions below, which tests resolve
//!   with `dlsym`, and through `TE_FAKEVERBS_DEVICES` (`delay=…`, `state=down`).
//!
//! `ibv_reg_dmabuf_mr` fails with `EOPNOTSUPP`: the fake moves host memory only.

#![warn(missing_debug_implementations, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]
#![allow(clippy::missing_safety_doc)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::fd::AsRawFd;
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

mod nic;
mod spec;
#[allow(unreachable_pub)]
#[path = "../../te-rdma/src/verbs.rs"]
mod verbs;

use nic::{lock, AsyncQueue, Channel, Cq, CqState, Device, Element, EventPipe, Fault, Mr, Qp};
use verbs::*;

fn set_errno(e: c_int) {
    // SAFETY: errno is this thread's; writing it is what a C library does on failure.
    unsafe { *libc::__errno_location() = e };
}

/// Null with `errno` set.
fn fail<T>(e: c_int) -> *mut T {
    set_errno(e);
    ptr::null_mut()
}

#[repr(C)]
struct CtxBox {
    ibv: ibv_context,
    dev: Arc<Device>,
    events: Arc<AsyncQueue>,
}

#[repr(C)]
struct PdBox {
    ibv: ibv_pd,
    dev: Arc<Device>,
    events: Arc<AsyncQueue>,
    refs: AtomicUsize,
}

#[repr(C)]
struct MrBox {
    ibv: ibv_mr,
    mr: Arc<Mr>,
    key: u32,
    dev: Arc<Device>,
}

#[repr(C)]
struct ChannelBox {
    ibv: ibv_comp_channel,
    ch: Arc<Channel>,
}

#[repr(C)]
struct CqBox {
    ibv: ibv_cq,
    cq: Arc<Cq>,
}

#[repr(C)]
struct QpBox {
    ibv: ibv_qp,
    qp: Arc<Qp>,
}

static NEXT_HANDLE: AtomicUsize = AtomicUsize::new(1);

fn handle() -> u32 {
    NEXT_HANDLE.fetch_add(1, Ordering::Relaxed) as u32
}

/// The device behind `ctx`.
///
/// # Safety
/// `ctx` came from [`ibv_open_device`] and is open.
unsafe fn ctx_box<'a>(ctx: *mut ibv_context) -> &'a CtxBox {
    // SAFETY: per the contract, `ctx` is the first field of a live `CtxBox`.
    unsafe { &*(ctx as *const CtxBox) }
}

// ---- devices ----

#[no_mangle]
unsafe extern "C" fn ibv_get_device_list(num: *mut c_int) -> *mut *mut ibv_device {
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
unsafe extern "C" fn ibv_free_device_list(list: *mut *mut ibv_device) {
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
unsafe extern "C" fn ibv_get_device_name(dev: *mut ibv_device) -> *const c_char {
    device(dev).map_or(ptr::null(), |d| d.cname.as_ptr())
}

#[no_mangle]
unsafe extern "C" fn ibv_open_device(dev: *mut ibv_device) -> *mut ibv_context {
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
unsafe extern "C" fn ibv_close_device(ctx: *mut ibv_context) -> c_int {
    // SAFETY: `ctx` came from ibv_open_device and is closed once.
    drop(unsafe { Box::from_raw(ctx as *mut CtxBox) });
    0
}

#[no_mangle]
unsafe extern "C" fn ibv_query_device(ctx: *mut ibv_context, attr: *mut ibv_device_attr) -> c_int {
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
unsafe extern "C" fn ibv_query_port(
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
unsafe extern "C" fn ibv_query_gid(
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
unsafe extern "C" fn _ibv_query_gid_ex(
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

// ---- protection domains and memory regions ----

#[no_mangle]
unsafe extern "C" fn ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
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
unsafe extern "C" fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
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
unsafe extern "C" fn ibv_reg_mr(
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
unsafe extern "C" fn ibv_reg_dmabuf_mr(
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
unsafe extern "C" fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
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

// ---- completion channels and queues ----

#[no_mangle]
unsafe extern "C" fn ibv_create_comp_channel(ctx: *mut ibv_context) -> *mut ibv_comp_channel {
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
unsafe extern "C" fn ibv_destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int {
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
unsafe extern "C" fn ibv_create_cq(
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
unsafe extern "C" fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
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
unsafe extern "C" fn ibv_get_cq_event(
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
unsafe extern "C" fn ibv_ack_cq_events(cq: *mut ibv_cq, n: u32) {
    // SAFETY: a live CQ (it cannot be destroyed before its events are acknowledged).
    let c = &unsafe { &*(cq as *const CqBox) }.cq;
    let mut u = lock(&c.unacked);
    *u = u.saturating_sub(n);
    c.acked.notify_all();
}

unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
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

unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, _solicited_only: c_int) -> c_int {
    // SAFETY: a live CQ.
    let c = &unsafe { &*(cq as *const CqBox) }.cq;
    lock(&c.state).armed = true;
    0
}

// ---- queue pairs ----

#[no_mangle]
unsafe extern "C" fn ibv_create_qp(pd: *mut ibv_pd, init: *mut ibv_qp_init_attr) -> *mut ibv_qp {
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
unsafe extern "C" fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
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
unsafe extern "C" fn ibv_modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int) -> c_int {
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

unsafe extern "C" fn post_send(
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

unsafe extern "C" fn post_recv(
    _qp: *mut ibv_qp,
    _wr: *mut c_void,
    _bad: *mut *mut c_void,
) -> c_int {
    // The fake carries RDMA WRITE and READ only; nothing consumes receives.
    libc::EOPNOTSUPP
}

// ---- async events ----

#[no_mangle]
unsafe extern "C" fn ibv_get_async_event(
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
unsafe extern "C" fn ibv_ack_async_event(event: *mut ibv_async_event) {
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

#[no_mangle]
unsafe extern "C" fn ibv_wc_status_str(status: u32) -> *const c_char {
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

// ---- the control API, for tests ----

/// Makes the next `count` work requests that QP `qpn` runs complete with `status` (an
/// `IBV_WC_*` error, e.g. 12 for `RETRY_EXC_ERR`, 13 for `RNR_RETRY_EXC_ERR`, 10 for
/// `REM_ACCESS_ERR`); the first one moves the QP to ERR. Returns 0, or `ENOENT` for an
/// unknown QP, `EINVAL` for status 0.
#[no_mangle]
extern "C" fn fakeverbs_fail(qpn: u32, status: u32, count: u32) -> c_int {
    inject(qpn, Fault::Status(status), count, status != IBV_WC_SUCCESS)
}

/// Makes the next `count` work requests that QP `qpn` runs wait `micros` µs first.
/// Returns 0, or `ENOENT` for an unknown QP.
#[no_mangle]
extern "C" fn fakeverbs_delay(qpn: u32, micros: u64, count: u32) -> c_int {
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
extern "C" fn fakeverbs_qp_fatal(qpn: u32) -> c_int {
    match nic::qp(qpn) {
        Some(q) => {
            q.to_error();
            q.event(IBV_EVENT_QP_FATAL);
            0
        }
        None => libc::ENOENT,
    }
}

/// The state (`IBV_QPS_*`) of QP `qpn`, or -1 if there is none.
#[no_mangle]
extern "C" fn fakeverbs_qp_state(qpn: u32) -> c_int {
    nic::qp(qpn).map_or(-1, |q| lock(&q.st).state as c_int)
}

/// Takes device `name`'s port down (`active` = 0) or up: every open context of it gets
/// `IBV_EVENT_PORT_ERR` or `IBV_EVENT_PORT_ACTIVE`; while down, its work requests fail
/// with `RETRY_EXC_ERR` and requests to it are dropped. Returns 0 or `ENODEV`.
#[no_mangle]
unsafe extern "C" fn fakeverbs_set_port(name: *const c_char, active: c_int) -> c_int {
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
unsafe extern "C" fn fakeverbs_fail_device(name: *const c_char, status: u32, count: u32) -> c_int {
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
unsafe extern "C" fn fakeverbs_delay_device(name: *const c_char, micros: u64, count: u32) -> c_int {
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
unsafe extern "C" fn fakeverbs_device_faults_left(name: *const c_char) -> i64 {
    named(name).map_or(-1, |d| {
        lock(&d.faults).iter().map(|(_, n)| i64::from(*n)).sum()
    })
}

/// Forgets the faults still pending on device `name`. Returns 0 or `ENODEV`.
#[no_mangle]
unsafe extern "C" fn fakeverbs_clear_faults(name: *const c_char) -> c_int {
    named(name).map_or(libc::ENODEV, |d| {
        lock(&d.faults).clear();
        0
    })
}

/// The key of device `name`'s memory region that covers `addr` (lkey and rkey are the
/// same in the fake), or 0: what a peer that guessed or stole a key would present.
#[no_mangle]
unsafe extern "C" fn fakeverbs_mr_key(name: *const c_char, addr: u64) -> u32 {
    let Some(dev) = named(name) else { return 0 };
    let mrs = dev.mrs.read().unwrap_or_else(|e| e.into_inner());
    mrs.iter()
        .find(|(_, m)| addr >= m.addr && addr < m.addr + m.len)
        .map_or(0, |(k, _)| *k)
}

/// Protection domains whose `ibv_dealloc_pd` was refused because memory regions were
/// still registered in them (a consumer that closes a device before deregistering
/// its memory; a real provider would then deregister into a closed device).
static BUSY_PDS: AtomicUsize = AtomicUsize::new(0);

/// How many `ibv_dealloc_pd` calls in this process were refused with `EBUSY`.
#[no_mangle]
extern "C" fn fakeverbs_busy_pds() -> u64 {
    BUSY_PDS.load(Ordering::Acquire) as u64
}

/// Work requests posted in this process and not yet completed or dropped.
#[no_mangle]
extern "C" fn fakeverbs_outstanding() -> u64 {
    nic::OUTSTANDING.load(Ordering::Acquire) as u64
}

#[cfg(test)]
mod tests;
