//! The requester: one thread per QP runs its send queue in order, checks the local
//! entries, copies the bytes and carries each work request to the peer node.

use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::queue_pair::Attrs;
use super::{
    lock, node_name, Fault, Qp, Wr, ACCESS, HELLO, INVALID, MAX_TRANSPORT_WAIT, OK, OP_READ,
    OP_WRITE,
};
use crate::verbs::*;

/// The requester's connection to its peer QP.
struct Link {
    generation: u64,
    stream: UnixStream,
}

/// A QP's requester thread: runs its send queue in order until the QP is destroyed.
pub(super) fn requester(qp: &Arc<Qp>) {
    let mut link: Option<Link> = None;
    let mut buf = Vec::new();
    loop {
        let (wr, state, attrs, generation) = {
            let mut st = lock(&qp.st);
            loop {
                if st.shutdown {
                    return;
                }
                if !st.sq.is_empty() {
                    break;
                }
                st = qp.cv.wait(st).unwrap_or_else(|p| p.into_inner());
            }
            let wr = st.sq.pop_front().expect("not empty");
            (wr, st.state, st.attrs, st.generation)
        };
        let (status, len) = if state == IBV_QPS_RTS {
            run(qp, &wr, &attrs, generation, &mut link, &mut buf)
        } else {
            (IBV_WC_WR_FLUSH_ERR, 0)
        };
        qp.finish(&wr, status, len);
    }
}

/// Runs one work request; returns its status and byte count.
fn run(
    qp: &Qp,
    wr: &Wr,
    attrs: &Attrs,
    generation: u64,
    link: &mut Option<Link>,
    buf: &mut Vec<u8>,
) -> (u32, u32) {
    let fault = qp.take_fault();
    let mut delay = qp.dev.spec.delay;
    if let Some(Fault::Delay(d)) = fault {
        delay += d;
    }
    if !delay.is_zero() && !qp.pause(delay) {
        return (IBV_WC_WR_FLUSH_ERR, 0);
    }
    if let Some(Fault::Status(s)) = fault {
        if s == IBV_WC_RETRY_EXC_ERR && !qp.pause(attrs.retry_time()) {
            return (IBV_WC_WR_FLUSH_ERR, 0);
        }
        return (s, 0);
    }
    let total: u64 = wr.sges.iter().map(|s| u64::from(s.length)).sum();
    if total > 1 << 31 {
        return (IBV_WC_LOC_LEN_ERR, 0);
    }
    // The local entries: each in a live region of this QP's PD, on this device; a READ
    // writes them, so they need LOCAL_WRITE.
    let mut local = Vec::with_capacity(wr.sges.len());
    for s in &wr.sges {
        match qp.dev.mr(s.lkey) {
            Some(mr)
                if mr.pd == qp.pd
                    && mr.covers(s.addr, u64::from(s.length))
                    && (wr.write || mr.access & IBV_ACCESS_LOCAL_WRITE != 0) =>
            {
                local.push((mr, *s))
            }
            _ => return (IBV_WC_LOC_PROT_ERR, 0),
        }
    }
    buf.clear();
    if wr.write {
        for (mr, s) in &local {
            let live = mr.live.read().unwrap_or_else(|p| p.into_inner());
            if !*live {
                return (IBV_WC_LOC_PROT_ERR, 0);
            }
            let at = buf.len();
            buf.resize(at + s.length as usize, 0);
            // SAFETY: the region is registered and live (its read lock is held, so it
            // cannot be deregistered during the copy) and covers the entry, so the
            // caller promised these bytes are readable.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    s.addr as *const u8,
                    buf[at..].as_mut_ptr(),
                    s.length as usize,
                )
            };
        }
    }
    if !qp.dev.active.load(Ordering::Acquire) {
        return transport_failure(qp, attrs, link);
    }
    if link.as_ref().is_none_or(|l| l.generation != generation) {
        *link = connect(qp, attrs).map(|stream| Link { generation, stream });
    }
    let Some(l) = link.as_mut() else {
        return transport_failure(qp, attrs, link);
    };
    let answer = exchange(&mut l.stream, wr, total as u32, buf);
    match answer {
        Ok(OK) if wr.write => (IBV_WC_SUCCESS, total as u32),
        Ok(OK) => {
            let mut at = 0;
            for (mr, s) in &local {
                let live = mr.live.read().unwrap_or_else(|p| p.into_inner());
                if !*live {
                    return (IBV_WC_LOC_PROT_ERR, 0);
                }
                // SAFETY: as above: a live region covering the entry, with LOCAL_WRITE,
                // held against deregistration during the copy.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        buf[at..].as_ptr(),
                        s.addr as *mut u8,
                        s.length as usize,
                    )
                };
                at += s.length as usize;
            }
            (IBV_WC_SUCCESS, total as u32)
        }
        Ok(ACCESS) => (IBV_WC_REM_ACCESS_ERR, 0),
        Ok(INVALID) => (IBV_WC_REM_INV_REQ_ERR, 0),
        Ok(_) => transport_failure(qp, attrs, link),
        Err(_) => {
            *link = None;
            transport_failure(qp, attrs, link)
        }
    }
}

/// No answer: the transport retries run out.
fn transport_failure(qp: &Qp, attrs: &Attrs, link: &mut Option<Link>) -> (u32, u32) {
    *link = None;
    if !qp.pause(attrs.retry_time()) {
        return (IBV_WC_WR_FLUSH_ERR, 0);
    }
    (IBV_WC_RETRY_EXC_ERR, 0)
}

fn connect(qp: &Qp, attrs: &Attrs) -> Option<UnixStream> {
    let addr = SocketAddr::from_abstract_name(node_name(attrs.remote_node)).ok()?;
    let mut s = UnixStream::connect_addr(&addr).ok()?;
    s.set_read_timeout(Some(MAX_TRANSPORT_WAIT)).ok()?;
    let mut hello = HELLO.to_vec();
    hello.extend_from_slice(&qp.dev.node.to_le_bytes());
    hello.extend_from_slice(&qp.qpn.to_le_bytes());
    hello.extend_from_slice(&attrs.dest_qpn.to_le_bytes());
    hello.extend_from_slice(&attrs.gid_type.to_le_bytes());
    hello.push(attrs.max_rd_atomic);
    s.write_all(&hello).ok()?;
    Some(s)
}

/// Sends one request and reads the answer (a READ's bytes land in `buf`).
fn exchange(s: &mut UnixStream, wr: &Wr, len: u32, buf: &mut Vec<u8>) -> std::io::Result<u8> {
    let mut head = Vec::with_capacity(17);
    head.push(if wr.write { OP_WRITE } else { OP_READ });
    head.extend_from_slice(&wr.remote_addr.to_le_bytes());
    head.extend_from_slice(&wr.rkey.to_le_bytes());
    head.extend_from_slice(&len.to_le_bytes());
    s.write_all(&head)?;
    if wr.write {
        s.write_all(buf)?;
    }
    let mut answer = [0u8; 1];
    s.read_exact(&mut answer)?;
    if answer[0] == OK && !wr.write {
        buf.resize(len as usize, 0);
        s.read_exact(buf)?;
    }
    Ok(answer[0])
}
