//! Plugin loading: a good plugin is found, a plugin with another layout and a library
//! that is no plugin are refused with a message, and neither hides the other plugins.

use std::path::{Path, PathBuf};

use te::{Config, Engine, ErrorKind, Origin};
use te_core::testkit::built_plugin;
use te_core::Registry;

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("te-plugins-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}

fn copy(from: &Path, dir: &Path, name: &str) -> PathBuf {
    let to = dir.join(format!("lib{name}{}", std::env::consts::DLL_SUFFIX));
    std::fs::copy(from, &to).expect("copy plugin");
    to
}

#[test]
fn a_plugin_built_against_another_te_core_layout_is_refused_with_a_message() {
    let dir = scratch("abi");
    let bad = copy(
        &built_plugin("abi_mismatch_fixture"),
        &dir,
        "te_abi_mismatch",
    );
    let good = copy(&built_plugin("te_stub"), &dir, "te_stub");
    let registry = Registry::discover(std::slice::from_ref(&dir));
    let problem = registry
        .problems()
        .iter()
        .find(|p| p.path == bad)
        .unwrap_or_else(|| panic!("the mismatched plugin was not refused: {registry:?}"));
    assert_eq!(problem.error.kind(), ErrorKind::Unavailable);
    let msg = problem.error.to_string();
    assert!(
        msg.contains("incompatible te-core") && msg.contains("rebuild"),
        "{msg}"
    );
    // The good plugin next to it still loads.
    let stub = registry.get("stub").expect("stub");
    assert_eq!(stub.origin(), &Origin::Plugin(good));
    assert!(!registry.names().contains(&"mismatch"));
}

#[test]
fn a_library_that_is_no_plugin_is_refused_with_a_message() {
    let dir = scratch("noplugin");
    // The fixture exports only `te_plugin_te_abi_mismatch`, not `te_plugin_te_other`.
    let lib = copy(&built_plugin("abi_mismatch_fixture"), &dir, "te_other");
    std::fs::write(
        dir.join(format!("libte_garbage{}", std::env::consts::DLL_SUFFIX)),
        b"not elf",
    )
    .unwrap();
    let registry = Registry::discover(std::slice::from_ref(&dir));
    let msgs: Vec<String> = registry
        .problems()
        .iter()
        .map(|p| p.error.to_string())
        .collect();
    assert_eq!(msgs.len(), 2, "{msgs:?}");
    let other = registry
        .problems()
        .iter()
        .find(|p| p.path == lib)
        .expect("te_other refused");
    assert!(
        other
            .error
            .to_string()
            .contains("exports no `te_plugin_te_other`"),
        "{}",
        other.error
    );
    assert!(
        msgs.iter().any(|m| m.contains("cannot load the library")),
        "{msgs:?}"
    );
}

#[test]
fn a_missing_plugin_directory_is_reported_not_fatal() {
    let registry = Registry::discover(&[PathBuf::from("/nonexistent/te-plugins")]);
    assert_eq!(registry.problems().len(), 1);
    assert!(registry.get("stub").is_ok());
}

#[test]
fn an_unknown_backend_lists_the_available_ones() {
    let mut c = Config::defaults();
    c.engine.backend = "nope".into();
    let e = Engine::from_config(&c).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConfigInvalid);
    let msg = e.to_string();
    let listed = msg.split("available: ").nth(1).unwrap_or_default();
    for (_, name) in backend_crates() {
        assert!(listed.contains(&name), "{name} is not listed: {msg}");
    }
}

/// Every crate under crates/ that registers a backend, with its registry name (its
/// `pub const NAME`), read from the sources: the tree, not a list kept by hand.
fn backend_crates() -> Vec<(String, String)> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crates");
    let mut found = Vec::new();
    for dir in std::fs::read_dir(&root).unwrap() {
        let dir = dir.unwrap().path();
        let Ok(lib) = std::fs::read_to_string(dir.join("src/lib.rs")) else {
            continue;
        };
        if !lib.contains("register_backend!(") {
            continue;
        }
        let krate = dir.file_name().unwrap().to_string_lossy().to_string();
        let name = lib
            .lines()
            .find_map(|l| l.trim().strip_prefix("pub const NAME: &str = \""))
            .and_then(|rest| rest.split('"').next())
            .unwrap_or_else(|| {
                panic!("{krate} registers a backend without `pub const NAME: &str`")
            });
        found.push((krate, name.to_string()));
    }
    assert!(
        found.len() >= 5,
        "found only {found:?} under {}",
        root.display()
    );
    found
}

#[test]
fn every_backend_crate_in_the_tree_is_linked_by_the_facade() {
    // Under the default features, every backend crate is built in: a crate added under
    // crates/ but not named by a facade feature fails here.
    let registry = Registry::discover(&[]);
    for (krate, name) in backend_crates() {
        let entry = registry.get(&name).unwrap_or_else(|e| {
            panic!("{krate} (backend `{name}`) is not linked by the facade: add it to Cargo.toml's [features] and default: {e}")
        });
        assert_eq!(entry.origin(), &Origin::BuiltIn, "{name}");
    }
}

#[test]
fn an_unknown_key_in_a_backend_table_names_the_key_and_the_file() {
    let c = Config::from_toml(
        "[engine]\nbackend = \"stub\"\n[backends.stub]\nmod = \"copy\"\n",
        "my.toml",
        Path::new("."),
    )
    .unwrap();
    let e = Engine::from_config(&c).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ConfigInvalid);
    let msg = e.to_string();
    assert!(
        msg.contains("mod") && msg.contains("my.toml") && msg.contains("[backends.stub]"),
        "{msg}"
    );
}
