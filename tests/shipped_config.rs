//! The shipped `plugins.toml` agrees with the code: every key in it, commented out or
//! not, parses and validates, every backend linked into te has a table there, and each
//! table names every key its backend takes. A key's one documentation is its config
//! field's doc comment; plugins.toml shows the keys with their defaults.

use std::path::Path;

use te::{Config, Origin};
use te_core::Registry;

/// `plugins.toml` with every commented-out key and table header uncommented.
fn every_key() -> String {
    let text = std::fs::read_to_string("plugins.toml").expect("plugins.toml at the root");
    text.lines()
        .map(|line| match line.strip_prefix("# ") {
            Some(rest) if looks_like_toml(rest) => rest,
            _ => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A `key = value` line or a `[table]` header, as opposed to prose.
fn looks_like_toml(line: &str) -> bool {
    if line.starts_with("[backends.") && line.ends_with(']') {
        return true;
    }
    line.split_once(" = ").is_some_and(|(key, _)| {
        !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    })
}

#[test]
fn every_key_in_plugins_toml_parses_with_its_backend() {
    let text = every_key();
    let config = Config::from_toml(&text, "plugins.toml (all keys)", Path::new("."))
        .unwrap_or_else(|e| panic!("plugins.toml, every key uncommented: {e}"));
    let registry = Registry::discover(&[]);
    assert!(!config.backends.is_empty());
    for name in config.backends.keys() {
        let entry = registry
            .get(name)
            .unwrap_or_else(|e| panic!("plugins.toml has [backends.{name}]: {e}"));
        match entry.check_table(&config.backend_context(name)) {
            Some(checked) => {
                checked.unwrap_or_else(|e| panic!("[backends.{name}] in plugins.toml: {e}"))
            }
            None => panic!("{name} is built in but cannot check its table without creating"),
        }
    }
}

#[test]
fn every_linked_backend_has_a_table_in_plugins_toml() {
    let config = Config::from_toml(&every_key(), "plugins.toml", Path::new(".")).unwrap();
    for entry in Registry::discover(&[]).entries() {
        if entry.origin() == &Origin::BuiltIn {
            assert!(
                config.backends.contains_key(entry.name()),
                "plugins.toml documents no [backends.{}] table",
                entry.name()
            );
        }
    }
}

/// The error `te check` gives for `[backends.rdma]` `table` in a file named `file`,
/// without creating the backend.
fn rdma_table_refused(table: &str, file: &str) -> te::Error {
    let config =
        Config::from_toml(&format!("[backends.rdma]\n{table}\n"), file, Path::new(".")).unwrap();
    let entry = Registry::discover(&[]).get("rdma").unwrap().clone();
    entry
        .check_table(&config.backend_context("rdma"))
        .expect("rdma registers by type")
        .unwrap_err()
}

#[test]
fn a_misspelt_key_in_a_table_is_caught_without_creating_the_backend() {
    let e = rdma_table_refused("slice_sise = \"1MiB\"", "typo.toml");
    assert!(e.to_string().contains("slice_sise"), "{e}");
    assert!(e.to_string().contains("typo.toml"), "{e}");
}

#[test]
fn each_table_in_plugins_toml_names_exactly_the_keys_its_backend_takes() {
    let config = Config::from_toml(&every_key(), "plugins.toml", Path::new(".")).unwrap();
    for entry in Registry::discover(&[]).entries() {
        let Some(options) = entry.options() else {
            continue;
        };
        let name = entry.name();
        let mut takes: Vec<&str> = options.to_vec();
        takes.sort_unstable();
        let mut shown: Vec<&str> = config.backends[name].keys().map(String::as_str).collect();
        shown.sort_unstable();
        assert!(!takes.is_empty(), "{name} takes no keys?");
        assert_eq!(
            shown, takes,
            "[backends.{name}] in plugins.toml against the fields of its config"
        );
    }
}

#[test]
fn a_table_that_parses_but_cannot_work_is_refused_without_creating_the_backend() {
    let e = rdma_table_refused("qps_per_path = 0", "zero.toml");
    assert_eq!(e.kind(), te::ErrorKind::ConfigInvalid, "{e}");
    assert!(e.to_string().contains("qps_per_path"), "{e}");
    assert!(e.to_string().contains("zero.toml"), "{e}");
}
