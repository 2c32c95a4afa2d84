//! The size and duration syntax of te's configuration (`64KiB`, `"250ms"`), and the
//! serde helpers that read it: a leaf, so anything configurable can use it.

use std::time::Duration;

use crate::error::{Error, ErrorKind, Result};

/// Serde helpers for backend config structs, so every table spells sizes and
/// durations the same way: `#[serde(deserialize_with = "te_core::config::de::size")]`.
pub mod de {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer};

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum SizeValue {
        Int(u64),
        Text(String),
    }

    /// A byte size: a number, or a string like `"64KiB"` ([`super::parse_size`]).
    ///
    /// # Errors
    /// The parse error, which serde places at the key.
    pub fn size<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        match SizeValue::deserialize(d)? {
            SizeValue::Int(n) => Ok(n),
            SizeValue::Text(s) => {
                super::parse_size(&s).map_err(|e| serde::de::Error::custom(e.message().to_string()))
            }
        }
    }

    /// A duration string like `"30s"` or `"250ms"` ([`super::parse_duration`]).
    ///
    /// # Errors
    /// The parse error, which serde places at the key.
    pub fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        super::parse_duration(&s).map_err(serde::de::Error::custom)
    }
}

/// Parses a human duration (`"30s"`, `"5ms"`, `"1m 30s"`).
///
/// # Errors
/// `ConfigInvalid` with the accepted forms.
pub fn parse_duration(s: &str) -> Result<Duration> {
    humantime::parse_duration(s).map_err(|e| {
        Error::new(
            ErrorKind::ConfigInvalid,
            format!("`{s}` is not a duration like \"30s\", \"250ms\" or \"1m 30s\" ({e})"),
        )
    })
}

/// Parses a byte size: `4096`, `4KiB`, `64KiB`, `1MiB`, `1GiB` (binary units), `1KB`,
/// `1MB`, `1GB` (decimal units), case-insensitive.
///
/// # Errors
/// `ConfigInvalid` with the accepted forms.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        _ => u64::MAX,
    };
    num.parse::<u64>()
        .ok()
        .filter(|_| mult != u64::MAX)
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| {
            Error::new(
                ErrorKind::ConfigInvalid,
                format!("`{s}` is not a size like 4096, 64KiB, 1MiB or 1GiB"),
            )
        })
}
