//! The conformance suite against the flagcx backend over the FAKE shim (engines of one
//! process, connected over loopback TCP through the fake, and with every target engine
//! in a child process). `two_process.rs` covers more across processes. With `TE_FLAGCX_REAL_SHIM` set it runs against real FlagCX instead.

use std::path::Path;

use te_core::testkit::{self, Harness};
use te_core::Config;

// Link the backend so its registration is in this test's registry.
use te_flagcx as _;

fn toml(shim: &str, options: &str) -> String {
    format!(
        "[engine]\nbackend = \"flagcx\"\n[backends.flagcx]\nshim = \"{shim}\"\nshim_options = \"{options}\"\n"
    )
}

fn config(shim: &str, options: &str) -> Config {
    Config::from_toml(
        &toml(shim, options),
        "flagcx-conformance.toml",
        Path::new("."),
    )
    .expect("valid config")
}

/// Set to a real shim (`libte_flagcx_shim.so` built with `FLAGCX_HOME`) to run the
/// suite against FlagCX instead of the fake (docs/flagcx.md).
const REAL_SHIM: &str = "TE_FLAGCX_REAL_SHIM";

fn main() {
    testkit::serve_target_if_asked();
    if let Some(real) = std::env::var_os(REAL_SHIM).filter(|p| !p.is_empty()) {
        let real = real.to_string_lossy().into_owned();
        std::env::set_var(te_flagcx::SHIM_ENV, &real);
        // No slow configuration: the tests that need one are skipped, saying so. FlagCX
        // cannot restrict a region's remote rights; the suite's local-only and
        // read-only regions need the operator's consent (docs/flagcx.md).
        let plain = Harness::new("flagcx_real", config(&real, "unrestricted=1"));
        let split = Harness::new(
            "flagcx_real_split",
            config(&real, "unrestricted=1,max_desc=4096"),
        );
        let mut trials = testkit::trials(&plain);
        trials.extend(testkit::trials(&split));
        testkit::run(trials);
    }
    let shim = match option_env!("TE_FLAGCX_FAKE_SHIM_PATH") {
        Some(p) => p,
        None => {
            panic!("the fake FlagCX shim was not built (no C compiler?); see the build warnings")
        }
    };
    // The probe cannot see the configuration; it finds the shim through the variable.
    std::env::set_var(te_flagcx::SHIM_ENV, shim);
    let small =
        Harness::new("flagcx_fake", config(shim, "")).with_slow(config(shim, "delay_ms=200"));
    // The same contract with every request split into 4 KiB descriptors.
    let split = Harness::new("flagcx_fake_split", config(shim, "max_desc=4096"))
        .with_slow(config(shim, "max_desc=4096,delay_ms=200"));
    let two_process = Harness::new("flagcx_fake_two_process", config(shim, ""))
        .with_slow(config(shim, "delay_ms=200"))
        .with_remote_target(&toml(shim, ""), Some(&toml(shim, "delay_ms=200")));
    let mut trials = testkit::trials(&small);
    trials.extend(testkit::trials(&split));
    trials.extend(testkit::trials(&two_process));
    testkit::run(trials);
}
