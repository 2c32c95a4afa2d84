//! The `[backends.tcp]` table. Every knob is described in the crate docs.

use std::fmt;
use std::time::Duration;

use serde::Deserialize;
use te_core::{Error, ErrorKind, Result};

use crate::wire::MAX_PAYLOAD;

/// The TCP backend's options.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct TcpConfig {
    /// Where the data listener binds (`HOST:PORT`; port 0 picks a free port). Unset:
    /// the host of `[engine] listen`, port 0 (outside an engine, `127.0.0.1:0`).
    pub listen: Option<String>,
    /// The host or IP peers use to reach the data listener; default: the `listen` host,
    /// or `[engine] advertise` when `listen` is unset. Required when the listener binds
    /// every interface (`0.0.0.0`, `[::]`).
    pub advertise: Option<String>,
    /// Persistent data connections opened to each peer (1–64).
    pub connections_per_peer: usize,
    /// Requests longer than this are cut into slices spread over the connections
    /// (4KiB–64MiB). It is also the largest frame this side accepts as a target,
    /// announced in the handshake; a peer's slices are the smaller of both sides'.
    #[serde(deserialize_with = "te_core::config::de::size")]
    pub slice_size: u64,
    /// Deprecated: set `[engine] auth_token`, which protects the control plane and these
    /// data connections alike (HMAC challenge–response before any data moves); a value
    /// here must equal it. `None` with no engine token accepts any peer.
    pub auth_token: Option<String>,
    /// Sets `TCP_NODELAY` on data connections: small frames go out at once instead of
    /// waiting for Nagle.
    pub nodelay: bool,
    /// `SO_SNDBUF` of data connections; 0 keeps the kernel's auto-tuning.
    #[serde(deserialize_with = "te_core::config::de::size")]
    pub send_buffer: u64,
    /// `SO_RCVBUF` of data connections; 0 keeps the kernel's auto-tuning.
    #[serde(deserialize_with = "te_core::config::de::size")]
    pub recv_buffer: u64,
    /// Bytes a submitting thread may send itself, without blocking, before it hands the
    /// rest of its batch to the connection's sender task; 0 always hands over.
    #[serde(deserialize_with = "te_core::config::de::size")]
    pub inline_send: u64,
    /// How long opening a data connection (TCP connect and handshake) may take.
    #[serde(deserialize_with = "te_core::config::de::duration")]
    pub connect_timeout: Duration,
    /// A connection on which nothing moves for this long while requests wait on it is
    /// declared dead, and its requests fail with `PeerUnreachable`; also the TCP
    /// keepalive idle time.
    #[serde(deserialize_with = "te_core::config::de::duration")]
    pub io_timeout: Duration,
    /// A peer must finish the whole handshake (hello, proof) within this long after its
    /// connection is accepted, however it paces its bytes.
    #[serde(deserialize_with = "te_core::config::de::duration")]
    pub handshake_timeout: Duration,
    /// Accepted connections still in their handshake, at most; a new one closes the
    /// oldest.
    pub max_pending: usize,
    /// Data connections this target serves at once (in their handshake or not), at
    /// most; more are closed at once.
    pub max_connections: usize,
    /// A served connection on which no request arrives for this long is closed (the
    /// initiator reconnects on next use); when shorter than `io_timeout` it also bounds
    /// a request stalled halfway; 0 never closes an idle connection.
    #[serde(deserialize_with = "te_core::config::de::duration")]
    pub idle_timeout: Duration,
    /// Frames between device memory of one runtime and device, to a peer that is a
    /// tcp backend of this same process, move device to device instead of through
    /// staging and the socket; `false` stages them as for any peer. A target with a
    /// `debug_delay` gets every frame over the socket.
    pub local_copies: bool,
    /// Peers in another process of this host, proven to be (see `samehost`), move
    /// without the socket: host memory with one cross-memory-attach copy, device memory
    /// through the runtime's IPC handles as device copies; `false` sends every frame
    /// over the socket. A target with a `debug_delay` gets every frame over the socket.
    pub local_ipc: bool,
    /// On a same-host channel, a caller waiting for its batch (`wait`) reads the
    /// channel's answers itself, so its answer wakes it directly instead of waking a
    /// receiving thread that then wakes it; batches nobody waits for on a thread are
    /// still read by that thread. Off by default: it saves a wake-up where the target
    /// takes a while (one waiting for a GPU), and costs one where answers come back
    /// within microseconds on a VM whose idle CPUs are slow to wake
    /// (`scripts/caller-reads-bench.sh` measures both on a machine). A waiting caller
    /// completes whatever answers it reads, other batches' too, so their callbacks
    /// (`te_batch_on_complete`, Python's `_on_done`) may run on an application thread
    /// blocked in a wait, not only on te's.
    pub caller_reads: bool,
    /// For tests only: the target holds every request this long before serving it.
    #[serde(deserialize_with = "te_core::config::de::duration")]
    pub debug_delay: Duration,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            listen: None,
            advertise: None,
            connections_per_peer: 4,
            slice_size: 512 << 10,
            auth_token: None,
            nodelay: true,
            send_buffer: 0,
            recv_buffer: 0,
            inline_send: 256 << 10,
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(5),
            max_pending: 64,
            max_connections: 4096,
            idle_timeout: Duration::ZERO,
            local_copies: true,
            local_ipc: true,
            caller_reads: false,
            debug_delay: Duration::ZERO,
        }
    }
}

impl fmt::Debug for TcpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpConfig")
            .field("listen", &self.listen)
            .field("advertise", &self.advertise)
            .field("connections_per_peer", &self.connections_per_peer)
            .field("slice_size", &self.slice_size)
            .field(
                "auth_token",
                &self.auth_token.as_ref().map(|_| "<redacted>"),
            )
            .field("nodelay", &self.nodelay)
            .field("send_buffer", &self.send_buffer)
            .field("recv_buffer", &self.recv_buffer)
            .field("inline_send", &self.inline_send)
            .field("connect_timeout", &self.connect_timeout)
            .field("io_timeout", &self.io_timeout)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("max_pending", &self.max_pending)
            .field("max_connections", &self.max_connections)
            .field("idle_timeout", &self.idle_timeout)
            .field("local_copies", &self.local_copies)
            .field("local_ipc", &self.local_ipc)
            .field("caller_reads", &self.caller_reads)
            .field("debug_delay", &self.debug_delay)
            .finish()
    }
}

impl te_core::BackendConfig for TcpConfig {
    /// Checks values serde cannot.
    ///
    /// # Errors
    /// `ConfigInvalid`, naming the key and the accepted range.
    fn validate(&self) -> Result<()> {
        let bad = |m: String| {
            Err(
                Error::new(ErrorKind::ConfigInvalid, format!("[backends.tcp] {m}"))
                    .with_operation("create backend"),
            )
        };
        if !(1..=64).contains(&self.connections_per_peer) {
            return bad(format!(
                "connections_per_peer = {} is outside 1..=64",
                self.connections_per_peer
            ));
        }
        if !(4096..=MAX_PAYLOAD).contains(&self.slice_size) {
            return bad(format!(
                "slice_size = {} is outside 4KiB..=64MiB",
                self.slice_size
            ));
        }
        if self.auth_token.as_ref().is_some_and(|t| t.is_empty()) {
            return bad("auth_token is empty; remove it or set a secret".into());
        }
        if self.connect_timeout.is_zero() || self.io_timeout.is_zero() {
            return bad("connect_timeout and io_timeout must be greater than zero".into());
        }
        if self.handshake_timeout.is_zero() {
            return bad("handshake_timeout must be greater than zero".into());
        }
        if self.max_pending == 0 || self.max_connections == 0 {
            return bad(format!(
                "max_pending = {} and max_connections = {} must be at least 1",
                self.max_pending, self.max_connections
            ));
        }
        if self.send_buffer > i32::MAX as u64 || self.recv_buffer > i32::MAX as u64 {
            return bad("send_buffer and recv_buffer must be below 2GiB".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_core::BackendContext;

    fn parse(text: &str) -> Result<TcpConfig> {
        let ctx = BackendContext {
            epoch: 0,
            engine: "t".into(),
            table: text.parse().expect("toml"),
            source: "test.toml".into(),
            ..Default::default()
        };
        ctx.config(crate::NAME)
    }

    #[test]
    fn sizes_take_numbers_or_units_and_durations_take_units() {
        let c = parse(
            "slice_size = \"1MiB\"\nsend_buffer = 65536\nio_timeout = \"2s\"\nauth_token = \"s\"",
        )
        .unwrap();
        assert_eq!(c.slice_size, 1 << 20);
        assert_eq!(c.send_buffer, 65536);
        assert_eq!(c.io_timeout, Duration::from_secs(2));
        assert!(!format!("{c:?}").contains("\"s\""), "the token is redacted");
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused_with_the_key() {
        let e = parse("slice_sise = 4096").unwrap_err();
        assert!(e.to_string().contains("slice_sise"), "{e}");
        assert!(e.to_string().contains("test.toml"), "{e}");
        let e = parse("connections_per_peer = 0").unwrap_err();
        assert!(e.to_string().contains("connections_per_peer"), "{e}");
        let e = parse("slice_size = \"1GiB\"").unwrap_err();
        assert!(e.to_string().contains("slice_size"), "{e}");
        let e = parse("slice_size = \"big\"").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ConfigInvalid);
        let e = parse("max_pending = 0").unwrap_err();
        assert!(e.to_string().contains("max_pending"), "{e}");
        let e = parse("handshake_timeout = \"0s\"").unwrap_err();
        assert!(e.to_string().contains("handshake_timeout"), "{e}");
        let e = parse("auth_token = \"\"").unwrap_err();
        assert!(e.to_string().contains("auth_token"), "{e}");
    }
}
