//! The software NIC: devices on a fabric of Unix sockets, memory regions, completion
//! queues and RC queue pairs, and the threads that carry out RDMA WRITE and READ.
//!
//! Every fake device of a process is one node of the fabric: it listens on the abstract
//! Unix socket `te-fakeverbs-node-XXXX` (XXXX = its 16-bit node id, chosen at random and
//! kept only if the name is free) and its GIDs and LID carry that id, so a QP's address
//! vector names the node its peer QP lives on, in this process or another.
//!
//! **Requester** (module `requester`). Each QP has one thread that runs its send queue
//! in order. A WRITE checks its local scatter-gather entries (lkey, protection domain,
//! range), copies the bytes and sends them with the remote address and rkey on the QP's
//! connection to the peer node; a READ checks its local entries (which also need
//! LOCAL_WRITE), asks, and scatters the answer. The reply's status becomes the work
//! completion's. A work request completes, in posting order, once its bytes have landed
//! (WRITE: the responder answered after copying them) or been placed (READ).
//!
//! **Responder** (module `responder`). A node's listener starts one thread per incoming
//! connection. Each request is checked as a NIC checks it: the target QP exists on this
//! device, is in RTR or RTS, and is connected to exactly the sending QP (QP number,
//! node and GID type) whose READ depth (`max_rd_atomic`) it can serve; otherwise the
//! request is dropped and the requester's transport retries run out (`RETRY_EXC_ERR`).
//! Then the rkey must name a live region of the QP's protection domain covering the
//! whole range, and both the region and the QP must grant the right (REMOTE_WRITE or
//! REMOTE_READ); otherwise the answer is a remote access error, the responder's QP
//! moves to ERR and its context gets `IBV_EVENT_QP_ACCESS_ERR`.
//!
//! **Errors and flushes.** A work request that fails moves its QP to ERR; every work
//! request after it, and every one posted while the QP is in ERR, completes with
//! `WR_FLUSH_ERR`. Error completions are generated whether or not the work request was
//! signalled; successful ones only when it was.
//!
//! **Memory.** Each copy into or out of a region holds the region's read lock, and
//! `ibv_dereg_mr` takes its write lock, so once deregistration returns no copy touches
//! the memory. `ibv_destroy_qp` stops the QP's thread (after the copy it may be doing)
//! and drops what it had not run, without completions, as a NIC does.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, RwLock};
use std::time::{Duration, Instant};

use crate::spec::{self, DeviceSpec, Roce};
use crate::verbs::*;

mod requester;
mod responder;

use requester::requester;
use responder::listen;

/// Locks a mutex, taking the data out of a poisoned one (a panicking test thread must
/// not wedge the NIC).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn wait_until<'a, T>(cv: &Condvar, g: MutexGuard<'a, T>, until: Instant) -> MutexGuard<'a, T> {
    let left = until.saturating_duration_since(Instant::now());
    cv.wait_timeout(g, left)
        .map(|(g, _)| g)
        .unwrap_or_else(|p| p.into_inner().0)
}

/// The longest a requester waits for an answer, and the cap on the transport timeout it
/// emulates before `RETRY_EXC_ERR`.
const MAX_TRANSPORT_WAIT: Duration = Duration::from_secs(2);
const MAX_EMULATED_TIMEOUT: Duration = Duration::from_millis(100);

// The wire protocol between a requester and a responder node: the greeting, the request
// operations and the answers.
const HELLO: [u8; 4] = *b"FVB1";
const OP_WRITE: u8 = 1;
const OP_READ: u8 = 2;
/// Answers.
const OK: u8 = 0;
const DROPPED: u8 = 1;
const ACCESS: u8 = 2;
const INVALID: u8 = 3;

/// A pipe whose read end is the pollable fd of a completion channel or an async queue;
/// one byte per event.
pub(crate) struct EventPipe {
    pub(crate) rd: OwnedFd,
    wr: OwnedFd,
}

impl EventPipe {
    pub(crate) fn new() -> Option<EventPipe> {
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors pipe2 writes.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return None;
        }
        // SAFETY: two new descriptors this pipe owns from now on.
        let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // The writer never blocks: a full pipe already signals readability.
        // SAFETY: fcntl on a descriptor we own.
        unsafe {
            let flags = libc::fcntl(wr.as_raw_fd(), libc::F_GETFL);
            libc::fcntl(wr.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
        }
        Some(EventPipe { rd, wr })
    }

    fn signal(&self) {
        // SAFETY: writes one byte from a valid buffer to our own pipe.
        unsafe { libc::write(self.wr.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
    }

    /// Takes one byte: false if none is there (non-blocking fd) or the read failed; the
    /// errno is left for the caller.
    pub(crate) fn take(&self) -> bool {
        let mut b = [0u8; 1];
        loop {
            // SAFETY: reads one byte into a valid buffer from our own pipe.
            let n = unsafe { libc::read(self.rd.as_raw_fd(), b.as_mut_ptr().cast(), 1) };
            if n == 1 {
                return true;
            }
            if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return false;
        }
    }
}

/// What an async event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Element {
    /// The `ibv_qp` pointer (as an address).
    Qp(usize),
    /// The `ibv_cq` pointer (as an address).
    Cq(usize),
    Port(i32),
}

/// One context's async events.
pub(crate) struct AsyncQueue {
    pub(crate) pipe: EventPipe,
    pub(crate) events: Mutex<VecDeque<(u32, Element)>>,
}

impl AsyncQueue {
    pub(crate) fn push(&self, kind: u32, element: Element) {
        lock(&self.events).push_back((kind, element));
        self.pipe.signal();
    }

    /// Forgets undelivered events about `element` (its object is being destroyed).
    pub(crate) fn purge(&self, element: Element) {
        lock(&self.events).retain(|(_, e)| *e != element);
    }
}

/// A registered memory region.
#[derive(Debug)]
pub(crate) struct Mr {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) access: i32,
    pub(crate) pd: u32,
    /// Read-held during every copy; `ibv_dereg_mr` write-locks it and sets it false.
    pub(crate) live: RwLock<bool>,
}

impl Mr {
    fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|e| e <= self.addr + self.len)
    }
}

/// One fake device: its node on the fabric and its regions.
pub(crate) struct Device {
    pub(crate) spec: DeviceSpec,
    pub(crate) cname: std::ffi::CString,
    pub(crate) node: u16,
    pub(crate) active: AtomicBool,
    pub(crate) mrs: RwLock<HashMap<u32, Arc<Mr>>>,
    /// The async queues of the device's open contexts (for port events).
    pub(crate) contexts: Mutex<Vec<std::sync::Weak<AsyncQueue>>>,
    /// Faults for the next work requests any QP of this device runs.
    pub(crate) faults: Mutex<VecDeque<(Fault, u32)>>,
    next_key: AtomicU32,
}

impl Device {
    /// The GID table: (gid, type).
    pub(crate) fn gids(&self) -> Vec<([u8; 16], u32)> {
        let [hi, lo] = self.node.to_be_bytes();
        let mut v1 = [0u8; 16];
        v1[..2].copy_from_slice(&[0xfe, 0x80]);
        v1[14..].copy_from_slice(&[hi, lo]);
        let mut v2 = [0u8; 16];
        v2[10..].copy_from_slice(&[0xff, 0xff, 127, 254, hi, lo]);
        if self.spec.infiniband {
            return vec![(v1, IBV_GID_TYPE_IB)];
        }
        match self.spec.roce {
            Roce::Both => vec![(v1, IBV_GID_TYPE_ROCE_V1), (v2, IBV_GID_TYPE_ROCE_V2)],
            Roce::V1 => vec![(v1, IBV_GID_TYPE_ROCE_V1)],
            Roce::V2 => vec![(v2, IBV_GID_TYPE_ROCE_V2)],
        }
    }

    pub(crate) fn lid(&self) -> u16 {
        if self.spec.infiniband {
            self.node
        } else {
            0
        }
    }

    /// A new key: a counter in the upper 24 bits, a fixed variant byte below.
    pub(crate) fn new_key(&self) -> u32 {
        (self.next_key.fetch_add(1, Ordering::Relaxed) << 8) | 0x5a
    }

    pub(crate) fn mr(&self, key: u32) -> Option<Arc<Mr>> {
        self.mrs
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
            .cloned()
    }

    /// Sends `kind` about `element` to every open context of this device.
    pub(crate) fn broadcast(&self, kind: u32, element: Element) {
        let mut list = lock(&self.contexts);
        list.retain(|w| w.strong_count() > 0);
        for q in list.iter().filter_map(std::sync::Weak::upgrade) {
            q.push(kind, element);
        }
    }
}

/// The process's fake devices, made at the first call that needs them.
pub(crate) struct Fabric {
    pub(crate) devices: Vec<Arc<Device>>,
    /// Why there are no devices, if `TE_FAKEVERBS_DEVICES` is wrong.
    pub(crate) error: Option<String>,
}

static FABRIC: OnceLock<Fabric> = OnceLock::new();

/// Every live QP of the process, by QP number (numbers are unique across devices).
static QPS: OnceLock<Mutex<HashMap<u32, Arc<Qp>>>> = OnceLock::new();
static NEXT_QPN: AtomicU32 = AtomicU32::new(0);
/// Work requests posted and not yet completed or dropped, in the whole process.
pub(crate) static OUTSTANDING: AtomicUsize = AtomicUsize::new(0);

pub(crate) fn qps() -> &'static Mutex<HashMap<u32, Arc<Qp>>> {
    QPS.get_or_init(|| Mutex::new(HashMap::new()))
}

pub(crate) fn qp(qpn: u32) -> Option<Arc<Qp>> {
    lock(qps()).get(&qpn).cloned()
}

/// A small pseudo-random number from the clock, the pid and `salt`.
fn random(salt: u64) -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut x =
        t ^ (u64::from(std::process::id()) << 32) ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^ (x >> 33)
}

fn node_name(node: u16) -> String {
    format!("te-fakeverbs-node-{node:04x}")
}

pub(crate) fn fabric() -> &'static Fabric {
    FABRIC.get_or_init(|| {
        let start = (random(1) as u32) & 0x00ff_f000;
        NEXT_QPN.store(start.max(0x100), Ordering::Relaxed);
        let specs = match spec::devices(std::env::var(spec::DEVICES_ENV).ok().as_deref()) {
            Ok(s) => s,
            Err(e) => {
                return Fabric {
                    devices: Vec::new(),
                    error: Some(format!("{}: {e}", spec::DEVICES_ENV)),
                }
            }
        };
        let mut devices = Vec::new();
        for (i, spec) in specs.into_iter().enumerate() {
            let Some((node, listener)) = (0..256).find_map(|attempt| {
                let node = (random(attempt * 64 + i as u64) % 0xfffe) as u16 + 1;
                let addr = SocketAddr::from_abstract_name(node_name(node)).ok()?;
                UnixListener::bind_addr(&addr).ok().map(|l| (node, l))
            }) else {
                return Fabric {
                    devices: Vec::new(),
                    error: Some("no free fabric address (abstract Unix sockets)".into()),
                };
            };
            let dev = Arc::new(Device {
                active: AtomicBool::new(spec.active),
                cname: std::ffi::CString::new(spec.name.clone()).unwrap_or_default(),
                spec,
                node,
                mrs: RwLock::new(HashMap::new()),
                contexts: Mutex::new(Vec::new()),
                faults: Mutex::new(VecDeque::new()),
                next_key: AtomicU32::new((random(7 + i as u64) as u32 & 0xffff) | 1),
            });
            let d = dev.clone();
            let _ = std::thread::Builder::new()
                .name(format!("fakeverbs-{}", dev.spec.name))
                .spawn(move || listen(&d, &listener));
            devices.push(dev);
        }
        Fabric {
            devices,
            error: None,
        }
    })
}

/// A completion channel.
pub(crate) struct Channel {
    pub(crate) pipe: EventPipe,
    /// The CQs with an event not yet taken, as `ibv_cq` addresses.
    pub(crate) ready: Mutex<VecDeque<usize>>,
    pub(crate) cqs: AtomicUsize,
}

/// A completion queue.
pub(crate) struct Cq {
    pub(crate) ibv: AtomicUsize,
    pub(crate) state: Mutex<CqState>,
    pub(crate) channel: Option<Arc<Channel>>,
    pub(crate) events: Arc<AsyncQueue>,
    /// Completion events handed out (counted under the channel's `ready` lock) and not
    /// acknowledged.
    pub(crate) unacked: Mutex<u32>,
    pub(crate) acked: Condvar,
    pub(crate) qps: AtomicUsize,
}

pub(crate) struct CqState {
    pub(crate) queue: VecDeque<ibv_wc>,
    pub(crate) capacity: usize,
    pub(crate) armed: bool,
    pub(crate) overrun: bool,
}

impl Cq {
    fn push(&self, wc: ibv_wc) {
        let mut st = lock(&self.state);
        if st.queue.len() >= st.capacity {
            if !st.overrun {
                st.overrun = true;
                self.events.push(
                    IBV_EVENT_CQ_ERR,
                    Element::Cq(self.ibv.load(Ordering::Relaxed)),
                );
            }
            return;
        }
        st.queue.push_back(wc);
        if st.armed {
            st.armed = false;
            if let Some(ch) = &self.channel {
                lock(&ch.ready).push_back(self.ibv.load(Ordering::Relaxed));
                ch.pipe.signal();
            }
        }
    }
}

/// The attributes a QP got from its transitions.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Attrs {
    pub(crate) access: u32,
    pub(crate) dest_qpn: u32,
    pub(crate) remote_node: u16,
    /// The type of the local GID the address vector uses (Ethernet).
    pub(crate) gid_type: u32,
    pub(crate) mtu: u32,
    pub(crate) timeout: u8,
    pub(crate) retry_cnt: u8,
    pub(crate) rnr_retry: u8,
    pub(crate) max_rd_atomic: u8,
    pub(crate) max_dest_rd_atomic: u8,
}

impl Attrs {
    /// The time a NIC spends retrying before `RETRY_EXC_ERR`: 4.096 µs × 2^timeout ×
    /// (retries + 1), capped so tests stay quick.
    fn retry_time(&self) -> Duration {
        let ns = 4096u64 << self.timeout.min(31);
        Duration::from_nanos(ns.saturating_mul(u64::from(self.retry_cnt) + 1))
            .min(MAX_EMULATED_TIMEOUT)
    }
}

/// One posted work request, copied out of the caller's `ibv_send_wr`.
#[derive(Debug, Clone)]
pub(crate) struct Wr {
    pub(crate) wr_id: u64,
    pub(crate) write: bool,
    pub(crate) sges: Vec<ibv_sge>,
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
    pub(crate) signaled: bool,
}

/// An injected fault, applied to the next work requests a QP runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// Complete with this status (after the emulated transport timeout for
    /// `RETRY_EXC_ERR`), moving the QP to ERR.
    Status(u32),
    /// Wait this long before running.
    Delay(Duration),
}

pub(crate) struct QpState {
    pub(crate) state: u32,
    pub(crate) attrs: Attrs,
    /// Bumped at every RTR, so the requester reconnects.
    pub(crate) generation: u64,
    pub(crate) sq: VecDeque<Wr>,
    /// Posted and not yet completed (queued or running).
    pub(crate) in_flight: u32,
    pub(crate) faults: VecDeque<(Fault, u32)>,
    pub(crate) shutdown: bool,
    /// Async events handed out (counted under the context's event lock) and not
    /// acknowledged.
    pub(crate) unacked_events: u32,
}

/// An RC queue pair.
pub(crate) struct Qp {
    pub(crate) qpn: u32,
    pub(crate) dev: Arc<Device>,
    pub(crate) pd: u32,
    pub(crate) cq: Arc<Cq>,
    pub(crate) max_send_wr: u32,
    pub(crate) max_send_sge: u32,
    pub(crate) sig_all: bool,
    pub(crate) ibv: AtomicUsize,
    pub(crate) events: Arc<AsyncQueue>,
    pub(crate) st: Mutex<QpState>,
    pub(crate) cv: Condvar,
    pub(crate) worker: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Qp {
    /// A new QP in RESET with its requester thread.
    pub(crate) fn create(
        dev: Arc<Device>,
        pd: u32,
        cq: Arc<Cq>,
        cap: ibv_qp_cap,
        sig_all: bool,
        events: Arc<AsyncQueue>,
    ) -> Option<Arc<Qp>> {
        let qpn = NEXT_QPN.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff;
        let qp = Arc::new(Qp {
            qpn,
            dev,
            pd,
            cq,
            max_send_wr: cap.max_send_wr,
            max_send_sge: cap.max_send_sge,
            sig_all,
            ibv: AtomicUsize::new(0),
            events,
            st: Mutex::new(QpState {
                state: IBV_QPS_RESET,
                attrs: Attrs::default(),
                generation: 0,
                sq: VecDeque::new(),
                in_flight: 0,
                faults: VecDeque::new(),
                shutdown: false,
                unacked_events: 0,
            }),
            cv: Condvar::new(),
            worker: Mutex::new(None),
        });
        let q = qp.clone();
        let h = std::thread::Builder::new()
            .name(format!("fakeverbs-qp-{qpn:x}"))
            .spawn(move || requester(&q))
            .ok()?;
        *lock(&qp.worker) = Some(h);
        lock(qps()).insert(qpn, qp.clone());
        Some(qp)
    }

    /// Moves the QP to ERR (its thread flushes what it holds).
    pub(crate) fn to_error(&self) {
        lock(&self.st).state = IBV_QPS_ERR;
        self.cv.notify_all();
    }

    /// Sends an async event about this QP to its context.
    pub(crate) fn event(&self, kind: u32) {
        self.events
            .push(kind, Element::Qp(self.ibv.load(Ordering::Relaxed)));
    }

    /// Stops the requester, drops what it had not run, and waits (bounded) for the
    /// async events about this QP to be acknowledged.
    pub(crate) fn destroy(&self) {
        self.events
            .purge(Element::Qp(self.ibv.load(Ordering::Relaxed)));
        {
            let mut st = lock(&self.st);
            st.shutdown = true;
            let dropped = st.sq.len();
            st.sq.clear();
            st.in_flight -= dropped as u32;
            OUTSTANDING.fetch_sub(dropped, Ordering::AcqRel);
        }
        self.cv.notify_all();
        if let Some(h) = lock(&self.worker).take() {
            let _ = h.join();
        }
        lock(qps()).remove(&self.qpn);
        let until = Instant::now() + Duration::from_secs(10);
        let mut st = lock(&self.st);
        while st.unacked_events > 0 && Instant::now() < until {
            st = wait_until(&self.cv, st, until);
        }
    }

    /// The next fault for this QP: its own first, else its device's.
    fn take_fault(&self) -> Option<Fault> {
        fn take(q: &mut VecDeque<(Fault, u32)>) -> Option<Fault> {
            let (fault, left) = q.front_mut()?;
            let f = *fault;
            *left -= 1;
            if *left == 0 {
                q.pop_front();
            }
            Some(f)
        }
        take(&mut lock(&self.st).faults).or_else(|| take(&mut lock(&self.dev.faults)))
    }

    /// Waits `d`; false if the QP left RTS (ERR, destroyed) meanwhile.
    fn pause(&self, d: Duration) -> bool {
        let until = Instant::now() + d;
        let mut st = lock(&self.st);
        loop {
            if st.shutdown || st.state != IBV_QPS_RTS {
                return false;
            }
            if Instant::now() >= until {
                return true;
            }
            st = wait_until(&self.cv, st, until);
        }
    }

    /// Completes `wr` with `status`; a failure (other than a flush) moves the QP to ERR.
    fn finish(&self, wr: &Wr, status: u32, byte_len: u32) {
        let mut st = lock(&self.st);
        // Counted done before its completion is visible, so a consumer that saw the
        // completion never finds it outstanding.
        st.in_flight -= 1;
        OUTSTANDING.fetch_sub(1, Ordering::AcqRel);
        if status != IBV_WC_SUCCESS || wr.signaled {
            self.cq.push(ibv_wc {
                wr_id: wr.wr_id,
                status,
                opcode: if wr.write {
                    IBV_WC_RDMA_WRITE
                } else {
                    IBV_WC_RDMA_READ
                },
                vendor_err: if status == IBV_WC_SUCCESS { 0 } else { 0xfa },
                byte_len,
                qp_num: self.qpn,
                ..ibv_wc::default()
            });
        }
        if status != IBV_WC_SUCCESS && status != IBV_WC_WR_FLUSH_ERR {
            st.state = IBV_QPS_ERR;
        }
    }
}
