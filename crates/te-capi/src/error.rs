//! Status codes, the calling thread's last error message, and the guard every exported
//! function runs its body in (so no panic crosses into C).

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use te_facade::{Error, ErrorKind, Result};

/// Success.
pub const TE_OK: c_int = 0;
/// Not an error: the thing waited for has not happened yet (a batch still in flight,
/// no notification within the timeout).
pub const TE_PENDING: c_int = 1;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `message` as the calling thread's last error.
pub(crate) fn set_last_error(message: &str) {
    // An interior NUL would cut the message short in C; show it instead.
    let text = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    // A te call from a thread-local destructor (a C++ `thread_local` holding te handles)
    // may come after this thread's LAST_ERROR is gone: the message is lost, and
    // te_last_error says so, instead of a panic that would abort the process.
    let _ = LAST_ERROR.try_with(|last| *last.borrow_mut() = text);
}

/// What `te_last_error` returns once the calling thread's storage is destroyed.
static LOST: &CStr = c"the message is lost: te was called while this thread was exiting, after its storage was destroyed";

/// The negative status code of `kind`: minus its code in te's one `ErrorKind` table.
pub(crate) fn status_of(kind: ErrorKind) -> c_int {
    // Codes are small (the table is checked against te.h), so the cast cannot wrap.
    -(kind.code() as c_int)
}

/// Records `error` as the last error and returns its status code.
pub(crate) fn fail(error: &Error) -> c_int {
    set_last_error(&error.to_string());
    status_of(error.kind())
}

/// An `InvalidRequest` error for a bad argument of a C call.
pub(crate) fn bad_argument(operation: &'static str, message: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidRequest, message).with_operation(operation)
}

/// Runs the body of an exported function: its error becomes a status code and the
/// thread's last error, and a panic becomes `Backend` with a message saying so.
pub(crate) fn guard(operation: &'static str, body: impl FnOnce() -> Result<c_int>) -> c_int {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(status)) => status,
        Ok(Err(error)) => fail(&error.with_operation(operation)),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".to_string());
            set_last_error(&format!(
                "{operation}: internal error ({what}); this is a bug in te, please report it"
            ));
            status_of(ErrorKind::Backend)
        }
    }
}

/// Runs `body`, discarding a panic (for functions that return nothing, such as the
/// `_free` functions).
pub(crate) fn guard_void(operation: &'static str, body: impl FnOnce()) {
    let _ = guard(operation, || {
        body();
        Ok(TE_OK)
    });
}

/// The calling thread's last error message: the message of the last call on this
/// thread that returned a negative status. Never NULL (empty if no call failed yet).
/// The string stays valid until the next te call on this thread. On a thread that is
/// exiting, after its storage was destroyed, a static message saying the message is lost.
#[no_mangle]
pub extern "C" fn te_last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|last| last.borrow().as_ptr())
        .unwrap_or(LOST.as_ptr())
}

fn names() -> &'static HashMap<c_int, CString> {
    static NAMES: OnceLock<HashMap<c_int, CString>> = OnceLock::new();
    NAMES.get_or_init(|| {
        let mut names: HashMap<c_int, CString> = crate::header::kinds()
            .into_iter()
            .map(|kind| {
                let name = CString::new(kind.as_str()).unwrap_or_default();
                (status_of(kind), name)
            })
            .collect();
        names.insert(TE_OK, c"Ok".to_owned());
        names.insert(TE_PENDING, c"Pending".to_owned());
        names
    })
}

/// The name of a status code (`"Ok"`, `"Pending"`, `"ConfigInvalid"`, …), or
/// `"Unknown"`. The string is static.
#[no_mangle]
pub extern "C" fn te_status_name(status: c_int) -> *const c_char {
    static UNKNOWN: &CStr = c"Unknown";
    let mut name = UNKNOWN.as_ptr();
    guard_void("te_status_name", || {
        if let Some(n) = names().get(&status) {
            name = n.as_ptr();
        }
    });
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last() -> String {
        // SAFETY: te_last_error returns a NUL-terminated string of this thread.
        unsafe { CStr::from_ptr(te_last_error()) }
            .to_str()
            .unwrap()
            .to_string()
    }

    #[test]
    fn a_panic_becomes_a_backend_error_with_a_message() {
        let status = guard("te_test_call", || panic!("deliberately"));
        assert_eq!(status, status_of(ErrorKind::Backend));
        let message = last();
        assert!(
            message.contains("te_test_call") && message.contains("deliberately"),
            "{message}"
        );
    }

    #[test]
    fn an_error_becomes_its_negated_code_and_the_threads_message() {
        let status = guard("te_test_call", || {
            Err(Error::new(ErrorKind::OutOfBounds, "past the end"))
        });
        assert_eq!(status, -5);
        assert_eq!(last(), "te_test_call: past the end");
        let other = std::thread::spawn(last).join().unwrap();
        assert_eq!(other, "", "another thread's last error is its own");
    }

    /// What a failing call returned in a thread-local destructor, and te_last_error().
    static SEEN_AT_EXIT: std::sync::Mutex<Option<(c_int, String)>> = std::sync::Mutex::new(None);

    /// Calls te from its destructor, as a C++ `thread_local` object holding te handles
    /// does when its thread exits.
    struct CallsTeAtExit;

    impl Drop for CallsTeAtExit {
        fn drop(&mut self) {
            let status = guard("te_test_call", || {
                Err(Error::new(ErrorKind::OutOfBounds, "past the end"))
            });
            *SEEN_AT_EXIT.lock().unwrap() = Some((status, last()));
        }
    }

    thread_local! {
        static AT_EXIT: CallsTeAtExit = const { CallsTeAtExit };
    }

    #[test]
    fn a_call_from_a_thread_local_destructor_returns_its_status() {
        std::thread::spawn(|| {
            // Destructors run in the reverse order of first use: this one after te's
            // own thread-local state is gone.
            AT_EXIT.with(|_| {});
            set_last_error("first");
        })
        .join()
        .unwrap();
        let (status, message) = SEEN_AT_EXIT
            .lock()
            .unwrap()
            .take()
            .expect("the destructor ran");
        assert_eq!(status, -5);
        assert!(message.contains("lost"), "{message}");
    }
}
