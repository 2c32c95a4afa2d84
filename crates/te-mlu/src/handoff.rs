//! Handing a backend instance's region table (see `shm`) to its peers: the owner
//! serves the table's descriptor on an abstract Unix socket named after the instance,
//! and a peer receives it with `SCM_RIGHTS`.
//!
//! Opening `/proc/PID/fd/N` of the owner instead fails where the two processes live in
//! different PID namespaces (two containers on one host): the PID in the endpoint is
//! the owner's own, meaningless or another process's in the peer's namespace. An
//! abstract socket belongs to the network namespace, so peers that share one (as
//! MLU-Link peers on one host with host networking do) reach it whatever their PID
//! namespaces. Only processes of the owner's user are served.

use std::io::{self, ErrorKind as IoKind};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::thread::JoinHandle;
use std::time::Duration;
use te_core::kit::thread::SpawnMasked as _;

use te_core::local;
use te_core::{Deadline, Error, ErrorKind, Result};

/// The socket name (abstract namespace) of instance `instance`'s table.
pub(crate) fn socket_name(instance: u64) -> String {
    format!("te-mlu-{instance:016x}")
}

/// The thread serving one table, stopped when dropped.
#[derive(Debug)]
pub(crate) struct Server {
    stop: OwnedFd,
    thread: Option<JoinHandle<()>>,
}

fn io_error(what: &str, e: io::Error) -> Error {
    Error::new(ErrorKind::Io, format!("{what}: {e}")).with_source(e)
}

impl Server {
    /// Serves `table` (a descriptor this server keeps a duplicate of) as instance
    /// `instance`.
    ///
    /// # Errors
    /// `Io` if the socket, the stop event or the thread cannot be created.
    pub(crate) fn start(instance: u64, table: BorrowedFd<'_>) -> Result<Server> {
        let name = socket_name(instance);
        let listener = local::listen(&name).map_err(|e| {
            io_error(
                &format!("cannot listen on the abstract socket @{name} for the mlu region table"),
                e,
            )
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| io_error("cannot configure the mlu table socket", e))?;
        let table = table
            .try_clone_to_owned()
            .map_err(|e| io_error("cannot duplicate the mlu region table", e))?;
        // SAFETY: plain call; the flags are valid.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(io_error(
                "cannot create the mlu table server's stop event",
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: `raw` is a new descriptor we own.
        let stop = unsafe { OwnedFd::from_raw_fd(raw) };
        let stop_fd = stop.as_raw_fd();
        let thread = std::thread::Builder::new()
            .name("te-mlu-table".into())
            .spawn_masked(move || serve(&listener, stop_fd, &table, instance))
            .map_err(|e| io_error("cannot start the mlu table server", e))?;
        Ok(Server {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd.
        unsafe { libc::write(self.stop.as_raw_fd(), (&one as *const u64).cast(), 8) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The longest pause after a failed `accept`.
const MAX_PAUSE_MS: i32 = 1000;

/// Waits (in `poll`, no spinning) for a peer or the stop event; hands each peer of
/// this user the table. After an `accept` that failed (out of descriptors, most
/// likely), the peer stays in the backlog and the listener stays readable, so the
/// server waits for the stop event alone for a pause that doubles up to
/// `MAX_PAUSE_MS` while `accept` keeps failing, instead of polling the listener again
/// at once.
fn serve(listener: &UnixListener, stop: RawFd, table: &OwnedFd, instance: u64) {
    let mut pause: Option<i32> = None;
    loop {
        let mut fds = [
            libc::pollfd {
                fd: stop,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let (nfds, timeout) = match pause {
            Some(ms) => (1, ms),
            None => (2, -1),
        };
        // SAFETY: `nfds` valid pollfd entries.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), nfds, timeout) };
        if n < 0 {
            if io::Error::last_os_error().kind() == IoKind::Interrupted {
                continue;
            }
            tracing::warn!(error = %io::Error::last_os_error(), "the mlu table server stopped");
            return;
        }
        if fds[0].revents != 0 {
            return;
        }
        loop {
            match listener.accept() {
                Ok((peer, _)) => {
                    pause = None;
                    if let Err(e) = hand_over(&peer, table, instance) {
                        tracing::debug!(error = %e, "an mlu peer did not get the region table");
                    }
                }
                Err(e) if e.kind() == IoKind::WouldBlock => break,
                Err(e) if e.kind() == IoKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors, most likely: the peer waits in the backlog
                    // (or gives up at its deadline); try again after a pause.
                    if pause.is_none() {
                        tracing::warn!(error = %e, "the mlu table server could not accept a peer; retrying");
                    }
                    pause = Some(pause.map_or(10, |ms| (ms * 2).min(MAX_PAUSE_MS)));
                    break;
                }
            }
        }
    }
}

fn hand_over(peer: &UnixStream, table: &OwnedFd, instance: u64) -> io::Result<()> {
    let me = local::my_uid();
    let (_, uid) = local::peer_cred(peer)?;
    if uid != me {
        return Err(io::Error::new(
            IoKind::PermissionDenied,
            format!("a process of user {uid} asked for the region table of user {me}"),
        ));
    }
    peer.set_nonblocking(false)?;
    peer.set_write_timeout(Some(Duration::from_secs(1)))?;
    local::send_with_fd(peer, &instance.to_le_bytes(), Some(table.as_fd()))
}

/// Receives instance `instance`'s table descriptor from the socket `name`, before
/// `deadline`.
///
/// # Errors
/// `PeerUnreachable` if nobody serves `name` here (the peer is gone, or in another
/// network namespace), `PeerRestarted` if another instance answers, `Timeout` if the
/// table has not come by `deadline`, `Io`/`Protocol` for a broken exchange.
pub(crate) fn fetch(name: &str, instance: u64, deadline: Deadline) -> Result<OwnedFd> {
    let s = local::connect(name, deadline.left("connect")?).map_err(|e| {
        Error::new(
            ErrorKind::PeerUnreachable,
            format!(
                "cannot reach the peer's mlu region table at the abstract socket @{name}: {e} (the peer process is gone, or runs in another network namespace: mlu peers must share one)"
            ),
        )
        .with_source(e)
    })?;
    let mut payload = [0u8; 8];
    let no_table = || {
        Error::new(
            ErrorKind::Protocol,
            format!("the peer's mlu table server at @{name} sent no region table (a process of another user?)"),
        )
    };
    let fd = match local::recv_with_fd(&s, &mut payload) {
        Ok(fd) => fd.ok_or_else(no_table)?,
        Err(e) if e.kind() == IoKind::UnexpectedEof => return Err(no_table()),
        Err(e) if matches!(e.kind(), IoKind::WouldBlock | IoKind::TimedOut) => {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!("the peer's mlu table server at @{name} did not answer by the deadline"),
            )
            .with_operation("connect")
            .with_source(e))
        }
        Err(e) => {
            return Err(Error::new(
                ErrorKind::PeerUnreachable,
                format!("the peer's mlu table server at @{name} did not answer: {e}"),
            )
            .with_source(e))
        }
    };
    if u64::from_le_bytes(payload) != instance {
        return Err(Error::new(
            ErrorKind::PeerRestarted,
            "the peer's region table belongs to another backend instance (the peer restarted)",
        ));
    }
    Ok(fd)
}
