//! Requests that must be refused, before anything is posted or by the target.

use std::time::Duration;

use libtest_mimic::Failed;

use super::harness::{soon, Harness, Pair};
use super::{e2f, expect_kind, fail};
use crate::{Access, Completion, ErrorKind, MemoryDesc, MemoryKind, RegionId, TransferRequest};

pub(super) fn out_of_bounds_requests_are_refused_before_posting(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(false, 4096)?;
    p.local.write(0, &[9; 4096]).map_err(e2f)?;
    let (l, r) = (p.local.id(), p.remote_desc.id);
    let cases = [
        (
            TransferRequest::write(l, 0, r, 4000, 200),
            "remote end past the region",
        ),
        (
            TransferRequest::write(l, 4000, r, 0, 200),
            "local end past the region",
        ),
        (
            TransferRequest::write(l, 0, r, u64::MAX - 10, 100),
            "remote offset overflowing",
        ),
        (
            TransferRequest::read(l, 0, r, 0, 4097),
            "read longer than the region",
        ),
    ];
    refused_after(&p, TransferRequest::write(l, 0, r, 0, 16), cases)
}

/// Checks that each of `cases`, after the good request `before` in one batch, fails the
/// batch as out of bounds, and that the target's buffer is untouched.
fn refused_after<const N: usize>(
    p: &Pair,
    before: TransferRequest,
    cases: [(TransferRequest, &str); N],
) -> Result<(), Failed> {
    for (req, what) in cases {
        expect_kind(
            p.initiator.transfer(&p.peer, &[before, req]),
            ErrorKind::OutOfBounds,
            what,
        )?;
    }
    ensure!(
        p.remote.to_vec().map_err(e2f)? == vec![0; 4096],
        "a refused batch changed the target's memory"
    );
    Ok(())
}

/// A batch whose requests alternate between regions of different sizes, on both
/// sides: each request is checked against its own two regions, never the ones the
/// request before it named.
pub(super) fn each_request_is_checked_against_its_own_regions(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(false, 4096)?;
    let big = p.initiator.alloc("big", 8192, Access::LOCAL).map_err(e2f)?;
    let far = p.target.alloc("far", 8192, Access::REMOTE_READ_WRITE)?;
    let (l, r, far) = (p.local.id(), p.remote_desc.id, far.id());
    let fits_big = TransferRequest::write(big.id(), 6000, r, 0, 16);
    let cases = [
        (
            TransferRequest::write(l, 6000, r, 0, 16),
            "local offset inside the region before, outside its own",
        ),
        (
            TransferRequest::write(big.id(), 0, r, 6000, 16),
            "remote offset inside the region before, outside its own",
        ),
    ];
    refused_after(
        &p,
        TransferRequest::write(big.id(), 6000, far, 6000, 16),
        cases,
    )?;
    // Alternating the other way, every request in its own bounds: it moves.
    let ok = [
        fits_big,
        TransferRequest::write(l, 0, far, 6000, 16),
        TransferRequest::write(big.id(), 0, r, 16, 16),
    ];
    p.initiator
        .transfer(&p.peer, &ok)
        .map_err(e2f)?
        .wait()
        .map_err(e2f)
}

pub(super) fn unknown_region_requests_are_refused_before_posting(
    h: &Harness,
) -> Result<(), Failed> {
    let p = h.pair(false, 4096)?;
    let req = TransferRequest::write(p.local.id(), 0, RegionId(987_654), 0, 16);
    expect_kind(
        p.initiator.transfer(&p.peer, &[req]),
        ErrorKind::NotRegistered,
        "unknown remote region",
    )?;
    let req = TransferRequest::write(RegionId(987_654), 0, p.remote_desc.id, 0, 16);
    expect_kind(
        p.initiator.transfer(&p.peer, &[req]),
        ErrorKind::NotRegistered,
        "unknown local region",
    )
}

pub(super) fn zero_length_requests_are_refused(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(false, 4096)?;
    let req = TransferRequest::write(p.local.id(), 0, p.remote_desc.id, 0, 0);
    expect_kind(
        p.initiator.transfer(&p.peer, &[req]),
        ErrorKind::InvalidRequest,
        "zero length",
    )
}

pub(super) fn deregistered_regions_are_refused(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(false, 4096)?;
    let extra = p
        .initiator
        .alloc("extra", 4096, Access::LOCAL)
        .map_err(e2f)?;
    let gone = extra.id();
    drop(extra);
    let req = TransferRequest::write(gone, 0, p.remote_desc.id, 0, 16);
    expect_kind(
        p.initiator.transfer(&p.peer, &[req]),
        ErrorKind::NotRegistered,
        "deregistered local region",
    )?;
    // A remote region deregistered after the initiator fetched the descriptor is still
    // listed there; the target's own check refuses it and the batch fails.
    let target_extra = p.target.alloc("gone", 4096, Access::REMOTE_READ_WRITE)?;
    let peer = p
        .initiator
        .connect(&p.target.address().to_string())
        .map_err(e2f)?;
    let _ = peer.region("gone");
    let stale = p.initiator.transfer(&peer, &[]).map_err(e2f)?;
    stale.wait().map_err(e2f)?;
    let rid = target_extra.id();
    let probe = TransferRequest::write(p.local.id(), 0, rid, 0, 16);
    // Make sure the initiator knows the region before it goes away.
    p.initiator
        .transfer(&peer, &[probe])
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    drop(target_extra);
    match p.initiator.transfer(&peer, &[probe]) {
        Err(e) if e.kind() == ErrorKind::NotRegistered => Ok(()),
        Err(e) => Err(fail(format!("expected NotRegistered, got {e:?}"))),
        Ok(handle) => expect_kind(
            handle.wait(),
            ErrorKind::NotRegistered,
            "write into a deregistered remote region",
        ),
    }
}

pub(super) fn a_write_into_a_region_without_remote_write_is_refused(
    h: &Harness,
) -> Result<(), Failed> {
    let p = h.pair(false, 4096)?;
    let ro = p.target.alloc("ro", 4096, Access::REMOTE_READ)?;
    let peer = p
        .initiator
        .connect(&p.target.address().to_string())
        .map_err(e2f)?;
    let req = TransferRequest::write(p.local.id(), 0, ro.id(), 0, 16);
    expect_kind(
        p.initiator.transfer(&peer, &[req]),
        ErrorKind::InvalidRequest,
        "write into a read-only region",
    )
}

pub(super) fn a_read_of_a_region_without_remote_read_is_refused(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(false, 4096)?;
    let wo = p.target.alloc(
        "wo",
        4096,
        Access {
            remote_read: false,
            remote_write: true,
        },
    )?;
    let peer = p
        .initiator
        .connect(&p.target.address().to_string())
        .map_err(e2f)?;
    let req = TransferRequest::read(p.local.id(), 0, wo.id(), 0, 16);
    expect_kind(
        p.initiator.transfer(&peer, &[req]),
        ErrorKind::InvalidRequest,
        "read of a write-only region",
    )
}

pub(super) fn requests_with_unsupported_memory_are_refused_at_register(
    h: &Harness,
) -> Result<(), Failed> {
    let e = h.engine(h.config(), "mem")?;
    let desc = MemoryDesc {
        name: "dev".into(),
        addr: 0x1000,
        len: 4096,
        kind: MemoryKind::Device {
            runtime: "nosuchruntime".into(),
            ordinal: 0,
        },
        access: Access::LOCAL,
    };
    // SAFETY: the registration is refused before anything touches the address.
    expect_kind(
        unsafe { e.register(desc) },
        ErrorKind::Unsupported,
        "unknown device runtime",
    )
}

pub(super) fn a_block_write_outside_its_slot_is_refused_by_the_target(
    h: &Harness,
) -> Result<(), Failed> {
    let (bpb, blocks) = (1024u64, 4u64);
    let slot = (bpb * blocks) as usize;
    let p = h.pair(false, 2 * slot)?;
    p.target.two_slot_layout("kv", &p.remote, bpb, blocks)?;
    let peer = p.initiator.connect(&p.target.address()).map_err(e2f)?;
    p.initiator
        .transfer(&peer, &[])
        .map_err(e2f)?
        .wait()
        .map_err(e2f)?;
    let layout = match peer.kv_layout("kv") {
        Some(l) => l,
        None => {
            // The descriptor was fetched before the layout: fetch it again.
            let probe = TransferRequest::write(p.local.id(), 0, RegionId(u64::MAX), 0, 1);
            let _ = p.initiator.transfer(&peer, &[probe]);
            peer.kv_layout("kv")
                .ok_or_else(|| fail("the target's layout is not in its descriptor"))?
        }
    };
    let key = layout.groups[0].slots[0].region;
    // Block `blocks` of the key slot (one past its end) lies in the value slot.
    let beyond = TransferRequest::write(p.local.id(), 0, key, bpb * blocks, bpb);
    expect_kind(
        p.initiator.transfer(&peer, &[beyond]),
        ErrorKind::OutOfBounds,
        "the initiator's own check of a block outside its slot",
    )?;
    // Below the engine, with a descriptor whose slot is forged larger: only the
    // target's own check stands between the request and the neighbouring slot.
    let raw = h.raw_backend()?;
    let mut src = vec![0xabu8; bpb as usize];
    let local = MemoryDesc {
        name: "forger".into(),
        addr: src.as_mut_ptr() as u64,
        len: src.len() as u64,
        kind: MemoryKind::Host,
        access: Access::LOCAL,
    };
    raw.register(RegionId(1), &local).map_err(e2f)?;
    let mut forged = (*peer.segment()).clone();
    for r in forged.regions.iter_mut().filter(|r| r.id == key) {
        r.len = 2 * bpb * blocks;
    }
    let result = (|| {
        let id = raw.connect(&forged, soon()).map_err(e2f)?;
        let (tx, rx) = std::sync::mpsc::channel();
        let done = Completion::new(Duration::from_secs(10), move |r, _| {
            let _ = tx.send(r);
        });
        let req = TransferRequest::write(RegionId(1), 0, key, bpb * blocks, bpb);
        match raw.submit(id, &[req], done) {
            Err(_) => Ok(()),
            Ok(()) => match rx.recv_timeout(Duration::from_secs(10)) {
                Ok(Err(_)) => Ok(()),
                Ok(Ok(())) => Err(fail("the target accepted a write outside the slot")),
                Err(_) => Err(fail("the forged write never completed")),
            },
        }
    })();
    raw.deregister(RegionId(1), soon()).map_err(e2f)?;
    drop(raw);
    result?;
    let bytes = p.remote.to_vec().map_err(e2f)?;
    ensure!(
        bytes[slot..] == vec![0; slot][..],
        "the value slot was written through the key slot"
    );
    Ok(())
}
