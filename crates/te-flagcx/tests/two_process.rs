//! The flagcx backend across two processes, over the FAKE shim (loopback TCP): bytes
//! written and read back, notifications after the data, a region registered after
//! connect, a request split at the descriptor limit, and many concurrent batches.
//!
//! Each test spawns this binary again as a target (see `common`); the initiator runs
//! here. The failures across processes are in `two_process_faults.rs`.

mod common;

use std::sync::Arc;

use common::{counter, e2f, ensure, fnv, pattern, setup, DST};
use libtest_mimic::Failed;
use te_core::{RegionId, TransferOptions, TransferRequest};

fn write_then_read_back_across_processes() -> Result<(), Failed> {
    let mut s = setup("", "")?;
    let data = pattern(DST, 11);
    s.src.write(0, &data).map_err(e2f)?;
    let q = (DST / 4) as u64;
    let writes: Vec<_> = [2u64, 0, 3, 1]
        .iter()
        .map(|&i| TransferRequest::write(s.src.id(), i * q, s.dst, i * q, q))
        .collect();
    s.initiator
        .transfer(&s.peer, &writes)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    ensure!(
        s.target.sum("dst", 0, DST)? == format!("sum {:x}", fnv(&data)),
        "the target's bytes differ from what was written"
    );
    s.src.write(0, &vec![0; DST]).map_err(e2f)?;
    let read = [TransferRequest::read(s.src.id(), 0, s.dst, 0, DST as u64)];
    s.initiator
        .transfer(&s.peer, &read)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    ensure!(
        s.src.to_vec().map_err(e2f)? == data,
        "the bytes read back differ"
    );
    Ok(())
}

fn notifications_arrive_after_the_data_across_processes() -> Result<(), Failed> {
    let mut s = setup("", "")?;
    for round in 0..4u8 {
        let data = pattern(DST, round);
        s.src.write(0, &data).map_err(e2f)?;
        let options = TransferOptions {
            notify: Some(format!("round{round}").into_bytes()),
            ..TransferOptions::default()
        };
        let req = [TransferRequest::write(s.src.id(), 0, s.dst, 0, DST as u64)];
        let handle = s
            .initiator
            .transfer_with(&s.peer, &req, &options)
            .map_err(e2f)?;
        let got = s.target.cmd("notif 10000")?;
        ensure!(
            got == format!("notif round{round} {:x}", fnv(&data)),
            "round {round}: the notification came before the data, or not at all: `{got}`"
        );
        handle.wait().map_err(e2f)?;
    }
    Ok(())
}

fn a_region_registered_after_connect_is_reachable_through_a_new_connection() -> Result<(), Failed> {
    let mut s = setup("", "")?;
    // One batch first, so the first connection is surely in use.
    let first = [TransferRequest::write(s.src.id(), 0, s.dst, 0, 64)];
    s.initiator
        .transfer(&s.peer, &first)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    let answer = s.target.cmd("alloc late 65536")?;
    let late = RegionId(
        answer
            .strip_prefix("ok ")
            .ok_or(answer.clone())?
            .parse()
            .map_err(|_| answer.clone())?,
    );
    let data = pattern(65536, 42);
    s.src.write(0, &data).map_err(e2f)?;
    let connects = counter("connects");
    let req = [TransferRequest::write(s.src.id(), 0, late, 0, 65536)];
    s.initiator
        .transfer(&s.peer, &req)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    ensure!(
        counter("connects") > connects,
        "the backend reached the late region without a new connection (the fake's snapshot would refuse it)"
    );
    ensure!(
        s.target.sum("late", 0, 65536)? == format!("sum {:x}", fnv(&data)),
        "the late region did not receive the bytes"
    );
    Ok(())
}

fn a_request_over_the_descriptor_limit_is_split_not_truncated() -> Result<(), Failed> {
    // The fake's 4 KiB limit stands in for FlagCX's 32-bit descriptor size: a
    // 1 MiB + 123 byte request is what a 4 GiB + 123 byte one is to FlagCX.
    let mut s = setup("max_desc=4096", "")?;
    let len = (1 << 20) + 123;
    let data = pattern(len, 5);
    s.src.write(0, &data).map_err(e2f)?;
    let descs = counter("descs");
    let req = [TransferRequest::write(s.src.id(), 0, s.dst, 77, len as u64)];
    s.initiator
        .transfer(&s.peer, &req)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    let posted = counter("descs") - descs;
    ensure!(
        posted >= 257,
        "only {posted} descriptors were posted for {len} bytes at 4 KiB each"
    );
    ensure!(
        s.target.sum("dst", 77, len)? == format!("sum {:x}", fnv(&data)),
        "the target's bytes differ: the request was truncated or misplaced"
    );
    ensure!(
        s.target.sum("dst", 77 + len, 4096)? == format!("sum {:x}", fnv(&[0; 4096])),
        "bytes landed past the end of the request"
    );
    s.src.write(0, &vec![0; len]).map_err(e2f)?;
    let req = [TransferRequest::read(s.src.id(), 0, s.dst, 77, len as u64)];
    s.initiator
        .transfer(&s.peer, &req)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    let mut back = vec![0; len];
    s.src.read(0, &mut back).map_err(e2f)?;
    ensure!(back == data, "the split READ brought back different bytes");
    Ok(())
}

fn many_concurrent_batches_complete_and_no_transfer_is_queried_after_it_finished(
) -> Result<(), Failed> {
    let mut s = setup("max_desc=1024", "")?;
    let data = pattern(DST, 77);
    s.src.write(0, &data).map_err(e2f)?;
    let block = DST / 256;
    let s2 = Arc::new((s.initiator, s.peer.clone(), s.src.id(), s.dst));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let s2 = s2.clone();
            std::thread::spawn(move || -> Result<(), String> {
                let (initiator, peer, src, dst) = &*s2;
                let handles: Vec<_> = (0..64)
                    .map(|i| {
                        let off = ((t * 64 + i) * block) as u64;
                        initiator.transfer(
                            peer,
                            &[TransferRequest::write(*src, off, *dst, off, block as u64)],
                        )
                    })
                    .collect::<Result<_, _>>()
                    .map_err(|e| e.to_string())?;
                handles
                    .into_iter()
                    .try_for_each(|h| h.wait().map_err(|e| e.to_string()))
            })
        })
        .collect();
    for t in threads {
        t.join().map_err(|_| "a thread panicked")??;
    }
    ensure!(
        s.target.sum("dst", 0, DST)? == format!("sum {:x}", fnv(&data)),
        "the target's bytes differ"
    );
    ensure!(
        counter("misuse") == 0,
        "the backend queried {} transfer(s) after they finished",
        counter("misuse")
    );
    drop(s.src);
    drop(s2);
    Ok(())
}

fn main() {
    common::run_tests(vec![
        (
            "write_then_read_back_across_processes",
            write_then_read_back_across_processes,
        ),
        (
            "notifications_arrive_after_the_data_across_processes",
            notifications_arrive_after_the_data_across_processes,
        ),
        (
            "a_region_registered_after_connect_is_reachable_through_a_new_connection",
            a_region_registered_after_connect_is_reachable_through_a_new_connection,
        ),
        (
            "a_request_over_the_descriptor_limit_is_split_not_truncated",
            a_request_over_the_descriptor_limit_is_split_not_truncated,
        ),
        (
            "many_concurrent_batches_complete_and_no_transfer_is_queried_after_it_finished",
            many_concurrent_batches_complete_and_no_transfer_is_queried_after_it_finished,
        ),
    ]);
}
