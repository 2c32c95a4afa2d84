//! `te bench` as a user runs it: JSON lines, verify, sweeps with a plot, bad input,
//! and against a `te serve` in another process.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};

/// Every field of a `--json` result line.
const FIELDS: [&str; 20] = [
    "backend",
    "op",
    "block_size",
    "batch_size",
    "threads",
    "bytes",
    "seconds",
    "gb_per_s",
    "lat_us_avg",
    "lat_us_p50",
    "lat_us_p99",
    "lat_us_p999",
    "device_calls_per_batch",
    "device_copies_per_batch",
    "device_syncs_per_batch",
    "post_us_p50",
    "queued_us_p50",
    "wire_us_p50",
    "device_us_p50",
    "wake_us_p50",
];

fn te() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_te"));
    c.env_remove("TE_CONFIG").env_remove("RUST_LOG");
    c
}

fn bench(args: &[&str]) -> Output {
    te().arg("bench").args(args).output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Parses every stdout line as a JSON object with exactly the documented fields.
fn json_lines(out: &Output) -> Vec<serde_json::Value> {
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status,
        text(&out.stderr)
    );
    let stdout = text(&out.stdout);
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(!lines.is_empty(), "no output");
    for v in &lines {
        let obj = v.as_object().unwrap();
        let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        keys.sort_unstable();
        let mut want = FIELDS.to_vec();
        want.sort_unstable();
        assert_eq!(keys, want, "{v}");
    }
    lines
}

fn te_result(v: &serde_json::Value) -> bool {
    !v["backend"].as_str().unwrap().starts_with("baseline-")
}

#[test]
fn the_acceptance_command_prints_valid_json_lines_and_verifies() {
    let out = bench(&[
        "--backend",
        "stub",
        "--block-size",
        "1MiB",
        "--batch",
        "64",
        "--duration",
        "300ms",
        "--warmup",
        "0s",
        "--json",
        "--verify",
    ]);
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 1);
    let v = &lines[0];
    assert_eq!(v["backend"], "stub");
    assert_eq!(v["op"], "write");
    assert_eq!(v["block_size"], 1 << 20);
    assert_eq!(v["batch_size"], 64);
    assert_eq!(v["threads"], 1);
    let bytes = v["bytes"].as_u64().unwrap();
    assert!(bytes > 0 && bytes % (64 << 20) == 0, "{v}");
    let (secs, gbps) = (
        v["seconds"].as_f64().unwrap(),
        v["gb_per_s"].as_f64().unwrap(),
    );
    assert!(
        (gbps - bytes as f64 / secs / 1e9).abs() < 1e-6 * gbps,
        "{v}"
    );
    let p50 = v["lat_us_p50"].as_f64().unwrap();
    let p999 = v["lat_us_p999"].as_f64().unwrap();
    assert!(
        p50 > 0.0 && p50 <= v["lat_us_p99"].as_f64().unwrap() && p999 >= p50,
        "{v}"
    );
    // The stub times its worker's copy as the wire, and copies no device memory.
    for stage in ["post_us_p50", "queued_us_p50", "wire_us_p50", "wake_us_p50"] {
        let us = v[stage].as_f64().unwrap_or_else(|| panic!("{stage}: {v}"));
        assert!((0.0..=p999).contains(&us), "{stage}: {v}");
    }
    assert!(v["device_us_p50"].is_null(), "{v}");
}

#[test]
fn reads_with_several_threads_verify_too() {
    let out = bench(&[
        "--op",
        "read",
        "--block-size",
        "64KiB",
        "--batch",
        "8",
        "--threads",
        "2",
        "--iters",
        "20",
        "--warmup",
        "0s",
        "--json",
        "--verify",
    ]);
    let v = &json_lines(&out)[0];
    assert_eq!(v["op"], "read");
    assert_eq!(v["threads"], 2);
    assert_eq!(v["bytes"], 2 * 20 * 8 * (64 << 10));
}

#[test]
fn a_sweep_writes_a_table_and_an_svg_plot_with_one_line_per_batch_size() {
    let svg = std::env::temp_dir().join(format!("te-bench-{}.svg", std::process::id()));
    let out = bench(&[
        "--block-sizes",
        "4KiB,16KiB,64KiB",
        "--batch-sizes",
        "1,4",
        "--duration",
        "40ms",
        "--warmup",
        "0s",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let rows = stdout.lines().filter(|l| l.starts_with("stub ")).count();
    assert_eq!(rows, 6, "{stdout}");
    assert!(
        stdout.contains("GB/S") && stdout.contains("P99.9"),
        "{stdout}"
    );
    // Not a terminal: plain progress lines, one per start and end of each point.
    let stderr = text(&out.stderr);
    assert!(stderr.contains("te bench: [6/6]"), "{stderr}");
    let plot = std::fs::read_to_string(&svg).unwrap();
    let _ = std::fs::remove_file(&svg);
    assert!(plot.starts_with("<svg"), "{plot}");
    assert_eq!(plot.matches("<polyline").count(), 2);
    assert!(plot.contains("batch 1") && plot.contains("batch 4"));
    assert!(plot.contains(">4K<") && plot.contains(">64K<"));
}

#[test]
fn baselines_come_as_their_own_json_lines_and_a_missing_qperf_is_one_line() {
    let out = te()
        .args([
            "bench",
            "--block-size",
            "256KiB",
            "--batch",
            "4",
            "--duration",
            "100ms",
        ])
        .args(["--warmup", "0s", "--baseline", "--json"])
        .env("PATH", "")
        .output()
        .unwrap();
    let lines = json_lines(&out);
    let backends: Vec<&str> = lines
        .iter()
        .map(|v| v["backend"].as_str().unwrap())
        .collect();
    assert_eq!(backends, ["stub", "baseline-memcpy", "baseline-socket"]);
    assert!(lines.iter().all(|v| v["gb_per_s"].as_f64().unwrap() > 0.0));
    assert!(lines[2]["lat_us_p50"].is_null());
    assert!(!te_result(&lines[1]));
    let stderr = text(&out.stderr);
    assert_eq!(
        stderr.matches("qperf is not installed").count(),
        1,
        "{stderr}"
    );
}

#[test]
fn the_human_report_compares_with_memcpy_and_the_socket_pump() {
    let out = te()
        .args([
            "bench",
            "--block-size",
            "256KiB",
            "--batch",
            "4",
            "--duration",
            "100ms",
        ])
        .args(["--warmup", "0s", "--baseline"])
        .env("PATH", "")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("of single-thread memcpy"), "{stdout}");
    assert!(stdout.contains("raw loopback TCP socket pump"), "{stdout}");
    assert!(
        stdout.contains("×MEMCPY") && stdout.contains("baseline-socket"),
        "{stdout}"
    );
}

/// Runs `te bench ARGS` and expects exit status 1 with one line on stderr containing
/// every needle: input refused before anything runs.
fn refused(args: &[&str], needles: &[&str]) {
    let stderr = failed(args, needles);
    assert_eq!(stderr.lines().count(), 1, "{args:?} => {stderr}");
}

/// Runs `te bench ARGS` and expects exit status 1, its last stderr line (after any
/// progress lines) the one error, containing every needle.
fn failed(args: &[&str], needles: &[&str]) -> String {
    let out = bench(args);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?} => {stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(last.starts_with("te: error: "), "{stderr}");
    assert_eq!(stderr.matches("te: error:").count(), 1, "{stderr}");
    for n in needles {
        assert!(last.contains(n), "{args:?}: `{n}` not in {stderr}");
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

#[test]
fn bad_input_is_one_line_and_a_non_zero_exit() {
    refused(
        &["--block-size", "0"],
        &["--block-size", "greater than zero"],
    );
    refused(&["--block-size", "lots"], &["--block-size", "4096, 64KiB"]);
    refused(&["--batch", "0"], &["--batch"]);
    refused(&["--threads", "0"], &["--threads"]);
    refused(&["--iters", "0"], &["--iters"]);
    refused(&["--duration", "0s"], &["--duration"]);
    refused(
        &["--block-sizes", "4KiB,,8KiB"],
        &["--block-sizes", "empty"],
    );
    refused(&["--op", "copy"], &["copy", "read", "write"]);
    refused(
        &["--block-size", "4MiB", "--buffer-size", "1MiB"],
        &["4 MiB", "does not fit", "1 MiB"],
    );
    refused(&["--backend", "nope"], &["nope", "stub"]);
}

#[test]
fn an_unreachable_target_is_one_line_and_a_non_zero_exit() {
    // A port that was free a moment ago: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    refused(&["--target", &addr, "--duration", "100ms"], &[&addr]);
}

/// `te serve` in its own process, killed when dropped.
struct Serve {
    child: Child,
    addr: String,
}

impl Serve {
    fn start(backend: &str, size: &str) -> Serve {
        Serve::start_on(backend, size, "host")
    }

    fn start_on(backend: &str, size: &str, mem: &str) -> Serve {
        Serve::start_with(&["--backend", backend, "--buffer-size", size, "--mem", mem])
    }

    fn start_with(args: &[&str]) -> Serve {
        let mut child = te()
            .arg("serve")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line.trim().to_string();
        assert!(addr.contains(':'), "te serve printed `{addr}` first");
        Serve { child, addr }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn bench_and_serve_work_as_two_processes_over_tcp() {
    let serve = Serve::start("tcp", "8MiB");
    for op in ["write", "read"] {
        let out = bench(&[
            "--backend",
            "tcp",
            "--target",
            &serve.addr,
            "--op",
            op,
            "--block-size",
            "256KiB",
            "--batch",
            "8",
            "--threads",
            "2",
            "--duration",
            "300ms",
            "--warmup",
            "0s",
            "--verify",
            "--json",
        ]);
        let v = &json_lines(&out)[0];
        assert_eq!(v["backend"], "tcp");
        assert_eq!(v["op"], op);
        assert!(v["gb_per_s"].as_f64().unwrap() > 0.0, "{v}");
    }
    // The target's 8 MiB buffer cannot hold 2 threads × 8 MiB blocks.
    refused(
        &[
            "--backend",
            "tcp",
            "--target",
            &serve.addr,
            "--block-size",
            "8MiB",
            "--threads",
            "2",
        ],
        &["8 MiB", "does not fit", "te serve --buffer-size"],
    );
}

#[test]
fn fakedev_memory_moves_over_tcp_verified_in_one_process_and_across_two() {
    let args = |op: &'static str| {
        vec![
            "--backend",
            "tcp",
            "--mem",
            "fakedev:0",
            "--op",
            op,
            "--block-size",
            "1MiB",
            "--batch",
            "8",
            "--duration",
            "300ms",
            "--warmup",
            "0s",
            "--verify",
            "--json",
        ]
    };
    for op in ["write", "read"] {
        let v = &json_lines(&bench(&args(op)))[0];
        assert_eq!(v["backend"], "tcp");
        assert!(v["gb_per_s"].as_f64().unwrap() > 0.0, "{v}");
        // A peer in the process gets device copies, which te-tcp times; no wire.
        assert!(v["device_us_p50"].as_f64().unwrap_or(0.0) > 0.0, "{v}");
        assert!(v["wire_us_p50"].is_null(), "{v}");
    }
    let serve = Serve::start_on("tcp", "16MiB", "fakedev:0");
    for op in ["write", "read"] {
        let mut a = args(op);
        a.extend(["--target", &serve.addr]);
        let v = &json_lines(&bench(&a))[0];
        assert_eq!(v["op"], op);
        assert!(v["gb_per_s"].as_f64().unwrap() > 0.0, "{v}");
    }
    refused(
        &["--backend", "tcp", "--mem", "nope:0"],
        &["no device runtime named `nope`", "fakedev"],
    );
}

#[test]
fn a_stub_target_in_another_process_is_refused_with_the_reason() {
    let serve = Serve::start("stub", "1MiB");
    refused(
        &["--backend", "stub", "--target", &serve.addr],
        &["one process", "tcp"],
    );
}

#[test]
fn verify_fails_the_run_when_bytes_do_not_arrive() {
    // The stub's noop mode completes every batch without moving a byte.
    let cfg = std::env::temp_dir().join(format!("te-bench-noop-{}.toml", std::process::id()));
    std::fs::write(&cfg, "[backends.stub]\nmode = \"noop\"\n").unwrap();
    for op in ["write", "read"] {
        failed(
            &[
                "--config",
                cfg.to_str().unwrap(),
                "--op",
                op,
                "--block-size",
                "4KiB",
                "--batch",
                "4",
                "--iters",
                "3",
                "--warmup",
                "0s",
                "--verify",
                "--json",
            ],
            &["verify failed", "16384 of 16384 bytes", "offset 0"],
        );
    }
    let _ = std::fs::remove_file(&cfg);
}

/// A configuration file in the temporary directory, removed when dropped.
struct TempConfig(std::path::PathBuf);

impl TempConfig {
    fn new(name: &str, text: &str) -> TempConfig {
        let path =
            std::env::temp_dir().join(format!("te-cli-bench-{}-{name}.toml", std::process::id()));
        std::fs::write(&path, text).unwrap();
        TempConfig(path)
    }

    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for TempConfig {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A short verified bench against `addr`, with `config` if given.
fn tokened<'a>(addr: &'a str, config: Option<&'a str>) -> Vec<&'a str> {
    let mut a = vec![
        "--backend",
        "tcp",
        "--target",
        addr,
        "--block-size",
        "64KiB",
        "--duration",
        "200ms",
        "--warmup",
        "0s",
        "--verify",
        "--json",
    ];
    if let Some(c) = config {
        a.extend(["--config", c]);
    }
    a
}

#[test]
fn bench_against_a_serve_with_an_auth_token_needs_the_same_token() {
    let right = TempConfig::new("right", "[engine]\nauth_token = \"s3cret\"\n");
    let wrong = TempConfig::new("wrong", "[engine]\nauth_token = \"guess\"\n");
    let serve = Serve::start_with(&[
        "--config",
        right.path(),
        "--backend",
        "tcp",
        "--buffer-size",
        "4MiB",
    ]);
    let v = &json_lines(&bench(&tokened(&serve.addr, Some(right.path()))))[0];
    assert_eq!(v["backend"], "tcp");
    assert!(v["gb_per_s"].as_f64().unwrap() > 0.0, "{v}");
    let stderr = failed(&tokened(&serve.addr, Some(wrong.path())), &["auth_token"]);
    assert!(stderr.contains("could not prove"), "{stderr}");
    failed(&tokened(&serve.addr, None), &["auth_token"]);
}

#[test]
fn kv_blocks_in_fakedev_memory_move_over_tcp_in_every_mode() {
    for op in ["read", "write"] {
        let out = bench(&[
            "--kv",
            "--backend",
            "tcp",
            "--mem",
            "fakedev:0",
            "--op",
            op,
            "--kv-layers",
            "2",
            "--kv-blocks",
            "16",
            "--batch",
            "4",
            "--duration",
            "200ms",
            "--json",
        ]);
        assert!(out.status.success(), "{op}: {}", text(&out.stderr));
        // --kv lines have their own fields (mode, blocks_per_s, requests_per_batch).
        let lines: Vec<serde_json::Value> = text(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
            .collect();
        let modes: Vec<_> = lines.iter().map(|v| v["mode"].clone()).collect();
        assert_eq!(modes, ["contiguous", "random", "plain-1MiB"], "{op}");
        for v in &lines {
            assert_eq!(v["op"], op);
            assert!(v["gb_per_s"].as_f64().unwrap() > 0.0, "{v}");
        }
    }
}

#[test]
fn kv_blocks_move_between_two_processes_against_te_serve_kv() {
    let geometry = ["--kv-layers", "2", "--kv-blocks", "16"];
    let mut args = vec!["--backend", "tcp", "--kv", "--mem", "fakedev:0"];
    args.extend(geometry);
    let serve = Serve::start_with(&args);
    for op in ["read", "write"] {
        let mut args = vec!["--kv", "--backend", "tcp", "--mem", "fakedev:0", "--op", op];
        args.extend(geometry);
        args.extend([
            "--target",
            &serve.addr,
            "--batch",
            "4",
            "--duration",
            "200ms",
            "--json",
        ]);
        let out = bench(&args);
        assert!(out.status.success(), "{op}: {}", text(&out.stderr));
        let modes: Vec<serde_json::Value> = text(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["mode"].clone())
            .collect();
        assert_eq!(modes, ["contiguous", "random", "plain-1MiB"], "{op}");
        // A process of this host: the same-host channel, said on stderr.
        assert!(
            text(&out.stderr).contains("reached by same-host channel"),
            "{}",
            text(&out.stderr)
        );
    }
    // Another geometry than the server's is refused, saying so.
    let out = bench(&[
        "--kv",
        "--backend",
        "tcp",
        "--mem",
        "fakedev:0",
        "--kv-layers",
        "2",
        "--kv-blocks",
        "32",
        "--target",
        &serve.addr,
        "--duration",
        "200ms",
    ]);
    assert!(!out.status.success());
    let e = text(&out.stderr);
    assert!(e.lines().count() == 1 && e.contains("bench"), "{e}");
}

/// Runs `te ARGS`, killing it if it has not ended within `limit`: what is refused must
/// be refused at once, not after the run it asked for.
fn bounded(args: &[&str], limit: std::time::Duration) -> Output {
    let mut child = te()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let end = std::time::Instant::now() + limit;
    while child.try_wait().unwrap().is_none() && std::time::Instant::now() < end {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.kill();
    child.wait_with_output().unwrap()
}

/// `te ARGS` exits 1 within 20 s, with one line on stderr holding every needle.
fn refused_at_once(args: &[&str], needles: &[&str]) {
    let out = bounded(args, std::time::Duration::from_secs(20));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?} => {stderr}");
    assert_eq!(stderr.lines().count(), 1, "{args:?} => {stderr}");
    assert!(stderr.starts_with("te: error: "), "{args:?} => {stderr}");
    for n in needles {
        assert!(stderr.contains(n), "{args:?}: `{n}` not in {stderr}");
    }
}

#[test]
fn durations_longer_than_a_day_are_refused_naming_the_limit() {
    for (option, kv) in [
        ("--duration", false),
        ("--warmup", false),
        ("--duration", true),
    ] {
        let mut args = vec!["bench", "--backend", "stub", option, "1000000000d"];
        if kv {
            args.extend([
                "--kv",
                "--kv-layers",
                "2",
                "--kv-blocks",
                "16",
                "--batch",
                "4",
            ]);
        }
        refused_at_once(&args, &[option, "1 day"]);
    }
}

#[test]
fn kv_durations_are_checked_like_the_other_benches() {
    let kv = ["bench", "--kv", "--backend", "stub", "--kv-layers", "2"];
    for (duration, says) in [("0s", "longer than zero"), ("soon", "not a duration")] {
        let mut args = kv.to_vec();
        args.extend(["--kv-blocks", "16", "--batch", "4", "--duration", duration]);
        refused_at_once(&args, &["--duration", says]);
    }
}

#[test]
fn more_requests_in_flight_than_the_limit_are_refused_before_any_is_built() {
    // 2 threads × 2^20 requests: 2^21 requests built and in flight at once.
    refused_at_once(
        &[
            "bench",
            "--backend",
            "stub",
            "--block-size",
            "1",
            "--batch",
            "1048576",
            "--threads",
            "2",
            "--iters",
            "1",
            "--warmup",
            "0s",
        ],
        &["--batch 1048576", "--threads 2", "1048576"],
    );
}

#[test]
fn a_kv_geometry_whose_sizes_overflow_is_refused_not_a_panic() {
    for geometry in [
        &["--kv-heads", "99999999999", "--kv-head-dim", "99999999999"][..],
        &[
            "--kv-block-tokens",
            "9999999999",
            "--kv-dtype-bytes",
            "9999999999",
        ][..],
        &["--kv-dtype-bytes", "9223372036854775808"][..],
    ] {
        for cmd in ["bench", "serve"] {
            let mut args = vec![cmd, "--backend", "stub", "--kv"];
            args.extend(geometry);
            refused_at_once(&args, &["16 GiB"]);
        }
    }
}

#[test]
fn a_kv_model_of_more_layers_blocks_or_requests_than_the_limits_is_refused() {
    let tiny = [
        "--kv-heads",
        "1",
        "--kv-head-dim",
        "1",
        "--kv-block-tokens",
        "1",
        "--kv-dtype-bytes",
        "1",
    ];
    for (geometry, says) in [
        (
            &["--kv-layers", "100000", "--kv-blocks", "4"][..],
            "--kv-layers",
        ),
        (
            &["--kv-layers", "1", "--kv-blocks", "2000000"][..],
            "--kv-blocks",
        ),
        (
            &[
                "--kv-layers",
                "1024",
                "--kv-blocks",
                "1024",
                "--batch",
                "1024",
            ][..],
            "requests per batch",
        ),
    ] {
        let mut args = vec!["bench", "--backend", "stub", "--kv", "--duration", "100ms"];
        args.extend(tiny);
        args.extend(geometry);
        refused_at_once(&args, &[says]);
    }
}

#[test]
fn a_kv_run_shorter_than_one_batch_measures_one_batch_per_mode_and_prints_no_nan() {
    let kv = [
        "bench",
        "--kv",
        "--backend",
        "stub",
        "--kv-layers",
        "2",
        "--kv-blocks",
        "16",
        "--batch",
        "4",
        "--duration",
        "1ns",
        "--baseline",
    ];
    let out = bounded(&kv, std::time::Duration::from_secs(60));
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        !stdout.contains("NaN") && !stdout.contains("inf") && !stdout.contains("-0.0"),
        "{stdout}"
    );
    let mut json = kv.to_vec();
    json.push("--json");
    let out = bounded(&json, std::time::Duration::from_secs(60));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 5, "{lines:?}");
    for v in &lines {
        assert!(v["blocks_per_s"].as_f64().unwrap() > 0.0, "{v}");
        assert!(v["lat_us_p50"].as_f64().unwrap() > 0.0, "{v}");
        assert!(v["requests_per_batch"].as_u64().unwrap() > 0, "{v}");
    }
}

#[test]
fn a_plot_that_cannot_be_written_is_refused_before_the_run() {
    let missing = std::env::temp_dir().join(format!("te-bench-no-such-dir-{}", std::process::id()));
    assert!(!missing.exists(), "{}", missing.display());
    let into_missing = missing.join("plot.svg");
    let a_dir = std::env::temp_dir();
    for (plot, says) in [
        (&into_missing, "does not exist"),
        (&a_dir, "is a directory"),
    ] {
        let path = plot.to_str().unwrap();
        let args = [
            "--backend",
            "stub",
            "--json",
            "--duration",
            "100ms",
            "--warmup",
            "0s",
            "--plot",
            path,
        ];
        let out = bench(&args);
        let stderr = text(&out.stderr);
        // Refused before anything was measured: no result line on stdout.
        assert!(
            out.stdout.is_empty(),
            "{args:?} measured: {}",
            text(&out.stdout)
        );
        assert_eq!(out.status.code(), Some(1), "{args:?} => {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?} => {stderr}");
        for n in ["--plot", path, says] {
            assert!(stderr.contains(n), "{args:?}: `{n}` not in {stderr}");
        }
    }
    assert!(!missing.exists(), "{}", missing.display());
}

#[test]
fn kv_refuses_the_options_it_does_not_take_naming_them() {
    let kv = [
        "bench",
        "--kv",
        "--backend",
        "stub",
        "--kv-layers",
        "2",
        "--kv-blocks",
        "64",
    ];
    let plot = std::env::temp_dir().join("te-bench-kv.svg");
    let plot = plot.to_str().unwrap();
    let cases: [&[&str]; 11] = [
        &["--threads", "2"],
        &["--iters", "3"],
        &["--warmup", "0s"],
        &["--verify"],
        &["--sweep"],
        &["--block-size", "4KiB"],
        &["--block-sizes", "4KiB,8KiB"],
        &["--batch-sizes", "1,2"],
        &["--plot", plot],
        &["--buffer-size", "1MiB"],
        &["--threads", "2", "--verify", "--sweep"],
    ];
    for extra in cases {
        let mut args = kv.to_vec();
        args.extend(extra);
        if extra[0] != "--iters" {
            // Short, so a run that wrongly goes ahead ends soon.
            args.extend(["--duration", "50ms"]);
        }
        let options: Vec<&str> = extra
            .iter()
            .copied()
            .filter(|a| a.starts_with("--"))
            .collect();
        let mut needles = vec!["--kv does not take"];
        needles.extend(&options);
        refused_at_once(&args, &needles);
    }
    assert!(!std::path::Path::new(plot).exists(), "{plot}");
}
