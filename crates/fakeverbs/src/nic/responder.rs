//! The responder: a node's listener, one thread per incoming connection, and the
//! checks a NIC makes on each request before it copies into or out of a region.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{lock, qp, Device, ACCESS, DROPPED, HELLO, INVALID, OK, OP_READ, OP_WRITE};
use crate::verbs::*;

pub(super) fn listen(dev: &Arc<Device>, listener: &UnixListener) {
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let d = dev.clone();
        let _ = std::thread::Builder::new()
            .name("fakeverbs-responder".into())
            .spawn(move || respond(&d, stream));
    }
}

fn read_u32(s: &mut UnixStream) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

/// The responder side of one connection.
fn respond(dev: &Arc<Device>, mut s: UnixStream) {
    let hello = (|| -> std::io::Result<Hello> {
        let mut magic = [0u8; 4];
        s.read_exact(&mut magic)?;
        if magic != HELLO {
            return Err(std::io::ErrorKind::InvalidData.into());
        }
        let mut node = [0u8; 2];
        s.read_exact(&mut node)?;
        let (qpn, dst_qpn, gid_type) = (read_u32(&mut s)?, read_u32(&mut s)?, read_u32(&mut s)?);
        let mut rd = [0u8; 1];
        s.read_exact(&mut rd)?;
        Ok(Hello {
            node: u16::from_le_bytes(node),
            qpn,
            dst_qpn,
            gid_type,
            rd_atomic: rd[0],
        })
    })();
    let Ok(hello) = hello else {
        return;
    };
    let mut buf = Vec::new();
    loop {
        let mut head = [0u8; 17];
        if s.read_exact(&mut head).is_err() {
            return;
        }
        let op = head[0];
        let addr = u64::from_le_bytes(head[1..9].try_into().expect("8 bytes"));
        let rkey = u32::from_le_bytes(head[9..13].try_into().expect("4 bytes"));
        let len = u32::from_le_bytes(head[13..17].try_into().expect("4 bytes"));
        if len > 1 << 31 || !(op == OP_WRITE || op == OP_READ) {
            return;
        }
        buf.clear();
        if op == OP_WRITE {
            buf.resize(len as usize, 0);
            if s.read_exact(&mut buf).is_err() {
                return;
            }
        }
        let answer = serve(dev, &hello, op, addr, rkey, &mut buf, len);
        let sent = s.write_all(&[answer]).and_then(|()| {
            if answer == OK && op == OP_READ {
                s.write_all(&buf)
            } else {
                Ok(())
            }
        });
        if sent.is_err() {
            return;
        }
    }
}

/// What a requester says when it connects.
struct Hello {
    node: u16,
    qpn: u32,
    dst_qpn: u32,
    gid_type: u32,
    /// The READs it may have outstanding (its `max_rd_atomic`).
    rd_atomic: u8,
}

/// Checks one request as a NIC does and carries it out; returns the answer.
fn serve(
    dev: &Device,
    from: &Hello,
    op: u8,
    addr: u64,
    rkey: u32,
    buf: &mut Vec<u8>,
    len: u32,
) -> u8 {
    let Some(qp) = qp(from.dst_qpn).filter(|q| std::ptr::eq(&*q.dev, dev)) else {
        return DROPPED;
    };
    let (access, max_dest_rd_atomic) = {
        let st = lock(&qp.st);
        // A requester allowed more READs in flight than this responder serves
        // (`max_rd_atomic` above its `max_dest_rd_atomic`) would have the excess
        // dropped; the fake drops every request of such a connection.
        let connected = (st.state == IBV_QPS_RTR || st.state == IBV_QPS_RTS)
            && st.attrs.dest_qpn == from.qpn
            && st.attrs.remote_node == from.node
            && (dev.spec.infiniband || st.attrs.gid_type == from.gid_type)
            && from.rd_atomic <= st.attrs.max_dest_rd_atomic;
        if !connected || !dev.active.load(Ordering::Acquire) {
            return DROPPED;
        }
        (st.attrs.access as i32, st.attrs.max_dest_rd_atomic)
    };
    let need = if op == OP_WRITE {
        IBV_ACCESS_REMOTE_WRITE
    } else {
        IBV_ACCESS_REMOTE_READ
    };
    if op == OP_READ && max_dest_rd_atomic == 0 {
        qp.to_error();
        return INVALID;
    }
    let refuse = || {
        qp.to_error();
        qp.event(IBV_EVENT_QP_ACCESS_ERR);
        ACCESS
    };
    let mr = match dev.mr(rkey) {
        Some(mr)
            if mr.pd == qp.pd
                && mr.covers(addr, u64::from(len))
                && mr.access & need != 0
                && access & need != 0 =>
        {
            mr
        }
        _ => return refuse(),
    };
    let live = mr.live.read().unwrap_or_else(|p| p.into_inner());
    if !*live {
        return refuse();
    }
    if op == OP_WRITE {
        // SAFETY: a live region (held against deregistration) that grants REMOTE_WRITE
        // and covers `addr..addr+len`: its owner allowed the NIC to write these bytes.
        unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), addr as *mut u8, len as usize) };
    } else {
        buf.resize(len as usize, 0);
        // SAFETY: as above, with REMOTE_READ: these bytes may be read.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, buf.as_mut_ptr(), len as usize) };
    }
    OK
}
