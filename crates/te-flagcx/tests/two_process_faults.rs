//! The flagcx backend across two processes when something fails, over the FAKE shim:
//! the fake's injected faults (`shim_options`: failed transfers and slices, stale
//! registrations, a failed connect), a region the target deregistered, and a target
//! that died.
//!
//! Each test spawns this binary again as a target (see `common`); the initiator runs
//! here.

mod common;

use common::{config, counter, e2f, ensure, fnv, pattern, setup, Target, DST};
use libtest_mimic::Failed;
use te_core::{Engine, ErrorKind, RegionId, TransferOptions, TransferRequest};

fn an_injected_transfer_failure_fails_only_its_batch() -> Result<(), Failed> {
    let mut s = setup("fail_every=3", "")?;
    let block = 4096u64;
    s.src.write(0, &pattern(DST, 9)).map_err(e2f)?;
    for i in 0..6u64 {
        let req = [TransferRequest::write(
            s.src.id(),
            i * block,
            s.dst,
            i * block,
            block,
        )];
        let r = s.initiator.transfer(&s.peer, &req).map_err(e2f)?.wait();
        if (i + 1) % 3 == 0 {
            let e = r.err().ok_or(format!("batch {i} should have failed"))?;
            ensure!(
                e.kind() == ErrorKind::Backend && e.to_string().contains("failed slice"),
                "batch {i}: unclear error {e:?}"
            );
        } else {
            r.map_err(|e| format!("batch {i} failed: {e:?}"))?;
        }
    }
    ensure!(
        s.peer.is_valid(),
        "a failed transfer must not drop the peer"
    );
    let mut expect = vec![0u8; 6 * block as usize];
    let src = s.src.to_vec().map_err(e2f)?;
    for i in [0usize, 1, 3, 4] {
        let r = i * block as usize..(i + 1) * block as usize;
        expect[r.clone()].copy_from_slice(&src[r]);
    }
    ensure!(
        s.target.sum("dst", 0, expect.len())? == format!("sum {:x}", fnv(&expect)),
        "the target's bytes are not those of the successful batches only"
    );
    Ok(())
}

/// FlagCX reports a transfer whose slices failed as finished; te must fail the batch
/// and send no "data is visible" notification. The fake finishes the transfer with its
/// last descriptor failed, as FlagCX's transfer task would.
fn a_transfer_finished_with_a_failed_slice_fails_and_sends_no_notification() -> Result<(), Failed> {
    let mut s = setup("max_desc=4096,fail_every=1", "")?;
    let len = 4 * 4096;
    s.src.write(0, &pattern(len, 3)).map_err(e2f)?;
    let options = TransferOptions {
        notify: Some(b"landed".to_vec()),
        ..TransferOptions::default()
    };
    let req = [TransferRequest::write(s.src.id(), 0, s.dst, 0, len as u64)];
    let r = s
        .initiator
        .transfer_with(&s.peer, &req, &options)
        .map_err(e2f)?
        .wait();
    let e = r
        .err()
        .ok_or("a WRITE that finished with a failed slice was reported delivered")?;
    ensure!(
        e.kind() == ErrorKind::Backend && e.to_string().contains("1 failed slice(s) of 4"),
        "unclear error for a failed slice: {e:?}"
    );
    let got = s.target.cmd("notif 500")?;
    ensure!(
        got == "none",
        "the target was told the data is visible although a slice failed: `{got}`"
    );
    // The first three slices landed, the last did not: the batch really was partial.
    ensure!(
        s.target.sum("dst", 0, 3 * 4096)? == format!("sum {:x}", fnv(&pattern(len, 3)[..3 * 4096])),
        "the slices that did not fail are missing"
    );
    ensure!(
        s.target.sum("dst", 3 * 4096, 4096)? == format!("sum {:x}", fnv(&[0; 4096])),
        "the failed slice's bytes arrived after all"
    );
    Ok(())
}

fn an_injected_stale_registration_fails_its_batch_and_the_next_one_reconnects() -> Result<(), Failed>
{
    let s = setup("stale_every=2", "")?;
    let req = [TransferRequest::write(s.src.id(), 0, s.dst, 0, 4096)];
    s.initiator
        .transfer(&s.peer, &req)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    let connects = counter("connects");
    let e = s
        .initiator
        .transfer(&s.peer, &req)
        .map_err(e2f)?
        .wait()
        .err()
        .ok_or("the second batch should have failed")?;
    ensure!(
        e.kind() == ErrorKind::NotRegistered && e.to_string().contains("stale"),
        "unclear error for a stale registration: {e:?}"
    );
    s.initiator
        .transfer(&s.peer, &req)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    ensure!(
        counter("connects") > connects,
        "the third batch did not renew the connection"
    );
    Ok(())
}

fn an_injected_connect_failure_is_a_clear_error() -> Result<(), Failed> {
    let target = Target::spawn("")?;
    let initiator = Engine::from_config(&config("fail_connect=1")).map_err(e2f)?;
    match initiator.connect(&target.addr) {
        Err(e)
            if e.kind() == ErrorKind::PeerUnreachable
                && e.to_string().contains("injected connect failure") =>
        {
            Ok(())
        }
        Err(e) => Err(format!("unclear connect error: {e:?}").into()),
        Ok(_) => Err("connect succeeded despite the injected failure".into()),
    }
}

fn a_region_the_target_deregistered_fails_the_batch_with_not_registered() -> Result<(), Failed> {
    let mut s = setup("", "")?;
    let answer = s.target.cmd("alloc gone 4096")?;
    let gone = RegionId(
        answer
            .strip_prefix("ok ")
            .ok_or(answer.clone())?
            .parse()
            .map_err(|_| answer.clone())?,
    );
    let req = [TransferRequest::write(s.src.id(), 0, gone, 0, 4096)];
    s.initiator
        .transfer(&s.peer, &req)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    ensure!(
        s.target.cmd("free gone")? == "ok",
        "the target could not free the region"
    );
    let e = match s.initiator.transfer(&s.peer, &req) {
        Err(e) => e,
        Ok(h) => h
            .wait()
            .err()
            .ok_or("a write into a deregistered region succeeded")?,
    };
    ensure!(
        e.kind() == ErrorKind::NotRegistered,
        "expected NotRegistered, got {e:?}"
    );
    // The peer still works for its other regions.
    let ok = [TransferRequest::write(s.src.id(), 0, s.dst, 0, 4096)];
    s.initiator
        .transfer(&s.peer, &ok)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)
}

fn a_dead_target_fails_batches_with_peer_unreachable() -> Result<(), Failed> {
    let mut s = setup("", "")?;
    let req = [TransferRequest::write(s.src.id(), 0, s.dst, 0, 4096)];
    s.initiator
        .transfer(&s.peer, &req)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    s.target.child.kill().map_err(|e| e.to_string())?;
    s.target.child.wait().map_err(|e| e.to_string())?;
    let r = s.initiator.transfer(&s.peer, &req).and_then(|h| h.wait());
    let e = r.err().ok_or("a write to a dead process succeeded")?;
    ensure!(
        e.kind() == ErrorKind::PeerUnreachable,
        "expected PeerUnreachable, got {e:?}"
    );
    Ok(())
}

fn main() {
    common::run_tests(vec![
        (
            "an_injected_transfer_failure_fails_only_its_batch",
            an_injected_transfer_failure_fails_only_its_batch,
        ),
        (
            "a_transfer_finished_with_a_failed_slice_fails_and_sends_no_notification",
            a_transfer_finished_with_a_failed_slice_fails_and_sends_no_notification,
        ),
        (
            "an_injected_stale_registration_fails_its_batch_and_the_next_one_reconnects",
            an_injected_stale_registration_fails_its_batch_and_the_next_one_reconnects,
        ),
        (
            "an_injected_connect_failure_is_a_clear_error",
            an_injected_connect_failure_is_a_clear_error,
        ),
        (
            "a_region_the_target_deregistered_fails_the_batch_with_not_registered",
            a_region_the_target_deregistered_fails_the_batch_with_not_registered,
        ),
        (
            "a_dead_target_fails_batches_with_peer_unreachable",
            a_dead_target_fails_batches_with_peer_unreachable,
        ),
    ]);
}
