//! The conformance suite on the tcp backend, both engines in this process, talking over
//! loopback sockets exactly as two processes would.

use te::testkit::{self, Harness};
use te::Config;

fn tcp_config(table: &str) -> Config {
    let text = format!("[engine]\nbackend = \"tcp\"\n[backends.tcp]\n{table}\n");
    Config::from_toml(&text, "tcp_conformance.toml", std::path::Path::new("."))
        .expect("valid config")
}

fn main() {
    // The slow configuration holds every request 200 ms at the target.
    let h = Harness::new("tcp", tcp_config("")).with_slow(tcp_config("debug_delay = \"200ms\""));
    testkit::run(testkit::trials(&h));
}
