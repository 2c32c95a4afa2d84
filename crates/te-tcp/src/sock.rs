//! Socket plumbing: options, vectored sends and receives on raw memory, and a small
//! inbound buffer for headers whose payloads still land straight in registered memory.

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use crate::config::TcpConfig;

/// Bytes of the inbound header buffer. Payload bytes that arrive in the same receive
/// as a header are copied out of it (at most this many per receive); the rest of every
/// payload is received straight into its destination.
pub(crate) const INBOUND_BUF: usize = 16 << 10;

/// The most iovecs one `sendmsg`/`recvmsg` takes (Linux's `UIO_MAXIOV`); longer lists
/// go out in several calls.
pub(crate) const IOV_MAX: usize = 1024;

fn setsockopt(fd: RawFd, level: i32, name: i32, value: i32) -> io::Result<()> {
    // SAFETY: `value` is a live i32 and its exact size is passed; the kernel only reads it.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Applies the configured options to a data connection (either side).
pub(crate) fn tune(s: &TcpStream, c: &TcpConfig) -> io::Result<()> {
    s.set_nodelay(c.nodelay)?;
    let fd = s.as_raw_fd();
    if c.send_buffer > 0 {
        setsockopt(fd, libc::SOL_SOCKET, libc::SO_SNDBUF, c.send_buffer as i32)?;
    }
    if c.recv_buffer > 0 {
        setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, c.recv_buffer as i32)?;
    }
    // Keepalive finds a peer host that vanished without a FIN while the connection idles.
    let idle = c.io_timeout.as_secs().clamp(1, 3600) as i32;
    setsockopt(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
    setsockopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, idle)?;
    setsockopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 1)?;
    setsockopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3)?;
    Ok(())
}

/// Sets both I/O timeouts; a blocking call that waits longer fails with `WouldBlock`.
pub(crate) fn timeouts(s: &TcpStream, t: Duration) -> io::Result<()> {
    s.set_read_timeout(Some(t))?;
    s.set_write_timeout(Some(t))
}

/// An iovec over raw memory.
pub(crate) fn iov(ptr: *const u8, len: usize) -> libc::iovec {
    libc::iovec {
        iov_base: ptr as *mut libc::c_void,
        iov_len: len,
    }
}

/// One `sendmsg` of (at most the first [`IOV_MAX`] of) `iov`; never raises SIGPIPE;
/// `nonblocking` returns `WouldBlock` instead of waiting for room.
///
/// Every iovec must point at memory that stays readable for the duration of the call.
pub(crate) fn send(fd: RawFd, iov: &[libc::iovec], nonblocking: bool) -> io::Result<usize> {
    // SAFETY: an all-zero msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = iov.len().min(IOV_MAX) as _;
    let flags = libc::MSG_NOSIGNAL | if nonblocking { libc::MSG_DONTWAIT } else { 0 };
    loop {
        // SAFETY: `msg` points at `iov`, whose entries the caller guarantees readable;
        // the kernel only reads them.
        let n = unsafe { libc::sendmsg(fd, &msg, flags) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Drops the first `n` bytes from `iov`, returning the index of the first iovec left.
fn advance(iov: &mut [libc::iovec], mut at: usize, mut n: usize) -> usize {
    while n > 0 && at < iov.len() {
        if n >= iov[at].iov_len {
            n -= iov[at].iov_len;
            at += 1;
        } else {
            // SAFETY: `n < iov_len`, so the new base stays inside the same buffer.
            iov[at].iov_base = unsafe { (iov[at].iov_base as *mut u8).add(n) }.cast();
            iov[at].iov_len -= n;
            n = 0;
        }
    }
    at
}

/// Sends all of `iov`, blocking; a send timeout is an error.
pub(crate) fn send_all(fd: RawFd, iov: &mut [libc::iovec]) -> io::Result<()> {
    let mut at = 0;
    while at < iov.len() {
        if iov[at].iov_len == 0 {
            at += 1;
            continue;
        }
        let n = send(fd, &iov[at..], false)?;
        at = advance(iov, at, n);
    }
    Ok(())
}

fn recv(fd: RawFd, iov: &mut [libc::iovec]) -> io::Result<usize> {
    // SAFETY: an all-zero msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len().min(IOV_MAX) as _;
    loop {
        // SAFETY: the caller's iovecs point at writable memory of their lengths.
        let n = unsafe { libc::recvmsg(fd, &mut msg, 0) };
        if n > 0 {
            return Ok(n as usize);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the peer closed the connection",
            ));
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Decides what a receive timeout means: called with whether a frame is partly
/// received, it returns true to keep waiting.
pub(crate) type OnTimeout<'a> = &'a mut dyn FnMut(bool) -> bool;

/// The receiving half of a connection: headers through a small buffer, payloads
/// straight into their destination.
pub(crate) struct Inbound {
    fd: RawFd,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// Reused by [`Inbound::read_scattered`].
    iov: Vec<libc::iovec>,
}

impl Inbound {
    pub(crate) fn new(fd: RawFd) -> Inbound {
        Inbound {
            fd,
            buf: vec![0; INBOUND_BUF].into_boxed_slice(),
            start: 0,
            end: 0,
            iov: Vec::new(),
        }
    }

    /// The buffered bytes.
    pub(crate) fn buffered(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// Drops `n` buffered bytes.
    pub(crate) fn consume(&mut self, n: usize) {
        self.start += n;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Waits until at least `n` (at most the buffer's size) bytes are buffered.
    pub(crate) fn fill(&mut self, n: usize, on_timeout: OnTimeout<'_>) -> io::Result<()> {
        debug_assert!(n <= self.buf.len());
        if self.end - self.start >= n {
            return Ok(());
        }
        if self.start + n > self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        while self.end - self.start < n {
            let tail = &mut self.buf[self.end..];
            let mut v = [iov(tail.as_mut_ptr(), tail.len())];
            match recv(self.fd, &mut v) {
                Ok(got) => self.end += got,
                Err(e) if is_timeout(&e) => {
                    if !on_timeout(self.end > self.start) {
                        return Err(io::Error::new(io::ErrorKind::TimedOut, "receive timed out"));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Receives `len` bytes into `dst`: what is buffered first, the rest straight from
    /// the socket, in the same calls that also buffer whatever follows.
    ///
    /// `dst..dst + len` must be writable and touched by nobody else during the call.
    pub(crate) fn read_into(
        &mut self,
        dst: *mut u8,
        len: usize,
        on_timeout: OnTimeout<'_>,
    ) -> io::Result<()> {
        let have = (self.end - self.start).min(len);
        // SAFETY: the caller guarantees `dst..dst + len` writable; `have <= len`, and
        // the source is our own buffer, which cannot overlap registered memory.
        unsafe { std::ptr::copy_nonoverlapping(self.buf.as_ptr().add(self.start), dst, have) };
        self.consume(have);
        let mut done = have;
        while done < len {
            // The buffer is empty here (everything buffered went to `dst`).
            let mut v = [
                // SAFETY: `done < len`, inside the caller's range.
                iov(unsafe { dst.add(done) }, len - done),
                iov(self.buf.as_mut_ptr(), self.buf.len()),
            ];
            match recv(self.fd, &mut v) {
                Ok(got) if got <= len - done => done += got,
                Ok(got) => {
                    self.start = 0;
                    self.end = got - (len - done);
                    done = len;
                }
                Err(e) if is_timeout(&e) => {
                    if !on_timeout(true) {
                        return Err(io::Error::new(io::ErrorKind::TimedOut, "receive timed out"));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Receives bytes into each `(address, len)` of `dst` in turn, scattered by
    /// `recvmsg` straight into them (what is already buffered is copied first); the
    /// bytes that follow are buffered in the same calls once the last destination is
    /// in reach.
    ///
    /// Every destination must be writable and touched by nobody else during the call.
    pub(crate) fn read_scattered(
        &mut self,
        dst: impl Iterator<Item = (usize, usize)>,
        on_timeout: OnTimeout<'_>,
    ) -> io::Result<()> {
        let mut v = std::mem::take(&mut self.iov);
        v.clear();
        v.extend(
            dst.filter(|d| d.1 > 0)
                .map(|(p, len)| iov(p as *const u8, len)),
        );
        let r = self.scatter(&mut v, on_timeout);
        v.clear();
        self.iov = v;
        r
    }

    fn scatter(&mut self, v: &mut Vec<libc::iovec>, on_timeout: OnTimeout<'_>) -> io::Result<()> {
        let n = v.len();
        let mut at = 0;
        // What is buffered goes first, copied.
        while at < n && self.end > self.start {
            let take = (self.end - self.start).min(v[at].iov_len);
            // SAFETY: the caller guarantees each destination writable for its length and
            // `take` is within it; the source is our own buffer, which cannot overlap
            // registered memory.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.buf.as_ptr().add(self.start),
                    v[at].iov_base.cast::<u8>(),
                    take,
                )
            };
            self.consume(take);
            at = advance(v, at, take);
        }
        while at < n {
            // The buffer is empty here. It joins the call only when every destination
            // left is in it, so the bytes that follow never overtake a destination.
            let end = n.min(at + IOV_MAX - 1);
            let left: usize = v[at..end].iter().map(|x| x.iov_len).sum();
            let tail = end == n;
            if tail {
                v.push(iov(self.buf.as_mut_ptr(), self.buf.len()));
            }
            let got = recv(self.fd, &mut v[at..end + usize::from(tail)]);
            if tail {
                v.pop();
            }
            match got {
                Ok(got) if got <= left => at = advance(v, at, got),
                Ok(got) => {
                    self.start = 0;
                    self.end = got - left;
                    at = n;
                }
                Err(e) if is_timeout(&e) => {
                    if !on_timeout(true) {
                        return Err(io::Error::new(io::ErrorKind::TimedOut, "receive timed out"));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Receives and drops `len` bytes.
    pub(crate) fn discard(&mut self, mut len: u64, on_timeout: OnTimeout<'_>) -> io::Result<()> {
        while len > 0 {
            let n = (len as usize).min(self.buf.len());
            self.fill(n.min(self.buf.len()), on_timeout)?;
            let take = (self.end - self.start).min(len as usize);
            self.consume(take);
            len -= take as u64;
        }
        Ok(())
    }
}
