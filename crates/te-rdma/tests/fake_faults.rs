//! te-rdma against the FAKE verbs provider's injected faults and hostile peers: errors
//! a NIC reports in the middle of a batch. A peer that forges the key of a local-only
//! region, an injected `RETRY_EXC_ERR` and `REM_ACCESS_ERR`, a target process killed
//! mid-batch, a port that goes down (and comes back), a peer's paths rebuilt again and
//! again under one batch. Each drives `RdmaBackend` directly (so a test can
//! present keys and ranges the engine would never let through), each backend with a
//! control plane of its own for the connect exchange, and steers the fake through its
//! `fakeverbs_*` control functions.
//!
//! Run as `cargo test -p te-rdma --test fake_faults`. The binary doubles as the target
//! of the two-process test when started with `TE_RDMA_FAKE_TARGET=1`.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    backend, check, host, none_outstanding, pair, pattern, region, run, segment, segment_at, soon,
    traced, write_all, Fake,
};
use libtest_mimic::Failed;
use te_core::{Access, ErrorKind, PeerId, RegionDesc, RegionId, TransferBackend, TransferRequest};
use te_rdma::RdmaBackend;

const RETRY_EXC: u32 = 12;
const REM_ACCESS: u32 = 10;

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
    none_outstanding(left)?;
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

/// The QPs of `device` in RTS, leaving out those in `old`, lowest first.
fn rts_qps(fake: &Fake, device: &str, old: &[u32]) -> Vec<u32> {
    fake.device_qps(device)
        .into_iter()
        .filter(|q| !old.contains(q) && fake.qp_state(*q) == QPS_RTS)
        .collect()
}

/// Waits up to 5 s for `done` to hold; else fails with `what`.
fn wait_for(what: &str, mut done: impl FnMut() -> bool) -> Result<(), Failed> {
    let until = Instant::now() + Duration::from_secs(5);
    while !done() {
        if Instant::now() > until {
            return Err(format!("{what} within 5 s").into());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

fn a_port_that_comes_back_up_is_used_again_by_the_peers_it_was_left_out_of() -> Result<(), Failed> {
    let fake = Fake::open();
    let old0 = fake.device_qps("fake0");
    let old1 = fake.device_qps("fake1");
    let mut p = pair()?;
    // One path on each NIC: the initiator's and the target's QP of each, in RTS.
    let first0 = rts_qps(&fake, "fake0", &old0);
    let first1 = rts_qps(&fake, "fake1", &old1);
    check(
        first0.len() == 2 && first1.len() == 2,
        format!("connected with QPs {first0:x?} on fake0 and {first1:x?} on fake1"),
    )?;
    // Down: the set is rebuilt on fake1 alone (the old one retired and released).
    fake.set_port("fake0", false);
    let gone1: Vec<u32> = old1.iter().chain(&first1).copied().collect();
    wait_for("the peer's paths were not rebuilt without fake0", || {
        rts_qps(&fake, "fake0", &old0).is_empty() && rts_qps(&fake, "fake1", &gone1).len() == 2
    })?;
    run(&p.initiator, p.peer, &[write_all(&p)], &fake).0?;
    check(
        p.dst == p.src,
        "the bytes did not land on fake1 alone".into(),
    )?;
    // A batch in flight on fake1: its first work request is held (3 s) until its QP
    // leaves RTS, and the rest wait behind it.
    // SAFETY: the target's own buffer; no batch uses it now.
    unsafe { std::ptr::write_bytes(p.dst.as_mut_ptr(), 0, p.dst.len()) };
    fake.delay_device("fake1", Duration::from_secs(3), 1);
    let (done, rx) = traced(&fake, Duration::from_secs(10));
    p.initiator.submit(p.peer, &[write_all(&p)], done)?;
    wait_for("the batch's first work request was not held", || {
        fake.faults_left("fake1") == 0
    })?;
    // Up again: the set is rebuilt to use fake0 as well, although none of its paths
    // failed since; the old set is retired, and the batch moves to the new one.
    fake.set_port("fake0", true);
    let gone0: Vec<u32> = old0.iter().chain(&first0).copied().collect();
    wait_for(
        "the peer's paths were not rebuilt on fake0 after its port came back",
        || rts_qps(&fake, "fake0", &gone0).len() == 2,
    )?;
    let (r, left, took) = rx
        .recv_timeout(Duration::from_secs(10))
        .map_err(|_| "the batch in flight did not complete")?;
    r.map_err(|e| format!("the batch in flight during the rebuild: {e}"))?;
    check(
        took < Duration::from_secs(3),
        format!("the batch took {took:?}: it waited for its held work request"),
    )?;
    none_outstanding(left)?;
    check(
        p.dst == p.src,
        "the bytes of the batch in flight did not land".into(),
    )?;
    // A batch of 16 slices over the two paths runs work requests on both NICs (a
    // zero delay on each device counts them).
    // SAFETY: the target's own buffer; no batch uses it now.
    unsafe { std::ptr::write_bytes(p.dst.as_mut_ptr(), 0, p.dst.len()) };
    fake.delay_device("fake0", Duration::ZERO, 1000);
    fake.delay_device("fake1", Duration::ZERO, 1000);
    let r = run(&p.initiator, p.peer, &[write_all(&p)], &fake).0;
    let ran = [
        1000 - fake.faults_left("fake0"),
        1000 - fake.faults_left("fake1"),
    ];
    fake.clear_faults("fake0");
    fake.clear_faults("fake1");
    r?;
    check(
        p.dst == p.src,
        "the bytes did not land over both NICs".into(),
    )?;
    check(
        ran[0] > 0 && ran[1] > 0,
        format!("work requests ran on fake0 and fake1: {ran:?}"),
    )?;
    // The set is complete: nothing rebuilds it again.
    let now = (
        rts_qps(&fake, "fake0", &old0),
        rts_qps(&fake, "fake1", &old1),
    );
    std::thread::sleep(Duration::from_millis(300));
    let later = (
        rts_qps(&fake, "fake0", &old0),
        rts_qps(&fake, "fake1", &old1),
    );
    check(
        now == later,
        format!("the complete set was rebuilt again: QPs {now:x?}, then {later:x?}"),
    )?;
    drop(p.target);
    Ok(())
}

/// How many times the test below has the peer's paths rebuilt under one slice: more
/// than the attempts a slice may spend on failures (twice the peer's 2 paths).
const REBUILDS: usize = 8;

/// `IBV_QPS_RTS`, as `fakeverbs_qp_state` reports it.
const QPS_RTS: i32 = 3;

/// Breaks the peer's current path on fake0 (both its QPs, as a link that drops its
/// connections does), once the set before has been retired and replaced: the
/// initiator's and the target's QPs on fake0 are then exactly two, in RTS, none of
/// them in `before`. The initiator's QP fails, and its peer's set is rebuilt.
fn break_fake0(fake: &Fake, before: &[u32]) -> Result<(), Failed> {
    // A rebuild whose exchange failed on a loaded machine is tried again after a
    // backoff of up to 5 s: leave room for one.
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let qps: Vec<u32> = fake
            .device_qps("fake0")
            .into_iter()
            .filter(|q| !before.contains(q))
            .collect();
        let states: Vec<i32> = qps.iter().map(|&q| fake.qp_state(q)).collect();
        // A QP that went away since it was seen (an exchange given up and built again,
        // on a loaded machine) breaks nothing: look again.
        if states == [QPS_RTS, QPS_RTS] && qps.iter().fold(false, |hit, &q| fake.qp_fatal(q) | hit)
        {
            return Ok(());
        }
        if Instant::now() > until {
            return Err(format!(
                "the paths on fake0 were not rebuilt: QPs {qps:x?} in states {states:?}"
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn a_slice_on_a_healthy_path_survives_more_rebuilds_of_its_peers_paths_than_it_has_attempts(
) -> Result<(), Failed> {
    let fake = Fake::open();
    let before = fake.device_qps("fake0");
    // fake1 first on both sides: path 0 of every set is fake1 to fake1, path 1 fake0 to
    // fake0. The one slice goes to path 0, and each rebuilt set takes it on its first
    // healthy path: fake1's, which never fails.
    let p = common::Pair::new(64 << 10, || backend(&["fake1", "fake0"]), segment)?;
    // Every work request fake1 runs waits 3 s first: the slice is held posted until its
    // QP leaves RTS (its set is retired), which flushes it back.
    fake.delay_device("fake1", Duration::from_secs(3), 1000);
    // However the test ends, the next one in this process finds fake1 without delays.
    struct Undelay<'a>(&'a Fake);
    impl Drop for Undelay<'_> {
        fn drop(&mut self) {
            self.0.clear_faults("fake1");
        }
    }
    let _undelay = Undelay(&fake);
    let (done, rx) = traced(&fake, Duration::from_secs(30));
    p.initiator.submit(p.peer, &[write_all(&p)], done)?;
    // Ports flapping under the batch: fake0's path breaks, the set is rebuilt and the
    // old one retired, again and again; fake1's path is healthy throughout.
    for round in 0..REBUILDS {
        break_fake0(&fake, &before)?;
        if let Ok((r, _, _)) = rx.try_recv() {
            return Err(format!(
                "the batch completed after {round} rebuilds, while its slice was held: {r:?}"
            )
            .into());
        }
    }
    // Released: the last rebuild moves the slice once more, and it lands at once.
    fake.clear_faults("fake1");
    break_fake0(&fake, &before)?;
    let (r, left, _) = rx
        .recv_timeout(Duration::from_secs(10))
        .map_err(|_| "the batch did not complete")?;
    r.map_err(|e| format!("after {} rebuilds: {e}", REBUILDS + 1))?;
    none_outstanding(left)?;
    check(p.dst == p.src, "the bytes did not land".into())?;
    drop(p.target);
    Ok(())
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
    common::use_the_fake();
    if std::env::var_os("TE_RDMA_FAKE_TARGET").is_some() {
        serve_target();
    }
    common::run_tests(vec![
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
            "a_slice_on_a_healthy_path_survives_more_rebuilds_of_its_peers_paths_than_it_has_attempts",
            a_slice_on_a_healthy_path_survives_more_rebuilds_of_its_peers_paths_than_it_has_attempts,
        ),
        (
            "a_port_that_comes_back_up_is_used_again_by_the_peers_it_was_left_out_of",
            a_port_that_comes_back_up_is_used_again_by_the_peers_it_was_left_out_of,
        ),
    ]);
}
