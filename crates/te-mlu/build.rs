//! Builds the FAKE libcnrt (`csrc/fake_cnrt*.c`) that te-mlu's tests load through the
//! same `dlopen` path as the real library, in three variants: the normal fake (a
//! CNRT 6.14-like library), one without `_V2`/`_V3` copy symbols (a 6.0.2-like
//! library), and one without `cnrtMapMemHandle` (a library missing a symbol).
//!
//! The paths reach the tests as `TE_MLU_FAKE_CNRT`, `TE_MLU_FAKE_CNRT_V602` and
//! `TE_MLU_FAKE_CNRT_NO_IPC`. Without a C compiler the crate still builds; the paths
//! are then empty and the fake-based tests fail with a message saying so.

use std::path::{Path, PathBuf};

/// The fake's sources; `csrc/fake_cnrt_internal.h` is what they share.
const SOURCES: &[&str] = &[
    "csrc/fake_cnrt.c",
    "csrc/fake_cnrt_device.c",
    "csrc/fake_cnrt_memory.c",
    "csrc/fake_cnrt_copy.c",
    "csrc/fake_cnrt_ipc.c",
];

fn build(out: &Path, name: &str, defines: &[&str]) -> Option<PathBuf> {
    let compiler = cc::Build::new()
        .cargo_metadata(false)
        .cargo_warnings(false)
        .try_get_compiler()
        .ok()?;
    let lib = out.join(format!("lib{name}.so"));
    let mut cmd = compiler.to_command();
    cmd.args([
        "-shared",
        "-fPIC",
        "-fvisibility=hidden",
        "-O1",
        "-Wall",
        "-o",
    ])
    .arg(&lib)
    .args(SOURCES);
    for d in defines {
        cmd.arg(format!("-D{d}"));
    }
    cmd.arg("-lpthread");
    match cmd.status() {
        Ok(s) if s.success() => Some(lib),
        Ok(s) => {
            println!("cargo:warning=building the fake libcnrt ({name}) failed: {s}");
            None
        }
        Err(e) => {
            println!("cargo:warning=cannot run the C compiler for the fake libcnrt: {e}");
            None
        }
    }
}

fn main() {
    println!("cargo:rerun-if-changed=csrc/fake_cnrt_internal.h");
    for source in SOURCES {
        println!("cargo:rerun-if-changed={source}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    for (var, name, defines) in [
        ("TE_MLU_FAKE_CNRT", "te_fake_cnrt", &[][..]),
        (
            "TE_MLU_FAKE_CNRT_V602",
            "te_fake_cnrt_v602",
            &["FAKE_V602"][..],
        ),
        (
            "TE_MLU_FAKE_CNRT_NO_IPC",
            "te_fake_cnrt_noipc",
            &["FAKE_NO_IPC_MAP"][..],
        ),
    ] {
        let path = build(&out, name, defines)
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        println!("cargo:rustc-env={var}={path}");
    }
}
