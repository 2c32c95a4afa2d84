//! A test fixture: a library that looks like a te backend plugin built against a newer
//! te-core (0.2.0), exported as `libte_newer_core.so` expects. It is compiled by
//! `tests/plugin_misbehaviour.rs` at run time against abi_stable alone; te refuses it
//! with a message that says which te-core the plugin was built for.

use abi_stable::library::{
    __call_root_module_loader, CheckTypeLayout, LibHeader, RootModule, RootModuleResult,
};
use abi_stable::prefix_type::PrefixTypeTrait;
use abi_stable::std_types::RStr;
use abi_stable::{declare_root_module_statics, sabi_types::VersionStrings, StableAbi};

/// The root module, with fields te-core's `PluginModule` does not have.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PluginModuleRef)))]
#[sabi(missing_field(panic))]
pub struct PluginModule {
    /// Not te's plugin ABI field type.
    pub abi: u64,
    /// A name.
    pub name: RStr<'static>,
    /// A function te's module does not have.
    #[sabi(last_prefix_field)]
    pub frobnicate: extern "C" fn(u64) -> u64,
}

impl RootModule for PluginModuleRef {
    declare_root_module_statics! {PluginModuleRef}
    const BASE_NAME: &'static str = "te_plugin";
    const NAME: &'static str = "te_plugin";
    // A newer te-core than this te: the version check must catch it, and say so.
    const VERSION_STRINGS: VersionStrings = VersionStrings::new("0.2.0");
}

extern "C" fn frobnicate(x: u64) -> u64 {
    x + 1
}

fn module() -> PluginModuleRef {
    PluginModule {
        abi: 1,
        name: RStr::from_str("mismatch"),
        frobnicate,
    }
    .leak_into_prefix()
}

extern "C" fn constructor() -> RootModuleResult {
    __call_root_module_loader(module)
}

/// The header te's loader reads, under the name it expects for `libte_newer_core.so`.
#[export_name = "te_plugin_te_newer_core"]
pub static HEADER: LibHeader = {
    // SAFETY: `constructor` returns a `PluginModuleRef`, the type named here.
    unsafe { LibHeader::from_constructor::<PluginModuleRef>(constructor, CheckTypeLayout::Yes) }
};
