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

/// The units [`parse_size`] accepts, as its errors list them.
const SIZE_UNITS: &str = "B, KiB, MiB, GiB (also K, M, G) or KB, MB, GB";

/// Parses a byte size: `4096`, `4KiB`, `64KiB`, `1MiB`, `1GiB` (binary units), `1KB`,
/// `1MB`, `1GB` (decimal units), case-insensitive; at most `u64::MAX` bytes.
///
/// # Errors
/// `ConfigInvalid` saying what was wrong (no whole number, an unknown unit, too large)
/// and what to write instead.
pub fn parse_size(s: &str) -> Result<u64> {
    let invalid = |why: String| Error::new(ErrorKind::ConfigInvalid, format!("`{s}`: {why}"));
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim();
    if num.is_empty() || unit.starts_with('.') {
        return Err(invalid(format!(
            "a size is a whole number of bytes with an optional unit ({SIZE_UNITS}), \
             like 4096, 64KiB or 1536MiB"
        )));
    }
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        _ => {
            return Err(invalid(format!(
                "unknown unit `{unit}`; write the size in {SIZE_UNITS}, like 64KiB or 1GiB"
            )))
        }
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| {
            invalid(format!(
                "too large: the largest size is {} bytes (16 EiB less one byte); \
                 write a smaller size",
                u64::MAX
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(s: &str) -> String {
        parse_size(s).unwrap_err().message().to_string()
    }

    #[test]
    fn an_unknown_unit_is_named_with_the_units_accepted() {
        let e = err("16EiB");
        assert!(e.contains("unknown unit `EiB`"), "{e}");
        for unit in ["KiB", "MiB", "GiB", "KB", "MB", "GB"] {
            assert!(e.contains(unit), "{e} lacks {unit}");
        }
    }

    #[test]
    fn a_size_too_large_names_the_largest() {
        for big in ["20000000000GiB", "99999999999999999999"] {
            let e = err(big);
            assert!(e.contains("too large"), "{e}");
            assert!(e.contains(&u64::MAX.to_string()), "{e}");
        }
        assert_eq!(parse_size(&u64::MAX.to_string()).unwrap(), u64::MAX);
    }

    #[test]
    fn a_size_without_a_number_says_so() {
        for bad in ["", "KiB", "-1"] {
            let e = err(bad);
            assert!(e.contains("whole number of bytes"), "{bad}: {e}");
        }
        let e = err("1.5MiB");
        assert!(e.contains("whole number"), "{e}");
    }
}
