//! Transfers that must work: data moves, completes once, notifications follow data.

use crate::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use libtest_mimic::Failed;

use super::harness::{soon, Harness};
use super::{e2f, fail, pattern};
use crate::{
    Access, Completion, MemoryDesc, MemoryKind, RegionDesc, RegionId, SegmentDesc, TransferOptions,
    TransferRequest, TransferStatus,
};

pub(super) fn an_empty_batch_completes(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(false, 4096)?;
    let handle = p.initiator.transfer(&p.peer, &[]).map_err(e2f)?;
    ensure!(
        handle
            .wait_timeout(Duration::from_secs(5))
            .is_some_and(|r| r.is_ok()),
        "empty batch did not complete"
    );
    ensure!(
        matches!(handle.status(), TransferStatus::Done),
        "status is not Done"
    );
    Ok(())
}

pub(super) fn write_then_read_back_gives_the_same_bytes(h: &Harness) -> Result<(), Failed> {
    let len = 1 << 20;
    let p = h.pair(false, len)?;
    let data = pattern(len, 7);
    p.local.write(0, &data).map_err(e2f)?;
    let rid = p.remote_desc.id;
    // Four requests, one per quarter, written out of order.
    let q = (len / 4) as u64;
    let writes: Vec<_> = [3u64, 0, 2, 1]
        .iter()
        .map(|&i| TransferRequest::write(p.local.id(), i * q, rid, i * q, q))
        .collect();
    p.initiator
        .transfer(&p.peer, &writes)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    ensure!(
        p.remote.to_vec().map_err(e2f)? == data,
        "the target's bytes differ from what was written"
    );
    p.local.write(0, &vec![0; len]).map_err(e2f)?;
    let reads = [TransferRequest::read(p.local.id(), 0, rid, 0, len as u64)];
    p.initiator
        .transfer(&p.peer, &reads)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    ensure!(
        p.local.to_vec().map_err(e2f)? == data,
        "bytes read back differ"
    );
    Ok(())
}

pub(super) fn the_stages_a_backend_times_lie_within_their_batch(h: &Harness) -> Result<(), Failed> {
    let len = 1 << 20;
    let p = h.pair(false, len)?;
    let write = [TransferRequest::write(
        p.local.id(),
        0,
        p.remote_desc.id,
        0,
        len as u64,
    )];
    for _ in 0..4 {
        let handle = p.initiator.transfer(&p.peer, &write).map_err(e2f)?;
        handle.wait().map_err(e2f)?;
        let Some(t) = handle.telemetry() else {
            return Err(fail("an ended batch tells no telemetry"));
        };
        // A stage the backend does not time is `None`; one it times is inside the batch.
        for (stage, d) in [("queued", t.queued), ("wire", t.wire), ("device", t.device)] {
            if let Some(d) = d {
                ensure!(
                    d <= t.duration,
                    "{stage} took {d:?} of a batch that took {:?}",
                    t.duration
                );
            }
        }
        ensure!(
            t.queued.is_some() == t.wire.is_some(),
            "queued is known exactly when the wire is timed: {t:?}"
        );
    }
    Ok(())
}

pub(super) fn completion_is_delivered_exactly_once(h: &Harness) -> Result<(), Failed> {
    // Straight at the backend, below the engine, which would hide a second completion.
    let (a, b) = (h.raw_backend()?, h.raw_backend()?);
    let (mut src, mut dst) = (vec![1u8; 4096], vec![0u8; 4096]);
    let desc = |v: &mut Vec<u8>, access| MemoryDesc {
        name: "m".into(),
        addr: v.as_mut_ptr() as u64,
        len: v.len() as u64,
        kind: MemoryKind::Host,
        access,
    };
    a.register(RegionId(1), &desc(&mut src, Access::LOCAL))
        .map_err(e2f)?;
    let key = b
        .register(RegionId(1), &desc(&mut dst, Access::REMOTE_READ_WRITE))
        .map_err(e2f)?;
    let seg = SegmentDesc {
        engine: "b".into(),
        epoch: 1,
        address: String::new(),
        backend: b.info().name.clone(),
        endpoint: b.endpoint(),
        regions: vec![RegionDesc {
            id: RegionId(1),
            name: "m".into(),
            addr: dst.as_ptr() as u64,
            len: 4096,
            kind: MemoryKind::Host,
            access: Access::REMOTE_READ_WRITE,
            key,
        }],
        layouts: Vec::new(),
    };
    let peer = a.connect(&seg, soon()).map_err(e2f)?;
    let n = 64;
    let counts: Arc<Vec<AtomicUsize>> = Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
    for i in 0..n {
        let c = counts.clone();
        let done = Completion::new(Duration::from_secs(10), move |_, _| {
            c[i].fetch_add(1, Ordering::SeqCst);
        });
        let req =
            TransferRequest::write(RegionId(1), 64 * i as u64, RegionId(1), 64 * i as u64, 64);
        if a.submit(peer, &[req], done).is_err() {
            return Err(fail(format!("submit {i} failed")));
        }
    }
    let end = Instant::now() + Duration::from_secs(10);
    while counts.iter().any(|c| c.load(Ordering::SeqCst) == 0) && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(50));
    for (i, c) in counts.iter().enumerate() {
        let c = c.load(Ordering::SeqCst);
        ensure!(c == 1, "batch {i} completed {c} times");
    }
    a.deregister(RegionId(1), soon()).map_err(e2f)?;
    b.deregister(RegionId(1), soon()).map_err(e2f)?;
    Ok(())
}

pub(super) fn notifications_arrive_after_the_data(h: &Harness) -> Result<(), Failed> {
    let len = 256 << 10;
    let p = h.pair(false, len)?;
    for round in 0..8u8 {
        let data = pattern(len, round);
        p.local.write(0, &data).map_err(e2f)?;
        let options = TransferOptions {
            notify: Some(vec![round]),
            ..TransferOptions::default()
        };
        let req = TransferRequest::write(p.local.id(), 0, p.remote_desc.id, 0, len as u64);
        let handle = p
            .initiator
            .transfer_with(&p.peer, &[req], &options)
            .map_err(e2f)?;
        let n = p
            .target
            .recv_notification(Duration::from_secs(10))?
            .ok_or_else(|| fail("no notification within 10 s"))?;
        // The data must already be there when the notification is seen.
        ensure!(
            p.remote.to_vec().map_err(e2f)? == data,
            "round {round}: notification arrived before the data"
        );
        ensure!(
            n.message == [round] && n.from_epoch == p.initiator.epoch(),
            "round {round}: wrong notification {n:?}"
        );
        handle.wait().map_err(e2f)?;
    }
    Ok(())
}

pub(super) fn many_concurrent_batches_from_several_threads_all_complete(
    h: &Harness,
) -> Result<(), Failed> {
    let threads = 4;
    let per_thread = 50;
    let block = 4096usize;
    let p = h.pair(false, threads * per_thread * block)?;
    p.local
        .write(0, &pattern(threads * per_thread * block, 3))
        .map_err(e2f)?;
    let errors = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for t in 0..threads {
            let (p, errors) = (&p, &errors);
            s.spawn(move || {
                let mut handles = Vec::new();
                for i in 0..per_thread {
                    let off = ((t * per_thread + i) * block) as u64;
                    let req = TransferRequest::write(
                        p.local.id(),
                        off,
                        p.remote_desc.id,
                        off,
                        block as u64,
                    );
                    match p.initiator.transfer(&p.peer, &[req]) {
                        Ok(hd) => handles.push(hd),
                        Err(e) => errors.lock().push(e.to_string()),
                    }
                }
                for hd in handles {
                    if let Err(e) = hd.wait() {
                        errors.lock().push(e.to_string());
                    }
                }
            });
        }
    });
    let errors = errors.into_inner();
    ensure!(
        errors.is_empty(),
        "{} batches failed, first: {}",
        errors.len(),
        errors[0]
    );
    ensure!(
        p.remote.to_vec().map_err(e2f)? == p.local.to_vec().map_err(e2f)?,
        "the target's bytes differ"
    );
    Ok(())
}

pub(super) fn a_second_connect_returns_the_cached_peer(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(false, 4096)?;
    let again = p
        .initiator
        .connect(&p.target.address().to_string())
        .map_err(e2f)?;
    ensure!(
        again.epoch() == p.peer.epoch() && again.epoch() == p.target.epoch(),
        "epochs differ"
    );
    ensure!(
        Arc::ptr_eq(&again.segment(), &p.peer.segment()),
        "a second connect did a new handshake"
    );
    Ok(())
}

pub(super) fn regions_registered_after_connect_are_reachable(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(false, 4096)?;
    let late = p.target.alloc("late", 4096, Access::REMOTE_READ_WRITE)?;
    p.local.write(0, &[5; 64]).map_err(e2f)?;
    let req = TransferRequest::write(p.local.id(), 0, late.id(), 0, 64);
    p.initiator
        .transfer(&p.peer, &[req])
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    let mut got = [0u8; 64];
    late.read(0, &mut got).map_err(e2f)?;
    ensure!(got == [5; 64], "the late region did not receive the bytes");
    Ok(())
}
