//! Builds the two shared libraries the backend can load; neither is linked into the crate.
//!
//! - The FAKE shim (`fake/*.c`, listed in `FAKE_SOURCES`), always, into `OUT_DIR`, for
//!   tests; its path is exported as `TE_FLAGCX_FAKE_SHIM_PATH`. Without a C compiler the
//!   build goes on without it and the tests say so.
//! - A library that claims an older ABI (`fake/fake_old_abi.c`), for the test that the
//!   backend refuses it; its path is exported as `TE_FLAGCX_OLD_ABI_SHIM_PATH`.
//! - The real shim (`shim/te_flagcx_shim.cc`) over an installed FlagCX, only when
//!   `FLAGCX_HOME` is set; its path is exported as `TE_FLAGCX_BUILT_SHIM_PATH`, where the
//!   backend looks when neither the configuration nor `TE_FLAGCX_SHIM` names one. Nothing
//!   is downloaded; with `FLAGCX_HOME` unset this step does nothing. Where FlagCX's
//!   header lacks `flagcxP2pEngineXferResult` the shim still builds but refuses to start
//!   (it could not tell a failed transfer from a finished one).

use std::env;
use std::path::{Path, PathBuf};

/// The FAKE shim's sources; `fake/fake_shim_internal.h` is what they share.
const FAKE_SOURCES: &[&str] = &[
    "fake/fake_shim.c",
    "fake/fake_engine.c",
    "fake/fake_wire.c",
    "fake/fake_target.c",
    "fake/fake_conn.c",
];

/// A library that claims the ABI before this one.
const OLD_ABI_SOURCE: &str = "fake/fake_old_abi.c";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=shim/te_flagcx_shim.h");
    println!("cargo:rerun-if-changed=shim/te_flagcx_shim.cc");
    println!("cargo:rerun-if-changed=shim/te_flagcx_status.h");
    println!("cargo:rerun-if-changed=fake/fake_shim_internal.h");
    for source in FAKE_SOURCES {
        println!("cargo:rerun-if-changed={source}");
    }
    println!("cargo:rerun-if-changed={OLD_ABI_SOURCE}");
    println!("cargo:rerun-if-env-changed=FLAGCX_HOME");
    println!("cargo:rerun-if-env-changed=CC");
    println!("cargo:rerun-if-env-changed=CXX");

    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    build_fake(&out);
    if let Some(home) = env::var_os("FLAGCX_HOME").filter(|h| !h.is_empty()) {
        build_real(&out, Path::new(&home));
    }
}

fn build_fake(out: &Path) {
    compile_c(
        out,
        "libte_flagcx_fake_shim.so",
        FAKE_SOURCES,
        "TE_FLAGCX_FAKE_SHIM_PATH",
        "the fake FlagCX shim",
    );
    compile_c(
        out,
        "libte_flagcx_old_abi.so",
        &[OLD_ABI_SOURCE],
        "TE_FLAGCX_OLD_ABI_SHIM_PATH",
        "the old-ABI test library",
    );
}

/// Compiles `sources` into the shared library `name` in `out` and exports its path as
/// `env`; warns (the tests then fail saying so) where that is impossible.
fn compile_c(out: &Path, name: &str, sources: &[&str], env: &str, what: &str) {
    let lib = out.join(name);
    let compiler = cc::Build::new()
        .cargo_metadata(false)
        .cargo_warnings(false)
        .get_compiler();
    let status = compiler
        .to_command()
        .args(["-std=c11", "-O2", "-g", "-shared", "-fPIC", "-pthread"])
        .args(["-Wall", "-Wextra"])
        .arg("-o")
        .arg(&lib)
        .args(sources)
        .status();
    match status {
        Ok(s) if s.success() => println!("cargo:rustc-env={env}={}", lib.display()),
        Ok(s) => {
            println!(
                "cargo:warning={what} did not compile ({s}); its tests will fail with that reason"
            )
        }
        Err(e) => println!(
            "cargo:warning=no C compiler for {what} ({e}); its tests will fail with that reason"
        ),
    }
}

fn build_real(out: &Path, home: &Path) {
    let include = home.join("include");
    let libdir = home.join("lib");
    if !include.join("flagcx_p2p.h").exists() {
        panic!(
            "FLAGCX_HOME={} has no include/flagcx_p2p.h (FlagCX 0.13 or later, installed with `make install PREFIX=…`); unset FLAGCX_HOME to build without the real shim",
            home.display()
        );
    }
    let header = include.join("flagcx_p2p.h");
    println!("cargo:rerun-if-changed={}", header.display());
    // FlagCX's XferStatus reports a transfer with failed slices as finished; the shim
    // needs a query that says how it ended, and refuses to start without one.
    let reports_failures = std::fs::read_to_string(&header)
        .map(|h| h.contains("flagcxP2pEngineXferResult"))
        .unwrap_or(false);
    if !reports_failures {
        println!(
            "cargo:warning={} declares no flagcxP2pEngineXferResult: the FlagCX shim builds, but refuses to start, because this FlagCX reports failed transfers as finished (docs/flagcx.md)",
            header.display()
        );
    }
    let lib = out.join("libte_flagcx_shim.so");
    let compiler = cc::Build::new()
        .cpp(true)
        .cargo_metadata(false)
        .get_compiler();
    let mut command = compiler.to_command();
    if reports_failures {
        command.arg("-DTE_FLAGCX_HAVE_XFER_RESULT");
    }
    let status = command
        .args(["-std=c++17", "-O2", "-g", "-shared", "-fPIC", "-pthread"])
        .arg("-Ishim")
        .arg(format!("-I{}", include.display()))
        .arg("-o")
        .arg(&lib)
        .arg("shim/te_flagcx_shim.cc")
        .arg(format!("-L{}", libdir.display()))
        .arg("-lflagcx")
        .arg(format!("-Wl,-rpath,{}", libdir.display()))
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C++ compiler for the FlagCX shim: {e}"));
    if !status.success() {
        panic!(
            "the FlagCX shim did not compile against FLAGCX_HOME={} ({status})",
            home.display()
        );
    }
    println!(
        "cargo:rustc-env=TE_FLAGCX_BUILT_SHIM_PATH={}",
        lib.display()
    );
}
