//! The caller's memory is the caller's again only when te says so: after a batch has
//! resolved — completed, timed out, cancelled — and after a deregistration has
//! returned, no byte lands in it. Each test watches the memory for a while afterwards.

use std::time::{Duration, Instant};

use libtest_mimic::Failed;

use super::harness::{Harness, Pair};
use super::{e2f, expect_kind, fail, pattern};
use crate::{Access, Buffer, ErrorKind, TransferHandle, TransferOptions, TransferRequest};

/// How long the memory is watched after te handed it back: well past the slow
/// configuration's batch time.
const WATCH: Duration = Duration::from_millis(1000);

/// A slow pair whose target holds a known pattern, and an initiator buffer of zeros.
fn filled(h: &Harness, len: usize) -> Result<(Pair, Vec<u8>), Failed> {
    let p = h.pair(true, len)?;
    let data = pattern(len, 11);
    p.local.write(0, &data).map_err(e2f)?;
    let req = TransferRequest::write(p.local.id(), 0, p.remote_desc.id, 0, len as u64);
    p.initiator
        .transfer(&p.peer, &[req])
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    p.local.write(0, &vec![0; len]).map_err(e2f)?;
    Ok((p, data))
}

/// Fails if `buffer` changes during [`WATCH`] from what it holds now.
fn stays_unchanged(buffer: &Buffer, what: &str) -> Result<(), Failed> {
    let before = buffer.to_vec().map_err(e2f)?;
    let end = Instant::now() + WATCH;
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(100));
        let now = buffer.to_vec().map_err(e2f)?;
        if now != before {
            let at = now.iter().zip(&before).position(|(a, b)| a != b);
            return Err(fail(format!(
                "{what}: the buffer changed after te handed it back (first at byte {at:?})"
            )));
        }
    }
    Ok(())
}

fn read_all(p: &Pair, len: usize, options: &TransferOptions) -> Result<TransferHandle, Failed> {
    let req = TransferRequest::read(p.local.id(), 0, p.remote_desc.id, 0, len as u64);
    p.initiator
        .transfer_with(&p.peer, &[req], options)
        .map_err(e2f)
}

pub(super) fn a_timed_out_batch_never_writes_afterwards(h: &Harness) -> Result<(), Failed> {
    let len = 256 << 10;
    let (p, _) = filled(h, len)?;
    let options = TransferOptions {
        timeout: Some(Duration::from_millis(50)),
        ..TransferOptions::default()
    };
    let handle = read_all(&p, len, &options)?;
    expect_kind(
        handle.wait(),
        ErrorKind::Timeout,
        "a READ past its deadline",
    )?;
    stays_unchanged(&p.local, "after the timeout")
}

pub(super) fn a_cancelled_batch_never_writes_afterwards(h: &Harness) -> Result<(), Failed> {
    let len = 256 << 10;
    let (p, _) = filled(h, len)?;
    let handle = read_all(&p, len, &TransferOptions::default())?;
    handle.cancel();
    let r = handle
        .wait_timeout(Duration::from_secs(10))
        .ok_or_else(|| fail("a cancelled batch was not released within 10 s"))?;
    expect_kind(r, ErrorKind::Cancelled, "a cancelled READ")?;
    stays_unchanged(&p.local, "after the cancel")
}

pub(super) fn deregistration_waits_for_batches_in_flight(h: &Harness) -> Result<(), Failed> {
    let len = 256 << 10;
    let (p, data) = filled(h, len)?;
    let victim = p
        .initiator
        .alloc_on(&h.memory().0, "victim", len, Access::LOCAL)
        .map_err(e2f)?;
    let req = TransferRequest::read(victim.id(), 0, p.remote_desc.id, 0, len as u64);
    let handle = p.initiator.transfer(&p.peer, &[req]).map_err(e2f)?;
    // The batch is in flight (the slow configuration); dropping the buffer deregisters
    // it, which must wait for the batch to be released before the memory is freed.
    let start = Instant::now();
    drop(victim);
    ensure!(
        handle.is_done(),
        "deregistration returned after {:?} while a batch on the region was still in flight",
        start.elapsed()
    );
    // Waited for, not cancelled: the batch had time left, so it completed.
    handle.wait().map_err(e2f)?;
    // And a READ into a region registered anew at the same place completes normally.
    let again = p
        .initiator
        .alloc_on(&h.memory().0, "again", len, Access::LOCAL)
        .map_err(e2f)?;
    let req = TransferRequest::read(again.id(), 0, p.remote_desc.id, 0, len as u64);
    p.initiator
        .transfer(&p.peer, &[req])
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    ensure!(
        again.to_vec().map_err(e2f)? == data,
        "the READ after the deregistration read the wrong bytes"
    );
    Ok(())
}
