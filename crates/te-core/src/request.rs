//! What a transfer names: regions and peers by id, the operation, and one request. A
//! leaf of te-core (errors only), so the descriptors, KV layouts and the backend
//! interface all build on it.

use std::fmt;
use std::str::FromStr;

use abi_stable::StableAbi;
use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};

/// Identifies a registered region within one engine's life.
#[repr(transparent)]
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, StableAbi,
)]
pub struct RegionId(pub u64);

impl fmt::Display for RegionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Identifies a connected peer within one backend instance.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, StableAbi)]
pub struct PeerId(pub u64);

/// READ pulls remote bytes into local memory; WRITE pushes local bytes to the peer.
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, StableAbi)]
pub enum Op {
    /// Copy from the peer's region into the local region.
    Read = 0,
    /// Copy from the local region into the peer's region.
    Write = 1,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Read => "read",
            Op::Write => "write",
        })
    }
}

impl FromStr for Op {
    type Err = Error;

    fn from_str(s: &str) -> Result<Op> {
        match s {
            "read" => Ok(Op::Read),
            "write" => Ok(Op::Write),
            _ => Err(Error::new(
                ErrorKind::InvalidRequest,
                format!("operation `{s}` is not `read` or `write`"),
            )),
        }
    }
}

/// One contiguous copy between a local and a remote region.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, StableAbi)]
pub struct TransferRequest {
    /// Direction.
    pub op: Op,
    /// The local region (source of a WRITE, destination of a READ).
    pub local: RegionId,
    /// Byte offset into the local region.
    pub local_offset: u64,
    /// The peer's region, from its segment descriptor.
    pub remote: RegionId,
    /// Byte offset into the peer's region.
    pub remote_offset: u64,
    /// Bytes to copy; must not be zero.
    pub len: u64,
}

impl TransferRequest {
    /// A WRITE of `len` bytes from `local[local_offset..]` to `remote[remote_offset..]`.
    pub fn write(
        local: RegionId,
        local_offset: u64,
        remote: RegionId,
        remote_offset: u64,
        len: u64,
    ) -> Self {
        TransferRequest {
            op: Op::Write,
            local,
            local_offset,
            remote,
            remote_offset,
            len,
        }
    }

    /// A READ of `len` bytes from `remote[remote_offset..]` into `local[local_offset..]`.
    pub fn read(
        local: RegionId,
        local_offset: u64,
        remote: RegionId,
        remote_offset: u64,
        len: u64,
    ) -> Self {
        TransferRequest {
            op: Op::Read,
            ..TransferRequest::write(local, local_offset, remote, remote_offset, len)
        }
    }
}

/// Whether `offset..offset + len` lies inside a region of `region_len` bytes, without
/// overflow: the range check of every request against its region (`kit::fits`).
pub fn fits(offset: u64, len: u64, region_len: u64) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= region_len)
}
