//! Helpers for tests that drive one backend directly, without an engine: what every
//! backend crate's own tests need (a recognisable pattern, a short deadline, a peer's
//! descriptor, a batch run to its end, a connected pair with host memory, a test list
//! run as a binary's `main`).

use std::sync::mpsc;
use std::time::Duration;

use libtest_mimic::{Arguments, Failed, Trial};

use crate::{
    Access, Completion, Deadline, MemoryDesc, MemoryKind, PeerId, RegionDesc, RegionId, Result,
    SegmentDesc, TransferBackend,
};

/// Byte `i` of [`pattern`]`(_, seed)`: every byte of a 4 GiB range depends on all of its
/// index's bits, so a block that lands at the wrong place (even a multiple of 256 bytes
/// or of 64 KiB away) does not match.
pub fn byte(i: u64, seed: u8) -> u8 {
    let x = (i ^ u64::from(seed) << 40).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (x >> 56) as u8
}

/// `len` bytes of a recognisable pattern; another `seed`, another pattern.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len as u64).map(|i| byte(i, seed)).collect()
}

/// A deadline for calls that should be quick (10 s).
pub fn soon() -> Deadline {
    Deadline::after(Duration::from_secs(10))
}

/// A host buffer as [`TransferBackend::register`] takes it.
pub fn host_memory(buf: &[u8], access: Access) -> MemoryDesc {
    MemoryDesc {
        name: String::new(),
        addr: buf.as_ptr() as u64,
        len: buf.len() as u64,
        kind: MemoryKind::Host,
        access,
    }
}

/// Region `id` over a peer's host buffer, with the `key` its backend returned, as the
/// peer's descriptor lists it (remotely readable and writable).
pub fn host_region(id: u64, buf: &[u8], key: Vec<u8>) -> RegionDesc {
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

/// The descriptor of a `backend` peer at `endpoint` (its control plane at `address`,
/// empty where the backend needs none), listing `regions`.
pub fn segment(
    backend: &str,
    endpoint: Vec<u8>,
    address: String,
    regions: Vec<RegionDesc>,
) -> SegmentDesc {
    SegmentDesc {
        engine: "target".into(),
        epoch: 1,
        address,
        backend: backend.into(),
        endpoint,
        regions,
        layouts: Vec::new(),
    }
}

/// Submits `requests` to `peer` and waits (at most `limit`, twice over) for the batch's
/// result.
///
/// # Panics
/// If the batch does not complete within twice `limit`.
pub fn run_batch(
    b: &dyn TransferBackend,
    peer: PeerId,
    requests: &[crate::TransferRequest],
    limit: Duration,
) -> Result<()> {
    let (tx, rx) = mpsc::channel();
    let done = Completion::new(limit, move |r, _| {
        let _ = tx.send(r);
    });
    b.submit(peer, requests, done)?;
    rx.recv_timeout(limit * 2).expect("the batch completes")
}

/// Two backends connected over host memory: the target's region 1 (`dst`, remotely
/// writable), the initiator's region 1 (`src`, filled with [`pattern`]`(_, 9)`).
#[derive(Debug)]
pub struct HostPair<B> {
    /// The target.
    pub target: B,
    /// The initiator, connected to the target as `peer`.
    pub initiator: B,
    /// The target's buffer.
    pub dst: Vec<u8>,
    /// The initiator's buffer.
    pub src: Vec<u8>,
    /// The target, as the initiator names it.
    pub peer: PeerId,
}

/// A backend, or a test's wrapper of one (with the control plane it needs, say).
pub trait AsBackend {
    /// The backend.
    fn backend(&self) -> &dyn TransferBackend;
}

impl<T: TransferBackend> AsBackend for T {
    fn backend(&self) -> &dyn TransferBackend {
        self
    }
}

impl<B: AsBackend> HostPair<B> {
    /// Makes both backends with `make`, registers `len` bytes on each, and connects the
    /// initiator with the descriptor `segment_of(target, regions)` gives.
    ///
    /// # Errors
    /// The backends' own, from registering or connecting.
    pub fn new(
        len: usize,
        make: impl Fn() -> B,
        segment_of: impl Fn(&B, Vec<RegionDesc>) -> SegmentDesc,
    ) -> Result<HostPair<B>> {
        let target = make();
        let dst = vec![0u8; len];
        let key = target
            .backend()
            .register(RegionId(1), &host_memory(&dst, Access::REMOTE_READ_WRITE))?;
        let initiator = make();
        let src = pattern(len, 9);
        initiator
            .backend()
            .register(RegionId(1), &host_memory(&src, Access::LOCAL))?;
        let peer = initiator.backend().connect(
            &segment_of(&target, vec![host_region(1, &dst, key)]),
            soon(),
        )?;
        Ok(HostPair {
            target,
            initiator,
            dst,
            src,
            peer,
        })
    }
}

/// A test that drives a backend directly.
pub type DirectTest = fn() -> std::result::Result<(), Failed>;

/// Runs `tests` as a test binary's `main` does (one at a time where `serial`: tests that
/// share a process-wide fake), each named `PREFIX::NAME`, exiting with the result.
pub fn run_tests(prefix: &str, tests: Vec<(&'static str, DirectTest)>, serial: bool) -> ! {
    let mut args = Arguments::from_args();
    if serial {
        args.test_threads = Some(1);
    }
    let trials = tests
        .into_iter()
        .map(|(name, f)| {
            let name = if prefix.is_empty() {
                name.to_string()
            } else {
                format!("{prefix}::{name}")
            };
            Trial::test(name, f)
        })
        .collect();
    libtest_mimic::run(&args, trials).exit()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_moved_by_a_power_of_two_does_not_match_the_pattern() {
        let p = pattern(1 << 20, 1);
        for shift in [256usize, 4096, 32 << 10, 64 << 10] {
            assert_ne!(p[..4096], p[shift..shift + 4096], "shift {shift}");
        }
        assert_ne!(pattern(4096, 1), pattern(4096, 2));
    }
}
