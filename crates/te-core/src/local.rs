//! Peers on this host: what backends use to find out that a peer shares their host and
//! to move its memory without a socket.
//!
//! - **Which host.** [`boot_id`] is the kernel's boot id: two engines with different
//!   ones are on different hosts (or one restarted). Equal ones prove nothing by
//!   themselves — a descriptor can claim any — so a backend never trusts them alone:
//!   it opens a channel only a process of this host can open.
//! - **The channel.** A Unix socket in the abstract namespace ([`listen`], [`connect`]):
//!   reachable only from this host's network namespace, never over a network. The
//!   listener learns who connected from the kernel ([`peer_cred`]: pid and uid as seen
//!   in its own pid namespace), not from the peer's word, and serves only its own user.
//!   Descriptors (a device runtime's exported memory) travel over it with
//!   `SCM_RIGHTS` ([`send_with_fd`], [`recv_with_fd`]).
//! - **Host memory without the socket.** [`cma_read`] and [`cma_write`] copy between this
//!   process and a peer process with `process_vm_readv`/`process_vm_writev` (cross-memory
//!   attach): one copy, no socket. The kernel allows it where this process may ptrace
//!   the peer (same user and a permissive Yama scope, or `CAP_SYS_PTRACE`); where it
//!   refuses, the caller moves the bytes over its socket instead.
//! - **Words both see.** A [`SharedPage`] is one page of memory mapped by two processes
//!   (a sealed memfd passed over the channel): atomics in it order what each side may
//!   do without a message, as a target telling its initiator that it is copying.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::Duration;

/// The kernel's boot id (`/proc/sys/kernel/random/boot_id`) as 16 bytes, or `None`
/// where it cannot be read: then no peer is taken for one of this host.
pub fn boot_id() -> Option<[u8; 16]> {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let hex: Vec<u8> = text.trim().bytes().filter(|b| *b != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(out)
}

fn abstract_addr(name: &str) -> io::Result<SocketAddr> {
    SocketAddr::from_abstract_name(name.as_bytes())
}

/// Listens on the abstract Unix socket `@name`.
///
/// # Errors
/// The system's error (`AddrInUse` if another process holds the name).
pub fn listen(name: &str) -> io::Result<UnixListener> {
    UnixListener::bind_addr(&abstract_addr(name)?)
}

/// Connects to the abstract Unix socket `@name`, with `timeout` on every later read
/// and write. A connect to a Unix socket never waits for the network: it succeeds or
/// fails at once (`ConnectionRefused` where nobody on this host listens on the name).
///
/// # Errors
/// The system's error.
pub fn connect(name: &str, timeout: Duration) -> io::Result<UnixStream> {
    let s = UnixStream::connect_addr(&abstract_addr(name)?)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    Ok(s)
}

/// Who is at the other end of `s`, from the kernel: (pid, uid), the pid as this
/// process's pid namespace sees it (0 where the peer is in a namespace it cannot see).
///
/// # Errors
/// The system's error.
pub fn peer_cred(s: &UnixStream) -> io::Result<(i32, u32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid out-parameters of the sizes given; the socket
    // is open for the call's length.
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
    Ok((cred.pid, cred.uid))
}

/// This process's effective user id: what [`peer_cred`] tells a peer of it.
pub fn my_uid() -> u32 {
    // SAFETY: geteuid cannot fail and has no preconditions.
    unsafe { libc::geteuid() }
}

/// Sends all of `bytes` on `s`, with `fd` (if any) attached to the first byte.
///
/// # Errors
/// The system's error.
pub fn send_with_fd(s: &UnixStream, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let sent = match fd {
        Some(_) => sendmsg(s, bytes, fd, 0)?,
        None => 0,
    };
    let mut w = s;
    io::Write::write_all(&mut w, &bytes[sent..])
}

/// Sends what of `bytes` `s` takes without waiting, with `fd` (if any) attached to the
/// first byte: the bytes sent, 0 where the socket is full (then `fd` was not sent).
///
/// # Errors
/// The system's error (`BrokenPipe` for a socket shut for writing, never a signal).
pub fn send_nowait(s: &UnixStream, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<usize> {
    let mut sent = 0;
    let mut fd = fd;
    while sent < bytes.len() {
        match sendmsg(s, &bytes[sent..], fd.take(), libc::MSG_DONTWAIT) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(sent)
}

/// One `sendmsg` of `bytes` with `flags` (and `MSG_NOSIGNAL`), with `fd` attached if
/// given: the bytes sent.
fn sendmsg(
    s: &UnixStream,
    bytes: &[u8],
    fd: Option<BorrowedFd<'_>>,
    flags: i32,
) -> io::Result<usize> {
    // Room for one descriptor, aligned as cmsghdr needs.
    let mut space = [0u64; 4];
    let iov = [IoSlice::new(bytes)];
    // SAFETY: an all-zero msghdr is a valid empty message; the fields set below
    // point at `iov` and `space`, which outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = 1;
    if let Some(fd) = fd {
        msg.msg_control = space.as_mut_ptr().cast();
        // SAFETY: CMSG_SPACE is a pure size computation.
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(std::mem::size_of::<i32>() as u32) } as _;
        // SAFETY: the control buffer holds CMSG_SPACE(4) bytes (32 available), so the
        // first header and its 4 data bytes lie inside it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<i32>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<i32>(), fd.as_raw_fd());
        }
    }
    // SAFETY: `msg` is fully initialised above and points at live buffers.
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL | flags) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Reads exactly `buf.len()` bytes from `s`, and the descriptor attached to them, if
/// one was (at most one is accepted; more are closed and refused).
///
/// # Errors
/// The system's error; `UnexpectedEof` if the peer closed first; `InvalidData` if more
/// than one descriptor came.
pub fn recv_with_fd(s: &UnixStream, buf: &mut [u8]) -> io::Result<Option<OwnedFd>> {
    let mut got = 0;
    let mut fd: Option<OwnedFd> = None;
    while got < buf.len() {
        let mut space = [0u64; 8];
        let mut iov = [IoSliceMut::new(&mut buf[got..])];
        // SAFETY: as in `send_with_fd`: an empty message pointing at live buffers.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr().cast();
        msg.msg_iovlen = 1;
        msg.msg_control = space.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&space) as _;
        // SAFETY: `msg` points at live buffers of the sizes it names.
        let n = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        let mut extra = false;
        // SAFETY: the kernel filled `msg`'s control part; the CMSG macros walk it
        // within `msg_controllen`, and each SCM_RIGHTS payload holds whole ints.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(c).cast::<i32>();
                    let bytes = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                    for i in 0..bytes / std::mem::size_of::<i32>() {
                        let raw = std::ptr::read_unaligned(data.add(i));
                        // The kernel gave us this descriptor; we own it now.
                        let owned = OwnedFd::from_raw_fd(raw);
                        if fd.is_none() {
                            fd = Some(owned);
                        } else {
                            extra = true;
                        }
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        if extra || msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the peer sent more than one descriptor with a message",
            ));
        }
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        got += n as usize;
    }
    Ok(fd)
}

/// A new memfd of `len` zero bytes, sealed so that its size can never change: a process
/// it is sent to that could shrink it would make every other mapping's next access past
/// the new end fault (`SIGBUS`).
///
/// # Errors
/// The system's error.
pub fn sealed_memfd(name: &std::ffi::CStr, len: usize) -> io::Result<OwnedFd> {
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // SAFETY: a valid C string and flags; the result is checked.
    let raw = unsafe { libc::memfd_create(name.as_ptr(), flags) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` was just created and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    let len = libc::off_t::try_from(len).map_err(|_| bad_data("memfd size out of range"))?;
    // SAFETY: plain calls on an open memfd; results checked.
    let sized = unsafe {
        libc::ftruncate(fd.as_raw_fd(), len) == 0
            && libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) == 0
    };
    if !sized {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Checks that `fd`, received from a peer, is a memfd of exactly `len` bytes sealed
/// against shrinking (as [`sealed_memfd`] makes them), so that a mapping of `len` bytes
/// of it can never fault whatever its sender does afterwards.
///
/// # Errors
/// `InvalidData` naming what is wrong with it.
pub fn check_sealed(fd: BorrowedFd<'_>, len: usize) -> io::Result<()> {
    // SAFETY: a plain call on an open descriptor.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(bad_data(
            "the peer's memfd is not sealed against shrinking (F_SEAL_SHRINK): its sender could shrink it under the mapping",
        ));
    }
    // SAFETY: an all-zero stat is a valid out-parameter.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is valid for the call; the descriptor is open.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if u64::try_from(st.st_size).ok() != Some(len as u64) {
        return Err(bad_data(&format!(
            "the peer's memfd holds {} bytes, not {len}",
            st.st_size
        )));
    }
    Ok(())
}

fn bad_data(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

/// One page of memory that two processes of this host map, for words both read and
/// write atomically ([`SharedPage::word`]): a memfd, sealed so that its size can never
/// change (a peer that could shrink it would make the other's next access fault),
/// passed to the peer over a Unix socket ([`send_with_fd`]).
#[derive(Debug)]
pub struct SharedPage {
    ptr: std::ptr::NonNull<std::sync::atomic::AtomicU32>,
    fd: OwnedFd,
}

// SAFETY: the page is only ever accessed through atomics, from any thread.
unsafe impl Send for SharedPage {}
// SAFETY: as above.
unsafe impl Sync for SharedPage {}

impl SharedPage {
    /// Bytes in the page.
    pub const LEN: usize = 4096;

    /// A new page of zeros, sealed against any change of size.
    ///
    /// # Errors
    /// The system's error.
    pub fn new() -> io::Result<SharedPage> {
        SharedPage::map(sealed_memfd(c"te-shared-page", Self::LEN)?)
    }

    /// The page a peer sent: refused unless it is a memfd of exactly one page that can
    /// never shrink.
    ///
    /// # Errors
    /// `InvalidData` for a descriptor that is not such a page; the system's error.
    pub fn open(fd: OwnedFd) -> io::Result<SharedPage> {
        check_sealed(fd.as_fd(), Self::LEN)
            .map_err(|_| bad_data("the peer's shared page is not a sealed memfd of one page"))?;
        SharedPage::map(fd)
    }

    fn map(fd: OwnedFd) -> io::Result<SharedPage> {
        // SAFETY: mapping LEN bytes of an open memfd that is at least that long and
        // cannot shrink; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                Self::LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = std::ptr::NonNull::new(p.cast()).ok_or_else(io::Error::last_os_error)?;
        Ok(SharedPage { ptr, fd })
    }

    /// The descriptor to send to the peer.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Word `i` of the page (`i < LEN / 4`).
    ///
    /// # Panics
    /// If `i` is outside the page.
    pub fn word(&self, i: usize) -> &std::sync::atomic::AtomicU32 {
        assert!(i < Self::LEN / 4, "word {i} is outside the shared page");
        // SAFETY: the page is mapped for LEN bytes while `self` lives, aligned to a
        // page, so word `i` lies inside it, aligned; it is only accessed atomically.
        unsafe { &*self.ptr.as_ptr().add(i) }
    }
}

impl Drop for SharedPage {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, LEN bytes, no longer referenced (every
        // word borrowed from `self` is gone).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), Self::LEN) };
    }
}

/// The most ranges one `process_vm_*` call takes (`IOV_MAX`).
const IOV_MAX: usize = 1024;

/// Copies from process `pid`'s ranges `remote` (address, bytes) into this process's
/// ranges `local`, which add up to as many bytes, with `process_vm_readv`.
///
/// # Safety
/// Every `local` range must be writable memory of this process that nothing else
/// touches during the call.
///
/// # Errors
/// The system's error: `PermissionDenied` where the kernel does not let this process
/// reach `pid`'s memory (another user, Yama, no `CAP_SYS_PTRACE`), `NotFound` where the
/// process is gone, `EFAULT` (as `Other`) where a remote range is not mapped there.
pub unsafe fn cma_read(
    pid: i32,
    local: &[(usize, usize)],
    remote: &[(u64, usize)],
) -> io::Result<()> {
    // SAFETY: forwarded from the caller.
    unsafe { cma(pid, local, remote, false) }
}

/// Copies this process's ranges `local` into process `pid`'s ranges `remote`, with
/// `process_vm_writev`.
///
/// # Safety
/// Every `local` range must be readable memory of this process.
///
/// # Errors
/// As [`cma_read`].
pub unsafe fn cma_write(
    pid: i32,
    local: &[(usize, usize)],
    remote: &[(u64, usize)],
) -> io::Result<()> {
    // SAFETY: forwarded from the caller.
    unsafe { cma(pid, local, remote, true) }
}

/// Both directions: walks the two lists in step, at most [`IOV_MAX`] ranges of each per
/// call, and goes on after a partial transfer from where it stopped.
unsafe fn cma(
    pid: i32,
    local: &[(usize, usize)],
    remote: &[(u64, usize)],
    write: bool,
) -> io::Result<()> {
    let total = |v: &mut dyn Iterator<Item = usize>| v.sum::<usize>();
    if total(&mut local.iter().map(|r| r.1)) != total(&mut remote.iter().map(|r| r.1)) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the local and remote ranges differ in length",
        ));
    }
    // Cursors: range index and bytes done within it, on each side.
    let (mut li, mut lo, mut ri, mut ro) = (0usize, 0usize, 0usize, 0usize);
    while li < local.len() && ri < remote.len() {
        let l: Vec<libc::iovec> = local[li..]
            .iter()
            .take(IOV_MAX)
            .enumerate()
            .map(|(k, &(a, n))| {
                let skip = if k == 0 { lo } else { 0 };
                libc::iovec {
                    iov_base: (a + skip) as *mut libc::c_void,
                    iov_len: n - skip,
                }
            })
            .collect();
        let r: Vec<libc::iovec> = remote[ri..]
            .iter()
            .take(IOV_MAX)
            .enumerate()
            .map(|(k, &(a, n))| {
                let skip = if k == 0 { ro } else { 0 };
                libc::iovec {
                    iov_base: (a as usize + skip) as *mut libc::c_void,
                    iov_len: n - skip,
                }
            })
            .collect();
        // SAFETY: the local ranges are valid per the caller; the remote ones are only
        // addresses in the other process, checked by the kernel.
        let n = unsafe {
            if write {
                libc::process_vm_writev(pid, l.as_ptr(), l.len() as _, r.as_ptr(), r.len() as _, 0)
            } else {
                libc::process_vm_readv(pid, l.as_ptr(), l.len() as _, r.as_ptr(), r.len() as _, 0)
            }
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the peer process's memory ended part way",
            ));
        }
        // Advance both cursors by `n` bytes.
        let mut left = n as usize;
        while left > 0 && li < local.len() {
            let room = local[li].1 - lo;
            if left >= room {
                left -= room;
                li += 1;
                lo = 0;
            } else {
                lo += left;
                left = 0;
            }
        }
        let mut left = n as usize;
        while left > 0 && ri < remote.len() {
            let room = remote[ri].1 - ro;
            if left >= room {
                left -= room;
                ri += 1;
                ro = 0;
            } else {
                ro += left;
                left = 0;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sending_without_waiting_stops_where_the_socket_is_full_and_carries_the_descriptor() {
        let (a, b) = UnixStream::pair().unwrap();
        let page = SharedPage::new().unwrap();
        let big = vec![7u8; 16 << 20];
        let sent = send_nowait(&a, &big, Some(page.fd())).unwrap();
        assert!(sent > 0 && sent < big.len(), "{sent} of {}", big.len());
        // Full: nothing more goes, and no descriptor either.
        assert_eq!(send_nowait(&a, &big, Some(page.fd())).unwrap(), 0);
        let mut head = [0u8; 8];
        let fd = recv_with_fd(&b, &mut head)
            .unwrap()
            .expect("the descriptor came");
        assert!(SharedPage::open(fd).is_ok());
        b.shutdown(std::net::Shutdown::Read).unwrap();
        drop(b);
        let e = send_nowait(&a, &big, None).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::BrokenPipe, "{e}");
    }

    #[test]
    fn a_shared_page_is_seen_by_both_mappings_and_cannot_change_size() {
        use std::sync::atomic::Ordering;
        let a = SharedPage::new().unwrap();
        let dup = a.fd().try_clone_to_owned().unwrap();
        let b = SharedPage::open(dup).unwrap();
        a.word(3).store(7, Ordering::SeqCst);
        assert_eq!(b.word(3).load(Ordering::SeqCst), 7);
        for len in [0, 2 * SharedPage::LEN] {
            // SAFETY: a plain call on an open descriptor.
            let r = unsafe { libc::ftruncate(a.fd().as_raw_fd(), len as libc::off_t) };
            assert_eq!(r, -1, "resized to {len}");
        }
        assert_eq!(b.word(3).load(Ordering::SeqCst), 7);
    }

    #[test]
    fn a_page_that_could_shrink_or_is_not_one_page_is_refused() {
        let memfd = |len: usize, seal: bool| {
            let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
            // SAFETY: plain calls; results checked.
            unsafe {
                let fd = OwnedFd::from_raw_fd(libc::memfd_create(c"t".as_ptr(), flags));
                assert_eq!(libc::ftruncate(fd.as_raw_fd(), len as libc::off_t), 0);
                if seal {
                    assert_eq!(
                        libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK),
                        0
                    );
                }
                fd
            }
        };
        for (len, seal) in [(SharedPage::LEN, false), (1 << 20, true), (16, true)] {
            let e = SharedPage::open(memfd(len, seal)).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{len} {seal}");
        }
        assert!(SharedPage::open(memfd(SharedPage::LEN, true)).is_ok());
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        assert!(SharedPage::open(file.into()).is_err());
    }

    #[test]
    fn the_boot_id_is_read_as_16_bytes() {
        let id = boot_id().expect("Linux has a boot id");
        assert_ne!(id, [0; 16]);
        assert_eq!(
            boot_id(),
            Some(id),
            "it does not change while the host runs"
        );
    }

    #[test]
    fn a_descriptor_travels_with_its_message_and_the_kernel_names_the_sender() {
        let name = format!("te-local-test-{}", std::process::id());
        let l = listen(&name).unwrap();
        let c = connect(&name, Duration::from_secs(5)).unwrap();
        let (s, _) = l.accept().unwrap();
        assert_eq!(
            peer_cred(&s).unwrap(),
            (std::process::id() as i32, my_uid())
        );
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        use std::os::fd::AsFd;
        send_with_fd(&c, b"hello", Some(file.as_fd())).unwrap();
        send_with_fd(&c, b"plain", None).unwrap();
        let mut b = [0u8; 5];
        let fd = recv_with_fd(&s, &mut b).unwrap();
        assert_eq!(&b, b"hello");
        assert!(fd.is_some(), "the descriptor came with the message");
        let fd = recv_with_fd(&s, &mut b).unwrap();
        assert_eq!((&b, fd.is_none()), (b"plain", true));
        drop(c);
        let e = recv_with_fd(&s, &mut b).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn nobody_listening_is_refused_at_once() {
        let e = connect("te-local-test-nobody-here", Duration::from_secs(5)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused);
    }

    #[test]
    fn cma_copies_scattered_ranges_of_unequal_cuts_both_ways() {
        let pid = std::process::id() as i32;
        let src: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; 10_000];
        // Remote cut in 3 ranges, local in 2 of other lengths.
        let remote = [
            (src.as_ptr() as u64, 1000),
            (src.as_ptr() as u64 + 1000, 7000),
            (src.as_ptr() as u64 + 8000, 2000),
        ];
        let local = [
            (dst.as_mut_ptr() as usize, 4321),
            (dst.as_mut_ptr() as usize + 4321, 10_000 - 4321),
        ];
        // SAFETY: `dst` is ours and untouched during the call.
        unsafe { cma_read(pid, &local, &remote) }.unwrap();
        assert!(dst == src);
        let mut back = vec![0u8; 10_000];
        let remote = [(back.as_mut_ptr() as u64, 10_000)];
        let local = [(src.as_ptr() as usize, 10_000)];
        // SAFETY: `src` is readable.
        unsafe { cma_write(pid, &local, &remote) }.unwrap();
        assert!(back == src);
        // SAFETY: as above.
        let e = unsafe { cma_read(pid, &[(dst.as_mut_ptr() as usize, 8)], &[(8, 8)]) }.unwrap_err();
        assert_eq!(
            e.raw_os_error(),
            Some(libc::EFAULT),
            "an unmapped remote range"
        );
    }
}
