//! Backend-level tests, one file per area; this module holds what they share: backends
//! on loopback, registered host and device memory, raw connections and frames.

use std::io::Read;
use std::net::TcpStream;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use te_core::{
    Access, Completion, MemoryDesc, MemoryKind, RegionId, Result, SegmentDesc, TransferBackend,
    TransferRequest,
};

use crate::endpoint::decode_endpoint;
use crate::wire::{Header, Kind, HEADER_LEN};
use crate::{TcpBackend, TcpConfig};

mod deadlines;
mod failures;
mod handshake;
mod hostile;
mod listener;
mod samehost;
mod samehost_waves;
mod transfer;

use te_core::testkit::{pattern, soon};

fn backend(f: impl FnOnce(&mut TcpConfig)) -> TcpBackend {
    let mut c = TcpConfig::default();
    f(&mut c);
    TcpBackend::new(c, &te_core::BackendContext::default()).expect("backend")
}

fn segment(b: &TcpBackend) -> SegmentDesc {
    te_core::testkit::segment(crate::NAME, b.endpoint(), String::new(), Vec::new())
}

/// Registers `v` as region `id`.
fn register(b: &TcpBackend, id: u64, v: &mut [u8], access: Access) {
    let mem = MemoryDesc {
        name: "m".into(),
        addr: v.as_mut_ptr() as u64,
        len: v.len() as u64,
        kind: MemoryKind::Host,
        access,
    };
    b.register(RegionId(id), &mem).expect("register");
}

/// Submits `reqs` and waits for the batch's result.
fn run(b: &TcpBackend, peer: te_core::PeerId, reqs: &[TransferRequest]) -> Result<()> {
    let (tx, rx) = mpsc::channel();
    let done = Completion::new(Duration::from_secs(10), move |r, _| {
        let _ = tx.send(r);
    });
    b.submit(peer, reqs, done)?;
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the batch completed")
}

/// Registers `remote` as region 1 of `target` and `local` as region 1 of `init`, then
/// connects `init` to `target`.
fn connected(
    target: &TcpBackend,
    remote: &mut [u8],
    init: &TcpBackend,
    local: &mut [u8],
) -> te_core::PeerId {
    register(target, 1, remote, Access::REMOTE_READ_WRITE);
    register(init, 1, local, Access::LOCAL);
    init.connect(&segment(target), soon()).unwrap()
}

/// A raw data connection that passed the handshake.
fn raw(target: &TcpBackend) -> TcpStream {
    let crate::endpoint::Endpoint { addr, instance, .. } =
        decode_endpoint(&target.endpoint()).unwrap();
    let mut s = TcpStream::connect(addr).unwrap();
    crate::handshake::handshake(&mut s, "raw", instance, None).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

fn read_header(s: &mut TcpStream) -> Header {
    let mut b = [0u8; HEADER_LEN];
    s.read_exact(&mut b).unwrap();
    Header::decode(&b).unwrap()
}

/// Device memory of `fakedev:0`, freed on drop.
struct DevMem {
    rt: std::sync::Arc<dyn te_core::device::DeviceRuntime>,
    addr: u64,
    len: usize,
}

impl DevMem {
    fn new(len: usize) -> DevMem {
        let rt = te_core::device::runtime(te_core::device::fakedev::NAME).expect("fakedev");
        let addr = rt.alloc(0, len).expect("alloc");
        DevMem { rt, addr, len }
    }

    fn register(&self, b: &TcpBackend, id: u64, access: Access) {
        let mem = MemoryDesc {
            name: "d".into(),
            addr: self.addr,
            len: self.len as u64,
            kind: MemoryKind::Device {
                runtime: te_core::device::fakedev::NAME.into(),
                ordinal: 0,
            },
            access,
        };
        b.register(RegionId(id), &mem).expect("register");
    }

    fn fill(&self, v: &[u8]) {
        let copy = te_core::device::DeviceCopy::ToDevice {
            ordinal: 0,
            device: self.addr,
            host: v.as_ptr() as *mut u8,
            len: v.len().min(self.len),
        };
        // SAFETY: `v` outlives the synchronous copy, which stays inside the allocation.
        unsafe { self.rt.copy_sync(copy) }.expect("copy");
    }

    fn read(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        let copy = te_core::device::DeviceCopy::ToHost {
            ordinal: 0,
            device: self.addr,
            host: v.as_mut_ptr(),
            len: self.len,
        };
        // SAFETY: `v` outlives the synchronous copy and holds `len` bytes.
        unsafe { self.rt.copy_sync(copy) }.expect("copy");
        v
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        let _ = self.rt.free(0, self.addr);
    }
}

/// Waits, bounded, until `f` holds.
fn eventually(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + limit;
    while !f() {
        assert!(
            Instant::now() < end,
            "{what} did not happen within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Reads what the target sends until it closes `s` (true) or 5 s pass (false).
fn read_until_closed(s: &mut TcpStream) -> (Vec<u8>, bool) {
    let end = Instant::now() + Duration::from_secs(5);
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut got = Vec::new();
    while Instant::now() < end {
        let mut b = [0u8; 4096];
        match s.read(&mut b) {
            Ok(0) => return (got, true),
            Ok(n) => got.extend_from_slice(&b[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return (got, true),
            Err(_) => {}
        }
    }
    (got, false)
}

/// A scatter-gather request's header and entry list, as a raw peer may send it: `len`
/// and the entry count are taken as given, whatever the entries add up to.
fn sg_frame(kind: Kind, id: u64, region: u64, entries: &[(u64, u64)], len: u64) -> Vec<u8> {
    sg_frame_counted(kind, id, region, entries, entries.len() as u32, len)
}

fn sg_frame_counted(
    kind: Kind,
    id: u64,
    region: u64,
    entries: &[(u64, u64)],
    count: u32,
    len: u64,
) -> Vec<u8> {
    let h = Header {
        kind,
        code: count,
        id,
        region,
        offset: 0,
        len,
    };
    let mut b = h.encode().to_vec();
    for &(offset, len) in entries {
        crate::wire::Entry { offset, len }.encode_into(&mut b);
    }
    b
}

/// A host buffer whose first `len` bytes are registered and whose last 4 KiB are a
/// canary that nothing may touch.
struct Guarded {
    v: Vec<u8>,
    len: usize,
}

impl Guarded {
    const CANARY: u8 = 0xC5;

    fn new(len: usize, fill: u8) -> Guarded {
        let mut v = vec![fill; len + 4096];
        v[len..].fill(Self::CANARY);
        Guarded { v, len }
    }

    fn register(&mut self, b: &TcpBackend, id: u64, access: Access) {
        let len = self.len;
        register(b, id, &mut self.v[..len], access);
    }

    fn assert_untouched(&self, fill: u8, what: &str) {
        assert!(
            self.v[..self.len].iter().all(|&b| b == fill),
            "{what}: a byte landed in the region"
        );
        assert!(
            self.v[self.len..].iter().all(|&b| b == Self::CANARY),
            "{what}: a byte landed past the region's end"
        );
    }
}
