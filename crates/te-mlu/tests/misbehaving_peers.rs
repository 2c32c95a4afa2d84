//! What a peer that misbehaves, or any process of this user, can do to an mlu backend
//! through what the backend hands it (its region table, its endpoint, its table
//! server), and what it must not achieve: crash or starve the backend's process, hold
//! up a caller past its deadline, or make it copy anywhere a registered region does not
//! allow.
//!
//! The peer is played by the test itself, with forged endpoints and region
//! tables (mirrors of te-mlu's private layouts below). Tests whose failure would crash
//! or starve their process run their body in a child: this binary again, with
//! `TE_MLU_TEST_ROLE` naming the test, running only that test.

mod common;

use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::process::{Command, Stdio};
use std::sync::Once;
use std::time::{Duration, Instant};

use common::*;
use serde::{Deserialize, Serialize};
use te_core::device::{DeviceCopy, DeviceRuntime};
use te_core::{
    Access, BackendContext, Completion, Deadline, ErrorKind, MemoryDesc, MemoryKind, PeerId,
    RegionDesc, RegionId, SegmentDesc, TransferBackend, TransferRequest,
};
use te_mlu::{MluBackend, MluConfig};

fn setup() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| use_fake_cnrt(&[]));
}

/// Mirror of te-mlu's endpoint (same fields, same order, te's codec).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Endpoint {
    instance: u64,
    socket: String,
    host: String,
    buses: Vec<String>,
}
const ENDPOINT_MAGIC: &[u8; 6] = b"TEMLU\x05";

fn decode_endpoint(b: &[u8]) -> Endpoint {
    let rest = b
        .strip_prefix(ENDPOINT_MAGIC.as_slice())
        .expect("mlu endpoint");
    te_core::codec::decode(rest, "endpoint").expect("the endpoint mirror matches")
}

fn encode_endpoint(e: &Endpoint) -> Vec<u8> {
    let mut v = ENDPOINT_MAGIC.to_vec();
    v.extend_from_slice(&te_core::codec::encode(e));
    v
}

/// te-mlu's region table layout: a header {magic, instance, changes u32, pad u32},
/// then 8192 slots of {region u64, state u32, inflight u32, waiters u32, access u32,
/// addr, offset, len, handle, generation}.
const MAGIC: u64 = 0x7465_6d6c_7574_6235;
const HEADER: usize = 24;
const SLOT: usize = 64;
const SLOTS: usize = 8192;
const TABLE_SIZE: usize = HEADER + SLOTS * SLOT;

fn socket_name(instance: u64) -> String {
    format!("te-mlu-{instance:016x}")
}

/// A memfd laid out as instance `instance`'s region table, with `region` live in
/// `slot` at `addr` for `len` bytes, readable and writable; sealed against resizing
/// as te-mlu's own tables are, or not.
fn forged_table(
    instance: u64,
    slot: u32,
    region: u64,
    addr: u64,
    len: u64,
    sealed: bool,
) -> OwnedFd {
    let fd = if sealed {
        te_core::local::sealed_memfd(c"forged-table", TABLE_SIZE).unwrap()
    } else {
        // SAFETY: a valid name and flags; the result is checked.
        let raw = unsafe { libc::memfd_create(c"forged-table".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0, "memfd_create");
        // SAFETY: a fresh descriptor nobody else owns.
        unsafe { std::os::fd::FromRawFd::from_raw_fd(raw) }
    };
    let mut img = vec![0u8; TABLE_SIZE];
    img[0..8].copy_from_slice(&MAGIC.to_ne_bytes());
    img[8..16].copy_from_slice(&instance.to_ne_bytes());
    let mut f = std::fs::File::from(fd.try_clone().unwrap());
    std::io::Write::write_all(&mut f, &img).unwrap();
    forge_slot(&fd, slot, region, addr, len, None);
    fd
}

/// Writes `region` into `slot` of the forged table `fd`: live, readable and writable,
/// at `addr` for `len` bytes, and for MLU memory, reached through `ipc` (its handle,
/// generation and offset in the allocation).
fn forge_slot(fd: &OwnedFd, slot: u32, region: u64, addr: u64, len: u64, ipc: Option<Ipc>) {
    let mut s = [0u8; SLOT];
    s[0..8].copy_from_slice(&region.to_ne_bytes());
    s[8..12].copy_from_slice(&2u32.to_ne_bytes()); // live
    s[20..24].copy_from_slice(&3u32.to_ne_bytes()); // read | write
    s[24..32].copy_from_slice(&addr.to_ne_bytes());
    s[40..48].copy_from_slice(&len.to_ne_bytes());
    if let Some(ipc) = ipc {
        s[32..40].copy_from_slice(&ipc.offset.to_ne_bytes());
        s[48..56].copy_from_slice(&ipc.handle);
        s[56..64].copy_from_slice(&ipc.generation.to_ne_bytes());
    }
    let f = std::fs::File::from(fd.try_clone().unwrap());
    std::os::unix::fs::FileExt::write_all_at(&f, &s, (HEADER + slot as usize * SLOT) as u64)
        .unwrap();
}

/// Serves `fd` as instance `instance`'s table on the socket `name` to the first `n`
/// peers that ask.
fn serve_table(name: &str, instance: u64, fd: OwnedFd, n: usize) -> std::thread::JoinHandle<()> {
    let l = te_core::local::listen(name).expect("listen");
    std::thread::spawn(move || {
        for _ in 0..n {
            let Ok((s, _)) = l.accept() else { return };
            let _ = te_core::local::send_with_fd(&s, &instance.to_le_bytes(), Some(fd.as_fd()));
        }
    })
}

fn backend(epoch: u64) -> MluBackend {
    let ctx = BackendContext {
        epoch,
        ..BackendContext::default()
    };
    MluBackend::new(MluConfig::default(), &ctx).expect("the fake libcnrt loads")
}

fn seg(endpoint: Vec<u8>, regions: Vec<RegionDesc>) -> SegmentDesc {
    SegmentDesc {
        engine: "peer".into(),
        epoch: 1,
        address: String::new(),
        backend: te_mlu::NAME.into(),
        endpoint,
        regions,
        layouts: Vec::new(),
    }
}

fn soon() -> Deadline {
    Deadline::after(Duration::from_secs(10))
}

/// `a`'s endpoint as an instance of another process on this host would send it: a new
/// instance number, with the socket named after it.
fn other_process(a: &MluBackend) -> Endpoint {
    claiming(a, rand::random::<u64>() | 1)
}

/// `a`'s endpoint with instance number `instance`, and the socket named after it.
fn claiming(a: &MluBackend, instance: u64) -> Endpoint {
    let mut ep = decode_endpoint(&a.endpoint());
    ep.instance = instance;
    ep.socket = socket_name(instance);
    ep
}

/// Region key bytes: table slot `slot` and, for MLU memory, the IPC handle of its
/// allocation, the export's generation and the offset there.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Key {
    slot: u32,
    ipc: Option<Ipc>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Ipc {
    handle: [u8; 8],
    generation: u64,
    offset: u64,
}

fn region(id: u64, addr: u64, len: usize, ordinal: u32, key: Vec<u8>) -> RegionDesc {
    RegionDesc {
        id: RegionId(id),
        name: "kv".into(),
        addr,
        len: len as u64,
        kind: mlu(ordinal),
        access: Access::REMOTE_READ_WRITE,
        key,
    }
}

fn mlu_mem(addr: u64, len: usize, ordinal: u32, access: Access) -> MemoryDesc {
    MemoryDesc {
        name: "m".into(),
        addr,
        len: len as u64,
        kind: mlu(ordinal),
        access,
    }
}

/// MLU memory holding `data`.
fn device_with(rt: &te_mlu::MluRuntime, ordinal: u32, data: &[u8]) -> u64 {
    let dev = rt.alloc(ordinal, data.len()).unwrap();
    // SAFETY: `data` lives across the synchronous copy, which stays inside `dev`.
    unsafe {
        (rt as &dyn DeviceRuntime).copy_sync(DeviceCopy::ToDevice {
            ordinal,
            device: dev,
            host: data.as_ptr(),
            len: data.len(),
        })
    }
    .unwrap();
    dev
}

/// The `len` bytes at `dev`.
fn device_bytes(rt: &te_mlu::MluRuntime, ordinal: u32, dev: u64, len: usize) -> Vec<u8> {
    let mut back = vec![0u8; len];
    // SAFETY: `back` lives across the synchronous copy, which stays inside it.
    unsafe {
        (rt as &dyn DeviceRuntime).copy_sync(DeviceCopy::ToHost {
            ordinal,
            device: dev,
            host: back.as_mut_ptr(),
            len,
        })
    }
    .unwrap();
    back
}

/// Submits a WRITE of `len` bytes from local region `local` to the peer's region
/// `remote`; returns the submit's result and the completion's (within 10 s).
fn write(
    b: &MluBackend,
    peer: PeerId,
    local: u64,
    remote: u64,
    len: usize,
) -> (te_core::Result<()>, Option<te_core::Result<()>>) {
    let req = TransferRequest::write(RegionId(local), 0, RegionId(remote), 0, len as u64);
    transfer(b, peer, req)
}

/// Submits `req` alone; returns the submit's result and the completion's (within 10 s).
fn transfer(
    b: &MluBackend,
    peer: PeerId,
    req: TransferRequest,
) -> (te_core::Result<()>, Option<te_core::Result<()>>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let done = Completion::new(Duration::from_secs(10), move |r, _| {
        let _ = tx.send(r.map(|_| ()));
    });
    let r = b.submit(peer, &[req], done);
    let c = if r.is_ok() {
        rx.recv_timeout(Duration::from_secs(10)).ok()
    } else {
        None
    };
    (r, c)
}

/// Runs `body` as test `test` in a child process (at most 60 s) and returns the
/// child's status and output; in that child, runs `body` and returns `None`.
fn in_child(test: &str, body: impl FnOnce()) -> Option<(std::process::ExitStatus, String)> {
    setup();
    if std::env::var("TE_MLU_TEST_ROLE").as_deref() == Ok(test) {
        body();
        return None;
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env("TE_MLU_TEST_ROLE", test)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the child");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut out = String::new();
    let _ = child.stdout.take().unwrap().read_to_string(&mut out);
    let _ = child.stderr.take().unwrap().read_to_string(&mut out);
    Some((status, out))
}

fn host_mem(buf: &mut [u8], access: Access) -> MemoryDesc {
    MemoryDesc {
        name: "h".into(),
        addr: buf.as_mut_ptr() as u64,
        len: buf.len() as u64,
        kind: MemoryKind::Host,
        access,
    }
}

#[test]
fn a_process_that_shrinks_our_region_table_cannot_crash_us() {
    const NAME: &str = "a_process_that_shrinks_our_region_table_cannot_crash_us";
    let child = in_child(NAME, || {
        let epoch = rand::random::<u64>() | 1;
        let b = backend(epoch);
        // What any process of this user can do: ask the table server for the table,
        // as connect does, and shrink it.
        let s = te_core::local::connect(&socket_name(epoch), Duration::from_secs(5)).unwrap();
        let mut buf = [0u8; 8];
        let fd = te_core::local::recv_with_fd(&s, &mut buf)
            .unwrap()
            .expect("the table's descriptor");
        // SAFETY: a plain call on a descriptor we own.
        let r = unsafe { libc::ftruncate(fd.as_raw_fd(), 0) };
        println!("ftruncate of the received table: {r}");
        let mut mem = vec![0u8; 4096];
        let res = b.register(RegionId(1), &host_mem(&mut mem, Access::LOCAL));
        println!("SURVIVED register: {:?}", res.map(|_| ()));
    });
    let Some((status, out)) = child else { return };
    assert!(
        status.success() && out.contains("SURVIVED"),
        "the backend's process died after another process shrank the region table it was handed: {status:?}\n{out}"
    );
}

#[test]
fn a_peer_table_is_accepted_only_if_it_can_never_shrink() {
    setup();
    let a = backend(rand::random::<u64>() | 1);
    for sealed in [false, true] {
        let ep = other_process(&a);
        // Unsealed, its owner could shrink it under our mapping after we connected.
        let table = forged_table(ep.instance, 0, 77, 0x1000, 4096, sealed);
        let _srv = serve_table(&ep.socket, ep.instance, table, 1);
        let r = a.connect(&seg(encode_endpoint(&ep), Vec::new()), soon());
        if sealed {
            r.expect("a sealed table of te-mlu's size is accepted");
        } else {
            let e = r.expect_err("a region table without F_SEAL_SHRINK was accepted");
            assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
            assert!(e.to_string().contains("F_SEAL_SHRINK"), "{e}");
        }
    }
}

#[test]
fn connect_returns_by_its_deadline_when_the_peers_table_server_is_stuck() {
    setup();
    let a = backend(rand::random::<u64>() | 1);
    let ep = other_process(&a);
    // A table server that never answers (its process stopped, its thread stuck): the
    // kernel completes the connection in the backlog, and nothing more comes.
    let _stuck = te_core::local::listen(&ep.socket).unwrap();
    let start = Instant::now();
    let r = a.connect(
        &seg(encode_endpoint(&ep), Vec::new()),
        Deadline::after(Duration::from_millis(300)),
    );
    let took = start.elapsed();
    assert!(
        took < Duration::from_millis(1500),
        "connect with 300 ms left returned after {took:?}: {:?}",
        r.map(|_| ())
    );
    assert_eq!(r.unwrap_err().kind(), ErrorKind::Timeout);
}

/// CPU time of the whole process (read without a descriptor, unlike /proc).
fn process_cpu() -> Duration {
    // SAFETY: an all-zero timespec is a valid out-parameter.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out-parameter.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[test]
fn the_table_server_does_not_spin_when_out_of_descriptors() {
    const NAME: &str = "the_table_server_does_not_spin_when_out_of_descriptors";
    let child = in_child(NAME, || {
        let epoch = rand::random::<u64>() | 1;
        let _b = backend(epoch);
        // A client socket, made while descriptors remain.
        // SAFETY: a plain call.
        let c = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        assert!(c >= 0);
        // Lower the soft limit, then use up what is left of it.
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: a valid out-parameter.
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
        let low = libc::rlimit {
            rlim_cur: 512,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: a valid in-parameter.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) };
        let mut hog = Vec::new();
        for _ in 0..1024 {
            // SAFETY: a plain call.
            let d = unsafe { libc::dup(c) };
            if d < 0 {
                break;
            }
            hog.push(d);
        }
        // Connecting needs no new descriptor here; the server's accept needs one.
        let name = socket_name(epoch);
        // SAFETY: an all-zero sockaddr_un is valid; filled with an abstract name below.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as _;
        for (i, b) in name.bytes().enumerate() {
            addr.sun_path[i + 1] = b as _;
        }
        let alen = (std::mem::size_of::<libc::sa_family_t>() + 1 + name.len()) as u32;
        // SAFETY: a valid address of the given length.
        let r = unsafe { libc::connect(c, (&addr as *const libc::sockaddr_un).cast(), alen) };
        assert_eq!(r, 0, "connect: {}", std::io::Error::last_os_error());
        std::thread::sleep(Duration::from_millis(200));
        let t0 = process_cpu();
        std::thread::sleep(Duration::from_millis(1000));
        let t1 = process_cpu();
        for d in hog {
            // SAFETY: our own descriptors.
            unsafe { libc::close(d) };
        }
        // SAFETY: a valid in-parameter.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
        // SAFETY: our own descriptor.
        unsafe { libc::close(c) };
        println!("TABLE_CPU_MS {}", (t1 - t0).as_millis());
    });
    let Some((status, out)) = child else { return };
    let ms: u64 = out
        .lines()
        .find_map(|l| l.find("TABLE_CPU_MS ").map(|i| &l[i + 13..]))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("the child said nothing useful: {status:?}\n{out}"));
    assert!(
        ms < 100,
        "out of descriptors, with one peer waiting to be accepted, the process (idle otherwise) burnt {ms} ms of CPU in 1 s: the mlu table server spins on accept\n{out}"
    );
}

#[test]
fn a_peer_naming_our_unregistered_memory_cannot_make_us_write_into_it() {
    setup();
    let rt = te_mlu::runtime().unwrap();
    let a = backend(rand::random::<u64>() | 1);
    let len = 4096usize;
    let src = device_with(&rt, 0, &te_core::testkit::pattern(len, 5));
    let victim = rt.alloc(0, len).unwrap(); // the application's; never registered
    a.register(RegionId(10), &mlu_mem(src, len, 0, Access::LOCAL))
        .unwrap();
    let key = te_core::codec::encode(&Key { slot: 0, ipc: None });
    // As an instance of another process, with a table that says the victim's address
    // is its region; and as this very instance, whose table says nothing of it.
    let foreign = other_process(&a);
    let _srv = serve_table(
        &foreign.socket,
        foreign.instance,
        forged_table(foreign.instance, 0, 77, victim, len as u64, true),
        1,
    );
    let ours = decode_endpoint(&a.endpoint());
    let mut results = Vec::new();
    for ep in [foreign, ours] {
        let desc = seg(
            encode_endpoint(&ep),
            vec![region(77, victim, len, 0, key.clone())],
        );
        let peer = a.connect(&desc, soon()).expect("connect");
        results.push(write(&a, peer, 10, 77, len));
    }
    let changed = device_bytes(&rt, 0, victim, len)
        .iter()
        .filter(|&&b| b != 0)
        .count();
    drop(a);
    rt.free(0, src).unwrap();
    rt.free(0, victim).unwrap();
    assert_eq!(
        changed, 0,
        "a peer made us copy into our own unregistered MLU memory at {victim:#x}: {changed} of {len} bytes changed ({results:?})"
    );
    assert!(results.iter().all(|(r, _)| r.is_err()), "{results:?}");
}

#[test]
fn a_descriptor_carrying_another_allocations_handle_cannot_make_us_write_there() {
    setup();
    let rt = te_mlu::runtime().unwrap();
    let mut always = MluConfig::default();
    always.ipc = te_mlu::IpcMode::Always;
    let ctx = BackendContext {
        epoch: rand::random::<u64>() | 1,
        ..BackendContext::default()
    };
    let a = MluBackend::new(always, &ctx).unwrap();
    let b = backend(rand::random::<u64>() | 1);
    let len = 4096usize;
    let src = device_with(&rt, 0, &te_core::testkit::pattern(len, 3));
    let t = rt.alloc(1, len).unwrap(); // B's region
    let victim = rt.alloc(1, len).unwrap(); // B's too, registered once, then no more
    a.register(RegionId(10), &mlu_mem(src, len, 0, Access::LOCAL))
        .unwrap();
    let key = b
        .register(RegionId(1), &mlu_mem(t, len, 1, Access::REMOTE_READ_WRITE))
        .unwrap();
    let old = b
        .register(
            RegionId(2),
            &mlu_mem(victim, len, 1, Access::REMOTE_READ_WRITE),
        )
        .unwrap();
    b.deregister(RegionId(2), soon()).unwrap();
    // Region 1's descriptor, exact in all but the handle: the victim allocation's.
    let mut forged: Key = te_core::codec::decode(&key, "key").unwrap();
    let theirs: Key = te_core::codec::decode(&old, "key").unwrap();
    let (Some(ours), Some(victims)) = (forged.ipc.as_mut(), theirs.ipc) else {
        panic!("MLU regions' keys carry IPC handles")
    };
    ours.handle = victims.handle;
    let peer = a
        .connect(
            &seg(
                b.endpoint(),
                vec![region(1, t, len, 1, te_core::codec::encode(&forged))],
            ),
            soon(),
        )
        .unwrap();
    let (r, done) = write(&a, peer, 10, 1, len);
    let changed = device_bytes(&rt, 1, victim, len)
        .iter()
        .filter(|&&b| b != 0)
        .count();
    drop((a, b));
    for (o, d) in [(0, src), (1, t), (1, victim)] {
        rt.free(o, d).unwrap();
    }
    assert_eq!(
        changed, 0,
        "a descriptor naming another allocation's IPC handle made us write into memory its owner no longer registers: {changed} of {len} bytes changed (submit {r:?}, completion {done:?})"
    );
    let e = r.err().or(done.and_then(|d| d.err())).expect("refused");
    assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
}

#[test]
fn a_peer_claiming_another_peers_instance_does_not_take_over_its_batches() {
    setup();
    let rt = te_mlu::runtime().unwrap();
    let a = backend(rand::random::<u64>() | 1);
    let x = rand::random::<u64>() | 1;
    let b = backend(x);
    let c = backend(rand::random::<u64>() | 1);
    let len = 4096usize;
    let data = te_core::testkit::pattern(len, 9);
    let src = device_with(&rt, 0, &data);
    let t = rt.alloc(1, len).unwrap(); // B's region
    let evil = rt.alloc(1, len).unwrap(); // the impostor's memory
    a.register(RegionId(10), &mlu_mem(src, len, 0, Access::LOCAL))
        .unwrap();
    let bkey = b
        .register(RegionId(1), &mlu_mem(t, len, 1, Access::REMOTE_READ_WRITE))
        .unwrap();
    let pb = a
        .connect(&seg(b.endpoint(), vec![region(1, t, len, 1, bkey)]), soon())
        .unwrap();
    // The impostor: its own allocation (a real handle, taken from C's key), a table of
    // its own, and B's instance number; with a socket of its own, or with B's and
    // another endpoint.
    let ckey = c
        .register(
            RegionId(2),
            &mlu_mem(evil, len, 1, Access::REMOTE_READ_WRITE),
        )
        .unwrap();
    let k: Key = te_core::codec::decode(&ckey, "key").unwrap();
    let mut own_socket = claiming(&a, x);
    own_socket.socket = socket_name(rand::random::<u64>() | 1);
    let _srv = serve_table(
        &own_socket.socket,
        x,
        forged_table(x, k.slot, 1, evil, len as u64, true),
        1,
    );
    let mut other_endpoint = claiming(&a, x);
    other_endpoint.buses.push("0000:ff:00.0".into());
    for ep in [own_socket, other_endpoint] {
        let desc = seg(
            encode_endpoint(&ep),
            vec![region(1, evil, len, 1, ckey.clone())],
        );
        let e = a
            .connect(&desc, soon())
            .expect_err("an impostor of a connected instance was accepted");
        assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
    }
    let (r, done) = write(&a, pb, 10, 1, len);
    let (in_b, in_evil) = (
        device_bytes(&rt, 1, t, len) == data,
        device_bytes(&rt, 1, evil, len) == data,
    );
    drop((a, b, c));
    for (o, d) in [(0, src), (1, t), (1, evil)] {
        rt.free(o, d).unwrap();
    }
    assert!(
        in_b && !in_evil,
        "a WRITE to peer B ({pb:?}) did not land in B's memory alone (in B: {in_b}, in the impostor's: {in_evil}; submit {r:?}, completion {done:?})"
    );
}

/// This process's mappings of the fake libcnrt's allocations.
fn fake_mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("/memfd:te-fake-cnrt-"))
        .count()
}

#[test]
fn a_peers_deregistered_allocation_is_unmapped_once_a_batch_finds_it_gone() {
    const NAME: &str = "a_peers_deregistered_allocation_is_unmapped_once_a_batch_finds_it_gone";
    // A child of its own: it counts this process's mappings.
    let child = in_child(NAME, || {
        let rt = te_mlu::runtime().unwrap();
        let mut always = MluConfig::default();
        always.ipc = te_mlu::IpcMode::Always;
        let ctx = BackendContext {
            epoch: rand::random::<u64>() | 1,
            ..BackendContext::default()
        };
        let a = MluBackend::new(always, &ctx).unwrap();
        let b = backend(rand::random::<u64>() | 1);
        let len = 1usize << 20;
        let src = rt.alloc(0, len).unwrap();
        let t = rt.alloc(1, len).unwrap();
        a.register(RegionId(10), &mlu_mem(src, len, 0, Access::LOCAL))
            .unwrap();
        let key = b
            .register(RegionId(1), &mlu_mem(t, len, 1, Access::REMOTE_READ_WRITE))
            .unwrap();
        let before = fake_mappings();
        let peer = a
            .connect(&seg(b.endpoint(), vec![region(1, t, len, 1, key)]), soon())
            .unwrap();
        let imported = fake_mappings();
        // The peer deregisters the region and frees its memory; a batch finds it gone.
        b.deregister(RegionId(1), soon()).unwrap();
        rt.free(1, t).unwrap();
        let (r, _) = write(&a, peer, 10, 1, len);
        println!(
            "MAPPINGS before={before} imported={imported} after={} submit={r:?}",
            fake_mappings()
        );
    });
    let Some((status, out)) = child else { return };
    let line = child_line(&status, &out, "MAPPINGS ");
    let n = |k: &str| field(line, k);
    assert!(n("imported=") > n("before="), "nothing was mapped: {line}");
    // The owner's free takes its own mapping away; ours must go too.
    assert!(
        n("after=") < n("before="),
        "the peer's freed allocation is still mapped here after a batch found its region deregistered: {line}"
    );
}

#[test]
fn a_peers_deregistered_allocation_is_unmapped_without_a_batch_or_a_refresh() {
    const NAME: &str = "a_peers_deregistered_allocation_is_unmapped_without_a_batch_or_a_refresh";
    // A child of its own: it counts this process's mappings.
    let child = in_child(NAME, || {
        let rt = te_mlu::runtime().unwrap();
        let a = mapping_backend();
        let b = backend(rand::random::<u64>() | 1);
        let len = 1usize << 20;
        let t = rt.alloc(1, len).unwrap();
        let key = b
            .register(RegionId(1), &mlu_mem(t, len, 1, Access::REMOTE_READ_WRITE))
            .unwrap();
        let before = fake_mappings();
        let _peer = a
            .connect(&seg(b.endpoint(), vec![region(1, t, len, 1, key)]), soon())
            .unwrap();
        let imported = fake_mappings();
        // Idle, whatever watches the peer sleeps: once it has gone to sleep (its count
        // still for 100 ms; a thread just started may switch once on its way there).
        let mut switches = watcher_switches();
        for _ in 0..50 {
            std::thread::sleep(Duration::from_millis(100));
            let now = watcher_switches();
            if now == switches {
                break;
            }
            switches = now;
        }
        std::thread::sleep(Duration::from_millis(500));
        let idle_wakeups = watcher_switches() - switches;
        // The owner deregisters the region and frees its memory; A does nothing.
        b.deregister(RegionId(1), soon()).unwrap();
        rt.free(1, t).unwrap();
        let start = Instant::now();
        while fake_mappings() >= before && start.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        println!(
            "MAPPINGS before={before} imported={imported} after={} ms={} idle_wakeups={idle_wakeups}",
            fake_mappings(),
            start.elapsed().as_millis()
        );
        // Whatever watched the peer goes with it.
        let watching = watchers();
        drop(a);
        let start = Instant::now();
        while watchers() > 0 && start.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        println!("WATCHERS connected={watching} dropped={}", watchers());
    });
    let Some((status, out)) = child else { return };
    let line = child_line(&status, &out, "MAPPINGS ");
    let n = |k: &str| field(line, k);
    assert!(n("imported=") > n("before="), "nothing was mapped: {line}");
    // The owner's free takes its own mapping away; ours must go too, by itself.
    assert!(
        n("after=") < n("before="),
        "the peer's freed allocation is still mapped here 5 s after its owner deregistered it, though no batch or refresh came: {line}"
    );
    assert_eq!(
        n("idle_wakeups="),
        0,
        "the thread watching an idle peer woke up: {line}"
    );
    let line = child_line(&status, &out, "WATCHERS ");
    let n = |k: &str| field(line, k);
    assert_eq!(
        n("dropped="),
        0,
        "a peer's watcher outlived its backend: {line}"
    );
}

/// The child's line from `tag` on; a failure showing all it printed if it has none.
fn child_line<'a>(status: &impl std::fmt::Debug, out: &'a str, tag: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.find(tag).map(|i| &l[i..]))
        .unwrap_or_else(|| panic!("the child printed no {tag:?} line: {status:?}\n{out}"))
}

/// The number after `key` (as `key=`) among `line`'s words.
fn field(line: &str, key: &str) -> usize {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no number after {key:?} in: {line}"))
}

/// This process's threads named `te-mlu-watch`.
fn watcher_tasks() -> Vec<std::path::PathBuf> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| t.ok().map(|t| t.path()))
        .filter(|t| {
            std::fs::read_to_string(t.join("comm")).is_ok_and(|c| c.trim() == "te-mlu-watch")
        })
        .collect()
}

/// How many threads watch peers in this process.
fn watchers() -> usize {
    watcher_tasks().len()
}

/// The context switches of this process's watcher threads so far.
fn watcher_switches() -> u64 {
    watcher_tasks()
        .iter()
        .filter_map(|t| std::fs::read_to_string(t.join("status")).ok())
        .flat_map(|s| {
            s.lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// A backend that maps its peers' IPC handles even for peers in this process, as it
/// does for peers elsewhere.
/// Two initiators of owner `b`'s region 1 (`t`, `len` bytes on MLU 1, under `key`),
/// each with `local` (`len` bytes on MLU 0) registered as region 10: one reaches it
/// through its mapping, one directly (a peer in this process).
fn initiators(
    b: &MluBackend,
    (t, len, key): (u64, usize, &[u8]),
    local: u64,
) -> Vec<(MluBackend, PeerId)> {
    [mapping_backend(), backend(rand::random::<u64>() | 1)]
        .into_iter()
        .map(|a| {
            a.register(RegionId(10), &mlu_mem(local, len, 0, Access::LOCAL))
                .unwrap();
            let peer = a
                .connect(
                    &seg(b.endpoint(), vec![region(1, t, len, 1, key.to_vec())]),
                    soon(),
                )
                .unwrap();
            (a, peer)
        })
        .collect()
}

fn mapping_backend() -> MluBackend {
    let mut always = MluConfig::default();
    always.ipc = te_mlu::IpcMode::Always;
    let ctx = BackendContext {
        epoch: rand::random::<u64>() | 1,
        ..BackendContext::default()
    };
    MluBackend::new(always, &ctx).expect("the fake libcnrt loads")
}

/// Where the fake puts the next allocation or mapping after one of at most 1 MiB: its
/// size rounded up to 1 MiB, then a 1 MiB gap (fake_cnrt_memory.c).
const FAKE_SPAN: u64 = 2 << 20;

/// Whether `e` refuses the peer's region `region` as forged, naming the peer.
fn refused_as_forged(e: &te_core::Error, region: u64) -> bool {
    let m = e.to_string();
    e.kind() == ErrorKind::Protocol && m.contains(&format!("region {region}")) && m.contains("peer")
}

#[test]
fn a_forged_offset_past_the_mapped_allocation_reaches_nothing_after_it() {
    const NAME: &str = "a_forged_offset_past_the_mapped_allocation_reaches_nothing_after_it";
    // A child of its own: where the fake places an allocation depends on every
    // allocation the process made before it.
    let child = in_child(NAME, || {
        let rt = te_mlu::runtime().unwrap();
        let a = mapping_backend();
        let b = backend(rand::random::<u64>() | 1);
        let len = 4096usize;
        // The owner's allocation, which A maps; its handle and generation are real.
        let shared = rt.alloc(1, len).unwrap();
        let key = b
            .register(
                RegionId(1),
                &mlu_mem(shared, len, 1, Access::REMOTE_READ_WRITE),
            )
            .unwrap();
        let ipc = te_core::codec::decode::<Key>(&key, "key")
            .unwrap()
            .ipc
            .expect("an MLU region's key carries its IPC handle");
        let src = device_with(&rt, 0, &te_core::testkit::pattern(2 * len, 5));
        let dst = rt.alloc(0, 2 * len).unwrap();
        a.register(RegionId(10), &mlu_mem(src, 2 * len, 0, Access::LOCAL))
            .unwrap();
        a.register(RegionId(11), &mlu_mem(dst, 2 * len, 0, Access::LOCAL))
            .unwrap();
        // The owner, as a process of its own, says its region 77 lies one span past
        // the allocation's start (where the fake puts the next allocation after A's
        // mapping of it), and its region 78 is one byte longer than the allocation.
        // Its region 79 is the allocation, listed first so that A maps it once for
        // all three; once A has connected, its owner makes it longer than that.
        let ep = other_process(&a);
        let table = forged_table(ep.instance, 0, 0, 0, 0, true);
        let past = Ipc {
            offset: FAKE_SPAN,
            ..ipc
        };
        let over = Ipc { offset: 0, ..ipc };
        forge_slot(&table, 0, 77, shared + FAKE_SPAN, len as u64, Some(past));
        forge_slot(&table, 1, 78, shared, len as u64 + 1, Some(over));
        forge_slot(&table, 2, 79, shared, len as u64, Some(over));
        let table_now = table.try_clone().unwrap();
        let _srv = serve_table(&ep.socket, ep.instance, table, 1);
        let key = |slot, ipc| {
            te_core::codec::encode(&Key {
                slot,
                ipc: Some(ipc),
            })
        };
        let desc = seg(
            encode_endpoint(&ep),
            vec![
                region(79, shared, len, 1, key(2, over)),
                region(77, shared + FAKE_SPAN, len, 1, key(0, past)),
                region(78, shared, len + 1, 1, key(1, over)),
            ],
        );
        let connected = a.connect(&desc, soon());
        // This process's other memory, right after A's mapping of the allocation.
        let canary_bytes = te_core::testkit::pattern(len, 9);
        let canary = device_with(&rt, 1, &canary_bytes);
        assert_eq!(
            canary,
            shared + 2 * FAKE_SPAN,
            "the test's premise: the fake puts the canary right after A's mapping of the owner's allocation"
        );
        let peer = connected.expect("connect");
        let grown = FAKE_SPAN + len as u64;
        forge_slot(&table_now, 2, 79, shared, grown, Some(over));
        // Each as a WRITE from A's memory and a READ into it: (region, offset, length).
        let tries = [
            (77, 0, len as u64),
            (78, 0, len as u64 + 1),
            (79, FAKE_SPAN, len as u64),
        ];
        let mut results = Vec::new();
        for (remote, offset, n) in tries {
            for req in [
                TransferRequest::write(RegionId(10), 0, RegionId(remote), offset, n),
                TransferRequest::read(RegionId(11), 0, RegionId(remote), offset, n),
            ] {
                results.push((remote, transfer(&a, peer, req)));
            }
        }
        let canary_now = device_bytes(&rt, 1, canary, len);
        let read = device_bytes(&rt, 0, dst, 2 * len);
        drop((a, b));
        assert!(
            canary_now == canary_bytes,
            "a forged offset made us write past the end of the mapped allocation into other memory of this process: {} of {len} bytes changed ({results:?})",
            canary_now.iter().zip(&canary_bytes).filter(|(x, y)| x != y).count()
        );
        assert!(
            read.iter().all(|&b| b == 0),
            "a forged offset made us read from past the end of the mapped allocation: {} bytes came in ({results:?})",
            read.iter().filter(|&&b| b != 0).count()
        );
        for (region, (r, done)) in &results {
            let e = r
                .as_ref()
                .err()
                .or(done.as_ref().and_then(|d| d.as_ref().err()))
                .unwrap_or_else(|| {
                    panic!("a transfer with region {region} succeeded: {results:?}")
                });
            assert!(refused_as_forged(e, *region), "region {region}: {e}");
        }
        println!("CHECKED");
    });
    let Some((status, out)) = child else { return };
    assert!(
        status.success() && out.contains("CHECKED"),
        "{status:?}\n{out}"
    );
}

#[test]
fn a_forged_offset_that_overflows_an_address_is_refused_without_panic() {
    setup();
    let rt = te_mlu::runtime().unwrap();
    let a = mapping_backend();
    let b = backend(rand::random::<u64>() | 1);
    let len = 4096usize;
    let shared = rt.alloc(1, len).unwrap();
    let key = b
        .register(
            RegionId(1),
            &mlu_mem(shared, len, 1, Access::REMOTE_READ_WRITE),
        )
        .unwrap();
    let ipc = te_core::codec::decode::<Key>(&key, "key")
        .unwrap()
        .ipc
        .expect("an MLU region's key carries its IPC handle");
    let src = rt.alloc(0, len).unwrap();
    a.register(RegionId(10), &mlu_mem(src, len, 0, Access::LOCAL))
        .unwrap();
    // The mapping's address plus this offset runs past the end of the address space.
    let huge = Ipc {
        offset: u64::MAX - 16,
        ..ipc
    };
    let ep = other_process(&a);
    let table = forged_table(ep.instance, 0, 0, 0, 0, true);
    forge_slot(&table, 0, 77, shared, len as u64, Some(huge));
    let _srv = serve_table(&ep.socket, ep.instance, table, 1);
    let k = te_core::codec::encode(&Key {
        slot: 0,
        ipc: Some(huge),
    });
    let desc = seg(encode_endpoint(&ep), vec![region(77, shared, len, 1, k)]);
    let r = a
        .connect(&desc, soon())
        .map(|peer| write(&a, peer, 10, 77, len));
    drop((a, b));
    rt.free(0, src).unwrap();
    rt.free(1, shared).unwrap();
    let e = match &r {
        Err(e) | Ok((Err(e), _)) => e,
        Ok((Ok(()), done)) => {
            panic!("a region past the end of the address space was written to: {done:?}")
        }
    };
    assert!(refused_as_forged(e, 77), "{e}");
}

#[test]
fn a_request_whose_offsets_overflow_an_address_is_refused_without_panic() {
    setup();
    let rt = te_mlu::runtime().unwrap();
    let b = backend(rand::random::<u64>() | 1);
    let len = 4096usize;
    let t = rt.alloc(1, len).unwrap();
    let src = rt.alloc(0, len).unwrap();
    let key = b
        .register(RegionId(1), &mlu_mem(t, len, 1, Access::REMOTE_READ_WRITE))
        .unwrap();
    let mut results = Vec::new();
    // Reached through its mapping, and directly (a peer in this process).
    for (a, peer) in initiators(&b, (t, len, &key), src) {
        // The engine would refuse these; the backend must too, not panic or wrap.
        for (local, remote) in [(u64::MAX - 8, 0), (0, u64::MAX - 8)] {
            let req = TransferRequest::write(RegionId(10), local, RegionId(1), remote, 16);
            results.push(transfer(&a, peer, req));
        }
    }
    drop(b);
    rt.free(0, src).unwrap();
    rt.free(1, t).unwrap();
    for (r, done) in &results {
        let e = r.as_ref().err().unwrap_or_else(|| {
            panic!("a request whose offset runs past the end of the address space was submitted: {done:?}")
        });
        assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
    }
}

#[test]
fn a_descriptor_handed_to_connect_is_checked_as_a_decoded_one_is() {
    setup();
    let rt = te_mlu::runtime().unwrap();
    let a = backend(rand::random::<u64>() | 1);
    let b = backend(rand::random::<u64>() | 1);
    let len = 4096usize;
    let t = rt.alloc(1, len).unwrap();
    let key = b
        .register(RegionId(1), &mlu_mem(t, len, 1, Access::REMOTE_READ_WRITE))
        .unwrap();
    let twice = vec![
        region(1, t, len, 1, key.clone()),
        region(1, t, len, 1, key.clone()),
    ];
    let past_the_end = vec![region(1, u64::MAX - 100, len, 1, key)];
    let mut errors = Vec::new();
    for regions in [twice, past_the_end] {
        match a.connect(&seg(b.endpoint(), regions.clone()), soon()) {
            Ok(_) => errors.push(format!("accepted {regions:?}")),
            Err(e) if e.kind() == ErrorKind::Protocol && e.to_string().contains("region 1") => {}
            Err(e) => errors.push(format!("{e} for {regions:?}")),
        }
    }
    drop((a, b));
    rt.free(1, t).unwrap();
    assert!(errors.is_empty(), "{errors:#?}");
}

#[test]
fn a_request_past_the_end_of_its_local_region_is_refused_by_the_backend() {
    setup();
    let rt = te_mlu::runtime().unwrap();
    let b = backend(rand::random::<u64>() | 1);
    let len = 4096usize;
    let t = device_with(&rt, 1, &te_core::testkit::pattern(len, 7));
    let key = b
        .register(RegionId(1), &mlu_mem(t, len, 1, Access::REMOTE_READ_WRITE))
        .unwrap();
    // The local region is the first half of its allocation: the second half is the
    // application's, never registered, and must stay as it is.
    let local = rt.alloc(0, 2 * len).unwrap();
    let mut results = Vec::new();
    let mut changed = Vec::new();
    // Reached through its mapping, and directly (a peer in this process).
    for (a, peer) in initiators(&b, (t, len, &key), local) {
        // The engine would refuse these before the backend sees them; the backend
        // must refuse them too, reading or writing nothing.
        for (local_offset, n) in [(len as u64 - 100, 200), (len as u64, 1), (1, len as u64)] {
            for req in [
                TransferRequest::read(RegionId(10), local_offset, RegionId(1), 0, n),
                TransferRequest::write(RegionId(10), local_offset, RegionId(1), 0, n),
            ] {
                results.push((req, transfer(&a, peer, req)));
            }
        }
        changed.push(
            device_bytes(&rt, 0, local, 2 * len)
                .iter()
                .filter(|&&x| x != 0)
                .count(),
        );
    }
    let target_now = device_bytes(&rt, 1, t, len);
    drop(b);
    rt.free(0, local).unwrap();
    rt.free(1, t).unwrap();
    assert_eq!(
        changed,
        [0, 0],
        "a READ past the end of the local region wrote into memory the caller did not register ({results:?})"
    );
    assert_eq!(
        target_now,
        te_core::testkit::pattern(len, 7),
        "a WRITE past the end of the local region sent bytes from outside it ({results:?})"
    );
    for (req, (r, done)) in &results {
        let e = r.as_ref().err().unwrap_or_else(|| {
            panic!("{req:?} past the end of its local region was submitted: {done:?}")
        });
        assert_eq!(e.kind(), ErrorKind::OutOfBounds, "{e}");
        let m = e.to_string();
        assert!(
            m.contains("local region 10") && m.contains(&format!("of {len} bytes")),
            "the refusal names neither the region nor its length: {m}"
        );
    }
}
