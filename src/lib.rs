//! te: a transfer engine for disaggregated LLM inference.
//!
//! This facade exports te's user API (and, in [`backend`], what backend authors
//! need) from [`te_core`] and links every backend crate that an enabled
//! Cargo feature names (all of them by default; the README lists them), so they are in
//! the registry of every program that uses it. Backends not linked in can be loaded
//! from plugin directories (`plugin_dirs`).

#![warn(missing_docs)]
// The README's example runs as a doctest, so it cannot drift from the API.
#![doc = include_str!("../README.md")]

// The user's API, by name: everything a program that moves data with te needs, and
// nothing it does not. `tests/public_api.rs` holds the list of names that must not be
// here.
pub use te_core::{
    // Engines, peers and memory.
    Access,
    // What an engine runs on.
    BackendInfo,
    // Requests and their handles.
    BlockOptions,
    Buffer,
    Capabilities,
    // Configuration.
    Config,
    Engine,
    EngineConfig,
    // Errors.
    Error,
    ErrorKind,
    // KV-cache layouts.
    KvGroup,
    KvLayout,
    KvSelection,
    KvSlot,
    MemoryDesc,
    MemoryKind,
    // Notifications and peer events.
    Next,
    Notification,
    Op,
    Origin,
    Peer,
    PeerEvent,
    PeerEventKind,
    PeerId,
    RegionDesc,
    RegionId,
    Registration,
    Result,
    SegmentDesc,
    TornRange,
    TransferHandle,
    TransferOptions,
    TransferRequest,
    TransferStatus,
};

/// Configuration: the file's structure, and the size and duration syntax it uses.
pub mod config {
    pub use te_core::config::{
        parse_duration, parse_size, Config, EngineConfig, Table, CONFIG_ENV,
    };
}

/// For backend authors: the interface a backend implements, the registry that finds
/// it by name, the plumbing backends share, and the device runtimes they move device
/// memory through. A program that only moves data needs none of it.
pub mod backend {
    /// Device runtimes: the seam between te and an accelerator's memory.
    pub use te_core::device;
    /// The network plumbing every listener shares.
    pub use te_core::net;
    pub use te_core::{
        hook::{ControlHook, MessageHandler, PeerInfo},
        peer_table, plugin, register_backend, register_runtime,
        registry::{self, BackendType, Registry},
        worker, Aborter, BackendConfig, BackendContext, BatchId, Completion, Deadline, FfiError,
        StandaloneControl, TransferBackend,
    };
}

// rustc links no crate nothing refers to; build.rs writes an `extern crate` line for
// each backend crate an enabled feature names, which makes its registration part of
// the program.
mod surface;

include!(concat!(env!("OUT_DIR"), "/linked.rs"));
