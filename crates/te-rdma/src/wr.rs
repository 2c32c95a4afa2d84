//! Work-request construction: one RDMA WRITE or READ per slice, one scatter-gather
//! entry each, chained for a single `ibv_post_send`. Pure data, tested without a NIC.
//!
//! The buffers are kept per QP and reused, so posting allocates nothing once they have
//! grown to the QP's depth.

use crate::verbs as sys;
use te_core::Op;

/// One slice, resolved to addresses and keys on one path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WorkItem {
    pub(crate) op: Op,
    pub(crate) wr_id: u64,
    pub(crate) signaled: bool,
    /// Local address (source of a WRITE, destination of a READ).
    pub(crate) local_addr: u64,
    pub(crate) lkey: u32,
    /// The peer's address, in its registration's address space.
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
    pub(crate) len: u32,
}

/// The verbs opcode of an operation.
pub(crate) fn opcode(op: Op) -> u32 {
    match op {
        Op::Write => sys::IBV_WR_RDMA_WRITE,
        Op::Read => sys::IBV_WR_RDMA_READ,
    }
}

/// Reusable storage for a chain of work requests.
#[derive(Default)]
pub(crate) struct WrChain {
    sges: Vec<sys::ibv_sge>,
    wrs: Vec<sys::ibv_send_wr>,
}

// SAFETY: the raw pointers inside point into the chain's own vectors and are rebuilt at
// every `build`; the chain is only used under its path's lock.
unsafe impl Send for WrChain {}

impl std::fmt::Debug for WrChain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WrChain")
            .field("len", &self.wrs.len())
            .finish()
    }
}

impl WrChain {
    /// Builds the chain for `items` and returns its head, valid until the next `build`
    /// (null for no items).
    pub(crate) fn build(&mut self, items: &[WorkItem]) -> *mut sys::ibv_send_wr {
        self.sges.clear();
        self.wrs.clear();
        self.sges.extend(items.iter().map(|it| sys::ibv_sge {
            addr: it.local_addr,
            length: it.len,
            lkey: it.lkey,
        }));
        for it in items {
            let mut wr = sys::ibv_send_wr {
                wr_id: it.wr_id,
                num_sge: 1,
                opcode: opcode(it.op),
                send_flags: if it.signaled {
                    sys::IBV_SEND_SIGNALED
                } else {
                    0
                },
                ..Default::default()
            };
            wr.wr.rdma = sys::ibv_rdma_info {
                remote_addr: it.remote_addr,
                rkey: it.rkey,
            };
            self.wrs.push(wr);
        }
        // The vectors are complete: their elements no longer move.
        let sges = self.sges.as_mut_ptr();
        let wrs = self.wrs.as_mut_ptr();
        let n = self.wrs.len();
        for (i, wr) in self.wrs.iter_mut().enumerate() {
            // SAFETY: `i < n`, within both vectors, which are not touched until the next
            // `build`.
            wr.sg_list = unsafe { sges.add(i) };
            wr.next = if i + 1 < n {
                // SAFETY: as above.
                unsafe { wrs.add(i + 1) }
            } else {
                std::ptr::null_mut()
            };
        }
        if n == 0 {
            std::ptr::null_mut()
        } else {
            wrs
        }
    }

    /// The work requests of the last `build`.
    #[cfg(test)]
    fn wrs(&self) -> &[sys::ibv_send_wr] {
        &self.wrs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(op: Op, i: u32, signaled: bool) -> WorkItem {
        WorkItem {
            op,
            wr_id: 100 + u64::from(i),
            signaled,
            local_addr: 0x1000 + u64::from(i) * 0x10000,
            lkey: 0x11,
            remote_addr: 0x7f00_0000_0000 + u64::from(i) * 0x10000,
            rkey: 0xabcd,
            len: 0x10000 - i,
        }
    }

    #[test]
    fn writes_and_reads_get_their_opcodes_addresses_keys_and_lengths() {
        let mut c = WrChain::default();
        let items = [item(Op::Write, 0, false), item(Op::Read, 1, true)];
        let head = c.build(&items);
        assert_eq!(head, c.wrs().as_ptr() as *mut _);
        for (wr, it) in c.wrs().iter().zip(&items) {
            assert_eq!(wr.wr_id, it.wr_id);
            assert_eq!(wr.opcode, opcode(it.op));
            assert_eq!(wr.num_sge, 1);
            // SAFETY: `rdma` is the member `build` wrote.
            let rdma = unsafe { wr.wr.rdma };
            assert_eq!((rdma.remote_addr, rdma.rkey), (it.remote_addr, it.rkey));
            // SAFETY: `sg_list` points into the chain, alive until the next build.
            let sge = unsafe { *wr.sg_list };
            assert_eq!(
                (sge.addr, sge.length, sge.lkey),
                (it.local_addr, it.len, it.lkey)
            );
        }
        assert_eq!(c.wrs()[0].opcode, sys::IBV_WR_RDMA_WRITE);
        assert_eq!(c.wrs()[1].opcode, sys::IBV_WR_RDMA_READ);
        assert_eq!(c.wrs()[0].send_flags, 0);
        assert_eq!(c.wrs()[1].send_flags, sys::IBV_SEND_SIGNALED);
    }

    #[test]
    fn the_chain_links_every_request_once_and_ends_in_null() {
        let mut c = WrChain::default();
        let items: Vec<_> = (0..5).map(|i| item(Op::Write, i, i == 4)).collect();
        let mut p = c.build(&items);
        let mut ids = Vec::new();
        while !p.is_null() {
            // SAFETY: the chain is alive until the next build.
            let wr = unsafe { &*p };
            ids.push(wr.wr_id);
            p = wr.next;
        }
        assert_eq!(ids, [100, 101, 102, 103, 104]);
        assert!(c.build(&[]).is_null());
        let p = c.build(&items[..1]);
        // SAFETY: as above.
        assert!(unsafe { (*p).next }.is_null(), "rebuilt, not appended");
    }
}
