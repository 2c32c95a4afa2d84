//! te-rdma against the fake verbs provider, with peers that lie and races that bite:
//! hostile descriptors and exchange requests (regions at the top of the address space,
//! another engine's instance or address, more devices than an endpoint has), initiators
//! that vanish without releasing their QPs, leave or restart (the target frees their
//! QPs when it hears of it, and only for the engine that made them), the repair thread
//! racing a disconnect, or waking while it has nothing to do, and two connects racing
//! each other.
//!
//! The tests serialize themselves: the fake's devices and counters are the process's.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Once};
use std::time::{Duration, Instant};

use common::{backend, host, node_with, pattern, region, run, segment, segment_at, soon, Fake};
use libtest_mimic::Failed;
use te_core::{
    Access, ControlHook, Deadline, EngineConfig, ErrorKind, MessageHandler, PeerInfo, RegionId,
    StandaloneControl, TransferBackend, TransferRequest,
};
use te_rdma::RdmaConfig;

/// `IBV_QPS_RTS`, as `fakeverbs_qp_state` reports it.
const QPS_RTS: i32 = 3;

static LOCK: Mutex<()> = Mutex::new(());

/// Points te-rdma at the fake (once) and runs the tests one at a time.
fn setup() -> MutexGuard<'static, ()> {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        common::use_the_fake();
        te_rdma::probe().expect("the fake verbs provider loads");
    });
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn config(devices: &[&str]) -> RdmaConfig {
    let mut c = RdmaConfig::default();
    c.devices = devices.iter().map(|d| d.to_string()).collect();
    c.qps_per_path = 1;
    c
}

/// The live QPs of `device` that are not in `old`.
fn new_qps(fake: &Fake, device: &str, old: &[u32]) -> Vec<u32> {
    fake.device_qps(device)
        .into_iter()
        .filter(|q| !old.contains(q))
        .collect()
}

/// A connect request as the exchange encodes it (version 3): one copy of `path` (a
/// genuine path's 33 bytes) per entry of `initiator_devices`, each naming that
/// initiator device.
fn request(
    initiator: u64,
    target: u64,
    set: u64,
    path: &[u8],
    initiator_devices: &[u8],
) -> Vec<u8> {
    let mut v = b"TERC".to_vec();
    v.extend_from_slice(&3u16.to_le_bytes());
    v.push(1);
    v.extend_from_slice(&initiator.to_le_bytes());
    v.extend_from_slice(&target.to_le_bytes());
    v.extend_from_slice(&set.to_le_bytes());
    v.extend_from_slice(&(initiator_devices.len() as u16).to_le_bytes());
    for d in initiator_devices {
        v.push(*d);
        v.extend_from_slice(&path[1..]);
    }
    v
}

/// Records what it relays.
struct Recorder {
    via: ControlHook,
    to: String,
    seen: Arc<Mutex<Vec<Vec<u8>>>>,
}

impl MessageHandler for Recorder {
    fn handle(
        &self,
        _from: &PeerInfo,
        request: &[u8],
        deadline: Deadline,
    ) -> te_core::Result<Vec<u8>> {
        self.seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(request.to_vec());
        self.via.call(&self.to, request, deadline)
    }
}

/// The 33 bytes of a genuine path towards `target`'s device 0 (from the request of an
/// initiator on fake0, recorded on its way), for hostile requests to build on.
fn genuine_path(target: &common::Node) -> Result<Vec<u8>, Failed> {
    let epoch = te_core::random_nonzero();
    let initiator = node_with(config(&["fake0"]), epoch)?;
    let via = StandaloneControl::start(&EngineConfig::default(), epoch)?;
    let relay = StandaloneControl::start(&EngineConfig::default(), te_core::random_nonzero())?;
    let seen = Arc::new(Mutex::new(Vec::new()));
    relay.hook().serve(Arc::new(Recorder {
        via: via.hook(),
        to: target.control.address().to_string(),
        seen: seen.clone(),
    }))?;
    let seg = segment_at(target.endpoint(), relay.address().to_string(), Vec::new());
    let peer = initiator.connect(&seg, soon())?;
    initiator.disconnect(peer, soon())?;
    let first = seen.lock().unwrap_or_else(|e| e.into_inner())[0].clone();
    let at = 4 + 2 + 1 + 8 + 8 + 8 + 2;
    Ok(first[at..at + 33].to_vec())
}

fn instance(endpoint: &[u8]) -> u64 {
    u64::from_le_bytes(endpoint[1..9].try_into().expect("8 bytes"))
}

/// A peer's region address near the top of the address space (its descriptor is the
/// peer's to write; the engine checks only offset + len against the region's length)
/// must be refused, at connect or submit, never panic on `addr + offset`.
#[test]
fn a_peer_region_at_the_top_of_the_address_space_is_refused_without_a_panic() -> Result<(), Failed>
{
    let _g = setup();
    let fake = Fake::open();
    let target = backend(&["fake0"]);
    let dst = vec![0u8; 8192];
    let key = target.register(RegionId(1), &host(&dst, Access::REMOTE_READ_WRITE))?;
    let initiator = backend(&["fake0"]);
    let src = pattern(4096, 1);
    initiator.register(RegionId(1), &host(&src, Access::LOCAL))?;
    let mut forged = region(1, &dst, key);
    forged.addr = u64::MAX - 100;
    let peer = match initiator.connect(&segment(&target, vec![forged]), soon()) {
        Ok(p) => p,
        Err(_) => return Ok(()), // refused at connect: fine
    };
    // In range as the engine checks it: 200 + 4096 <= 8192.
    let req = TransferRequest::write(RegionId(1), 0, RegionId(1), 200, 4096);
    let r = catch_unwind(AssertUnwindSafe(|| run(&initiator, peer, &[req], &fake).0));
    match r {
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(format!("submit panicked on a peer-supplied region address: {msg}").into())
        }
        Ok(Ok(())) => Err("a write to a region at 0xffff_ffff_ffff_ff9b + 200 succeeded".into()),
        Ok(Err(_)) => Ok(()),
    }
}

/// A descriptor that names a connected peer's instance in its endpoint bytes but comes
/// from another engine (another control-plane address) is not that peer: connect must
/// not hand back the connected peer's id, nor replace that peer's regions with the
/// descriptor's.
#[test]
fn a_descriptor_from_another_address_naming_a_connected_peers_instance_does_not_take_over_that_peer(
) -> Result<(), Failed> {
    let _g = setup();
    let fake = Fake::open();
    let a = backend(&["fake0"]);
    let dst = vec![0u8; 64 << 10];
    let decoy = vec![0u8; 64 << 10];
    let key = a.register(RegionId(1), &host(&dst, Access::REMOTE_READ_WRITE))?;
    let decoy_key = a.register(RegionId(2), &host(&decoy, Access::REMOTE_READ_WRITE))?;
    let initiator = backend(&["fake0"]);
    let src = pattern(64 << 10, 9);
    initiator.register(RegionId(1), &host(&src, Access::LOCAL))?;
    let peer_a = initiator.connect(&segment(&a, vec![region(1, &dst, key)]), soon())?;
    // Another engine, B, whose descriptor carries A's endpoint bytes, and a region 1
    // that is really A's decoy buffer.
    let b = backend(&["fake0"]);
    let forged = segment_at(
        a.endpoint(),
        b.control.address().to_string(),
        vec![region(1, &decoy, decoy_key)],
    );
    let hijacked = initiator.connect(&forged, soon());
    // What the initiator now writes to A's region 1 goes where B's descriptor said.
    let req = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, src.len() as u64);
    let r = run(&initiator, peer_a, &[req], &fake).0;
    let into_decoy = decoy == src;
    match hijacked {
        Ok(id) if id == peer_a => Err(format!(
            "connect to B's descriptor (at {}) returned A's peer id {id:?}; A's next write {r:?} landed in the decoy: {into_decoy}",
            b.control.address()
        )
        .into()),
        _ if into_decoy => Err("A's regions were replaced by B's descriptor".into()),
        _ => Ok(()),
    }
}

/// A descriptor naming a connected peer's instance with fewer devices (and region keys
/// with fewer rkeys) must be refused or leave the peer's regions alone: the peer's paths
/// index the region keys by the peer device they reach.
#[test]
fn a_descriptor_with_fewer_devices_for_a_connected_instance_does_not_panic_the_data_path(
) -> Result<(), Failed> {
    let _g = setup();
    let fake = Fake::open();
    let a = backend(&["fake0", "fake1"]);
    let dst = vec![0u8; 1 << 20];
    let key = a.register(RegionId(1), &host(&dst, Access::REMOTE_READ_WRITE))?;
    let initiator = backend(&["fake0", "fake1"]);
    let src = pattern(1 << 20, 5);
    initiator.register(RegionId(1), &host(&src, Access::LOCAL))?;
    let seg = segment(&a, vec![region(1, &dst, key.clone())]);
    let peer = initiator.connect(&seg, soon())?;
    // A's endpoint, cut to its first device; its key, cut to its first rkey.
    let ep = a.endpoint();
    let name_len = ep[12] as usize;
    let mut short = ep[..10].to_vec();
    short[9] = 1;
    short.extend_from_slice(&ep[10..13 + name_len]);
    let mut short_key = vec![1u8, 1];
    short_key.extend_from_slice(&key[2..6]);
    let mut forged = seg.clone();
    forged.endpoint = short;
    forged.regions = vec![region(1, &dst, short_key)];
    let again = initiator.connect(&forged, soon());
    let req = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, src.len() as u64);
    let r = catch_unwind(AssertUnwindSafe(|| run(&initiator, peer, &[req], &fake).0));
    match r {
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(format!(
                "after connect({again:?}) with a one-device endpoint, submit panicked: {msg}"
            )
            .into())
        }
        Ok(_) => Ok(()),
    }
}

/// A request that names 200 distinct initiator devices (an endpoint names at most 32)
/// makes the target build 200 QPs for one initiator: the cap must not grow with what
/// the request claims beyond what any initiator can have.
#[test]
fn a_request_naming_more_initiator_devices_than_an_endpoint_can_have_is_refused(
) -> Result<(), Failed> {
    let _g = setup();
    let fake = Fake::open();
    let target = backend(&["fake0"]); // qps_per_path = 1, one device
    let address = target.control.address().to_string();
    let inst = instance(&target.endpoint());
    let path = genuine_path(&target)?;
    let before = fake.device_qps("fake0");
    let epoch = te_core::random_nonzero();
    let hostile = StandaloneControl::start(&EngineConfig::default(), epoch)?;
    let devices: Vec<u8> = (0..200u16).map(|d| d as u8).collect();
    let r = hostile
        .hook()
        .call(&address, &request(epoch, inst, 1, &path, &devices), soon());
    let built = new_qps(&fake, "fake0", &before).len();
    match r {
        Err(e) if e.kind() == ErrorKind::InvalidRequest => Ok(()),
        other => Err(format!(
            "a request naming 200 initiator devices (at most 32 exist per endpoint) was answered {:?}; the target built {built} QPs for it",
            other.map(|v| v.len())
        )
        .into()),
    }
}

/// The control-plane address an initiator gives in its hello is only claimed (the
/// target knows its sets by its name and epoch). Another engine that claims the same
/// address with its own epoch must not destroy the first initiator's QPs.
#[test]
fn another_engine_claiming_an_initiators_address_does_not_destroy_its_qps() -> Result<(), Failed> {
    let _g = setup();
    let fake = Fake::open();
    let target = backend(&["fake0"]);
    let dst = vec![0u8; 64 << 10];
    let key = target.register(RegionId(1), &host(&dst, Access::REMOTE_READ_WRITE))?;
    let path = genuine_path(&target)?;
    let before = fake.device_qps("fake0");
    let good = backend(&["fake0"]);
    let src = pattern(64 << 10, 3);
    good.register(RegionId(1), &host(&src, Access::LOCAL))?;
    let peer = good.connect(&segment(&target, vec![region(1, &dst, key)]), soon())?;
    let req = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, src.len() as u64);
    run(&good, peer, &[req], &fake).0?;
    let goods = new_qps(&fake, "fake0", &before);
    if goods.len() != 2 {
        return Err(format!("expected 2 QPs for the good pair, got {goods:x?}").into());
    }
    // A hostile engine on 127.0.0.2 at the good initiator's port, advertising
    // 127.0.0.1: it claims the good initiator's address, with an epoch of its own.
    let good_addr = good.control.address();
    let port = good_addr.port();
    let epoch = te_core::random_nonzero();
    let cfg = EngineConfig {
        listen: format!("127.0.0.2:{port}"),
        advertise: Some("127.0.0.1".into()),
        ..Default::default()
    };
    let hostile = StandaloneControl::start(&cfg, epoch)?;
    if hostile.address() != good_addr {
        return Err(format!(
            "setup: the hostile engine claims {} (wanted {good_addr})",
            hostile.address()
        )
        .into());
    }
    let inst = instance(&target.endpoint());
    let answer = hostile.hook().call(
        &target.control.address().to_string(),
        &request(epoch, inst, 1, &path, &[0]),
        soon(),
    );
    std::thread::sleep(Duration::from_millis(100));
    let gone: Vec<u32> = goods
        .iter()
        .copied()
        .filter(|&q| fake.qp_state(q) != QPS_RTS)
        .collect();
    if !gone.is_empty() {
        return Err(format!(
            "a request from an engine claiming {good_addr} (answered {:?}) tore down the good initiator's QPs {gone:x?} (states {:?})",
            answer.map(|v| v.len()),
            gone.iter().map(|&q| fake.qp_state(q)).collect::<Vec<_>>()
        )
        .into());
    }
    Ok(())
}

/// Initiators that die without releasing their sets (a crash: no release, and no
/// goodbye on their sessions, so the target never hears that they left) and never come
/// back under their names leave their sets on the target; the target holds at most
/// `max_served_qps` QPs for them all, the oldest going first, and a live initiator's
/// newest set is kept and works.
#[test]
fn qp_sets_of_initiators_that_died_without_releasing_them_stay_within_the_targets_cap(
) -> Result<(), Failed> {
    let _g = setup();
    let fake = Fake::open();
    const CAP: usize = 3;
    let before = fake.device_qps("fake0");
    let mut cfg = config(&["fake0"]);
    cfg.max_served_qps = CAP;
    let target = node_with(cfg, te_core::random_nonzero())?;
    let dst = vec![0u8; 64 << 10];
    let key = target.register(RegionId(1), &host(&dst, Access::REMOTE_READ_WRITE))?;
    const LIVES: usize = 5;
    for life in 0..LIVES {
        // An engine of its own name (no life is another's restart), reaching the
        // target through a relay that is cut before it goes.
        let relay = Relay::to(&target.control.address().to_string(), 1)?;
        let epoch = te_core::random_nonzero();
        let engine = EngineConfig {
            name: format!("crashes-{life}"),
            ..Default::default()
        };
        let control = StandaloneControl::start(&engine, epoch)?;
        let g = te_rdma::RdmaBackend::with_hook(config(&["fake0"]), epoch, control.hook())?;
        let src = pattern(64 << 10, life as u8);
        g.register(RegionId(1), &host(&src, Access::LOCAL))?;
        let seg = segment_at(
            target.endpoint(),
            relay.address.to_string(),
            vec![region(1, &dst, key.clone())],
        );
        let peer = g.connect(&seg, soon())?;
        let req = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, src.len() as u64);
        run(&g, peer, &[req], &fake).0?;
        relay.cut();
        drop(g);
        drop(control);
    }
    let held = new_qps(&fake, "fake0", &before);
    if held.len() > CAP {
        return Err(format!(
            "the target holds {} QPs for {LIVES} initiators that are gone, past max_served_qps = {CAP}: {held:x?}",
            held.len()
        )
        .into());
    }
    let live = node_with(config(&["fake0"]), te_core::random_nonzero())?;
    let src = pattern(64 << 10, 9);
    live.register(RegionId(1), &host(&src, Access::LOCAL))?;
    let peer = live.connect(&segment(&target, vec![region(1, &dst, key)]), soon())?;
    let req = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, src.len() as u64);
    run(&live, peer, &[req], &fake).0?;
    if dst != src {
        return Err("a live initiator's write did not land whole".into());
    }
    Ok(())
}

/// Forwards connect-exchange messages to `to` through `via` (an engine with the
/// initiator's epoch), after `delay` milliseconds: a slow path to the target.
struct Slow {
    via: ControlHook,
    to: String,
    delay: Arc<AtomicU64>,
}

impl MessageHandler for Slow {
    fn handle(
        &self,
        _from: &PeerInfo,
        request: &[u8],
        deadline: Deadline,
    ) -> te_core::Result<Vec<u8>> {
        std::thread::sleep(Duration::from_millis(self.delay.load(Ordering::Acquire)));
        self.via.call(&self.to, request, deadline)
    }
}

/// A disconnect that lands while the repair thread rebuilds the peer's paths must win:
/// the rebuilt set must not be put back under the disconnected id (which would bring
/// the peer back, with QPs on both sides that nothing releases).
#[test]
fn a_disconnect_during_a_background_rebuild_is_not_undone_by_the_rebuild() -> Result<(), Failed> {
    let _g = setup();
    let fake = Fake::open();
    let target = backend(&["fake0", "fake1"]);
    let dst = vec![0u8; 256 << 10];
    let key = target.register(RegionId(1), &host(&dst, Access::REMOTE_READ_WRITE))?;
    let before0 = fake.device_qps("fake0");
    let before1 = fake.device_qps("fake1");
    let epoch = te_core::random_nonzero();
    let initiator = node_with(config(&["fake0", "fake1"]), epoch)?;
    let src = pattern(256 << 10, 7);
    initiator.register(RegionId(1), &host(&src, Access::LOCAL))?;
    // The initiator reaches the target through a relay that can be made slow.
    let via = StandaloneControl::start(&EngineConfig::default(), epoch)?;
    let relay = StandaloneControl::start(&EngineConfig::default(), te_core::random_nonzero())?;
    let delay = Arc::new(AtomicU64::new(0));
    relay.hook().serve(Arc::new(Slow {
        via: via.hook(),
        to: target.control.address().to_string(),
        delay: delay.clone(),
    }))?;
    let seg = segment_at(
        target.endpoint(),
        relay.address().to_string(),
        vec![region(1, &dst, key)],
    );
    let peer = initiator.connect(&seg, soon())?;
    let req = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, src.len() as u64);
    run(&initiator, peer, &[req], &fake).0?;
    // Break the paths on fake0: the repair thread rebuilds the set, slowly.
    delay.store(1500, Ordering::Release);
    let on0 = new_qps(&fake, "fake0", &before0);
    for q in &on0 {
        fake.qp_fatal(*q);
    }
    std::thread::sleep(Duration::from_millis(300));
    initiator.disconnect(peer, soon())?;
    delay.store(0, Ordering::Release);
    // The rebuild's exchange answers meanwhile.
    std::thread::sleep(Duration::from_millis(2500));
    let r = run(&initiator, peer, &[req], &fake).0;
    let live0: Vec<u32> = new_qps(&fake, "fake0", &before0)
        .into_iter()
        .filter(|&q| fake.qp_state(q) == QPS_RTS)
        .collect();
    let live1: Vec<u32> = new_qps(&fake, "fake1", &before1)
        .into_iter()
        .filter(|&q| fake.qp_state(q) == QPS_RTS)
        .collect();
    if r.is_ok() || !live0.is_empty() || !live1.is_empty() {
        return Err(format!(
            "after disconnect returned Ok, a batch to the disconnected peer gave {r:?}, and QPs {live0:x?} (fake0) {live1:x?} (fake1) are in RTS"
        )
        .into());
    }
    Ok(())
}

/// Context switches of this process's threads named `name`, in all.
fn switches_of(name: &str) -> (usize, u64) {
    let mut threads = 0;
    let mut total = 0;
    for task in std::fs::read_dir("/proc/self/task")
        .expect("tasks")
        .flatten()
    {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim() != name {
            continue;
        }
        threads += 1;
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        total += status
            .lines()
            .filter(|l| l.contains("ctxt_switches:"))
            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum::<u64>();
    }
    (threads, total)
}

/// Idle means no wake-up: a connected pair with nothing to do, and nothing to repair,
/// must not wake its repair threads.
#[test]
fn an_idle_backends_repair_thread_does_not_wake() -> Result<(), Failed> {
    let _g = setup();
    let fake = Fake::open();
    let p = common::pair()?;
    run(&p.initiator, p.peer, &[common::write_all(&p)], &fake).0?;
    std::thread::sleep(Duration::from_millis(300));
    let (n, before) = switches_of("te-rdma-repair");
    std::thread::sleep(Duration::from_secs(3));
    let (_, after) = switches_of("te-rdma-repair");
    let woke = after - before;
    if woke > 0 {
        return Err(format!(
            "{n} idle repair threads woke {woke} times in 3 s (a 1 s wait_timeout when nothing is queued)"
        )
        .into());
    }
    Ok(())
}

/// A peer whose rebuild failed (its target is gone) and that is then disconnected
/// leaves nothing for the repair thread to do: it must go back to sleep, not spin.
#[test]
fn a_disconnected_peer_whose_rebuild_failed_does_not_make_the_repair_thread_spin(
) -> Result<(), Failed> {
    let _g = setup();
    let fake = Fake::open();
    let before = fake.device_qps("fake0");
    let target = backend(&["fake0"]);
    let dst = vec![0u8; 64 << 10];
    let key = target.register(RegionId(1), &host(&dst, Access::REMOTE_READ_WRITE))?;
    let initiator = backend(&["fake0"]);
    let src = pattern(64 << 10, 2);
    initiator.register(RegionId(1), &host(&src, Access::LOCAL))?;
    let peer = initiator.connect(&segment(&target, vec![region(1, &dst, key)]), soon())?;
    let req = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, src.len() as u64);
    run(&initiator, peer, &[req], &fake).0?;
    // The target goes (its control plane with it); the initiator's QP then fails, and
    // its rebuild cannot reach the target.
    drop(target);
    for q in new_qps(&fake, "fake0", &before) {
        fake.qp_fatal(q);
    }
    std::thread::sleep(Duration::from_millis(300));
    initiator.disconnect(peer, soon())?;
    // Past the rebuild's backoff (50 ms, then 100 ms, …).
    std::thread::sleep(Duration::from_millis(500));
    let (n, a) = switches_of("te-rdma-repair");
    std::thread::sleep(Duration::from_secs(1));
    let (_, b) = switches_of("te-rdma-repair");
    let woke = b - a;
    if woke > 20 {
        return Err(format!(
            "{n} repair thread(s) woke {woke} times in 1 s with no peer left to repair (a backoff entry of a peer that is gone)"
        )
        .into());
    }
    Ok(())
}

/// Two connects to one new instance at once end with one peer: both callers get its
/// id, and the QPs the slower one built are released on both sides.
#[test]
fn concurrent_connects_to_one_instance_make_one_peer() -> Result<(), Failed> {
    let _g = setup();
    let fake = Fake::open();
    let before = fake.device_qps("fake0");
    let target = backend(&["fake0"]);
    let dst = vec![0u8; 64 << 10];
    let key = target.register(RegionId(1), &host(&dst, Access::REMOTE_READ_WRITE))?;
    let init = node_with(config(&["fake0"]), te_core::random_nonzero())?;
    let seg = segment(&target, vec![region(1, &dst, key)]);
    let ids: Vec<_> = std::thread::scope(|sc| {
        let calls: Vec<_> = (0..2)
            .map(|_| sc.spawn(|| init.connect(&seg, soon())))
            .collect();
        calls.into_iter().map(|c| c.join().unwrap()).collect()
    });
    let ids = ids.into_iter().collect::<te_core::Result<Vec<_>>>()?;
    if ids[0] != ids[1] {
        return Err(format!("two connects to one instance made two peers: {ids:?}").into());
    }
    // One QP a side (qps_per_path = 1, one device each).
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let live: Vec<u32> = new_qps(&fake, "fake0", &before)
            .into_iter()
            .filter(|&q| fake.qp_state(q) == QPS_RTS)
            .collect();
        if live.len() == 2 {
            return Ok(());
        }
        if Instant::now() > until {
            return Err(format!(
                "{} QPs in RTS for one peer, 2 wanted: {live:x?}",
                live.len()
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits up to 5 s for `cond`, looking every 20 ms; whether it came.
fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        if cond() {
            return true;
        }
        if Instant::now() > until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A target on fake0 with a remotely writable region; its initiators are on fake1, so
/// the QPs that appear on fake0 are the target's.
struct Served {
    target: common::Node,
    dst: Vec<u8>,
    key: Vec<u8>,
}

fn served_target() -> Result<Served, Failed> {
    let target = node_with(config(&["fake0"]), te_core::random_nonzero())?;
    let dst = vec![0u8; 64 << 10];
    let key = target.register(RegionId(1), &host(&dst, Access::REMOTE_READ_WRITE))?;
    Ok(Served { target, dst, key })
}

impl Served {
    /// An initiator on fake1 with `epoch`, reaching the target at `address`, that wrote
    /// once; and the QPs the target built for it.
    fn initiator(
        &self,
        fake: &Fake,
        epoch: u64,
        address: String,
    ) -> Result<(common::Node, te_core::PeerId, Vec<u32>), Failed> {
        let before = fake.device_qps("fake0");
        let init = node_with(config(&["fake1"]), epoch)?;
        let src = pattern(64 << 10, epoch as u8);
        init.register(RegionId(1), &host(&src, Access::LOCAL))?;
        let seg = segment_at(
            self.target.endpoint(),
            address,
            vec![region(1, &self.dst, self.key.clone())],
        );
        let peer = init.connect(&seg, soon())?;
        let req = TransferRequest::write(RegionId(1), 0, RegionId(1), 0, src.len() as u64);
        run(&init, peer, &[req], fake).0?;
        let held = new_qps(fake, "fake0", &before);
        if held.len() != 1 {
            return Err(format!("expected the target to build 1 QP, it built {held:x?}").into());
        }
        Ok((init, peer, held))
    }

    fn address(&self) -> String {
        self.target.control.address().to_string()
    }
}

/// A TCP relay to a control plane, for its first `connections` connections, that the
/// test can cut: the network between two engines failing, with no goodbye from either.
/// Past them (or once dropped) it refuses connections.
struct Relay {
    address: std::net::SocketAddr,
    sockets: Arc<Mutex<Vec<std::net::TcpStream>>>,
    closed: Arc<std::sync::atomic::AtomicBool>,
}

impl Relay {
    fn to(to: &str, connections: usize) -> Result<Relay, Failed> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let address = listener.local_addr()?;
        let to: std::net::SocketAddr = to.parse()?;
        let sockets = Arc::new(Mutex::new(Vec::new()));
        let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (kept, stop) = (sockets.clone(), closed.clone());
        std::thread::spawn(move || {
            for _ in 0..connections {
                let Ok((a, _)) = listener.accept() else {
                    return;
                };
                if stop.load(Ordering::Acquire) {
                    return;
                }
                if let Ok(b) = std::net::TcpStream::connect(to) {
                    let _ = Relay::pipe(a, b, &kept);
                }
            }
        });
        Ok(Relay {
            address,
            sockets,
            closed,
        })
    }

    /// Copies between `a` and `b` both ways, until either closes or is cut.
    fn pipe(
        mut a: std::net::TcpStream,
        mut b: std::net::TcpStream,
        kept: &Mutex<Vec<std::net::TcpStream>>,
    ) -> std::io::Result<()> {
        let (mut a2, mut b2) = (a.try_clone()?, b.try_clone()?);
        kept.lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend([a.try_clone()?, b.try_clone()?]);
        std::thread::spawn(move || std::io::copy(&mut a, &mut b2));
        std::thread::spawn(move || std::io::copy(&mut b, &mut a2));
        Ok(())
    }

    /// Cuts the connections it relays.
    fn cut(&self) {
        for s in self
            .sockets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.closed.store(true, Ordering::Release);
        // Wakes its accept, which then ends.
        let _ = std::net::TcpStream::connect(self.address);
        self.cut();
    }
}

/// An initiator engine that closes says goodbye on its sessions; the target then
/// destroys the QP sets that engine (its name and epoch) made, at once: without a
/// release from its backend (inside an engine the control plane stops first) and
/// without waiting for `max_served_qps` to push them out.
#[test]
fn the_qp_sets_of_an_initiator_engine_that_left_are_destroyed_at_once() -> Result<(), Failed> {
    let _g = setup();
    let fake = Fake::open();
    let s = served_target()?;
    let (init, _, held) = s.initiator(&fake, te_core::random_nonzero(), s.address())?;
    let common::Node { backend, control } = init;
    drop(control);
    let gone = eventually(|| held.iter().all(|&q| fake.qp_state(q) == -1));
    drop(backend);
    if !gone {
        return Err(format!(
            "5 s after its initiator's engine left, the target still holds its QPs {held:x?} (states {:?})",
            held.iter().map(|&q| fake.qp_state(q)).collect::<Vec<_>>()
        )
        .into());
    }
    Ok(())
}

/// An initiator engine whose session to the target breaks (no goodbye) may come back
/// with the same epoch, so the target keeps its QPs; when the engine's name comes
/// back with a new epoch (it restarted), the target destroys the old life's QPs at
/// once, not when `max_served_qps` pushes them out, and serves the new life.
#[test]
fn a_restarted_initiators_qp_sets_are_destroyed_when_it_comes_back() -> Result<(), Failed> {
    let _g = setup();
    let fake = Fake::open();
    let s = served_target()?;
    let relay = Relay::to(&s.address(), 1)?;
    let (old, _, held) =
        s.initiator(&fake, te_core::random_nonzero(), relay.address.to_string())?;
    relay.cut();
    let lost = eventually(|| {
        s.target
            .control
            .try_recv_events()
            .iter()
            .any(|e| e.kind == te_core::PeerEventKind::Lost)
    });
    if !lost {
        return Err("setup: the target did not see its initiator's session break".into());
    }
    std::thread::sleep(Duration::from_millis(200));
    let live: Vec<u32> = held
        .iter()
        .copied()
        .filter(|&q| fake.qp_state(q) == QPS_RTS)
        .collect();
    if live != held {
        return Err(format!(
            "a broken session (the initiator may be back with the same epoch) destroyed its QPs: {held:x?} held, {live:x?} in RTS"
        )
        .into());
    }
    let (new, _, mine) = s.initiator(&fake, te_core::random_nonzero(), s.address())?;
    let gone = eventually(|| held.iter().all(|&q| fake.qp_state(q) == -1));
    let states = |qps: &[u32]| qps.iter().map(|&q| fake.qp_state(q)).collect::<Vec<_>>();
    let (olds, news) = (states(&held), states(&mine));
    drop((new, old));
    if !gone || news.iter().any(|&st| st != QPS_RTS) {
        return Err(format!(
            "5 s after its initiator came back with a new epoch, the target's QPs of the old life {held:x?} are in states {olds:?}, and of the new one {mine:x?} in {news:?}"
        )
        .into());
    }
    Ok(())
}

/// An initiator whose sets the target freed while it still ran (its session broke
/// while a newer life of its name was up, which the target takes for a restart: two
/// engines given one name) sees its path fail, rebuilds its set, and its writes land
/// again.
#[test]
fn an_initiator_whose_sets_were_freed_under_it_rebuilds_them() -> Result<(), Failed> {
    let _g = setup();
    let fake = Fake::open();
    let s = served_target()?;
    let relay = Relay::to(&s.address(), 4)?;
    let (first, peer, held) =
        s.initiator(&fake, te_core::random_nonzero(), relay.address.to_string())?;
    let (second, _, _) = s.initiator(&fake, te_core::random_nonzero(), s.address())?;
    relay.cut();
    if !eventually(|| held.iter().all(|&q| fake.qp_state(q) == -1)) {
        return Err("setup: the target kept the QPs of a life it took for restarted".into());
    }
    let src = pattern(64 << 10, 6);
    first.register(RegionId(2), &host(&src, Access::LOCAL))?;
    let req = TransferRequest::write(RegionId(2), 0, RegionId(1), 0, src.len() as u64);
    // Its first batches fail (its only path failed; the set is rebuilt in the
    // background).
    let until = Instant::now() + Duration::from_secs(5);
    let r = loop {
        match run(&first, peer, &[req], &fake).0 {
            Err(e) if e.kind() == ErrorKind::PeerUnreachable && Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(20))
            }
            r => break r,
        }
    };
    drop(second);
    if let Err(e) = r {
        return Err(format!("the initiator did not rebuild the set the target freed: {e}").into());
    }
    if s.dst != src {
        return Err("the write after the rebuild did not land whole".into());
    }
    Ok(())
}

/// A release of QP set `set`, as the exchange encodes it (version 3, kind 4).
fn release(initiator: u64, target: u64, set: u64) -> Vec<u8> {
    let mut v = b"TERC".to_vec();
    v.extend_from_slice(&3u16.to_le_bytes());
    v.push(4);
    v.extend_from_slice(&initiator.to_le_bytes());
    v.extend_from_slice(&target.to_le_bytes());
    v.extend_from_slice(&set.to_le_bytes());
    v
}

/// Another engine that claims an initiator's address and its epoch (both public: the
/// address in its hello, the epoch in its descriptor) under a name of its own neither
/// releases the initiator's QP sets nor, by leaving, has them destroyed: the target
/// knows a set by the name and epoch its maker authenticated with.
#[test]
fn an_engine_claiming_an_initiators_address_and_epoch_under_another_name_cannot_free_its_qps(
) -> Result<(), Failed> {
    let _g = setup();
    let fake = Fake::open();
    let s = served_target()?;
    let epoch = te_core::random_nonzero();
    let (victim, peer, held) = s.initiator(&fake, epoch, s.address())?;
    let victim_addr = victim.control.address();
    let cfg = EngineConfig {
        name: "claims-another-address".into(),
        listen: format!("127.0.0.2:{}", victim_addr.port()),
        advertise: Some("127.0.0.1".into()),
        ..Default::default()
    };
    let hostile = StandaloneControl::start(&cfg, epoch)?;
    if hostile.address() != victim_addr {
        return Err(format!(
            "setup: the hostile engine claims {} (wanted {victim_addr})",
            hostile.address()
        )
        .into());
    }
    let inst = instance(&s.target.endpoint());
    let answers: Vec<_> = (1..=4)
        .map(|set| {
            hostile
                .hook()
                .call(&s.address(), &release(epoch, inst, set), soon())
                .map(|v| v.len())
        })
        .collect();
    drop(hostile);
    let left =
        eventually(|| {
            s.target.control.try_recv_events().iter().any(|e| {
                e.kind == te_core::PeerEventKind::Left && e.name == "claims-another-address"
            })
        });
    if !left {
        return Err("setup: the target did not see the hostile engine leave".into());
    }
    std::thread::sleep(Duration::from_millis(200));
    let states: Vec<i32> = held.iter().map(|&q| fake.qp_state(q)).collect();
    if states.iter().any(|&st| st != QPS_RTS) {
        return Err(format!(
            "an engine claiming the initiator's address and epoch (its releases answered {answers:?}) tore down the initiator's QPs {held:x?} (states {states:?})"
        )
        .into());
    }
    let src = pattern(64 << 10, 5);
    victim.register(RegionId(2), &host(&src, Access::LOCAL))?;
    let req = TransferRequest::write(RegionId(2), 0, RegionId(1), 0, src.len() as u64);
    run(&victim, peer, &[req], &fake).0?;
    Ok(())
}
