//! te-tcp: the TCP backend (in progress).

#![warn(missing_debug_implementations, missing_docs, unreachable_pub)]

/// The TCP backend's registry name.
pub const NAME: &str = "tcp";
