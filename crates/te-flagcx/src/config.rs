//! The FlagCX backend's `[backends.flagcx]` table.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

/// The FlagCX backend's options.
///
/// ```toml
/// [backends.flagcx]
/// shim = "/opt/te/lib/libte_flagcx_shim.so"  # else TE_FLAGCX_SHIM, else the built one
/// shim_options = ""                           # handed to the shim's engine
/// max_poll_interval = "1ms"                   # longest pause between status queries
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
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
    /// While transfers are in flight, the completion thread queries them again after
    /// a pause that starts at a few microseconds and doubles up to this. Default 1 ms.
    #[serde(deserialize_with = "te_core::config::de::duration")]
    pub max_poll_interval: Duration,
}

impl Default for FlagcxConfig {
    fn default() -> Self {
        FlagcxConfig {
            shim: None,
            shim_options: String::new(),
            max_poll_interval: Duration::from_millis(1),
        }
    }
}
