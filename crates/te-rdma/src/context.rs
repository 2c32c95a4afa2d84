//! An open RDMA device and the objects made from it: [`Context`] (the device, its
//! protection domain and completion channel), [`Mr`], [`Cq`] and [`Qp`]. Each owns its
//! libibverbs object and releases it when dropped; the calls go through the function
//! table of module `ffi`.

use std::ffi::{c_int, c_void};
use std::ptr;

use te_core::{Access, Error, ErrorKind, Result};

use crate::exchange::GidType;
use crate::ffi::{last_os_error, DeviceList, Verbs};
use crate::verbs as sys;

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
        let devices = DeviceList::get(v)?;
        let found = devices
            .iter()
            .find(|(_, dn)| dn.to_bytes() == name.as_bytes());
        let ctx = match found {
            // SAFETY: a valid device from the live list; the context it opens stays
            // valid after the list is freed.
            Some((dev, _)) => unsafe { (v.ibv_open_device)(dev) },
            None => ptr::null_mut(),
        };
        drop(devices);
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
    #[cfg(feature = "cuda")]
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
