//! te-tcp's I/O threads: one small, fixed set of threads (a tokio runtime, one worker
//! per core, named `te-tcp-io`) serves every data connection of every tcp backend in
//! the process, on both sides, whatever the number of peers. A connection is a few
//! tasks on it (the initiator's sender and receiver; the target's server and, once it
//! sees device memory, its responder), which wait in epoll, not in threads.
//!
//! A connection's socket (`sock::Sock`) is registered with that runtime.
//! [`Tasks`] counts a backend's tasks, so the backend can wait for them to end before
//! its memory is handed back.

use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use te_core::sync::{Condvar, Mutex};
use te_core::{Error, ErrorKind, Result};
use tokio::runtime::Runtime;

/// The name of te-tcp's I/O threads.
pub(crate) const THREAD_NAME: &str = "te-tcp-io";

/// The process's te-tcp runtime, started on first use with one worker per core.
///
/// # Errors
/// `Io` if its threads cannot start.
pub(crate) fn runtime() -> Result<&'static Runtime> {
    static RT: OnceLock<std::result::Result<Runtime, String>> = OnceLock::new();
    let rt = RT.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        // Its threads take none of the process's signals (te_core::kit::thread): the
        // workers, started here, from the start; a blocking thread, started later,
        // from its first step.
        te_core::kit::thread::masked(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(cores)
                .thread_name(THREAD_NAME)
                .max_blocking_threads(1)
                .on_thread_start(te_core::kit::thread::mask_signals)
                .enable_io()
                .enable_time()
                .build()
        })
        .map_err(|e| e.to_string())
    });
    rt.as_ref().map_err(|e| {
        Error::new(
            ErrorKind::Io,
            format!("cannot start te-tcp's I/O threads: {e}"),
        )
    })
}

/// Whether the calling thread is one of te-tcp's I/O threads.
pub(crate) fn on_io_thread() -> bool {
    std::thread::current().name() == Some(THREAD_NAME)
}

/// The tasks of one backend still running.
#[derive(Debug, Default)]
pub(crate) struct Tasks {
    live: Mutex<usize>,
    ended: Condvar,
}

/// Counts one task in [`Tasks`] until dropped (the task ended or was dropped).
struct Counted(Arc<Tasks>);

impl Drop for Counted {
    fn drop(&mut self) {
        *self.0.live.lock() -= 1;
        self.0.ended.notify_all();
    }
}

impl Tasks {
    /// Runs `f` on te-tcp's I/O threads, counted until it ends.
    ///
    /// # Errors
    /// `Io` if the I/O threads cannot start.
    pub(crate) fn spawn(
        self: &Arc<Self>,
        f: impl Future<Output = ()> + Send + 'static,
    ) -> Result<()> {
        let rt = runtime()?;
        *self.live.lock() += 1;
        let counted = Counted(self.clone());
        rt.spawn(async move {
            f.await;
            drop(counted);
        });
        Ok(())
    }

    /// Waits until every task has ended, at most `limit`; returns how many still run.
    pub(crate) fn wait(&self, limit: Duration) -> usize {
        let end = std::time::Instant::now() + limit;
        let mut live = self.live.lock();
        while *live > 0 {
            let left = end.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            live = self.ended.wait_timeout(live, left).0;
        }
        *live
    }
}
