//! The one public error type of te.
//!
//! Every failure is an [`Error`]: a [`ErrorKind`] a program can match on, the
//! operation that failed, a message that says what happened and what to do, key/value
//! context, and an optional source. Backends keep their own private error enums and
//! convert them into this one.

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;

macro_rules! error_kinds {
    ($($(#[$doc:meta])* $name:ident = $code:literal,)*) => {
        /// What kind of failure an [`Error`] is.
        ///
        /// Each kind has a stable numeric code ([`ErrorKind::code`]) that crosses the
        /// plugin boundary and the wire; the codes are defined here and nowhere else.
        #[non_exhaustive]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum ErrorKind {
            $($(#[$doc])* $name,)*
        }

        impl ErrorKind {
            /// The stable numeric code of this kind.
            pub const fn code(self) -> u32 {
                match self { $(ErrorKind::$name => $code,)* }
            }

            /// The kind with this code; unknown codes (from a newer peer or plugin)
            /// become [`ErrorKind::Backend`].
            pub const fn from_code(code: u32) -> ErrorKind {
                match code { $($code => ErrorKind::$name,)* _ => ErrorKind::Backend }
            }

            /// The kind's name, as written in messages.
            pub const fn as_str(self) -> &'static str {
                match self { $(ErrorKind::$name => stringify!($name),)* }
            }
        }
    };
}

error_kinds! {
    /// A configuration file or value is malformed, names an unknown key, or is inconsistent.
    ConfigInvalid = 1,
    /// A backend, plugin or device runtime is not available on this machine.
    Unavailable = 2,
    /// The backend or engine cannot do what was asked (a memory kind, an operation).
    Unsupported = 3,
    /// A request is malformed: zero length, unknown region, missing rights.
    InvalidRequest = 4,
    /// A request reaches outside a registered region.
    OutOfBounds = 5,
    /// The memory or region was never registered, or has been deregistered.
    NotRegistered = 6,
    /// The peer could not be reached, or its connection broke.
    PeerUnreachable = 7,
    /// The peer restarted: its descriptors belong to a previous life.
    PeerRestarted = 8,
    /// The deadline passed before the operation completed.
    Timeout = 9,
    /// The operation was abandoned (the engine or backend shut down).
    Cancelled = 10,
    /// A peer sent bytes that do not follow the protocol.
    Protocol = 11,
    /// The backend or the vendor library under it failed.
    Backend = 12,
    /// An operating-system call failed.
    Io = 13,
    /// A bounded queue is full; retry later or read what is queued.
    Busy = 14,
    /// The peer failed to prove a shared secret (auth_token).
    Unauthorized = 15,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A te failure: kind, operation, message, context and source.
///
/// `Display` is one line: `operation: message (key=value, …): source`.
/// `Debug` prints the same, plus the kind.
#[derive(Clone)]
pub struct Error {
    kind: ErrorKind,
    operation: &'static str,
    message: String,
    context: Vec<(&'static str, String)>,
    source: Option<Arc<dyn StdError + Send + Sync>>,
}

/// `Result` with te's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A new error of `kind` with a message that says what happened and what to do.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error {
            kind,
            operation: "",
            message: message.into(),
            context: Vec::new(),
            source: None,
        }
    }

    /// Sets the operation that failed (`"connect"`, `"register"`, …), if none is set.
    pub fn with_operation(mut self, operation: &'static str) -> Error {
        if self.operation.is_empty() {
            self.operation = operation;
        }
        self
    }

    /// Adds a `key=value` pair of context.
    pub fn with_context(mut self, key: &'static str, value: impl fmt::Display) -> Error {
        let value = value.to_string();
        if !self.context.iter().any(|(k, v)| *k == key && *v == value) {
            self.context.push((key, value));
        }
        self
    }

    /// Sets the underlying cause.
    pub fn with_source(mut self, source: impl StdError + Send + Sync + 'static) -> Error {
        self.source = Some(Arc::new(source));
        self
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The operation that failed, or `""`.
    pub fn operation(&self) -> &'static str {
        self.operation
    }

    /// The message, without operation, context or source.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The value of a context key, if present.
    pub fn context(&self, key: &str) -> Option<&str> {
        self.context
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Rebuilds an error that crossed a boundary as a code and a rendered message.
    pub(crate) fn from_parts(code: u32, operation: &'static str, message: String) -> Error {
        Error::new(ErrorKind::from_code(code), message).with_operation(operation)
    }

    /// An error whose text came from a peer: `prefix` (this side's words, may be empty)
    /// and the peer's `text`, cut to 1,024 bytes and with control and
    /// direction-changing characters escaped, so that a hostile peer can neither flood
    /// a log or an error message nor rewrite a terminal through one.
    pub fn from_peer(kind: ErrorKind, prefix: &str, text: &str) -> Error {
        let text = peer_text(text);
        let message = if prefix.is_empty() {
            text
        } else {
            format!("{prefix}: {text}")
        };
        Error::new(kind, message)
    }

    pub(crate) fn io(operation: &'static str, what: impl Into<String>, e: std::io::Error) -> Error {
        let kind = match e.kind() {
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => ErrorKind::Timeout,
            std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::NotConnected
            | std::io::ErrorKind::HostUnreachable
            | std::io::ErrorKind::NetworkUnreachable
            | std::io::ErrorKind::AddrNotAvailable => ErrorKind::PeerUnreachable,
            _ => ErrorKind::Io,
        };
        Error::new(kind, what)
            .with_operation(operation)
            .with_source(e)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.operation.is_empty() {
            write!(f, "{}: ", self.operation)?;
        }
        f.write_str(&self.message)?;
        if !self.context.is_empty() {
            f.write_str(" (")?;
            for (i, (k, v)) in self.context.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{k}={v}")?;
            }
            f.write_str(")")?;
        }
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

/// The most bytes of a peer's text that [`Error::from_peer`] keeps.
pub(crate) const PEER_TEXT_MAX: usize = 1024;

/// `text` as it may be shown: at most [`PEER_TEXT_MAX`] bytes of it (cut at a character
/// boundary, saying how much was cut), control characters and the Unicode direction
/// overrides escaped (`\n`, `\u{1b}`, `\u{202e}`).
fn peer_text(text: &str) -> String {
    let mut end = text.len().min(PEER_TEXT_MAX);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let mut out = String::with_capacity(end + 32);
    for c in text[..end].chars() {
        let direction = matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        if c.is_control() || direction {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    if end < text.len() {
        out.push_str(&format!(" … ({} more bytes cut)", text.len() - end));
    }
    out
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {self}", self.kind)
    }
}

impl StdError for Error {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|s| s as &(dyn StdError + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_unknown_codes_become_backend() {
        for kind in [
            ErrorKind::ConfigInvalid,
            ErrorKind::Timeout,
            ErrorKind::Busy,
        ] {
            assert_eq!(ErrorKind::from_code(kind.code()), kind);
        }
        assert_eq!(ErrorKind::from_code(9999), ErrorKind::Backend);
    }

    #[test]
    fn a_peers_text_is_cut_and_its_control_characters_escaped() {
        let e = Error::from_peer(ErrorKind::Backend, "refused", "a\nb\u{1b}[31mred\u{202e}x");
        assert_eq!(e.message(), "refused: a\\nb\\u{1b}[31mred\\u{202e}x");
        // 60 KB with a multi-byte character across the cut.
        let long = format!("{}é{}", "x".repeat(PEER_TEXT_MAX - 1), "y".repeat(60_000));
        let e = Error::from_peer(ErrorKind::Backend, "", &long);
        assert!(
            e.message().len() < PEER_TEXT_MAX + 64,
            "{}",
            e.message().len()
        );
        assert!(
            e.message().ends_with(" … (60002 more bytes cut)"),
            "{}",
            e.message()
        );
        assert!(!e.message().contains('é'));
    }

    #[test]
    fn display_is_one_line_with_operation_context_and_source() {
        let e = Error::new(
            ErrorKind::OutOfBounds,
            "request reaches past the region end",
        )
        .with_operation("transfer")
        .with_context("region", 3)
        .with_source(std::io::Error::other("boom"));
        assert_eq!(
            e.to_string(),
            "transfer: request reaches past the region end (region=3): boom"
        );
        assert_eq!(e.context("region"), Some("3"));
    }
}
