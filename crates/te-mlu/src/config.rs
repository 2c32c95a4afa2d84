//! The mlu backend's `[backends.mlu]` table.

use std::time::Duration;

use serde::Deserialize;

/// When a peer's memory is reached through IPC handles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IpcMode {
    /// Peers in other processes through IPC handles; peers in this process directly
    /// (device addresses are valid process-wide). The default.
    #[default]
    Auto,
    /// Through IPC handles even for peers in this process. For tests of the handle
    /// path with one process; real CNRT may refuse to map a handle in the process
    /// that exported it.
    Always,
}

/// The mlu backend's options.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct MluConfig {
    /// How peers' memory is reached.
    pub ipc: IpcMode,
    /// Worker threads, each with its own queue per MLU; batches run on them in
    /// parallel (1–64).
    pub workers: usize,
    /// For tests only: every batch is held this long before its copies start.
    #[serde(deserialize_with = "te_core::config::de::duration")]
    pub debug_delay: Duration,
}

impl Default for MluConfig {
    fn default() -> MluConfig {
        MluConfig {
            ipc: IpcMode::Auto,
            workers: 4,
            debug_delay: Duration::ZERO,
        }
    }
}
/// Nothing is checked here: `workers` outside 1–64 is refused only when the backend is
/// created (so `te check` lets it pass); every other value that parses works.
impl te_core::BackendConfig for MluConfig {}
