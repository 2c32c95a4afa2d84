//! The `te` command line: `info`, `check`, `serve`, `bench`, `probe`, `stats`, `peers`.
//!
//! Exit codes: 0 on success, 1 with a one-line cause on stderr on error, 2 for
//! command-line usage errors.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use te::Config;
use te_core::Registry;

mod bench;
mod probe;
mod serve;
mod stats;

/// te: a transfer engine for disaggregated LLM inference.
#[derive(Parser, Debug)]
#[command(name = "te", version, about)]
struct Cli {
    /// More log output on stderr (-v info, -vv debug); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// List every backend te knows: name, version, origin, whether it can run here.
    Info {
        /// Configuration file (default: $TE_CONFIG, else built-in defaults).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Validate a configuration and print what it resolves to.
    Check {
        /// Configuration file (default: $TE_CONFIG, else built-in defaults).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Serve a registered buffer to remote `te bench --target` runs until interrupted.
    Serve(Box<serve::ServeArgs>),
    /// Measure throughput and latency over loopback or against a `te serve`.
    Bench(Box<bench::BenchArgs>),
    /// Time the steps of a small transfer alone on this machine: thread wake-ups,
    /// socket round trips, and device copies launched and waited for.
    Probe(probe::ProbeArgs),
    /// Print a running engine's metrics as a live table, from its metrics endpoint.
    Stats(stats::StatsArgs),
    /// List the engines published in the configuration's metadata store (etcd).
    Peers {
        /// Configuration file (default: $TE_CONFIG, else built-in defaults).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Print one JSON object per engine instead of a table.
        #[arg(long)]
        json: bool,
    },
}

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    if matches!(cli.command, Command::Info { .. } | Command::Check { .. }) {
        // Printing commands end quietly when their reader goes away (`te info | head`),
        // as other command-line tools do, instead of failing on a broken pipe.
        // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let result = match cli.command {
        Command::Info { config, json } => info(config, json),
        Command::Check { config } => check(config),
        Command::Serve(args) => serve::run(*args),
        Command::Bench(args) => bench::run(*args),
        Command::Stats(args) => stats::run(args),
        Command::Probe(args) => probe::run(args),
        Command::Peers { config, json } => peers(config, json),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = std::io::stdout().flush();
            eprintln!("te: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn peers(config: Option<PathBuf>, json: bool) -> te::Result<()> {
    let config = Config::resolve(config.as_deref())?;
    let store = te_core::metadata::open(&config.engine)?;
    let engines = store.list(te_core::Deadline::after(config.engine.default_timeout))?;
    if json {
        for e in &engines {
            println!("{}", serde_json::to_string(e).unwrap_or_default());
        }
        return Ok(());
    }
    println!("{:<24} {:<18} {:<10} ADDRESS", "NAME", "EPOCH", "BACKEND");
    for e in &engines {
        println!(
            "{:<24} {:<18x} {:<10} {}",
            e.name, e.epoch, e.backend, e.address
        );
    }
    if engines.is_empty() {
        eprintln!("no engines in {}", store.describe());
    }
    Ok(())
}

fn info(config: Option<PathBuf>, json: bool) -> te::Result<()> {
    let config = Config::resolve(config.as_deref())?;
    let registry = Registry::discover(&config.engine.plugin_dirs);
    let selected = &config.engine.backend;
    let chosen = registry.get(selected);
    let is_selected =
        |e: &te_core::registry::Entry| chosen.as_ref().is_ok_and(|c| std::ptr::eq(*c, e));
    if json {
        let backends: Vec<_> = registry
            .entries()
            .iter()
            .map(|e| {
                serde_json::json!({
                    "name": e.name(),
                    "version": e.version(),
                    "origin": match e.origin() { te::Origin::BuiltIn => "built-in", te::Origin::Plugin(_) => "plugin" },
                    "path": match e.origin() { te::Origin::BuiltIn => None, te::Origin::Plugin(p) => Some(p.display().to_string()) },
                    "available": e.available().is_ok(),
                    "reason": e.available().as_ref().err().map(|r| r.to_string()),
                    "shadowed": e.is_shadowed(),
                    "selected": is_selected(e),
                })
            })
            .collect();
        let problems: Vec<_> = registry
            .problems()
            .iter()
            .map(|p| serde_json::json!({"path": p.path.display().to_string(), "error": p.error.to_string()}))
            .collect();
        let runtimes: Vec<_> = te_core::device::runtimes()
            .into_iter()
            .map(|(name, description, status)| {
                let copies = status
                    .is_ok()
                    .then(|| te_core::device::runtime(name).ok().map(|r| r.copy_path()))
                    .flatten();
                serde_json::json!({
                    "name": name,
                    "description": description,
                    "available": status.is_ok(),
                    "reason": status.err().map(|e| e.to_string()),
                    "copies": copies,
                })
            })
            .collect();
        let out = serde_json::json!({
            "runtimes": runtimes,
            "config": config.source,
            "selected": selected,
            "plugin_dirs": config.engine.plugin_dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>(),
            "backends": backends,
            "problems": problems,
        });
        println!("{out}");
    } else {
        println!("config: {} (backend = \"{selected}\")", config.source);
        println!("   NAME      VERSION  STATUS      ORIGIN");
        for e in registry.entries() {
            let mark = if is_selected(e) { "*" } else { "" };
            let status = match (e.available(), e.is_shadowed()) {
                (_, true) => "shadowed",
                (Ok(()), false) => "available",
                (Err(_), false) => "unavailable",
            };
            println!(
                "{mark:<3}{:<10}{:<9}{status:<12}{}",
                e.name(),
                e.version(),
                e.origin()
            );
            if let Err(r) = e.available() {
                println!("{:<3}  why: {r}", "");
            }
        }
        for p in registry.problems() {
            println!("plugin not loaded: {}: {}", p.path.display(), p.error);
        }
        println!("device runtimes:");
        for (name, description, status) in te_core::device::runtimes() {
            match status {
                Ok(()) => {
                    println!("   {name:<10}available   {description}");
                    if let Ok(rt) = te_core::device::runtime(name) {
                        println!("     copies: {}", rt.copy_path());
                    }
                }
                Err(e) => println!("   {name:<10}unavailable {description}\n     why: {e}"),
            }
        }
    }
    chosen.map(|_| ())
}

fn check(config: Option<PathBuf>) -> te::Result<()> {
    let config = Config::resolve(config.as_deref())?;
    let registry = Registry::discover(&config.engine.plugin_dirs);
    let name = &config.engine.backend;
    let entry = registry.get(name)?;
    // Creating the backend validates its own table; it is dropped at once.
    let backend = entry.create(&config.backend_context(name))?;
    // The other backends' tables are checked too, so a typo waits for no switch of backend.
    for other in config.backends.keys().filter(|k| *k != name) {
        let entry = registry.get(other).map_err(|e| {
            te::Error::new(
                te::ErrorKind::ConfigInvalid,
                format!("[backends.{other}] in {}: {}", config.source, e.message()),
            )
        })?;
        let ctx = config.backend_context(other);
        match entry.check_table(&ctx) {
            Some(checked) => checked?,
            None if entry.available().is_ok() => drop(entry.create(&ctx)?),
            None => {}
        }
    }
    // Device runtimes' tables, without starting the runtimes.
    for (name, table) in &config.runtimes {
        match te_core::device::check_table(name, table) {
            Some(checked) => checked.map_err(|e| {
                te::Error::new(
                    te::ErrorKind::ConfigInvalid,
                    format!("{}: {}", config.source, e.message()),
                )
            })?,
            None => println!(
                "warning: [runtimes.{name}]: no device runtime of that name in this build; `te info` lists them"
            ),
        }
    }
    let e = &config.engine;
    println!("config: {}", config.source);
    println!(
        "engine: name = {}, listen = {}, metadata = {}, default_timeout = {:?}",
        e.name, e.listen, e.metadata, e.default_timeout
    );
    println!(
        "backend: {} {} ({}), moves {} memory",
        backend.info().name,
        backend.info().version,
        entry.origin(),
        backend.info().capabilities.memory.join(", ")
    );
    for p in registry.problems() {
        println!(
            "warning: plugin not loaded: {}: {}",
            p.path.display(),
            p.error
        );
    }
    println!("ok");
    Ok(())
}
