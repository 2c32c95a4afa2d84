//! te's C ABI: `libte.so` and `libte.a`, described by `include/te.h`.
//!
//! Every exported function is `te_*`, returns `TE_OK` or a negative status (minus the
//! code of an [`ErrorKind`](te_facade::ErrorKind)), records its message for
//! `te_last_error()`, and runs inside `catch_unwind`, so no panic crosses into C.
//! Handles (`te_engine`, `te_peer`, `te_batch`, `te_notification`) are boxes handed to
//! C as opaque pointers and taken back by their `_free` function. The header documents
//! each function; this crate's docs say how it is sound.

#![warn(missing_debug_implementations, missing_docs, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]

mod args;
mod batch;
mod engine;
mod error;
mod header;
mod inbox;
#[cfg(test)]
mod testing;

pub use batch::{te_batch_cancel, te_batch_eventfd, te_batch_free, te_batch_on_complete};
pub use batch::{te_batch_status, te_batch_wait, TeBatch};
pub use engine::{te_engine_address, te_engine_connect, te_engine_deregister, te_engine_metrics};
pub use engine::{te_engine_deregister_layout, te_engine_free, te_engine_from_file};
pub use engine::{te_engine_new, te_engine_pull_blocks, te_engine_push_blocks};
pub use engine::{te_engine_register, te_engine_register_layout, te_engine_transfer};
pub use engine::{te_peer_free, te_peer_region, TeEngine, TePeer, TeRequest};
pub use error::{te_last_error, te_status_name, TE_OK, TE_PENDING};
pub use header::ABI_VERSION;
pub use inbox::{te_engine_recv_event, te_engine_recv_notification, te_notification_data};
pub use inbox::{te_notification_free, te_notification_sender, TeNotification, TePeerEvent};

use std::ffi::c_char;

/// The library's C ABI version ([`ABI_VERSION`]); a program compares it with the
/// header's `TE_ABI_VERSION` before anything else.
#[no_mangle]
pub extern "C" fn te_abi_version() -> u32 {
    ABI_VERSION
}

/// te's version (`"0.1.0"`), a static string.
#[no_mangle]
pub extern "C" fn te_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}
