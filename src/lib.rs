//! te: a transfer engine for disaggregated LLM inference.
//!
//! This facade re-exports [`te_core`] and links every backend crate that an enabled
//! Cargo feature names (all of them by default; the README lists them), so they are in
//! the registry of every program that uses it. Backends not linked in can be loaded
//! from plugin directories (`plugin_dirs`).

#![warn(missing_docs)]
// The README's example runs as a doctest, so it cannot drift from the API.
#![doc = include_str!("../README.md")]

pub use te_core::*;

// rustc links no crate nothing refers to; build.rs writes an `extern crate` line for
// each backend crate an enabled feature names, which makes its registration part of
// the program.
include!(concat!(env!("OUT_DIR"), "/linked.rs"));
