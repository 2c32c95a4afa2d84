//! Skips that can fail: tests that cannot run here (no etcd, no RDMA device, no
//! network namespaces) say so and pass, unless `TE_REQUIRE` names what they need.
//!
//! `TE_REQUIRE` is a comma-separated list (`TE_REQUIRE=rdma,etcd`, or `all`); set it on
//! machines that have the hardware or the packages, so that a broken setup fails
//! instead of skipping quietly.

/// Whether `TE_REQUIRE` names `what` (or is `all`).
pub fn required(what: &str) -> bool {
    std::env::var("TE_REQUIRE")
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .any(|w| w == what || w == "all")
}

/// Reports a test that cannot run here: prints `skipped: WHY`, or panics with the
/// reason if `TE_REQUIRE` names `what`.
///
/// # Panics
/// If `TE_REQUIRE` names `what`.
pub fn skip(what: &str, why: impl std::fmt::Display) {
    assert!(
        !required(what),
        "TE_REQUIRE names `{what}`, but this test cannot run here: {why}"
    );
    println!("skipped ({what}): {why}");
}
