//! Deadlines, waiting and shutdown with work in flight (the slow configuration).

use std::sync::Arc;

use crate::sync::Mutex;
use std::time::{Duration, Instant};

use libtest_mimic::Failed;

use super::harness::{Harness, Pair};
use super::{e2f, expect_kind, fail};
use crate::{ErrorKind, TransferOptions, TransferRequest};

pub(super) fn a_batch_past_its_deadline_fails_with_timeout_and_is_released(
    h: &Harness,
) -> Result<(), Failed> {
    let p = h.pair(true, 4096)?;
    let req = TransferRequest::write(p.local.id(), 0, p.remote_desc.id, 0, 16);
    let options = TransferOptions {
        timeout: Some(Duration::from_millis(20)),
        ..TransferOptions::default()
    };
    let start = Instant::now();
    let handle = p
        .initiator
        .transfer_with(&p.peer, &[req], &options)
        .map_err(e2f)?;
    expect_kind(handle.wait(), ErrorKind::Timeout, "batch past its deadline")?;
    // Resolved once the backend let go: at the deadline for a backend that can stop at
    // once, when the slow batch would have ended for one that cannot; never hanging.
    let took = start.elapsed();
    ensure!(
        took >= Duration::from_millis(20) && took < Duration::from_secs(2),
        "the timed-out batch resolved after {took:?}"
    );
    // The engine keeps working afterwards.
    let handle = p.initiator.transfer(&p.peer, &[req]).map_err(e2f)?;
    handle.wait().map_err(e2f)
}

pub(super) fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec; the clock id is a constant Linux provides.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

pub(super) fn a_waiting_thread_uses_almost_no_cpu(h: &Harness) -> Result<(), Failed> {
    let p = h.pair(true, 4096)?;
    let req = TransferRequest::write(p.local.id(), 0, p.remote_desc.id, 0, 16);
    let handle = p.initiator.transfer(&p.peer, &[req]).map_err(e2f)?;
    let (cpu0, wall0) = (thread_cpu_time(), Instant::now());
    handle.wait().map_err(e2f)?;
    let (cpu, wall) = (thread_cpu_time() - cpu0, wall0.elapsed());
    ensure!(
        wall >= Duration::from_millis(100),
        "the slow batch took only {wall:?}; the slow config is not slow"
    );
    ensure!(
        cpu * 20 < wall,
        "the waiting thread used {cpu:?} of CPU in {wall:?} (more than 5%)"
    );
    Ok(())
}

pub(super) fn dropping_the_engine_with_batches_in_flight_neither_hangs_nor_crashes(
    h: &Harness,
) -> Result<(), Failed> {
    let p = h.pair(true, 64 << 10)?;
    let mut handles = Vec::new();
    for i in 0..16u64 {
        let req = TransferRequest::write(p.local.id(), i * 4096, p.remote_desc.id, i * 4096, 4096);
        handles.push(p.initiator.transfer(&p.peer, &[req]).map_err(e2f)?);
    }
    let start = Instant::now();
    let Pair {
        remote_desc: _,
        peer,
        local,
        remote,
        initiator,
        target,
    } = p;
    drop(initiator);
    drop(target);
    drop(peer);
    drop(local);
    drop(remote);
    for hd in handles {
        // Each either completed or failed; none may hang.
        ensure!(
            hd.wait_timeout(Duration::from_secs(10)).is_some(),
            "a batch hung after the engines were dropped"
        );
    }
    ensure!(
        start.elapsed() < Duration::from_secs(10),
        "dropping took {:?}",
        start.elapsed()
    );
    Ok(())
}

pub(super) fn a_handle_can_be_awaited_as_a_future(h: &Harness) -> Result<(), Failed> {
    use std::future::Future;
    use std::task::{Context, Poll, Wake, Waker};
    struct Flag(Mutex<bool>, crate::sync::Condvar);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            *self.0.lock() = true;
            self.1.notify_all();
        }
    }
    let p = h.pair(true, 4096)?;
    let req = TransferRequest::write(p.local.id(), 0, p.remote_desc.id, 0, 16);
    let mut handle = p.initiator.transfer(&p.peer, &[req]).map_err(e2f)?;
    let flag = Arc::new(Flag(Mutex::new(false), crate::sync::Condvar::new()));
    let waker = Waker::from(flag.clone());
    let mut cx = Context::from_waker(&waker);
    ensure!(
        std::pin::Pin::new(&mut handle).poll(&mut cx).is_pending(),
        "a slow batch was ready at once"
    );
    let woken = flag.0.lock();
    let (woken, _) = flag
        .1
        .wait_timeout_while(woken, Duration::from_secs(10), |w| !*w);
    ensure!(*woken, "the waker was not called");
    drop(woken);
    match std::pin::Pin::new(&mut handle).poll(&mut cx) {
        Poll::Ready(r) => r.map_err(e2f),
        Poll::Pending => Err(fail("woken but still pending")),
    }
}

pub(super) fn every_clone_of_a_handle_wakes(h: &Harness) -> Result<(), Failed> {
    use std::future::Future;
    use std::task::{Context, Wake, Waker};
    struct Flag(Mutex<bool>, crate::sync::Condvar);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            *self.0.lock() = true;
            self.1.notify_all();
        }
    }
    let p = h.pair(true, 4096)?;
    let req = TransferRequest::write(p.local.id(), 0, p.remote_desc.id, 0, 16);
    let handle = p.initiator.transfer(&p.peer, &[req]).map_err(e2f)?;
    let start = Instant::now();
    // Two futures polled with two different wakers, and two threads waiting.
    let flags: Vec<Arc<Flag>> = (0..2)
        .map(|_| Arc::new(Flag(Mutex::new(false), crate::sync::Condvar::new())))
        .collect();
    for f in &flags {
        let waker = Waker::from(f.clone());
        let mut clone = handle.clone();
        ensure!(
            std::pin::Pin::new(&mut clone)
                .poll(&mut Context::from_waker(&waker))
                .is_pending(),
            "a slow batch was ready at once"
        );
    }
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let h = handle.clone();
            std::thread::spawn(move || h.wait_timeout(Duration::from_secs(10)))
        })
        .collect();
    for w in waiters {
        let r = w.join().map_err(|_| fail("a waiting thread panicked"))?;
        ensure!(r.is_some(), "a waiting clone was not woken within 10 s");
    }
    for (i, f) in flags.iter().enumerate() {
        let woken = f.0.lock();
        let (woken, _) =
            f.1.wait_timeout_while(woken, Duration::from_secs(10), |w| !*w);
        ensure!(*woken, "the waker of future {i} was not called");
    }
    ensure!(
        start.elapsed() < Duration::from_secs(5),
        "the clones took {:?} to wake",
        start.elapsed()
    );
    Ok(())
}
