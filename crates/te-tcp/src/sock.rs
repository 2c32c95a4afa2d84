//! Socket plumbing: a connection's socket ([`Sock`]), its options, vectored sends and
//! receives on raw memory, and a small inbound buffer for headers whose payloads still
//! land straight in registered memory.
//!
//! A [`Sock`] is a non-blocking socket registered with te-tcp's runtime (`runtime`).
//! Its operations try the system call first and wait for readiness only when the
//! kernel has nothing (or no room), so a busy connection costs the same calls as a
//! blocking one.

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use crate::config::TcpConfig;
use tokio::io::unix::AsyncFd;

use crate::runtime::runtime;

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

/// One non-blocking `recvmsg` into the spans (address, length), at most the first
/// [`IOV_MAX`]. `UnexpectedEof` once the peer has closed; `WouldBlock` when nothing
/// is there yet.
///
/// Every span must be writable memory of its length, touched by nobody else.
pub(crate) fn recv(fd: RawFd, spans: &[(usize, usize)]) -> io::Result<usize> {
    with_iovecs(spans, 0, |v| recv_iov(fd, v))
}

/// Runs `f` on iovecs over (at most the first [`IOV_MAX`] of) `spans`, the first
/// shortened by `skip` bytes: on the stack for a few spans, so a frame's receive or
/// send allocates nothing.
pub(crate) fn with_iovecs<T>(
    spans: &[(usize, usize)],
    skip: usize,
    f: impl FnOnce(&mut [libc::iovec]) -> T,
) -> T {
    const SMALL: usize = 8;
    let n = spans.len().min(IOV_MAX);
    let make = |i: usize| {
        let (p, len) = spans[i];
        let s = if i == 0 { skip } else { 0 };
        iov((p + s) as *const u8, len - s)
    };
    if n <= SMALL {
        let mut v = [iov(std::ptr::null(), 0); SMALL];
        for (i, x) in v.iter_mut().enumerate().take(n) {
            *x = make(i);
        }
        f(&mut v[..n])
    } else {
        let mut v: Vec<libc::iovec> = (0..n).map(make).collect();
        f(&mut v)
    }
}

fn recv_iov(fd: RawFd, v: &mut [libc::iovec]) -> io::Result<usize> {
    // SAFETY: an all-zero msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = v.as_mut_ptr();
    msg.msg_iovlen = v.len() as _;
    loop {
        // SAFETY: the caller's spans are writable memory of their lengths; `v` and
        // `msg` outlive the call.
        let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) };
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

/// Decides what a receive timeout means: called with whether a frame is partly
/// received, it returns true to keep waiting.
pub(crate) type OnTimeout<'a> = &'a mut (dyn FnMut(bool) -> bool + Send);

/// The receiving half of a connection: headers through a small buffer, payloads
/// straight into their destination.
pub(crate) struct Inbound {
    sock: Arc<Sock>,
    /// How long one wait for bytes lasts before `OnTimeout` is asked.
    wait: Duration,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    /// Reused by [`Inbound::read_scattered`].
    spans: Vec<(usize, usize)>,
}

impl Inbound {
    pub(crate) fn new(sock: Arc<Sock>, wait: Duration) -> Inbound {
        Inbound {
            sock,
            wait,
            buf: vec![0; INBOUND_BUF].into_boxed_slice(),
            start: 0,
            end: 0,
            spans: Vec::new(),
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

    /// One receive into `spans`, asking `on_timeout` (with `mid`) whenever nothing
    /// arrives for the connection's wait.
    async fn recv(
        &self,
        spans: &[(usize, usize)],
        mid: bool,
        on_timeout: OnTimeout<'_>,
    ) -> io::Result<usize> {
        loop {
            match self.sock.recv(spans, self.wait).await {
                Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                    if !on_timeout(mid) {
                        return Err(io::Error::new(io::ErrorKind::TimedOut, "receive timed out"));
                    }
                }
                r => return r,
            }
        }
    }

    /// The free tail of the buffer as a span.
    fn tail(&mut self) -> (usize, usize) {
        let tail = &mut self.buf[self.end..];
        (tail.as_mut_ptr() as usize, tail.len())
    }

    /// Waits until at least `n` (at most the buffer's size) bytes are buffered.
    pub(crate) async fn fill(&mut self, n: usize, on_timeout: OnTimeout<'_>) -> io::Result<()> {
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
            let tail = [self.tail()];
            let mid = self.end > self.start;
            self.end += self.recv(&tail, mid, on_timeout).await?;
        }
        Ok(())
    }

    /// Receives `len` bytes into `dst`: what is buffered first, the rest straight from
    /// the socket, in the same calls that also buffer whatever follows.
    ///
    /// `dst..dst + len` must be writable and touched by nobody else during the call.
    pub(crate) async fn read_into(
        &mut self,
        dst: usize,
        len: usize,
        on_timeout: OnTimeout<'_>,
    ) -> io::Result<()> {
        self.read_scattered(std::iter::once((dst, len)), on_timeout)
            .await
    }

    /// Receives bytes into each `(address, len)` of `dst` in turn, scattered by
    /// `recvmsg` straight into them (what is already buffered is copied first); the
    /// bytes that follow are buffered in the same calls once the last destination is
    /// in reach.
    ///
    /// Every destination must be writable and touched by nobody else during the call.
    pub(crate) async fn read_scattered(
        &mut self,
        dst: impl Iterator<Item = (usize, usize)>,
        on_timeout: OnTimeout<'_>,
    ) -> io::Result<()> {
        let mut v = std::mem::take(&mut self.spans);
        v.clear();
        v.extend(dst.filter(|d| d.1 > 0));
        let r = self.scatter(&mut v, on_timeout).await;
        v.clear();
        self.spans = v;
        r
    }

    async fn scatter(
        &mut self,
        v: &mut Vec<(usize, usize)>,
        on_timeout: OnTimeout<'_>,
    ) -> io::Result<()> {
        let n = v.len();
        let mut at = 0;
        // What is buffered goes first, copied.
        while at < n && self.end > self.start {
            let take = (self.end - self.start).min(v[at].1);
            // SAFETY: the caller guarantees each destination writable for its length and
            // `take` is within it; the source is our own buffer, which cannot overlap
            // registered memory.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.buf.as_ptr().add(self.start),
                    v[at].0 as *mut u8,
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
            let left: usize = v[at..end].iter().map(|x| x.1).sum();
            let tail = end == n;
            if tail {
                v.push((self.buf.as_mut_ptr() as usize, self.buf.len()));
            }
            let got = self
                .recv(&v[at..end + usize::from(tail)], true, on_timeout)
                .await;
            if tail {
                v.pop();
            }
            let got = got?;
            if got <= left {
                at = advance(v, at, got);
            } else {
                self.start = 0;
                self.end = got - left;
                at = n;
            }
        }
        Ok(())
    }

    /// Receives and drops `len` bytes.
    pub(crate) async fn discard(
        &mut self,
        mut len: u64,
        on_timeout: OnTimeout<'_>,
    ) -> io::Result<()> {
        while len > 0 {
            let n = (len as usize).min(self.buf.len());
            self.fill(n, on_timeout).await?;
            let take = (self.end - self.start).min(len as usize);
            self.consume(take);
            len -= take as u64;
        }
        Ok(())
    }
}

/// Drops the first `n` bytes from the spans, returning the index of the first left.
fn advance(v: &mut [(usize, usize)], mut at: usize, mut n: usize) -> usize {
    while n > 0 && at < v.len() {
        if n >= v[at].1 {
            n -= v[at].1;
            at += 1;
        } else {
            v[at].0 += n;
            v[at].1 -= n;
            n = 0;
        }
    }
    at
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
        match recv(self.fd(), spans) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            r => return r,
        }
        waited(
            tokio::time::timeout(limit, async {
                loop {
                    let mut g = self.io.readable().await?;
                    match g.try_io(|s| recv(s.as_raw_fd(), spans)) {
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
            let send = |fd: RawFd| with_iovecs(rest, skip, |v| send(fd, v, true));
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
