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
}
