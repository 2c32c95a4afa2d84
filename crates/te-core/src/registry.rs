//! The backend registry: backends compiled in and backends loaded from plugin directories,
//! found by name.
//!
//! Nothing here lists backends. A backend crate registers itself with
//! [`register_backend!`](crate::register_backend); the facade links the crates its Cargo
//! features enable; plugin directories add whatever `libte_*.so` they hold.
//!
//! **Duplicates.** When one name is found more than once, the first one in this order
//! is used: plugin directories in the order the configuration lists them (files in one
//! directory by file name), then the built-in backend. So a plugin overrides the
//! built-in backend of the same name, and an operator can ship a fixed backend without
//! rebuilding the application. `te info` lists every entry, marking the shadowed ones.

use crate::sync::Mutex;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::backend::{BackendConfig, BackendContext, TransferBackend};
use crate::error::{Error, ErrorKind, Result};
use crate::plugin::{self, PluginModuleRef};

/// A compiled-in backend, submitted by [`register_backend!`](crate::register_backend).
#[derive(Debug)]
pub struct BackendFactory {
    /// The registry name, owned by the backend crate (`te_stub::NAME`).
    pub name: &'static str,
    /// The backend crate's version.
    pub version: &'static str,
    /// Says whether the backend can run here (library present, devices present), and
    /// if not, why.
    pub probe: fn() -> Result<()>,
    /// Creates an instance from its context.
    pub create: fn(&BackendContext) -> Result<Arc<dyn TransferBackend>>,
    /// Parses and validates the context's `[backends.NAME]` table without creating
    /// anything, where the backend registered by type ([`BackendType`]).
    pub check: Option<fn(&BackendContext) -> Result<()>>,
    /// The keys its `[backends.NAME]` table takes, where the backend registered by
    /// type: the fields of its [`BackendConfig`], whose docs are each key's one
    /// documentation (`tests/shipped_config.rs` holds plugins.toml to them).
    pub options: fn() -> &'static [&'static str],
}

inventory::collect!(BackendFactory);

/// A backend the registry builds by type: its name, its `[backends.NAME]` table and
/// its constructor. A backend crate implements it once and registers with
/// `te_core::register_backend!(MyBackend);`.
pub trait BackendType: TransferBackend + Sized {
    /// The registry name (`[engine] backend = "…"`), also the crate's `NAME`.
    const NAME: &'static str;
    /// The `[backends.NAME]` table, parsed (unknown keys refused) and validated
    /// before `create`.
    type Config: BackendConfig;

    /// Says whether the backend can run here (library present, devices present), and
    /// if not, why. The default: it always can.
    ///
    /// # Errors
    /// `Unavailable`, saying what is missing.
    fn probe() -> Result<()> {
        Ok(())
    }

    /// Builds an instance from its parsed table and the engine's context.
    ///
    /// # Errors
    /// Whatever stops the backend from starting, with a message saying what to fix.
    fn create(config: Self::Config, ctx: &BackendContext) -> Result<Self>;
}

/// Builds a [`BackendType`] as the registry does: parses its `[backends.NAME]` table
/// from the context, then calls its `create`.
///
/// # Errors
/// `ConfigInvalid` for a bad table; otherwise what `create` returns.
pub fn build<B: BackendType + 'static>(ctx: &BackendContext) -> Result<Arc<dyn TransferBackend>> {
    Ok(Arc::new(B::create(ctx.config(B::NAME)?, ctx)?))
}

/// Parses a [`BackendType`]'s `[backends.NAME]` table from the context, creating
/// nothing: what `te check` uses for backends that cannot run here.
///
/// # Errors
/// `ConfigInvalid`, naming the offending key and the file.
pub fn check_table<B: BackendType>(ctx: &BackendContext) -> Result<()> {
    ctx.config::<B::Config>(B::NAME).map(|_| ())
}

/// The keys a [`BackendType`]'s table takes: its config's field names.
pub fn options<B: BackendType>() -> &'static [&'static str] {
    crate::config::fields::<B::Config>()
}

#[doc(hidden)]
pub fn __no_options() -> &'static [&'static str] {
    &[]
}

/// Registers a backend crate: as a built-in backend (through `inventory`) and as the
/// root module of its cdylib (symbol `te_plugin_<crate name>`). Once per crate:
///
/// ```ignore
/// te_core::register_backend!(MyBackend); // MyBackend: te_core::BackendType
/// ```
/// or, with plain functions, `te_core::register_backend!(NAME, probe, create)` with
/// `probe: fn() -> te_core::Result<()>` and
/// `create: fn(&te_core::BackendContext) -> te_core::Result<Arc<dyn TransferBackend>>`.
#[macro_export]
macro_rules! register_backend {
    ($name:expr, $probe:path, $create:path) => {
        $crate::register_backend!(@with_check $name, $probe, $create, None, $crate::registry::__no_options);
    };
    (@with_check $name:expr, $probe:path, $create:path, $check:expr, $options:expr) => {
        $crate::inventory::submit! {
            $crate::registry::BackendFactory {
                name: $name,
                version: env!("CARGO_PKG_VERSION"),
                probe: $probe,
                create: $create,
                check: $check,
                options: $options,
            }
        }

        #[doc(hidden)]
        #[export_name = concat!("te_plugin_", env!("CARGO_CRATE_NAME"))]
        pub static __TE_PLUGIN_HEADER: $crate::plugin::__LibHeader = {
            extern "C" fn __te_probe() -> $crate::__abi::RResult<(), $crate::FfiError> {
                $crate::plugin::__probe($probe)
            }
            extern "C" fn __te_create(
                ctx: $crate::__abi::RSlice<'_, u8>,
                hook: $crate::plugin::FfiHookBox,
            ) -> $crate::__abi::RResult<$crate::plugin::FfiBackendBox, $crate::FfiError> {
                $crate::plugin::__create(ctx, hook, $create)
            }
            fn __te_module() -> $crate::plugin::PluginModuleRef {
                $crate::plugin::__module($name, env!("CARGO_PKG_VERSION"), __te_probe, __te_create)
            }
            extern "C" fn __te_constructor() -> $crate::plugin::__RootModuleResult {
                $crate::plugin::__call_root_module_loader(__te_module)
            }
            // SAFETY: `__te_constructor` returns the `PluginModuleRef` named as the type
            // parameter, which is what `from_constructor` requires.
            unsafe {
                $crate::plugin::__LibHeader::from_constructor::<$crate::plugin::PluginModuleRef>(
                    __te_constructor,
                    $crate::plugin::__CheckTypeLayout::Yes,
                )
            }
        };
    };
    ($backend:ty) => {
        #[doc(hidden)]
        fn __te_backend_probe() -> $crate::Result<()> {
            <$backend as $crate::registry::BackendType>::probe()
        }
        #[doc(hidden)]
        fn __te_backend_create(
            ctx: &$crate::BackendContext,
        ) -> $crate::Result<::std::sync::Arc<dyn $crate::TransferBackend>> {
            $crate::registry::build::<$backend>(ctx)
        }
        $crate::register_backend!(
            @with_check <$backend as $crate::registry::BackendType>::NAME,
            __te_backend_probe,
            __te_backend_create,
            Some($crate::registry::check_table::<$backend>),
            $crate::registry::options::<$backend>
        );
    };
}

/// Where a registry entry came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// Linked into this program.
    BuiltIn,
    /// Loaded from this plugin file.
    Plugin(PathBuf),
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::BuiltIn => f.write_str("built-in"),
            Origin::Plugin(p) => write!(f, "plugin {}", p.display()),
        }
    }
}

#[derive(Clone, Copy)]
enum Source {
    BuiltIn(&'static BackendFactory),
    Plugin(PluginModuleRef),
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::BuiltIn(b) => write!(f, "BuiltIn({})", b.name),
            Source::Plugin(m) => write!(f, "Plugin({})", m.name()),
        }
    }
}

/// One backend the registry knows, with where it came from and whether it can run here.
#[derive(Debug, Clone)]
pub struct Entry {
    name: String,
    version: String,
    origin: Origin,
    available: Result<()>,
    shadowed: bool,
    source: Source,
}

impl Entry {
    /// The registry name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The backend crate's version.
    pub fn version(&self) -> &str {
        &self.version
    }
    /// Built in, or the plugin's path.
    pub fn origin(&self) -> &Origin {
        &self.origin
    }
    /// `Ok` if it can run here, else why not.
    pub fn available(&self) -> &Result<()> {
        &self.available
    }
    /// True if an earlier entry of the same name is used instead (see the module docs).
    pub fn is_shadowed(&self) -> bool {
        self.shadowed
    }
    /// The keys its `[backends.NAME]` table takes, for a built-in backend registered by
    /// type (its config's fields); `None` for a plugin or a backend registered with
    /// plain functions.
    pub fn options(&self) -> Option<&'static [&'static str]> {
        match self.source {
            Source::BuiltIn(f) if f.check.is_some() => Some((f.options)()),
            _ => None,
        }
    }

    /// Parses the context's `[backends.NAME]` table without creating the backend:
    /// `None` where this entry cannot (a plugin, or a backend registered by functions
    /// rather than by type), so only [`create`](Self::create) can tell.
    ///
    /// # Errors
    /// `ConfigInvalid`, naming the offending key and the file.
    pub fn check_table(&self, ctx: &BackendContext) -> Option<Result<()>> {
        match self.source {
            Source::BuiltIn(f) => f.check.map(|check| check(ctx)),
            Source::Plugin(_) => None,
        }
    }

    /// Creates the backend.
    ///
    /// The probe answers for the default settings; a configuration may name what the
    /// probe could not find (a vendor library's path), so creation is always tried, and
    /// a backend that cannot run returns the reason from its constructor.
    ///
    /// # Errors
    /// Whatever the backend's constructor returns: an invalid table, a missing device
    /// or vendor library.
    pub fn create(&self, ctx: &BackendContext) -> Result<Arc<dyn TransferBackend>> {
        let created = match self.source {
            Source::BuiltIn(f) => (f.create)(ctx),
            Source::Plugin(m) => plugin::create(m, ctx),
        };
        created.map_err(|e| e.with_operation("create backend"))
    }
}

/// A plugin file that could not be used, and why.
#[derive(Debug, Clone)]
pub struct PluginProblem {
    /// The file or directory.
    pub path: PathBuf,
    /// Why it was not used.
    pub error: Error,
}

/// All backends known to this process with a given set of plugin directories.
#[derive(Debug, Clone)]
pub struct Registry {
    entries: Vec<Entry>,
    problems: Vec<PluginProblem>,
}

/// Plugin libraries loaded in this process, by canonical path; a library is loaded
/// once and never unloaded. A refusal is not kept: the next discovery tries the file
/// again, so a plugin rebuilt as its refusal asks is taken without a restart.
static LOADED: Mutex<Option<HashMap<PathBuf, PluginModuleRef>>> = Mutex::new(None);

fn load_once(path: &Path) -> Result<PluginModuleRef> {
    let key = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let mut loaded = LOADED.lock();
    let loaded = loaded.get_or_insert_with(HashMap::new);
    if let Some(module) = loaded.get(&key) {
        return Ok(*module);
    }
    let module = plugin::load(path)?;
    loaded.insert(key, module);
    Ok(module)
}

/// Whether `path` names a plugin file (`libte_*.so`).
fn plugin_file_name(path: &Path) -> bool {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    name.starts_with("libte_") && name.ends_with(std::env::consts::DLL_SUFFIX)
}

fn plugin_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| plugin_file_name(p))
        .collect();
    files.sort();
    Ok(files)
}

impl Registry {
    /// The built-in backends, then whatever the plugin directories hold.
    ///
    /// Unusable plugin files and missing directories are recorded as
    /// [`problems`](Registry::problems), not errors: one broken plugin does not hide
    /// the others.
    pub fn discover(plugin_dirs: &[PathBuf]) -> Registry {
        let mut entries = Vec::new();
        let mut problems = Vec::new();
        for dir in plugin_dirs {
            let files = match plugin_files(dir) {
                Ok(f) => f,
                Err(e) => {
                    problems.push(PluginProblem {
                        path: dir.clone(),
                        error: Error::new(ErrorKind::Unavailable, "cannot read plugin directory")
                            .with_operation("discover plugins")
                            .with_source(e),
                    });
                    continue;
                }
            };
            for path in files {
                match load_once(&path) {
                    Ok(module) => {
                        let (name, version, available) = plugin::describe(module);
                        entries.push(Entry {
                            name,
                            version,
                            origin: Origin::Plugin(path),
                            available,
                            shadowed: false,
                            source: Source::Plugin(module),
                        });
                    }
                    Err(error) => problems.push(PluginProblem { path, error }),
                }
            }
        }
        let mut builtins: Vec<&'static BackendFactory> =
            inventory::iter::<BackendFactory>().collect();
        builtins.sort_by_key(|f| f.name);
        for f in builtins {
            entries.push(Entry {
                name: f.name.to_string(),
                version: f.version.to_string(),
                origin: Origin::BuiltIn,
                available: (f.probe)(),
                shadowed: false,
                source: Source::BuiltIn(f),
            });
        }
        for i in 0..entries.len() {
            entries[i].shadowed = entries[..i].iter().any(|e| e.name == entries[i].name);
        }
        Registry { entries, problems }
    }

    /// Every entry, shadowed ones included, in resolution order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// Plugin files and directories that could not be used.
    pub fn problems(&self) -> &[PluginProblem] {
        &self.problems
    }

    /// The distinct names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.entries.iter().map(|e| e.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        names
    }

    /// The entry `name` resolves to.
    ///
    /// # Errors
    /// `Unavailable` when no entry has the name but its plugin file (`libte_<name>.so`)
    /// was refused, with the loader's reason (what to rebuild); `ConfigInvalid` for an
    /// unknown name otherwise, listing the available names and any plugin directory
    /// that could not be read.
    pub fn get(&self, name: &str) -> Result<&Entry> {
        if let Some(entry) = self.entries.iter().find(|e| e.name == name) {
            return Ok(entry);
        }
        // A refused plugin's name is unknown: its file name is all there is to go by.
        let file = format!("libte_{name}{}", std::env::consts::DLL_SUFFIX);
        let refused: Vec<String> = self
            .problems
            .iter()
            .filter(|p| p.path.file_name().and_then(|n| n.to_str()) == Some(file.as_str()))
            .map(|p| p.error.to_string())
            .collect();
        if !refused.is_empty() {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!(
                    "no usable backend named `{name}`: its plugin was refused: {}",
                    refused.join("; ")
                ),
            )
            .with_operation("find backend"));
        }
        let unread: Vec<String> = self
            .problems
            .iter()
            .filter(|p| !plugin_file_name(&p.path))
            .map(|p| format!("{} ({})", p.path.display(), p.error))
            .collect();
        let unread = if unread.is_empty() {
            String::new()
        } else {
            format!(
                "; plugin directories that could not be read: {}",
                unread.join(", ")
            )
        };
        Err(Error::new(
            ErrorKind::ConfigInvalid,
            format!(
                "no backend named `{name}`; available: {} (a plugin may also be missing from plugin_dirs){unread}",
                self.names().join(", ")
            ),
        )
        .with_operation("find backend"))
    }
}
