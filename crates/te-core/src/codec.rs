//! Compact encoding of descriptor types, shared by frames, the plugin boundary and
//! backends' own endpoint and key bytes (postcard: stable for a given type, not
//! self-describing, so prefix a version where a format may change).

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Error, ErrorKind, Result};

/// Encodes a value; encoding into a `Vec` cannot fail for te's own types.
pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    postcard::to_stdvec(value).expect("te's descriptor types always encode")
}

/// Decodes a value, refusing trailing bytes.
///
/// # Errors
/// `Protocol`, naming `what`, for malformed bytes or trailing bytes.
pub fn decode<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T> {
    match postcard::take_from_bytes(bytes) {
        Ok((value, [])) => Ok(value),
        Ok((_, rest)) => Err(Error::new(
            ErrorKind::Protocol,
            format!("{what} has {} trailing bytes", rest.len()),
        )),
        Err(e) => {
            Err(Error::new(ErrorKind::Protocol, format!("{what} is malformed")).with_source(e))
        }
    }
}
