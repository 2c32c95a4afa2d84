//! te-mlu: Cambricon MLUs for te, through CNRT loaded at run time.
//!
//! Two things live here:
//!
//! - the **`mlu` device runtime** ([`MluRuntime`], memory kinds `mlu:N`): pointer
//!   queries, device and pinned host allocation, and asynchronous copies, so any
//!   backend that moves device memory through a runtime (the stub today, tcp and rdma
//!   as they gain device memory) carries `mlu:N` memory;
//! - the **`mlu` backend** ([`MluBackend`]): one-sided copies between MLU memory of
//!   engines on one host over MLU-Link, across processes through IPC handles exchanged
//!   in the handshake. Peers on other hosts are refused with a message that says to use
//!   tcp or rdma with `mlu:N` memory.
//!
//! Nothing of Neuware is needed to build: `libcnrt.so` (CNRT 6.x or newer) is loaded
//! on first use from `TE_MLU_CNRT_LIB`, `$NEUWARE_HOME/lib64`, or the system library
//! path. Without it the runtime and the backend are registered but unavailable, with
//! the reason; nothing panics. The symbols bound are listed in `docs/mlu-abi.md`.
//!
//! The runtime exists only in programs that link this crate (the facade's `mlu`
//! feature, or `extern crate te_mlu as _;`).
//!
//! # Options (`[backends.mlu]`)
//!
//! The keys are the fields of [`MluConfig`], each documented there, with their
//! defaults in its `Default`; the shipped `plugins.toml` shows every key (a test
//! keeps the two in step).
//!
//! Tests run against a FAKE libcnrt built from the C files in `csrc/`; what it cannot
//! prove is listed in `docs/mlu.md`.

#![warn(missing_debug_implementations, missing_docs, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]

use te_core::{BackendContext, BackendType, Result};

mod backend;
mod config;
mod endpoint;
mod ffi;
mod handoff;
mod peers;
mod runtime;
mod shm;
mod worker;

pub use backend::MluBackend;
pub use config::{IpcMode, MluConfig};
pub use runtime::{instance as runtime, MluRuntime, RUNTIME};

/// The mlu backend's registry name.
pub const NAME: &str = "mlu";

impl BackendType for MluBackend {
    const NAME: &'static str = NAME;
    type Config = MluConfig;

    fn probe() -> Result<()> {
        runtime::instance().map(|_| ())
    }

    fn create(config: MluConfig, ctx: &BackendContext) -> Result<Self> {
        MluBackend::new(config, ctx)
    }
}

te_core::register_backend!(MluBackend);

#[cfg(test)]
mod tests {
    use std::path::Path;

    use te_core::ErrorKind;

    use crate::ffi::Cnrt;

    /// The fake libcnrt the build script compiled; unit tests load it by default.
    pub(crate) const FAKE: &str = env!("TE_MLU_FAKE_CNRT");

    #[test]
    fn the_newest_async_copy_symbol_is_bound_and_older_libraries_fall_back() {
        let c = Cnrt::open(Path::new(FAKE)).unwrap();
        assert_eq!(c.memcpy_async_name(), "cnrtMemcpyAsync_V3");
        assert_eq!(c.version(), (6, 14, 1));
        let old = Cnrt::open(Path::new(env!("TE_MLU_FAKE_CNRT_V602"))).unwrap();
        assert_eq!(old.memcpy_async_name(), "cnrtMemcpyAsync");
        assert_eq!(old.version(), (6, 0, 2));
    }

    #[test]
    fn a_missing_symbol_makes_cnrt_unavailable_naming_it() {
        let e = Cnrt::open(Path::new(env!("TE_MLU_FAKE_CNRT_NO_IPC"))).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        assert!(
            e.to_string().contains("lacks the symbol cnrtMapMemHandle"),
            "{e}"
        );
    }

    #[test]
    fn a_missing_library_is_unavailable_naming_the_file() {
        let e = Cnrt::open(Path::new("/nonexistent/libcnrt.so")).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        assert!(e.to_string().contains("/nonexistent/libcnrt.so"), "{e}");
    }

    #[test]
    fn a_cnrt_older_than_6_is_refused_with_its_version() {
        // A library of its own (the v602 variant's copy), so other tests' loads of the
        // main fake never see the lowered version.
        let dir = std::env::temp_dir().join(format!("te-mlu-old-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("libcnrt-old.so");
        std::fs::copy(env!("TE_MLU_FAKE_CNRT_V602"), &path).unwrap();
        // SAFETY: the fake's initialisers only read environment variables.
        let lib = unsafe { libloading::Library::new(&path) }.unwrap();
        // SAFETY: the fake-only setter's prototype.
        let set: libloading::Symbol<'_, unsafe extern "C" fn(i32, i32, i32)> =
            unsafe { lib.get(b"te_fake_cnrt_set_version\0") }.unwrap();
        // SAFETY: plain call.
        unsafe { set(5, 10, 0) };
        let e = Cnrt::open(&path).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        assert!(e.to_string().contains("CNRT 5.10.0"), "{e}");
        assert!(e.to_string().contains("6.x or newer"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
