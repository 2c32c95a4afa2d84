//! The software NIC: devices on a fabric of Unix sockets, memory regions, completion
//! queues and RC queue pairs, and the threads that carry out RDMA WRITE and READ.
//!
//! Every fake device of a process is one node of the fabric: it listens on the abstract
//! Unix socket `te-fakeverbs-node-XXXX` (XXXX = its 16-bit node id, chosen at random and
//! kept only if the name is free) and its GIDs and LID carry that id, so a QP's address
//! vector names the node its peer QP lives on, in this process or another.
//!
//! This module holds the devices, their memory regions and the fabric; module `event`
//! the event pipes, async event queues and completion queues; module `queue_pair` the
//! QPs and their state.
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
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};
use std::time::Duration;

use crate::spec::{self, DeviceSpec, Roce};
use crate::verbs::*;

mod event;
mod queue_pair;
mod requester;
mod responder;

pub(crate) use event::{AsyncQueue, Channel, Cq, CqState, Element, EventPipe};
pub(crate) use queue_pair::{Fault, Qp, Wr};
use responder::listen;

/// Locks a mutex, taking the data out of a poisoned one (a panicking test thread must
/// not wedge the NIC).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
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
