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
impl te_core::BackendConfig for MluConfig {
    /// Refuses `workers` outside 1–64 (every other value that parses works), so `te
    /// check` refuses it too, without creating the backend.
    ///
    /// # Errors
    /// `ConfigInvalid`, naming the key and the range.
    fn validate(&self) -> te_core::Result<()> {
        if !(1..=64).contains(&self.workers) {
            return Err(te_core::Error::new(
                te_core::ErrorKind::ConfigInvalid,
                format!(
                    "[backends.mlu] workers = {} is outside 1..=64",
                    self.workers
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use te_core::Config;

    #[test]
    fn workers_outside_1_to_64_are_refused_by_the_table_check_alone() {
        let check = |text: &str| {
            let c = Config::from_toml(text, "t.toml", std::path::Path::new(".")).unwrap();
            te_core::registry::check_table::<crate::MluBackend>(&c.backend_context("mlu"))
        };
        for bad in [0, 65] {
            let e = check(&format!("[backends.mlu]\nworkers = {bad}\n")).unwrap_err();
            assert!(e.message().contains("1..=64"), "{e}");
        }
        check("[backends.mlu]\nworkers = 64\n").unwrap();
    }
}
