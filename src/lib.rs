//! te: a transfer engine for disaggregated LLM inference.
//!
//! This facade re-exports [`te_core`] and links the backends its Cargo features
//! enable, so they are in the registry of every program that uses it:
//!
//! | feature | backend |
//! |---|---|
//! | `stub` (default) | in-process memcpy backend for hardware-free tests |
//! | `tcp` (default) | TCP backend |
//! | `rdma` (default) | RDMA backend (libibverbs is loaded at run time) |
//! | `flagcx` (default) | FlagCX backend (its C shim is loaded at run time) |
//! | `mlu` (default) | the `mlu` device runtime and MLU-Link backend (CNRT is loaded at run time) |
//! | `cuda` (default) | the `cuda` device runtime (the driver is loaded at run time) |
//!
//! Backends not linked in can be loaded from plugin directories (`plugin_dirs`).

#![warn(missing_docs)]
// The README's example runs as a doctest, so it cannot drift from the API.
#![doc = include_str!("../README.md")]

pub use te_core::*;

// rustc links no crate nothing refers to; these make each enabled backend's
// registration part of the program.
#[cfg(feature = "flagcx")]
extern crate te_flagcx as _;
#[cfg(feature = "mlu")]
extern crate te_mlu as _;
#[cfg(feature = "rdma")]
extern crate te_rdma as _;
#[cfg(feature = "stub")]
extern crate te_stub as _;
#[cfg(feature = "tcp")]
extern crate te_tcp as _;

/// The names of the backends this build links in, by Cargo feature.
pub fn linked_backends() -> &'static [&'static str] {
    &[
        #[cfg(feature = "stub")]
        te_stub::NAME,
        #[cfg(feature = "tcp")]
        te_tcp::NAME,
        #[cfg(feature = "rdma")]
        te_rdma::NAME,
        #[cfg(feature = "flagcx")]
        te_flagcx::NAME,
        #[cfg(feature = "mlu")]
        te_mlu::NAME,
    ]
}
