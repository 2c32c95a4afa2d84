//! The target's own checks, seen through raw frames from a hostile peer: writes out of
//! bounds or rights, malformed and oversized frames, scatter-gather frames that break
//! the rules, and a peer that floods requests and reads nothing.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use te_core::{Access, ErrorKind, RegionId, TransferBackend, TransferRequest};

use super::{
    backend, eventually, pattern, raw, read_header, read_until_closed, register, run, segment,
    sg_frame, sg_frame_counted, soon, DevMem, Guarded,
};
use crate::endpoint::decode_endpoint;
use crate::wire::{Header, Kind};
use crate::TcpBackend;

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
        let (r, _) = read_error(&mut s);
        assert_eq!((r.kind, r.id), (Kind::Error, id), "case {i}");
        assert_eq!(ErrorKind::from_code(r.code), kind, "case {i}");
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

/// Sends `h` on a fresh raw connection and returns the target's answer: the error
/// frame's header and message, and whether the connection was closed after it.
fn send_raw_request(target: &TcpBackend, h: Header) -> (Header, String, bool) {
    let mut s = raw(target);
    s.write_all(&h.encode()).unwrap();
    let (e, msg) = read_error(&mut s);
    let mut rest = [0u8; 64];
    let closed = matches!(s.read(&mut rest), Ok(0) | Err(_));
    (e, msg, closed)
}

/// Reads a frame and the message that follows it: an `Error`'s header and its text.
fn read_error(s: &mut TcpStream) -> (Header, String) {
    let e = read_header(s);
    let mut msg = vec![0u8; e.len as usize];
    s.read_exact(&mut msg).unwrap();
    (e, String::from_utf8_lossy(&msg).into_owned())
}

#[test]
fn a_frame_longer_than_the_agreed_limit_is_refused_and_the_target_keeps_serving() {
    let target = backend(|c| c.slice_size = 64 << 10);
    let dev = DevMem::new(1 << 20);
    dev.register(&target, 1, Access::REMOTE_READ_WRITE);
    let mut host = vec![0u8; 1 << 20];
    register(&target, 2, &mut host, Access::REMOTE_READ_WRITE);
    // The limit is announced in the handshake.
    let crate::endpoint::Endpoint { addr, instance, .. } =
        decode_endpoint(&target.endpoint()).unwrap();
    let mut s = TcpStream::connect(addr).unwrap();
    let (terms, _) = crate::handshake::handshake(&mut s, "raw", instance, None).unwrap();
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
    let w = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, 1 << 20);
    run(&init, peer, &[w]).expect("an honest write");
    assert!(dev.read() == data);
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
        let (r, _) = read_error(&mut s);
        assert_eq!((r.kind, r.id), (Kind::Error, id), "case {i}");
        assert_eq!(ErrorKind::from_code(r.code), kind, "case {i}");
        mem.assert_untouched(0, &format!("case {i}"));
        ro.assert_untouched(0, &format!("case {i}"));
    }
    // A READ with one entry outside is refused whole too: no data, one error.
    s.write_all(&sg_frame(Kind::ReadV, 7, 1, &[(0, 8), (4095, 2)], 10))
        .unwrap();
    let (r, _) = read_error(&mut s);
    assert_eq!((r.kind, r.id), (Kind::Error, 7));
    assert_eq!(ErrorKind::from_code(r.code), ErrorKind::OutOfBounds);
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

#[test]
fn a_peer_that_floods_requests_and_reads_nothing_is_bounded_and_cut_off() {
    // Long enough that the held pins are seen before the target gives up on the peer.
    let target = backend(|c| c.io_timeout = Duration::from_secs(2));
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
    let pins = || {
        target
            .shared()
            .regions
            .get(RegionId(2))
            .map_or(0, |r| r.pins())
    };
    eventually("the flood holding pins", Duration::from_secs(5), || {
        pins() >= crate::target::respond::MAX_QUEUED - 1
    });
    std::thread::sleep(Duration::from_millis(100));
    let held = pins();
    assert!(
        held <= crate::target::respond::MAX_QUEUED + 2,
        "{held} pins: one per queued response, the one being sent, the one waiting for room"
    );
    let start = Instant::now();
    target
        .deregister(
            RegionId(2),
            te_core::Deadline::after(Duration::from_secs(10)),
        )
        .expect("the flood's pins are released");
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "released after {:?}",
        start.elapsed()
    );
    let high = crate::target::respond::HIGH_WATER.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        high,
        crate::target::respond::MAX_QUEUED,
        "the queue filled to its bound"
    );
    let _s = writer.join().unwrap();
    // The target still serves an honest peer.
    let init = backend(|_| {});
    let mut dst = vec![0u8; 4096];
    register(&init, 1, &mut dst, Access::LOCAL);
    let peer = init.connect(&segment(&target), soon()).unwrap();
    let r = TransferRequest::read(RegionId(1), 0, RegionId(1), 0, 4096);
    run(&init, peer, &[r]).expect("an honest read");
}

#[test]
fn a_request_stalled_halfway_is_cut_off_after_io_timeout() {
    // Idle connections may stay (no idle_timeout), but a request that stops part way
    // may not: after its header, nothing of it arrives for io_timeout.
    let target = backend(|c| c.io_timeout = Duration::from_millis(300));
    let mut mem = vec![0u8; 4096];
    register(&target, 1, &mut mem, Access::REMOTE_READ_WRITE);
    let cases: [(&str, Vec<u8>); 5] = [
        (
            "a scatter-gather header without its entries",
            sg_frame_counted(Kind::WriteV, 1, 1, &[], 1, 16),
        ),
        (
            "a scatter-gather write without its payload",
            sg_frame(Kind::WriteV, 1, 1, &[(0, 16)], 16),
        ),
        (
            "a refused write without its payload",
            Header::request(Kind::Write, 1, 77, 0, 64 << 10)
                .encode()
                .to_vec(),
        ),
        ("a refused write whose payload stops after 100 bytes", {
            let mut b = Header::request(Kind::Write, 1, 77, 0, 64 << 10)
                .encode()
                .to_vec();
            b.extend_from_slice(&[0xee; 100]);
            b
        }),
        ("a write whose payload stops after 100 bytes", {
            let mut b = Header::request(Kind::Write, 1, 1, 0, 4096)
                .encode()
                .to_vec();
            b.extend_from_slice(&[0xee; 100]);
            b
        }),
    ];
    for (what, bytes) in cases {
        let mut s = raw(&target);
        s.write_all(&bytes).unwrap();
        let start = Instant::now();
        let (_, closed) = read_until_closed(&mut s);
        assert!(closed, "{what}: the connection is still open after 5 s");
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{what}: closed after {:?}",
            start.elapsed()
        );
    }
    // An idle connection stays, and the target still serves.
    let mut idle = raw(&target);
    std::thread::sleep(Duration::from_millis(800));
    idle.write_all(&Header::request(Kind::Read, 3, 1, 0, 16).encode())
        .unwrap();
    let r = read_header(&mut idle);
    assert_eq!((r.kind, r.id, r.len), (Kind::ReadData, 3, 16));
    target.deregister(RegionId(1), soon()).unwrap();
}

/// Counts the warnings (and errors) about region [`LOGGED_REGION`], wherever they are
/// logged from: the process's subscriber, set once.
fn warnings_about_logged_region() -> &'static std::sync::atomic::AtomicUsize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static COUNT: AtomicUsize = AtomicUsize::new(0);
    static SET: std::sync::Once = std::sync::Once::new();
    struct Count;
    struct Region(bool);
    impl tracing::field::Visit for Region {
        fn record_u64(&mut self, f: &tracing::field::Field, v: u64) {
            self.0 |= f.name() == "region" && v == LOGGED_REGION;
        }
        fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
    }
    impl tracing::Subscriber for Count {
        fn enabled(&self, m: &tracing::Metadata<'_>) -> bool {
            *m.level() <= tracing::Level::WARN
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, e: &tracing::Event<'_>) {
            let mut r = Region(false);
            e.record(&mut r);
            if r.0 {
                COUNT.fetch_add(1, Ordering::Relaxed);
            }
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }
    SET.call_once(|| {
        let _ = tracing::subscriber::set_global_default(Count);
    });
    &COUNT
}

/// A region id no test registers, named by the requests whose log lines are counted.
const LOGGED_REGION: u64 = 0x7e57_10c0;

#[test]
fn a_flood_of_refused_requests_is_answered_each_time_but_logged_once() {
    use std::sync::atomic::Ordering;
    let count = warnings_about_logged_region();
    let target = backend(|_| {});
    let mut s = raw(&target);
    const N: u64 = 2000;
    let mut frames = Vec::new();
    for id in 1..=N {
        frames.extend_from_slice(&Header::request(Kind::Read, id, LOGGED_REGION, 0, 64).encode());
    }
    let writer = {
        let mut s = s.try_clone().unwrap();
        std::thread::spawn(move || s.write_all(&frames).unwrap())
    };
    for id in 1..=N {
        let (h, msg) = read_error(&mut s);
        assert_eq!((h.kind, h.id), (Kind::Error, id));
        assert_eq!(
            ErrorKind::from_code(h.code),
            ErrorKind::NotRegistered,
            "{msg}"
        );
    }
    writer.join().unwrap();
    drop(s);
    std::thread::sleep(Duration::from_millis(200));
    let logged = count.load(Ordering::Relaxed);
    assert!(
        (1..=2).contains(&logged),
        "{N} refused requests of one peer logged {logged} warnings"
    );
}
