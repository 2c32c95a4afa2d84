//! te-tcp's I/O threads: one small, fixed set of threads (a tokio runtime, one worker
//! per core, named `te-tcp-io`) serves every data connection of every tcp backend in
//! the process, on both sides, whatever the number of peers. A connection is a few
//! tasks on it (the initiator's sender and receiver; the target's server and, once it
//! sees device memory, its responder), which wait in epoll, not in threads.
//!
//! A [`Sock`] is a non-blocking socket registered with that runtime. Its operations
//! try the system call first and wait for readiness only when the kernel has nothing
//! (or no room), so a busy connection costs the same calls as a blocking one.
//! [`Tasks`] counts a backend's tasks, so the backend can wait for them to end before
//! its memory is handed back.

use std::future::Future;
use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use te_core::sync::{Condvar, Mutex};
use te_core::{Error, ErrorKind, Result};
use tokio::io::unix::AsyncFd;
use tokio::runtime::Runtime;

use crate::sock::{self, IOV_MAX};

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
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cores)
            .thread_name(THREAD_NAME)
            .max_blocking_threads(1)
            .enable_io()
            .enable_time()
            .build()
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

/// A connected, non-blocking socket registered with te-tcp's runtime. Shared by the
/// tasks of its connection; the descriptor closes when the last of them lets go, so no
/// task ever uses a number the process has reused.
#[derive(Debug)]
pub(crate) struct Sock {
    io: AsyncFd<TcpStream>,
}

/// What a readiness wait gave back: the socket's error, or the limit passed.
fn waited<T>(r: std::result::Result<io::Result<T>, tokio::time::error::Elapsed>) -> io::Result<T> {
    r.unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into()))
}

impl Sock {
    /// Registers `s` (made non-blocking here) with te-tcp's runtime.
    pub(crate) fn new(s: TcpStream) -> io::Result<Arc<Sock>> {
        let rt = runtime().map_err(|e| io::Error::other(e.to_string()))?;
        s.set_nonblocking(true)?;
        let _in = rt.enter();
        // SAFETY: the stream owns its open descriptor and the `AsyncFd` owns the
        // stream, so the descriptor stays open, the same socket, until it drops.
        let io = unsafe { AsyncFd::register(s) }.map_err(|e| e.into_parts().1)?;
        Ok(Arc::new(Sock { io }))
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.io.get_ref().as_raw_fd()
    }

    /// Shuts both directions down: every task waiting on it wakes with an error.
    pub(crate) fn shutdown(&self) {
        let _ = self.io.get_ref().shutdown(std::net::Shutdown::Both);
    }

    /// Receives into the spans (address, length) with one `recvmsg`, waiting for
    /// bytes at most `limit`. Returns how many arrived (`UnexpectedEof` once the peer
    /// closed; `TimedOut` after `limit`).
    ///
    /// Every span must be writable and touched by nobody else until this returns.
    pub(crate) async fn recv(
        &self,
        spans: &[(usize, usize)],
        limit: Duration,
    ) -> io::Result<usize> {
        match sock::recv(self.fd(), spans) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            r => return r,
        }
        waited(
            tokio::time::timeout(limit, async {
                loop {
                    let mut g = self.io.readable().await?;
                    match g.try_io(|s| sock::recv(s.as_raw_fd(), spans)) {
                        Ok(r) => return r,
                        Err(_would_block) => continue,
                    }
                }
            })
            .await,
        )
    }

    /// Sends every span (address, length), in order; each wait for room in the socket
    /// lasts at most `limit` (`TimedOut` then: the peer took nothing for that long).
    ///
    /// Every span must stay readable until this returns.
    pub(crate) async fn send_all(
        &self,
        spans: &[(usize, usize)],
        limit: Duration,
    ) -> io::Result<()> {
        let mut at = 0;
        let mut skip = 0;
        loop {
            while at < spans.len() && spans[at].1 == skip {
                at += 1;
                skip = 0;
            }
            if at == spans.len() {
                return Ok(());
            }
            let rest = &spans[at..spans.len().min(at + IOV_MAX)];
            let send = |fd: RawFd| sock::with_iovecs(rest, skip, |v| sock::send(fd, v, true));
            let n = match send(self.fd()) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => waited(
                    tokio::time::timeout(limit, async {
                        loop {
                            let mut g = self.io.writable().await?;
                            match g.try_io(|s| send(s.as_raw_fd())) {
                                Ok(r) => return r,
                                Err(_would_block) => continue,
                            }
                        }
                    })
                    .await,
                )?,
                r => r?,
            };
            // Walk `n` bytes forward over the spans.
            let mut n = n;
            while n > 0 {
                let left = spans[at].1 - skip;
                if n < left {
                    skip += n;
                    n = 0;
                } else {
                    n -= left;
                    at += 1;
                    skip = 0;
                }
            }
        }
    }

    /// Waits until the socket may take more bytes, at most `limit`, and runs `f`, whose
    /// `WouldBlock` means it found no room (the wait then starts again).
    pub(crate) async fn when_writable<T>(
        &self,
        limit: Duration,
        mut f: impl FnMut() -> io::Result<T>,
    ) -> io::Result<T> {
        waited(
            tokio::time::timeout(limit, async {
                loop {
                    let mut g = self.io.writable().await?;
                    match g.try_io(|_| f()) {
                        Ok(r) => return r,
                        Err(_would_block) => continue,
                    }
                }
            })
            .await,
        )
    }

    /// Reads exactly `b.len()` bytes, waiting at most until `until` in all.
    pub(crate) async fn read_exact_by(
        &self,
        b: &mut [u8],
        until: tokio::time::Instant,
    ) -> io::Result<()> {
        let mut got = 0;
        while got < b.len() {
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            let span = [(b.as_mut_ptr() as usize + got, b.len() - got)];
            // The span is the rest of `b`, which this call borrows mutably.
            got += self.recv(&span, left).await.map_err(|e| {
                if e.kind() == io::ErrorKind::TimedOut {
                    io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the peer did not finish the handshake within handshake_timeout",
                    )
                } else {
                    e
                }
            })?;
        }
        Ok(())
    }

    /// Writes all of `b`, waiting at most until `until`.
    pub(crate) async fn write_all_by(
        &self,
        b: &[u8],
        until: tokio::time::Instant,
    ) -> io::Result<()> {
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        self.send_all(&[(b.as_ptr() as usize, b.len())], left).await
    }
}
