//! `te serve`: a target engine with one registered buffer, serving until interrupted.
//!
//! The first line of stdout is the control-plane address (`HOST:PORT`), so a script can
//! read it and hand it to `te bench --target`. Notifications peers send it are read and
//! dropped (logged at debug level), and peer events logged, so nothing piles up.

use std::future::Future;
use std::io::Write;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use te::{Access, Config, Engine, MemoryKind};

/// Options of `te serve`.
#[derive(clap::Args, Debug)]
pub(crate) struct ServeArgs {
    /// Configuration file (default: $TE_CONFIG, else built-in defaults).
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    /// Backend name, overriding the configuration.
    #[arg(long)]
    pub(crate) backend: Option<String>,
    /// Control-plane listen address, overriding the configuration.
    #[arg(long)]
    pub(crate) listen: Option<String>,
    /// Size of the buffer registered as "buffer" (remote read and write): 64MiB, 1GiB, …
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    pub(crate) buffer_size: u64,
    /// Memory of the buffer: host, fakedev:0, cuda:0, … (`te info` lists the runtimes).
    #[arg(long, value_name = "KIND", default_value = "host")]
    pub(crate) mem: String,
    /// Serve the engine's metrics on this address (`GET /metrics`), overriding the
    /// configuration's `metrics_listen`; `te stats ADDR` shows them live.
    #[arg(long, value_name = "HOST:PORT")]
    pub(crate) metrics_listen: Option<String>,
    /// Serve a simulated model's KV cache instead (registered as "kv", with the layout
    /// "bench"), for `te bench --kv --target` with the same --kv-* options;
    /// --buffer-size does not apply.
    #[arg(long)]
    pub(crate) kv: bool,
    /// --kv: the simulated model's geometry.
    #[command(flatten)]
    pub(crate) kv_model: crate::bench::KvArgs,
}

/// clap value parser for sizes.
pub(crate) fn parse_size(s: &str) -> Result<u64, String> {
    match te::config::parse_size(s) {
        Ok(0) => Err("size must be greater than zero".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.message().to_string()),
    }
}

/// Blocks SIGINT and SIGTERM in this thread and every thread it starts later, so that
/// `wait_for_signal` receives them instead of the default handler.
fn block_signals() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise the set we own; pthread_sigmask only
    // changes this thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn wait_for_signal(set: &libc::sigset_t) -> i32 {
    let mut sig = 0;
    // SAFETY: `set` was initialised by `block_signals`; `sig` is writable.
    unsafe { libc::sigwait(set, &mut sig) };
    sig
}

pub(crate) fn run(args: ServeArgs) -> te::Result<()> {
    let set = block_signals();
    let mut config = Config::resolve(args.config.as_deref())?;
    if let Some(b) = args.backend {
        config.engine.backend = b;
    }
    if let Some(l) = args.listen {
        config.engine.listen = l;
    }
    if let Some(m) = args.metrics_listen {
        config.engine.metrics_listen = Some(m);
    }
    let len = usize::try_from(args.buffer_size).map_err(|_| {
        te::Error::new(
            te::ErrorKind::InvalidRequest,
            "buffer size does not fit in memory",
        )
    })?;
    let mem: MemoryKind = args.mem.parse().map_err(|e: te::Error| {
        te::Error::new(
            te::ErrorKind::InvalidRequest,
            format!("--mem {}: {}", args.mem, e.message()),
        )
    })?;
    let engine = Engine::from_config(&config)?;
    let (buffer, name) = if args.kv {
        let cache = crate::bench::cache_side(&engine, &args.kv_model, &mem)?;
        (cache, "kv\" (KV layout \"bench\")")
    } else {
        let buffer = engine.alloc_on(&mem, "buffer", len, Access::REMOTE_READ_WRITE)?;
        (buffer, "buffer\"")
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", engine.address());
    if let Some(m) = engine.metrics_address() {
        let _ = writeln!(
            out,
            "metrics at http://{m}/metrics (`te stats {m}` shows them live)"
        );
    }
    let _ = writeln!(
        out,
        "serving {} bytes of {mem} memory as \"{name} on backend {} (epoch {:016x}); Ctrl-C stops",
        buffer.len(),
        engine.backend_info().name,
        engine.epoch()
    );
    let _ = out.flush();
    drop(out);
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let reader = scope.spawn(|| read_until(&engine, &stop));
        let sig = wait_for_signal(&set);
        tracing::info!(signal = sig, "shutting down");
        stop.store(true, Ordering::Release);
        reader.thread().unpark();
    });
    drop(buffer);
    drop(engine);
    Ok(())
}

/// Wakes a parked thread.
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Reads (and logs) every notification and peer event until `stop`, so that nothing
/// peers send piles up in a server nobody reads from. It sleeps until one arrives: each
/// future is kept until it is ready, since a future dropped while pending takes its
/// waker with it.
fn read_until(engine: &Engine, stop: &AtomicBool) {
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut count = 0u64;
    let mut notification = engine.next_notification();
    let mut event = engine.next_event();
    while !stop.load(Ordering::Acquire) {
        let mut idle = true;
        if let Poll::Ready(n) = Pin::new(&mut notification).poll(&mut cx) {
            count += 1;
            tracing::debug!(from = %n.from, bytes = n.message.len(), count, "notification");
            notification = engine.next_notification();
            idle = false;
        }
        if let Poll::Ready(e) = Pin::new(&mut event).poll(&mut cx) {
            tracing::info!(kind = ?e.kind, peer = %e.name, address = %e.address, "peer event");
            event = engine.next_event();
            idle = false;
        }
        if idle {
            std::thread::park();
        }
    }
}
