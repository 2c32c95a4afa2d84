//! Completion callbacks for asyncio: one thread per process turns handle wake-ups into
//! Python calls.
//!
//! A handle's waker only sends the batch's number down a channel, so a backend's
//! completion thread never waits for the GIL; this thread takes the GIL to run the
//! callback (which, for `await`, is `loop.call_soon_threadsafe`). It sleeps on the
//! channel: nothing polls.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Wake, Waker};
use te_core::kit::thread::SpawnMasked as _;
use te_core::sync::Mutex;

use pyo3::prelude::*;
use te::TransferHandle;

enum Msg {
    Watch(u64, TransferHandle, PyObject),
    Wake(u64),
}

struct Wakeup {
    id: u64,
    tx: Mutex<Sender<Msg>>,
}

impl Wake for Wakeup {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        let tx = self.tx.lock();
        // The thread lives as long as the process; a send cannot fail before exit.
        let _ = tx.send(Msg::Wake(self.id));
    }
}

struct Notifier {
    tx: Mutex<Sender<Msg>>,
    next: Mutex<u64>,
}

fn notifier() -> PyResult<&'static Notifier> {
    static N: OnceLock<Mutex<Option<&'static Notifier>>> = OnceLock::new();
    let mut slot = N.get_or_init(|| Mutex::new(None)).lock();
    if let Some(n) = *slot {
        return Ok(n);
    }
    {
        let (tx, rx) = channel::<Msg>();
        let waker_tx = tx.clone();
        std::thread::Builder::new()
            .name("te-py-notifier".into())
            .spawn_masked(move || {
                let mut watched: HashMap<u64, (TransferHandle, PyObject)> = HashMap::new();
                for msg in rx {
                    let id = match msg {
                        Msg::Watch(id, h, cb) => {
                            watched.insert(id, (h, cb));
                            id
                        }
                        Msg::Wake(id) => id,
                    };
                    let Some((h, _)) = watched.get_mut(&id) else {
                        continue;
                    };
                    let waker = Waker::from(Arc::new(Wakeup {
                        id,
                        tx: Mutex::new(waker_tx.clone()),
                    }));
                    let ready = Pin::new(h)
                        .poll(&mut Context::from_waker(&waker))
                        .is_ready();
                    if ready {
                        if let Some((_, cb)) = watched.remove(&id) {
                            Python::with_gil(|py| {
                                if let Err(e) = cb.call0(py) {
                                    e.write_unraisable(py, None);
                                }
                            });
                        }
                    }
                }
            })
            .map_err(|e| {
                pyo3::exceptions::PyRuntimeError::new_err(format!(
                    "cannot start te's completion-callback thread: {e}"
                ))
            })?;
        let n: &'static Notifier = Box::leak(Box::new(Notifier {
            tx: Mutex::new(tx),
            next: Mutex::new(0),
        }));
        *slot = Some(n);
        Ok(n)
    }
}

/// Calls `callback()` (with the GIL, on the notifier thread) once `handle` resolves.
///
/// # Errors
/// `RuntimeError` if the notifier thread cannot be started.
pub(crate) fn on_done(handle: TransferHandle, callback: PyObject) -> PyResult<()> {
    let n = notifier()?;
    let id = {
        let mut next = n.next.lock();
        *next += 1;
        *next
    };
    let tx = n.tx.lock();
    let _ = tx.send(Msg::Watch(id, handle, callback));
    Ok(())
}
