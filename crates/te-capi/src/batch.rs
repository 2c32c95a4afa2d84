//! Batches in flight: wait with a timeout, status without blocking, a completion
//! callback, an event fd, cancel.
//!
//! A batch is reported done (by `te_batch_wait`, `te_batch_status` and its event fds)
//! only once the callbacks registered on it have returned: a caller told that its
//! batch is done may free what those callbacks use.

use std::cell::RefCell;
use std::ffi::{c_int, c_void};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Instant;
use te_core::sync::{Condvar, Mutex};

use te_facade::{Error, ErrorKind, Result, TransferHandle, TransferStatus};

use crate::args::{free_box, obj, wait_timeout, Out};
use crate::error::{fail, guard, guard_void, TE_OK, TE_PENDING};

/// `te_batch`: a submitted batch.
#[derive(Debug)]
pub struct TeBatch {
    handle: TransferHandle,
    hooks: Arc<Hooks>,
}

impl TeBatch {
    pub(crate) fn boxed(handle: TransferHandle) -> *mut TeBatch {
        let hooks = Arc::new(Hooks::default());
        Box::into_raw(Box::new(TeBatch { handle, hooks }))
    }
}

/// A batch's C callbacks and event fds, and whether its end was reported.
#[derive(Debug, Default)]
struct Hooks {
    state: Mutex<HookState>,
    /// Signalled when the last running callback returns.
    idle: Condvar,
}

#[derive(Debug, Default)]
struct HookState {
    /// Callbacks registered before the batch was reported done that have not returned.
    running: usize,
    /// Event fds to write once `running` is 0.
    fds: Vec<c_int>,
    /// The batch was reported done. A callback registered later runs at once on its
    /// caller's thread and is not waited for, so a report never goes back to pending.
    reported: bool,
}

thread_local! {
    /// The hooks whose callbacks run on this thread now: a callback that asks about its
    /// own batch sees it done instead of waiting for itself.
    static RUNNING_HERE: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

impl Hooks {
    fn key(&self) -> usize {
        self as *const Hooks as usize
    }

    /// How many of this batch's callbacks run on this thread now.
    fn here(&self) -> usize {
        let key = self.key();
        RUNNING_HERE
            .try_with(|r| r.borrow().iter().filter(|k| **k == key).count())
            .unwrap_or(0)
    }

    /// Waits (until `until`, `None`: without limit) for the callbacks of the resolved
    /// batch to return, those on this thread excepted; whether they did, and the batch
    /// may be reported done.
    fn settle(&self, until: Option<Instant>) -> bool {
        let here = self.here();
        let mut state = self.state.lock();
        loop {
            if state.running <= here {
                state.reported = true;
                return true;
            }
            state = match until {
                None => self.idle.wait(state),
                Some(end) => {
                    let left = end.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return false;
                    }
                    self.idle.wait_timeout(state, left).0
                }
            };
        }
    }

    /// Registers a callback: whether it is to be waited for.
    fn add_callback(&self) -> bool {
        let mut state = self.state.lock();
        if !state.reported {
            state.running += 1;
        }
        !state.reported
    }

    /// Runs a counted callback on this thread, then lets the batch be reported.
    fn run_callback(&self, callback: impl FnOnce()) {
        let key = self.key();
        let _ = RUNNING_HERE.try_with(|r| r.borrow_mut().push(key));
        callback();
        let _ = RUNNING_HERE.try_with(|r| {
            let mut r = r.borrow_mut();
            if let Some(i) = r.iter().rposition(|k| *k == key) {
                r.remove(i);
            }
        });
        let mut state = self.state.lock();
        state.running -= 1;
        if state.running != 0 {
            return;
        }
        let fds = std::mem::take(&mut state.fds);
        state.reported |= !fds.is_empty();
        drop(state);
        self.idle.notify_all();
        for fd in fds {
            signal(fd);
        }
    }

    /// The batch resolved: signals `fd` now, or once its callbacks have returned.
    fn signal_when_settled(&self, fd: c_int) {
        let mut state = self.state.lock();
        if state.running != 0 {
            state.fds.push(fd);
            return;
        }
        state.reported = true;
        drop(state);
        signal(fd);
    }
}

/// Makes an event fd readable.
fn signal(fd: c_int) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live local to the eventfd, which the caller keeps
    // open until it became readable (te.h); a non-blocking write never waits.
    let _ = unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

/// A batch's result as a status, recording its message when it failed.
fn status_of(result: &Result<()>) -> c_int {
    match result {
        Ok(()) => TE_OK,
        Err(e) => fail(e),
    }
}

/// `int te_batch_wait(te_batch *, int64_t timeout_ms)`.
///
/// # Safety
/// `batch` a live batch.
#[no_mangle]
pub unsafe extern "C" fn te_batch_wait(batch: *const TeBatch, timeout_ms: i64) -> c_int {
    const OP: &str = "te_batch_wait";
    guard(OP, || {
        // SAFETY: te.h asks for a live batch.
        let batch = unsafe { obj(batch, OP, "batch") }?;
        // One end for the batch and its callbacks; none: without limit.
        let until = wait_timeout(timeout_ms).and_then(|t| Instant::now().checked_add(t));
        let result = match until {
            None => batch.handle.wait(),
            Some(end) => {
                let left = end.saturating_duration_since(Instant::now());
                match batch.handle.wait_timeout(left) {
                    Some(result) => result,
                    None => return Ok(TE_PENDING),
                }
            }
        };
        if !batch.hooks.settle(until) {
            return Ok(TE_PENDING);
        }
        Ok(status_of(&result))
    })
}

/// `int te_batch_status(const te_batch *)`.
///
/// # Safety
/// `batch` a live batch.
#[no_mangle]
pub unsafe extern "C" fn te_batch_status(batch: *const TeBatch) -> c_int {
    const OP: &str = "te_batch_status";
    guard(OP, || {
        // SAFETY: te.h asks for a live batch.
        let batch = unsafe { obj(batch, OP, "batch") }?;
        let failed = match batch.handle.status() {
            TransferStatus::Pending => return Ok(TE_PENDING),
            TransferStatus::Done => None,
            TransferStatus::Failed(e) => Some(e),
        };
        if !batch.hooks.settle(Some(Instant::now())) {
            return Ok(TE_PENDING);
        }
        Ok(failed.map_or(TE_OK, |e| fail(&e)))
    })
}

/// `int te_batch_cancel(te_batch *)`.
///
/// # Safety
/// `batch` a live batch.
#[no_mangle]
pub unsafe extern "C" fn te_batch_cancel(batch: *const TeBatch) -> c_int {
    const OP: &str = "te_batch_cancel";
    guard(OP, || {
        // SAFETY: te.h asks for a live batch.
        unsafe { obj(batch, OP, "batch") }?.handle.cancel();
        Ok(TE_OK)
    })
}

/// `void te_batch_free(te_batch *)`: stops listening; does not cancel.
///
/// # Safety
/// `batch` NULL or a batch not freed yet, used by nothing else now.
#[no_mangle]
pub unsafe extern "C" fn te_batch_free(batch: *mut TeBatch) {
    // SAFETY: NULL or the box `TeBatch::boxed` leaked, by the contract above.
    unsafe { free_box(batch, "te_batch_free") }
}

type OnDone = Box<dyn FnOnce(c_int) + Send>;

/// Runs `on_done` once when the batch resolves, on the thread that resolves it (or on
/// this one if it already has): the handle's `Future`, polled by its own waker.
struct Watch {
    handle: Mutex<TransferHandle>,
    on_done: Mutex<Option<OnDone>>,
    fired: AtomicBool,
}

impl Watch {
    fn start(handle: TransferHandle, on_done: OnDone) {
        let watch = Arc::new(Watch {
            handle: Mutex::new(handle),
            on_done: Mutex::new(Some(on_done)),
            fired: AtomicBool::new(false),
        });
        watch.poll();
    }

    fn poll(self: &Arc<Self>) {
        let waker = Waker::from(self.clone());
        let mut cx = Context::from_waker(&waker);
        let ready = {
            let mut handle = self.handle.lock();
            Pin::new(&mut *handle).poll(&mut cx)
        };
        if let Poll::Ready(result) = ready {
            if !self.fired.swap(true, Ordering::AcqRel) {
                let on_done = self.on_done.lock().take();
                if let Some(on_done) = on_done {
                    on_done(status_of(&result));
                }
            }
        }
    }
}

impl Wake for Watch {
    fn wake(self: Arc<Self>) {
        // A waker runs on te's threads: a panic must stop here.
        guard_void("te_batch_on_complete", || self.poll());
    }
}

/// The C callback and its argument, carried to whichever thread completes the batch.
struct Callback {
    function: extern "C" fn(user: *mut c_void, status: c_int),
    user: *mut c_void,
}

// SAFETY: te.h requires `user` to be usable from any thread (the callback runs on one
// of te's threads); the pointer is only handed back to the caller's function.
unsafe impl Send for Callback {}

/// `int te_batch_on_complete(te_batch *, void (*callback)(void *user, int status),
/// void *user)`.
///
/// # Safety
/// `batch` a live batch; `callback` safe to call with `user` from any thread.
#[no_mangle]
pub unsafe extern "C" fn te_batch_on_complete(
    batch: *const TeBatch,
    callback: Option<extern "C" fn(user: *mut c_void, status: c_int)>,
    user: *mut c_void,
) -> c_int {
    const OP: &str = "te_batch_on_complete";
    guard(OP, || {
        // SAFETY: te.h asks for a live batch.
        let batch = unsafe { obj(batch, OP, "batch") }?;
        let function =
            callback.ok_or_else(|| crate::error::bad_argument(OP, "`callback` is NULL"))?;
        let callback = Callback { function, user };
        let counted = batch.hooks.add_callback();
        let hooks = batch.hooks.clone();
        Watch::start(
            batch.handle.clone(),
            Box::new(move |status| {
                let callback = callback;
                let call = || (callback.function)(callback.user, status);
                if counted {
                    hooks.run_callback(call)
                } else {
                    call()
                }
            }),
        );
        Ok(TE_OK)
    })
}

/// `int te_batch_eventfd(te_batch *, int *fd)`.
///
/// # Safety
/// `batch` a live batch; `fd` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn te_batch_eventfd(batch: *const TeBatch, fd: *mut c_int) -> c_int {
    const OP: &str = "te_batch_eventfd";
    guard(OP, || {
        // SAFETY: te.h asks for a live batch and an out-parameter.
        let (batch, out) = unsafe { (obj(batch, OP, "batch")?, Out::new(fd, OP, "fd")?) };
        // SAFETY: eventfd takes no pointers; a negative result is checked.
        let event = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if event < 0 {
            return Err(Error::new(ErrorKind::Io, "eventfd failed")
                .with_source(std::io::Error::last_os_error()));
        }
        // The fd belongs to the caller from here: te writes it once, and never closes it.
        // Writing after the caller closed it (against te.h) writes to whatever reuses
        // the number, so te.h says: close it only after it became readable.
        let hooks = batch.hooks.clone();
        Watch::start(
            batch.handle.clone(),
            Box::new(move |_status| hooks.signal_when_settled(event)),
        );
        out.set(event);
        Ok(TE_OK)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{last, Pair};
    use std::sync::mpsc::{channel, Receiver, Sender};
    use std::time::Duration;

    /// What a blocking callback shares with its test (leaked: it outlives a failed test).
    struct Gate {
        batch: *const TeBatch,
        entered: Sender<c_int>,
        go: Mutex<Receiver<()>>,
        /// What te_batch_status and te_batch_wait said inside the callback.
        inside: Mutex<Option<(c_int, c_int)>>,
        returned: AtomicBool,
    }

    // SAFETY: `batch` is only passed back to te, whose functions are thread-safe.
    unsafe impl Sync for Gate {}
    // SAFETY: as above.
    unsafe impl Send for Gate {}

    /// Says it entered, asks te about its own batch, then blocks until the test lets it
    /// go (at most 10 s).
    extern "C" fn blocking(user: *mut c_void, status: c_int) {
        // SAFETY: `user` is the leaked Gate of the test.
        let gate = unsafe { &*(user as *const Gate) };
        // SAFETY: the batch outlives its callback (the test frees it after waiting).
        let inside = unsafe { (te_batch_status(gate.batch), te_batch_wait(gate.batch, 5000)) };
        *gate.inside.lock() = Some(inside);
        let _ = gate.entered.send(status);
        let _ = gate.go.lock().recv_timeout(Duration::from_secs(10));
        gate.returned.store(true, Ordering::SeqCst);
    }

    fn readable(fd: c_int) -> bool {
        readable_within(fd, 0)
    }

    /// Whether `fd` becomes readable within `ms` milliseconds.
    fn readable_within(fd: c_int, ms: c_int) -> bool {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        unsafe { libc::poll(&mut p, 1, ms) == 1 }
    }

    #[test]
    fn a_batch_is_reported_done_only_after_its_callback_returned() {
        let pair = Pair::stub("200ms");
        let batch = pair.submit();
        let (entered, entered_rx) = channel();
        let (go_tx, go) = channel();
        let gate: &'static Gate = Box::leak(Box::new(Gate {
            batch,
            entered,
            go: Mutex::new(go),
            inside: Mutex::new(None),
            returned: AtomicBool::new(false),
        }));
        let mut fd = -1;
        // SAFETY: a live batch, a callback and its leaked argument, an out-parameter.
        unsafe {
            assert_eq!(
                te_batch_on_complete(batch, Some(blocking), gate as *const Gate as *mut c_void),
                TE_OK
            );
            assert_eq!(te_batch_eventfd(batch, &mut fd), TE_OK);
            assert_eq!(
                te_batch_status(batch),
                TE_PENDING,
                "resolved before its 200 ms"
            );
        }
        let status = entered_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the callback ran");
        assert_eq!(status, TE_OK);
        // The callback sees its own batch resolved (and does not wait for itself).
        assert_eq!(*gate.inside.lock(), Some((TE_OK, TE_OK)));
        // Elsewhere the batch is not done while its callback runs.
        // SAFETY: a live batch.
        unsafe {
            assert_eq!(
                te_batch_status(batch),
                TE_PENDING,
                "done while its callback runs"
            );
            assert_eq!(
                te_batch_wait(batch, 50),
                TE_PENDING,
                "done while its callback runs"
            );
        }
        assert!(
            !readable(fd),
            "the event fd is readable while the callback runs"
        );
        go_tx.send(()).unwrap();
        // SAFETY: a live batch, freed once.
        unsafe {
            assert_eq!(te_batch_wait(batch, 10_000), TE_OK);
            assert!(
                gate.returned.load(Ordering::SeqCst),
                "te_batch_wait returned before the callback"
            );
            assert_eq!(te_batch_status(batch), TE_OK);
            te_batch_free(batch);
        }
        // The thread that ran the callback writes the event fd next: soon after the
        // wait returned, not necessarily before.
        assert!(
            readable_within(fd, 5_000),
            "the event fd is not readable after the callback returned"
        );
        // SAFETY: the caller's fd, closed once after it became readable.
        unsafe { libc::close(fd) };
    }

    /// The thread the last `note_thread` callback ran on.
    static RAN_ON: Mutex<Option<std::thread::ThreadId>> = Mutex::new(None);

    extern "C" fn note_thread(_user: *mut c_void, _status: c_int) {
        *RAN_ON.lock() = Some(std::thread::current().id());
    }

    #[test]
    fn a_wait_returns_after_the_callback_where_waiters_read_for_the_backend() {
        // With caller_reads, the waiting thread may read the answer and run the callback
        // itself, or te's thread may: either way the wait returns after the callback.
        let pair =
            Pair::with(c"[engine]\nbackend = \"tcp\"\n[backends.tcp]\ncaller_reads = true\n");
        for _ in 0..5 {
            *RAN_ON.lock() = None;
            let batch = pair.submit();
            // SAFETY: a live batch, freed once.
            unsafe {
                assert_eq!(
                    te_batch_on_complete(batch, Some(note_thread), std::ptr::null_mut()),
                    TE_OK
                );
                assert_eq!(te_batch_wait(batch, 10_000), TE_OK, "{}", last());
                te_batch_free(batch);
            }
            assert!(
                RAN_ON.lock().is_some(),
                "te_batch_wait returned before the callback ran"
            );
        }
    }
}
