//! Backends as plugins: the layout-checked boundary between te and a backend cdylib.
//!
//! A backend crate calls [`register_backend!`](crate::register_backend) once; that both
//! submits it to the built-in registry and exports a root module under the symbol
//! `te_plugin_<crate name>` (so several backends linked into one binary do not clash).
//! The loader finds `libte_<x>.so`, looks up `te_plugin_te_<x>`, and lets `abi_stable`
//! compare the module's type layouts and te-core version with its own before anything
//! is called: a plugin built against another te-core is refused with a message.
//!
//! Across the boundary, plain-data types ([`TransferRequest`], [`Completion`], ids) go
//! as they are; descriptors go encoded, as they go on the wire.

// `#[sabi_trait]` implements foreign traits for the types it generates inside a const.
#![allow(non_local_definitions)]

use std::fmt;
use std::mem::ManuallyDrop;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::Arc;

use abi_stable::library::{AbiHeaderRef, RawLibrary, RootModule};
use abi_stable::sabi_trait;
use abi_stable::std_types::{RBox, RResult, RSlice, RStr, RVec};
use abi_stable::{declare_root_module_statics, package_version_strings, StableAbi};
use serde::{Deserialize, Serialize};

use crate::backend::{
    from_ffi, to_ffi, BackendContext, BatchId, Completion, FfiError, TransferBackend,
};
use crate::codec;
use crate::desc::{BackendInfo, MemoryDesc, PeerId, RegionId, SegmentDesc, TransferRequest};
use crate::error::{Error, ErrorKind, Result};
use crate::hook::{ControlHook, HookTarget, MessageHandler, PeerInfo};
use crate::time::Deadline;

#[doc(hidden)]
pub use abi_stable::library::{
    __call_root_module_loader, CheckTypeLayout as __CheckTypeLayout, LibHeader as __LibHeader,
    RootModuleResult as __RootModuleResult,
};
#[doc(hidden)]
pub use abi_stable::prefix_type::PrefixTypeTrait as __PrefixTypeTrait;

/// te's own plugin protocol version, checked in addition to `abi_stable`'s layout
/// check; raised whenever the meaning (not only the layout) of the boundary changes.
pub const PLUGIN_ABI: u32 = 9;

/// A fingerprint of the sources of the types that cross the boundary encoded; a plugin
/// built from other sources is refused even when its te-core version matches.
pub const SCHEMA: &str = env!("TE_SCHEMA");

/// The backend object as it crosses the boundary.
#[sabi_trait]
pub trait FfiBackend: Send + Sync + Debug {
    /// Encoded [`BackendInfo`], or the error its panic became.
    fn info(&self) -> RResult<RVec<u8>, FfiError>;
    /// Endpoint bytes, or the error its panic became.
    fn endpoint(&self) -> RResult<RVec<u8>, FfiError>;
    /// Registers an encoded [`MemoryDesc`] as region `id`.
    fn register(&self, id: RegionId, mem: RSlice<'_, u8>) -> RResult<RVec<u8>, FfiError>;
    /// Deregisters region `id`.
    fn deregister(&self, id: RegionId, deadline: Deadline) -> RResult<(), FfiError>;
    /// Connects to an encoded [`SegmentDesc`].
    fn connect(&self, peer: RSlice<'_, u8>, deadline: Deadline) -> RResult<PeerId, FfiError>;
    /// Disconnects a peer.
    fn disconnect(&self, peer: PeerId, deadline: Deadline) -> RResult<(), FfiError>;
    /// Posts a batch.
    fn submit(
        &self,
        peer: PeerId,
        batch: RSlice<'_, TransferRequest>,
        done: Completion,
    ) -> RResult<(), FfiError>;
    /// Asks the backend to stop a batch.
    fn abort(&self, peer: PeerId, batch: BatchId);
    /// Encoded gauges of the backend's state, `Vec<(String, u64)>`.
    fn gauges(&self) -> RVec<u8>;
    /// Encoded `Option<String>`: how bytes to `peer` travel.
    fn path_to(&self, peer: PeerId) -> RVec<u8>;
    /// Lends the calling thread to the backend while it waits for a batch.
    #[sabi(last_prefix_field)]
    fn drive(&self, peer: PeerId, batch: BatchId, until: Deadline) -> bool;
}

/// A boxed backend object from a plugin.
pub type FfiBackendBox = FfiBackend_TO<'static, RBox<()>>;

/// The engine's control hook as it crosses the boundary (host side implements it).
#[sabi_trait]
pub trait FfiHook: Send + Sync {
    /// Serves the backend's message handler.
    fn serve(&self, handler: FfiHandlerBox) -> RResult<(), FfiError>;
    /// Sends a backend message to the engine at `peer`.
    #[sabi(last_prefix_field)]
    fn call(
        &self,
        peer: RStr<'_>,
        request: RSlice<'_, u8>,
        deadline: Deadline,
    ) -> RResult<RVec<u8>, FfiError>;
    /// Posts an encoded [`PeerEvent`](crate::PeerEvent) to the engine's peer events.
    fn post_event(&self, event: RSlice<'_, u8>) -> RResult<(), FfiError>;
}

/// A boxed control hook.
pub type FfiHookBox = FfiHook_TO<'static, RBox<()>>;

/// A backend's message handler as it crosses the boundary (plugin side implements it).
#[sabi_trait]
pub trait FfiHandler: Send + Sync {
    /// Answers a message from an encoded [`PeerInfo`].
    #[sabi(last_prefix_field)]
    fn handle(
        &self,
        from: RSlice<'_, u8>,
        request: RSlice<'_, u8>,
        deadline: Deadline,
    ) -> RResult<RVec<u8>, FfiError>;
    /// Says that a peer engine's life is gone for good (see
    /// [`MessageHandler::peer_gone`]).
    fn peer_gone(&self, name: RStr<'_>, epoch: u64);
}

/// A boxed message handler.
pub type FfiHandlerBox = FfiHandler_TO<'static, RBox<()>>;

/// The host's hook, exported to a plugin.
struct HostHook(ControlHook);

impl FfiHook for HostHook {
    fn serve(&self, handler: FfiHandlerBox) -> RResult<(), FfiError> {
        to_ffi(caught("serve", || {
            self.0.serve(Arc::new(PluginHandler(handler)))
        }))
    }
    fn call(
        &self,
        peer: RStr<'_>,
        request: RSlice<'_, u8>,
        deadline: Deadline,
    ) -> RResult<RVec<u8>, FfiError> {
        to_ffi(caught("call", || {
            self.0
                .call(peer.as_str(), request.as_slice(), deadline)
                .map(RVec::from)
        }))
    }
    fn post_event(&self, event: RSlice<'_, u8>) -> RResult<(), FfiError> {
        to_ffi(caught("post_event", || self.post(event.as_slice())))
    }
}

impl HostHook {
    fn post(&self, event: &[u8]) -> Result<()> {
        let event: crate::PeerEvent = codec::decode(event, "peer event")?;
        self.0.post_event(event)
    }
}

/// A plugin's handler, as the host calls it.
struct PluginHandler(FfiHandlerBox);

impl MessageHandler for PluginHandler {
    fn handle(&self, from: &PeerInfo, request: &[u8], deadline: Deadline) -> Result<Vec<u8>> {
        from_ffi(self.0.handle(
            codec::encode(from).as_slice().into(),
            request.into(),
            deadline,
        ))
        .map(RVec::into_vec)
    }

    fn peer_gone(&self, name: &str, epoch: u64) {
        self.0.peer_gone(name.into(), epoch)
    }
}

/// The plugin's own handler, exported to the host. The host drops it through an
/// `extern "C"` function, where a panic would abort the process, so its `Drop` drops
/// the handler under [`dropped_in_plugin`].
struct ExportedHandler(ManuallyDrop<Arc<dyn MessageHandler>>);

impl Drop for ExportedHandler {
    fn drop(&mut self) {
        // SAFETY: the field is taken only here, once, and `self` is not used again.
        let handler = unsafe { ManuallyDrop::take(&mut self.0) };
        dropped_in_plugin("its message handler", handler);
    }
}

impl FfiHandler for ExportedHandler {
    fn handle(
        &self,
        from: RSlice<'_, u8>,
        request: RSlice<'_, u8>,
        deadline: Deadline,
    ) -> RResult<RVec<u8>, FfiError> {
        to_ffi(caught("handle", || {
            let from: PeerInfo = codec::decode(from.as_slice(), "peer info")?;
            self.0
                .handle(&from, request.as_slice(), deadline)
                .map(RVec::from)
        }))
    }

    fn peer_gone(&self, name: RStr<'_>, epoch: u64) {
        let told = caught("peer_gone", || {
            self.0.peer_gone(name.as_str(), epoch);
            Ok(())
        });
        if let Err(e) = told {
            tracing::error!(error = %e, "a peer's departure did not reach the plugin's handler");
        }
    }
}

/// A plugin's view of its host's hook: what its backend's [`ControlHook`] calls.
struct PluginHook(FfiHookBox);

impl HookTarget for PluginHook {
    fn kind(&self) -> &'static str {
        "plugin"
    }

    fn serve(&self, handler: Arc<dyn MessageHandler>) -> Result<()> {
        let handler = FfiHandler_TO::from_value(
            ExportedHandler(ManuallyDrop::new(handler)),
            sabi_trait::TD_Opaque,
        );
        from_ffi(self.0.serve(handler))
    }

    fn call(&self, peer: &str, request: &[u8], deadline: Deadline) -> Result<Vec<u8>> {
        from_ffi(self.0.call(peer.into(), request.into(), deadline)).map(RVec::into_vec)
    }

    fn post_event(&self, event: crate::PeerEvent) -> Result<()> {
        from_ffi(self.0.post_event(codec::encode(&event).as_slice().into()))
    }
}

/// The root module every backend plugin exports.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PluginModuleRef)))]
#[sabi(missing_field(panic))]
pub struct PluginModule {
    /// [`PLUGIN_ABI`] of the te-core the plugin was built with.
    pub abi: u32,
    /// [`SCHEMA`] of the te-core the plugin was built with.
    pub schema: RStr<'static>,
    /// The backend's registry name.
    pub name: RStr<'static>,
    /// The backend crate's version.
    pub version: RStr<'static>,
    /// Says whether the backend can run here, and why not.
    pub probe: extern "C" fn() -> RResult<(), FfiError>,
    /// Creates the backend from an encoded context.
    #[sabi(last_prefix_field)]
    pub create:
        extern "C" fn(ctx: RSlice<'_, u8>, hook: FfiHookBox) -> RResult<FfiBackendBox, FfiError>,
}

impl fmt::Debug for PluginModule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PluginModule")
            .field("abi", &self.abi)
            .field("name", &self.name)
            .field("version", &self.version)
            .finish()
    }
}

impl RootModule for PluginModuleRef {
    declare_root_module_statics! {PluginModuleRef}
    const BASE_NAME: &'static str = "te_plugin";
    const NAME: &'static str = "te_plugin";
    const VERSION_STRINGS: abi_stable::sabi_types::VersionStrings = package_version_strings!();
}

#[derive(Serialize, Deserialize)]
struct FfiContext {
    engine: String,
    epoch: u64,
    auth_token: Option<String>,
    table: String,
    source: String,
    listen_host: Option<String>,
    advertise: Option<String>,
}

fn caught<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        // Its own `Drop` could panic, outside any `catch_unwind`: leak it instead.
        std::mem::forget(payload);
        Err(Error::new(
            ErrorKind::Backend,
            format!("the plugin panicked in {what}; this is a bug in the backend"),
        ))
    })
}

/// Drops `value` (a plugin's object, dropped because the host let go of it) so that a
/// panic in its `Drop` is logged instead of unwinding into the `extern "C"` drop
/// function the host called, which would abort the process. Whatever the panicking
/// `Drop` did not release stays leaked.
fn dropped_in_plugin<T>(what: &str, value: T) {
    if let Err(payload) = catch_unwind(AssertUnwindSafe(move || drop(value))) {
        std::mem::forget(payload);
        tracing::error!(
            "the plugin panicked while dropping {what}; this is a bug in the backend (what it held may have leaked)"
        );
    }
}

/// Builds the root module; used by [`register_backend!`](crate::register_backend).
#[doc(hidden)]
pub fn __module(
    name: &'static str,
    version: &'static str,
    probe: extern "C" fn() -> RResult<(), FfiError>,
    create: extern "C" fn(RSlice<'_, u8>, FfiHookBox) -> RResult<FfiBackendBox, FfiError>,
) -> PluginModuleRef {
    __PrefixTypeTrait::leak_into_prefix(PluginModule {
        abi: PLUGIN_ABI,
        schema: RStr::from_str(SCHEMA),
        name: RStr::from_str(name),
        version: RStr::from_str(version),
        probe,
        create,
    })
}

/// The plugin side of `probe`.
#[doc(hidden)]
pub fn __probe(probe: fn() -> Result<()>) -> RResult<(), FfiError> {
    to_ffi(caught("probe", probe))
}

/// The plugin side of `create`.
#[doc(hidden)]
pub fn __create(
    ctx: RSlice<'_, u8>,
    hook: FfiHookBox,
    create: fn(&BackendContext) -> Result<Arc<dyn TransferBackend>>,
) -> RResult<FfiBackendBox, FfiError> {
    to_ffi(caught("create", || {
        let c: FfiContext = codec::decode(ctx.as_slice(), "backend context")?;
        let table = toml::from_str(&c.table).map_err(|e| {
            Error::new(
                ErrorKind::ConfigInvalid,
                format!("backend table did not cross the plugin boundary: {e}"),
            )
        })?;
        let backend = create(&BackendContext {
            engine: c.engine,
            epoch: c.epoch,
            auth_token: c.auth_token,
            hook: ControlHook::new(Arc::new(PluginHook(hook))),
            table,
            source: c.source,
            listen_host: c.listen_host,
            advertise: c.advertise,
        })?;
        Ok(FfiBackend_TO::from_value(
            Exported(ManuallyDrop::new(backend)),
            sabi_trait::TD_Opaque,
        ))
    }))
}

/// A backend exported through the boundary (plugin side). The host drops it, and
/// formats it, through `extern "C"` functions, where a panic would abort the process:
/// its `Drop` drops the backend under [`dropped_in_plugin`], and its `Debug` catches a
/// panic of the backend's.
struct Exported(ManuallyDrop<Arc<dyn TransferBackend>>);

impl Drop for Exported {
    fn drop(&mut self) {
        // SAFETY: the field is taken only here, once, and `self` is not used again.
        let backend = unsafe { ManuallyDrop::take(&mut self.0) };
        dropped_in_plugin("its backend", backend);
    }
}

impl fmt::Debug for Exported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let backend: &dyn TransferBackend = &**self.0;
        let mut text = String::new();
        let formatted = catch_unwind(AssertUnwindSafe(|| {
            fmt::write(&mut text, format_args!("{backend:?}"))
        }));
        match formatted {
            Ok(Ok(())) => f.write_str(&text),
            Ok(Err(e)) => Err(e),
            Err(payload) => {
                std::mem::forget(payload);
                f.write_str("(the plugin panicked in Debug; this is a bug in the backend)")
            }
        }
    }
}

impl FfiBackend for Exported {
    fn info(&self) -> RResult<RVec<u8>, FfiError> {
        to_ffi(caught("info", || Ok(codec::encode(self.0.info()).into())))
    }
    fn endpoint(&self) -> RResult<RVec<u8>, FfiError> {
        to_ffi(caught("endpoint", || Ok(self.0.endpoint().into())))
    }
    fn register(&self, id: RegionId, mem: RSlice<'_, u8>) -> RResult<RVec<u8>, FfiError> {
        to_ffi(caught("register", || {
            let mem: MemoryDesc = codec::decode(mem.as_slice(), "memory descriptor")?;
            self.0.register(id, &mem).map(RVec::from)
        }))
    }
    fn deregister(&self, id: RegionId, deadline: Deadline) -> RResult<(), FfiError> {
        to_ffi(caught("deregister", || self.0.deregister(id, deadline)))
    }
    fn connect(&self, peer: RSlice<'_, u8>, deadline: Deadline) -> RResult<PeerId, FfiError> {
        to_ffi(caught("connect", || {
            self.0
                .connect(&SegmentDesc::decode(peer.as_slice())?, deadline)
        }))
    }
    fn disconnect(&self, peer: PeerId, deadline: Deadline) -> RResult<(), FfiError> {
        to_ffi(caught("disconnect", || self.0.disconnect(peer, deadline)))
    }
    fn submit(
        &self,
        peer: PeerId,
        batch: RSlice<'_, TransferRequest>,
        done: Completion,
    ) -> RResult<(), FfiError> {
        to_ffi(caught("submit", || {
            self.0.submit(peer, batch.as_slice(), done)
        }))
    }
    fn abort(&self, peer: PeerId, batch: BatchId) {
        let _ = caught("abort", || {
            self.0.abort(peer, batch);
            Ok(())
        });
    }
    fn gauges(&self) -> RVec<u8> {
        let gauges = caught("gauges", || Ok(self.0.gauges())).unwrap_or_default();
        codec::encode(&gauges).into()
    }
    fn path_to(&self, peer: PeerId) -> RVec<u8> {
        let path = caught("path_to", || Ok(self.0.path_to(peer))).unwrap_or_default();
        codec::encode(&path).into()
    }
    fn drive(&self, peer: PeerId, batch: BatchId, until: Deadline) -> bool {
        caught("drive", || Ok(self.0.drive(peer, batch, until))).unwrap_or(false)
    }
}

/// A backend loaded from a plugin (host side).
pub(crate) struct PluginBackend {
    inner: FfiBackendBox,
    info: BackendInfo,
    /// The endpoint the backend gave at creation: what is published if a later call
    /// panics (the trait's `endpoint` cannot fail).
    endpoint: Vec<u8>,
}

impl fmt::Debug for PluginBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PluginBackend({:?})", self.inner)
    }
}

impl TransferBackend for PluginBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }
    fn endpoint(&self) -> Vec<u8> {
        match from_ffi(self.inner.endpoint()) {
            Ok(endpoint) => endpoint.into_vec(),
            Err(e) => {
                tracing::error!(error = %e, "the plugin's endpoint failed; its endpoint from creation is used instead");
                self.endpoint.clone()
            }
        }
    }
    fn register(&self, id: RegionId, mem: &MemoryDesc) -> Result<Vec<u8>> {
        from_ffi(
            self.inner
                .register(id, codec::encode(mem).as_slice().into()),
        )
        .map(RVec::into_vec)
    }
    fn deregister(&self, id: RegionId, deadline: Deadline) -> Result<()> {
        from_ffi(self.inner.deregister(id, deadline))
    }
    fn connect(&self, peer: &SegmentDesc, deadline: Deadline) -> Result<PeerId> {
        from_ffi(
            self.inner
                .connect(peer.encode().as_slice().into(), deadline),
        )
    }
    fn disconnect(&self, peer: PeerId, deadline: Deadline) -> Result<()> {
        from_ffi(self.inner.disconnect(peer, deadline))
    }
    fn submit(&self, peer: PeerId, batch: &[TransferRequest], done: Completion) -> Result<()> {
        from_ffi(self.inner.submit(peer, batch.into(), done))
    }
    fn abort(&self, peer: PeerId, batch: BatchId) {
        self.inner.abort(peer, batch)
    }
    fn gauges(&self) -> Vec<(String, u64)> {
        codec::decode(self.inner.gauges().as_slice(), "the plugin's gauges").unwrap_or_default()
    }
    fn path_to(&self, peer: PeerId) -> Option<String> {
        codec::decode(self.inner.path_to(peer).as_slice(), "the plugin's path").unwrap_or_default()
    }
    fn drive(&self, peer: PeerId, batch: BatchId, until: Deadline) -> bool {
        self.inner.drive(peer, batch, until)
    }
}

/// The plugin's name and version, and its probe result.
pub(crate) fn describe(module: PluginModuleRef) -> (String, String, Result<()>) {
    let probe = from_ffi((module.probe())());
    (
        module.name().to_string(),
        module.version().to_string(),
        probe,
    )
}

/// Creates a backend through a plugin module.
pub(crate) fn create(
    module: PluginModuleRef,
    ctx: &BackendContext,
) -> Result<Arc<dyn TransferBackend>> {
    let table = toml::to_string(&ctx.table).map_err(|e| {
        Error::new(
            ErrorKind::ConfigInvalid,
            format!("backend table cannot be re-encoded: {e}"),
        )
    })?;
    let encoded = codec::encode(&FfiContext {
        engine: ctx.engine.clone(),
        epoch: ctx.epoch,
        auth_token: ctx.auth_token.clone(),
        table,
        source: ctx.source.clone(),
        listen_host: ctx.listen_host.clone(),
        advertise: ctx.advertise.clone(),
    });
    let hook = FfiHook_TO::from_value(HostHook(ctx.hook.clone()), sabi_trait::TD_Opaque);
    let inner = from_ffi((module.create())(encoded.as_slice().into(), hook))?;
    // Both are asked for once here, so a backend that cannot answer them fails at
    // creation rather than at a peer's handshake.
    let info: BackendInfo = codec::decode(&from_ffi(inner.info())?, "backend info")?;
    let endpoint = from_ffi(inner.endpoint())?.into_vec();
    Ok(Arc::new(PluginBackend {
        inner,
        info,
        endpoint,
    }))
}

/// Loads the plugin library at `path` and checks its layout, te-core version and
/// plugin ABI. A library that passes abi_stable's checks stays loaded for the life of
/// the process, even when te's own checks refuse it; one that fails them is unloaded.
///
/// # Errors
/// `Unavailable` with the reason: not loadable, not a te plugin, built against an
/// incompatible te-core.
pub(crate) fn load(path: &Path) -> Result<PluginModuleRef> {
    let refuse = |why: String| {
        Err(Error::new(ErrorKind::Unavailable, why)
            .with_operation("load plugin")
            .with_context("path", path.display()))
    };
    let stem = path
        .file_stem()
        .and_then(|s| s.to_str())
        .and_then(|s| s.strip_prefix("lib"))
        .unwrap_or_default();
    let symbol = format!("te_plugin_{stem}\0");
    let raw = match RawLibrary::load_at(path) {
        Ok(raw) => raw,
        Err(e) => return refuse(format!("cannot load the library: {}", one_line(&e))),
    };
    // SAFETY: `get::<AbiHeaderRef>` yields the symbol's address as a reference; when the
    // symbol exists it is the `LibHeader` static `register_backend!` exports, which
    // starts with its `AbiHeader`, and `upgrade` checks that header before anything
    // else is read. The library is leaked below, so the `'static` references stay valid.
    let header = match unsafe { raw.get::<AbiHeaderRef>(symbol.as_bytes()) } {
        Ok(h) => *h,
        Err(_) => {
            return refuse(format!(
                "not a te backend plugin: it exports no `{}` (plugins keep the file name cargo gave them)",
                symbol.trim_end_matches('\0')
            ))
        }
    };
    let lib = match header.upgrade() {
        Ok(lib) => lib,
        Err(e) => {
            return refuse(format!(
                "built with an incompatible abi_stable, so not against this te's te-core; rebuild the plugin against this te (cargo build --workspace): {}",
                one_line(&e)
            ))
        }
    };
    let module = match lib.init_root_module::<PluginModuleRef>() {
        Ok(m) => m,
        Err(e) => {
            // The version first: abi_stable's own message leads with its layout dump,
            // which is long and cut.
            let theirs = lib.version_strings().version;
            let ours = env!("CARGO_PKG_VERSION");
            let which = if theirs.as_str() == ours {
                format!("te-core {theirs}, the version this te uses, but from other sources (the layouts of the types it shares with te differ)")
            } else {
                format!("te-core {theirs} (this te uses te-core {ours})")
            };
            tracing::debug!(path = %path.display(), detail = %e, "a plugin failed abi_stable's checks");
            return refuse(format!(
                "built against an incompatible te-core: {which}; rebuild the plugin against this te (cargo build --workspace). abi_stable says: {}",
                one_line(&e)
            ));
        }
    };
    std::mem::forget(raw);
    if module.abi() != PLUGIN_ABI {
        return refuse(format!(
            "plugin ABI {} is not this te's plugin ABI {PLUGIN_ABI}; rebuild the plugin against this te (cargo build --workspace) and restart this process (the refused library stays loaded)",
            module.abi()
        ));
    }
    if module.schema().as_str() != SCHEMA {
        return refuse(format!(
            "built from other te-core sources (schema {} here {SCHEMA}); rebuild the plugin with this te (cargo build --workspace) and restart this process (the refused library stays loaded)",
            module.schema()
        ));
    }
    Ok(module)
}

fn one_line(e: &dyn fmt::Display) -> String {
    let text = e.to_string();
    let mut out = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if out.len() > 600 {
        let mut cut = 600;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::Mutex;

    /// Records the departures it hears of; panics on one named `panic`.
    #[derive(Default)]
    struct Departures(Mutex<Vec<(String, u64)>>);

    impl MessageHandler for Departures {
        fn handle(&self, _: &PeerInfo, _: &[u8], _: Deadline) -> Result<Vec<u8>> {
            Ok(Vec::new())
        }
        fn peer_gone(&self, name: &str, epoch: u64) {
            assert_ne!(name, "panic", "a handler that panics");
            self.0.lock().push((name.to_string(), epoch));
        }
    }

    /// The host's view of `handler` as a plugin exports it.
    fn across(handler: Arc<Departures>) -> PluginHandler {
        PluginHandler(FfiHandler_TO::from_value(
            ExportedHandler(ManuallyDrop::new(handler)),
            sabi_trait::TD_Opaque,
        ))
    }

    #[test]
    fn a_plugins_handler_hears_of_a_peer_gone_across_the_boundary() {
        let heard = Arc::new(Departures::default());
        let host = across(heard.clone());
        host.peer_gone("prefill-0", 7);
        // A panic stays in the plugin (an unwind into the host would abort it).
        host.peer_gone("panic", 8);
        assert_eq!(*heard.0.lock(), vec![("prefill-0".to_string(), 7)]);
    }
}
