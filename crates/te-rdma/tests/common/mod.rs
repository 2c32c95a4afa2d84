//! What the fake-verbs test binaries share: the fake's control functions, backends
//! each with a control plane of its own, descriptors, a blocking submit, and the `main`
//! that points te-rdma at the fake and runs a binary's tests one at a time.

#![allow(dead_code)]

use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use libtest_mimic::Failed;
pub use te_core::testkit::{self, host_memory as host, host_region as region, pattern, soon};
use te_core::testkit::{AsBackend, HostPair};
use te_core::StandaloneControl;
use te_core::{
    Completion, PeerId, RegionDesc, RegionId, SegmentDesc, TransferBackend, TransferRequest,
};
use te_rdma::{RdmaBackend, RdmaConfig};

pub const DEVICES: &str = "fake0 fake1 fakeslow:delay=200ms fakev1:roce=v1,rd_atom=4";

/// The fake's control functions, resolved from the library te-rdma loads.
pub struct Fake {
    handle: *mut c_void,
}

impl Fake {
    pub fn open() -> Fake {
        let path = std::env::var(te_rdma::VERBS_LIB_ENV).expect("set in main");
        let c = CString::new(path.clone()).expect("a path");
        // SAFETY: dlopen of the fake provider; te-rdma opens the same file, so this
        // returns the same, already loaded, library.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW) };
        assert!(!handle.is_null(), "cannot open {path}");
        Fake { handle }
    }

    pub fn sym(&self, name: &str) -> *mut c_void {
        let c = CString::new(name).expect("a name");
        // SAFETY: a live handle and a C string.
        let p = unsafe { libc::dlsym(self.handle, c.as_ptr()) };
        assert!(!p.is_null(), "the fake lacks {name}");
        p
    }

    pub fn fail_device(&self, device: &str, status: u32, count: u32) {
        type F = unsafe extern "C" fn(*const c_char, u32, u32) -> c_int;
        let d = CString::new(device).expect("a name");
        // SAFETY: the fake's function of this signature.
        let rc = unsafe {
            std::mem::transmute::<*mut c_void, F>(self.sym("fakeverbs_fail_device"))(
                d.as_ptr(),
                status,
                count,
            )
        };
        assert_eq!(rc, 0, "fakeverbs_fail_device({device})");
    }

    pub fn faults_left(&self, device: &str) -> i64 {
        type F = unsafe extern "C" fn(*const c_char) -> i64;
        let d = CString::new(device).expect("a name");
        // SAFETY: as above.
        unsafe {
            std::mem::transmute::<*mut c_void, F>(self.sym("fakeverbs_device_faults_left"))(
                d.as_ptr(),
            )
        }
    }

    pub fn mr_key(&self, device: &str, addr: u64) -> u32 {
        type F = unsafe extern "C" fn(*const c_char, u64) -> u32;
        let d = CString::new(device).expect("a name");
        // SAFETY: as above.
        unsafe {
            std::mem::transmute::<*mut c_void, F>(self.sym("fakeverbs_mr_key"))(d.as_ptr(), addr)
        }
    }

    pub fn set_port(&self, device: &str, up: bool) {
        type F = unsafe extern "C" fn(*const c_char, c_int) -> c_int;
        let d = CString::new(device).expect("a name");
        // SAFETY: as above.
        let rc = unsafe {
            std::mem::transmute::<*mut c_void, F>(self.sym("fakeverbs_set_port"))(
                d.as_ptr(),
                c_int::from(up),
            )
        };
        assert_eq!(rc, 0, "fakeverbs_set_port({device})");
    }

    /// Makes the next `count` work requests any QP of `device` runs wait `delay` first
    /// (a wait the QP leaving RTS cuts short, flushing the work request).
    pub fn delay_device(&self, device: &str, delay: Duration, count: u32) {
        type F = unsafe extern "C" fn(*const c_char, u64, u32) -> c_int;
        let d = CString::new(device).expect("a name");
        // SAFETY: as above.
        let rc = unsafe {
            std::mem::transmute::<*mut c_void, F>(self.sym("fakeverbs_delay_device"))(
                d.as_ptr(),
                delay.as_micros() as u64,
                count,
            )
        };
        assert_eq!(rc, 0, "fakeverbs_delay_device({device})");
    }

    /// Forgets the faults still pending on `device`.
    pub fn clear_faults(&self, device: &str) {
        type F = unsafe extern "C" fn(*const c_char) -> c_int;
        let d = CString::new(device).expect("a name");
        // SAFETY: as above.
        let rc = unsafe {
            std::mem::transmute::<*mut c_void, F>(self.sym("fakeverbs_clear_faults"))(d.as_ptr())
        };
        assert_eq!(rc, 0, "fakeverbs_clear_faults({device})");
    }

    /// The numbers of `device`'s live QPs (the initiator's and the target's halves of
    /// every path on it, in this process), lowest first.
    pub fn device_qps(&self, device: &str) -> Vec<u32> {
        type F = unsafe extern "C" fn(*const c_char, *mut u32, usize) -> c_int;
        let d = CString::new(device).expect("a name");
        let f =
            // SAFETY: as above.
            unsafe { std::mem::transmute::<*mut c_void, F>(self.sym("fakeverbs_device_qps")) };
        for _ in 0..1000 {
            // SAFETY: a C string; a null buffer of no room, which the fake only counts.
            let n = unsafe { f(d.as_ptr(), std::ptr::null_mut(), 0) };
            assert!(n >= 0, "fakeverbs_device_qps({device})");
            let mut out = vec![0u32; n as usize];
            // SAFETY: `out` has room for `out.len()` numbers.
            let m = unsafe { f(d.as_ptr(), out.as_mut_ptr(), out.len()) };
            // QPs come and go meanwhile; ask again until the two calls agree.
            if m == n {
                return out;
            }
        }
        panic!("fakeverbs_device_qps({device}) never gave the same count twice running");
    }

    /// The state (`IBV_QPS_*`) of QP `qpn`, or -1 if it is gone.
    pub fn qp_state(&self, qpn: u32) -> i32 {
        type F = unsafe extern "C" fn(u32) -> c_int;
        // SAFETY: as above.
        unsafe { std::mem::transmute::<*mut c_void, F>(self.sym("fakeverbs_qp_state"))(qpn) }
    }

    /// A fatal error on QP `qpn`: it moves to ERR and its context gets `QP_FATAL`.
    /// False if the QP is gone.
    pub fn qp_fatal(&self, qpn: u32) -> bool {
        type F = unsafe extern "C" fn(u32) -> c_int;
        // SAFETY: as above.
        unsafe { std::mem::transmute::<*mut c_void, F>(self.sym("fakeverbs_qp_fatal"))(qpn) == 0 }
    }

    pub fn busy_pds(&self) -> u64 {
        type F = unsafe extern "C" fn() -> u64;
        // SAFETY: as above.
        unsafe { std::mem::transmute::<*mut c_void, F>(self.sym("fakeverbs_busy_pds"))() }
    }

    pub fn outstanding(&self) -> u64 {
        type F = unsafe extern "C" fn() -> u64;
        // SAFETY: as above.
        unsafe { std::mem::transmute::<*mut c_void, F>(self.sym("fakeverbs_outstanding"))() }
    }
}

/// A backend with the control plane its connect exchange runs on (dropped after it).
pub struct Node {
    pub backend: RdmaBackend,
    pub control: StandaloneControl,
}

impl std::ops::Deref for Node {
    type Target = RdmaBackend;
    fn deref(&self) -> &RdmaBackend {
        &self.backend
    }
}

/// A backend of epoch `epoch` behind a control plane of its own on 127.0.0.1.
pub fn node_with(config: RdmaConfig, epoch: u64) -> te_core::Result<Node> {
    let control = StandaloneControl::start(&te_core::EngineConfig::default(), epoch)?;
    let backend = RdmaBackend::with_hook(config, epoch, control.hook())?;
    Ok(Node { backend, control })
}

pub fn node(config: RdmaConfig) -> te_core::Result<Node> {
    node_with(config, te_core::random_nonzero())
}

pub fn backend(devices: &[&str]) -> Node {
    backend_with(devices, 1)
}

pub fn backend_with(devices: &[&str], qps_per_path: usize) -> Node {
    let mut c = RdmaConfig::default();
    c.devices = devices.iter().map(|d| d.to_string()).collect();
    c.qps_per_path = qps_per_path;
    node(c).expect("an rdma backend on the fake")
}

/// `target`'s descriptor, with `regions`.
pub fn segment(target: &Node, regions: Vec<RegionDesc>) -> SegmentDesc {
    segment_at(
        target.endpoint(),
        target.control.address().to_string(),
        regions,
    )
}

pub fn segment_at(endpoint: Vec<u8>, address: String, regions: Vec<RegionDesc>) -> SegmentDesc {
    testkit::segment(te_rdma::NAME, endpoint, address, regions)
}

/// Submits a batch and waits for its result; also returns how many work requests the
/// fake still had outstanding when the batch completed.
pub fn run(
    b: &RdmaBackend,
    peer: PeerId,
    reqs: &[TransferRequest],
    fake: &Fake,
) -> (te_core::Result<()>, u64, Duration) {
    let start = Instant::now();
    let (done, rx) = traced(fake, Duration::from_secs(5));
    if let Err(e) = b.submit(peer, reqs, done) {
        return (Err(e), 0, start.elapsed());
    }
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the batch completes")
}

/// What a [`traced`] completion reports: the batch's result, the work requests the
/// fake still had outstanding when it completed, and the time since it was made.
pub type Traced = (te_core::Result<()>, u64, Duration);

/// A completion with `timeout` that reports on the receiver when it runs.
pub fn traced(fake: &Fake, timeout: Duration) -> (Completion, mpsc::Receiver<Traced>) {
    let (tx, rx) = mpsc::channel();
    let outstanding: unsafe extern "C" fn() -> u64 =
        // SAFETY: the fake's function of this signature.
        unsafe { std::mem::transmute(fake.sym("fakeverbs_outstanding")) };
    let start = Instant::now();
    let done = Completion::new(timeout, move |r, _| {
        // SAFETY: a plain counter read.
        let left = unsafe { outstanding() };
        let _ = tx.send((r, left, start.elapsed()));
    });
    (done, rx)
}

/// Fails unless no work request was outstanding (`left`) when a batch completed.
pub fn none_outstanding(left: u64) -> Result<(), Failed> {
    check(
        left == 0,
        format!("{left} work requests were outstanding when the batch completed"),
    )
}

pub fn check(cond: bool, what: String) -> Result<(), Failed> {
    if cond {
        Ok(())
    } else {
        Err(what.into())
    }
}

impl AsBackend for Node {
    fn backend(&self) -> &dyn TransferBackend {
        &self.backend
    }
}

/// A target with one remotely writable 1 MiB region, an initiator with a 1 MiB source,
/// both on fake0 and fake1 (two paths, one QP each), connected.
pub type Pair = HostPair<Node>;

pub fn pair() -> Result<Pair, Failed> {
    Ok(HostPair::new(
        1 << 20,
        || backend(&["fake0", "fake1"]),
        segment,
    )?)
}

pub fn write_all(p: &Pair) -> TransferRequest {
    TransferRequest::write(RegionId(1), 0, RegionId(1), 0, p.src.len() as u64)
}

pub type Test = testkit::DirectTest;

/// Points te-rdma at the fake verbs library beside the test binary and names the fake's
/// devices. Before any thread starts; a child started from the binary inherits both.
pub fn use_the_fake() {
    if std::env::var_os(te_rdma::VERBS_LIB_ENV).is_none() {
        let exe = std::env::current_exe().expect("the test binary's path");
        std::env::set_var(
            te_rdma::VERBS_LIB_ENV,
            exe.with_file_name("libfakeverbs.so"),
        );
    }
    std::env::set_var("TE_FAKEVERBS_DEVICES", DEVICES);
}

/// Runs `tests` one at a time (the faults are injected per device and the outstanding
/// count is the process's), after checking that the fake loads.
pub fn run_tests(tests: Vec<(&'static str, Test)>) -> ! {
    if let Err(why) = te_rdma::probe() {
        eprintln!("the fake verbs provider does not load: {why}");
        std::process::exit(1);
    }
    testkit::run_tests("", tests, true)
}
