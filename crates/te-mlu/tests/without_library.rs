//! With no libcnrt anywhere, the mlu runtime and backend are registered but
//! unavailable, with the reason, and nothing panics.
//!
//! Skipped (with a message) on a machine where `libcnrt.so` is on the library path.

use te_core::{Access, Config, Engine, ErrorKind, MemoryKind, Registry};

fn main() {
    // Before any thread starts: no hint where a library could be.
    std::env::remove_var("TE_MLU_CNRT_LIB");
    std::env::remove_var("NEUWARE_HOME");
    assert_eq!(te_mlu::NAME, "mlu");
    assert_eq!(te_stub::NAME, "stub");
    // SAFETY: only probes whether the system has a libcnrt; never called into.
    if unsafe { libloading::Library::new("libcnrt.so") }.is_ok() {
        println!("skipped: this machine has a libcnrt.so on the library path");
        return;
    }

    let e = te_mlu::runtime().expect_err("no runtime without CNRT");
    assert_eq!(e.kind(), ErrorKind::Unavailable);
    let reason = e.to_string();
    assert!(reason.contains("libcnrt.so not found"), "{reason}");
    assert!(reason.contains("NEUWARE_HOME"), "{reason}");
    assert!(reason.contains("TE_MLU_CNRT_LIB"), "{reason}");

    let e = te_core::device::runtime("mlu").expect_err("the registered runtime");
    assert_eq!(e.kind(), ErrorKind::Unavailable);
    assert!(
        te_core::device::runtimes()
            .iter()
            .any(|(name, _, r)| *name == "mlu" && r.is_err()),
        "mlu is listed among the runtimes, unavailable"
    );

    let registry = Registry::discover(&[]);
    let entry = registry.get("mlu").expect("mlu is registered");
    let why = entry.available().clone().expect_err("mlu is unavailable");
    assert!(why.to_string().contains("libcnrt.so not found"), "{why}");

    let config = Config::from_toml(
        "[engine]\nbackend = \"mlu\"\n",
        "without_library.toml",
        std::path::Path::new("."),
    )
    .expect("config");
    let e = Engine::from_config(&config).expect_err("no mlu engine without CNRT");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");

    let stub = Engine::from_config(&Config::defaults()).expect("stub engine");
    let kind = MemoryKind::Device {
        runtime: "mlu".into(),
        ordinal: 0,
    };
    let e = stub
        .alloc_on(&kind, "b", 4096, Access::LOCAL)
        .expect_err("no mlu memory without CNRT");
    assert!(
        e.to_string().contains("libcnrt.so not found") || e.kind() == ErrorKind::Unsupported,
        "{e}"
    );
    println!("ok: mlu is unavailable without libcnrt, with the reason: {reason}");
}
