//! te-tcp: the TCP backend, the one every machine can run.
//!
//! The engine's control plane exchanges segment descriptors; this backend's endpoint
//! in them is the address of its own **data listener** plus a random **instance id**.
//! `connect` opens a pool of persistent data connections to a peer's listener, each
//! opened with a versioned handshake that names the instance the initiator expects (a
//! restarted peer is a new instance and refuses connections meant for its previous
//! life) and, with an `auth_token`, proves the token on both sides by HMAC-SHA-256
//! challenge–response, so the token never travels and an unproven peer is refused
//! before any data moves.
//!
//! A batch is cut into slices of at most `slice_size` bytes, and the slices going to one
//! remote region from one kind of local memory (host memory, or one device) are
//! gathered into **scatter-gather frames** (up to `slice_size` bytes and 1,024 entries
//! each), spread round-robin over the pool; each connection carries many frames in
//! flight (pipelined). A WRITE frame is a 40-byte header (and, gathered, its list of
//! (offset, len) entries) followed by its payload, sent from the registered source
//! memory with `sendmsg` (header and payload spans gathered, many frames per call). The
//! target checks region, rights and bounds of every entry against its own registrations
//! **before** placing a byte, receives the payload with `recvmsg` straight into the
//! registered destinations, and acknowledges only once the bytes are there. A READ is
//! the mirror image. A refused request fails its batch with the target's reason
//! (`OutOfBounds`, `NotRegistered`, `InvalidRequest`) and is logged at the target; a
//! malformed frame closes that one connection with a `Protocol` error. The wire format is in the `wire` module's docs.
//!
//! Threads: every connection of every tcp backend in the process, initiator and target
//! side, runs as a few tasks on one fixed set of I/O threads (`te-tcp-io`, one per
//! core; a tokio runtime over epoll), so threads do not grow with peers or
//! connections: 200 peers × 4 connections run on the same threads as one. Sockets are
//! non-blocking; a task tries the system call first and waits in epoll only when the
//! kernel has no bytes or no room, so nothing spins and an idle connection costs no
//! wake-up.
//!
//! Completion: each connection has a receiver task that matches responses to slices
//! and completes a batch when its last slice is answered; a submitting thread that
//! finds a connection idle writes its frames itself without blocking, and a sender
//! task per connection writes the rest whenever the socket has room.
//! A connection that breaks fails every batch with slices on it with `PeerUnreachable`
//! at once (a killed peer's kernel resets the connection); the engine then reconnects
//! on next use. Deregistration waits for transfers touching the region on either side,
//! so no byte is read or written after `deregister` returns; dropping the backend
//! waits (at most `io_timeout`) for its tasks to end.
//!
//! Device memory (`cuda:0`, `fakedev:0`, any runtime in `te_core::device`): sockets
//! cannot touch it, so its slices are staged through pinned host memory, one ring per
//! connection, direction and runtime, allocated once with the runtime's
//! `alloc_pinned` and handed out by bytes. A frame's pieces are packed one after
//! another in one range and copied as one group of copies (adjacent pieces as one copy), which
//! synchronises once per frame rather than once per block, on either side (pieces that
//! write the same device bytes, a batch writing them twice, in groups one after another,
//! in order). A sender
//! copies frame k+1 from the device while frame k goes out on the socket; a receiver
//! receives frame k+1 while frame k is copied to the device, and the target
//! acknowledges a WRITE once its copies have completed (a responder task sends that
//! connection's responses in order as their copies complete).
//! Copies complete through the runtime's callback. A failed copy fails its batch with
//! the runtime's error; checks, rights and deregistration work as for host memory
//! (deregistration also waits for copies of the region in flight).
//!
//! A peer that is a tcp backend of this same process (its endpoint is one this
//! process published) gets its device-to-device frames, where both regions are on one
//! runtime and device, as one group of device copies instead (`local_copies`): the
//! frame is admitted against the target's registrations as a served frame is, and both
//! regions stay pinned until the copies end. Pieces of a batch that overlap one another
//! (a region moved into itself) are never in one group: each such piece waits for the
//! group before it to end. Everything else still goes over its connections.
//!
//! A peer in another process of this host, proven so by a channel on an abstract Unix
//! socket that only the process behind its authenticated data connection can open,
//! gets its frames through that channel (`local_ipc`): the target admits each request
//! as a served frame and copies it itself — host memory with cross-memory attach,
//! device memory of one runtime through the runtime's IPC handles as one device group
//! (entries that overlap one another in groups one after another, as above).
//! [`TcpBackend::peer_path`] says which path a peer takes; see `samehost.rs`.
//!
//! # Options (`[backends.tcp]`)
//!
//! The keys are the fields of [`TcpConfig`], each documented there, with their
//! defaults in its `Default`; the shipped `plugins.toml` shows every key (a test
//! keeps the two in step).
//!
//! Sizes are numbers of bytes or strings like `"64KiB"`; durations are strings like
//! `"250ms"`. The reasons for the defaults, with measurements, are in
//! `docs/decisions.md`.
//!
//! A served connection's responses wait in a queue of at most 256; while it is full the
//! target reads no more requests from that peer (TCP throttles it), and a peer that
//! reads none of its responses for `io_timeout` is cut off, releasing every pin its
//! requests held. Refusals are buffered up to 64 KiB before they are sent.
//!
//! A WRITE into host memory whose payload stops arriving part way (the initiator died
//! or the network broke) leaves a torn range; the target logs it as a warning naming
//! the peer, region and range. Device-memory WRITEs are staged whole before their copy,
//! so they are never torn.
//!
//! The data listener never stops on a failed `accept` (out of descriptors or memory):
//! it backs off (5 ms doubling to 200 ms), logs once per burst, and accepts again when
//! it can.
//!
//! Deadlines: a task per backend wakes at the earliest deadline of the batches in
//! flight. A batch that is still unfinished then has its unwritten slices dropped; a
//! connection that carries one of its written slices (or is receiving its answer) is
//! left alone while answers, sends or its staging copies still move (the batch's late
//! answers are dropped, never placed), and closed once nothing moved on it for 250 ms
//! with no staging copy running. So a batch on a stalled or partitioned peer completes
//! with `Timeout` about 250 ms after its deadline, not after `io_timeout`, and no late
//! byte lands in the caller's memory.
//! Other batches on a closed connection fail with `PeerUnreachable`; the engine
//! reconnects on next use. An abort (a cancel, or a deregistration of a region the
//! batch uses) is handled the same way, at once.
//!
//! # Limits
//! A target that vanishes without a reset (a host that loses power)
//! is found by the `io_timeout` or TCP keepalive, not at once; the batch's own deadline
//! still ends the wait for its caller.
//!
//! # Layout
//! Named by role, as in every te backend: `backend` (the `TransferBackend`), `state`
//! (what its tasks share), `peers`, `completion` (how a batch completes), `errors`,
//! `endpoint`, `config`, `regions` (the kit's table). Then the two sides apart:
//! `initiator` (planning, data connections, the deadline watcher, in-process copies)
//! and `target` (the listener and its responder); `samehost` has both sides of the
//! same-host channel. Beneath them: `handshake`, `wire`, `sock` (a connection's socket),
//! `runtime` (the I/O threads), `stage` (pinned staging memory) and `waves` (device
//! copies that overlap one another, in groups one after another).

#![warn(missing_debug_implementations, missing_docs, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]

use te_core::{BackendContext, BackendType, Result};

mod backend;
mod completion;
mod config;
mod endpoint;
mod errors;
mod handshake;
mod initiator;
mod peers;
mod regions;
mod runtime;
mod samehost;
mod sock;
mod stage;
mod state;
mod target;
#[cfg(test)]
mod tests;
mod waves;
mod wire;

pub use backend::TcpBackend;
pub use config::TcpConfig;
pub use peers::PeerPath;

/// The TCP backend's registry name.
pub const NAME: &str = "tcp";

impl BackendType for TcpBackend {
    const NAME: &'static str = NAME;
    type Config = TcpConfig;

    fn create(config: TcpConfig, ctx: &BackendContext) -> Result<Self> {
        TcpBackend::new(config, ctx)
    }
}

te_core::register_backend!(TcpBackend);
