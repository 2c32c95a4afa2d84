//! The errors both sides of te-tcp report, each saying which connection and what broke.

use te_core::{Error, ErrorKind};

/// The initiator's data connection to `label` broke while doing `what`.
pub(crate) fn unreachable(label: &str, what: &str, e: std::io::Error) -> Error {
    Error::new(
        ErrorKind::PeerUnreachable,
        format!("data connection to {label}: {what}"),
    )
    .with_source(e)
}

/// The target's data connection from `peer` broke while doing `what`.
pub(crate) fn io_err(peer: &str, what: &str, e: std::io::Error) -> Error {
    Error::new(
        ErrorKind::PeerUnreachable,
        format!("data connection from {peer}: {what}"),
    )
    .with_source(e)
}

/// `peer` sent something te-tcp's protocol does not allow.
pub(crate) fn protocol(peer: &str, e: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorKind::Protocol,
        format!("{peer} broke the te-tcp protocol ({e}); the connection was closed"),
    )
}

/// A slice the engine's abort (deadline, cancel, deregistration) ended.
pub(crate) fn timeout_error() -> Error {
    Error::new(
        ErrorKind::Timeout,
        "the batch was aborted (its deadline, a cancel or a deregistration) before this slice was done",
    )
}

/// A `[backends.tcp]` option that cannot be used.
pub(crate) fn config_error(m: String) -> Error {
    Error::new(ErrorKind::ConfigInvalid, format!("[backends.tcp] {m}"))
        .with_operation("create backend")
}
