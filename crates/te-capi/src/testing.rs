//! What the tests share: two engines connected to each other.

use std::ffi::{c_char, CStr, CString};

use crate::batch::TeBatch;
use crate::engine::{
    te_engine_address, te_engine_connect, te_engine_free, te_engine_new, te_engine_register,
    te_engine_transfer, te_peer_free, te_peer_region, TeEngine, TePeer, TeRequest,
};
use crate::error::TE_OK;

/// The bytes of each engine's region.
pub(crate) const LEN: usize = 4096;

/// The calling thread's last error message.
pub(crate) fn last() -> String {
    // SAFETY: te_last_error returns a NUL-terminated string of this thread.
    unsafe { CStr::from_ptr(crate::te_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// Two engines, `b` connected to `a`, each with a region of `LEN` bytes, and a WRITE
/// of `b`'s region into `a`'s.
pub(crate) struct Pair {
    pub(crate) a: *mut TeEngine,
    pub(crate) b: *mut TeEngine,
    pub(crate) peer: *mut TePeer,
    pub(crate) write: TeRequest,
    _memory: Vec<u8>,
}

impl Pair {
    /// Two stub engines whose batches complete `delay` after submission.
    pub(crate) fn stub(delay: &str) -> Pair {
        let config =
            format!("[engine]\nbackend = \"stub\"\n[backends.stub]\ndelay = \"{delay}\"\n");
        Pair::with(&CString::new(config).unwrap())
    }

    /// Two engines of `config`.
    pub(crate) fn with(config: &CStr) -> Pair {
        let mut memory = vec![7u8; 2 * LEN];
        let (mut a, mut b, mut peer) = (
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        );
        let (mut dst, mut src, mut remote) = (0, 0, 0);
        let mut address = [0 as c_char; 64];
        // SAFETY: every pointer is a live local or what te returned.
        unsafe {
            assert_eq!(te_engine_new(config.as_ptr(), &mut a), TE_OK, "{}", last());
            assert_eq!(te_engine_new(config.as_ptr(), &mut b), TE_OK, "{}", last());
            let base = memory.as_mut_ptr();
            let (null, rw) = (std::ptr::null(), 3);
            assert_eq!(
                te_engine_register(a, c"dst".as_ptr(), base.cast(), LEN, null, rw, &mut dst),
                TE_OK
            );
            assert_eq!(
                te_engine_register(
                    b,
                    c"src".as_ptr(),
                    base.add(LEN).cast(),
                    LEN,
                    null,
                    0,
                    &mut src
                ),
                TE_OK
            );
            assert_eq!(te_engine_address(a, address.as_mut_ptr(), 64), TE_OK);
            assert_eq!(
                te_engine_connect(b, address.as_ptr(), 0, &mut peer),
                TE_OK,
                "{}",
                last()
            );
            assert_eq!(
                te_peer_region(peer, c"dst".as_ptr(), &mut remote, std::ptr::null_mut()),
                TE_OK
            );
        }
        let write = TeRequest {
            op: 1,
            reserved: 0,
            local: src,
            local_offset: 0,
            remote,
            remote_offset: 0,
            len: LEN as u64,
        };
        Pair {
            a,
            b,
            peer,
            write,
            _memory: memory,
        }
    }

    /// Submits the WRITE.
    pub(crate) fn submit(&self) -> *mut TeBatch {
        let mut batch = std::ptr::null_mut();
        // SAFETY: live handles, one request, an out-parameter.
        let rc = unsafe {
            te_engine_transfer(
                self.b,
                self.peer,
                &self.write,
                1,
                0,
                std::ptr::null(),
                0,
                &mut batch,
            )
        };
        assert_eq!(rc, TE_OK, "{}", last());
        batch
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        // SAFETY: handles from te, freed once.
        unsafe {
            te_peer_free(self.peer);
            te_engine_free(self.b);
            te_engine_free(self.a);
        }
    }
}
