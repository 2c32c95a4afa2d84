//! **fakeverbs: a FAKE libibverbs** for testing te's RDMA backend on machines without an
//! RDMA NIC. It is not a verbs provider for real use.
//!
//! The library exports the libibverbs functions te-rdma resolves by name (and the data
//! path te-rdma calls through `ibv_context::ops`), so te-rdma loads it through its normal
//! `dlopen` path when `TE_RDMA_VERBS_LIB` names it:
//!
//! ```sh
//! cargo build -p fakeverbs
//! TE_RDMA_VERBS_LIB=$PWD/target/debug/libfakeverbs.so te info
//! ```
//!
//! What it models (module `nic` says how):
//! - devices, one port each, with a GID table (RoCE v1 and v2 types, or InfiniBand with
//!   a LID), listed by `TE_FAKEVERBS_DEVICES` (module `spec`; default `fake0 fake1`);
//! - protection domains; memory regions with access flags and keys, refused for
//!   unmapped memory or REMOTE_WRITE without LOCAL_WRITE;
//! - completion queues with completion channels: `ibv_req_notify_cq` arms a CQ, the
//!   next completion puts one event on the channel (a pollable pipe),
//!   `ibv_get_cq_event` takes it and `ibv_ack_cq_events` acknowledges it;
//!   `ibv_destroy_cq` waits for the acknowledgements;
//! - RC queue pairs with the RESET → INIT → RTR → RTS (→ ERR) state machine; each
//!   transition refuses missing or unexpected attributes and out-of-range values
//!   (MTU above the port's, `max_rd_atomic` above the device's, a GID index the port
//!   lacks, …);
//! - RDMA WRITE and READ, carried out by a software NIC thread per QP across the
//!   fabric of abstract Unix sockets, in one process or between processes; the
//!   responder checks rkey, range, protection domain and rights, and answers a
//!   violation with `IBV_WC_REM_ACCESS_ERR`, moving both QPs to ERR;
//! - per-QP completion order, flush completions after an error, async events
//!   (`ibv_get_async_event`: port down and up, QP fatal, QP access error, CQ overrun);
//! - fault injection through the `fakeverbs_*` functions (module `control`), which
//!   tests resolve with `dlsym`, and through `TE_FAKEVERBS_DEVICES` (`delay=…`,
//!   `state=down`).
//!
//! `ibv_reg_dmabuf_mr` fails with `EOPNOTSUPP`: the fake moves host memory only.
//!
//! The exported functions live with the verbs object they act on: `device` (devices
//! and contexts), `memory` (protection domains and memory regions), `cq` (completion
//! channels and queues), `qp` (queue pairs and their state machine), `post` (work
//! requests, reached through `ibv_context::ops`), `events` (async events) and `control`.

#![warn(missing_debug_implementations, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]
#![allow(clippy::missing_safety_doc)]

use std::ffi::c_int;
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};

mod control;
mod cq;
mod device;
mod events;
mod memory;
mod nic;
mod post;
mod qp;
mod spec;
#[allow(unreachable_pub)]
#[path = "../../te-rdma/src/verbs.rs"]
mod verbs;

fn set_errno(e: c_int) {
    // SAFETY: errno is this thread's; writing it is what a C library does on failure.
    unsafe { *libc::__errno_location() = e };
}

/// Null with `errno` set.
fn fail<T>(e: c_int) -> *mut T {
    set_errno(e);
    ptr::null_mut()
}

static NEXT_HANDLE: AtomicUsize = AtomicUsize::new(1);

fn handle() -> u32 {
    NEXT_HANDLE.fetch_add(1, Ordering::Relaxed) as u32
}

#[cfg(test)]
mod tests;
