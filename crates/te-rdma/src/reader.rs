//! The little-endian reader the endpoint, key and connect-exchange formats are decoded
//! with: each read names the field it reads, so a short or over-long input is a
//! `Protocol` error saying where it ended.

use te_core::{Error, ErrorKind, Result};

/// A `Protocol` error about `what` (the format being decoded).
pub(crate) fn protocol(what: &str, m: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Protocol, format!("rdma {what}: {m}"))
}

/// A little-endian reader that fails with the name of what it was reading.
pub(crate) struct Reader<'a> {
    /// The bytes not read yet.
    pub(crate) b: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// A reader of `b`, whose errors name `what`.
    pub(crate) fn new(b: &'a [u8], what: &'static str) -> Reader<'a> {
        Reader { b, what }
    }
    /// Reads a one-byte version, refusing any but `expected`.
    pub(crate) fn version(&mut self, expected: u8) -> Result<()> {
        let version = self.u8("version")?;
        if version != expected {
            return Err(protocol(
                self.what,
                format!("version {version}, this build understands {expected}"),
            ));
        }
        Ok(())
    }
    pub(crate) fn take<const N: usize>(&mut self, field: &str) -> Result<[u8; N]> {
        let (head, rest) = self
            .b
            .split_first_chunk::<N>()
            .ok_or_else(|| protocol(self.what, format!("truncated at {field}")))?;
        self.b = rest;
        Ok(*head)
    }
    pub(crate) fn u8(&mut self, field: &str) -> Result<u8> {
        Ok(self.take::<1>(field)?[0])
    }
    pub(crate) fn u16(&mut self, field: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(field)?))
    }
    pub(crate) fn u32(&mut self, field: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(field)?))
    }
    pub(crate) fn u64(&mut self, field: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(field)?))
    }
    pub(crate) fn bytes(&mut self, n: usize, field: &str) -> Result<&'a [u8]> {
        if self.b.len() < n {
            return Err(protocol(self.what, format!("truncated at {field}")));
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }
    pub(crate) fn end(&self) -> Result<()> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(protocol(
                self.what,
                format!("{} unexpected trailing bytes", self.b.len()),
            ))
        }
    }
}
