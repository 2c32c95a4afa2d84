//! te-stub: the in-process backend, for hardware-free tests and demos.
//!
//! Engines of one process exchange data by `memcpy`, through a process-wide table of
//! stub endpoints, reached through the normal control plane and handshake. Completions
//! come from the stub's own worker thread, so they are as asynchronous as a real
//! fabric's.
//!
//! Options (`[backends.stub]`):
//! - `mode = "copy"` (default) moves bytes; `"noop"` completes without moving any, for
//!   pure control-flow tests.
//! - `fail_every = N` fails every Nth batch with a `Backend` error (0 = never).
//! - `delay = "5ms"` completes each batch no sooner than this after its submission.
//!
//! It is also the contract's adversary, so that the conformance suite catches an engine
//! or backend that breaks the memory contract:
//! - `ignore_abort = true` plays a fabric that cannot stop: an aborted batch still
//!   moves all its data when due (after its deadline) and only then is released.
//! - `reorder = true` runs due batches newest first and a batch's requests last first.
//! - `fail_partway_every = N` makes every Nth batch move about half its bytes and fail.
//! - `restart_every = N` fails every Nth batch with `PeerRestarted` and forgets the
//!   peer until it is connected again.
//!
//! Abort: a batch still queued is released at once; one being copied stops between
//! requests.
//!
//! The stub only connects engines of one process that use the same copy of it (both
//! built in, or both from the same plugin file).

#![warn(missing_debug_implementations, missing_docs, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]

use te_core::{BackendContext, BackendType, Result};

mod backend;
mod config;
mod worker;

pub use backend::StubBackend;
pub use config::{Mode, StubConfig};

/// The stub's registry name.
pub const NAME: &str = "stub";

impl BackendType for StubBackend {
    const NAME: &'static str = NAME;
    type Config = StubConfig;

    fn create(config: StubConfig, ctx: &BackendContext) -> Result<Self> {
        StubBackend::new(config, ctx)
    }
}

te_core::register_backend!(StubBackend);
