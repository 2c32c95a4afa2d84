//! What the tests that drive `FlagcxBackend` directly over the FAKE shim share: memory
//! the fake's threads write into, backends, registrations, forged descriptors,
//! completions, counting this process's threads, the fake's counters, and a peer that
//! answers only its first handshake.

#![allow(dead_code)]

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::mpsc::{self, Receiver};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use te_core::{
    Access, Completion, Deadline, MemoryDesc, MemoryKind, PeerId, RegionDesc, RegionId,
    SegmentDesc, TransferBackend, TransferRequest,
};
use te_flagcx::{FlagcxBackend, FlagcxConfig};

/// The size of most test regions.
pub const LEN: usize = 64 << 10;

static SERIAL: Mutex<()> = Mutex::new(());

/// Runs tests one at a time: some count this process's threads.
pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The fake shim this crate's build compiled.
pub fn shim() -> &'static str {
    match option_env!("TE_FLAGCX_FAKE_SHIM_PATH") {
        Some(p) => p,
        None => {
            panic!("the fake FlagCX shim was not built (no C compiler?); see the build warnings")
        }
    }
}

/// Page-aligned, zeroed memory the fake's threads write into behind Rust's back.
pub struct Mem {
    ptr: *mut u8,
    layout: Layout,
}
// SAFETY: a plain heap allocation, only read and written through raw copies.
unsafe impl Send for Mem {}
// SAFETY: as above.
unsafe impl Sync for Mem {}

impl Mem {
    pub fn new(len: usize) -> Mem {
        let layout = Layout::from_size_align(len, 4096).expect("layout");
        // SAFETY: non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        Mem { ptr, layout }
    }
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }
    pub fn len(&self) -> usize {
        self.layout.size()
    }
    pub fn write(&self, data: &[u8]) {
        assert!(data.len() <= self.len());
        // SAFETY: in bounds.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr, data.len()) };
    }
    pub fn read(&self) -> Vec<u8> {
        let mut out = vec![0; self.len()];
        // SAFETY: in bounds.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr, out.as_mut_ptr(), out.len()) };
        out
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr, self.layout) };
    }
}

/// A backend over the fake shim with these shim options.
pub fn backend(options: &str) -> FlagcxBackend {
    let mut config = FlagcxConfig::default();
    config.shim = Some(shim().into());
    config.shim_options = options.to_string();
    FlagcxBackend::new(config).expect("a backend over the fake shim")
}

/// Registers `mem` as region `id` with `access`; returns its descriptor.
pub fn register(b: &FlagcxBackend, id: u64, mem: &Mem, access: Access) -> RegionDesc {
    let desc = MemoryDesc {
        name: format!("r{id}"),
        addr: mem.addr(),
        len: mem.len() as u64,
        kind: MemoryKind::Host,
        access,
    };
    let key = b.register(RegionId(id), &desc).expect("register");
    RegionDesc {
        id: RegionId(id),
        name: desc.name,
        addr: desc.addr,
        len: desc.len,
        kind: desc.kind,
        access,
        key,
    }
}

/// A region descriptor as a (possibly hostile) peer writes it.
pub fn region(id: u64, addr: u64, len: u64, access: Access) -> RegionDesc {
    RegionDesc {
        id: RegionId(id),
        name: format!("r{id}"),
        addr,
        len,
        kind: MemoryKind::Host,
        access,
        key: Vec::new(),
    }
}

/// A segment descriptor of instance epoch 1 at control-plane `address`.
pub fn segment(endpoint: Vec<u8>, address: &str, regions: Vec<RegionDesc>) -> SegmentDesc {
    SegmentDesc {
        engine: "target".into(),
        epoch: 1,
        address: address.into(),
        backend: te_flagcx::NAME.into(),
        endpoint,
        regions,
        layouts: Vec::new(),
    }
}

/// Where a completion's result arrives.
pub type Done = Receiver<te_core::Result<()>>;

/// A completion with `timeout` that sends its result.
pub fn completion(timeout: Duration) -> (Completion, Done) {
    let (tx, rx) = mpsc::channel();
    let c = Completion::new(timeout, move |r, _| {
        let _ = tx.send(r);
    });
    (c, rx)
}

/// Connects within 10 s.
pub fn connect(b: &FlagcxBackend, seg: &SegmentDesc) -> PeerId {
    b.connect(seg, Deadline::after(Duration::from_secs(10)))
        .expect("connect")
}

/// Runs one request with a 5 s deadline; `None` if it had not completed 8 s later.
pub fn run(b: &FlagcxBackend, peer: PeerId, req: TransferRequest) -> Option<te_core::Result<()>> {
    let (done, rx) = completion(Duration::from_secs(5));
    if let Err(e) = b.submit(peer, &[req], done) {
        return Some(Err(e));
    }
    rx.recv_timeout(Duration::from_secs(8)).ok()
}

/// A process-wide counter of the fake shim (see `te_flagcx_fake_counter` in
/// fake/fake_shim.c), shared with the backends under test, which load the same library.
pub fn fake_counter(name: &str) -> u64 {
    type FakeCounter = unsafe extern "C" fn(*const std::ffi::c_char) -> u64;
    static LIB: std::sync::OnceLock<libloading::Library> = std::sync::OnceLock::new();
    // SAFETY: the fake shim's initializers do nothing; loading the path the backends
    // load gives the same library, so this reads their counters.
    let lib =
        LIB.get_or_init(|| unsafe { libloading::Library::new(shim()) }.expect("load the fake"));
    // SAFETY: `te_flagcx_fake_counter` has this signature in fake/fake_shim.c.
    let f = unsafe { lib.get::<FakeCounter>(b"te_flagcx_fake_counter\0") }
        .expect("fake counter symbol");
    let c = std::ffi::CString::new(name).expect("no NUL");
    // SAFETY: `c` is a valid C string for the duration of the call.
    unsafe { f(c.as_ptr()) }
}

/// Threads of this process whose name starts with `prefix` (comm is cut at 15 bytes).
pub fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.flatten()
                .filter(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|c| c.trim_end().starts_with(prefix))
                })
                .count()
        })
        .unwrap_or(0)
}

/// A FAKE-protocol peer that answers the first handshake with one region and leaves
/// every later connection unanswered (in its listener's backlog). Returns its endpoint
/// and a sender that ends it.
pub fn answers_once(addr: u64, len: u64) -> (String, mpsc::Sender<()>) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let ep = l.local_addr().expect("addr").to_string();
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        let Ok((mut s, _)) = l.accept() else { return };
        let mut hello = [0u8; 8];
        if s.read_exact(&mut hello).is_err() {
            return;
        }
        let mut table = Vec::new();
        table.extend_from_slice(&1u32.to_ne_bytes());
        table.extend_from_slice(&addr.to_ne_bytes());
        table.extend_from_slice(&len.to_ne_bytes());
        let _ = s.write_all(&table);
        let _ = stop_rx.recv_timeout(Duration::from_secs(30));
        drop(s);
        drop(l);
    });
    (ep, stop_tx)
}
