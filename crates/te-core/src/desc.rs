//! Descriptor types: memory, regions, segments, requests, backend capabilities.
//!
//! These are the nouns every backend and the control plane share. The ones that
//! cross the plugin boundary by value ([`TransferRequest`], [`RegionId`], [`PeerId`],
//! [`Op`]) are `#[repr(C)]` plain data with a checked layout; the rest cross it
//! encoded, like they cross the wire.

use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize};

use crate::error::{Error, ErrorKind, Result};
pub use crate::request::{Op, PeerId, RegionId, TransferRequest};

/// Where a region's bytes live.
///
/// Written `host`, `RUNTIME:ORDINAL` for device memory (`cuda:0`, `mlu:1`), or `auto`.
/// The runtime is a name, not a closed list, so a new device runtime needs no change
/// here.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MemoryKind {
    /// Ordinary host memory.
    Host,
    /// Memory of device `ordinal` of a device runtime.
    Device {
        /// The device runtime's name (`cuda`, `mlu`).
        runtime: String,
        /// The device's ordinal within that runtime.
        ordinal: u32,
    },
    /// Whatever the memory is: a registration asks the device runtimes who owns the
    /// address and becomes that device's memory, or host memory if none claims it.
    /// Only a registration resolves it; a region is always `Host` or `Device`.
    Auto,
}

impl MemoryKind {
    /// The runtime name: `host`, the device runtime's name, or `auto`.
    pub fn runtime(&self) -> &str {
        match self {
            MemoryKind::Host => "host",
            MemoryKind::Device { runtime, .. } => runtime,
            MemoryKind::Auto => "auto",
        }
    }
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryKind::Host => f.write_str("host"),
            MemoryKind::Device { runtime, ordinal } => write!(f, "{runtime}:{ordinal}"),
            MemoryKind::Auto => f.write_str("auto"),
        }
    }
}

impl FromStr for MemoryKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<MemoryKind> {
        match s {
            "host" => return Ok(MemoryKind::Host),
            "auto" => return Ok(MemoryKind::Auto),
            _ => {}
        }
        let bad = || {
            Error::new(
                ErrorKind::InvalidRequest,
                format!(
                    "memory kind `{s}` is not `host`, `auto` or `RUNTIME:ORDINAL` (like `cuda:0`)"
                ),
            )
        };
        let (runtime, ordinal) = s.split_once(':').ok_or_else(bad)?;
        let ordinal = ordinal.parse().map_err(|_| bad())?;
        if runtime.is_empty() || !runtime.chars().all(|c| c.is_ascii_alphanumeric()) {
            return Err(bad());
        }
        Ok(MemoryKind::Device {
            runtime: runtime.to_string(),
            ordinal,
        })
    }
}

/// What a remote peer may do to a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Access {
    /// Peers may READ from the region.
    pub remote_read: bool,
    /// Peers may WRITE into the region.
    pub remote_write: bool,
}

impl Access {
    /// Only this engine uses the region (as a source or destination of its own requests).
    pub const LOCAL: Access = Access {
        remote_read: false,
        remote_write: false,
    };
    /// Peers may read the region.
    pub const REMOTE_READ: Access = Access {
        remote_read: true,
        remote_write: false,
    };
    /// Peers may read and write the region.
    pub const REMOTE_READ_WRITE: Access = Access {
        remote_read: true,
        remote_write: true,
    };

    /// Whether a peer may do `op` to the region: READ from it, or WRITE into it.
    pub fn allows(&self, op: Op) -> bool {
        match op {
            Op::Read => self.remote_read,
            Op::Write => self.remote_write,
        }
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match (self.remote_read, self.remote_write) {
            (false, false) => "local",
            (true, false) => "remote-read",
            (false, true) => "remote-write",
            (true, true) => "remote-read-write",
        })
    }
}

/// Memory handed to [`Engine::register`](crate::Engine::register).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryDesc {
    /// A name peers may look the region up by (need not be unique; may be empty).
    pub name: String,
    /// Start address, in the address space of `kind`.
    pub addr: u64,
    /// Length in bytes; must not be zero.
    pub len: u64,
    /// Where the bytes live.
    pub kind: MemoryKind,
    /// What peers may do to it.
    pub access: Access,
}

/// A registered region as peers see it, in the segment descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionDesc {
    /// The region's id within its engine's life.
    pub id: RegionId,
    /// The name it was registered with.
    pub name: String,
    /// Start address, in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Where the bytes live.
    pub kind: MemoryKind,
    /// What peers may do to it.
    pub access: Access,
    /// The backend's remote key bytes (an rkey, an IPC handle; empty where unused).
    pub key: Vec<u8>,
}

/// What a peer learns in the handshake: who the engine is and what it exposes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentDesc {
    /// The engine's name.
    pub engine: String,
    /// Random at every engine start; a new epoch means a restarted peer.
    pub epoch: u64,
    /// The engine's control-plane address (where its backend takes messages through
    /// the engine's hook).
    #[serde(default)]
    pub address: String,
    /// The backend's registry name; peers with another backend are refused.
    pub backend: String,
    /// The backend's endpoint bytes: what a peer's backend needs to reach this one.
    pub endpoint: Vec<u8>,
    /// The regions registered with remote access. Decoding refuses a list that
    /// [`SegmentDesc::check_regions`] refuses.
    #[serde(deserialize_with = "checked_regions")]
    pub regions: Vec<RegionDesc>,
    /// The KV-cache layouts registered on the engine.
    pub layouts: Vec<crate::kv::KvLayout>,
}

impl SegmentDesc {
    /// The region with this id.
    pub fn region(&self, id: RegionId) -> Option<&RegionDesc> {
        self.regions.iter().find(|r| r.id == id)
    }

    /// The first region registered under this name.
    pub fn region_named(&self, name: &str) -> Option<&RegionDesc> {
        self.regions.iter().find(|r| r.name == name)
    }

    /// The layout registered under `name`.
    pub fn layout(&self, name: &str) -> Option<&crate::kv::KvLayout> {
        self.layouts.iter().find(|l| l.name == name)
    }

    /// Checks what every backend assumes of a peer's regions: each lies inside the
    /// 64-bit address space (`addr + len` does not overflow), so an address computed
    /// from an offset the engine checked against the region's length cannot wrap; and
    /// no id is listed twice, so the engine's checks and a backend's table of the
    /// peer's regions describe the same region. Empty and overlapping regions pass:
    /// they are a peer's to describe (a KV slot's view lies inside its region), and a
    /// request into an empty one is out of its bounds.
    ///
    /// Every descriptor decoded from bytes ([`SegmentDesc::decode`], the control
    /// plane's frames) has passed it, so an engine refuses such a peer at connect,
    /// before its backend sees the descriptor; a backend calls it at connect for a
    /// descriptor it is handed as a value.
    ///
    /// # Errors
    /// [`ErrorKind::Protocol`], naming the engine and the region.
    pub fn check_regions(&self) -> Result<()> {
        match unfit(&self.regions) {
            None => Ok(()),
            Some(why) => Err(Error::new(
                ErrorKind::Protocol,
                format!(
                    "the descriptor of engine `{}` is forged or corrupt: {why}",
                    self.engine
                ),
            )),
        }
    }

    /// Encodes the descriptor as it travels in frames and across the plugin boundary.
    pub fn encode(&self) -> Vec<u8> {
        crate::codec::encode(self)
    }

    /// Decodes a descriptor.
    ///
    /// # Errors
    /// [`ErrorKind::Protocol`] if the bytes are not a descriptor, or describe regions
    /// [`SegmentDesc::check_regions`] refuses.
    pub fn decode(bytes: &[u8]) -> Result<SegmentDesc> {
        crate::codec::decode(bytes, "segment descriptor")
    }
}

/// Why `regions` cannot be a peer's (see [`SegmentDesc::check_regions`]), if so.
fn unfit(regions: &[RegionDesc]) -> Option<String> {
    let mut ids = HashSet::with_capacity(regions.len());
    for r in regions {
        if r.addr.checked_add(r.len).is_none() {
            return Some(format!(
                "region {} at {:#x} of {} bytes runs past the end of the 64-bit address space",
                r.id, r.addr, r.len
            ));
        }
        if !ids.insert(r.id) {
            return Some(format!("region {} is listed twice", r.id));
        }
    }
    None
}

/// Decodes a descriptor's regions, refusing what [`unfit`] refuses.
fn checked_regions<'de, D: Deserializer<'de>>(
    d: D,
) -> std::result::Result<Vec<RegionDesc>, D::Error> {
    let regions = Vec::<RegionDesc>::deserialize(d)?;
    match unfit(&regions) {
        Some(why) => Err(serde::de::Error::custom(format_args!(
            "{why}: a forged or corrupt descriptor"
        ))),
        None => Ok(regions),
    }
}

/// What a backend can do, so the engine refuses the rest with a clear error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    /// Memory runtimes the backend moves: `host`, `cuda`, `mlu`, …
    pub memory: Vec<String>,
    /// READ is supported.
    pub read: bool,
    /// WRITE is supported.
    pub write: bool,
    /// Peers may live in other processes (false for the in-process stub).
    pub cross_process: bool,
    /// Peers must be on the same host.
    pub same_host_only: bool,
    /// The largest single request, in bytes.
    pub max_request_size: u64,
    /// The receiving side checks every request against its own registrations (region,
    /// bounds, rights) before a byte moves — in its own code, or in hardware that
    /// enforces the region's key — so a forged or stale descriptor cannot reach
    /// outside a region or a KV slot. False where the fabric resolves remote addresses
    /// by itself and only the initiator's check stands (the backend's docs say why).
    pub checks_at_target: bool,
}

/// A backend's name, version and capabilities.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendInfo {
    /// The registry name (`tcp`, `stub`).
    pub name: String,
    /// The backend crate's version.
    pub version: String,
    /// What it can do.
    pub capabilities: Capabilities,
}

#[cfg(test)]
mod tests;
