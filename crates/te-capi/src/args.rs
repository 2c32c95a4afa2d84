//! Reading C arguments: NULL and malformed pointers become `InvalidRequest` errors
//! that name the argument, never undefined behaviour the library could detect.

use std::ffi::{c_char, CStr};
use std::time::Duration;

use te_facade::Result;

use crate::error::{bad_argument, guard_void};

/// The object behind a handle.
///
/// # Safety
/// `ptr` is NULL or a handle of type `T` that te returned and the caller has not freed.
pub(crate) unsafe fn obj<'a, T>(
    ptr: *const T,
    operation: &'static str,
    what: &str,
) -> Result<&'a T> {
    // SAFETY: by the contract above, a non-NULL `ptr` points to a live `T`.
    unsafe { ptr.as_ref() }.ok_or_else(|| bad_argument(operation, format!("`{what}` is NULL")))
}

/// Frees a handle C hands back: drops the box te leaked for it; NULL does nothing.
///
/// # Safety
/// `ptr` is NULL or a handle of type `T` that te returned, not freed yet, and used by
/// no other thread during or after the call.
pub(crate) unsafe fn free_box<T>(ptr: *mut T, operation: &'static str) {
    if ptr.is_null() {
        return;
    }
    guard_void(operation, || {
        // SAFETY: by the contract above this is the box te leaked for the handle, and
        // nothing uses it any more.
        drop(unsafe { Box::from_raw(ptr) });
    });
}

/// A NUL-terminated UTF-8 string argument.
///
/// # Safety
/// `ptr` is NULL or points to a NUL-terminated string that stays valid for `'a`.
pub(crate) unsafe fn text<'a>(
    ptr: *const c_char,
    operation: &'static str,
    what: &str,
) -> Result<&'a str> {
    if ptr.is_null() {
        return Err(bad_argument(operation, format!("`{what}` is NULL")));
    }
    // SAFETY: not NULL, and NUL-terminated and valid by the contract above.
    let c = unsafe { CStr::from_ptr(ptr) };
    c.to_str()
        .map_err(|_| bad_argument(operation, format!("`{what}` is not UTF-8")))
}

/// An array argument of `len` elements; NULL is allowed when `len` is 0. A `len` no
/// array can have (more than `isize::MAX` bytes) is refused, whatever `ptr` is.
///
/// # Safety
/// `ptr` is NULL or points to `len` initialised `T`s that stay valid for `'a`.
pub(crate) unsafe fn slice<'a, T>(
    ptr: *const T,
    len: usize,
    operation: &'static str,
    what: &str,
) -> Result<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    if len > isize::MAX as usize / std::mem::size_of::<T>().max(1) {
        return Err(bad_argument(
            operation,
            format!("`{what}` has {len} elements, more than any array can hold"),
        ));
    }
    if ptr.is_null() {
        return Err(bad_argument(
            operation,
            format!("`{what}` is NULL but its length is {len}"),
        ));
    }
    if !ptr.is_aligned() {
        return Err(bad_argument(operation, format!("`{what}` is misaligned")));
    }
    // SAFETY: not NULL, aligned, and `len` valid elements by the contract above.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// An out-parameter: checked for NULL when taken, written once.
#[derive(Debug)]
pub(crate) struct Out<T>(*mut T);

impl<T> Out<T> {
    /// Takes an out-parameter.
    ///
    /// # Safety
    /// `ptr` is NULL or valid for one write of a `T` until the call returns.
    pub(crate) unsafe fn new(ptr: *mut T, operation: &'static str, what: &str) -> Result<Out<T>> {
        if ptr.is_null() {
            return Err(bad_argument(operation, format!("`{what}` is NULL")));
        }
        if !ptr.is_aligned() {
            return Err(bad_argument(operation, format!("`{what}` is misaligned")));
        }
        Ok(Out(ptr))
    }

    /// Takes an optional out-parameter: `None` where `ptr` is NULL.
    ///
    /// # Safety
    /// As [`Out::new`].
    pub(crate) unsafe fn optional(
        ptr: *mut T,
        operation: &'static str,
        what: &str,
    ) -> Result<Option<Out<T>>> {
        if ptr.is_null() {
            return Ok(None);
        }
        // SAFETY: not NULL, and otherwise the caller's promise, passed on.
        unsafe { Out::new(ptr, operation, what) }.map(Some)
    }

    /// Writes the value (without dropping what was there: C memory holds no Rust value).
    pub(crate) fn set(self, value: T) {
        // SAFETY: `new` checked that the pointer is not NULL and aligned, and its caller
        // promised it is valid for a write of `T`.
        unsafe { self.0.write(value) }
    }
}

/// A wait's timeout: negative waits without limit (`None`), otherwise milliseconds.
pub(crate) fn wait_timeout(ms: i64) -> Option<Duration> {
    u64::try_from(ms).ok().map(Duration::from_millis)
}

/// A call's deadline: 0 is the engine's `default_timeout` (`None`).
pub(crate) fn call_timeout(ms: u64) -> Option<Duration> {
    (ms != 0).then(|| Duration::from_millis(ms))
}
