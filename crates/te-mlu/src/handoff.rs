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
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::thread::JoinHandle;
use std::time::Duration;

use te_core::{Error, ErrorKind, Result};

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
        let addr = SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| io_error("cannot name the mlu region table's socket", e))?;
        let listener = UnixListener::bind_addr(&addr).map_err(|e| {
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
            .spawn(move || serve(&listener, stop_fd, &table, instance))
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

/// Waits (in `poll`, no spinning) for a peer or the stop event; hands each peer of
/// this user the table.
fn serve(listener: &UnixListener, stop: RawFd, table: &OwnedFd, instance: u64) {
    loop {
        let mut fds = [
            libc::pollfd {
                fd: listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: stop,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfd entries; no timeout.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            if io::Error::last_os_error().kind() == IoKind::Interrupted {
                continue;
            }
            tracing::warn!(error = %io::Error::last_os_error(), "the mlu table server stopped");
            return;
        }
        if fds[1].revents != 0 {
            return;
        }
        loop {
            match listener.accept() {
                Ok((peer, _)) => {
                    if let Err(e) = hand_over(&peer, table, instance) {
                        tracing::debug!(error = %e, "an mlu peer did not get the region table");
                    }
                }
                Err(e) if e.kind() == IoKind::WouldBlock => break,
                Err(e) if e.kind() == IoKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors, most likely: let the peer retry later.
                    tracing::warn!(error = %e, "the mlu table server could not accept a peer");
                    break;
                }
            }
        }
    }
}

/// The effective user id of the process at the other end of `s`.
fn peer_uid(s: &UnixStream) -> io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid out-parameters of the sizes passed.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.uid)
}

fn hand_over(peer: &UnixStream, table: &OwnedFd, instance: u64) -> io::Result<()> {
    // SAFETY: plain call.
    let me = unsafe { libc::geteuid() };
    let uid = peer_uid(peer)?;
    if uid != me {
        return Err(io::Error::new(
            IoKind::PermissionDenied,
            format!("a process of user {uid} asked for the region table of user {me}"),
        ));
    }
    peer.set_nonblocking(false)?;
    peer.set_write_timeout(Some(Duration::from_secs(1)))?;
    let payload = instance.to_le_bytes();
    let mut iov = libc::iovec {
        iov_base: payload.as_ptr() as *mut libc::c_void,
        iov_len: payload.len(),
    };
    let mut space = [0u64; 4];
    // SAFETY: a zeroed msghdr is valid; the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = space.as_mut_ptr().cast();
    // SAFETY: plain arithmetic on the size of one descriptor.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as _;
    // SAFETY: `msg` points at `space`, large enough for one cmsghdr with one fd
    // (CMSG_SPACE(4) is 24 bytes on LP64; `space` has 32), aligned for cmsghdr.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), table.as_raw_fd());
    }
    // SAFETY: `msg` and everything it points to are valid for the call.
    let n = unsafe { libc::sendmsg(peer.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n != payload.len() as isize {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Receives instance `instance`'s table descriptor from the socket `name`, waiting at
/// most `timeout`.
///
/// # Errors
/// `PeerUnreachable` if nobody serves `name` here (the peer is gone, or in another
/// network namespace), `PeerRestarted` if another instance answers, `Io`/`Protocol`
/// for a broken exchange.
pub(crate) fn fetch(name: &str, instance: u64, timeout: Duration) -> Result<OwnedFd> {
    let addr = SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(|e| io_error("cannot name the peer's mlu table socket", e))?;
    let s = UnixStream::connect_addr(&addr).map_err(|e| {
        Error::new(
            ErrorKind::PeerUnreachable,
            format!(
                "cannot reach the peer's mlu region table at the abstract socket @{name}: {e} (the peer process is gone, or runs in another network namespace: mlu peers must share one)"
            ),
        )
        .with_source(e)
    })?;
    s.set_read_timeout(Some(timeout))
        .map_err(|e| io_error("cannot configure the mlu table socket", e))?;
    let mut payload = [0u8; 8];
    let mut iov = libc::iovec {
        iov_base: payload.as_mut_ptr().cast(),
        iov_len: payload.len(),
    };
    let mut space = [0u64; 4];
    // SAFETY: a zeroed msghdr is valid; the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = space.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&space) as _;
    // SAFETY: `msg` and everything it points to are valid for the call.
    let n = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return Err(Error::new(
            ErrorKind::PeerUnreachable,
            format!("the peer's mlu table server at @{name} did not answer: {e}"),
        )
        .with_source(e));
    }
    // SAFETY: `msg` was filled by recvmsg; CMSG_FIRSTHDR checks the control length.
    let c = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    // SAFETY: a non-null header lies inside `space`.
    let fd = if !c.is_null()
        && unsafe { (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS }
    {
        // SAFETY: an SCM_RIGHTS message carries at least one descriptor, now ours.
        let raw = unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<RawFd>()) };
        // SAFETY: the kernel installed `raw` in this process for us.
        Some(unsafe { OwnedFd::from_raw_fd(raw) })
    } else {
        None
    };
    let (Some(fd), 8) = (fd, n) else {
        return Err(Error::new(
            ErrorKind::Protocol,
            format!("the peer's mlu table server at @{name} sent no region table (a process of another user?)"),
        ));
    };
    if u64::from_le_bytes(payload) != instance {
        return Err(Error::new(
            ErrorKind::PeerRestarted,
            "the peer's region table belongs to another backend instance (the peer restarted)",
        ));
    }
    Ok(fd)
}
