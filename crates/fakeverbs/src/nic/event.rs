//! How the NIC tells its consumer: event pipes, each context's async event queue,
//! completion channels and completion queues.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use super::lock;
use crate::verbs::*;

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

/// What a completion queue holds, under its lock.
pub(crate) struct CqState {
    pub(crate) queue: VecDeque<ibv_wc>,
    pub(crate) capacity: usize,
    pub(crate) armed: bool,
    pub(crate) overrun: bool,
}

impl Cq {
    pub(super) fn push(&self, wc: ibv_wc) {
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
