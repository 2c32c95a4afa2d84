//! A queue of jobs, each due at an instant, for backends whose own worker threads carry
//! out batches (te-stub, te-mlu): submitters push, workers take the next job that is
//! due, blocking on a condition variable until one is or the queue stops, so an idle
//! worker never wakes.

use std::collections::VecDeque;
use std::time::Instant;

use crate::sync::{Condvar, Mutex};

/// Jobs waiting for a worker, each with the instant it becomes due.
pub struct DueQueue<J> {
    state: Mutex<State<J>>,
    cond: Condvar,
}

struct State<J> {
    jobs: VecDeque<(Instant, J)>,
    stopped: bool,
}

impl<J> std::fmt::Debug for DueQueue<J> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state.lock();
        f.debug_struct("DueQueue")
            .field("queued", &s.jobs.len())
            .field("stopped", &s.stopped)
            .finish()
    }
}

impl<J> Default for DueQueue<J> {
    fn default() -> Self {
        DueQueue {
            state: Mutex::new(State {
                jobs: VecDeque::new(),
                stopped: false,
            }),
            cond: Condvar::new(),
        }
    }
}

impl<J> DueQueue<J> {
    /// Queues `job`, due at `due`, and wakes a worker.
    ///
    /// # Errors
    /// The job back, once the queue has stopped.
    pub fn push(&self, due: Instant, job: J) -> Result<(), J> {
        let mut s = self.state.lock();
        if s.stopped {
            return Err(job);
        }
        s.jobs.push_back((due, job));
        drop(s);
        self.cond.notify_one();
        Ok(())
    }

    /// Takes the oldest queued job `which` picks (an aborted batch's), if any.
    pub fn remove(&self, mut which: impl FnMut(&J) -> bool) -> Option<J> {
        let mut s = self.state.lock();
        let at = s.jobs.iter().position(|(_, j)| which(j))?;
        s.jobs.remove(at).map(|(_, j)| j)
    }

    /// Stops the queue: every worker's [`DueQueue::next`] returns `None`, later pushes
    /// are refused; returns the jobs still queued.
    pub fn stop(&self) -> Vec<J> {
        let jobs = {
            let mut s = self.state.lock();
            s.stopped = true;
            std::mem::take(&mut s.jobs)
        };
        self.cond.notify_all();
        jobs.into_iter().map(|(_, j)| j).collect()
    }

    /// The next job, waiting until it is due: the one queued first (jobs come out in
    /// the order they were queued, each once it is due), or with `newest_first` the
    /// last queued of those due. `None` once the queue has stopped.
    pub fn next(&self, newest_first: bool) -> Option<J> {
        let mut s = self.state.lock();
        loop {
            if s.stopped {
                return None;
            }
            let now = Instant::now();
            let due = |(at, _): &(Instant, J)| *at <= now;
            let pick = if newest_first {
                s.jobs.iter().rposition(due)
            } else {
                s.jobs.front().filter(|j| due(j)).map(|_| 0)
            };
            if let Some(i) = pick {
                return s.jobs.remove(i).map(|(_, j)| j);
            }
            s = match s.jobs.iter().map(|(at, _)| *at).min() {
                Some(at) => {
                    self.cond
                        .wait_timeout(s, at.saturating_duration_since(now))
                        .0
                }
                None => self.cond.wait(s),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::DueQueue;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    #[test]
    fn jobs_come_out_when_due_in_the_order_asked_for() {
        let q = DueQueue::default();
        let now = Instant::now();
        for j in 1..=3 {
            q.push(now, j).unwrap();
        }
        assert_eq!(q.next(false), Some(1));
        assert_eq!(q.next(true), Some(3));
        assert_eq!(q.remove(|&j| j == 2), Some(2));
        assert_eq!(q.remove(|&j| j == 2), None);
    }

    #[test]
    fn jobs_come_out_in_the_order_queued_even_if_a_later_one_is_due_first() {
        let q = DueQueue::default();
        let start = Instant::now();
        q.push(start + Duration::from_millis(30), "first").unwrap();
        q.push(start, "second").unwrap();
        assert_eq!(q.next(false), Some("first"));
        assert!(start.elapsed() >= Duration::from_millis(30));
        assert_eq!(q.next(false), Some("second"));
    }

    #[test]
    fn a_worker_waits_for_the_due_instant_and_stop_releases_it() {
        let q = Arc::new(DueQueue::default());
        let start = Instant::now();
        q.push(start + Duration::from_millis(50), "late").unwrap();
        assert_eq!(q.next(false), Some("late"));
        assert!(
            start.elapsed() >= Duration::from_millis(50),
            "not before its instant"
        );

        q.push(start + Duration::from_secs(3600), "never").unwrap();
        let w = {
            let q = q.clone();
            std::thread::spawn(move || q.next(false))
        };
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(q.stop(), ["never"]);
        assert_eq!(w.join().unwrap(), None, "stopping wakes the waiting worker");
        assert_eq!(q.push(Instant::now(), "after"), Err("after"));
    }
}
