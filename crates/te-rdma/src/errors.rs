//! The errors te-rdma's own checks report, naming what to fix.

use te_core::{Error, ErrorKind};

/// A `[backends.rdma]` option that cannot be used.
pub(crate) fn config_error(m: String) -> Error {
    Error::new(ErrorKind::ConfigInvalid, format!("[backends.rdma] {m}"))
        .with_operation("create backend")
}
