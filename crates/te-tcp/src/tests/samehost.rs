//! The same-host channel driven directly against a target of this process: the target
//! copies host memory with cross-memory attach into and out of this process, checks
//! every request as a served frame is checked, and opens a channel only for the nonce
//! of a data connection it accepted, once.

use std::sync::{mpsc, Arc};
use std::time::Duration;

use te_core::{Access, Completion, ErrorKind, Op, Result, TransferBackend};

use super::{backend, register};
use crate::completion::Batch;
use crate::endpoint::decode_endpoint;
use crate::samehost::{Channel, Frame, Range};
use crate::TcpBackend;

/// A nonce the target recorded: the challenge of a data connection it accepted.
fn nonce(target: &TcpBackend) -> [u8; 32] {
    let ep = decode_endpoint(&target.endpoint()).unwrap();
    let mut s = std::net::TcpStream::connect(ep.addr).unwrap();
    let (_, nonce) = crate::handshake::handshake(&mut s, "test", ep.instance, None).unwrap();
    // The target records it before it sends the welcome.
    nonce
}

pub(super) fn channel(target: &TcpBackend) -> Arc<Channel> {
    let instance = decode_endpoint(&target.endpoint()).unwrap().instance;
    Channel::open(
        instance,
        nonce(target),
        Duration::from_secs(5),
        &Default::default(),
        false,
    )
    .expect("channel opens")
}

/// One request of `ranges` on `ch`, waited for.
pub(super) fn request(ch: &Channel, op: Op, ranges: Vec<Range>) -> Result<()> {
    let (tx, rx) = mpsc::channel();
    let done = Completion::new(Duration::from_secs(10), move |r, _| {
        let _ = tx.send(r);
    });
    let batch = Arc::new(Batch::new(1, done, Vec::new()));
    ch.submit(vec![Frame { op, ranges, batch }]);
    rx.recv_timeout(Duration::from_secs(10)).expect("answered")
}

fn host(region: u64, offset: u64, len: u64, addr: *const u8) -> Range {
    Range {
        region,
        offset,
        len,
        key: 0,
        addr: addr as u64,
    }
}

#[test]
fn host_memory_moves_both_ways_in_scattered_ranges_with_one_copy() {
    let target = backend(|_| {});
    let mut remote = vec![0u8; 64 << 10];
    register(&target, 1, &mut remote, Access::REMOTE_READ_WRITE);
    let ch = channel(&target);
    assert!(ch.cma, "a process may reach its own memory");
    let data: Vec<u8> = (0..64u32 << 10).map(|i| (i * 7 % 251) as u8).collect();
    // Block i of `data` to block (i * 5 mod 16) of the region, 4 KiB each.
    let write: Vec<Range> = (0..16u64)
        .map(|i| {
            host(
                1,
                (i * 5 % 16) << 12,
                4096,
                data[(i as usize) << 12..].as_ptr(),
            )
        })
        .collect();
    request(&ch, Op::Write, write).unwrap();
    for i in 0..16usize {
        let at = (i * 5 % 16) << 12;
        assert!(
            remote[at..at + 4096] == data[i << 12..(i + 1) << 12],
            "block {i}"
        );
    }
    let mut back = vec![0u8; 64 << 10];
    let read = vec![host(1, 0, 64 << 10, back.as_mut_ptr())];
    request(&ch, Op::Read, read).unwrap();
    assert!(back == remote);
}

#[test]
fn the_target_refuses_unregistered_out_of_bounds_and_unpermitted_ranges_and_goes_on() {
    let target = backend(|_| {});
    let mut writable = vec![0u8; 8192];
    let mut readable = vec![7u8; 8192];
    register(&target, 1, &mut writable, Access::REMOTE_READ_WRITE);
    register(&target, 2, &mut readable, Access::REMOTE_READ);
    let ch = channel(&target);
    let src = vec![0xabu8; 8192];
    let e = request(&ch, Op::Write, vec![host(9, 0, 16, src.as_ptr())]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotRegistered, "{e}");
    // One range inside and one past the end: nothing of the request lands.
    let e = request(
        &ch,
        Op::Write,
        vec![
            host(1, 0, 16, src.as_ptr()),
            host(1, 8190, 16, src.as_ptr()),
        ],
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
    assert!(writable.iter().all(|&b| b == 0), "nothing landed");
    let e = request(&ch, Op::Write, vec![host(2, 0, 16, src.as_ptr())]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidRequest, "{e}");
    assert!(e.to_string().contains("not remotely writable"), "{e}");
    assert!(readable.iter().all(|&b| b == 7));
    // The channel still serves good requests.
    request(&ch, Op::Write, vec![host(1, 100, 16, src.as_ptr())]).unwrap();
    assert_eq!(&writable[100..116], &src[..16]);
    assert!(ch.is_alive());
}

#[test]
fn a_channel_opens_only_with_a_nonce_the_target_gave_and_only_once() {
    let target = backend(|_| {});
    let instance = decode_endpoint(&target.endpoint()).unwrap().instance;
    let forged: [u8; 32] = rand::random();
    let e = Channel::open(
        instance,
        forged,
        Duration::from_secs(5),
        &Default::default(),
        false,
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerUnreachable, "{e}");
    let n = nonce(&target);
    Channel::open(
        instance,
        n,
        Duration::from_secs(5),
        &Default::default(),
        false,
    )
    .expect("a fresh nonce opens one");
    let e = Channel::open(
        instance,
        n,
        Duration::from_secs(5),
        &Default::default(),
        false,
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("refused"),
        "a nonce is good once: {e}"
    );
    // An instance nobody on this host serves: refused at once, not waited for.
    let e = Channel::open(
        instance ^ 1,
        n,
        Duration::from_secs(5),
        &Default::default(),
        false,
    )
    .unwrap_err();
    assert!(e.to_string().contains("no same-host listener"), "{e}");
}

#[test]
fn without_local_ipc_or_with_a_debug_delay_no_boot_id_is_advertised() {
    for b in [
        backend(|c| c.local_ipc = false),
        backend(|c| c.debug_delay = Duration::from_millis(1)),
    ] {
        assert_eq!(decode_endpoint(&b.endpoint()).unwrap().boot_id, None);
    }
    let b = backend(|_| {});
    assert_eq!(
        decode_endpoint(&b.endpoint()).unwrap().boot_id,
        te_core::local::boot_id()
    );
}

#[test]
fn a_peer_in_this_process_never_gets_a_channel() {
    let (target, init) = (backend(|_| {}), backend(|c| c.local_copies = false));
    let (mut remote, mut local) = (vec![0u8; 4096], vec![1u8; 4096]);
    let peer = super::connected(&target, &mut remote, &init, &mut local);
    assert_eq!(init.peer_path(peer).unwrap(), crate::PeerPath::Socket);
    let init2 = backend(|_| {});
    let mut local2 = vec![1u8; 4096];
    register(&init2, 1, &mut local2, Access::LOCAL);
    let peer2 = init2
        .connect(&super::segment(&target), super::soon())
        .unwrap();
    assert_eq!(init2.peer_path(peer2).unwrap(), crate::PeerPath::InProcess);
}

/// A raw connection to `target`'s channel listener.
fn raw(target: &TcpBackend) -> std::os::unix::net::UnixStream {
    let instance = decode_endpoint(&target.endpoint()).unwrap().instance;
    te_core::local::connect(
        &crate::samehost::socket_name(instance),
        Duration::from_secs(5),
    )
    .unwrap()
}

/// A proven channel's raw stream: the hello with a nonce the target gave (and where to
/// find it, so host memory may move by cross-memory attach) and a fence page, welcome
/// read.
fn proven_raw(target: &TcpBackend) -> std::os::unix::net::UnixStream {
    let page = te_core::local::SharedPage::new().unwrap();
    let (s, w) = hello_with(target, Some(page.fd()));
    assert_eq!(&w[4..6], &[0, 0], "welcomed");
    s
}

/// A raw channel to `target` after a good hello with descriptor `fd` attached (the
/// fence page, or anything else), and the target's welcome.
fn hello_with(
    target: &TcpBackend,
    fd: Option<std::os::fd::BorrowedFd<'_>>,
) -> (std::os::unix::net::UnixStream, [u8; 8]) {
    use std::io::Read;
    let instance = decode_endpoint(&target.endpoint()).unwrap().instance;
    let n = nonce(target);
    let mut s = raw(target);
    let mut hello = [0u8; 64];
    hello[..4].copy_from_slice(b"TELC");
    hello[4..6].copy_from_slice(&crate::samehost::VERSION.to_le_bytes());
    hello[8..16].copy_from_slice(&instance.to_le_bytes());
    hello[16..48].copy_from_slice(&n);
    // Where the target finds the nonce by cross-memory attach: `n` lives until the
    // welcome has come.
    hello[48..56].copy_from_slice(&(n.as_ptr() as u64).to_le_bytes());
    te_core::local::send_with_fd(&s, &hello, fd).unwrap();
    let mut w = [0u8; 8];
    s.read_exact(&mut w).unwrap();
    (s, w)
}

/// Whether the target closed `s` within 5 s (read returns end of file or a reset; a
/// read that merely times out is an open socket).
fn closed(s: &mut std::os::unix::net::UnixStream) -> bool {
    use std::io::{ErrorKind, Read};
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Err(e) => return !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
            Ok(_) => continue,
        }
    }
}

/// Whether the target hangs up `s` within `limit`, seen without reading from it.
fn hung_up(s: &std::os::unix::net::UnixStream, limit: Duration) -> bool {
    let gone = libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR;
    let end = std::time::Instant::now() + limit;
    loop {
        let left = end.saturating_duration_since(std::time::Instant::now());
        if crate::samehost::poll(s, libc::POLLRDHUP, left).is_ok_and(|r| r & gone != 0) {
            return true;
        }
        if left.is_zero() {
            return false;
        }
    }
}

#[test]
fn hostile_channels_are_closed_and_the_listener_keeps_serving_good_peers() {
    use std::io::Write;
    let target = backend(|_| {});
    let mut remote = vec![0u8; 4096];
    register(&target, 1, &mut remote, Access::REMOTE_READ_WRITE);

    // Sockets that connect and say nothing: the oldest are closed to make room.
    let idle: Vec<_> = (0..40).map(|_| raw(&target)).collect();
    let ch = channel(&target);
    let src = [5u8; 16];
    request(&ch, Op::Write, vec![host(1, 0, 16, src.as_ptr())]).unwrap();
    let mut first = idle.into_iter().next().unwrap();
    assert!(closed(&mut first), "the oldest idle socket was closed");

    // A hello that is not one: refused.
    let mut s = raw(&target);
    s.write_all(&[0x55; 64]).unwrap();
    assert!(closed(&mut s));

    // A good hello without a fence page, or with a file that could change size in its
    // place: refused (the target would fault on a page its peer shrank).
    let file = std::fs::File::open("/proc/self/stat").unwrap();
    for fd in [None, Some(std::os::fd::AsFd::as_fd(&file))] {
        let (mut s, w) = hello_with(&target, fd);
        assert_eq!(&w[4..6], &[1, 0], "refused");
        assert!(closed(&mut s));
    }

    // A proven channel that sends a message of no kind, a request of too many entries,
    // or a share whose runtime and device name is longer than any: closed before
    // anything more is read.
    for header in [
        {
            let mut h = [0u8; 40];
            h[0] = 99;
            h
        },
        {
            let mut h = [0u8; 40];
            h[0] = 2;
            h[4..8].copy_from_slice(&((crate::samehost::MAX_ENTRIES as u32) + 1).to_le_bytes());
            h
        },
        {
            let mut h = [0u8; 40];
            h[0] = 1;
            h[32..40].copy_from_slice(&(crate::samehost::MAX_NAME as u64 + 1).to_le_bytes());
            h
        },
    ] {
        let mut s = proven_raw(&target);
        s.write_all(&header).unwrap();
        assert!(closed(&mut s), "kind {}", header[0]);
    }

    // Good peers are still served, on the old channel and on a new one.
    request(&ch, Op::Write, vec![host(1, 16, 16, src.as_ptr())]).unwrap();
    let ch2 = channel(&target);
    request(&ch2, Op::Write, vec![host(1, 32, 16, src.as_ptr())]).unwrap();
    assert_eq!(&remote[..48], &[5u8; 48][..]);
}

/// Registers `len` bytes of fresh fakedev memory with `target` as region `id`, remotely
/// readable and writable; returns its address.
fn fakedev_region(target: &TcpBackend, id: u64, len: usize) -> u64 {
    let rt = te_core::device::runtime("fakedev").expect("fakedev");
    let addr = rt.alloc(0, len).unwrap();
    let mem = te_core::MemoryDesc {
        name: "d".into(),
        addr,
        len: len as u64,
        kind: "fakedev:0".parse().unwrap(),
        access: Access::REMOTE_READ_WRITE,
    };
    target.register(te_core::RegionId(id), &mem).unwrap();
    addr
}

/// One raw message: a 40-byte header (kind, code, id, a, b, c) and what follows it.
fn message(kind: u8, code: u32, fields: [u64; 4], tail: &[u8]) -> Vec<u8> {
    let mut m = vec![0u8; 40];
    m[0] = kind;
    m[4..8].copy_from_slice(&code.to_le_bytes());
    for (i, f) in fields.iter().enumerate() {
        m[8 + 8 * i..16 + 8 * i].copy_from_slice(&f.to_le_bytes());
    }
    m.extend_from_slice(tail);
    m
}

#[test]
fn a_share_naming_a_device_this_process_does_not_see_fails_its_requests_not_the_channel() {
    use std::io::{Read, Write};
    let target = backend(|_| {});
    fakedev_region(&target, 1, 4096);
    let mut host_region = vec![0u8; 64];
    register(&target, 2, &mut host_region, Access::REMOTE_READ_WRITE);

    // A share of allocation 7 on a device no process here has, without its memfd;
    // then a write naming it.
    let mut s = proven_raw(&target);
    let name = b"fakedev\0fakedev-999";
    let share = message(1, 0, [7, 0x1000, 4096, name.len() as u64], name);
    s.write_all(&share).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut h = [0u8; 40];
    s.read_exact(&mut h).expect("the share is answered");
    assert_eq!(h[0], 7, "a share's answer");
    assert_ne!(
        u32::from_le_bytes(h[4..8].try_into().unwrap()),
        0,
        "refused"
    );
    let len = u64::from_le_bytes(h[24..32].try_into().unwrap()) as usize;
    let mut text = vec![0u8; len];
    s.read_exact(&mut text).unwrap();
    assert!(String::from_utf8_lossy(&text).contains("fakedev-999"));
    // A request that names it anyway is refused too.
    let mut entry = Vec::new();
    for v in [1u64, 0, 4096, 7, 0x1000] {
        entry.extend_from_slice(&v.to_le_bytes());
    }
    s.write_all(&message(2, 1, [1, 0, 4096, 0], &entry))
        .unwrap();
    s.read_exact(&mut h).expect("the request is answered");
    assert_eq!(h[0], 5, "the request failed");
    let len = u64::from_le_bytes(h[24..32].try_into().unwrap()) as usize;
    let mut text = vec![0u8; len];
    s.read_exact(&mut text).unwrap();
    let text = String::from_utf8_lossy(&text);
    assert!(text.contains("fakedev-999"), "{text}");

    // The channel still serves a request for host memory, and the listener new peers.
    let src = [9u8; 16];
    let mut ours = Vec::new();
    for v in [2u64, 0, 16, 0, src.as_ptr() as u64] {
        ours.extend_from_slice(&v.to_le_bytes());
    }
    s.write_all(&message(2, 1, [2, 0, 16, 0], &ours)).unwrap();
    s.read_exact(&mut h).expect("the next request is answered");
    let len = u64::from_le_bytes(h[24..32].try_into().unwrap()) as usize;
    let mut text = vec![0u8; len];
    s.read_exact(&mut text).unwrap();
    assert_eq!(h[0], 4, "done: {}", String::from_utf8_lossy(&text));
    let ch = channel(&target);
    request(&ch, Op::Write, vec![host(2, 16, 16, src.as_ptr())]).unwrap();
    assert_eq!(&host_region[..32], &[9u8; 32][..]);
}

#[test]
fn a_peer_that_floods_shares_and_never_reads_their_answers_is_cut_off() {
    use std::io::Write;
    let target = backend(|c| c.io_timeout = Duration::from_millis(300));
    let mut remote = vec![0u8; 64];
    register(&target, 2, &mut remote, Access::REMOTE_READ_WRITE);
    let mut s = proven_raw(&target);
    // Shares the target refuses at once (a device no process has), each answered, none
    // of the answers read: the target's writes fill the socket and time out.
    let name = b"fakedev\0fakedev-999";
    s.set_write_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    for key in 0..100_000u64 {
        let share = message(1, 0, [key % 4000, 0x1000, 4096, name.len() as u64], name);
        if s.write_all(&share).is_err() {
            break;
        }
    }
    // Still not reading: reading now would free the target's blocked write before its
    // timeout ran out. Wait for the hang-up without taking a byte off the socket.
    assert!(
        hung_up(&s, Duration::from_secs(5)),
        "the channel was closed"
    );
    // Good peers are still served.
    let ch = channel(&target);
    let src = [4u8; 16];
    request(&ch, Op::Write, vec![host(2, 0, 16, src.as_ptr())]).unwrap();
    assert_eq!(&remote[..16], &[4u8; 16][..]);
}

#[test]
fn a_request_naming_a_new_region_at_every_entry_is_refused_and_nothing_copied() {
    use std::io::{Read, Write};
    let target = backend(|_| {});
    let mut remote = vec![0u8; 64];
    register(&target, 1, &mut remote, Access::REMOTE_READ_WRITE);
    let mut s = proven_raw(&target);
    // The most entries a request may carry, each in a region of its own (the last
    // one registered), so grouping them by region is the whole cost.
    let n = crate::samehost::MAX_ENTRIES as u64;
    let mut entries = Vec::with_capacity(n as usize * 40);
    let src = [3u8; 1];
    for i in 0..n {
        let region = if i == n - 1 { 1 } else { 1_000 + i };
        for v in [region, 0, 1, 0, src.as_ptr() as u64] {
            entries.extend_from_slice(&v.to_le_bytes());
        }
    }
    s.write_all(&message(2, n as u32, [1, 0, n, 0], &entries))
        .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut h = [0u8; 40];
    s.read_exact(&mut h).expect("the request is answered");
    assert_eq!(h[0], 5, "refused: its regions are not registered");
    assert_eq!(remote, [0u8; 64], "nothing was copied");
}

/// What [`Link::key`] gives for `addr` once the target has answered its share (it
/// shares on the first call, and gives the socket until the answer comes).
pub(super) fn answered_key(
    ch: &Channel,
    rt: &Arc<dyn te_core::device::DeviceRuntime>,
    region: te_core::RegionId,
    addr: u64,
) -> Option<u64> {
    if let Some(k) = ch.key(rt, region, addr) {
        return Some(k);
    }
    let end = std::time::Instant::now() + Duration::from_secs(5);
    while ch.answers_due() > 0 && std::time::Instant::now() < end {
        std::thread::sleep(Duration::from_millis(2));
    }
    ch.key(rt, region, addr)
}

#[test]
fn memory_the_runtime_will_not_export_takes_the_socket_alone() {
    use te_core::RegionId;
    let rt = te_core::device::runtime("fakedev").expect("fakedev");
    let dev = te_core::device::fakedev::process().expect("fakedev runs");
    let target = backend(|_| {});
    let private = dev.alloc_private(0, 4096).unwrap();
    let shared = rt.alloc(0, 4096).unwrap();
    let ch = channel(&target);
    assert_eq!(
        ch.key(&rt, RegionId(8), private),
        None,
        "an allocation the runtime will not export goes over the socket"
    );
    assert_eq!(
        ch.key(&rt, RegionId(8), private),
        None,
        "and is not asked again"
    );
    assert!(
        answered_key(&ch, &rt, RegionId(9), shared).is_some(),
        "another region of the same runtime is still shared"
    );
    for addr in [private, shared] {
        rt.free(0, addr).unwrap();
    }
}

/// Held by the tests that count fakedev's imports or make it refuse them: both are
/// process-wide.
pub(super) static IMPORTS: te_core::sync::Mutex<()> = te_core::sync::Mutex::new(());

#[test]
fn memory_the_target_cannot_map_takes_the_socket_and_is_not_offered_again() {
    use te_core::RegionId;
    let _alone = IMPORTS.lock();
    let rt = te_core::device::runtime("fakedev").expect("fakedev");
    let dev = te_core::device::fakedev::process().expect("fakedev runs");
    let target = backend(|_| {});
    fakedev_region(&target, 1, 4096);
    let (mine, other) = (rt.alloc(0, 4096).unwrap(), rt.alloc(0, 4096).unwrap());
    let ch = channel(&target);
    dev.refuse_imports(1);
    // Nothing waits for the target's answer: the socket until it comes, and for good
    // once it says it could not map the allocation.
    assert_eq!(
        ch.key(&rt, RegionId(8), mine),
        None,
        "shared, the answer due"
    );
    assert_eq!(answered_key(&ch, &rt, RegionId(8), mine), None, "refused");
    assert!(ch.is_alive(), "the channel goes on");
    let before = dev.imported();
    assert_eq!(
        ch.key(&rt, RegionId(8), mine),
        None,
        "then the socket: not offered again"
    );
    let k = answered_key(&ch, &rt, RegionId(9), other);
    assert!(k.is_some(), "another region is still shared");
    let write = Range {
        region: 1,
        offset: 0,
        len: 4096,
        key: k.unwrap(),
        addr: other,
    };
    request(&ch, Op::Write, vec![write]).unwrap();
    assert_eq!(dev.imported(), before + 1, "and mapped once");
    for addr in [mine, other] {
        rt.free(0, addr).unwrap();
    }
    target.deregister(RegionId(1), super::soon()).unwrap();
}

#[test]
fn a_peers_allocation_is_mapped_once_for_its_channels_and_unmapped_when_unshared() {
    let _alone = IMPORTS.lock();
    use te_core::device::DeviceCopy;
    use te_core::RegionId;
    let rt = te_core::device::runtime("fakedev").expect("fakedev");
    let dev = te_core::device::fakedev::process().expect("fakedev runs");
    let target = backend(|_| {});
    let theirs = fakedev_region(&target, 1, 8192);
    let mine = rt.alloc(0, 8192).unwrap();
    let data: Vec<u8> = (0..8192u32).map(|i| (i % 241) as u8).collect();
    let fill = DeviceCopy::ToDevice {
        ordinal: 0,
        device: mine,
        host: data.as_ptr(),
        len: 8192,
    };
    // SAFETY: `data` outlives the call, which waits for the copy.
    unsafe { rt.copy_group_wait(&[fill]) }.unwrap();

    let exports = Arc::default();
    let instance = decode_endpoint(&target.endpoint()).unwrap().instance;
    let open = || {
        Channel::open(
            instance,
            nonce(&target),
            Duration::from_secs(5),
            &exports,
            false,
        )
        .unwrap()
    };
    let (a, b) = (open(), open());
    let before = dev.imported();
    let k = answered_key(&a, &rt, RegionId(9), mine).expect("fakedev memory is shared");
    assert_eq!(
        answered_key(&b, &rt, RegionId(9), mine),
        Some(k),
        "one key for the peer"
    );
    let dev_range = |offset: u64| Range {
        region: 1,
        offset,
        len: 4096,
        key: k,
        addr: mine + offset,
    };
    request(&a, Op::Write, vec![dev_range(0)]).unwrap();
    request(&b, Op::Write, vec![dev_range(4096)]).unwrap();
    assert_eq!(dev.imported(), before + 1, "both channels use one mapping");
    let mut got = vec![0u8; 8192];
    let back = DeviceCopy::ToHost {
        ordinal: 0,
        device: theirs,
        host: got.as_mut_ptr(),
        len: 8192,
    };
    // SAFETY: `got` outlives the call, which waits for the copy.
    unsafe { rt.copy_group_wait(&[back]) }.unwrap();
    assert!(
        got == data,
        "the target copied the bytes through its mapping"
    );

    a.unshare(k);
    b.unshare(k);
    // Once both channels' unshares are answered, it is unmapped: a deregistration that
    // waits for them returns only then, and its memory may be freed.
    let soon = te_core::Deadline::after(Duration::from_secs(5));
    a.unshared(&[k], soon).unwrap();
    b.unshared(&[k], soon).unwrap();
    assert_eq!(dev.imported(), before, "answered, it is unmapped");
    target.deregister(RegionId(1), super::soon()).unwrap();
}

/// A range of a device allocation the initiator shared under key 1 (the fake target
/// below copies nothing).
fn dev(region: u64, len: u64, addr: *const u8) -> Range {
    Range {
        key: 1,
        ..host(region, 0, len, addr)
    }
}

/// A channel with `caller_reads` to a fake target: the test plays the target on the
/// other end of `peer`.
fn fake_channel() -> (Arc<Channel>, std::os::unix::net::UnixStream) {
    let (ch, peer, _) = fenced_channel(true);
    (ch, peer)
}

/// A channel to a fake target, with the fake target's mapping of the channel's fence
/// page: word 0 is the initiator's `CLOSED`, word 1 the target's `BUSY`.
fn fenced_channel(
    caller_reads: bool,
) -> (
    Arc<Channel>,
    std::os::unix::net::UnixStream,
    te_core::local::SharedPage,
) {
    let (ours, peer) = std::os::unix::net::UnixStream::pair().unwrap();
    let fence = te_core::local::SharedPage::new().unwrap();
    let theirs =
        te_core::local::SharedPage::open(fence.fd().try_clone_to_owned().unwrap()).unwrap();
    let ch = Channel::start(ours, fence, true, &Default::default(), caller_reads).unwrap();
    (ch, peer, theirs)
}

/// The fake target reads one request and returns its id.
fn read_request(peer: &mut std::os::unix::net::UnixStream) -> u64 {
    use std::io::Read;
    let mut h = [0u8; 40];
    peer.read_exact(&mut h).unwrap();
    let n = u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize;
    let mut entries = vec![0u8; n * 40];
    peer.read_exact(&mut entries).unwrap();
    u64::from_le_bytes(h[8..16].try_into().unwrap())
}

/// The fake target answers request `id`: done.
fn answer_done(peer: &mut std::os::unix::net::UnixStream, id: u64) {
    use std::io::Write;
    let mut m = [0u8; 40];
    m[0] = 4;
    m[8..16].copy_from_slice(&id.to_le_bytes());
    peer.write_all(&m).unwrap();
}

/// Submits a one-range request on `ch`; its result and the thread that completed it
/// come on the receiver.
fn submit_traced(
    ch: &Channel,
    range: Range,
) -> mpsc::Receiver<(Result<()>, std::thread::ThreadId)> {
    submit_batch(ch, range).1
}

/// As [`submit_traced`], with the batch.
fn submit_batch(
    ch: &Channel,
    range: Range,
) -> (
    Arc<Batch>,
    mpsc::Receiver<(Result<()>, std::thread::ThreadId)>,
) {
    let (tx, rx) = mpsc::channel();
    let done = Completion::new(Duration::from_secs(30), move |r, _| {
        let _ = tx.send((r, std::thread::current().id()));
    });
    let batch = Arc::new(Batch::new(1, done, Vec::new()));
    ch.submit(vec![Frame {
        op: Op::Write,
        ranges: vec![range],
        batch: batch.clone(),
    }]);
    (batch, rx)
}

/// Stops `ch` as the deadline watcher does once a batch's channel answered nothing
/// for a grace.
fn cut(ch: &Channel, batch: &Arc<Batch>) {
    let seen = ch.cut(batch, None).expect("the batch waits on the channel");
    assert_eq!(ch.cut(batch, Some(seen)), None, "stopped");
}

#[test]
fn a_channel_stopped_while_the_target_copies_hands_back_nothing_until_the_copy_ends() {
    use std::sync::atomic::Ordering::SeqCst;
    for caller_reads in [false, true] {
        let (ch, mut peer, fence) = fenced_channel(caller_reads);
        let src = [1u8; 16];
        let (a, copied) = submit_batch(&ch, dev(1, 16, src.as_ptr()));
        let (_, unread) = submit_batch(&ch, dev(1, 16, src.as_ptr()));
        let id = read_request(&mut peer);
        // The target copies the first request; the second is still in the socket.
        fence.word(1).store(1, SeqCst);
        cut(&ch, &a);
        assert_eq!(fence.word(0).load(SeqCst), 1, "the target is told");
        for rx in [&copied, &unread] {
            assert!(
                rx.recv_timeout(Duration::from_millis(300)).is_err(),
                "nothing is handed back while the target copies"
            );
        }
        // The copy ends and is answered: both are handed back, the unread one failed.
        fence.word(1).store(0, SeqCst);
        answer_done(&mut peer, id);
        let wait = Duration::from_secs(5);
        copied.recv_timeout(wait).unwrap().0.unwrap();
        let e = unread.recv_timeout(wait).unwrap().0.unwrap_err();
        assert_eq!(e.kind(), te_core::ErrorKind::Timeout, "{e}");
        assert!(!ch.is_alive());
    }
}

#[test]
fn a_channel_stopped_while_the_target_is_idle_hands_back_at_once() {
    let (ch, mut peer, _fence) = fenced_channel(false);
    let src = [1u8; 16];
    let (a, done) = submit_batch(&ch, dev(1, 16, src.as_ptr()));
    read_request(&mut peer);
    cut(&ch, &a);
    let e = done
        .recv_timeout(Duration::from_secs(1))
        .unwrap()
        .0
        .unwrap_err();
    assert_eq!(e.kind(), te_core::ErrorKind::Timeout, "{e}");
}

#[test]
fn a_channel_its_owner_drops_while_the_target_copies_keeps_the_batch_until_the_copy_ends() {
    use std::sync::atomic::Ordering::SeqCst;
    let (ch, mut peer, fence) = fenced_channel(false);
    let src = [1u8; 16];
    let done = submit_traced(&ch, dev(1, 16, src.as_ptr()));
    let id = read_request(&mut peer);
    fence.word(1).store(1, SeqCst);
    drop(ch);
    assert!(
        done.recv_timeout(Duration::from_millis(300)).is_err(),
        "the batch is kept while the target copies"
    );
    fence.word(1).store(0, SeqCst);
    answer_done(&mut peer, id);
    done.recv_timeout(Duration::from_secs(5))
        .unwrap()
        .0
        .unwrap();
}

/// The fake target reads one share and returns its key.
fn read_share(peer: &mut std::os::unix::net::UnixStream) -> u64 {
    use std::io::Read;
    let mut h = [0u8; 40];
    peer.read_exact(&mut h).unwrap();
    assert_eq!(h[0], 1, "a share");
    let handle = u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize;
    let name = (u64::from_le_bytes(h[32..40].try_into().unwrap()) & 0xffff_ffff) as usize;
    let mut tail = vec![0u8; handle + name];
    peer.read_exact(&mut tail).unwrap();
    u64::from_le_bytes(h[8..16].try_into().unwrap())
}

#[test]
fn a_late_answer_to_a_share_of_a_deregistered_region_does_not_kill_the_channel() {
    use std::io::{Read, Write};
    use te_core::RegionId;
    let rt = te_core::device::runtime("fakedev").expect("fakedev");
    let mine = rt.alloc(0, 4096).unwrap();
    let (ch, mut peer, _fence) = fenced_channel(false);
    peer.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    // The share goes out; the target has not answered it when the region is
    // deregistered, which unshares it.
    assert_eq!(
        ch.key(&rt, RegionId(8), mine),
        None,
        "the socket until it is answered"
    );
    let key = read_share(&mut peer);
    ch.unshare(key);
    let mut unshare = [0u8; 40];
    peer.read_exact(&mut unshare).unwrap();
    assert_eq!((unshare[0], &unshare[8..16]), (6, &key.to_le_bytes()[..]));
    // Now the target's answer to the share comes, then a request is served.
    let mut shared = [0u8; 40];
    shared[0] = 7;
    shared[8..16].copy_from_slice(&key.to_le_bytes());
    peer.write_all(&shared).unwrap();
    let src = [1u8; 16];
    let done = submit_traced(&ch, host(1, 0, 16, src.as_ptr()));
    let id = read_request(&mut peer);
    answer_done(&mut peer, id);
    let r = done.recv_timeout(Duration::from_secs(5)).unwrap().0;
    assert!(r.is_ok(), "the request failed: {}", r.unwrap_err());
    assert!(ch.is_alive(), "the late answer killed the channel");
    rt.free(0, mine).unwrap();
}

fn in_10s() -> te_core::Deadline {
    te_core::Deadline::after(Duration::from_secs(10))
}

#[test]
fn a_caller_driving_the_channel_reads_its_own_answer_and_the_receiving_thread_the_others() {
    let (ch, mut peer) = fake_channel();
    let src = [1u8; 16];
    let done = submit_traced(&ch, dev(1, 16, src.as_ptr()));
    let driver = {
        let ch = ch.clone();
        std::thread::spawn(move || {
            let waited = ch.drive(te_core::BatchId(0), in_10s());
            (waited, std::thread::current().id())
        })
    };
    let id = read_request(&mut peer);
    // Answer only once the caller drives: the answer is then its to read.
    super::eventually("the caller drives", Duration::from_secs(5), || {
        ch.drivers() == 1
    });
    answer_done(&mut peer, id);
    let (waited, driver) = driver.join().unwrap();
    assert!(waited);
    let (r, by) = done.recv_timeout(Duration::from_secs(5)).unwrap();
    r.unwrap();
    assert_eq!(by, driver, "the waiting caller completed its own batch");
    // Nobody drives the next one: the receiving thread reads its answer.
    let done = submit_traced(&ch, dev(1, 16, src.as_ptr()));
    let id = read_request(&mut peer);
    answer_done(&mut peer, id);
    let (r, by) = done.recv_timeout(Duration::from_secs(5)).unwrap();
    r.unwrap();
    assert_ne!(by, driver);
    assert_ne!(by, std::thread::current().id());
    // Without `caller_reads` no caller is lent the channel: its thread reads all.
    let (plain, mut peer2, _) = fenced_channel(false);
    let done = submit_traced(&plain, dev(1, 16, src.as_ptr()));
    assert!(!plain.drive(te_core::BatchId(0), in_10s()));
    let id = read_request(&mut peer2);
    answer_done(&mut peer2, id);
    let (r, by) = done.recv_timeout(Duration::from_secs(5)).unwrap();
    r.unwrap();
    assert_ne!(by, std::thread::current().id());
    // Nothing of a batch that has nothing here to wait for, nor past the deadline.
    assert!(!ch.drive(te_core::BatchId(0), in_10s()));
    let _ = submit_traced(&ch, dev(1, 16, src.as_ptr()));
    assert!(!ch.drive(te_core::BatchId(7), in_10s()));
    assert!(!ch.drive(
        te_core::BatchId(0),
        te_core::Deadline::after(Duration::ZERO)
    ));
}

#[test]
fn an_answer_a_driver_leaves_unread_is_read_by_the_receiving_thread() {
    let (ch, mut peer) = fake_channel();
    let src = [1u8; 16];
    let done = submit_traced(&ch, dev(1, 16, src.as_ptr()));
    let id = read_request(&mut peer);
    // A driver is there when the answer comes (the receiving thread, woken by its
    // arrival, leaves it to the driver), then goes without reading it.
    ch.enter_idle();
    answer_done(&mut peer, id);
    std::thread::sleep(Duration::from_millis(50));
    assert!(done.try_recv().is_err(), "nobody read it yet");
    ch.leave_idle();
    let (r, _) = done
        .recv_timeout(Duration::from_secs(5))
        .expect("read after the driver left");
    r.unwrap();
}

#[test]
fn a_driver_past_its_deadline_returns_and_closing_the_channel_frees_a_driver() {
    let (ch, mut peer) = fake_channel();
    let src = [1u8; 16];
    let done = submit_traced(&ch, dev(1, 16, src.as_ptr()));
    read_request(&mut peer);
    let t = std::time::Instant::now();
    assert!(ch.drive(
        te_core::BatchId(0),
        te_core::Deadline::after(Duration::from_millis(30))
    ));
    assert!(t.elapsed() >= Duration::from_millis(30));
    assert!(done.try_recv().is_err());
    let driver = {
        let ch = ch.clone();
        std::thread::spawn(move || ch.drive(te_core::BatchId(0), in_10s()))
    };
    super::eventually("the caller drives", Duration::from_secs(5), || {
        ch.drivers() == 1
    });
    let t = std::time::Instant::now();
    drop(peer);
    assert!(driver.join().unwrap());
    assert!(t.elapsed() < Duration::from_secs(5));
    let (r, _) = done.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(r.unwrap_err().kind(), ErrorKind::PeerUnreachable);
    assert!(!ch.is_alive());
}

#[test]
fn callers_driving_one_channel_together_each_get_their_answers() {
    let (ch, mut peer) = fake_channel();
    const THREADS: usize = 4;
    const ROUNDS: usize = 300;
    // The fake target answers every request as it reads it.
    let target = std::thread::spawn(move || {
        for _ in 0..THREADS * ROUNDS {
            let id = read_request(&mut peer);
            answer_done(&mut peer, id);
        }
        peer
    });
    let src = [1u8; 16];
    let addr = src.as_ptr() as usize;
    let threads: Vec<_> = (0..THREADS)
        .map(|_| {
            let ch = ch.clone();
            std::thread::spawn(move || {
                let mut own = 0;
                for _ in 0..ROUNDS {
                    let done = submit_traced(&ch, dev(1, 16, addr as *const u8));
                    ch.drive(te_core::BatchId(0), in_10s());
                    let (r, by) = done
                        .recv_timeout(Duration::from_secs(10))
                        .expect("answered");
                    r.unwrap();
                    own += usize::from(by == std::thread::current().id());
                }
                own
            })
        })
        .collect();
    let own: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    let _peer = target.join().unwrap();
    assert!(ch.is_alive());
    assert_eq!(ch.drivers(), 0);
    // Most answers were read by their own callers (some by another driver or the
    // receiving thread, whichever held the socket when they came).
    assert!(own > 0, "no caller read its own answer");
}

#[test]
fn a_target_that_breaks_the_protocol_inside_a_copy_holds_the_batch_until_its_end() {
    use std::io::Write;
    use std::sync::atomic::Ordering::SeqCst;
    let (ch, mut peer, fence) = fenced_channel(false);
    let src = [1u8; 16];
    let done = submit_traced(&ch, dev(1, 16, src.as_ptr()));
    read_request(&mut peer);
    // The target copies (BUSY), and sends a message that breaks the protocol: an
    // answer to a share never sent.
    fence.word(1).store(1, SeqCst);
    let mut m = [0u8; 40];
    m[0] = 7;
    m[8..16].copy_from_slice(&0xdead_u64.to_le_bytes());
    peer.write_all(&m).unwrap();
    assert!(
        done.recv_timeout(Duration::from_millis(300)).is_err(),
        "handed back while the target still copied"
    );
    // The copy ends and the target closes its end: now it is handed back, failed.
    fence.word(1).store(0, SeqCst);
    drop(peer);
    let (r, _) = done.recv_timeout(Duration::from_secs(5)).unwrap();
    assert!(r.is_err());
    assert!(!ch.is_alive());
}

/// Bytes written to `s` that its peer has not read yet.
fn unread(s: &std::os::unix::net::UnixStream) -> i32 {
    use std::os::fd::AsRawFd;
    let mut n: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one int, to `n`, which lives for the call.
    let r = unsafe { libc::ioctl(s.as_raw_fd(), libc::TIOCOUTQ, &mut n) };
    if r < 0 {
        -1
    } else {
        n
    }
}

/// The target's `samehost_request_bytes` gauge.
fn request_bytes(target: &TcpBackend) -> u64 {
    let g = TransferBackend::gauges(target);
    g.iter()
        .find(|(n, _)| n == "samehost_request_bytes")
        .map(|(_, v)| *v)
        .expect("the gauge")
}

#[test]
fn a_peer_that_announces_the_largest_request_and_sends_little_makes_the_target_hold_little() {
    use std::io::Write;
    let target = backend(|_| {});
    let mut remote = vec![0u8; 64];
    register(&target, 1, &mut remote, Access::REMOTE_READ_WRITE);
    let n = crate::samehost::MAX_ENTRIES as u64;
    // Channels that announce the most entries a request may carry (2.6 MB of them) and
    // send one entry's bytes, then nothing.
    let peers = 8;
    let hostile: Vec<_> = (0..peers)
        .map(|_| {
            let mut s = proven_raw(&target);
            s.write_all(&message(2, n as u32, [1, 0, n, 0], &[7u8; 40]))
                .unwrap();
            s
        })
        .collect();
    // Once the target has read all that was sent, each channel's buffer is there.
    let end = std::time::Instant::now() + Duration::from_secs(10);
    while hostile.iter().any(|s| unread(s) != 0) && std::time::Instant::now() < end {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        hostile.iter().all(|s| unread(s) == 0),
        "the target read every header and entry"
    );
    let held = request_bytes(&target);
    assert!(
        held >= peers * 40,
        "each channel holds the entry it read ({held} bytes)"
    );
    assert!(
        held <= peers * (128 << 10),
        "the target holds what arrived, not what was announced: {held} bytes for {peers} channels"
    );

    // A good peer is still served, and the hostile channels give back what they held
    // when they close.
    let ch = channel(&target);
    let src = [9u8; 16];
    request(&ch, Op::Write, vec![host(1, 0, 16, src.as_ptr())]).unwrap();
    assert_eq!(&remote[..16], &src);
    for s in hostile {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
    let end = std::time::Instant::now() + Duration::from_secs(10);
    while request_bytes(&target) > 4096 && std::time::Instant::now() < end {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        request_bytes(&target) <= 4096,
        "closed channels hold nothing ({} bytes left: the good channel's)",
        request_bytes(&target)
    );
}

/// Runs `f` on a thread of its own; its result, if it came within `wait`.
fn within<T: Send + 'static>(wait: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(wait).ok()
}

#[test]
fn a_driver_whose_target_breaks_the_protocol_inside_a_copy_returns_and_the_batch_waits_for_the_end()
{
    use std::io::Write;
    use std::sync::atomic::Ordering::SeqCst;
    let Broken {
        ch,
        mut peer,
        fence,
        done,
        driver,
    } = broken_while_copying();
    // The driver goes back to its caller; reading on to the target's end is the
    // receiving thread's work.
    let joined = within(Duration::from_secs(3), move || driver.join().unwrap());
    assert_eq!(joined, Some(true), "the driver waited for the target's end");
    assert!(
        done.recv_timeout(Duration::from_millis(300)).is_err(),
        "handed back while the target still copied"
    );
    // What the target sends before its end is skipped, not read as answers.
    peer.write_all(&[4u8; 40]).unwrap();
    fence.word(1).store(0, SeqCst);
    drop(peer);
    let (r, _) = done.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(r.unwrap_err().kind(), ErrorKind::Protocol);
    assert!(!ch.is_alive());
}

#[test]
fn a_driver_is_not_held_past_its_deadline_by_half_an_answer_and_the_rest_is_read_later() {
    use std::io::Write;
    let (ch, mut peer) = fake_channel();
    let src = [1u8; 16];
    let done = submit_traced(&ch, dev(1, 16, src.as_ptr()));
    let id = read_request(&mut peer);
    let driver = {
        let ch = ch.clone();
        std::thread::spawn(move || {
            let t = std::time::Instant::now();
            let deadline = te_core::Deadline::after(Duration::from_millis(200));
            (ch.drive(te_core::BatchId(0), deadline), t.elapsed())
        })
    };
    super::eventually("the caller drives", Duration::from_secs(5), || {
        ch.drivers() == 1
    });
    // Half of the answer comes, and the target stalls.
    let mut m = [0u8; 40];
    m[0] = 4;
    m[8..16].copy_from_slice(&id.to_le_bytes());
    peer.write_all(&m[..20]).unwrap();
    let joined = within(Duration::from_secs(3), move || driver.join().unwrap());
    let (waited, took) = joined.expect("the driver was held by half an answer");
    assert!(waited);
    assert!(took < Duration::from_secs(2), "{took:?}");
    assert!(done.try_recv().is_err(), "nothing was answered yet");
    assert!(ch.is_alive(), "a slow answer is not a broken channel");
    // The rest comes: the answer is read whole, by whoever reads next.
    peer.write_all(&m[20..]).unwrap();
    let (r, _) = done.recv_timeout(Duration::from_secs(5)).unwrap();
    r.unwrap();
    assert!(ch.is_alive());
}

#[test]
fn a_target_that_never_answers_an_unshare_fails_the_wait_at_its_deadline_and_loses_the_channel() {
    let rt = te_core::device::runtime("fakedev").expect("fakedev");
    let mine = rt.alloc(0, 4096).unwrap();
    // The target maps it, then reads the unshare and says nothing.
    let (ch, _peer, _fence, key) = shared_channel(&rt, mine);
    ch.unshare(key);
    let t = std::time::Instant::now();
    let e = ch
        .unshared(&[key], te_core::Deadline::after(Duration::from_millis(200)))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(e.message().contains("unmapped"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert!(
        !ch.is_alive(),
        "the channel is closed, so the target lets go"
    );
    rt.free(0, mine).unwrap();
}

#[test]
fn an_answer_to_no_unshare_breaks_the_channel() {
    use std::io::Write;
    let (ch, mut peer, _fence) = fenced_channel(false);
    let mut m = [0u8; 40];
    m[0] = 8;
    m[8..16].copy_from_slice(&77u64.to_le_bytes());
    peer.write_all(&m).unwrap();
    super::eventually("the channel breaks", Duration::from_secs(5), || {
        !ch.is_alive()
    });
    // A wait for an unshare on a dead channel does not wait.
    assert!(ch.unshared(&[77], in_10s()).is_ok());
}

/// The fake target answers the share of `key`: mapped.
fn answer_shared(peer: &mut std::os::unix::net::UnixStream, key: u64) {
    use std::io::Write;
    let mut m = [0u8; 40];
    m[0] = 7;
    m[8..16].copy_from_slice(&key.to_le_bytes());
    peer.write_all(&m).unwrap();
}

#[test]
fn a_caller_waiting_on_a_channel_its_target_broke_inside_a_copy_does_not_spin() {
    use std::sync::atomic::Ordering::SeqCst;
    let Broken {
        ch,
        peer,
        fence,
        done,
        driver,
    } = broken_while_copying();
    driver.join().unwrap();
    // A caller waiting for the batch lends its thread as the engine does, again for as
    // long as the backend says it waited there: nothing is left for it to read, so it
    // must be sent to the condition variable, not called back at once for 300 ms.
    let until = std::time::Instant::now() + Duration::from_millis(300);
    let mut calls = 0u32;
    while std::time::Instant::now() < until
        && ch.drive(te_core::BatchId(0), te_core::Deadline::at(until))
    {
        calls += 1;
    }
    assert!(
        calls <= 1,
        "the waiting caller was called back {calls} times"
    );
    assert!(
        done.try_recv().is_err(),
        "handed back while the target copied"
    );
    fence.word(1).store(0, SeqCst);
    drop(peer);
    let (r, _) = done.recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(r.unwrap_err().kind(), ErrorKind::Protocol);
}

#[test]
fn an_unshare_on_a_channel_stopped_while_its_target_copies_waits_for_the_targets_end() {
    use std::sync::atomic::Ordering::SeqCst;
    let rt = te_core::device::runtime("fakedev").expect("fakedev");
    let mine = rt.alloc(0, 4096).unwrap();
    let (ch, mut peer, fence, key) = shared_channel(&rt, mine);
    // A request of another region is copied by the target when its channel is cut: the
    // target holds every mapping of the channel until it has ended.
    let src = [1u8; 16];
    let (a, done) = submit_batch(&ch, dev(1, 16, src.as_ptr()));
    read_request(&mut peer);
    fence.word(1).store(1, SeqCst);
    cut(&ch, &a);
    // An allocation never shared on the channel is not waited for.
    ch.unshare(key + 1);
    let t = std::time::Instant::now();
    ch.unshared(&[key + 1], in_10s()).unwrap();
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    ch.unshare(key);
    let e = ch
        .unshared(&[key], te_core::Deadline::after(Duration::from_millis(300)))
        .expect_err("the target still copies, holding the mapping");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    // Once the target has ended, it let go.
    let waiter = {
        let ch = ch.clone();
        std::thread::spawn(move || ch.unshared(&[key], in_10s()))
    };
    fence.word(1).store(0, SeqCst);
    drop(peer);
    let r = within(Duration::from_secs(5), move || waiter.join().unwrap());
    assert!(matches!(r, Some(Ok(()))), "{r:?}");
    assert!(done.recv_timeout(Duration::from_secs(5)).is_ok());
    rt.free(0, mine).unwrap();
}

/// A `caller_reads` channel whose fake target copies (`BUSY` set) the request of one
/// batch, then sends a message that breaks the protocol, which a caller driving the
/// channel reads.
struct Broken {
    ch: Arc<Channel>,
    peer: std::os::unix::net::UnixStream,
    fence: te_core::local::SharedPage,
    /// The batch's result.
    done: mpsc::Receiver<(Result<()>, std::thread::ThreadId)>,
    /// The driver: what its `drive` returned.
    driver: std::thread::JoinHandle<bool>,
}

fn broken_while_copying() -> Broken {
    use std::io::Write;
    use std::sync::atomic::Ordering::SeqCst;
    // The fake target copies nothing: the address is never read.
    static SRC: [u8; 16] = [1; 16];
    let (ch, mut peer, fence) = fenced_channel(true);
    let done = submit_traced(&ch, dev(1, 16, SRC.as_ptr()));
    read_request(&mut peer);
    fence.word(1).store(1, SeqCst);
    let driver = {
        let ch = ch.clone();
        std::thread::spawn(move || ch.drive(te_core::BatchId(0), in_10s()))
    };
    super::eventually("the caller drives", Duration::from_secs(5), || {
        ch.drivers() == 1
    });
    let mut m = [0u8; 40];
    m[0] = 7;
    m[8..16].copy_from_slice(&0xdead_u64.to_le_bytes());
    peer.write_all(&m).unwrap();
    Broken {
        ch,
        peer,
        fence,
        done,
        driver,
    }
}

/// A channel to a fake target that mapped `mine` (fakedev memory of local region 8),
/// shared under the key returned.
fn shared_channel(
    rt: &Arc<dyn te_core::device::DeviceRuntime>,
    mine: u64,
) -> (
    Arc<Channel>,
    std::os::unix::net::UnixStream,
    te_core::local::SharedPage,
    u64,
) {
    use te_core::RegionId;
    let (ch, mut peer, fence) = fenced_channel(false);
    peer.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(ch.key(rt, RegionId(8), mine), None);
    let key = read_share(&mut peer);
    answer_shared(&mut peer, key);
    super::eventually("the share is answered", Duration::from_secs(5), || {
        ch.key(rt, RegionId(8), mine) == Some(key)
    });
    (ch, peer, fence, key)
}
