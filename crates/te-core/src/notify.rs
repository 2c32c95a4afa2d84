//! Notifications: messages delivered to a peer after a batch's data is visible there.
//!
//! The sending side is one thread per engine that owns its control connections (no
//! lock around them, none held across I/O); the receiving side is a bounded queue.

use std::collections::{HashMap, VecDeque};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::batch::BatchState;
use crate::control::{self, Msg, Notice};
use crate::error::{Error, ErrorKind, Result};

/// A message a peer attached to a batch, received after the batch's data landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The sending engine's name.
    pub from: String,
    /// The sending engine's epoch.
    pub from_epoch: u64,
    /// The message bytes.
    pub message: Vec<u8>,
}

/// Received notifications, bounded.
pub(crate) struct Inbox {
    queue: Mutex<VecDeque<Notification>>,
    cond: Condvar,
    capacity: usize,
}

impl Inbox {
    pub(crate) fn new(capacity: usize) -> Inbox {
        Inbox {
            queue: Mutex::new(VecDeque::new()),
            cond: Condvar::new(),
            capacity,
        }
    }

    pub(crate) fn push(&self, n: Notification) -> Result<()> {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() >= self.capacity {
            return Err(Error::new(
                ErrorKind::Busy,
                format!(
                    "the peer's notification queue is full ({} unread); it must read them, or raise notification_queue",
                    self.capacity
                ),
            ));
        }
        q.push_back(n);
        drop(q);
        self.cond.notify_one();
        Ok(())
    }

    pub(crate) fn pop(&self, timeout: Duration) -> Option<Notification> {
        let end = Instant::now() + timeout;
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(n) = q.pop_front() {
                return Some(n);
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            q = self
                .cond
                .wait_timeout(q, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

pub(crate) struct Job {
    pub addr: String,
    pub notice: Notice,
    pub state: Arc<BatchState>,
}

/// The sending thread.
///
/// Dropping it does not wait for the thread: jobs still queued are cancelled, and a
/// delivery under way ends at its batch's deadline.
pub(crate) struct Notifier {
    tx: Option<Sender<Job>>,
    stop: Arc<AtomicBool>,
}

impl Notifier {
    pub(crate) fn start() -> Result<Notifier> {
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        std::thread::Builder::new()
            .name("te-notify".into())
            .spawn(move || run(rx, &s))
            .map_err(|e| Error::io("start engine", "cannot spawn the notification thread", e))?;
        Ok(Notifier { tx: Some(tx), stop })
    }

    pub(crate) fn send(&self, job: Job) {
        if let Some(tx) = &self.tx {
            if let Err(mpsc::SendError(job)) = tx.send(job) {
                job.state.finish(Err(shut_down()));
            }
        }
    }
}

fn shut_down() -> Error {
    Error::new(
        ErrorKind::Cancelled,
        "the engine shut down before the notification was sent",
    )
    .with_operation("notify")
}

fn run(rx: Receiver<Job>, stop: &AtomicBool) {
    let mut conns: HashMap<String, TcpStream> = HashMap::new();
    for job in rx {
        if job.state.is_done() {
            continue;
        }
        if stop.load(Ordering::Acquire) {
            job.state.finish(Err(shut_down()));
            continue;
        }
        let r = deliver(&mut conns, &job);
        job.state.finish(r.map_err(|e| e.with_operation("notify")));
    }
}

fn deliver(conns: &mut HashMap<String, TcpStream>, job: &Job) -> Result<()> {
    let deadline = job.state.deadline();
    let msg = Msg::Notify(job.notice.clone());
    // A cached connection may have died quietly; one fresh retry covers that.
    for attempt in 0..2 {
        let stream = match conns.remove(&job.addr) {
            Some(s) => s,
            None => control::dial(&job.addr, deadline)?,
        };
        let mut stream = stream;
        let reply = control::write_msg(&mut stream, &msg, deadline)
            .and_then(|()| control::read_msg(&mut stream, deadline));
        match reply {
            Ok(Msg::Ack) => {
                conns.insert(job.addr.clone(), stream);
                return Ok(());
            }
            Ok(Msg::Error(e)) => {
                conns.insert(job.addr.clone(), stream);
                return Err(e);
            }
            Ok(_) => {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    "the peer answered a notification with something else",
                ))
            }
            Err(e) if attempt == 0 && e.kind() == ErrorKind::PeerUnreachable => continue,
            Err(e) => return Err(e.with_context("peer", &job.addr)),
        }
    }
    Err(Error::new(
        ErrorKind::PeerUnreachable,
        "cannot deliver the notification",
    )
    .with_context("peer", &job.addr))
}

impl Drop for Notifier {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.tx.take();
    }
}
