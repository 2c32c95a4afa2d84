//! Links every backend crate that an enabled Cargo feature names (`feature =
//! ["dep:te-…"]` in Cargo.toml's `[features]`), so that its registration is part of
//! every program using the facade. The features are the one list of backends; this
//! writes the `extern crate` lines from it.

use std::fmt::Write;

fn main() {
    println!("cargo:rerun-if-changed=Cargo.toml");
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let manifest = std::fs::read_to_string(format!("{dir}/Cargo.toml")).expect("read Cargo.toml");
    let manifest: toml::Table = manifest.parse().expect("Cargo.toml parses");
    let mut out = String::new();
    let features = manifest.get("features").and_then(|f| f.as_table());
    for (feature, enables) in features.into_iter().flatten() {
        let var = format!("CARGO_FEATURE_{}", feature.to_uppercase().replace('-', "_"));
        if std::env::var_os(var).is_none() {
            continue;
        }
        for dep in enables.as_array().into_iter().flatten() {
            if let Some(krate) = dep.as_str().and_then(|d| d.strip_prefix("dep:te-")) {
                let krate = krate.replace('-', "_");
                writeln!(out, "extern crate te_{krate} as _;").unwrap();
            }
        }
    }
    let path = format!(
        "{}/linked.rs",
        std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")
    );
    std::fs::write(path, out).expect("write linked.rs");
}
