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
// nothing it does not. `src/surface.rs` lists names that must stay internal.

// Engines, peers and memory.
pub use te_core::{
    Access, Buffer, Engine, MemoryDesc, MemoryKind, Peer, PeerId, RegionDesc, RegionId,
    Registration, SegmentDesc,
};
// Requests and their handles.
pub use te_core::{
    BlockOptions, Op, TransferHandle, TransferOptions, TransferRequest, TransferStatus,
};
// KV-cache layouts.
pub use te_core::{KvGroup, KvLayout, KvSelection, KvSlot};
// Configuration.
pub use te_core::{Config, EngineConfig};
// Errors.
pub use te_core::{Error, ErrorKind, Result};
// Notifications and peer events.
pub use te_core::{Next, Notification, PeerEvent, PeerEventKind, TornRange};
// What an engine runs on.
pub use te_core::{BackendInfo, Capabilities, Origin};
// What it has done.
pub use te_core::{BatchTelemetry, Histogram, Metrics, PeerMetrics, RegisteredMemory};

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
    /// The mechanisms every backend shares: region table and pins, countdown
    /// completion, range checks, listener and address plumbing.
    pub use te_core::kit;
    pub use te_core::{
        hook::{ControlHook, MessageHandler, PeerInfo},
        peer_table, plugin, register_backend, register_runtime,
        registry::{self, BackendType, Registry},
        worker, Aborter, BackendConfig, BackendContext, BatchId, BatchStage, Completion, Deadline,
        FfiError, StandaloneControl, TransferBackend,
    };
}

// rustc links no crate nothing refers to; build.rs writes an `extern crate` line for
// each backend crate an enabled feature names, which makes its registration part of
// the program.
mod surface;

include!(concat!(env!("OUT_DIR"), "/linked.rs"));
