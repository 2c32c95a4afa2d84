//! te-rdma against the FAKE verbs provider's injected faults and hostile peers: the
//! acceptance tests of the RDMA hardening. Each drives `RdmaBackend` directly (so a
//! test can present keys and ranges the engine would never let through), each backend
//! with a control plane of its own for the connect exchange, and steers the fake
//! through its `fakeverbs_*` control functions.
//!
//! Run as `cargo test -p te-rdma --test fake_faults`. The binary doubles as the target
//! of the two-process test when started with `TE_RDMA_FAKE_TARGET=1`.

use std::ffi::{c_char, c_int, c_void, CString};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use libtest_mimic::{Arguments, Failed, Trial};
use te_core::hook::StandaloneControl;
use te_core::{
    Access, Completion, Deadline, ErrorKind, MemoryDesc, MemoryKind, PeerId, RegionDesc, RegionId,
    SegmentDesc, TransferBackend, TransferRequest,
};
use te_rdma::{RdmaBackend, RdmaConfig};

const DEVICES: &str = "fake0 fake1 fakeslow:delay=200ms fakev1:roce=v1,rd_atom=4";
const RETRY_EXC: u32 = 12;
const REM_ACCESS: u32 = 10;

/// The fake's control functions, resolved from the library te-rdma loads.
struct Fake {
    handle: *mut c_void,
}

impl Fake {
    fn open() -> Fake {
        let path = std::env::var(te_rdma::VERBS_LIB_ENV).expect("set in main");
        let c = CString::new(path.clone()).expect("a path");
        // SAFETY: dlopen of the fake provider; te-rdma opens the same file, so this
        // returns the same, already loaded, library.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW) };
        assert!(!handle.is_null(), "cannot open {path}");
        Fake { handle }
    }

    fn sym(&self, name: &str) -> *mut c_void {
        let c = CString::new(name).expect("a name");
        // SAFETY: a live handle and a C string.
        let p = unsafe { libc::dlsym(self.handle, c.as_ptr()) };
        assert!(!p.is_null(), "the fake lacks {name}");
        p
    }

    fn fail_device(&self, device: &str, status: u32, count: u32) {
        type F = unsafe extern "C" fn(*const c_char, u32, u32) -> c_int;
        let d = CString::new(device).expect("a name");
        // SAFETY: the fake's function of this signature.
        let rc = unsafe {
            std::mem::transmute::<*mut c_void, F>(self.sym("fakeverbs_fail_device"))(
                d.as_ptr(),
                status,
                count,
            )
        };
        assert_eq!(rc, 0, "fakeverbs_fail_device({device})");
    }

    fn faults_left(&self, device: &str) -> i64 {
        type F = unsafe extern "C" fn(*const c_char) -> i64;
        let d = CString::new(device).expect("a name");
        // SAFETY: as above.
        unsafe {
            std::mem::transmute::<*mut c_void, F>(self.sym("fakeverbs_device_faults_left"))(
                d.as_ptr(),
            )
        }
    }

    fn mr_key(&self, device: &str, addr: u64) -> u32 {
        type F = unsafe extern "C" fn(*const c_char, u64) -> u32;
        let d = CString::new(device).expect("a name");
        // SAFETY: as above.
        unsafe {
            std::mem::transmute::<*mut c_void, F>(self.sym("fakeverbs_mr_key"))(d.as_ptr(), addr)
        }
    }

    fn set_port(&self, device: &str, up: bool) {
        type F = unsafe extern "C" fn(*const c_char, c_int) -> c_int;
        let d = CString::new(device).expect("a name");
        // SAFETY: as above.
        let rc = unsafe {
            std::mem::transmute::<*mut c_void, F>(self.sym("fakeverbs_set_port"))(
                d.as_ptr(),
                c_int::from(up),
            )
        };
        assert_eq!(rc, 0, "fakeverbs_set_port({device})");
    }

    fn busy_pds(&self) -> u64 {
        type F = unsafe extern "C" fn() -> u64;
        // SAFETY: as above.
        unsafe { std::mem::transmute::<*mut c_void, F>(self.sym("fakeverbs_busy_pds"))() }
    }

    fn outstanding(&self) -> u64 {
        type F = unsafe extern "C" fn() -> u64;
        // SAFETY: as above.
        unsafe { std::mem::transmute::<*mut c_void, F>(self.sym("fakeverbs_outstanding"))() }
    }
}

/// A backend with the control plane its connect exchange runs on (dropped after it).
struct Node {
    backend: RdmaBackend,
    control: StandaloneControl,
}

impl std::ops::Deref for Node {
    type Target = RdmaBackend;
    fn deref(&self) -> &RdmaBackend {
        &self.backend
    }
}

/// A backend of epoch `epoch` behind a control plane of its own on 127.0.0.1.
fn node_with(config: RdmaConfig, epoch: u64) -> te_core::Result<Node> {
    let control = StandaloneControl::start(&te_core::EngineConfig::default(), epoch)?;
    let backend = RdmaBackend::with_hook(config, epoch, control.hook())?;
    Ok(Node { backend, control })
}

fn node(config: RdmaConfig) -> te_core::Result<Node> {
    node_with(config, te_core::random_nonzero())
}

fn backend(devices: &[&str]) -> Node {
    backend_with(devices, 1)
}

fn backend_with(devices: &[&str], qps_per_path: usize) -> Node {
    let mut c = RdmaConfig::default();
    c.devices = devices.iter().map(|d| d.to_string()).collect();
    c.qps_per_path = qps_per_path;
    node(c).expect("an rdma backend on the fake")
}

/// An initiator on `fakeslow` (each work request takes 200 ms) that posts one work
/// request at a time, so a batch of several slices keeps most of them waiting.
fn one_at_a_time() -> Node {
    let mut c = RdmaConfig::default();
    c.devices = vec!["fakeslow".into()];
    c.qps_per_path = 1;
    c.max_outstanding = 1;
    c.signal_every = 1;
    node(c).expect("an rdma backend on the fake")
}

fn host(buf: &[u8], access: Access) -> MemoryDesc {
    MemoryDesc {
        name: String::new(),
        addr: buf.as_ptr() as u64,
        len: buf.len() as u64,
        kind: MemoryKind::Host,
        access,
    }
}

/// `target`'s descriptor, with `regions`.
fn segment(target: &Node, regions: Vec<RegionDesc>) -> SegmentDesc {
    segment_at(
        target.endpoint(),
        target.control.address().to_string(),
        regions,
    )
}

fn segment_at(endpoint: Vec<u8>, address: String, regions: Vec<RegionDesc>) -> SegmentDesc {
    SegmentDesc {
        engine: "target".into(),
        epoch: 1,
        address,
        backend: "rdma".into(),
        endpoint,
        regions,
        layouts: Vec::new(),
    }
}

fn region(id: u64, buf: &[u8], key: Vec<u8>) -> RegionDesc {
    RegionDesc {
        id: RegionId(id),
        name: String::new(),
        addr: buf.as_ptr() as u64,
        len: buf.len() as u64,
        kind: MemoryKind::Host,
        access: Access::REMOTE_READ_WRITE,
        key,
    }
}

/// Submits a batch and waits for its result; also returns how many work requests the
/// fake still had outstanding when the batch completed.
fn run(
    b: &RdmaBackend,
    peer: PeerId,
    reqs: &[TransferRequest],
    fake: &Fake,
) -> (te_core::Result<()>, u64, Duration) {
    let (tx, rx) = mpsc::channel();
    let outstanding: unsafe extern "C" fn() -> u64 =
        // SAFETY: the fake's function of this signature.
        unsafe { std::mem::transmute(fake.sym("fakeverbs_outstanding")) };
    let start = Instant::now();
    let done = Completion::new(Duration::from_secs(5), move |r, _| {
        // SAFETY: a plain counter read.
        let left = unsafe { outstanding() };
        let _ = tx.send((r, left, start.elapsed()));
    });
    if let Err(e) = b.submit(peer, reqs, done) {
        return (Err(e), 0, start.elapsed());
    }
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the batch completes")
}

/// [`run`], again while the peer has no healthy path (its only QP failed and is being
/// rebuilt in the background), for at most 2 s.
fn run_rebuilt(
    b: &RdmaBackend,
    peer: PeerId,
    reqs: &[TransferRequest],
    fake: &Fake,
) -> te_core::Result<()> {
    let until = Instant::now() + Duration::from_secs(2);
    loop {
        match run(b, peer, reqs, fake).0 {
            Err(e) if e.kind() == ErrorKind::PeerUnreachable && Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(20))
            }
            r => return r,
        }
    }
}

/// A deadline for calls that should be quick.
fn soon() -> Deadline {
    Deadline::after(Duration::from_secs(5))
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

fn check(cond: bool, what: String) -> Result<(), Failed> {
    if cond {
        Ok(())
    } else {
        Err(what.into())
    }
}

fn a_peer_that_knows_a_local_regions_address_and_key_gets_a_remote_access_error_and_no_data(
) -> Result<(), Failed> {
    let fake = Fake::open();
    let target = backend(&["fake0"]);
    let secret = vec![0x5au8; 8192];
    let key = target.register(RegionId(1), &host(&secret, Access::LOCAL))?;
    check(
        key.is_empty(),
        format!("a local-only region published key bytes {key:?}"),
    )?;
    let readable = pattern(4096, 3);
    let rkey_bytes = target.register(RegionId(2), &host(&readable, Access::REMOTE_READ))?;
    // The key a NIC would need for the secret, as someone who guessed it would have it.
    let rkey = fake.mr_key("fake0", secret.as_ptr() as u64);
    check(rkey != 0, "the fake knows no key for the secret".into())?;
    let mut forged = vec![1u8, 1];
    forged.extend_from_slice(&rkey.to_le_bytes());

    let attacker = backend(&["fake0"]);
    let mine = vec![0u8; 8192];
    attacker.register(RegionId(1), &host(&mine, Access::LOCAL))?;
    let peer = attacker.connect(
        &segment(
            &target,
            vec![region(7, &secret, forged), region(8, &readable, rkey_bytes)],
        ),
        soon(),
    )?;
    let (r, _, _) = run(
        &attacker,
        peer,
        &[TransferRequest::read(RegionId(1), 0, RegionId(7), 0, 8192)],
        &fake,
    );
    match r {
        Err(e)
            if e.kind() == ErrorKind::NotRegistered
                && e.to_string().contains("remote access error") => {}
        other => {
            return Err(format!(
                "reading the secret: expected a remote access error, got {other:?}"
            )
            .into())
        }
    }
    check(
        mine.iter().all(|&b| b == 0),
        "bytes of the secret reached the attacker".into(),
    )?;
    // Its only QP is in the error state now, as on a NIC: the next batches wait for
    // the background rebuild.
    let r = run_rebuilt(
        &attacker,
        peer,
        &[TransferRequest::write(RegionId(1), 0, RegionId(7), 0, 8192)],
        &fake,
    );
    let refused =
        |r: &te_core::Result<()>| matches!(r, Err(e) if e.kind() == ErrorKind::NotRegistered);
    check(refused(&r), format!("writing the secret: {r:?}"))?;
    // A read-only region: the NIC refuses a write whatever the descriptor claims.
    let r = run_rebuilt(
        &attacker,
        peer,
        &[TransferRequest::write(RegionId(1), 0, RegionId(8), 0, 4096)],
        &fake,
    );
    check(refused(&r), format!("writing a read-only region: {r:?}"))?;
    check(
        secret.iter().all(|&b| b == 0x5a),
        "the secret was overwritten".into(),
    )?;
    check(
        readable == pattern(4096, 3),
        "the read-only region was overwritten".into(),
    )?;
    // What the region grants still works.
    run_rebuilt(
        &attacker,
        peer,
        &[TransferRequest::read(RegionId(1), 0, RegionId(8), 0, 4096)],
        &fake,
    )?;
    check(
        mine[..4096] == readable[..],
        "the allowed read did not land".into(),
    )
}

/// A target with one remotely writable 1 MiB region, an initiator with a 1 MiB source,
/// both on fake0 and fake1 (two paths, one QP each), connected.
struct Pair {
    target: Node,
    initiator: Node,
    dst: Vec<u8>,
    src: Vec<u8>,
    peer: PeerId,
}

fn pair() -> Result<Pair, Failed> {
    let target = backend(&["fake0", "fake1"]);
    let dst = vec![0u8; 1 << 20];
    let key = target.register(RegionId(1), &host(&dst, Access::REMOTE_READ_WRITE))?;
    let initiator = backend(&["fake0", "fake1"]);
    let src = pattern(1 << 20, 9);
    initiator.register(RegionId(1), &host(&src, Access::LOCAL))?;
    let peer = initiator.connect(&segment(&target, vec![region(1, &dst, key)]), soon())?;
    Ok(Pair {
        target,
        initiator,
        dst,
        src,
        peer,
    })
}

fn write_all(p: &Pair) -> TransferRequest {
    TransferRequest::write(RegionId(1), 0, RegionId(1), 0, p.src.len() as u64)
}

fn an_injected_retry_exceeded_on_one_path_moves_the_batch_to_another_and_it_completes(
) -> Result<(), Failed> {
    let fake = Fake::open();
    let p = pair()?;
    fake.fail_device("fake0", RETRY_EXC, 1);
    let (r, left, _) = run(&p.initiator, p.peer, &[write_all(&p)], &fake);
    r?;
    check(
        fake.faults_left("fake0") == 0,
        "the injected RETRY_EXC was never hit".into(),
    )?;
    check(
        left == 0,
        format!("{left} work requests were outstanding when the batch completed"),
    )?;
    check(
        p.dst == p.src,
        "the target's bytes differ from the source".into(),
    )?;
    drop(p.target);
    Ok(())
}

fn an_injected_remote_access_error_fails_the_batch_and_leaves_the_other_qps_usable(
) -> Result<(), Failed> {
    let fake = Fake::open();
    let p = pair()?;
    fake.fail_device("fake0", REM_ACCESS, 1);
    let (r, left, _) = run(&p.initiator, p.peer, &[write_all(&p)], &fake);
    match r {
        Err(e) if e.kind() == ErrorKind::NotRegistered => {}
        other => return Err(format!("expected the remote access error, got {other:?}").into()),
    }
    check(
        left == 0,
        format!("the batch completed with {left} of its work requests still outstanding"),
    )?;
    // The other QP takes the next batch at once; the failed one is being rebuilt.
    let (r, _, _) = run(&p.initiator, p.peer, &[write_all(&p)], &fake);
    r?;
    check(p.dst == p.src, "the second batch did not land".into())?;
    // And after the rebuild, batches still complete on every path.
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..4 {
        let (r, _, _) = run(&p.initiator, p.peer, &[write_all(&p)], &fake);
        r?;
    }
    drop(p.target);
    Ok(())
}

fn a_peer_killed_mid_batch_fails_the_batch_within_its_deadline_and_nothing_lands_after(
) -> Result<(), Failed> {
    let fake = Fake::open();
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .env("TE_RDMA_FAKE_TARGET", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let [ready, endpoint, address, addr, len, key] = words[..] else {
        let _ = child.kill();
        return Err(format!("the target did not start: {line:?}").into());
    };
    check(ready == "ready", format!("the target said {line:?}"))?;
    let remote = RegionDesc {
        addr: addr.parse()?,
        len: len.parse()?,
        ..region(1, &[], unhex(key))
    };
    // Every work request of the initiator waits 200 ms (device fakeslow): 8 slices on
    // one QP take 1.6 s, so the batch is in flight when the target dies.
    let initiator = backend(&["fakeslow"]);
    let local = vec![0u8; 8 << 16];
    initiator.register(RegionId(1), &host(&local, Access::LOCAL))?;
    let seg = segment_at(unhex(endpoint), address.to_string(), vec![remote]);
    let peer = initiator.connect(&seg, soon())?;
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let _ = child.kill();
        let _ = child.wait();
    });
    let req = TransferRequest::read(RegionId(1), 0, RegionId(1), 0, local.len() as u64);
    let (r, left, took) = run(&initiator, peer, &[req], &fake);
    let _ = killer.join();
    match r {
        Err(e) if e.kind() == ErrorKind::PeerUnreachable => {}
        other => return Err(format!("expected PeerUnreachable, got {other:?}").into()),
    }
    check(
        took < Duration::from_millis(1500),
        format!("the batch took {took:?}: it waited for slices after the peer died"),
    )?;
    check(
        left == 0,
        format!("{left} work requests were still outstanding when the batch completed"),
    )?;
    // Released: nothing may land in the buffer any more.
    let sentinel = local.as_ptr() as *mut u8;
    // SAFETY: our own buffer; no batch uses it any more (that is what is checked).
    unsafe { std::ptr::write_bytes(sentinel, 0xab, local.len()) };
    std::thread::sleep(Duration::from_millis(600));
    check(
        local.iter().all(|&b| b == 0xab),
        "bytes landed in the buffer after its batch was handed back".into(),
    )?;
    check(
        fake.outstanding() == 0,
        "work requests are still outstanding".into(),
    )
}

fn a_port_that_goes_down_moves_the_work_to_the_other_nic() -> Result<(), Failed> {
    let fake = Fake::open();
    let p = pair()?;
    fake.set_port("fake0", false);
    // The event reaches the event thread asynchronously; the batch succeeds either way
    // (a slice that meets the dead port fails over), and afterwards fake0 stays unused.
    let r = run(&p.initiator, p.peer, &[write_all(&p)], &fake).0;
    fake.set_port("fake0", true);
    r?;
    check(p.dst == p.src, "the bytes did not land".into())?;
    drop(p.target);
    Ok(())
}

fn a_peer_with_only_roce_v1_and_fewer_read_slots_is_reached_over_v1_with_a_capped_read_depth(
) -> Result<(), Failed> {
    let fake = Fake::open();
    // fakev1 offers RoCE v1 only and serves 4 READs at once; fake0 offers v1 and v2
    // and would issue 16. The fake drops requests of a mismatched GID type, and of a
    // requester whose read depth exceeds what the responder serves.
    let target = backend(&["fakev1"]);
    let src = pattern(1 << 20, 5);
    let key = target.register(RegionId(1), &host(&src, Access::REMOTE_READ))?;
    let initiator = backend(&["fake0"]);
    let dst = vec![0u8; 1 << 20];
    initiator.register(RegionId(1), &host(&dst, Access::LOCAL))?;
    let peer = initiator.connect(&segment(&target, vec![region(1, &src, key)]), soon())?;
    let req = TransferRequest::read(RegionId(1), 0, RegionId(1), 0, dst.len() as u64);
    run(&initiator, peer, &[req], &fake).0?;
    check(dst == src, "the READ did not land".into())
}

fn a_request_for_more_qps_than_the_cap_is_refused_with_the_reason() -> Result<(), Failed> {
    let target = backend_with(&["fake0"], 1);
    let initiator = backend_with(&["fake0"], 4);
    match initiator.connect(&segment(&target, Vec::new()), soon()) {
        Err(e)
            if e.kind() == ErrorKind::InvalidRequest && e.to_string().contains("qps_per_path") =>
        {
            Ok(())
        }
        other => Err(format!("expected a refusal naming qps_per_path, got {other:?}").into()),
    }
}

fn disconnect_moves_the_qps_to_error_and_waits_for_their_flushes() -> Result<(), Failed> {
    let fake = Fake::open();
    let p = pair()?;
    // Every work request waits 100 ms, so a batch is in flight at the disconnect.
    let (tx, rx) = mpsc::channel();
    for d in ["fake0", "fake1"] {
        type F = unsafe extern "C" fn(*const c_char, u64, u32) -> c_int;
        let c = CString::new(d).expect("a name");
        // SAFETY: the fake's function of this signature.
        unsafe {
            std::mem::transmute::<*mut c_void, F>(fake.sym("fakeverbs_delay_device"))(
                c.as_ptr(),
                100_000,
                64,
            )
        };
    }
    let done = Completion::new(Duration::from_secs(5), move |r, _| {
        let _ = tx.send(r);
    });
    p.initiator.submit(p.peer, &[write_all(&p)], done)?;
    std::thread::sleep(Duration::from_millis(50));
    let start = Instant::now();
    p.initiator.disconnect(p.peer, soon())?;
    // When disconnect returns, every work request has been flushed and accounted for.
    check(
        fake.outstanding() == 0,
        format!(
            "{} work requests still outstanding after disconnect",
            fake.outstanding()
        ),
    )?;
    let r = rx.recv_timeout(Duration::from_secs(1))?;
    check(
        matches!(&r, Err(e) if e.kind() == ErrorKind::PeerUnreachable),
        format!("the batch: {r:?}"),
    )?;
    check(
        start.elapsed() < Duration::from_secs(2),
        format!("disconnect took {:?}", start.elapsed()),
    )?;
    for d in ["fake0", "fake1"] {
        // What is left of the delays must not slow the next tests.
        type F = unsafe extern "C" fn(*const c_char) -> c_int;
        let c = CString::new(d).expect("a name");
        // SAFETY: as above.
        unsafe {
            std::mem::transmute::<*mut c_void, F>(fake.sym("fakeverbs_clear_faults"))(c.as_ptr())
        };
    }
    drop(p.target);
    Ok(())
}

/// A target on fake0 with a remotely writable region of 8 slices, an initiator that
/// posts one slow work request at a time with an 8-slice source, connected.
struct SlowPair {
    target: Node,
    initiator: Node,
    dst: Vec<u8>,
    src: Vec<u8>,
    peer: PeerId,
}

const SLICE: usize = 64 << 10;

fn slow_pair() -> Result<SlowPair, Failed> {
    let target = backend(&["fake0"]);
    let dst = vec![0u8; 8 * SLICE];
    let key = target.register(RegionId(1), &host(&dst, Access::REMOTE_READ_WRITE))?;
    let initiator = one_at_a_time();
    let src = pattern(8 * SLICE, 4);
    initiator.register(RegionId(1), &host(&src, Access::LOCAL))?;
    let peer = initiator.connect(&segment(&target, vec![region(1, &dst, key)]), soon())?;
    Ok(SlowPair {
        target,
        initiator,
        dst,
        src,
        peer,
    })
}

fn an_aborted_batch_posts_none_of_its_waiting_slices_and_is_released_once_its_posted_ones_are_back(
) -> Result<(), Failed> {
    let fake = Fake::open();
    let p = slow_pair()?;
    let (tx, rx) = mpsc::channel();
    let outstanding: unsafe extern "C" fn() -> u64 =
        // SAFETY: the fake's function of this signature.
        unsafe { std::mem::transmute(fake.sym("fakeverbs_outstanding")) };
    let start = Instant::now();
    let (done, aborter) = Completion::abortable(soon(), move |r, _| {
        // SAFETY: a plain counter read.
        let left = unsafe { outstanding() };
        let _ = tx.send((r, left, start.elapsed()));
    });
    let batch = done.batch();
    let req = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, p.src.len() as u64);
    p.initiator.submit(p.peer, &[req], done)?;
    // 8 slices one after another take 1.6 s; abort while the second is posted.
    std::thread::sleep(Duration::from_millis(300));
    aborter.abort();
    p.initiator.abort(p.peer, batch);
    let (r, left, took) = rx.recv_timeout(Duration::from_secs(5))?;
    check(
        matches!(&r, Err(e) if e.kind() == ErrorKind::Cancelled),
        format!("the aborted batch: {r:?}"),
    )?;
    check(
        left == 0,
        format!("the batch was released with {left} work requests outstanding"),
    )?;
    check(
        took < Duration::from_millis(1000),
        format!("released after {took:?}: its waiting slices were posted"),
    )?;
    // Long enough for every slice to have landed, had any been posted after the abort.
    std::thread::sleep(Duration::from_millis(1600));
    let landed = p
        .dst
        .chunks(SLICE)
        .zip(p.src.chunks(SLICE))
        .filter(|(d, s)| d == s)
        .count();
    let untouched = p
        .dst
        .chunks(SLICE)
        .filter(|d| d.iter().all(|&b| b == 0))
        .count();
    check(
        landed + untouched == 8 && (1..=3).contains(&landed),
        format!("{landed} slices landed and {untouched} are untouched, of 8"),
    )?;
    drop(p.target);
    Ok(())
}

fn deregister_times_out_while_a_slice_pins_the_region_and_its_ok_means_the_keys_are_gone(
) -> Result<(), Failed> {
    let fake = Fake::open();
    let p = slow_pair()?;
    let addr = p.src.as_ptr() as u64;
    let (tx, rx) = mpsc::channel();
    let done = Completion::new(Duration::from_secs(5), move |r, _| {
        let _ = tx.send(r);
    });
    let req = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, p.src.len() as u64);
    p.initiator.submit(p.peer, &[req], done)?;
    std::thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    let r = p
        .initiator
        .deregister(RegionId(1), Deadline::after(Duration::from_millis(200)));
    let took = start.elapsed();
    check(
        matches!(&r, Err(e) if e.kind() == ErrorKind::Timeout),
        format!("deregister with slices in flight: {r:?}"),
    )?;
    check(
        took >= Duration::from_millis(150) && took < Duration::from_millis(1000),
        format!("deregister returned after {took:?}, not at its deadline"),
    )?;
    check(
        fake.mr_key("fakeslow", addr) != 0,
        "the MR went while work requests still used it".into(),
    )?;
    // The region is out of the table: a new batch on it is refused.
    let r = run(&p.initiator, p.peer, &[req], &fake).0;
    check(
        matches!(&r, Err(e) if e.kind() == ErrorKind::NotRegistered),
        format!("a batch on a region being deregistered: {r:?}"),
    )?;
    // The batch in flight is not the backend's to stop (the engine aborts it): it lands.
    rx.recv_timeout(Duration::from_secs(5))??;
    check(p.dst == p.src, "the batch in flight did not land".into())?;
    p.initiator.deregister(RegionId(1), soon())?;
    check(
        fake.mr_key("fakeslow", addr) == 0,
        "deregister returned Ok with the region's MR still registered".into(),
    )?;
    let r = p.initiator.deregister(RegionId(1), soon());
    check(
        matches!(&r, Err(e) if e.kind() == ErrorKind::NotRegistered),
        format!("a second deregister: {r:?}"),
    )?;
    drop(p.target);
    Ok(())
}

fn a_batchs_regions_are_unpinned_by_the_time_its_completion_runs() -> Result<(), Failed> {
    let p = pair()?;
    let initiator = std::sync::Arc::new(p.initiator);
    let (tx, rx) = mpsc::channel();
    let b = initiator.clone();
    // On the completion thread, before anything after the completion runs there: a
    // deregistration with no time to wait finds no slice pinning the region.
    let done = Completion::new(Duration::from_secs(5), move |r, _| {
        let dereg = b.deregister(RegionId(1), Deadline::after(Duration::ZERO));
        let _ = tx.send((r, dereg));
    });
    let req = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, p.src.len() as u64);
    initiator.submit(p.peer, &[req], done)?;
    let (r, dereg) = rx.recv_timeout(Duration::from_secs(5))?;
    r?;
    check(
        dereg.is_ok(),
        format!("deregister from the batch's completion: {dereg:?}"),
    )?;
    drop(p.target);
    Ok(())
}

fn connect_ends_at_the_callers_deadline_or_at_connect_timeout_whichever_is_sooner(
) -> Result<(), Failed> {
    let target = backend(&["fake0"]);
    // A control plane that accepts connections (the kernel does) and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0")?;
    let seg = segment_at(
        target.endpoint(),
        silent.local_addr()?.to_string(),
        Vec::new(),
    );

    let initiator = backend(&["fake0"]);
    let start = Instant::now();
    let r = initiator.connect(&seg, Deadline::after(Duration::from_millis(300)));
    let took = start.elapsed();
    check(
        matches!(&r, Err(e) if e.kind() == ErrorKind::Timeout),
        format!("a deadline sooner than connect_timeout: {r:?}"),
    )?;
    check(
        took >= Duration::from_millis(250) && took < Duration::from_millis(1500),
        format!("connect returned after {took:?}, its deadline was 300 ms"),
    )?;

    let mut c = RdmaConfig::default();
    c.devices = vec!["fake0".into()];
    c.connect_timeout = Duration::from_millis(300);
    let impatient = node(c)?;
    let start = Instant::now();
    let r = impatient.connect(&seg, Deadline::after(Duration::from_secs(10)));
    let took = start.elapsed();
    check(
        matches!(&r, Err(e) if e.kind() == ErrorKind::PeerUnreachable
            && e.to_string().contains("connect_timeout")),
        format!("connect_timeout sooner than the deadline: {r:?}"),
    )?;
    check(
        took >= Duration::from_millis(250) && took < Duration::from_millis(1500),
        format!("connect returned after {took:?}, connect_timeout was 300 ms"),
    )?;
    drop(silent);
    Ok(())
}

fn the_backend_names_itself_to_peers_with_the_engines_epoch() -> Result<(), Failed> {
    let config = || {
        let mut c = RdmaConfig::default();
        c.devices = vec!["fake0".into()];
        c
    };
    let epoch = 0x1234_5678_9abc_def0u64;
    let b = node_with(config(), epoch)?;
    // The endpoint: version, then the instance id.
    let endpoint = b.endpoint();
    check(
        endpoint[0] == 3 && endpoint[1..9] == epoch.to_le_bytes(),
        format!("the endpoint does not carry epoch {epoch:#x}: {endpoint:?}"),
    )?;
    // A target names itself by epoch: a request for another instance is refused.
    let initiator = backend(&["fake0"]);
    let mut stale = endpoint.clone();
    stale[1..9].copy_from_slice(&(epoch + 1).to_le_bytes());
    let address = b.control.address().to_string();
    let r = initiator.connect(&segment_at(stale, address.clone(), Vec::new()), soon());
    check(
        matches!(&r, Err(e) if e.kind() == ErrorKind::PeerRestarted && e.to_string().contains("stale")),
        format!("a descriptor of another life: {r:?}"),
    )?;
    initiator.connect(&segment_at(endpoint, address, Vec::new()), soon())?;
    // Created by an engine, through the registry, with the engine's epoch.
    let ctx = te_core::BackendContext {
        engine: "e".into(),
        epoch: epoch + 2,
        table: "devices = [\"fake0\"]".parse()?,
        source: "test".into(),
        ..Default::default()
    };
    let made = te_core::Registry::discover(&[])
        .get(te_rdma::NAME)?
        .create(&ctx)?;
    check(
        made.endpoint()[1..9] == (epoch + 2).to_le_bytes(),
        "the registry's backend does not name itself with its context's epoch".into(),
    )?;
    let r = RdmaBackend::with_epoch(config(), 0);
    check(
        matches!(&r, Err(e) if e.kind() == ErrorKind::ConfigInvalid),
        format!("a zero epoch: {:?}", r.map(|_| ())),
    )
}

fn a_backend_dropped_with_regions_registered_deregisters_them_before_closing_its_devices(
) -> Result<(), Failed> {
    let fake = Fake::open();
    let before = fake.busy_pds();
    let b = backend(&["fake0", "fake1"]);
    let buf = vec![0u8; 8192];
    b.register(RegionId(1), &host(&buf, Access::REMOTE_READ_WRITE))?;
    drop(b);
    check(
        fake.busy_pds() == before,
        "the devices were closed with memory regions still registered in them".into(),
    )?;
    check(
        fake.mr_key("fake0", buf.as_ptr() as u64) == 0,
        "the region's MR outlived the backend".into(),
    )
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The child of the two-process test: a target with one 512 KiB region, until its
/// stdin closes (or it is killed).
fn serve_target() -> ! {
    let target = backend(&["fake0"]);
    let buf = vec![0x77u8; 8 << 16];
    let key = target
        .register(RegionId(1), &host(&buf, Access::REMOTE_READ_WRITE))
        .expect("register");
    println!(
        "ready {} {} {} {} {}",
        hex(&target.endpoint()),
        target.control.address(),
        buf.as_ptr() as u64,
        buf.len(),
        hex(&key)
    );
    let _ = std::io::stdout().flush();
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    std::process::exit(0);
}

fn main() {
    // Before any thread starts; the child inherits both.
    if std::env::var_os(te_rdma::VERBS_LIB_ENV).is_none() {
        let exe = std::env::current_exe().expect("the test binary's path");
        std::env::set_var(
            te_rdma::VERBS_LIB_ENV,
            exe.with_file_name("libfakeverbs.so"),
        );
    }
    std::env::set_var("TE_FAKEVERBS_DEVICES", DEVICES);
    if std::env::var_os("TE_RDMA_FAKE_TARGET").is_some() {
        serve_target();
    }
    if let Err(why) = te_rdma::probe() {
        eprintln!("the fake verbs provider does not load: {why}");
        std::process::exit(1);
    }
    type Test = fn() -> Result<(), Failed>;
    let tests: [(&str, Test); 14] = [
        (
            "a_peer_that_knows_a_local_regions_address_and_key_gets_a_remote_access_error_and_no_data",
            a_peer_that_knows_a_local_regions_address_and_key_gets_a_remote_access_error_and_no_data,
        ),
        (
            "an_injected_retry_exceeded_on_one_path_moves_the_batch_to_another_and_it_completes",
            an_injected_retry_exceeded_on_one_path_moves_the_batch_to_another_and_it_completes,
        ),
        (
            "an_injected_remote_access_error_fails_the_batch_and_leaves_the_other_qps_usable",
            an_injected_remote_access_error_fails_the_batch_and_leaves_the_other_qps_usable,
        ),
        (
            "a_peer_killed_mid_batch_fails_the_batch_within_its_deadline_and_nothing_lands_after",
            a_peer_killed_mid_batch_fails_the_batch_within_its_deadline_and_nothing_lands_after,
        ),
        (
            "a_port_that_goes_down_moves_the_work_to_the_other_nic",
            a_port_that_goes_down_moves_the_work_to_the_other_nic,
        ),
        (
            "a_peer_with_only_roce_v1_and_fewer_read_slots_is_reached_over_v1_with_a_capped_read_depth",
            a_peer_with_only_roce_v1_and_fewer_read_slots_is_reached_over_v1_with_a_capped_read_depth,
        ),
        (
            "a_request_for_more_qps_than_the_cap_is_refused_with_the_reason",
            a_request_for_more_qps_than_the_cap_is_refused_with_the_reason,
        ),
        (
            "disconnect_moves_the_qps_to_error_and_waits_for_their_flushes",
            disconnect_moves_the_qps_to_error_and_waits_for_their_flushes,
        ),
        (
            "an_aborted_batch_posts_none_of_its_waiting_slices_and_is_released_once_its_posted_ones_are_back",
            an_aborted_batch_posts_none_of_its_waiting_slices_and_is_released_once_its_posted_ones_are_back,
        ),
        (
            "deregister_times_out_while_a_slice_pins_the_region_and_its_ok_means_the_keys_are_gone",
            deregister_times_out_while_a_slice_pins_the_region_and_its_ok_means_the_keys_are_gone,
        ),
        (
            "a_batchs_regions_are_unpinned_by_the_time_its_completion_runs",
            a_batchs_regions_are_unpinned_by_the_time_its_completion_runs,
        ),
        (
            "connect_ends_at_the_callers_deadline_or_at_connect_timeout_whichever_is_sooner",
            connect_ends_at_the_callers_deadline_or_at_connect_timeout_whichever_is_sooner,
        ),
        (
            "the_backend_names_itself_to_peers_with_the_engines_epoch",
            the_backend_names_itself_to_peers_with_the_engines_epoch,
        ),
        (
            "a_backend_dropped_with_regions_registered_deregisters_them_before_closing_its_devices",
            a_backend_dropped_with_regions_registered_deregisters_them_before_closing_its_devices,
        ),
    ];
    // The faults are injected per device and the outstanding count is the process's:
    // the tests run one at a time.
    let mut args = Arguments::from_args();
    args.test_threads = Some(1);
    let trials = tests
        .into_iter()
        .map(|(name, f)| Trial::test(name, f))
        .collect();
    libtest_mimic::run(&args, trials).exit();
}
