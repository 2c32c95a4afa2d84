//! te-flagcx: the FlagCX backend.
//!
//! FlagCX's point-to-point engine (`flagcx_p2p.h`) is a C++ API, so this backend talks
//! to it through a small C shim of te's own (`shim/te_flagcx_shim.h`), loaded at run
//! time: the crate builds and its backend registers on any machine, and says why it is
//! unavailable where no shim is found.
//!
//! Which shim is loaded, first match wins:
//! 1. `shim = "…"` in `[backends.flagcx]` (at create time; see the note below);
//! 2. the `TE_FLAGCX_SHIM` environment variable;
//! 3. the shim this crate's build compiled when `FLAGCX_HOME` was set;
//! 4. `libte_flagcx_shim.so` on the dynamic loader's search path.
//!
//! The probe (what `te info` shows) cannot see the configuration, so it checks 2–4;
//! a configured `shim` takes effect only where the probe found one of those.
//!
//! Every request is split into descriptors no longer than the shim's limit (FlagCX's
//! descriptor size is 32 bits), posted as one vector per operation, and completed by
//! the backend's completion thread; a transfer that finished with failed slices fails
//! its batch. The peer's region table inside a FlagCX connection is a snapshot taken at
//! connect time, so the backend opens a new connection when the peer's descriptor
//! lists regions the snapshot lacks, or the shim reports it stale; connections are
//! opened on threads of their own, never by `submit`, which parks a batch for a peer
//! still connecting. `deregister` waits for the batches in flight on the region.
//!
//! Options (`[backends.flagcx]`): see [`FlagcxConfig`]. The guide is `docs/flagcx.md`.

#![warn(missing_debug_implementations, missing_docs, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]

use std::path::{Path, PathBuf};

use te_core::{BackendContext, BackendType, Error, ErrorKind, Result};

mod backend;
mod batch;
mod config;
mod ffi;
mod peers;
mod progress;
mod regions;

pub use backend::FlagcxBackend;
pub use config::FlagcxConfig;

/// The FlagCX backend's registry name.
pub const NAME: &str = "flagcx";

/// The environment variable naming the shim library.
pub const SHIM_ENV: &str = "TE_FLAGCX_SHIM";

/// The file name looked up on the loader's search path when nothing else names a shim.
pub const SHIM_FILE: &str = "libte_flagcx_shim.so";

/// The real shim this crate's build compiled (when `FLAGCX_HOME` was set), if any.
pub const BUILT_SHIM: Option<&str> = option_env!("TE_FLAGCX_BUILT_SHIM_PATH");

/// The shim to load: the configured path, else `TE_FLAGCX_SHIM`, else the built one,
/// else [`SHIM_FILE`] for the loader to find.
fn shim_path(configured: Option<&Path>) -> PathBuf {
    if let Some(p) = configured {
        return p.to_path_buf();
    }
    if let Some(p) = std::env::var_os(SHIM_ENV).filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    PathBuf::from(BUILT_SHIM.unwrap_or(SHIM_FILE))
}

impl BackendType for FlagcxBackend {
    const NAME: &'static str = NAME;
    type Config = FlagcxConfig;

    fn probe() -> Result<()> {
        probe()
    }

    fn create(config: FlagcxConfig, _ctx: &BackendContext) -> Result<Self> {
        FlagcxBackend::new(config)
    }
}

fn probe() -> Result<()> {
    let path = shim_path(None);
    match ffi::load(&path) {
        Ok(_) => Ok(()),
        Err(e) if path.as_os_str() == SHIM_FILE => Err(Error::new(
            ErrorKind::Unavailable,
            format!(
                "no FlagCX shim: {SHIM_ENV} is unset and {SHIM_FILE} is not on the loader's search path ({e}); build it with FLAGCX_HOME=/path/to/flagcx cargo build -p te-flagcx (docs/flagcx.md)"
            ),
        )),
        Err(e) => Err(Error::from(e)),
    }
}

te_core::register_backend!(FlagcxBackend);
