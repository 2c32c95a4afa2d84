//! The `te` command line: `info`, `check` and `serve`, as a user runs them.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn te() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_te"));
    c.env_remove("TE_CONFIG").env_remove("RUST_LOG");
    c
}

fn config(tag: &str, text: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("te-cli-{tag}-{}.toml", std::process::id()));
    std::fs::write(&p, text).unwrap();
    p
}

fn target_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_te"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Runs `cmd`, which must succeed, and parses each line it printed as JSON.
fn json_lines(cmd: &mut Command) -> Vec<serde_json::Value> {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn json(out: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn info_lists_stub_as_built_in_and_selected() {
    let out = te()
        .args(["info", "--json", "--config", "plugins.toml"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json(&out);
    let stub = v["backends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["name"] == "stub")
        .expect("stub listed");
    assert_eq!(stub["origin"], "built-in");
    assert_eq!(stub["available"], true);
}

#[test]
fn info_lists_plugins_from_plugin_dirs_with_their_path() {
    let dir = target_dir();
    let cfg = config(
        "plugins",
        &format!(
            "[engine]\nbackend = \"stub\"\nplugin_dirs = [{:?}]\n",
            dir.display().to_string()
        ),
    );
    let out = te()
        .args(["info", "--json", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json(&out);
    let stubs: Vec<_> = v["backends"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["name"] == "stub")
        .collect();
    assert_eq!(stubs.len(), 2, "{v}");
    assert_eq!(stubs[0]["origin"], "plugin");
    assert!(stubs[0]["path"]
        .as_str()
        .unwrap()
        .ends_with("libte_stub.so"));
    assert_eq!(stubs[0]["selected"], true);
    assert_eq!(stubs[1]["origin"], "built-in");
    assert_eq!(stubs[1]["shadowed"], true);
    let human = te().args(["info", "--config"]).arg(&cfg).output().unwrap();
    let text = String::from_utf8_lossy(&human.stdout);
    assert!(
        text.contains("shadowed") && text.contains("libte_stub.so"),
        "{text}"
    );
}

#[test]
fn an_unknown_backend_exits_non_zero_listing_the_available_ones() {
    let cfg = config("nope", "[engine]\nbackend = \"nope\"\n");
    for cmd in ["info", "check"] {
        let out = te().args([cmd, "--config"]).arg(&cfg).output().unwrap();
        assert!(!out.status.success(), "{cmd} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.contains("no backend named `nope`")
                && err.contains("available: ")
                && err.contains("stub"),
            "{err}"
        );
    }
}

#[test]
fn check_accepts_the_shipped_config_and_names_bad_keys() {
    let out = te()
        .args(["check", "--config", "plugins.toml"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout)
        .trim_end()
        .ends_with("ok"));
    let cfg = config("badkey", "[engine]\nbackend = \"stub\"\ntimeout = \"1s\"\n");
    let out = te().args(["check", "--config"]).arg(&cfg).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unknown field `timeout`") && err.contains(":3"),
        "{err}"
    );
    let cfg = config(
        "badtable",
        "[backends.stub]\nmod = \"copy\"\n[backends.tpc]\n",
    );
    let out = te().args(["check", "--config"]).arg(&cfg).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("mod"),
        "a bad key in another backend's table is caught"
    );
    let cfg = config("typo", "[backends.tpc]\n");
    let out = te().args(["check", "--config"]).arg(&cfg).output().unwrap();
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("[backends.tpc]"),
        "a misspelt backend table is caught"
    );
    let out = te()
        .args(["check", "--config", "/nonexistent/te.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read config file"));
}

#[test]
fn te_config_in_the_environment_is_used_when_no_flag_is_given() {
    let cfg = config("env", "[engine]\nbackend = \"nope\"\n");
    let out = te().arg("check").env("TE_CONFIG", &cfg).output().unwrap();
    assert!(!out.status.success());
}

/// Starts `te serve` as `cmd` says; the process and the first line it printed.
fn serve(cmd: &mut Command) -> (std::process::Child, String) {
    let mut child = cmd.stdout(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    (child, line)
}

#[test]
fn serve_prints_its_address_first_and_stops_on_sigterm() {
    let (mut child, line) =
        serve(te().args(["serve", "--backend", "stub", "--buffer-size", "1MiB"]));
    let addr: std::net::SocketAddr = line
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("first line is not an address: {line:?}"));
    assert!(std::net::TcpStream::connect(addr).is_ok());
    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "{status}");
            break;
        }
        assert!(Instant::now() < end, "te serve did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn serve_refuses_bad_sizes_with_one_line() {
    for size in ["0", "12XB", "-5"] {
        let out = te()
            .args(["serve", "--buffer-size", size])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{size}");
    }
}

#[test]
fn bench_kv_reports_contiguous_random_and_plain_modes() {
    let lines = json_lines(
        te().args([
            "bench",
            "--kv",
            "--backend",
            "stub",
            "--kv-layers",
            "2",
            "--kv-blocks",
            "16",
        ])
        .args(["--batch", "4", "--duration", "200ms", "--json"]),
    );
    let modes: Vec<&str> = lines.iter().map(|v| v["mode"].as_str().unwrap()).collect();
    assert_eq!(modes, ["contiguous", "random", "plain-1MiB"]);
    for v in &lines {
        assert!(
            v["blocks_per_s"].as_f64().unwrap() > 0.0 && v["gb_per_s"].as_f64().unwrap() > 0.0,
            "{v}"
        );
        assert_eq!(v["block_size"], 32768);
    }
    // Contiguous ids merge into one request per buffer: 2 layers × 2 buffers.
    assert_eq!(lines[0]["requests_per_batch"], 4);
    let out = te()
        .args([
            "bench",
            "--kv",
            "--backend",
            "stub",
            "--kv-blocks",
            "16",
            "--batch",
            "100",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("more blocks than the cache has"));
}

#[test]
fn probe_times_each_step_and_counts_one_device_call_per_group() {
    let steps = json_lines(te().args(["probe", "--mem", "fakedev:0", "--rounds", "20", "--json"]));
    assert_eq!(steps.len(), 10, "{steps:?}");
    for s in &steps {
        assert_eq!(s["rounds"], 20, "{s}");
        assert!(s["p50_us"].as_f64().unwrap() > 0.0, "{s}");
        assert!(s["p99_us"].as_f64() >= s["p50_us"].as_f64(), "{s}");
    }
    let device: Vec<_> = steps.iter().filter(|s| s["bytes"] != 0).collect();
    assert_eq!(device.len(), 7);
    for s in &device {
        // fakedev groups a direction's copies into one launch, waited for once: 128
        // scattered blocks included.
        assert_eq!(s["device_calls_per_round"], 1.0, "{s}");
        assert_eq!(s["device_syncs_per_round"], 1.0, "{s}");
    }
    let scattered = device
        .iter()
        .find(|s| s["step"].as_str().unwrap().contains("scattered"))
        .unwrap();
    assert_eq!(scattered["bytes"], 128 * 32 * 1024);
    // A driver without a batched call launches once per copy.
    let cfg = config("probe", "[runtimes.fakedev]\nbatch = false\n");
    let scattered = json_lines(
        te().args([
            "probe",
            "--mem",
            "fakedev:0",
            "--rounds",
            "5",
            "--json",
            "--config",
        ])
        .arg(&cfg),
    )
    .into_iter()
    .find(|s| s["step"].as_str().unwrap().contains("scattered"))
    .unwrap();
    assert_eq!(scattered["device_calls_per_round"], 128.0, "{scattered}");
}

#[test]
fn probe_refuses_bad_options_with_one_line() {
    for (args, says) in [
        (&["probe", "--mem", "nodev:0"][..], "nodev"),
        (&["probe", "--rounds", "0"][..], "--rounds"),
    ] {
        let out = te().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
}

#[test]
fn probe_refuses_more_rounds_than_it_can_keep_naming_the_limit() {
    for rounds in ["18446744073709551615", "100000000000"] {
        let out = te().args(["probe", "--rounds", rounds]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{rounds}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains("--rounds") && err.contains("1000000"), "{err}");
    }
}

/// A fake metrics endpoint on a free loopback port: each of its first 4 connections is
/// read up to the end of its request, then handed to `answer` on a thread of its own.
fn endpoint(answer: fn(std::net::TcpStream)) -> String {
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for conn in listener.incoming().take(4) {
            let Ok(mut conn) = conn else { return };
            std::thread::spawn(move || {
                let mut request = Vec::new();
                let mut byte = [0u8];
                while !request.ends_with(b"\r\n\r\n") && request.len() < 4096 {
                    match conn.read(&mut byte) {
                        Ok(1) => request.push(byte[0]),
                        _ => return,
                    }
                }
                answer(conn);
            });
        }
    });
    addr
}

/// Runs `te ARGS`, killing it if it has not ended within `limit`.
fn bounded(args: &[&str], limit: Duration) -> std::process::Output {
    let mut child = te()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let end = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    child.wait_with_output().unwrap()
}

#[test]
fn stats_gives_up_on_an_endpoint_that_trickles_its_answer() {
    let addr = endpoint(|mut conn| {
        use std::io::Write;
        let _ = conn.write_all(b"HTTP/1.1 200 OK\r\n\r\n");
        // One byte every 200 ms, for 20 s at most.
        for _ in 0..100 {
            if conn.write_all(b"x").is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    let out = bounded(
        &["stats", &addr, "--count", "1", "--interval", "10ms"],
        Duration::from_secs(30),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&addr) && err.contains("did not answer within 5 s"),
        "{err}"
    );
}

#[test]
fn stats_reads_an_answer_as_long_as_its_content_length_and_prints_no_nan() {
    let addr = endpoint(|mut conn| {
        use std::io::Write;
        let body = "# TYPE te_batches_completed_total counter\nte_batches_completed_total 10\nte_batches_in_flight NaN\nte_batch_latency_seconds_count +Inf\n";
        let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
        let _ = conn.write_all(head.as_bytes());
        let _ = conn.write_all(body.as_bytes());
        // The connection stays open, as HTTP/1.1 allows.
        std::thread::sleep(Duration::from_secs(8));
    });
    let out = bounded(
        &["stats", &addr, "--count", "1", "--interval", "10ms"],
        Duration::from_secs(30),
    );
    let (stdout, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{err}");
    assert_eq!(stdout.lines().count(), 2, "{stdout}");
    assert!(
        !stdout.contains("NaN") && !stdout.contains("inf"),
        "{stdout}"
    );
}

#[test]
fn stats_refuses_an_interval_longer_than_a_day() {
    let out = te()
        .args(["stats", "127.0.0.1:1", "--interval", "1000000000d"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--interval") && err.contains("1 day"), "{err}");
}

#[test]
fn serve_reads_every_notification_and_peer_event_as_they_come() {
    let log = std::env::temp_dir().join(format!("te-cli-serve-log-{}.txt", std::process::id()));
    let (mut child, line) = serve(
        te().args(["serve", "--backend", "tcp", "--buffer-size", "1MiB"])
            .env("RUST_LOG", "info,te::serve=debug")
            .stderr(std::fs::File::create(&log).unwrap()),
    );
    // Let the server's reader go to sleep before anything comes.
    std::thread::sleep(Duration::from_millis(300));
    let mut config = te::Config::default();
    config.engine.backend = "tcp".into();
    let me = te::Engine::from_config(&config).unwrap();
    let peer = me.connect(line.trim()).unwrap();
    for i in 0..3u8 {
        me.notify(&peer, vec![i; 16]).unwrap().wait().unwrap();
        std::thread::sleep(Duration::from_millis(100));
    }
    let read = |log: &PathBuf| std::fs::read_to_string(log).unwrap_or_default();
    let end = Instant::now() + Duration::from_secs(10);
    // Each notification read is one debug line naming its count.
    let read_count = |text: &str| {
        text.lines()
            .filter(|l| l.contains("notification") && l.contains("count"))
            .count()
    };
    // The peer leaves: an event.
    drop(peer);
    drop(me);
    while (read_count(&read(&log)) < 3 || !read(&log).contains("peer event"))
        && Instant::now() < end
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    let text = read(&log);
    let _ = std::fs::remove_file(&log);
    assert!(status.success(), "{status}");
    assert_eq!(
        read_count(&text),
        3,
        "te serve read and logged these of the 3 notifications sent:\n{text}"
    );
    assert!(text.contains("peer event"), "no peer event logged:\n{text}");
}

#[test]
fn check_names_bad_runtime_tables_without_starting_the_runtime() {
    let run = |tag: &str, text: &str| {
        let cfg = config(tag, text);
        te().args(["check", "--config"]).arg(&cfg).output().unwrap()
    };
    let out = run("rt-key", "[runtimes.fakedev]\nsync_cots = \"1ms\"\n");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("[runtimes.fakedev]") && err.contains("sync_cots"),
        "{err}"
    );
    let out = run("rt-visible", "[runtimes.fakedev]\nvisible = [0, 0]\n");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("visible"));
    let out = run("rt-cuda", "[runtimes.cuda]\nbatchcall = false\n");
    assert_eq!(
        out.status.code(),
        Some(1),
        "a cuda table is checked without a GPU"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("batchcall"));
    let out = run("rt-ok", "[runtimes.fakedev]\nsync_cost = \"1ms\"\n");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
