//! libibverbs, loaded at run time, and owning wrappers around its objects.
//!
//! The structs and constants are te's own (module `verbs`). The functions are resolved
//! with `dlopen("libibverbs.so.1")` instead of being linked, so the plugin loads,
//! registers and explains itself on a machine without libibverbs; the data-path calls (`post_send`, `poll_cq`, `req_notify_cq`) are the
//! provider's function pointers in `ibv_context::ops`, exactly what the header's inline
//! functions call.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr;
use std::sync::OnceLock;

use crate::verbs as sys;
use te_core::{Access, Error, ErrorKind, Result};

use crate::exchange::GidType;

/// The file names tried, in order.
pub(crate) const LIBRARIES: [&str; 2] = ["libibverbs.so.1", "libibverbs.so"];

macro_rules! verbs_table {
    ($($name:ident : fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        /// The libibverbs functions te calls, resolved by name.
        #[allow(non_snake_case)]
        pub(crate) struct Verbs {
            $(pub(crate) $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?,)*
            /// `ibv_reg_dmabuf_mr` (rdma-core 34 and later); `None` on older libraries.
            pub(crate) ibv_reg_dmabuf_mr: Option<
                unsafe extern "C" fn(*mut sys::ibv_pd, u64, usize, u64, c_int, c_int) -> *mut sys::ibv_mr,
            >,
            /// `_ibv_query_gid_ex` (rdma-core 32 and later), which reports each GID's
            /// type; `None` on older libraries (sysfs says the type there).
            pub(crate) ibv_query_gid_ex: Option<QueryGidEx>,
        }

        impl Verbs {
            /// Resolves every function from `handle`.
            ///
            /// # Safety
            /// `handle` is a live `dlopen` handle of libibverbs.
            unsafe fn resolve(handle: *mut c_void) -> std::result::Result<Verbs, String> {
                Ok(Verbs {
                    $($name: {
                        // SAFETY: the caller passes a live handle; the name is a C string.
                        let p = unsafe { libc::dlsym(handle, concat!(stringify!($name), "\0").as_ptr().cast()) };
                        if p.is_null() {
                            return Err(format!("libibverbs lacks {}", stringify!($name)));
                        }
                        // SAFETY: the symbol is libibverbs' function of this name, whose C
                        // signature the bindings (and this table) spell out.
                        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) $(-> $ret)?>(p) }
                    },)*
                    ibv_query_gid_ex: {
                        // SAFETY: as above.
                        let p = unsafe { libc::dlsym(handle, c"_ibv_query_gid_ex".as_ptr()) };
                        // SAFETY: as above; a null pointer stays `None`.
                        (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, QueryGidEx>(p) })
                    },
                    ibv_reg_dmabuf_mr: {
                        // SAFETY: as above.
                        let p = unsafe { libc::dlsym(handle, c"ibv_reg_dmabuf_mr".as_ptr()) };
                        // SAFETY: as above; a null pointer stays `None`.
                        (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn(*mut sys::ibv_pd, u64, usize, u64, c_int, c_int) -> *mut sys::ibv_mr>(p) })
                    },
                })
            }
        }
    };
}

/// `_ibv_query_gid_ex(context, port, index, entry, flags, entry_size)`.
type QueryGidEx = unsafe extern "C" fn(
    *mut sys::ibv_context,
    u32,
    u32,
    *mut sys::ibv_gid_entry,
    u32,
    usize,
) -> c_int;

verbs_table! {
    ibv_get_device_list: fn(*mut c_int) -> *mut *mut sys::ibv_device;
    ibv_free_device_list: fn(*mut *mut sys::ibv_device);
    ibv_get_device_name: fn(*mut sys::ibv_device) -> *const c_char;
    ibv_open_device: fn(*mut sys::ibv_device) -> *mut sys::ibv_context;
    ibv_close_device: fn(*mut sys::ibv_context) -> c_int;
    ibv_query_device: fn(*mut sys::ibv_context, *mut sys::ibv_device_attr) -> c_int;
    ibv_query_port: fn(*mut sys::ibv_context, u8, *mut sys::ibv_port_attr) -> c_int;
    ibv_query_gid: fn(*mut sys::ibv_context, u8, c_int, *mut sys::ibv_gid) -> c_int;
    ibv_alloc_pd: fn(*mut sys::ibv_context) -> *mut sys::ibv_pd;
    ibv_dealloc_pd: fn(*mut sys::ibv_pd) -> c_int;
    ibv_reg_mr: fn(*mut sys::ibv_pd, *mut c_void, usize, c_int) -> *mut sys::ibv_mr;
    ibv_dereg_mr: fn(*mut sys::ibv_mr) -> c_int;
    ibv_create_comp_channel: fn(*mut sys::ibv_context) -> *mut sys::ibv_comp_channel;
    ibv_destroy_comp_channel: fn(*mut sys::ibv_comp_channel) -> c_int;
    ibv_create_cq: fn(*mut sys::ibv_context, c_int, *mut c_void, *mut sys::ibv_comp_channel, c_int) -> *mut sys::ibv_cq;
    ibv_destroy_cq: fn(*mut sys::ibv_cq) -> c_int;
    ibv_get_cq_event: fn(*mut sys::ibv_comp_channel, *mut *mut sys::ibv_cq, *mut *mut c_void) -> c_int;
    ibv_ack_cq_events: fn(*mut sys::ibv_cq, u32);
    ibv_create_qp: fn(*mut sys::ibv_pd, *mut sys::ibv_qp_init_attr) -> *mut sys::ibv_qp;
    ibv_modify_qp: fn(*mut sys::ibv_qp, *mut sys::ibv_qp_attr, c_int) -> c_int;
    ibv_destroy_qp: fn(*mut sys::ibv_qp) -> c_int;
    ibv_wc_status_str: fn(u32) -> *const c_char;
    ibv_get_async_event: fn(*mut sys::ibv_context, *mut sys::ibv_async_event) -> c_int;
    ibv_ack_async_event: fn(*mut sys::ibv_async_event);
}

impl std::fmt::Debug for Verbs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verbs")
            .field("dmabuf", &self.ibv_reg_dmabuf_mr.is_some())
            .finish()
    }
}

/// Opens the first of `names` that loads and resolves every function.
///
/// # Errors
/// `Unavailable`, naming each file tried and why it failed.
pub(crate) fn load(names: &[&str]) -> Result<Verbs> {
    let mut why = Vec::new();
    for name in names {
        let c = CString::new(*name).map_err(|_| Error::new(ErrorKind::Unavailable, "bad name"))?;
        // SAFETY: dlopen with a valid C string; libibverbs has no unsafe initialisers.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            // SAFETY: dlerror returns a thread-local C string or null.
            let e = unsafe { libc::dlerror() };
            let e = if e.is_null() {
                "not found".to_string()
            } else {
                // SAFETY: non-null dlerror strings are valid C strings.
                unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
            };
            why.push(e);
            continue;
        }
        // SAFETY: `handle` is live and is never closed (libraries stay loaded).
        match unsafe { Verbs::resolve(handle) } {
            Ok(v) => return Ok(v),
            Err(e) => why.push(format!("{name}: {e}")),
        }
    }
    Err(Error::new(
        ErrorKind::Unavailable,
        format!(
            "libibverbs not found ({}); install rdma-core's libibverbs1 (Debian/Ubuntu) or rdma-core (RHEL)",
            why.join("; ")
        ),
    ))
}

static VERBS: OnceLock<Result<Verbs>> = OnceLock::new();

/// The process's libibverbs.
///
/// # Errors
/// `Unavailable` if it cannot be loaded.
pub(crate) fn verbs() -> Result<&'static Verbs> {
    VERBS
        .get_or_init(|| match std::env::var(crate::VERBS_LIB_ENV) {
            Ok(path) if !path.is_empty() => load(&[path.as_str()]).map_err(|e| {
                Error::new(
                    ErrorKind::Unavailable,
                    format!("{}={path}: {}", crate::VERBS_LIB_ENV, e.message()),
                )
            }),
            _ => load(&LIBRARIES),
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// `errno` as an `io::Error`.
pub(crate) fn last_os_error() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// The status text of a work completion status (`IBV_WC_REM_ACCESS_ERR` reads
/// "remote access error").
pub(crate) fn status_text(v: &Verbs, status: u32) -> String {
    // SAFETY: ibv_wc_status_str returns a static string for any value.
    let p = unsafe { (v.ibv_wc_status_str)(status) };
    if p.is_null() {
        return format!("status {status}");
    }
    // SAFETY: a static, NUL-terminated string.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The names of the RDMA devices present.
///
/// # Errors
/// `Unavailable` with the reason (no devices, no kernel support: `ibv_get_device_list`'s
/// errno).
pub(crate) fn device_names(v: &Verbs) -> Result<Vec<String>> {
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-parameter.
    let list = unsafe { (v.ibv_get_device_list)(&mut n) };
    if list.is_null() {
        return Err(Error::new(
            ErrorKind::Unavailable,
            format!("no RDMA devices: ibv_get_device_list: {}", last_os_error()),
        ));
    }
    let mut names = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` valid device pointers.
        let dev = unsafe { *list.add(i) };
        // SAFETY: a valid device; the name is a C string owned by it.
        let name = unsafe { (v.ibv_get_device_name)(dev) };
        if !name.is_null() {
            // SAFETY: as above.
            names.push(
                unsafe { CStr::from_ptr(name) }
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
    // SAFETY: the list came from ibv_get_device_list and is freed once.
    unsafe { (v.ibv_free_device_list)(list) };
    if names.is_empty() {
        return Err(Error::new(
            ErrorKind::Unavailable,
            "no RDMA devices: ibv_get_device_list found none (is the driver loaded? see `ibv_devices`)",
        ));
    }
    Ok(names)
}

/// An open device with its protection domain and completion channel.
pub(crate) struct Context {
    pub(crate) v: &'static Verbs,
    pub(crate) ctx: *mut sys::ibv_context,
    pub(crate) pd: *mut sys::ibv_pd,
    pub(crate) channel: *mut sys::ibv_comp_channel,
    pub(crate) attr: sys::ibv_device_attr,
}

// SAFETY: verbs objects may be used from any thread; libibverbs serialises internally
// where the specification requires it, and QP posting is serialised by te's own locks.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("ctx", &self.ctx).finish()
    }
}

fn backend_err(what: &str) -> Error {
    Error::new(
        ErrorKind::Backend,
        format!("{what} failed: {}", last_os_error()),
    )
}

impl Context {
    /// Opens device `name`.
    ///
    /// # Errors
    /// `Unavailable` if it is not there; `Backend` if a verbs call fails.
    pub(crate) fn open(v: &'static Verbs, name: &str) -> Result<Context> {
        let mut n: c_int = 0;
        // SAFETY: valid out-parameter.
        let list = unsafe { (v.ibv_get_device_list)(&mut n) };
        if list.is_null() {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!("no RDMA devices: ibv_get_device_list: {}", last_os_error()),
            ));
        }
        let mut ctx = ptr::null_mut();
        for i in 0..n.max(0) as usize {
            // SAFETY: the list holds `n` valid device pointers with C-string names.
            let dev = unsafe { *list.add(i) };
            // SAFETY: as above.
            let dn = unsafe { (v.ibv_get_device_name)(dev) };
            // SAFETY: as above.
            if !dn.is_null() && unsafe { CStr::from_ptr(dn) }.to_bytes() == name.as_bytes() {
                // SAFETY: a valid device from the live list.
                ctx = unsafe { (v.ibv_open_device)(dev) };
                break;
            }
        }
        // SAFETY: freed once; opened contexts stay valid after the list is freed.
        unsafe { (v.ibv_free_device_list)(list) };
        if ctx.is_null() {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!(
                    "RDMA device {name} not found or cannot be opened: {}",
                    last_os_error()
                ),
            ));
        }
        let mut c = Context {
            v,
            ctx,
            pd: ptr::null_mut(),
            channel: ptr::null_mut(),
            attr: sys::ibv_device_attr::default(),
        };
        // SAFETY: a live context and a valid out-parameter.
        if unsafe { (v.ibv_query_device)(ctx, &mut c.attr) } != 0 {
            return Err(backend_err("ibv_query_device"));
        }
        // SAFETY: a live context.
        c.pd = unsafe { (v.ibv_alloc_pd)(ctx) };
        if c.pd.is_null() {
            return Err(backend_err("ibv_alloc_pd"));
        }
        // SAFETY: a live context.
        c.channel = unsafe { (v.ibv_create_comp_channel)(ctx) };
        if c.channel.is_null() {
            return Err(backend_err("ibv_create_comp_channel"));
        }
        // SAFETY: the channel and the context are live; their fds are owned by them.
        // Non-blocking, so the completion and event threads wait in poll(2) together
        // with their stop pipe, and take events until EAGAIN.
        unsafe {
            for fd in [(*c.channel).fd, (*ctx).async_fd] {
                let flags = libc::fcntl(fd, libc::F_GETFL);
                libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
            }
        }
        Ok(c)
    }

    /// The context's async event fd.
    pub(crate) fn async_fd(&self) -> c_int {
        // SAFETY: the context lives as long as `self`.
        unsafe { (*self.ctx).async_fd }
    }

    /// How many completion vectors the device has (at least 1).
    pub(crate) fn comp_vectors(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.ctx).num_comp_vectors }.max(1) as u32
    }

    /// GID `index` of `port` with its type: from `_ibv_query_gid_ex` where libibverbs
    /// has it, else from `ibv_query_gid` and the type sysfs names (`RoCE v2`,
    /// `IB/RoCE v1`) for device `name`. `None` for an empty or unreadable entry.
    pub(crate) fn gid_entry(
        &self,
        name: &str,
        port: u8,
        index: u8,
    ) -> Option<([u8; 16], Option<GidType>)> {
        if let Some(f) = self.v.ibv_query_gid_ex {
            let mut e = sys::ibv_gid_entry::default();
            // SAFETY: a live context and an out-parameter of the size passed.
            let rc = unsafe {
                f(
                    self.ctx,
                    u32::from(port),
                    u32::from(index),
                    &mut e,
                    0,
                    std::mem::size_of::<sys::ibv_gid_entry>(),
                )
            };
            if rc != 0 {
                return None;
            }
            let kind = match e.gid_type {
                sys::IBV_GID_TYPE_ROCE_V2 => Some(GidType::RoceV2),
                sys::IBV_GID_TYPE_ROCE_V1 => Some(GidType::RoceV1),
                sys::IBV_GID_TYPE_IB => Some(GidType::InfiniBand),
                _ => None,
            };
            // SAFETY: every bit pattern is a valid `raw`.
            return Some((unsafe { e.gid.raw }, kind));
        }
        let gid = self.gid(port, index).ok()?;
        let kind = std::fs::read_to_string(format!(
            "/sys/class/infiniband/{name}/ports/{port}/gid_attrs/types/{index}"
        ))
        .ok()
        .and_then(|t| {
            if t.contains("v2") {
                Some(GidType::RoceV2)
            } else if t.contains("v1") {
                Some(GidType::RoceV1)
            } else {
                None
            }
        });
        Some((gid, kind))
    }

    /// The completion channel's file descriptor.
    pub(crate) fn channel_fd(&self) -> c_int {
        // SAFETY: the channel lives as long as `self`.
        unsafe { (*self.channel).fd }
    }

    /// Port attributes.
    ///
    /// # Errors
    /// `Backend` if the query fails.
    pub(crate) fn port(&self, port: u8) -> Result<sys::ibv_port_attr> {
        let mut attr = sys::ibv_port_attr::default();
        // SAFETY: the exported ibv_query_port writes the (smaller) compat layout, a
        // prefix of ibv_port_attr; the rest stays zeroed.
        if unsafe { (self.v.ibv_query_port)(self.ctx, port, &mut attr) } != 0 {
            return Err(backend_err("ibv_query_port"));
        }
        Ok(attr)
    }

    /// GID `index` of `port`.
    ///
    /// # Errors
    /// `Backend` if the query fails.
    pub(crate) fn gid(&self, port: u8, index: u8) -> Result<[u8; 16]> {
        let mut gid = sys::ibv_gid::default();
        // SAFETY: valid out-parameter.
        if unsafe { (self.v.ibv_query_gid)(self.ctx, port, c_int::from(index), &mut gid) } != 0 {
            return Err(backend_err("ibv_query_gid"));
        }
        // SAFETY: every bit pattern is a valid `raw`.
        Ok(unsafe { gid.raw })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every QP, CQ and MR of this context is gone: the backend's `Drop`
        // drops its paths (QPs, CQs) and regions (MRs) before its devices. Each object
        // is destroyed once, children first.
        unsafe {
            if !self.channel.is_null() {
                (self.v.ibv_destroy_comp_channel)(self.channel);
            }
            if !self.pd.is_null() {
                (self.v.ibv_dealloc_pd)(self.pd);
            }
            (self.v.ibv_close_device)(self.ctx);
        }
    }
}

/// A registered memory region.
pub(crate) struct Mr {
    pub(crate) v: &'static Verbs,
    pub(crate) mr: *mut sys::ibv_mr,
}

// SAFETY: an MR handle is usable from any thread.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl std::fmt::Debug for Mr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mr")
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .finish()
    }
}

impl Mr {
    /// The local key.
    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: the MR is live.
        unsafe { (*self.mr).lkey }
    }
    /// The remote key.
    pub(crate) fn rkey(&self) -> u32 {
        // SAFETY: the MR is live.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: deregistered once.
        unsafe { (self.v.ibv_dereg_mr)(self.mr) };
    }
}

/// The access rights a region is registered with: LOCAL_WRITE always (the NIC writes
/// the destination of our READs), REMOTE_READ and REMOTE_WRITE only when the region
/// grants them, so the NIC itself refuses a peer the region does not allow, whatever
/// key the peer presents.
pub(crate) fn mr_access(access: Access) -> c_int {
    let mut a = sys::IBV_ACCESS_LOCAL_WRITE;
    if access.remote_read {
        a |= sys::IBV_ACCESS_REMOTE_READ;
    }
    if access.remote_write {
        a |= sys::IBV_ACCESS_REMOTE_WRITE;
    }
    a
}

impl Context {
    /// Registers `len` bytes at `addr` (host memory, or device memory through
    /// nvidia-peermem).
    ///
    /// # Errors
    /// `Backend` with the errno.
    pub(crate) fn reg_mr(&self, addr: u64, len: u64, access: Access) -> Result<Mr> {
        // SAFETY: the caller registered this memory with the engine, which keeps it
        // alive until deregistration drops the MR.
        let mr = unsafe {
            (self.v.ibv_reg_mr)(
                self.pd,
                addr as *mut c_void,
                len as usize,
                mr_access(access),
            )
        };
        if mr.is_null() {
            return Err(backend_err("ibv_reg_mr"));
        }
        Ok(Mr { v: self.v, mr })
    }

    /// Registers a DMA-BUF: `len` bytes at `offset` into `fd`, addressed as `iova`.
    ///
    /// # Errors
    /// `Unsupported` if libibverbs is too old; `Backend` with the errno.
    pub(crate) fn reg_dmabuf_mr(
        &self,
        fd: c_int,
        offset: u64,
        len: u64,
        iova: u64,
        access: Access,
    ) -> Result<Mr> {
        let f = self.v.ibv_reg_dmabuf_mr.ok_or_else(|| {
            Error::new(
                ErrorKind::Unsupported,
                "libibverbs has no ibv_reg_dmabuf_mr (rdma-core 34 or later is needed)",
            )
        })?;
        // SAFETY: `fd` is a live DMA-BUF the caller owns for the duration of the call.
        let mr = unsafe { f(self.pd, offset, len as usize, iova, fd, mr_access(access)) };
        if mr.is_null() {
            return Err(backend_err("ibv_reg_dmabuf_mr"));
        }
        Ok(Mr { v: self.v, mr })
    }

    /// A completion queue of `entries` entries reporting to this context's channel
    /// (`channel`) or to none, on completion vector `tag % comp_vectors` (spreading
    /// CQs over the device's interrupt vectors); `tag` comes back with its events.
    ///
    /// # Errors
    /// `Backend` with the errno.
    pub(crate) fn create_cq(&self, entries: u32, tag: u64, channel: bool) -> Result<Cq> {
        let vector = (tag % u64::from(self.comp_vectors())) as c_int;
        // SAFETY: a live context (and channel); `tag` is an opaque value, never
        // dereferenced.
        let cq = unsafe {
            (self.v.ibv_create_cq)(
                self.ctx,
                entries as c_int,
                tag as usize as *mut c_void,
                if channel {
                    self.channel
                } else {
                    ptr::null_mut()
                },
                vector,
            )
        };
        if cq.is_null() {
            return Err(backend_err("ibv_create_cq"));
        }
        Ok(Cq { v: self.v, cq })
    }

    /// An RC QP on `cq` holding `max_send_wr` work requests; `tag` comes back in its
    /// async events (`qp_context`).
    ///
    /// # Errors
    /// `Backend` with the errno.
    pub(crate) fn create_qp(&self, cq: &Cq, max_send_wr: u32, tag: u64) -> Result<Qp> {
        let mut init = sys::ibv_qp_init_attr {
            qp_context: tag as usize as *mut c_void,
            send_cq: cq.cq,
            recv_cq: cq.cq,
            qp_type: sys::IBV_QPT_RC,
            sq_sig_all: 0,
            ..Default::default()
        };
        init.cap.max_send_wr = max_send_wr;
        init.cap.max_recv_wr = 1;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        // SAFETY: a live PD and CQ; a valid init attribute.
        let qp = unsafe { (self.v.ibv_create_qp)(self.pd, &mut init) };
        if qp.is_null() {
            return Err(backend_err("ibv_create_qp"));
        }
        Ok(Qp { v: self.v, qp })
    }
}

/// A completion queue.
pub(crate) struct Cq {
    v: &'static Verbs,
    pub(crate) cq: *mut sys::ibv_cq,
}

// SAFETY: a CQ may be polled from any thread; te polls each from one thread at a time.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    /// Asks for an event on the next completion.
    pub(crate) fn arm(&self) -> c_int {
        // SAFETY: the CQ is live; `ops.req_notify_cq` is what ibv_req_notify_cq calls.
        unsafe {
            match (*(*self.cq).context).ops.req_notify_cq {
                Some(f) => f(self.cq, 0),
                None => libc::ENOSYS,
            }
        }
    }

    /// Polls up to `wc.len()` completions; returns how many, or a negative value.
    pub(crate) fn poll(&self, wc: &mut [sys::ibv_wc]) -> c_int {
        // SAFETY: the CQ is live; `wc` has room for `len` entries of `struct ibv_wc`'s
        // layout. `ops.poll_cq` is what ibv_poll_cq calls.
        unsafe {
            match (*(*self.cq).context).ops.poll_cq {
                Some(f) => f(self.cq, wc.len() as c_int, wc.as_mut_ptr().cast()),
                None => -1,
            }
        }
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: every event of this CQ was acknowledged when it was taken; the QPs
        // using it are destroyed first (they are dropped before their CQ).
        unsafe { (self.v.ibv_destroy_cq)(self.cq) };
    }
}

impl std::fmt::Debug for Cq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cq").finish_non_exhaustive()
    }
}

/// A queue pair.
pub(crate) struct Qp {
    v: &'static Verbs,
    pub(crate) qp: *mut sys::ibv_qp,
}

// SAFETY: a QP may be used from any thread; posting is serialised by the path's lock.
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

impl std::fmt::Debug for Qp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qp").field("qpn", &self.qpn()).finish()
    }
}

impl Qp {
    /// The QP number.
    pub(crate) fn qpn(&self) -> u32 {
        // SAFETY: the QP is live.
        unsafe { (*self.qp).qp_num }
    }

    /// Applies a state transition.
    ///
    /// # Errors
    /// `Backend` naming the target state and the errno.
    pub(crate) fn modify(&self, mut t: crate::qp::Transition, state: &str) -> Result<()> {
        // SAFETY: a live QP and a fully initialised attribute.
        let rc = unsafe { (self.v.ibv_modify_qp)(self.qp, &mut t.attr, t.mask) };
        if rc != 0 {
            return Err(Error::new(
                ErrorKind::Backend,
                format!(
                    "ibv_modify_qp to {state} failed: {}",
                    std::io::Error::from_raw_os_error(rc)
                ),
            ));
        }
        Ok(())
    }

    /// Posts a chain of work requests. On a refusal returns the provider's errno and how
    /// many work requests of the chain were posted before the one it refused (those
    /// will complete as usual).
    ///
    /// # Safety
    /// `wr` heads a valid chain whose scatter-gather entries name registered memory that
    /// stays registered until the work requests complete.
    pub(crate) unsafe fn post_send(
        &self,
        wr: *mut sys::ibv_send_wr,
    ) -> std::result::Result<(), (c_int, usize)> {
        let mut bad = ptr::null_mut();
        // SAFETY: forwarded from the caller; `ops.post_send` is what ibv_post_send calls.
        let rc = unsafe {
            match (*(*self.qp).context).ops.post_send {
                Some(f) => f(self.qp, wr, &mut bad),
                None => libc::ENOSYS,
            }
        };
        if rc == 0 {
            return Ok(());
        }
        let mut posted = 0;
        let mut cur = wr;
        while !cur.is_null() && cur != bad {
            posted += 1;
            // SAFETY: walking the caller's valid chain.
            cur = unsafe { (*cur).next };
        }
        // Without a bad_wr every request counts as posted: waiting for completions
        // that never come only delays, while retrying a request the NIC still runs
        // could let its batch complete under a live DMA.
        Err((rc, posted))
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: destroyed once.
        unsafe { (self.v.ibv_destroy_qp)(self.qp) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_unavailable_with_the_names_tried() {
        let e = load(&["libibverbs-te-test-missing.so.1"]).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        assert!(e.to_string().contains("libibverbs not found"), "{e}");
        assert!(e.to_string().contains("libibverbs-te-test-missing"), "{e}");
    }

    #[test]
    fn a_library_without_the_verbs_is_refused_by_the_missing_symbol() {
        let e = load(&["libc.so.6"]).unwrap_err();
        assert!(e.to_string().contains("lacks ibv_get_device_list"), "{e}");
    }
}
