//! The mlu backend's completion machinery: batches handed to worker threads, each
//! with its own CNRT queue per MLU; a worker enqueues all of a batch's copies, waits
//! once per queue (a blocking sync, never a poll loop) and completes the batch.

use std::collections::HashMap;
use std::sync::Arc;

use te_core::worker::DueQueue;
use te_core::{BatchStage, Completion, Error, ErrorKind, Result};

use crate::ffi::{Cnrt, Queue};
use crate::peers::Mapping;
use crate::shm::Table;

/// A batch's claim on one region: counted out again when dropped.
pub(crate) struct Guard {
    pub(crate) table: Arc<Table>,
    pub(crate) slot: u32,
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.table.leave(self.slot);
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum Kind {
    HostToHost,
    /// One queue on `dev`, direction `dir`.
    Queue {
        dev: u32,
        dir: i32,
    },
    /// Between two MLUs, on a queue of `dev`.
    Peer {
        dev: u32,
        dst: u32,
        src: u32,
    },
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Copy {
    pub(crate) dst: u64,
    pub(crate) src: u64,
    pub(crate) len: usize,
    pub(crate) kind: Kind,
}

pub(crate) struct Job {
    pub(crate) copies: Vec<Copy>,
    /// The peer's allocations the copies reach, mapped here. Dropped before `guards`
    /// (as fields drop in order): once the owner sees the batch leave a region, the
    /// batch holds no mapping of its allocation, which the owner may then free.
    pub(crate) maps: Vec<Arc<Mapping>>,
    pub(crate) guards: Vec<Guard>,
    pub(crate) done: Completion,
}

impl Job {
    /// Lets go of the peer's mappings, then of the regions (`maps` says why in this
    /// order), then completes the batch with `result`.
    pub(crate) fn complete(self, result: Result<()>) {
        let Job {
            maps, guards, done, ..
        } = self;
        drop(maps);
        drop(guards);
        done.complete(result);
    }
}

pub(crate) fn worker(queue: &DueQueue<Job>, cnrt: &Cnrt) {
    let mut queues: HashMap<u32, Queue> = HashMap::new();
    while let Some(job) = queue.next(false) {
        let result = if job.done.remaining().is_zero() || job.done.is_aborted() {
            Err(Error::new(
                ErrorKind::Cancelled,
                "the batch was aborted (its deadline, a cancel or a deregistration) before its copies started",
            ))
        } else {
            // MLU copies, one-sided over MLU-Link or through the host: the device stage.
            job.done.stage_began(BatchStage::Device);
            let r = run(&job.copies, cnrt, &mut queues);
            job.done.stage_ended(BatchStage::Device);
            r
        };
        job.complete(result);
    }
    for (_, q) in queues.drain() {
        let _ = cnrt.queue_destroy(q);
    }
}

/// `dev`'s queue of this worker, with `dev` made current: a queue belongs to the MLU
/// current when it was created, and CNRT refuses a copy on it while another is.
pub(crate) fn queue(cnrt: &Cnrt, queues: &mut HashMap<u32, Queue>, dev: u32) -> Result<Queue> {
    cnrt.set_device(dev)?;
    if let Some(q) = queues.get(&dev) {
        return Ok(*q);
    }
    let q = cnrt.queue_create()?;
    queues.insert(dev, q);
    Ok(q)
}

/// Enqueues every copy, then waits for the queues used; the first error wins, and a
/// queue that failed is destroyed so the next batch starts on a fresh one.
pub(crate) fn run(copies: &[Copy], cnrt: &Cnrt, queues: &mut HashMap<u32, Queue>) -> Result<()> {
    let mut used: Vec<u32> = Vec::new();
    let mut first: Option<Error> = None;
    for (i, c) in copies.iter().enumerate() {
        let r = match c.kind {
            Kind::HostToHost => {
                // SAFETY: both ranges were checked against live registrations, which
                // the batch's guards keep registered until it completes; `copy`
                // allows overlap (an engine writing into itself).
                unsafe { std::ptr::copy(c.src as *const u8, c.dst as *mut u8, c.len) };
                Ok(())
            }
            Kind::Queue { dev, dir } => queue(cnrt, queues, dev).and_then(|q| {
                if !used.contains(&dev) {
                    used.push(dev);
                }
                // SAFETY: as above; the queue is synchronized below before the guards
                // are released.
                cnrt.enqueue_or_wait(q, || unsafe {
                    cnrt.memcpy_async(c.dst, c.src, c.len, q, dir)
                })
            }),
            Kind::Peer { dev, dst, src } => queue(cnrt, queues, dev).and_then(|q| {
                if !used.contains(&dev) {
                    used.push(dev);
                }
                // SAFETY: as above.
                cnrt.enqueue_or_wait(q, || unsafe {
                    cnrt.memcpy_peer_async(c.dst, dst, c.src, src, c.len, q)
                })
            }),
        };
        if let Err(e) = r {
            first = Some(e.with_context("request", i));
            break;
        }
    }
    for dev in used {
        let Some(&q) = queues.get(&dev) else { continue };
        let r = cnrt
            .set_device(dev)
            .and_then(|()| match cnrt.queue_query(q) {
                Ok(true) => Ok(()),
                Ok(false) => cnrt.queue_sync(q),
                Err(e) => Err(e),
            });
        if let Err(e) = r {
            queues.remove(&dev);
            let _ = cnrt.queue_sync(q);
            let _ = cnrt.queue_destroy(q);
            first.get_or_insert(e.with_context("mlu", dev));
        }
    }
    match first {
        Some(e) => Err(e.with_operation("transfer")),
        None => Ok(()),
    }
}
