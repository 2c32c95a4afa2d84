//! What `te` does not export: each name below was public once and is internal or
//! backend plumbing now. Each block is a program that must not compile; `cargo test
//! --doc` fails if one does, so a name cannot become public again by accident. The
//! README's example, compiled as this crate's doc test, is the program that uses the
//! user API.

//!
//! `te::sync::Mutex` (te's poison-free locks are internal):
//! ```compile_fail
//! use te::sync::Mutex;
//! ```
//!
//! `te::worker::DueQueue` (backend plumbing: te::backend::worker):
//! ```compile_fail
//! use te::worker::DueQueue;
//! ```
//!
//! `te::codec::encode` (the control plane's encoding):
//! ```compile_fail
//! use te::codec::encode;
//! ```
//!
//! `te::net::bind` (listener plumbing: te::backend::kit::net):
//! ```compile_fail
//! use te::net::bind;
//! ```
//!
//! `te::require::skip` (a test helper):
//! ```compile_fail
//! use te::require::skip;
//! ```
//!
//! `te::fakedev::FakeDev` (the fake device's internals):
//! ```compile_fail
//! use te::fakedev::FakeDev;
//! ```
//!
//! `te::auth::prove` (the handshake's HMAC):
//! ```compile_fail
//! use te::auth::prove;
//! ```
//!
//! `te::peer_table::PeerTable` (backend plumbing: te::backend::peer_table):
//! ```compile_fail
//! use te::peer_table::PeerTable;
//! ```
//!
//! `te::plugin::Plugin` (plugin loading: te::backend::plugin):
//! ```compile_fail
//! use te::plugin::Plugin;
//! ```
//!
//! `te::hook::ControlHook` (backend plumbing: te::backend):
//! ```compile_fail
//! use te::hook::ControlHook;
//! ```
//!
//! `te::metadata::open` (the metadata store's internals):
//! ```compile_fail
//! use te::metadata::open;
//! ```
//!
//! `te::device::runtime` (device runtimes: te::backend::device):
//! ```compile_fail
//! use te::device::runtime;
//! ```
//!
//! `te::registry::Registry` (the registry: te::backend::registry):
//! ```compile_fail
//! use te::registry::Registry;
//! ```
//!
//! `te::kv::KvLayout` (the Kv types are at te's root):
//! ```compile_fail
//! use te::kv::KvLayout;
//! ```
//!
//! `te::Completion` (backend plumbing: te::backend):
//! ```compile_fail
//! use te::Completion;
//! ```
//!
//! `te::FfiError` (the plugin boundary):
//! ```compile_fail
//! use te::FfiError;
//! ```
//!
//! `te::ControlHook` (backend plumbing: te::backend):
//! ```compile_fail
//! use te::ControlHook;
//! ```
//!
//! `te::TransferBackend` (backend plumbing: te::backend):
//! ```compile_fail
//! use te::TransferBackend;
//! ```
//!
//! `te::BackendContext` (backend plumbing: te::backend):
//! ```compile_fail
//! use te::BackendContext;
//! ```
//!
//! `te::BatchId` (backend plumbing: te::backend):
//! ```compile_fail
//! use te::BatchId;
//! ```
//!
//! `te::Aborter` (backend plumbing: te::backend):
//! ```compile_fail
//! use te::Aborter;
//! ```
//!
//! `te::Deadline` (backend plumbing: te::backend (users give durations)):
//! ```compile_fail
//! use te::Deadline;
//! ```
//!
//! `te::random_nonzero` (an internal helper):
//! ```compile_fail
//! use te::random_nonzero;
//! ```
//!
//! `te::MAX_FRAME` (the control plane's frame limit):
//! ```compile_fail
//! use te::MAX_FRAME;
//! ```
//!
//! `te::CONTROL_VERSIONS` (the control plane's versions):
//! ```compile_fail
//! use te::CONTROL_VERSIONS;
//! ```
//!
//! `te::inventory` (the registry's link-time collection):
//! ```compile_fail
//! use te::inventory;
//! ```
