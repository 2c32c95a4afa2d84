//! Batches in flight: wait with a timeout, status without blocking, a completion
//! callback, an event fd, cancel.

use std::ffi::{c_int, c_void};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use te_core::sync::Mutex;

use te_facade::{Error, ErrorKind, Result, TransferHandle, TransferStatus};

use crate::args::{free_box, obj, wait_timeout, Out};
use crate::error::{fail, guard, guard_void, TE_OK, TE_PENDING};

/// `te_batch`: a submitted batch.
#[derive(Debug)]
pub struct TeBatch(TransferHandle);

impl TeBatch {
    pub(crate) fn boxed(handle: TransferHandle) -> *mut TeBatch {
        Box::into_raw(Box::new(TeBatch(handle)))
    }
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
        Ok(match wait_timeout(timeout_ms) {
            None => status_of(&batch.0.wait()),
            Some(t) => match batch.0.wait_timeout(t) {
                Some(result) => status_of(&result),
                None => TE_PENDING,
            },
        })
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
        Ok(match batch.0.status() {
            TransferStatus::Pending => TE_PENDING,
            TransferStatus::Done => TE_OK,
            TransferStatus::Failed(e) => fail(&e),
        })
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
        unsafe { obj(batch, OP, "batch") }?.0.cancel();
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
        Watch::start(
            batch.0.clone(),
            Box::new(move |status| {
                let callback = callback;
                (callback.function)(callback.user, status)
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
        Watch::start(
            batch.0.clone(),
            Box::new(move |_status| {
                let one: u64 = 1;
                // SAFETY: writes 8 bytes from a live local to the eventfd, which the
                // caller keeps open until it became readable (te.h).
                let _ = unsafe { libc::write(event, (&one as *const u64).cast(), 8) };
            }),
        );
        out.set(event);
        Ok(TE_OK)
    })
}
