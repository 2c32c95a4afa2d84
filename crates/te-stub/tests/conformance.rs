//! The conformance suite on te-stub: the pattern every backend crate's conformance test
//! follows. Copy it, change the crate, the tables and nothing else.

use te_core::testkit::{self, Harness};

fn main() {
    testkit::serve_target_if_asked();
    // The second table makes every batch take about 200 ms (deadline, cancel and
    // shutdown tests need one).
    let h = Harness::for_backend(te_stub::NAME, "", Some("delay = \"200ms\""));
    testkit::run(testkit::trials_everywhere(&h));
}
