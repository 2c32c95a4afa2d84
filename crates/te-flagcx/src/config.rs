//! The FlagCX backend's `[backends.flagcx]` table.

use std::path::PathBuf;

use serde::Deserialize;

/// The FlagCX backend's options.
///
/// ```toml
/// [backends.flagcx]
/// shim = "/opt/te/lib/libte_flagcx_shim.so"  # else TE_FLAGCX_SHIM, else the built one
/// shim_options = ""                           # handed to the shim's engine
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct FlagcxConfig {
    /// The shim library to load. Unset: `TE_FLAGCX_SHIM`, then the shim this crate
    /// built when `FLAGCX_HOME` was set, then `libte_flagcx_shim.so` on the loader's
    /// search path.
    pub shim: Option<PathBuf>,
    /// Options for the shim's engine, `key=value` pairs separated by commas, which the
    /// shim interprets (the real shim: `max_desc`, `memory`; the fake: see
    /// `fake/fake_shim.c`). Default: none.
    pub shim_options: String,
}
/// Every value that parses works: nothing more to check.
impl te_core::BackendConfig for FlagcxConfig {}
