//! libibverbs, loaded at run time: the table of its functions te calls, and the calls
//! that need no open device (the device list, status text).
//!
//! The structs and constants are te's own (module `verbs`); the objects made with these
//! functions are wrapped in module `context`. The functions are resolved with
//! `dlopen("libibverbs.so.1")` instead of being linked, so the plugin loads, registers
//! and explains itself on a machine without libibverbs; the data-path calls
//! (`post_send`, `poll_cq`, `req_notify_cq`) are the provider's function pointers in
//! `ibv_context::ops`, exactly what the header's inline functions call.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

use crate::verbs as sys;
use te_core::{Error, ErrorKind, Result};

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

/// The RDMA devices present, as `ibv_get_device_list` lists them. The list is freed
/// when this is dropped; a device opened from it stays open.
pub(crate) struct DeviceList<'a> {
    v: &'a Verbs,
    list: *mut *mut sys::ibv_device,
    n: usize,
}

impl<'a> DeviceList<'a> {
    /// Lists the devices.
    ///
    /// # Errors
    /// `Unavailable` with `ibv_get_device_list`'s errno when it fails (no devices, no
    /// kernel support).
    pub(crate) fn get(v: &'a Verbs) -> Result<DeviceList<'a>> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-parameter.
        let list = unsafe { (v.ibv_get_device_list)(&mut n) };
        if list.is_null() {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!("no RDMA devices: ibv_get_device_list: {}", last_os_error()),
            ));
        }
        Ok(DeviceList {
            v,
            list,
            n: n.max(0) as usize,
        })
    }

    /// Each device with its name; a device without a name is left out.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (*mut sys::ibv_device, &CStr)> + '_ {
        (0..self.n).filter_map(|i| {
            // SAFETY: the list holds `n` valid device pointers while it is not freed.
            let dev = unsafe { *self.list.add(i) };
            // SAFETY: a valid device; the name is a C string owned by it.
            let name = unsafe { (self.v.ibv_get_device_name)(dev) };
            // SAFETY: a non-NULL name is NUL-terminated and lives as long as the list,
            // which the returned borrow of `self` cannot outlive.
            (!name.is_null()).then(|| (dev, unsafe { CStr::from_ptr(name) }))
        })
    }
}

impl Drop for DeviceList<'_> {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed once, here.
        unsafe { (self.v.ibv_free_device_list)(self.list) };
    }
}

/// The names of the RDMA devices present.
///
/// # Errors
/// `Unavailable` with the reason (no devices, no kernel support: `ibv_get_device_list`'s
/// errno).
pub(crate) fn device_names(v: &Verbs) -> Result<Vec<String>> {
    let names: Vec<String> = DeviceList::get(v)?
        .iter()
        .map(|(_, name)| name.to_string_lossy().into_owned())
        .collect();
    if names.is_empty() {
        return Err(Error::new(
            ErrorKind::Unavailable,
            "no RDMA devices: ibv_get_device_list found none (is the driver loaded? see `ibv_devices`)",
        ));
    }
    Ok(names)
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
