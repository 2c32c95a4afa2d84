//! The stub's `[backends.stub]` table.

use std::time::Duration;

use serde::Deserialize;

/// Whether batches move bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Copy the bytes (default).
    #[default]
    Copy,
    /// Check and complete requests without moving bytes.
    Noop,
}

/// The stub's options.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct StubConfig {
    /// Copy bytes, or only complete.
    pub mode: Mode,
    /// Fail every Nth batch with an injected `Backend` error; 0 never fails.
    pub fail_every: u64,
    /// Complete each batch no sooner than this after submission.
    #[serde(deserialize_with = "te_core::config::de::duration")]
    pub delay: Duration,
    /// Play a fabric that cannot stop: an aborted batch (deadline, cancel) still moves
    /// all its data when it is due, late, and only then is released. The engine must
    /// keep the batch's handle unresolved until then.
    pub ignore_abort: bool,
    /// Run batches that are due newest first, and a batch's requests last first, so
    /// completions come out of submission order.
    pub reorder: bool,
    /// Every Nth batch moves about half of its bytes, then fails with a `Backend`
    /// error; 0 never.
    pub fail_partway_every: u64,
    /// Every Nth batch fails with `PeerRestarted`, as if the peer had restarted under
    /// it, and the stub forgets the peer until it is connected again; 0 never.
    pub restart_every: u64,
}
/// Every value that parses works: nothing more to check.
impl te_core::BackendConfig for StubConfig {}
