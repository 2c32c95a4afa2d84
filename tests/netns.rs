//! te across real network interfaces: two test hosts in network namespaces joined by a
//! veth pair, `te serve` in one and `te bench` in the other.
//!
//! Needs root and `ip netns` (iproute2); where namespaces cannot be made, each test
//! says why and passes (fails with `TE_REQUIRE=netns`). Loss is made with `tc netem` where the kernel has it, else with
//! an nftables rule dropping 1 % of packets at random (then without the 1 ms delay,
//! which nftables cannot add; the test says so). Print the numbers with
//! `cargo test --test netns -- --nocapture --test-threads 1`.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Two namespaces and the veth pair between them, removed when dropped.
struct Hosts {
    a: String,
    b: String,
    link_a: String,
    link_b: String,
    dir: std::path::PathBuf,
}

fn ip(args: &[&str]) -> Output {
    Command::new("ip")
        .args(args)
        .output()
        .expect("run ip (iproute2)")
}

fn ok(out: Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Hosts {
    /// Makes the hosts, or `None` (saying why) where this machine does not allow it.
    fn new(tag: &str) -> Option<Hosts> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            te_core::require::skip("netns", "network namespaces need root");
            return None;
        }
        let id = format!("{}{tag}", std::process::id() % 100_000);
        let (a, b) = (format!("te-a{id}"), format!("te-b{id}"));
        match Command::new("ip").args(["netns", "add", &a]).output() {
            Ok(o) if o.status.success() => {}
            Ok(o) => {
                let why = String::from_utf8_lossy(&o.stderr);
                te_core::require::skip(
                    "netns",
                    format!("`ip netns add` is not allowed here: {}", why.trim()),
                );
                return None;
            }
            Err(e) => {
                te_core::require::skip(
                    "netns",
                    format!("no `ip` command (apt-get install iproute2): {e}"),
                );
                return None;
            }
        }
        let dir = std::env::temp_dir().join(format!("te-netns-{id}"));
        std::fs::create_dir_all(&dir).unwrap();
        let hosts = Hosts {
            link_a: format!("va{id}"),
            link_b: format!("vb{id}"),
            a,
            b,
            dir,
        };
        ok(ip(&["netns", "add", &hosts.b]), "add namespace");
        ok(
            ip(&[
                "link",
                "add",
                &hosts.link_a,
                "netns",
                &hosts.a,
                "type",
                "veth",
                "peer",
                "name",
                &hosts.link_b,
                "netns",
                &hosts.b,
            ]),
            "add veth pair",
        );
        for (ns, link, addr) in [
            (&hosts.a, &hosts.link_a, "10.231.0.1/24"),
            (&hosts.b, &hosts.link_b, "10.231.0.2/24"),
        ] {
            ok(ip(&["-n", ns, "addr", "add", addr, "dev", link]), "address");
            ok(ip(&["-n", ns, "link", "set", link, "up"]), "link up");
            ok(ip(&["-n", ns, "link", "set", "lo", "up"]), "lo up");
        }
        Some(hosts)
    }

    /// A configuration file for the tcp backend on host `ip`, with a 3 s default
    /// deadline.
    fn config(&self, ip: &str) -> std::path::PathBuf {
        let path = self.dir.join(format!("{ip}.toml"));
        std::fs::write(
            &path,
            format!("[engine]\nbackend = \"tcp\"\nlisten = \"{ip}:0\"\ndefault_timeout = \"3s\"\nheartbeat = \"1s\"\n"),
        )
        .unwrap();
        path
    }

    /// `te serve` in host a, and the address it printed.
    fn serve(&self) -> (Child, String) {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.a, env!("CARGO_BIN_EXE_te"), "serve"])
            .arg("--config")
            .arg(self.config("10.231.0.1"))
            .args(["--buffer-size", "64MiB"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start te serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line.trim().to_string();
        assert!(addr.starts_with("10.231.0.1:"), "te serve printed {addr:?}");
        (child, addr)
    }

    /// `te bench` in host b against `addr`.
    fn bench(&self, addr: &str, extra: &[&str]) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.b, env!("CARGO_BIN_EXE_te"), "bench"])
            .arg("--config")
            .arg(self.config("10.231.0.2"))
            .args(["--target", addr])
            .args(extra);
        cmd
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        // Deleting a namespace deletes its end of the veth pair, and so the pair.
        let _ = ip(&["netns", "del", &self.a]);
        let _ = ip(&["netns", "del", &self.b]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The throughput `te bench --json` reported.
fn gbps(out: &Output) -> f64 {
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.starts_with('{')).unwrap_or("{}");
    let v: serde_json::Value = serde_json::from_str(line).unwrap_or_default();
    v["gb_per_s"].as_f64().unwrap_or(f64::NAN)
}

#[test]
fn a_bench_across_a_veth_pair_verifies_every_byte() {
    let Some(hosts) = Hosts::new("v") else { return };
    let (mut serve, addr) = hosts.serve();
    for op in ["write", "read"] {
        let out = hosts
            .bench(
                &addr,
                &["--op", op, "--verify", "--json", "--duration", "1s"],
            )
            .args(["--block-size", "1MiB", "--batch", "16"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("veth, tcp, {op} 1 MiB x 16: {:.3} GB/s", gbps(&out));
    }
    let _ = serve.kill();
    let _ = serve.wait();
}

#[test]
fn a_partition_mid_transfer_fails_the_batch_within_its_deadline() {
    let Some(hosts) = Hosts::new("p") else { return };
    let (mut serve, addr) = hosts.serve();
    let mut bench = hosts
        .bench(&addr, &["--duration", "30s"])
        .args(["--block-size", "1MiB", "--batch", "16"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    ok(
        ip(&["-n", &hosts.b, "link", "set", &hosts.link_b, "down"]),
        "link down",
    );
    let cut = Instant::now();
    // The batch's deadline is 3 s; te-tcp cuts a stalled connection 250 ms after it.
    // 8 s leaves room for a loaded machine, and is still far below io_timeout + 3 s.
    let mut status = None;
    while cut.elapsed() < Duration::from_secs(8) {
        if let Some(s) = bench.try_wait().unwrap() {
            status = Some(s);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let took = cut.elapsed();
    let Some(status) = status else {
        let _ = bench.kill();
        let _ = bench.wait();
        panic!("te bench still ran 8 s after the partition: the deadline was 3 s");
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut bench.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success(), "te bench succeeded across a partition");
    assert!(
        err.contains("deadline") || err.contains("Timeout") || err.contains("unreachable"),
        "unclear error: {err}"
    );
    eprintln!("partition: te bench failed {took:?} after the link went down: {err}");
    let _ = serve.kill();
    let _ = serve.wait();
}

/// Adds 1 ms delay and 1 % loss on both ends with netem, or 1 % loss with nftables
/// where the kernel has no netem; says which.
fn impair(hosts: &Hosts) -> &'static str {
    let links = [(&hosts.a, &hosts.link_a), (&hosts.b, &hosts.link_b)];
    let netem = links.iter().all(|(ns, link)| {
        Command::new("ip")
            .args(["netns", "exec", ns, "tc", "qdisc", "add", "dev", link])
            .args(["root", "netem", "delay", "1ms", "loss", "1%"])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if netem {
        return "netem delay 1ms loss 1%";
    }
    for (ns, _) in &links {
        let nft = |rule: &str| {
            Command::new("ip")
                .args(["netns", "exec", ns, "nft", rule])
                .output()
                .is_ok_and(|o| o.status.success())
        };
        let added = nft("add table inet te")
            && nft("add chain inet te in { type filter hook input priority 0; }")
            && nft("add rule inet te in numgen random mod 100 < 1 drop");
        if !added {
            return "";
        }
    }
    "nftables loss 1% (this kernel has no netem: no added delay)"
}

#[test]
fn transfers_over_a_lossy_link_complete_with_every_byte_verified() {
    let Some(hosts) = Hosts::new("l") else { return };
    let how = impair(&hosts);
    if how.is_empty() {
        te_core::require::skip(
            "netns",
            "neither tc netem nor nftables can impair the link here",
        );
        return;
    }
    let (mut serve, addr) = hosts.serve();
    for op in ["write", "read"] {
        let out = hosts
            .bench(
                &addr,
                &["--op", op, "--verify", "--json", "--duration", "1s"],
            )
            .args(["--block-size", "64KiB", "--batch", "16"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("{how}, tcp, {op} 64 KiB x 16: {:.3} GB/s", gbps(&out));
    }
    let _ = serve.kill();
    let _ = serve.wait();
}
