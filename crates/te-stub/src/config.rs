//! The stub's `[backends.stub]` table.

use std::time::Duration;

use serde::{Deserialize, Deserializer};

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
    #[serde(deserialize_with = "duration")]
    pub delay: Duration,
}

fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let s = String::deserialize(d)?;
    te_core::config::parse_duration(&s).map_err(serde::de::Error::custom)
}
