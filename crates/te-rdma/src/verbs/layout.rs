//! Compares every declaration of `verbs` with the system's `<infiniband/verbs.h>`: a C
//! program compiled against it prints sizes, alignments, offsets and constants, and
//! each is compared with the Rust value. Without a C compiler or the header
//! (`libibverbs-dev`), the test prints why and checks nothing; with `CI` set in the
//! environment (`scripts/test.sh` installs the header) that is a failure instead.

use super::*;
use std::mem::{align_of, offset_of, size_of};

/// (C expression, Rust value) pairs.
fn facts() -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = Vec::new();
    macro_rules! shape {
        ($t:ident, $c:literal $(, $f:ident)*) => {
            v.push((format!("sizeof({})", $c), size_of::<$t>() as u64));
            v.push((format!("_Alignof({})", $c), align_of::<$t>() as u64));
            $(v.push((
                format!("offsetof({}, {})", $c, stringify!($f)),
                offset_of!($t, $f) as u64,
            ));)*
        };
    }
    macro_rules! constant {
        ($($name:ident),* $(,)?) => {$(
            v.push((stringify!($name).to_string(), $name as u64));
        )*};
    }
    shape!(ibv_gid, "union ibv_gid", raw, global);
    shape!(
        ibv_gid_entry,
        "struct ibv_gid_entry",
        gid,
        gid_index,
        port_num,
        gid_type,
        ndev_ifindex
    );
    shape!(
        ibv_device_attr,
        "struct ibv_device_attr",
        fw_ver,
        node_guid,
        max_mr_size,
        vendor_id,
        max_qp,
        max_qp_wr,
        device_cap_flags,
        max_sge,
        max_cq,
        max_cqe,
        max_mr,
        max_pd,
        max_qp_rd_atom,
        max_qp_init_rd_atom,
        max_pkeys,
        local_ca_ack_delay,
        phys_port_cnt
    );
    v.push((
        "offsetof(struct ibv_device_attr, max_ee_init_rd_atom)".into(),
        offset_of!(ibv_device_attr, _more) as u64,
    ));
    v.push((
        "offsetof(struct ibv_device_attr, max_srq_sge) + sizeof(int)".into(),
        (offset_of!(ibv_device_attr, _more) + size_of::<[c_int; 16]>()) as u64,
    ));
    shape!(
        ibv_port_attr,
        "struct ibv_port_attr",
        state,
        max_mtu,
        active_mtu,
        gid_tbl_len,
        port_cap_flags,
        max_msg_sz,
        pkey_tbl_len,
        lid,
        sm_lid,
        lmc,
        active_width,
        active_speed,
        phys_state,
        link_layer,
        flags,
        port_cap_flags2
    );
    shape!(
        ibv_context_ops,
        "struct ibv_context_ops",
        poll_cq,
        req_notify_cq,
        post_send,
        post_recv
    );
    // The padding arrays start where their first C member does.
    for (member, rust) in [
        (
            "_compat_query_device",
            offset_of!(ibv_context_ops, _before_poll_cq),
        ),
        (
            "_compat_cq_event",
            offset_of!(ibv_context_ops, _before_post_send),
        ),
        (
            "_compat_create_ah",
            offset_of!(ibv_context_ops, _after_post_recv),
        ),
    ] {
        v.push((
            format!("offsetof(struct ibv_context_ops, {member})"),
            rust as u64,
        ));
    }
    shape!(
        ibv_context,
        "struct ibv_context",
        device,
        ops,
        cmd_fd,
        async_fd,
        num_comp_vectors,
        mutex,
        abi_compat
    );
    shape!(ibv_pd, "struct ibv_pd", context, handle);
    shape!(
        ibv_mr,
        "struct ibv_mr",
        context,
        pd,
        addr,
        length,
        handle,
        lkey,
        rkey
    );
    shape!(
        ibv_comp_channel,
        "struct ibv_comp_channel",
        context,
        fd,
        refcnt
    );
    shape!(
        ibv_cq,
        "struct ibv_cq",
        context,
        channel,
        cq_context,
        handle,
        cqe,
        mutex,
        cond,
        comp_events_completed,
        async_events_completed
    );
    shape!(
        ibv_qp,
        "struct ibv_qp",
        context,
        qp_context,
        pd,
        send_cq,
        recv_cq,
        srq,
        handle,
        qp_num,
        state,
        qp_type,
        mutex,
        cond,
        events_completed
    );
    shape!(
        ibv_qp_cap,
        "struct ibv_qp_cap",
        max_send_wr,
        max_recv_wr,
        max_send_sge,
        max_recv_sge,
        max_inline_data
    );
    shape!(
        ibv_qp_init_attr,
        "struct ibv_qp_init_attr",
        qp_context,
        send_cq,
        recv_cq,
        srq,
        cap,
        qp_type,
        sq_sig_all
    );
    shape!(
        ibv_global_route,
        "struct ibv_global_route",
        dgid,
        flow_label,
        sgid_index,
        hop_limit,
        traffic_class
    );
    shape!(
        ibv_ah_attr,
        "struct ibv_ah_attr",
        grh,
        dlid,
        sl,
        src_path_bits,
        static_rate,
        is_global,
        port_num
    );
    shape!(
        ibv_qp_attr,
        "struct ibv_qp_attr",
        qp_state,
        cur_qp_state,
        path_mtu,
        path_mig_state,
        qkey,
        rq_psn,
        sq_psn,
        dest_qp_num,
        qp_access_flags,
        cap,
        ah_attr,
        alt_ah_attr,
        pkey_index,
        alt_pkey_index,
        en_sqd_async_notify,
        sq_draining,
        max_rd_atomic,
        max_dest_rd_atomic,
        min_rnr_timer,
        port_num,
        timeout,
        retry_cnt,
        rnr_retry,
        alt_port_num,
        alt_timeout,
        rate_limit
    );
    shape!(ibv_sge, "struct ibv_sge", addr, length, lkey);
    shape!(
        ibv_send_wr,
        "struct ibv_send_wr",
        wr_id,
        next,
        sg_list,
        num_sge,
        opcode,
        send_flags,
        imm_data,
        wr,
        qp_type
    );
    v.push((
        "offsetof(struct ibv_send_wr, wr.rdma.remote_addr)".into(),
        (offset_of!(ibv_send_wr, wr) + offset_of!(ibv_rdma_info, remote_addr)) as u64,
    ));
    v.push((
        "offsetof(struct ibv_send_wr, wr.rdma.rkey)".into(),
        (offset_of!(ibv_send_wr, wr) + offset_of!(ibv_rdma_info, rkey)) as u64,
    ));
    v.push((
        "sizeof(((struct ibv_send_wr *)0)->wr)".into(),
        size_of::<ibv_send_wr_wr>() as u64,
    ));
    v.push((
        "offsetof(struct ibv_send_wr, bind_mw)".into(),
        offset_of!(ibv_send_wr, _bind_mw_or_tso) as u64,
    ));
    shape!(
        ibv_wc,
        "struct ibv_wc",
        wr_id,
        status,
        opcode,
        vendor_err,
        byte_len,
        imm_data,
        qp_num,
        src_qp,
        wc_flags,
        pkey_index,
        slid,
        sl,
        dlid_path_bits
    );
    shape!(
        ibv_async_event,
        "struct ibv_async_event",
        element,
        event_type
    );
    constant!(
        IBV_GID_TYPE_IB,
        IBV_GID_TYPE_ROCE_V1,
        IBV_GID_TYPE_ROCE_V2,
        IBV_PORT_DOWN,
        IBV_PORT_ACTIVE,
        IBV_LINK_LAYER_INFINIBAND,
        IBV_LINK_LAYER_ETHERNET,
        IBV_MTU_256,
        IBV_MTU_1024,
        IBV_MTU_4096,
        IBV_ACCESS_LOCAL_WRITE,
        IBV_ACCESS_REMOTE_WRITE,
        IBV_ACCESS_REMOTE_READ,
        IBV_ACCESS_REMOTE_ATOMIC,
        IBV_QPT_RC,
        IBV_QPS_RESET,
        IBV_QPS_INIT,
        IBV_QPS_RTR,
        IBV_QPS_RTS,
        IBV_QPS_ERR,
        IBV_QP_STATE,
        IBV_QP_ACCESS_FLAGS,
        IBV_QP_PKEY_INDEX,
        IBV_QP_PORT,
        IBV_QP_AV,
        IBV_QP_PATH_MTU,
        IBV_QP_TIMEOUT,
        IBV_QP_RETRY_CNT,
        IBV_QP_RNR_RETRY,
        IBV_QP_RQ_PSN,
        IBV_QP_MAX_QP_RD_ATOMIC,
        IBV_QP_MIN_RNR_TIMER,
        IBV_QP_SQ_PSN,
        IBV_QP_MAX_DEST_RD_ATOMIC,
        IBV_QP_DEST_QPN,
        IBV_WR_RDMA_WRITE,
        IBV_WR_SEND,
        IBV_WR_RDMA_READ,
        IBV_SEND_SIGNALED,
        IBV_WC_SUCCESS,
        IBV_WC_LOC_LEN_ERR,
        IBV_WC_LOC_QP_OP_ERR,
        IBV_WC_LOC_PROT_ERR,
        IBV_WC_WR_FLUSH_ERR,
        IBV_WC_BAD_RESP_ERR,
        IBV_WC_LOC_ACCESS_ERR,
        IBV_WC_REM_INV_REQ_ERR,
        IBV_WC_REM_ACCESS_ERR,
        IBV_WC_REM_OP_ERR,
        IBV_WC_RETRY_EXC_ERR,
        IBV_WC_RNR_RETRY_EXC_ERR,
        IBV_WC_REM_ABORT_ERR,
        IBV_WC_FATAL_ERR,
        IBV_WC_RESP_TIMEOUT_ERR,
        IBV_WC_GENERAL_ERR,
        IBV_WC_RDMA_WRITE,
        IBV_WC_RDMA_READ,
        IBV_EVENT_CQ_ERR,
        IBV_EVENT_QP_FATAL,
        IBV_EVENT_QP_REQ_ERR,
        IBV_EVENT_QP_ACCESS_ERR,
        IBV_EVENT_DEVICE_FATAL,
        IBV_EVENT_PORT_ACTIVE,
        IBV_EVENT_PORT_ERR,
        IBV_EVENT_GID_CHANGE,
    );
    v
}

/// Why the check cannot run here, if it cannot.
fn skip(why: String) {
    assert!(
        std::env::var_os("CI").is_none(),
        "the verbs layout check must run in CI: {why}"
    );
    println!("verbs layout check skipped: {why}");
}

#[test]
fn declarations_match_the_system_verbs_header() {
    let header = std::path::Path::new("/usr/include/infiniband/verbs.h");
    if !header.exists() {
        return skip(format!(
            "{} is missing (install libibverbs-dev)",
            header.display()
        ));
    }
    let facts = facts();
    let mut c = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include <infiniband/verbs.h>\nint main(void) {\n",
    );
    for (expr, _) in &facts {
        c.push_str(&format!(
            "  printf(\"%llu\\n\", (unsigned long long)({expr}));\n"
        ));
    }
    c.push_str("  return 0;\n}\n");
    let dir = std::env::temp_dir().join(format!("te-verbs-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let (src, exe) = (dir.join("layout.c"), dir.join("layout"));
    std::fs::write(&src, c).expect("write the C program");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = std::process::Command::new(&cc)
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .output();
    let built = match built {
        Ok(b) => b,
        Err(e) => return skip(format!("no C compiler ({cc}: {e})")),
    };
    assert!(
        built.status.success(),
        "the layout program did not compile: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    let out = std::process::Command::new(&exe)
        .output()
        .expect("run the layout program");
    let _ = std::fs::remove_dir_all(&dir);
    let values: Vec<u64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim().parse().expect("a number"))
        .collect();
    assert_eq!(values.len(), facts.len(), "one value per fact");
    let wrong: Vec<String> = facts
        .iter()
        .zip(&values)
        .filter(|((_, rust), c)| rust != *c)
        .map(|((expr, rust), c)| format!("{expr}: header {c}, te {rust}"))
        .collect();
    assert!(
        wrong.is_empty(),
        "te's verbs declarations differ from verbs.h:\n{}",
        wrong.join("\n")
    );
    println!("{} sizes, offsets and constants match verbs.h", facts.len());
}
