//! Backend-level tests: the handshake's refusals, the target's own checks seen through
//! raw frames, and failures mid-transfer.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use te_core::{
    Access, Completion, ErrorKind, MemoryDesc, MemoryKind, RegionId, Result, SegmentDesc,
    TransferBackend, TransferRequest,
};

use crate::backend::decode_endpoint;
use crate::wire::{Header, Kind, HEADER_LEN};
use crate::{TcpBackend, TcpConfig};

fn soon() -> te_core::Deadline {
    te_core::Deadline::after(std::time::Duration::from_secs(10))
}

fn backend(f: impl FnOnce(&mut TcpConfig)) -> TcpBackend {
    let mut c = TcpConfig::default();
    f(&mut c);
    TcpBackend::new(c, &te_core::BackendContext::default()).expect("backend")
}

fn segment(b: &TcpBackend) -> SegmentDesc {
    SegmentDesc {
        engine: "target".into(),
        epoch: 1,
        address: String::new(),
        backend: crate::NAME.into(),
        endpoint: b.endpoint(),
        regions: Vec::new(),
        layouts: Vec::new(),
    }
}

/// Registers `v` as region `id`.
fn register(b: &TcpBackend, id: u64, v: &mut [u8], access: Access) {
    let mem = MemoryDesc {
        name: "m".into(),
        addr: v.as_mut_ptr() as u64,
        len: v.len() as u64,
        kind: MemoryKind::Host,
        access,
    };
    b.register(RegionId(id), &mem).expect("register");
}

/// Submits `reqs` and waits for the batch's result.
fn run(b: &TcpBackend, peer: te_core::PeerId, reqs: &[TransferRequest]) -> Result<()> {
    let (tx, rx) = mpsc::channel();
    let done = Completion::new(Duration::from_secs(10), move |r, _| {
        let _ = tx.send(r);
    });
    b.submit(peer, reqs, done)?;
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the batch completed")
}

/// A raw data connection that passed the handshake.
fn raw(target: &TcpBackend) -> TcpStream {
    let (addr, instance) = decode_endpoint(&target.endpoint()).unwrap();
    let mut s = TcpStream::connect(addr).unwrap();
    crate::handshake::handshake(&mut s, "raw", instance, None).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

fn read_header(s: &mut TcpStream) -> Header {
    let mut b = [0u8; HEADER_LEN];
    s.read_exact(&mut b).unwrap();
    Header::decode(&b).unwrap()
}

#[test]
fn a_peer_without_the_right_auth_token_is_refused_before_any_data_moves() {
    let target = backend(|c| c.auth_token = Some("s3cret".into()));
    let seg = segment(&target);
    for token in [None, Some("wrong"), Some("s3cret ")] {
        let init = backend(|c| c.auth_token = token.map(String::from));
        let e = init.connect(&seg, soon()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unauthorized, "{token:?}: {e}");
        assert!(e.to_string().contains("auth_token"), "{e}");
    }
    // A target without a token cannot prove one to an initiator that has one.
    let open = backend(|_| {});
    let init = backend(|c| c.auth_token = Some("s3cret".into()));
    let e = init.connect(&segment(&open), soon()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unauthorized, "{e}");
    // The same token on both sides works.
    init.connect(&seg, soon()).expect("same token");
}

#[test]
fn the_token_never_travels_in_clear() {
    // Record what the initiator sends by standing in for the target.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let recorder = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut hello = [0u8; crate::wire::Hello::LEN];
        s.read_exact(&mut hello).unwrap();
        let ch = crate::wire::Challenge {
            version: crate::wire::VERSION,
            status: crate::wire::Status::Ok,
            auth: true,
            nonce: [9; 32],
        };
        s.write_all(&ch.encode()).unwrap();
        let terms = crate::wire::Terms { max_payload: 65536 };
        s.write_all(&terms.encode()).unwrap();
        let mut all = hello.to_vec();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        all.extend(rest);
        all
    });
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let token = b"correct horse battery staple";
    let _ = crate::handshake::handshake(&mut s, "recorder", 7, Some(token));
    drop(s);
    let sent = recorder.join().unwrap();
    assert!(sent.len() >= crate::wire::Hello::LEN + crate::wire::Proof::LEN);
    assert!(
        !sent.windows(6).any(|w| token.windows(6).any(|t| t == w)),
        "part of the token appears on the wire"
    );
}

#[test]
fn a_restarted_target_refuses_connections_meant_for_its_previous_life() {
    let first = backend(|_| {});
    let old = segment(&first);
    let port = first.data_addr().port();
    drop(first);
    let second = backend(|c| c.listen = Some(format!("127.0.0.1:{port}")));
    assert_eq!(second.data_addr().port(), port, "rebound the same port");
    let init = backend(|_| {});
    let e = init.connect(&old, soon()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::PeerRestarted, "{e}");
    init.connect(&segment(&second), soon())
        .expect("the new life");
}

#[test]
fn a_raw_write_past_the_region_end_is_refused_at_the_target_and_memory_is_unchanged() {
    let target = backend(|_| {});
    let mut mem = vec![0u8; 4096];
    register(&target, 1, &mut mem, Access::REMOTE_READ_WRITE);
    let mut ro = vec![0u8; 64];
    register(&target, 2, &mut ro, Access::REMOTE_READ);
    let mut s = raw(&target);
    let cases = [
        (1, 4090, 16, ErrorKind::OutOfBounds),
        (1, u64::MAX - 8, 8, ErrorKind::OutOfBounds),
        (2, 0, 16, ErrorKind::InvalidRequest),
        (77, 0, 16, ErrorKind::NotRegistered),
    ];
    for (i, (region, offset, len, kind)) in cases.into_iter().enumerate() {
        let id = i as u64 + 1;
        let h = Header::request(Kind::Write, id, region, offset, len);
        s.write_all(&h.encode()).unwrap();
        s.write_all(&vec![0xee; len as usize]).unwrap();
        let r = read_header(&mut s);
        assert_eq!((r.kind, r.id), (Kind::Error, id), "case {i}");
        assert_eq!(ErrorKind::from_code(r.code), kind, "case {i}");
        let mut msg = vec![0u8; r.len as usize];
        s.read_exact(&mut msg).unwrap();
    }
    assert!(
        mem.iter().all(|&b| b == 0),
        "a refused write changed memory"
    );
    assert!(ro.iter().all(|&b| b == 0), "a refused write changed memory");
    // The connection is still in sync: a good write lands and is acknowledged.
    s.write_all(&Header::request(Kind::Write, 9, 1, 4080, 16).encode())
        .unwrap();
    s.write_all(&[7; 16]).unwrap();
    let r = read_header(&mut s);
    assert_eq!((r.kind, r.id), (Kind::WriteAck, 9));
    assert_eq!(&mem[4080..4096], &[7; 16]);
    assert!(mem[..4080].iter().all(|&b| b == 0));
    target.deregister(RegionId(1), soon()).unwrap();
    target.deregister(RegionId(2), soon()).unwrap();
}

#[test]
fn a_malformed_frame_closes_only_its_own_connection() {
    let target = backend(|_| {});
    let mut mem = vec![0u8; 4096];
    register(&target, 1, &mut mem, Access::REMOTE_READ_WRITE);
    let mut bad = raw(&target);
    let mut good = raw(&target);
    let mut frame = Header::request(Kind::Write, 1, 1, 0, 16).encode();
    frame[0] = 0x7f;
    bad.write_all(&frame).unwrap();
    let mut b = [0u8; 1];
    assert_eq!(
        bad.read(&mut b).unwrap_or(0),
        0,
        "the bad connection is closed"
    );
    good.write_all(&Header::request(Kind::Read, 5, 1, 0, 16).encode())
        .unwrap();
    let r = read_header(&mut good);
    assert_eq!((r.kind, r.id, r.len), (Kind::ReadData, 5, 16));
    target.deregister(RegionId(1), soon()).unwrap();
}

#[test]
fn large_requests_are_sliced_and_land_intact_in_both_directions() {
    let target = backend(|_| {});
    let init = backend(|c| {
        c.slice_size = 4096;
        c.connections_per_peer = 3;
    });
    let len = (1 << 20) + 123;
    let mut remote = vec![0u8; len];
    let mut local: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    let want = local.clone();
    register(&target, 1, &mut remote, Access::REMOTE_READ_WRITE);
    register(&init, 1, &mut local, Access::LOCAL);
    let peer = init.connect(&segment(&target), soon()).unwrap();
    let n = len as u64;
    run(
        &init,
        peer,
        &[TransferRequest::write(RegionId(1), 0, RegionId(1), 0, n)],
    )
    .unwrap();
    assert!(remote == want, "the written bytes differ");
    local.fill(0);
    run(
        &init,
        peer,
        &[TransferRequest::read(RegionId(1), 0, RegionId(1), 0, n)],
    )
    .unwrap();
    assert!(local == want, "the read bytes differ");
    init.deregister(RegionId(1), soon()).unwrap();
    target.deregister(RegionId(1), soon()).unwrap();
}

#[test]
fn a_target_that_dies_mid_transfer_fails_the_batch_with_peer_unreachable_at_once() {
    let target = backend(|c| c.debug_delay = Duration::from_millis(500));
    let init = backend(|_| {});
    let mut remote = vec![0u8; 1 << 20];
    let mut local = vec![1u8; 1 << 20];
    register(&target, 1, &mut remote, Access::REMOTE_READ_WRITE);
    register(&init, 1, &mut local, Access::LOCAL);
    let peer = init.connect(&segment(&target), soon()).unwrap();
    let (tx, rx) = mpsc::channel();
    let deadline = Duration::from_secs(20);
    for i in 0..8u64 {
        let tx = tx.clone();
        let done = Completion::new(deadline, move |r, _| {
            let _ = tx.send(r);
        });
        let req = TransferRequest::write(RegionId(1), i << 17, RegionId(1), i << 17, 1 << 17);
        init.submit(peer, &[req], done).unwrap();
    }
    std::thread::sleep(Duration::from_millis(50));
    let start = Instant::now();
    target.deregister(RegionId(1), soon()).unwrap();
    drop(target);
    for _ in 0..8 {
        let r = rx.recv_timeout(Duration::from_secs(5)).expect("completed");
        let e = r.expect_err("the target died");
        assert_eq!(e.kind(), ErrorKind::PeerUnreachable, "{e}");
    }
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "failing took {:?}",
        start.elapsed()
    );
    // Nothing is left to use; a new submit says so at once, and a new target works.
    let done = Completion::new(deadline, |_, _| {});
    let req = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, 16);
    assert_eq!(
        init.submit(peer, &[req], done).unwrap_err().kind(),
        ErrorKind::PeerUnreachable
    );
    let other = backend(|_| {});
    let mut mem = vec![0u8; 64];
    register(&other, 1, &mut mem, Access::REMOTE_READ_WRITE);
    let p2 = init.connect(&segment(&other), soon()).unwrap();
    run(&init, p2, &[req]).unwrap();
    assert_eq!(mem[..16], [1; 16]);
    other.deregister(RegionId(1), soon()).unwrap();
    init.deregister(RegionId(1), soon()).unwrap();
}

#[test]
fn connect_refills_a_pool_with_broken_connections() {
    let target = backend(|_| {});
    let init = backend(|c| c.connections_per_peer = 2);
    let mut mem = vec![0u8; 64];
    register(&target, 1, &mut mem, Access::REMOTE_READ_WRITE);
    let mut src = vec![3u8; 64];
    register(&init, 1, &mut src, Access::LOCAL);
    let seg = segment(&target);
    let peer = init.connect(&seg, soon()).unwrap();
    // Break every connection the target serves.
    for (_, s) in target.shared().serving.lock().iter() {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
    let req = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, 64);
    let end = Instant::now() + Duration::from_secs(5);
    // The breaks arrive asynchronously; wait until a submit notices.
    loop {
        match run(&init, peer, &[req]) {
            Err(e) if e.kind() == ErrorKind::PeerUnreachable => break,
            _ if Instant::now() < end => std::thread::sleep(Duration::from_millis(5)),
            r => panic!("no failure after the connections broke: {r:?}"),
        }
    }
    // Each connection's receiver notices its own break; wait for all of them.
    while init.live_connections(peer) > 0 {
        assert!(
            Instant::now() < end,
            "a broken connection was never noticed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        init.connect(&seg, soon()).unwrap(),
        peer,
        "the same peer id"
    );
    run(&init, peer, &[req]).unwrap();
    assert_eq!(mem, vec![3u8; 64]);
    target.deregister(RegionId(1), soon()).unwrap();
    init.deregister(RegionId(1), soon()).unwrap();
}

/// Device memory of `fakedev:0`, freed on drop.
struct DevMem {
    rt: std::sync::Arc<dyn te_core::device::DeviceRuntime>,
    addr: u64,
    len: usize,
}

impl DevMem {
    fn new(len: usize) -> DevMem {
        let rt = te_core::device::runtime(te_core::fakedev::NAME).expect("fakedev");
        let addr = rt.alloc(0, len).expect("alloc");
        DevMem { rt, addr, len }
    }

    fn register(&self, b: &TcpBackend, id: u64, access: Access) {
        let mem = MemoryDesc {
            name: "d".into(),
            addr: self.addr,
            len: self.len as u64,
            kind: MemoryKind::Device {
                runtime: te_core::fakedev::NAME.into(),
                ordinal: 0,
            },
            access,
        };
        b.register(RegionId(id), &mem).expect("register");
    }

    fn fill(&self, v: &[u8]) {
        let copy = te_core::device::DeviceCopy::ToDevice {
            ordinal: 0,
            device: self.addr,
            host: v.as_ptr() as *mut u8,
            len: v.len().min(self.len),
        };
        // SAFETY: `v` outlives the synchronous copy, which stays inside the allocation.
        unsafe { self.rt.copy_sync(copy) }.expect("copy");
    }

    fn read(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        let copy = te_core::device::DeviceCopy::ToHost {
            ordinal: 0,
            device: self.addr,
            host: v.as_mut_ptr(),
            len: self.len,
        };
        // SAFETY: `v` outlives the synchronous copy and holds `len` bytes.
        unsafe { self.rt.copy_sync(copy) }.expect("copy");
        v
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        let _ = self.rt.free(0, self.addr);
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u8)
                .wrapping_mul(31)
                .wrapping_add(seed ^ (i >> 12) as u8)
        })
        .collect()
}

#[test]
fn peers_with_different_slice_sizes_agree_and_device_blocks_move_intact() {
    const BLOCK: u64 = 4 << 20;
    // The target's staging buffers hold 64 KiB; the initiator would cut 8 MiB slices.
    let target = backend(|c| c.slice_size = 64 << 10);
    let init = backend(|c| c.slice_size = 8 << 20);
    let (remote, src, back) = (
        DevMem::new(4 * BLOCK as usize),
        DevMem::new(4 * BLOCK as usize),
        DevMem::new(4 * BLOCK as usize),
    );
    remote.register(&target, 1, Access::REMOTE_READ_WRITE);
    src.register(&init, 1, Access::LOCAL);
    back.register(&init, 2, Access::LOCAL);
    let data = pattern(4 * BLOCK as usize, 7);
    src.fill(&data);
    let peer = init.connect(&segment(&target), soon()).unwrap();
    let reqs = |op, local| -> Vec<TransferRequest> {
        (0..4)
            .map(|i| TransferRequest {
                op,
                local: RegionId(local),
                local_offset: i * BLOCK,
                remote: RegionId(1),
                remote_offset: (3 - i) * BLOCK,
                len: BLOCK,
            })
            .collect()
    };
    run(&init, peer, &reqs(te_core::Op::Write, 1)).expect("write 4 x 4 MiB");
    let landed = remote.read();
    for i in 0..4 {
        let (at, from) = ((3 - i) * BLOCK as usize, i * BLOCK as usize);
        assert!(
            landed[at..at + BLOCK as usize] == data[from..from + BLOCK as usize],
            "block {i} landed intact"
        );
    }
    run(&init, peer, &reqs(te_core::Op::Read, 2)).expect("read 4 x 4 MiB");
    assert!(back.read() == data, "the blocks read back intact");
}

/// Sends `h` on a fresh raw connection and returns the target's answer: the error
/// frame's header and message, and whether the connection was closed after it.
fn send_raw_request(target: &TcpBackend, h: Header) -> (Header, String, bool) {
    let mut s = raw(target);
    s.write_all(&h.encode()).unwrap();
    let e = read_header(&mut s);
    let mut msg = vec![0u8; e.len as usize];
    s.read_exact(&mut msg).unwrap();
    let mut rest = [0u8; 64];
    let closed = matches!(s.read(&mut rest), Ok(0) | Err(_));
    (e, String::from_utf8_lossy(&msg).into_owned(), closed)
}

#[test]
fn a_frame_longer_than_the_agreed_limit_is_refused_and_the_target_keeps_serving() {
    let target = backend(|c| c.slice_size = 64 << 10);
    let dev = DevMem::new(1 << 20);
    dev.register(&target, 1, Access::REMOTE_READ_WRITE);
    let mut host = vec![0u8; 1 << 20];
    register(&target, 2, &mut host, Access::REMOTE_READ_WRITE);
    // The limit is announced in the handshake.
    let (addr, instance) = decode_endpoint(&target.endpoint()).unwrap();
    let mut s = TcpStream::connect(addr).unwrap();
    let terms = crate::handshake::handshake(&mut s, "raw", instance, None).unwrap();
    assert_eq!(terms.max_payload, 64 << 10);
    drop(s);
    // A hostile peer ignores it: an oversized WRITE into device memory (whose staging
    // buffer holds 64 KiB), a READ of it, and a WRITE to host memory.
    for (kind, region) in [(Kind::Write, 1), (Kind::Read, 1), (Kind::Write, 2)] {
        let h = Header::request(kind, 5, region, 0, 1 << 20);
        let (e, msg, closed) = send_raw_request(&target, h);
        assert_eq!(e.kind, Kind::Error, "{kind:?}");
        assert_eq!(e.id, 5);
        assert_eq!(e.code, ErrorKind::InvalidRequest.code(), "{msg}");
        assert!(msg.contains("1048576") && msg.contains("65536"), "{msg}");
        assert!(closed, "the connection is closed after the refusal");
    }
    // The target still serves an honest peer, which slices to its limit.
    let init = backend(|c| c.slice_size = 8 << 20);
    let src = DevMem::new(1 << 20);
    src.register(&init, 1, Access::LOCAL);
    let data = pattern(1 << 20, 3);
    src.fill(&data);
    let peer = init.connect(&segment(&target), soon()).unwrap();
    let w = TransferRequest {
        op: te_core::Op::Write,
        local: RegionId(1),
        local_offset: 0,
        remote: RegionId(1),
        remote_offset: 0,
        len: 1 << 20,
    };
    run(&init, peer, &[w]).expect("an honest write");
    assert!(dev.read() == data);
}

/// Waits, bounded, until `f` holds.
fn eventually(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + limit;
    while !f() {
        assert!(
            Instant::now() < end,
            "{what} did not happen within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// How long until the target closes `s`, which sends one byte every 100 ms; `None` if
/// it is still open after `limit`.
fn closed_after(s: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    while start.elapsed() < limit {
        let _ = s.write(b"T");
        let mut b = [0u8; 64];
        match s.read(&mut b) {
            Ok(0) => return Some(start.elapsed()),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return Some(start.elapsed())
            }
            _ => {}
        }
    }
    None
}

#[test]
fn a_peer_that_trickles_its_handshake_is_cut_at_the_handshake_timeout() {
    let target = backend(|c| c.handshake_timeout = Duration::from_millis(300));
    let (addr, _) = decode_endpoint(&target.endpoint()).unwrap();
    let mut s = TcpStream::connect(addr).unwrap();
    // Without the timeout the connection would stay open: the upper bound only
    // leaves room for a loaded machine.
    let t = closed_after(&mut s, Duration::from_secs(5)).expect("closed");
    assert!(
        t >= Duration::from_millis(250) && t < Duration::from_secs(5),
        "closed after {t:?}"
    );
    // The target still serves honest peers.
    let init = backend(|_| {});
    init.connect(&segment(&target), soon()).expect("connect");
}

#[test]
fn pending_handshakes_and_connections_are_capped_and_the_rest_closed_at_once() {
    let target = backend(|c| {
        c.max_pending = 2;
        c.max_connections = 3;
        // Far above the bounds below, so "closed at once" cannot be the timeout.
        c.handshake_timeout = Duration::from_secs(20);
    });
    let (addr, _) = decode_endpoint(&target.endpoint()).unwrap();
    let idle: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    eventually("two pending handshakes", Duration::from_secs(5), || {
        target
            .shared()
            .pending
            .load(std::sync::atomic::Ordering::Acquire)
            == 2
    });
    // A third unauthenticated connection is closed at once.
    let mut third = TcpStream::connect(addr).unwrap();
    let t = closed_after(&mut third, Duration::from_secs(5)).expect("refused");
    assert!(t < Duration::from_secs(5), "closed after {t:?}");
    // An authenticated one is not pending; it fits the connection cap (3), a fourth
    // connection does not.
    drop(idle);
    eventually("no connection served", Duration::from_secs(5), || {
        target.shared().serving.lock().is_empty()
    });
    let init = backend(|c| c.connections_per_peer = 3);
    let peer = init.connect(&segment(&target), soon()).expect("connect");
    assert_eq!(init.live_connections(peer), 3);
    let mut fourth = TcpStream::connect(addr).unwrap();
    let t = closed_after(&mut fourth, Duration::from_secs(5)).expect("refused");
    assert!(t < Duration::from_secs(5), "closed after {t:?}");
}

#[test]
fn an_idle_data_connection_is_closed_after_idle_timeout() {
    let target = backend(|c| c.idle_timeout = Duration::from_millis(300));
    let mut mem = vec![0u8; 4096];
    register(&target, 1, &mut mem, Access::REMOTE_READ_WRITE);
    let init = backend(|c| c.connections_per_peer = 1);
    let mut src = vec![1u8; 4096];
    register(&init, 1, &mut src, Access::LOCAL);
    let peer = init.connect(&segment(&target), soon()).unwrap();
    let w = TransferRequest {
        op: te_core::Op::Write,
        local: RegionId(1),
        local_offset: 0,
        remote: RegionId(1),
        remote_offset: 0,
        len: 4096,
    };
    run(&init, peer, &[w]).expect("write");
    eventually("the idle connection closed", Duration::from_secs(3), || {
        init.live_connections(peer) == 0
    });
    // Connecting again refills the pool.
    init.connect(&segment(&target), soon()).unwrap();
    run(&init, peer, &[w]).expect("write after reconnecting");
}

const FD_CHILD: &str = "TE_TCP_TEST_FD_CHILD";

#[test]
fn the_listener_survives_running_out_of_file_descriptors() {
    let name = "tests::the_listener_survives_running_out_of_file_descriptors";
    if std::env::var_os(FD_CHILD).is_none() {
        // The descriptor limit is the process's: lower it in a child of our own.
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--nocapture", "--test-threads=1"])
            .env(FD_CHILD, "1")
            .output()
            .expect("run the child");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{text}");
        assert!(text.contains("fd child: served again"), "{text}");
        return;
    }
    let target = backend(|c| c.handshake_timeout = Duration::from_millis(500));
    let mut mem = vec![0u8; 4096];
    register(&target, 1, &mut mem, Access::REMOTE_READ_WRITE);
    let init = backend(|c| c.connections_per_peer = 1);
    let mut src = vec![9u8; 4096];
    register(&init, 1, &mut src, Access::LOCAL);
    let (addr, _) = decode_endpoint(&target.endpoint()).unwrap();
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `old` is a valid rlimit for the kernel to fill.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut old) }, 0);
    let low = libc::rlimit {
        rlim_cur: open + 16,
        rlim_max: old.rlim_max,
    };
    // SAFETY: a valid rlimit, read by the kernel.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) }, 0);
    // Use every descriptor, then free one for a client: the listener has a connection
    // to accept and no descriptor to accept it with. Other threads may hold descriptors
    // for a moment (and free them later), so squeeze again until accept fails.
    let errors = || {
        target
            .shared()
            .accept_errors
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let mut files = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..20 {
        while files.len() < 128 {
            match std::fs::File::open("/dev/null") {
                Ok(f) => files.push(f),
                Err(_) => break,
            }
        }
        assert!(files.len() < 128, "the descriptor limit was not reached");
        files.pop();
        if let Ok(c) = TcpStream::connect(addr) {
            clients.push(c);
        }
        let end = Instant::now() + Duration::from_millis(300);
        while errors() == 0 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
        if errors() > 0 {
            break;
        }
    }
    assert!(
        errors() > 0,
        "accept never failed: {} clients, {} files, {} served",
        clients.len(),
        files.len(),
        target.shared().serving.lock().len()
    );
    drop(files);
    drop(clients);
    // SAFETY: a valid rlimit, read by the kernel.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &old) }, 0);
    let peer = init
        .connect(&segment(&target), soon())
        .expect("connect after");
    let w = TransferRequest {
        op: te_core::Op::Write,
        local: RegionId(1),
        local_offset: 0,
        remote: RegionId(1),
        remote_offset: 0,
        len: 4096,
    };
    run(&init, peer, &[w]).expect("write after");
    drop(init);
    drop(target);
    assert!(mem.iter().all(|&b| b == 9));
    println!("fd child: served again");
}

#[test]
fn a_peer_that_floods_requests_and_reads_nothing_is_bounded_and_cut_off() {
    let target = backend(|c| c.io_timeout = Duration::from_millis(500));
    let dev = DevMem::new(64 << 10);
    dev.register(&target, 1, Access::REMOTE_READ_WRITE);
    let mut host = vec![5u8; 64 << 10];
    register(&target, 2, &mut host, Access::REMOTE_READ_WRITE);
    let mut s = raw(&target);
    s.set_write_timeout(Some(Duration::from_secs(3))).unwrap();
    // One device READ starts the connection's responder; host READs (each holding a pin
    // on region 2 until it is sent) follow, and nothing is ever read back.
    let mut frames = Header::request(Kind::Read, 1, 1, 0, 4096).encode().to_vec();
    // 64 KiB each: far more than the socket buffers hold.
    for id in 2..3000u64 {
        frames.extend_from_slice(&Header::request(Kind::Read, id, 2, 0, 64 << 10).encode());
    }
    let writer = std::thread::spawn(move || {
        let _ = s.write_all(&frames);
        s
    });
    // The target queues at most MAX_QUEUED responses, then stops reading; after
    // io_timeout without the peer reading it closes the connection and releases the
    // pins, so the region can be deregistered.
    let pins = || target.shared().regions.users(RegionId(2));
    eventually("the flood holding pins", Duration::from_secs(5), || {
        pins() >= crate::respond::MAX_QUEUED - 1
    });
    std::thread::sleep(Duration::from_millis(100));
    let held = pins();
    assert!(
        held <= crate::respond::MAX_QUEUED + 2,
        "{held} pins: one per queued response, the one being sent, the one waiting for room"
    );
    let start = Instant::now();
    target
        .deregister(
            RegionId(2),
            te_core::Deadline::after(Duration::from_secs(5)),
        )
        .expect("the flood's pins are released");
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "released after {:?}",
        start.elapsed()
    );
    let high = crate::respond::HIGH_WATER.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        high,
        crate::respond::MAX_QUEUED,
        "the queue filled to its bound"
    );
    let _s = writer.join().unwrap();
    // The target still serves an honest peer.
    let init = backend(|_| {});
    let mut dst = vec![0u8; 4096];
    register(&init, 1, &mut dst, Access::LOCAL);
    let peer = init.connect(&segment(&target), soon()).unwrap();
    let r = TransferRequest {
        op: te_core::Op::Read,
        local: RegionId(1),
        local_offset: 0,
        remote: RegionId(1),
        remote_offset: 0,
        len: 4096,
    };
    run(&init, peer, &[r]).expect("an honest read");
}

#[test]
fn a_stalled_target_fails_the_batch_at_its_deadline_and_never_writes_later() {
    // The target holds every request 8 s; the batches' deadline is 300 ms.
    let target = backend(|c| c.debug_delay = Duration::from_secs(8));
    let mut remote = vec![0x11u8; 8192];
    register(&target, 1, &mut remote, Access::REMOTE_READ_WRITE);
    let init = backend(|c| c.connections_per_peer = 2);
    let mut local = vec![0xABu8; 8192];
    register(&init, 1, &mut local, Access::LOCAL);
    let peer = init.connect(&segment(&target), soon()).unwrap();
    let (tx, rx) = mpsc::channel();
    let start = Instant::now();
    for (op, off) in [(te_core::Op::Read, 0), (te_core::Op::Write, 4096)] {
        let tx = tx.clone();
        let done = Completion::new(Duration::from_millis(300), move |r, _| {
            let _ = tx.send((op, r, start.elapsed()));
        });
        let r = TransferRequest {
            op,
            local: RegionId(1),
            local_offset: off,
            remote: RegionId(1),
            remote_offset: off,
            len: 4096,
        };
        init.submit(peer, &[r], done).unwrap();
    }
    for _ in 0..2 {
        let (op, r, at) = rx.recv_timeout(Duration::from_secs(5)).expect("completed");
        let e = r.expect_err("the target never answered in time");
        assert_eq!(e.kind(), ErrorKind::Timeout, "{op}: {e}");
        assert!(at < Duration::from_secs(5), "{op} completed after {at:?}");
    }
    assert_eq!(
        init.live_connections(peer),
        0,
        "the connections carrying the batches were closed"
    );
    // The target answers after 8 s; nothing of it may land in the caller's memory.
    std::thread::sleep(Duration::from_millis(8500));
    assert!(local.iter().all(|&b| b == 0xAB), "late bytes landed");
}

#[test]
fn a_write_cut_off_mid_payload_is_reported_at_the_target_as_torn() {
    let target = backend(|c| c.slice_size = 1 << 20);
    let mut mem = vec![0u8; 1 << 20];
    register(&target, 1, &mut mem, Access::REMOTE_READ_WRITE);
    let mut s = raw(&target);
    // Announces 1 MiB, sends 100 bytes, and goes away.
    s.write_all(&Header::request(Kind::Write, 1, 1, 0, 1 << 20).encode())
        .unwrap();
    s.write_all(&[7u8; 100]).unwrap();
    drop(s);
    let torn = || {
        target
            .shared()
            .torn_writes
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    eventually("the torn write reported", Duration::from_secs(5), || {
        torn() == 1
    });
    // A refused or complete request is not torn.
    let mut s = raw(&target);
    s.write_all(&Header::request(Kind::Write, 2, 1, 0, 8).encode())
        .unwrap();
    s.write_all(&[1u8; 8]).unwrap();
    assert_eq!(read_header(&mut s).kind, Kind::WriteAck);
    drop(s);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(torn(), 1);
}

#[test]
fn a_busy_connection_is_not_closed_for_a_batch_past_its_deadline() {
    // Answers keep coming every ~10 ms; one batch's deadline passes while it waits
    // behind another. The busy connection stays, the late batch gets Timeout, and its
    // data is dropped, not placed. A 4 KiB frame limit keeps each read its own frame.
    let target = backend(|c| {
        c.debug_delay = Duration::from_millis(10);
        c.slice_size = 4096;
    });
    let mut remote = vec![0x22u8; 4096];
    register(&target, 1, &mut remote, Access::REMOTE_READ_WRITE);
    let init = backend(|c| c.connections_per_peer = 1);
    let mut long = vec![0u8; 40 * 4096];
    register(&init, 1, &mut long, Access::LOCAL);
    let mut late = vec![0xABu8; 4096];
    register(&init, 2, &mut late, Access::LOCAL);
    let peer = init.connect(&segment(&target), soon()).unwrap();
    let read = |local, local_offset| TransferRequest {
        op: te_core::Op::Read,
        local: RegionId(local),
        local_offset,
        remote: RegionId(1),
        remote_offset: 0,
        len: 4096,
    };
    let (tx, rx) = mpsc::channel();
    let first: Vec<_> = (0..40).map(|i| read(1, i * 4096)).collect();
    let t = tx.clone();
    let done = Completion::new(Duration::from_secs(10), move |r, _| {
        let _ = t.send(("first", r));
    });
    init.submit(peer, &first, done).unwrap();
    let done = Completion::new(Duration::from_millis(100), move |r, _| {
        let _ = tx.send(("late", r));
    });
    init.submit(peer, &[read(2, 0)], done).unwrap();
    let mut results = std::collections::HashMap::new();
    for _ in 0..2 {
        let (name, r) = rx.recv_timeout(Duration::from_secs(10)).expect("completed");
        results.insert(name, r);
    }
    results["first"].as_ref().expect("the long batch succeeds");
    let e = results["late"].as_ref().expect_err("past its deadline");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert_eq!(init.live_connections(peer), 1, "the busy connection stays");
    assert!(long.iter().all(|&b| b == 0x22));
    assert!(late.iter().all(|&b| b == 0xAB), "late data was not placed");
}

#[test]
fn an_aborted_batch_on_a_stalled_target_ends_without_waiting_for_io_timeout() {
    let target = backend(|c| c.debug_delay = Duration::from_secs(8));
    let mut remote = vec![0x33u8; 4096];
    register(&target, 1, &mut remote, Access::REMOTE_READ_WRITE);
    let init = backend(|c| c.connections_per_peer = 1);
    let mut local = vec![0xABu8; 4096];
    register(&init, 1, &mut local, Access::LOCAL);
    let peer = init.connect(&segment(&target), soon()).unwrap();
    let (tx, rx) = mpsc::channel();
    let (done, aborter) = Completion::abortable(
        te_core::Deadline::after(Duration::from_secs(10)),
        move |r, _| {
            let _ = tx.send(r);
        },
    );
    let r = TransferRequest {
        op: te_core::Op::Read,
        local: RegionId(1),
        local_offset: 0,
        remote: RegionId(1),
        remote_offset: 0,
        len: 4096,
    };
    init.submit(peer, &[r], done).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    aborter.abort();
    init.abort(peer, te_core::BatchId(0));
    let r = rx.recv_timeout(Duration::from_secs(5)).expect("completed");
    assert!(r.is_err(), "an aborted batch does not succeed");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "ended {:?} after the abort",
        start.elapsed()
    );
    std::thread::sleep(Duration::from_millis(8500));
    assert!(local.iter().all(|&b| b == 0xAB), "late bytes landed");
}

/// A scatter-gather request's header and entry list, as a raw peer may send it: `len`
/// and the entry count are taken as given, whatever the entries add up to.
fn sg_frame(kind: Kind, id: u64, region: u64, entries: &[(u64, u64)], len: u64) -> Vec<u8> {
    sg_frame_counted(kind, id, region, entries, entries.len() as u32, len)
}

fn sg_frame_counted(
    kind: Kind,
    id: u64,
    region: u64,
    entries: &[(u64, u64)],
    count: u32,
    len: u64,
) -> Vec<u8> {
    let h = Header {
        kind,
        code: count,
        id,
        region,
        offset: 0,
        len,
    };
    let mut b = h.encode().to_vec();
    for &(offset, len) in entries {
        crate::wire::Entry { offset, len }.encode_into(&mut b);
    }
    b
}

/// Reads what the target sends until it closes `s` (true) or 5 s pass (false).
fn read_until_closed(s: &mut TcpStream) -> (Vec<u8>, bool) {
    let end = Instant::now() + Duration::from_secs(5);
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut got = Vec::new();
    while Instant::now() < end {
        let mut b = [0u8; 4096];
        match s.read(&mut b) {
            Ok(0) => return (got, true),
            Ok(n) => got.extend_from_slice(&b[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return (got, true),
            Err(_) => {}
        }
    }
    (got, false)
}

/// A host buffer whose first `len` bytes are registered and whose last 4 KiB are a
/// canary that nothing may touch.
struct Guarded {
    v: Vec<u8>,
    len: usize,
}

impl Guarded {
    const CANARY: u8 = 0xC5;

    fn new(len: usize, fill: u8) -> Guarded {
        let mut v = vec![fill; len + 4096];
        v[len..].fill(Self::CANARY);
        Guarded { v, len }
    }

    fn register(&mut self, b: &TcpBackend, id: u64, access: Access) {
        let len = self.len;
        register(b, id, &mut self.v[..len], access);
    }

    fn assert_untouched(&self, fill: u8, what: &str) {
        assert!(
            self.v[..self.len].iter().all(|&b| b == fill),
            "{what}: a byte landed in the region"
        );
        assert!(
            self.v[self.len..].iter().all(|&b| b == Self::CANARY),
            "{what}: a byte landed past the region's end"
        );
    }
}

#[test]
fn a_scatter_gather_frame_with_an_entry_outside_the_region_is_refused_whole_before_any_byte_lands()
{
    let target = backend(|_| {});
    let mut mem = Guarded::new(4096, 0);
    mem.register(&target, 1, Access::REMOTE_READ_WRITE);
    let mut ro = Guarded::new(64, 0);
    ro.register(&target, 2, Access::REMOTE_READ);
    let mut s = raw(&target);
    // Each case's first entry is good: it must not land either.
    // (region, entries, the refusal)
    type Case = (u64, &'static [(u64, u64)], ErrorKind);
    let cases: [Case; 4] = [
        (1, &[(0, 16), (4090, 16)], ErrorKind::OutOfBounds),
        (1, &[(0, 16), (4096, 1)], ErrorKind::OutOfBounds),
        (
            1,
            &[(0, 16), (8, 8), (u64::MAX - 8, 8)],
            ErrorKind::OutOfBounds,
        ),
        (2, &[(0, 16), (16, 16)], ErrorKind::InvalidRequest),
    ];
    for (i, (region, entries, kind)) in cases.into_iter().enumerate() {
        let id = i as u64 + 1;
        let len: u64 = entries.iter().map(|e| e.1).sum();
        s.write_all(&sg_frame(Kind::WriteV, id, region, entries, len))
            .unwrap();
        s.write_all(&vec![0xee; len as usize]).unwrap();
        let r = read_header(&mut s);
        assert_eq!((r.kind, r.id), (Kind::Error, id), "case {i}");
        assert_eq!(ErrorKind::from_code(r.code), kind, "case {i}");
        let mut msg = vec![0u8; r.len as usize];
        s.read_exact(&mut msg).unwrap();
        mem.assert_untouched(0, &format!("case {i}"));
        ro.assert_untouched(0, &format!("case {i}"));
    }
    // A READ with one entry outside is refused whole too: no data, one error.
    s.write_all(&sg_frame(Kind::ReadV, 7, 1, &[(0, 8), (4095, 2)], 10))
        .unwrap();
    let r = read_header(&mut s);
    assert_eq!((r.kind, r.id), (Kind::Error, 7));
    assert_eq!(ErrorKind::from_code(r.code), ErrorKind::OutOfBounds);
    let mut msg = vec![0u8; r.len as usize];
    s.read_exact(&mut msg).unwrap();
    // The connection is still in sync: a good gathered write lands, entry by entry in
    // order, and a gathered read returns the entries' bytes in order.
    s.write_all(&sg_frame(Kind::WriteV, 8, 1, &[(4088, 8), (0, 4)], 12))
        .unwrap();
    s.write_all(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
        .unwrap();
    let r = read_header(&mut s);
    assert_eq!((r.kind, r.id), (Kind::WriteAck, 8));
    assert_eq!(&mem.v[4088..4096], &[1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(&mem.v[..4], &[9, 10, 11, 12]);
    assert!(mem.v[4..4088].iter().all(|&b| b == 0));
    assert!(mem.v[4096..].iter().all(|&b| b == Guarded::CANARY));
    s.write_all(&sg_frame(Kind::ReadV, 9, 1, &[(0, 2), (4094, 2)], 4))
        .unwrap();
    let r = read_header(&mut s);
    assert_eq!((r.kind, r.id, r.len), (Kind::ReadData, 9, 4));
    let mut data = [0u8; 4];
    s.read_exact(&mut data).unwrap();
    assert_eq!(data, [9, 10, 7, 8]);
    target.deregister(RegionId(1), soon()).unwrap();
    target.deregister(RegionId(2), soon()).unwrap();
}

#[test]
fn a_scatter_gather_frame_that_breaks_the_rules_closes_its_connection_before_any_byte_lands() {
    // The frame limit is 4 KiB: a frame whose entries are all inside the region may
    // still be too long.
    let target = backend(|c| c.slice_size = 4096);
    let mut mem = Guarded::new(16384, 0);
    mem.register(&target, 1, Access::REMOTE_READ_WRITE);
    let too_many: Vec<(u64, u64)> = (0..1025).map(|i| (i, 1)).collect();
    let cases: Vec<(&str, Vec<u8>, u64)> = vec![
        (
            "more entries than the limit",
            sg_frame(Kind::WriteV, 1, 1, &too_many, 1025),
            1025,
        ),
        (
            "no entries",
            sg_frame_counted(Kind::WriteV, 1, 1, &[], 0, 16),
            16,
        ),
        (
            "a header that claims more payload than its entries",
            sg_frame(Kind::WriteV, 1, 1, &[(0, 16), (32, 16)], 48),
            48,
        ),
        (
            "a header that claims less payload than its entries",
            sg_frame(Kind::WriteV, 1, 1, &[(0, 16), (32, 16)], 16),
            32,
        ),
        (
            "an entry count larger than the list sent",
            sg_frame_counted(Kind::WriteV, 1, 1, &[(0, 16), (32, 16)], 3, 32),
            32,
        ),
        (
            "an empty entry",
            sg_frame(Kind::WriteV, 1, 1, &[(0, 16), (32, 0)], 16),
            16,
        ),
        (
            "an entry that overflows",
            sg_frame(Kind::WriteV, 1, 1, &[(u64::MAX - 4, 8)], 8),
            8,
        ),
        (
            "a frame longer than the agreed limit",
            sg_frame(Kind::WriteV, 1, 1, &[(0, 4096), (8192, 4096)], 8192),
            8192,
        ),
    ];
    for (what, frame, payload) in cases {
        let mut s = raw(&target);
        // The target may close before it has read everything: writes may fail.
        let _ = s.write_all(&frame);
        let _ = s.write_all(&vec![0xee; payload as usize]);
        let (got, closed) = read_until_closed(&mut s);
        assert!(closed, "{what}: the connection stays open");
        if what.contains("longer than the agreed limit") {
            let r = Header::decode(&got).expect("an error frame first");
            assert_eq!((r.kind, r.id), (Kind::Error, 1), "{what}");
            assert_eq!(ErrorKind::from_code(r.code), ErrorKind::InvalidRequest);
        }
        mem.assert_untouched(0, what);
        // The target keeps serving others.
        let mut good = raw(&target);
        good.write_all(&Header::request(Kind::Read, 5, 1, 0, 16).encode())
            .unwrap();
        let r = read_header(&mut good);
        assert_eq!((r.kind, r.id, r.len), (Kind::ReadData, 5, 16), "{what}");
    }
    target.deregister(RegionId(1), soon()).unwrap();
}

/// A small deterministic generator (xorshift), so the test needs no seed handling.
fn shuffled(n: u64, seed: u64) -> Vec<u64> {
    let mut x = seed | 1;
    let mut v: Vec<u64> = (0..n).collect();
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

/// Requests moving block `local_ids[i]` of the local region to block `remote_ids[i]`
/// of remote region 1.
fn blocks(
    op: te_core::Op,
    local: u64,
    local_ids: &[u64],
    remote_ids: &[u64],
    block: u64,
) -> Vec<TransferRequest> {
    local_ids
        .iter()
        .zip(remote_ids)
        .map(|(&l, &r)| TransferRequest {
            op,
            local: RegionId(local),
            local_offset: l * block,
            remote: RegionId(1),
            remote_offset: r * block,
            len: block,
        })
        .collect()
}

#[test]
fn blocks_by_random_id_are_gathered_into_frames_and_land_intact_both_ways() {
    const BLOCK: u64 = 4096;
    const N: u64 = 2048;
    // 8 MiB in 2048 blocks with an 8 MiB frame limit: two frames of 1024 entries (cut
    // at the entry limit), one per connection.
    let target = backend(|c| c.slice_size = 8 << 20);
    let init = backend(|c| {
        c.connections_per_peer = 2;
        c.slice_size = 8 << 20;
    });
    let mut remote = Guarded::new((N * BLOCK) as usize, 0);
    remote.register(&target, 1, Access::REMOTE_READ_WRITE);
    let mut src = pattern((N * BLOCK) as usize, 3);
    register(&init, 1, &mut src, Access::LOCAL);
    let mut back = vec![0u8; (N * BLOCK) as usize];
    register(&init, 2, &mut back, Access::LOCAL);
    let peer = init.connect(&segment(&target), soon()).unwrap();
    let (local_ids, remote_ids) = (shuffled(N, 11), shuffled(N, 29));
    let w = blocks(te_core::Op::Write, 1, &local_ids, &remote_ids, BLOCK);
    run(&init, peer, &w).expect("write 2048 random blocks");
    let b = BLOCK as usize;
    for (&l, &r) in local_ids.iter().zip(&remote_ids) {
        let (l, r) = (l as usize * b, r as usize * b);
        assert!(
            remote.v[r..r + b] == src[l..l + b],
            "block {l} landed at {r}"
        );
    }
    assert!(remote.v[(N * BLOCK) as usize..]
        .iter()
        .all(|&x| x == Guarded::CANARY));
    // Read them back into other random places.
    let back_ids = shuffled(N, 47);
    let r = blocks(te_core::Op::Read, 2, &back_ids, &remote_ids, BLOCK);
    run(&init, peer, &r).expect("read 2048 random blocks");
    for ((&l, &dst), &_r) in local_ids.iter().zip(&back_ids).zip(&remote_ids) {
        let (l, dst) = (l as usize * b, dst as usize * b);
        assert!(
            back[dst..dst + b] == src[l..l + b],
            "block {l} read back at {dst}"
        );
    }
}

#[test]
fn gathered_blocks_to_and_from_device_memory_at_the_target_land_intact() {
    const BLOCK: u64 = 4096;
    const N: u64 = 256;
    let target = backend(|c| c.slice_size = 64 << 10);
    let init = backend(|_| {});
    let remote = DevMem::new((N * BLOCK) as usize);
    remote.register(&target, 1, Access::REMOTE_READ_WRITE);
    let mut src = pattern((N * BLOCK) as usize, 5);
    register(&init, 1, &mut src, Access::LOCAL);
    let mut back = vec![0u8; (N * BLOCK) as usize];
    register(&init, 2, &mut back, Access::LOCAL);
    let peer = init.connect(&segment(&target), soon()).unwrap();
    let (local_ids, remote_ids) = (shuffled(N, 5), shuffled(N, 9));
    let w = blocks(te_core::Op::Write, 1, &local_ids, &remote_ids, BLOCK);
    run(&init, peer, &w).expect("write random blocks to device memory");
    let landed = remote.read();
    let b = BLOCK as usize;
    for (&l, &r) in local_ids.iter().zip(&remote_ids) {
        let (l, r) = (l as usize * b, r as usize * b);
        assert!(landed[r..r + b] == src[l..l + b], "block {l} landed at {r}");
    }
    let r = blocks(te_core::Op::Read, 2, &local_ids, &remote_ids, BLOCK);
    run(&init, peer, &r).expect("read random blocks from device memory");
    assert!(back == src, "the blocks read back intact");
}

#[test]
fn device_blocks_gathered_at_both_ends_land_intact_scattered_or_in_runs() {
    const BLOCK: u64 = 4096;
    const N: u64 = 256;
    let target = backend(|c| c.slice_size = 64 << 10);
    let init = backend(|_| {});
    let size = (N * BLOCK) as usize;
    let (remote, src, back) = (DevMem::new(size), DevMem::new(size), DevMem::new(size));
    remote.register(&target, 1, Access::REMOTE_READ_WRITE);
    src.register(&init, 1, Access::LOCAL);
    back.register(&init, 2, Access::LOCAL);
    let data = pattern(size, 11);
    src.fill(&data);
    let peer = init.connect(&segment(&target), soon()).unwrap();
    // The first half scattered at both ends (one copy per block inside each frame's
    // group); the second half in order at both ends, so adjacent blocks share copies
    // and runs break where a frame ends.
    let (mut local_ids, mut remote_ids) = (shuffled(N / 2, 3), shuffled(N / 2, 17));
    local_ids.extend(N / 2..N);
    remote_ids.extend(N / 2..N);
    let w = blocks(te_core::Op::Write, 1, &local_ids, &remote_ids, BLOCK);
    run(&init, peer, &w).expect("write device blocks to device memory");
    let landed = remote.read();
    let b = BLOCK as usize;
    for (&l, &r) in local_ids.iter().zip(&remote_ids) {
        let (l, r) = (l as usize * b, r as usize * b);
        assert!(
            landed[r..r + b] == data[l..l + b],
            "block {l} landed at {r}"
        );
    }
    let r = blocks(te_core::Op::Read, 2, &local_ids, &remote_ids, BLOCK);
    run(&init, peer, &r).expect("read device blocks into device memory");
    assert!(back.read() == data, "the blocks read back intact");
}

#[test]
fn a_version_2_peer_is_refused_with_a_version_mismatch_on_both_sides() {
    use crate::wire::{Challenge, Hello, Status};
    // A version-2 initiator at a version-3 target: the challenge says `Version`, and
    // nothing else follows (no terms), so the old peer reports the mismatch.
    let target = backend(|_| {});
    let (addr, instance) = decode_endpoint(&target.endpoint()).unwrap();
    let mut s = TcpStream::connect(addr).unwrap();
    let hello = Hello {
        version: 2,
        instance,
        nonce: [1; 32],
    };
    s.write_all(&hello.encode()).unwrap();
    let mut b = [0u8; Challenge::LEN];
    s.read_exact(&mut b).unwrap();
    let ch = Challenge::decode(&b).unwrap();
    assert_eq!((ch.status, ch.version), (Status::Version, 3));
    let (rest, closed) = read_until_closed(&mut s);
    assert!(rest.is_empty() && closed, "the refusal is the last message");
    // A version-3 initiator at a version-2 target (a raw one) gets a clear error.
    let old = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let at = old.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (mut c, _) = old.accept().unwrap();
        let mut b = [0u8; Hello::LEN];
        c.read_exact(&mut b).unwrap();
        let ch = Challenge {
            version: 2,
            status: Status::Version,
            auth: false,
            nonce: [2; 32],
        };
        c.write_all(&ch.encode()).unwrap();
    });
    let mut s = TcpStream::connect(at).unwrap();
    let e = crate::handshake::handshake(&mut s, "old", 7, None).unwrap_err();
    t.join().unwrap();
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    assert!(e.to_string().contains("protocol 2 and this side 3"), "{e}");
}

#[test]
fn a_write_torn_mid_payload_is_posted_as_a_peer_event_naming_region_and_range() {
    let control =
        te_core::hook::StandaloneControl::start(&te_core::EngineConfig::default(), 7).unwrap();
    let ctx = te_core::BackendContext {
        hook: control.hook(),
        ..te_core::BackendContext::default()
    };
    let c = TcpConfig {
        slice_size: 1 << 20,
        ..TcpConfig::default()
    };
    let target = TcpBackend::new(c, &ctx).expect("backend");
    let mut mem = vec![0u8; 1 << 20];
    register(&target, 3, &mut mem, Access::REMOTE_READ_WRITE);
    // A plain WRITE of 1 MiB at 4096 that stops after 100 bytes, then a gathered one
    // whose entries span 100..9000 and that stops inside its second entry.
    let mut s = raw(&target);
    s.write_all(&Header::request(Kind::Write, 1, 3, 4096, (1 << 20) - 4096).encode())
        .unwrap();
    s.write_all(&[7u8; 100]).unwrap();
    drop(s);
    let mut s = raw(&target);
    s.write_all(&sg_frame(
        Kind::WriteV,
        1,
        3,
        &[(8000, 1000), (100, 50)],
        1050,
    ))
    .unwrap();
    s.write_all(&[8u8; 1010]).unwrap();
    let local = s.local_addr().unwrap().to_string();
    drop(s);
    let mut events = Vec::new();
    eventually("both torn writes posted", Duration::from_secs(5), || {
        events.extend(control.try_recv_events());
        events.len() >= 2
    });
    drop(target);
    let mut torn: Vec<_> = events
        .iter()
        .map(|e| {
            assert_eq!(e.kind, te_core::PeerEventKind::TornWrite, "{e:?}");
            e.torn.expect("a torn range")
        })
        .collect();
    torn.sort_by_key(|t| t.start);
    let range = |start, end| te_core::TornRange {
        region: RegionId(3),
        start,
        end,
    };
    assert_eq!(torn, [range(100, 9000), range(4096, 1 << 20)]);
    assert!(
        events.iter().any(|e| e.address == local),
        "the event names the connection's peer address: {events:?}"
    );
}

#[test]
fn without_a_listen_key_the_data_listener_follows_the_engines_listen_and_advertise() {
    let ctx = |host: &str, advertise: Option<&str>| te_core::BackendContext {
        listen_host: Some(host.into()),
        advertise: advertise.map(str::to_string),
        ..Default::default()
    };
    // Every interface, advertised as loopback: the endpoint names the advertised host.
    let b = TcpBackend::new(TcpConfig::default(), &ctx("0.0.0.0", Some("127.0.0.1"))).unwrap();
    let (addr, _) = decode_endpoint(&b.endpoint()).unwrap();
    assert_eq!(addr.ip().to_string(), "127.0.0.1");
    assert_ne!(addr.port(), 0);
    TcpStream::connect(addr).expect("the data listener is reachable where advertised");
    // Every interface and nothing advertised: refused, saying where to set it.
    let e = TcpBackend::new(TcpConfig::default(), &ctx("0.0.0.0", None)).unwrap_err();
    assert!(e.to_string().contains("advertise"), "{e}");
    // An explicit listen wins over the engine's host.
    let b = backend(|c| c.listen = Some("127.0.0.1:0".into()));
    let (addr, _) = decode_endpoint(&b.endpoint()).unwrap();
    assert!(addr.ip().is_loopback());
}
