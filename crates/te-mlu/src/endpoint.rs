//! What the mlu backend puts in its endpoint and in region keys, and how it is encoded
//! (te-core's descriptor codec, behind a magic and version prefix).

use serde::{Deserialize, Serialize};
use te_core::{codec, Error, ErrorKind, Result};

use crate::ffi::IpcHandle;

/// What a peer learns about this backend instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Endpoint {
    pub(crate) instance: u64,
    /// The abstract socket serving the region table (always `handoff::socket_name` of
    /// the instance; a peer's is refused otherwise).
    pub(crate) socket: String,
    /// The host's identity (host name and boot id).
    pub(crate) host: String,
    /// PCI bus ids of the MLUs this process sees, by ordinal.
    pub(crate) buses: Vec<String>,
}

const ENDPOINT_MAGIC: &[u8; 6] = b"TEMLU\x05";

/// This host's identity: host name and boot id, so that two containers with one host
/// name on different machines, or one machine rebooted, never look alike.
pub(crate) fn host_identity() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer and its length are valid.
    let name = if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "unknown-host".into()
    };
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{name}/{}", boot.trim())
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

/// A region's remote key: its table slot and, for MLU memory, how a peer maps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Key {
    pub(crate) slot: u32,
    pub(crate) ipc: Option<Ipc>,
}

/// How a peer reaches a region of MLU memory: the IPC handle of its allocation, the
/// generation the owner gave that export (new with each handle CNRT gives, so two
/// allocations are told apart even where CNRT gives them one handle value), and the
/// region's offset in the allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Ipc {
    pub(crate) handle: IpcHandle,
    pub(crate) generation: u64,
    pub(crate) offset: u64,
}

impl Key {
    pub(crate) fn encode(&self) -> Vec<u8> {
        codec::encode(self)
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Key> {
        codec::decode(b, "an mlu region key")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_and_keys_round_trip() {
        let ep = Endpoint {
            instance: 7,
            socket: "te-mlu-0000000000000007".into(),
            host: "h/boot".into(),
            buses: vec!["0000:1a:00.0".into(), "0000:1b:00.0".into()],
        };
        assert_eq!(Endpoint::decode(&ep.encode()).unwrap(), ep);
        assert!(Endpoint::decode(&ep.encode()[..10]).is_err());
        for k in [
            Key { slot: 3, ipc: None },
            Key {
                slot: 4,
                ipc: Some(Ipc {
                    handle: [1, 2, 3, 4, 5, 6, 7, 8],
                    generation: 9,
                    offset: 4096,
                }),
            },
        ] {
            assert_eq!(Key::decode(&k.encode()).unwrap(), k);
        }
    }
}
