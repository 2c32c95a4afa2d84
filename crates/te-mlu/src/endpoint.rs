//! What the mlu backend puts in its endpoint and in region keys, and how it is encoded
//! (te-core's descriptor codec, behind a magic and version prefix).

use serde::{Deserialize, Serialize};
use te_core::{codec, Error, ErrorKind, Result};

use crate::ffi::IpcHandle;

/// What a peer learns about this backend instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Endpoint {
    pub(crate) instance: u64,
    /// Random per process: tells a peer in this process from one in another.
    pub(crate) process: u64,
    /// The abstract socket serving the region table.
    pub(crate) socket: String,
    /// The host's identity (host name and boot id).
    pub(crate) host: String,
    /// PCI bus ids of the MLUs this process sees, by ordinal.
    pub(crate) buses: Vec<String>,
}

const ENDPOINT_MAGIC: &[u8; 6] = b"TEMLU\x03";

/// This process's random id.
pub(crate) fn process_id() -> u64 {
    static ID: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *ID.get_or_init(|| rand::random::<u64>() | 1)
}

impl Endpoint {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = ENDPOINT_MAGIC.to_vec();
        v.extend_from_slice(&codec::encode(self));
        v
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Endpoint> {
        match b.strip_prefix(ENDPOINT_MAGIC.as_slice()) {
            Some(rest) => codec::decode(rest, "the peer's mlu endpoint"),
            None => Err(Error::new(
                ErrorKind::Protocol,
                "the peer's endpoint is not an mlu endpoint of this version",
            )),
        }
    }
}

/// A region's remote key: its table slot and, for MLU memory, the IPC handle of its
/// allocation and its offset there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Key {
    pub(crate) slot: u32,
    pub(crate) handle: Option<(IpcHandle, u64)>,
}

impl Key {
    pub(crate) fn encode(&self) -> Vec<u8> {
        codec::encode(self)
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Key> {
        codec::decode(b, "an mlu region key")
    }
}
