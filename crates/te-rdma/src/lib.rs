//! te-rdma: the RDMA backend, on ibverbs, for host memory and CUDA memory.
//!
//! The engine's control plane exchanges segment descriptors; this backend's endpoint in
//! them names its devices (name, link layer, RoCE GID types) and its **instance id**
//! (the engine's epoch, so a restarted engine is a new peer). Each region is registered
//! with every device and its key bytes carry one rkey per device. `connect` runs the
//! connect exchange (modules `exchange` and `connect`) as one request and answer on the
//! engine's control-plane hook, so it is authenticated by `[engine] auth_token`, bounded
//! by the control plane's limits and carries the caller's deadline; te-rdma runs no
//! listener of its own. For each path — an RC queue pair per (local NIC, peer NIC)
//! pair, `qps_per_path` times — the request carries its QP number, PSN, LID, GID and its
//! type, MTU and READ depth; the target builds its half (at most `qps_per_path` × device
//! pairs of them per request, at most two sets per initiator), moves it INIT → RTR →
//! RTS and answers with its own, and the initiator does the same (module `qp` lists
//! every attribute). The target keeps a set, per initiator engine name and epoch (as
//! the control plane authenticated them), until the initiator releases it
//! (disconnect, replacement, closing), a newer set of the same initiator pushes it
//! out, the control plane says the initiator's engine left or restarted
//! (`MessageHandler::peer_gone`), `max_served_qps` pushes out the oldest (those of an
//! initiator whose name came back with another epoch first), or the backend closes.
//! A broken session alone frees nothing: the initiator may be back with the same
//! epoch, its QPs still working. A peer
//! that dies is noticed by its QPs' transport errors (retries exhausted) and by the
//! engine's session to it; its QPs are moved to the error state, failing what was in
//! flight with `PeerUnreachable`.
//!
//! A batch is cut into slices of at most `slice_size` bytes (default 64 KiB), dealt
//! round-robin over the peer's healthy paths, NIC pairs first (module `plan`). Each
//! slice is one RDMA WRITE or READ work request with one scatter-gather entry (module
//! `wr`); a QP has at most `max_outstanding` work requests posted, the rest wait in its
//! queue and are posted as completions free room; one in `signal_every` work requests
//! is signalled, and always the last of a post (module `completion`).
//!
//! Completion: one thread per device waits in poll(2) on the device's completion
//! channel, takes the event (`ibv_get_cq_event`), acknowledges it, re-arms the CQ and
//! drains it; nothing spins. A batch completes only when every one of its slices is
//! accounted for. A transport or flush error (`RETRY_EXC`, `RNR_RETRY_EXC`,
//! `WR_FLUSH`, …) moves its slice to another healthy path of the same peer; any other
//! error (remote access, local protection, invalid request) fails the batch and leaves
//! the other paths alone. A failed QP is moved to the error state, its work comes back
//! flushed and moves on, and the peer's paths are rebuilt in the background; a peer
//! with no healthy path fails its batches with `PeerUnreachable`. A second thread per
//! device takes its async events: a port going down or a fatal QP error fails the
//! paths it hits at once. Disconnecting, replacing or losing a peer moves its QPs to
//! the error state and waits for their flush completions before anything fails and
//! any region is unpinned.
//!
//! The engine's deadline and cancel reach a batch through `abort`: its slices not yet
//! posted are never posted, the posted ones complete as the NICs complete them, and
//! the batch is released only then.
//!
//! Every call that can wait takes the caller's deadline: `connect` ends its exchange
//! by it or by `connect_timeout`, whichever is sooner; `disconnect` waits for its QPs'
//! flushes until it; `deregister` waits until it for the slices that pin the region,
//! and returns `Timeout`, not `Ok`, while one may still move bytes (the region stays
//! refused to new batches, its MRs in place, and a later call finishes the job). Its
//! `Ok` means the region's MRs are destroyed: no NIC accepts any of its keys.
//!
//! Regions are registered with LOCAL_WRITE and only the remote rights their `Access`
//! grants; a local-only region publishes no key. A region inside another (the slot of
//! a KV layout) gets MRs of its own over its bytes, so its rkeys bound what a peer
//! reaches to the slot, whatever the peer's descriptor says. CUDA memory is moved by
//! the NICs nearest to its GPU on the PCIe tree (or those `nic_affinity` names).
//!
//! CUDA memory (`cuda:N`) is exported as a DMA-BUF (`cuMemGetHandleForAddressRange`,
//! the driver loaded at run time through cudarc) and registered with
//! `ibv_reg_dmabuf_mr`; where that fails, plain `ibv_reg_mr` (nvidia-peermem) is tried;
//! where both fail, or no driver is present, registration is refused saying why.
//!
//! libibverbs is loaded at run time (`dlopen`), so the backend registers everywhere:
//! on a machine without libibverbs, RDMA devices or an active port, [`probe`] and
//! `te info` say why, and creating the backend returns that error.
//!
//! # Options (`[backends.rdma]`)
//!
//! The keys are the fields of [`RdmaConfig`], each documented there, with their
//! defaults in its `Default`; the shipped `plugins.toml` shows every key (a test
//! keeps the two in step).
//!
//! See `docs/rdma.md` for requirements, two-host commands and what was verified.
//!
//! # Layout
//! Named by role, as in every te backend: `backend` (the `TransferBackend`), `state`
//! (what its threads share), `peers`, `completion` (how a batch completes, a QP's work
//! requests in order), `errors`, `endpoint`, `config`, `regions` (MRs in the kit's
//! table). The data path is `path` (posting, settling, retrying, retiring a peer's QPs)
//! over `plan`, `wr` and `qp`; `connect` and `exchange` set up QP sets over the
//! engine's control plane; `context`, `device`, `verbs` and `ffi` wrap libibverbs.

#![warn(missing_debug_implementations, missing_docs, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]

use te_core::{BackendContext, BackendType, Result};

mod backend;
mod completion;
mod config;
mod connect;
mod context;
#[cfg(feature = "cuda")]
mod cuda;
mod device;
mod endpoint;
mod errors;
mod exchange;
mod ffi;
mod path;
mod peers;
mod plan;
mod qp;
mod reader;
mod regions;
mod state;
mod topology;
mod verbs;
mod wr;

pub use backend::RdmaBackend;
pub use config::RdmaConfig;

/// The RDMA backend's registry name.
pub const NAME: &str = "rdma";

/// The environment variable that names the verbs library to load instead of libibverbs
/// (a path, or a file name the dynamic loader finds): tests point it at the fake
/// provider `libfakeverbs.so`. Read once, when the backend is first probed or created.
pub const VERBS_LIB_ENV: &str = "TE_RDMA_VERBS_LIB";

/// Says whether the backend can run here: libibverbs loads and lists RDMA devices.
///
/// # Errors
/// `Unavailable` with the reason (`libibverbs not found …`, `no RDMA devices: …`).
pub fn probe() -> Result<()> {
    backend::probe()
}

impl BackendType for RdmaBackend {
    const NAME: &'static str = NAME;
    type Config = RdmaConfig;

    fn probe() -> Result<()> {
        backend::probe()
    }

    fn create(config: RdmaConfig, ctx: &BackendContext) -> Result<Self> {
        create(config, ctx)
    }
}

fn create(config: RdmaConfig, ctx: &BackendContext) -> Result<RdmaBackend> {
    let epoch = ctx.epoch_or_random();
    if ctx.hook.is_connected() {
        return RdmaBackend::with_hook(config, epoch, ctx.hook.clone());
    }
    // Outside an engine (a tool, a test below the engine): the exchange needs a
    // control plane to reach engines, so the backend runs te-core's, with the
    // context's name and token, and also reaches backends of this process made the
    // same way directly.
    backend::probe()?;
    let mut engine = te_core::EngineConfig::default();
    engine.name = ctx.engine.clone();
    engine.auth_token = ctx.auth_token.clone();
    let control = te_core::StandaloneControl::start(&engine, epoch)?;
    RdmaBackend::outside_engine(config, epoch, control)
}

te_core::register_backend!(RdmaBackend);

#[cfg(test)]
mod tests {
    use super::*;
    use te_core::ErrorKind;

    #[test]
    fn without_rdma_devices_probe_and_create_say_why_instead_of_panicking() {
        let Err(why) = probe() else {
            return; // A machine with RDMA devices: covered by the hardware test in docs/rdma.md.
        };
        assert_eq!(why.kind(), ErrorKind::Unavailable);
        let text = why.to_string();
        assert!(
            text.contains("no RDMA devices") || text.contains("libibverbs not found"),
            "{text}"
        );
        let ctx = BackendContext {
            epoch: 0,
            engine: "t".into(),
            table: toml::Table::new(),
            source: "test".into(),
            ..Default::default()
        };
        let e = te_core::registry::build::<RdmaBackend>(&ctx).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        assert_eq!(e.message(), why.message());
    }

    #[test]
    fn the_backend_is_in_the_registry_even_where_it_cannot_run() {
        let r = te_core::Registry::discover(&[]);
        let entry = r.get(NAME).expect("rdma registers itself");
        assert_eq!(entry.available().is_ok(), probe().is_ok());
    }

    #[test]
    fn a_bad_table_is_refused_before_any_device_is_touched() {
        let ctx = BackendContext {
            epoch: 0,
            engine: "t".into(),
            table: "slice_sise = 4096".parse().unwrap(),
            source: "rdma.toml".into(),
            ..Default::default()
        };
        let e = te_core::registry::build::<RdmaBackend>(&ctx).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ConfigInvalid);
        assert!(e.to_string().contains("slice_sise"), "{e}");
    }
}
