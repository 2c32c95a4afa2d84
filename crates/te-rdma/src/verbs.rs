//! The libibverbs structs, enums and constants te uses, declared here rather than taken
//! from a bindings crate whose build compiles rdma-core.
//!
//! Each declaration follows `<infiniband/verbs.h>` of rdma-core on 64-bit Linux. Only the
//! fields te reads or writes are named; the rest of a struct is kept as padding of the
//! right size so that the whole struct has the header's size and alignment. C enums are
//! `u32` fields with the values as constants. The test in `verbs/layout.rs` compiles a
//! C program against the system's header and compares every size, alignment, offset
//! and constant listed there with these declarations.
//!
//! The module has no dependency on the rest of the crate, so the fake verbs provider
//! (`crates/fakeverbs`) declares its side of the ABI with the same file.

// Some declarations serve only the fake provider, which shares this file.
#![allow(dead_code, non_camel_case_types, missing_docs)]

use std::ffi::{c_char, c_int, c_uint, c_void};

/// An RDMA device as `ibv_get_device_list` lists it; te only passes its pointer on.
#[repr(C)]
pub(crate) struct ibv_device {
    _opaque: [u8; 0],
}

/// `union ibv_gid`: 16 bytes, aligned as the 64-bit halves of its `global` member.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) union ibv_gid {
    pub(crate) raw: [u8; 16],
    pub(crate) global: ibv_gid_global,
}

/// The `global` view of a GID: subnet prefix and interface id, big-endian.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct ibv_gid_global {
    pub(crate) subnet_prefix: u64,
    pub(crate) interface_id: u64,
}

/// `struct ibv_gid_entry`, filled by `_ibv_query_gid_ex`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ibv_gid_entry {
    pub(crate) gid: ibv_gid,
    pub(crate) gid_index: u32,
    pub(crate) port_num: u32,
    pub(crate) gid_type: u32,
    pub(crate) ndev_ifindex: u32,
}

pub(crate) const IBV_GID_TYPE_IB: u32 = 0;
pub(crate) const IBV_GID_TYPE_ROCE_V1: u32 = 1;
pub(crate) const IBV_GID_TYPE_ROCE_V2: u32 = 2;

/// `struct ibv_device_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ibv_device_attr {
    pub(crate) fw_ver: [c_char; 64],
    pub(crate) node_guid: u64,
    pub(crate) sys_image_guid: u64,
    pub(crate) max_mr_size: u64,
    pub(crate) page_size_cap: u64,
    pub(crate) vendor_id: u32,
    pub(crate) vendor_part_id: u32,
    pub(crate) hw_ver: u32,
    pub(crate) max_qp: c_int,
    pub(crate) max_qp_wr: c_int,
    pub(crate) device_cap_flags: c_uint,
    pub(crate) max_sge: c_int,
    pub(crate) max_sge_rd: c_int,
    pub(crate) max_cq: c_int,
    pub(crate) max_cqe: c_int,
    pub(crate) max_mr: c_int,
    pub(crate) max_pd: c_int,
    pub(crate) max_qp_rd_atom: c_int,
    pub(crate) max_ee_rd_atom: c_int,
    pub(crate) max_res_rd_atom: c_int,
    pub(crate) max_qp_init_rd_atom: c_int,
    /// `max_ee_init_rd_atom` through `max_srq_sge`: 16 ints te does not read.
    pub(crate) _more: [c_int; 16],
    pub(crate) max_pkeys: u16,
    pub(crate) local_ca_ack_delay: u8,
    pub(crate) phys_port_cnt: u8,
}

/// `struct ibv_port_attr`. The exported `ibv_query_port` writes the older layout, which
/// is this one up to and including `link_layer`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct ibv_port_attr {
    pub(crate) state: u32,
    pub(crate) max_mtu: u32,
    pub(crate) active_mtu: u32,
    pub(crate) gid_tbl_len: c_int,
    pub(crate) port_cap_flags: u32,
    pub(crate) max_msg_sz: u32,
    pub(crate) bad_pkey_cntr: u32,
    pub(crate) qkey_viol_cntr: u32,
    pub(crate) pkey_tbl_len: u16,
    pub(crate) lid: u16,
    pub(crate) sm_lid: u16,
    pub(crate) lmc: u8,
    pub(crate) max_vl_num: u8,
    pub(crate) sm_sl: u8,
    pub(crate) subnet_timeout: u8,
    pub(crate) init_type_reply: u8,
    pub(crate) active_width: u8,
    pub(crate) active_speed: u8,
    pub(crate) phys_state: u8,
    pub(crate) link_layer: u8,
    pub(crate) flags: u8,
    pub port_cap_flags2: u16,
}

pub(crate) const IBV_PORT_DOWN: u32 = 1;
pub(crate) const IBV_PORT_ACTIVE: u32 = 4;
pub(crate) const IBV_LINK_LAYER_INFINIBAND: u8 = 1;
pub(crate) const IBV_LINK_LAYER_ETHERNET: u8 = 2;

pub(crate) const IBV_MTU_256: u32 = 1;
pub(crate) const IBV_MTU_1024: u32 = 3;
pub(crate) const IBV_MTU_4096: u32 = 5;

/// The provider's entry points in `struct ibv_context`. Those te calls are named (they
/// are what the header's inline `ibv_poll_cq`, `ibv_req_notify_cq`, `ibv_post_send` and
/// `ibv_post_recv` call); the others are kept as pointer-sized padding.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ibv_context_ops {
    /// `_compat_query_device` through `_compat_create_cq`.
    pub(crate) _before_poll_cq: [*mut c_void; 11],
    pub(crate) poll_cq: Option<unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int>,
    pub(crate) req_notify_cq: Option<unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int>,
    /// `_compat_cq_event` through `_compat_destroy_qp`.
    pub(crate) _before_post_send: [*mut c_void; 12],
    pub(crate) post_send:
        Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int>,
    pub(crate) post_recv:
        Option<unsafe extern "C" fn(*mut ibv_qp, *mut c_void, *mut *mut c_void) -> c_int>,
    /// `_compat_create_ah` through `_compat_async_event`.
    pub(crate) _after_post_recv: [*mut c_void; 5],
}

/// `struct ibv_context`: an open device.
#[repr(C)]
pub(crate) struct ibv_context {
    pub(crate) device: *mut ibv_device,
    pub(crate) ops: ibv_context_ops,
    pub(crate) cmd_fd: c_int,
    pub(crate) async_fd: c_int,
    pub(crate) num_comp_vectors: c_int,
    pub(crate) mutex: libc::pthread_mutex_t,
    pub(crate) abi_compat: *mut c_void,
}

/// `struct ibv_pd`.
#[repr(C)]
pub(crate) struct ibv_pd {
    pub(crate) context: *mut ibv_context,
    pub(crate) handle: u32,
}

/// `struct ibv_mr`.
#[repr(C)]
pub(crate) struct ibv_mr {
    pub(crate) context: *mut ibv_context,
    pub(crate) pd: *mut ibv_pd,
    pub(crate) addr: *mut c_void,
    pub(crate) length: usize,
    pub(crate) handle: u32,
    pub(crate) lkey: u32,
    pub(crate) rkey: u32,
}

pub(crate) const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
pub(crate) const IBV_ACCESS_REMOTE_WRITE: c_int = 2;
pub(crate) const IBV_ACCESS_REMOTE_READ: c_int = 4;
pub(crate) const IBV_ACCESS_REMOTE_ATOMIC: c_int = 8;

/// `struct ibv_comp_channel`.
#[repr(C)]
pub(crate) struct ibv_comp_channel {
    pub(crate) context: *mut ibv_context,
    pub(crate) fd: c_int,
    pub(crate) refcnt: c_int,
}

/// `struct ibv_cq`.
#[repr(C)]
pub(crate) struct ibv_cq {
    pub(crate) context: *mut ibv_context,
    pub(crate) channel: *mut ibv_comp_channel,
    pub(crate) cq_context: *mut c_void,
    pub(crate) handle: u32,
    pub(crate) cqe: c_int,
    pub(crate) mutex: libc::pthread_mutex_t,
    pub(crate) cond: libc::pthread_cond_t,
    pub(crate) comp_events_completed: u32,
    pub(crate) async_events_completed: u32,
}

/// `struct ibv_qp`.
#[repr(C)]
pub(crate) struct ibv_qp {
    pub(crate) context: *mut ibv_context,
    pub(crate) qp_context: *mut c_void,
    pub(crate) pd: *mut ibv_pd,
    pub(crate) send_cq: *mut ibv_cq,
    pub(crate) recv_cq: *mut ibv_cq,
    pub(crate) srq: *mut c_void,
    pub(crate) handle: u32,
    pub(crate) qp_num: u32,
    pub(crate) state: u32,
    pub(crate) qp_type: u32,
    pub(crate) mutex: libc::pthread_mutex_t,
    pub(crate) cond: libc::pthread_cond_t,
    pub(crate) events_completed: u32,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub(crate) struct ibv_qp_cap {
    pub(crate) max_send_wr: u32,
    pub(crate) max_recv_wr: u32,
    pub(crate) max_send_sge: u32,
    pub(crate) max_recv_sge: u32,
    pub(crate) max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ibv_qp_init_attr {
    pub(crate) qp_context: *mut c_void,
    pub(crate) send_cq: *mut ibv_cq,
    pub(crate) recv_cq: *mut ibv_cq,
    pub(crate) srq: *mut c_void,
    pub(crate) cap: ibv_qp_cap,
    pub(crate) qp_type: u32,
    pub(crate) sq_sig_all: c_int,
}

pub(crate) const IBV_QPT_RC: u32 = 2;

/// `struct ibv_global_route`: the GRH of an address vector (RoCE, routed IB).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ibv_global_route {
    pub(crate) dgid: ibv_gid,
    pub(crate) flow_label: u32,
    pub(crate) sgid_index: u8,
    pub(crate) hop_limit: u8,
    pub(crate) traffic_class: u8,
}

/// `struct ibv_ah_attr`: an address vector.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ibv_ah_attr {
    pub(crate) grh: ibv_global_route,
    pub(crate) dlid: u16,
    pub(crate) sl: u8,
    pub(crate) src_path_bits: u8,
    pub(crate) static_rate: u8,
    pub(crate) is_global: u8,
    pub(crate) port_num: u8,
}

/// `struct ibv_qp_attr`, for `ibv_modify_qp`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ibv_qp_attr {
    pub(crate) qp_state: u32,
    pub(crate) cur_qp_state: u32,
    pub(crate) path_mtu: u32,
    pub(crate) path_mig_state: u32,
    pub(crate) qkey: u32,
    pub(crate) rq_psn: u32,
    pub(crate) sq_psn: u32,
    pub(crate) dest_qp_num: u32,
    pub(crate) qp_access_flags: c_uint,
    pub(crate) cap: ibv_qp_cap,
    pub(crate) ah_attr: ibv_ah_attr,
    pub(crate) alt_ah_attr: ibv_ah_attr,
    pub(crate) pkey_index: u16,
    pub(crate) alt_pkey_index: u16,
    pub(crate) en_sqd_async_notify: u8,
    pub(crate) sq_draining: u8,
    pub(crate) max_rd_atomic: u8,
    pub(crate) max_dest_rd_atomic: u8,
    pub(crate) min_rnr_timer: u8,
    pub(crate) port_num: u8,
    pub(crate) timeout: u8,
    pub(crate) retry_cnt: u8,
    pub(crate) rnr_retry: u8,
    pub(crate) alt_port_num: u8,
    pub(crate) alt_timeout: u8,
    pub(crate) rate_limit: u32,
}

pub(crate) const IBV_QPS_RESET: u32 = 0;
pub(crate) const IBV_QPS_INIT: u32 = 1;
pub(crate) const IBV_QPS_RTR: u32 = 2;
pub(crate) const IBV_QPS_RTS: u32 = 3;
pub(crate) const IBV_QPS_ERR: u32 = 6;

pub(crate) const IBV_QP_STATE: c_int = 1;
pub(crate) const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub(crate) const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
pub(crate) const IBV_QP_PORT: c_int = 1 << 5;
pub(crate) const IBV_QP_AV: c_int = 1 << 7;
pub(crate) const IBV_QP_PATH_MTU: c_int = 1 << 8;
pub(crate) const IBV_QP_TIMEOUT: c_int = 1 << 9;
pub(crate) const IBV_QP_RETRY_CNT: c_int = 1 << 10;
pub(crate) const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub(crate) const IBV_QP_RQ_PSN: c_int = 1 << 12;
pub(crate) const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
pub(crate) const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub(crate) const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub(crate) const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
pub(crate) const IBV_QP_DEST_QPN: c_int = 1 << 20;

/// `struct ibv_sge`: one scatter-gather entry.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub(crate) struct ibv_sge {
    pub(crate) addr: u64,
    pub(crate) length: u32,
    pub(crate) lkey: u32,
}

/// The `rdma` member of `ibv_send_wr::wr`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub(crate) struct ibv_rdma_info {
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
}

/// The `wr` union of `ibv_send_wr`; `atomic`, the largest member, sets its size.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) union ibv_send_wr_wr {
    pub(crate) rdma: ibv_rdma_info,
    pub(crate) atomic: [u64; 4],
}

/// `struct ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ibv_send_wr {
    pub(crate) wr_id: u64,
    pub(crate) next: *mut ibv_send_wr,
    pub(crate) sg_list: *mut ibv_sge,
    pub(crate) num_sge: c_int,
    pub(crate) opcode: u32,
    pub(crate) send_flags: c_uint,
    /// `imm_data` or `invalidate_rkey`.
    pub(crate) imm_data: u32,
    pub(crate) wr: ibv_send_wr_wr,
    /// The `qp_type` union (`xrc.remote_srqn`).
    pub(crate) qp_type: u32,
    /// The trailing `bind_mw` / `tso` union.
    pub(crate) _bind_mw_or_tso: [u64; 6],
}

pub(crate) const IBV_WR_RDMA_WRITE: u32 = 0;
pub(crate) const IBV_WR_SEND: u32 = 2;
pub(crate) const IBV_WR_RDMA_READ: u32 = 4;
pub(crate) const IBV_SEND_SIGNALED: c_uint = 2;

/// `struct ibv_wc`: one work completion.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub(crate) struct ibv_wc {
    pub(crate) wr_id: u64,
    pub(crate) status: u32,
    pub(crate) opcode: u32,
    pub(crate) vendor_err: u32,
    pub(crate) byte_len: u32,
    /// `imm_data` or `invalidated_rkey`.
    pub(crate) imm_data: u32,
    pub(crate) qp_num: u32,
    pub(crate) src_qp: u32,
    pub(crate) wc_flags: c_uint,
    pub(crate) pkey_index: u16,
    pub(crate) slid: u16,
    pub(crate) sl: u8,
    pub(crate) dlid_path_bits: u8,
}

pub(crate) const IBV_WC_SUCCESS: u32 = 0;
pub(crate) const IBV_WC_LOC_LEN_ERR: u32 = 1;
pub(crate) const IBV_WC_LOC_QP_OP_ERR: u32 = 2;
pub(crate) const IBV_WC_LOC_PROT_ERR: u32 = 4;
pub(crate) const IBV_WC_WR_FLUSH_ERR: u32 = 5;
pub(crate) const IBV_WC_BAD_RESP_ERR: u32 = 7;
pub(crate) const IBV_WC_LOC_ACCESS_ERR: u32 = 8;
pub(crate) const IBV_WC_REM_INV_REQ_ERR: u32 = 9;
pub(crate) const IBV_WC_REM_ACCESS_ERR: u32 = 10;
pub(crate) const IBV_WC_REM_OP_ERR: u32 = 11;
pub(crate) const IBV_WC_RETRY_EXC_ERR: u32 = 12;
pub(crate) const IBV_WC_RNR_RETRY_EXC_ERR: u32 = 13;
pub(crate) const IBV_WC_REM_ABORT_ERR: u32 = 16;
pub(crate) const IBV_WC_FATAL_ERR: u32 = 19;
pub(crate) const IBV_WC_RESP_TIMEOUT_ERR: u32 = 20;
pub(crate) const IBV_WC_GENERAL_ERR: u32 = 21;

pub(crate) const IBV_WC_RDMA_WRITE: u32 = 1;
pub(crate) const IBV_WC_RDMA_READ: u32 = 2;

/// The `element` union of `ibv_async_event`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) union ibv_async_element {
    pub(crate) cq: *mut ibv_cq,
    pub(crate) qp: *mut ibv_qp,
    pub(crate) srq: *mut c_void,
    pub(crate) port_num: c_int,
}

/// `struct ibv_async_event`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ibv_async_event {
    pub(crate) element: ibv_async_element,
    pub(crate) event_type: u32,
}

pub(crate) const IBV_EVENT_CQ_ERR: u32 = 0;
pub(crate) const IBV_EVENT_QP_FATAL: u32 = 1;
pub(crate) const IBV_EVENT_QP_REQ_ERR: u32 = 2;
pub(crate) const IBV_EVENT_QP_ACCESS_ERR: u32 = 3;
pub(crate) const IBV_EVENT_DEVICE_FATAL: u32 = 8;
pub(crate) const IBV_EVENT_PORT_ACTIVE: u32 = 9;
pub(crate) const IBV_EVENT_PORT_ERR: u32 = 10;
pub(crate) const IBV_EVENT_GID_CHANGE: u32 = 18;

macro_rules! zeroed_default {
    ($($t:ty),*) => {$(
        impl Default for $t {
            fn default() -> Self {
                // SAFETY: the struct holds only integers, raw pointers, optional function
                // pointers and unions of those, for all of which all-zero bytes are valid.
                unsafe { std::mem::zeroed() }
            }
        }
    )*};
}

zeroed_default!(
    ibv_gid,
    ibv_gid_entry,
    ibv_device_attr,
    ibv_context_ops,
    ibv_qp_init_attr,
    ibv_global_route,
    ibv_ah_attr,
    ibv_qp_attr,
    ibv_send_wr_wr,
    ibv_send_wr,
    ibv_async_element,
    ibv_async_event
);

// The layout test lives in its own file. The path is spelled out because
// `crates/fakeverbs` includes this file by path, and a nested module of a file
// included that way would otherwise be looked for beside it, not under `verbs/`.
#[cfg(test)]
#[path = "verbs/layout.rs"]
mod layout;
