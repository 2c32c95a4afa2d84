//! te-core: the heart of te, a transfer engine for disaggregated LLM inference.
//!
//! It holds the [`TransferBackend`] seam every fabric implements, the descriptor types,
//! the one [`Error`] type, configuration, the backend [`Registry`] (built-in backends
//! and plugins), and the [`Engine`] users hold, with its control plane.
//!
//! ```no_run
//! use te_core::{Access, Config, Engine, TransferRequest};
//!
//! # fn main() -> te_core::Result<()> {
//! let config = Config::defaults(); // backend "stub": engines of one process
//! let target = Engine::from_config(&config)?;
//! let dst = target.alloc("kv", 1 << 20, Access::REMOTE_READ_WRITE)?;
//!
//! let initiator = Engine::from_config(&config)?;
//! let src = initiator.alloc("kv", 1 << 20, Access::LOCAL)?;
//! src.write(0, b"hello")?;
//! let peer = initiator.connect(&target.address().to_string())?;
//! let remote = peer.region("kv").expect("the target registered `kv`");
//! initiator
//!     .transfer(&peer, &[TransferRequest::write(src.id(), 0, remote.id, 0, 5)])?
//!     .wait()?;
//! # let _ = dst;
//! # Ok(())
//! # }
//! ```

#![warn(missing_debug_implementations, missing_docs, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]

pub mod auth;
mod backend;
mod batch;
mod buffer;
pub mod codec;
pub mod config;
mod control;
mod desc;
pub mod device;
mod engine;
mod error;
pub mod hook;
mod inbox;
pub mod kit;
pub mod kv;
pub mod local;
pub mod metadata;
mod metrics;
pub mod peer_table;
pub mod plugin;
mod region;
pub mod registry;
mod request;
pub mod require;
mod signals;
pub mod sync;
#[cfg(feature = "testkit")]
pub mod testkit;
mod time;
mod units;
pub mod worker;

pub use backend::{
    random_nonzero, Aborter, BackendConfig, BackendContext, BatchId, BatchStage, Completion,
    Deadline, FfiError, TransferBackend,
};
pub use batch::{TransferHandle, TransferStatus};
pub use buffer::Buffer;
pub use config::{Config, EngineConfig};
pub use control::{StandaloneControl, MAX_FRAME, VERSIONS as CONTROL_VERSIONS};
pub use desc::{
    Access, BackendInfo, Capabilities, MemoryDesc, MemoryKind, Op, PeerId, RegionDesc, RegionId,
    SegmentDesc, TransferRequest,
};
pub use engine::{BlockOptions, Engine, Peer, Registration, TransferOptions};
pub use error::{Error, ErrorKind, Result};
pub use hook::{ControlHook, MessageHandler, PeerInfo};
pub use inbox::Notification;
pub use inbox::{Next, PeerEvent, PeerEventKind, TornRange};
pub use kv::{KvGroup, KvLayout, KvSelection, KvSlot};
pub use metrics::{BatchTelemetry, Histogram, Metrics, PeerMetrics, RegisteredMemory};
pub use registry::{BackendType, Origin, Registry};

#[doc(hidden)]
pub use inventory;

/// `abi_stable` types the registration macro names.
#[doc(hidden)]
pub mod __abi {
    pub use abi_stable::std_types::{RResult, RSlice};
}
