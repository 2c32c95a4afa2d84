//! Opened RDMA devices and their two threads: the completion thread, which waits on the
//! device's completion channel and settles what completed, and the event thread,
//! which takes the device's async events (port down and up, QP and device fatal
//! errors) and marks the paths they hit as failed.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use te_core::sync::RwLock;

use te_core::{Error, ErrorKind, Result};

use crate::config::RdmaConfig;
use crate::context::Context;
use crate::endpoint::{self, LinkLayer, ROCE_V1, ROCE_V2};
use crate::errors::config_error;
use crate::exchange::{GidType, PathInfo};
use crate::ffi::{self, Verbs};
use crate::path::{self, Path};
use crate::qp::{self, QpParams};
use crate::state::Shared;
use crate::verbs;

/// One opened device and what a QP on it needs.
pub(crate) struct Device {
    pub(crate) ctx: Context,
    pub(crate) index: usize,
    pub(crate) name: String,
    pub(crate) link_layer: LinkLayer,
    pub(crate) lid: u16,
    /// The GID (index, bytes) of each type the port offers: InfiniBand, RoCE v1, v2.
    pub(crate) gids: Vec<(GidType, u8, [u8; 16])>,
    pub(crate) params: QpParams,
    /// False between `IBV_EVENT_PORT_ERR` and `IBV_EVENT_PORT_ACTIVE`.
    pub(crate) port_up: AtomicBool,
    /// The paths whose CQs report to this device's channel, by CQ tag.
    pub(crate) paths: RwLock<HashMap<u64, Arc<Path>>>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("name", &self.name).finish()
    }
}

impl Device {
    /// The RoCE GID types offered, as endpoint bits.
    pub(crate) fn roce(&self) -> u8 {
        self.gids.iter().fold(0, |b, (t, _, _)| match t {
            GidType::RoceV1 => b | ROCE_V1,
            GidType::RoceV2 => b | ROCE_V2,
            GidType::InfiniBand => b,
        })
    }

    /// Our GID of type `kind`: (index, bytes).
    pub(crate) fn gid(&self, kind: GidType) -> Option<(u8, [u8; 16])> {
        self.gids
            .iter()
            .find(|(t, _, _)| *t == kind)
            .map(|(_, i, g)| (*i, *g))
    }

    /// Our half of a path of type `kind` to peer device `remote_device`.
    pub(crate) fn path_info(
        &self,
        remote_device: usize,
        qpn: u32,
        psn: u32,
        kind: GidType,
    ) -> PathInfo {
        PathInfo {
            local_device: self.index as u8,
            remote_device: remote_device as u8,
            qpn,
            psn,
            lid: self.lid,
            gid: self.gid(kind).map_or([0; 16], |(_, g)| g),
            mtu: self.params.mtu,
            link_layer: self.link_layer,
            port: self.params.port,
            gid_type: kind,
            rd_atomic: self.params.max_dest_rd_atomic,
        }
    }

    /// Every path on this device, for events that hit them all.
    fn all_paths(&self) -> Vec<Arc<Path>> {
        self.paths.read().values().cloned().collect()
    }
}

/// The GIDs of each type a port offers: the configured index only, if there is one.
fn port_gids(
    ctx: &Context,
    name: &str,
    config: &RdmaConfig,
    len: i32,
) -> Vec<(GidType, u8, [u8; 16])> {
    let table: Vec<(u8, [u8; 16], Option<GidType>)> = (0..len.clamp(0, 256) as u16)
        .filter_map(|i| {
            let (g, t) = ctx.gid_entry(name, config.port, i as u8)?;
            Some((i as u8, g, t))
        })
        .collect();
    [GidType::RoceV2, GidType::RoceV1]
        .into_iter()
        .filter_map(|kind| {
            let i = qp::pick_gid(config.gid_index, &table, kind)?;
            let g = table.iter().find(|(j, _, _)| *j == i)?.1;
            Some((kind, i, g))
        })
        .collect()
}

/// Opens the configured devices (every one with an active port by default).
///
/// # Errors
/// `Unavailable` without devices or active ports; `ConfigInvalid` for a named device
/// that is not here or an option the device cannot honour.
pub(crate) fn open_devices(v: &'static Verbs, config: &RdmaConfig) -> Result<Vec<Arc<Device>>> {
    let present = ffi::device_names(v)?;
    let explicit = !config.devices.is_empty();
    let wanted = if explicit {
        for d in &config.devices {
            if !present.contains(d) {
                return Err(config_error(format!(
                    "devices names {d:?}, which is not here; present: {}",
                    present.join(", ")
                )));
            }
        }
        config.devices.clone()
    } else {
        present
    };
    let mut devices = Vec::new();
    let mut skipped = Vec::new();
    for name in wanted {
        let ctx = Context::open(v, &name)?;
        let port = ctx.port(config.port)?;
        if port.state != verbs::IBV_PORT_ACTIVE {
            let why = format!(
                "{name} port {} is not active (state {})",
                config.port, port.state
            );
            if explicit {
                return Err(Error::new(ErrorKind::Unavailable, why));
            }
            skipped.push(why);
            continue;
        }
        let (link_layer, gids) = if port.link_layer == verbs::IBV_LINK_LAYER_ETHERNET {
            let gids = port_gids(&ctx, &name, config, port.gid_tbl_len);
            if gids.is_empty() {
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    format!(
                        "{name} port {} has no usable RoCE GID{} (is an IP address configured on its interface?)",
                        config.port,
                        config.gid_index.map_or(String::new(), |i| format!(" at gid_index {i}"))
                    ),
                ));
            }
            (LinkLayer::Ethernet, gids)
        } else {
            let i = config.gid_index.unwrap_or(0);
            let g = ctx.gid(config.port, i).unwrap_or([0; 16]);
            (LinkLayer::InfiniBand, vec![(GidType::InfiniBand, i, g)])
        };
        let mtu = qp::mtu_enum(config.mtu)
            .unwrap_or(5)
            .min(port.active_mtu.clamp(1, 5) as u8);
        let params = QpParams {
            port: config.port,
            mtu,
            timeout: config.timeout,
            retry_count: config.retry_count,
            rnr_retry: config.rnr_retry,
            service_level: config.service_level,
            traffic_class: config.traffic_class,
            max_rd_atomic: ctx.attr.max_qp_init_rd_atom.clamp(1, 16) as u8,
            max_dest_rd_atomic: ctx.attr.max_qp_rd_atom.clamp(1, 16) as u8,
        };
        if (ctx.attr.max_qp_wr as i64) < i64::from(config.max_outstanding) {
            return Err(config_error(format!(
                "max_outstanding = {} exceeds {name}'s max_qp_wr ({})",
                config.max_outstanding, ctx.attr.max_qp_wr
            )));
        }
        devices.push(Arc::new(Device {
            index: devices.len(),
            ctx,
            name,
            link_layer,
            lid: port.lid,
            gids,
            params,
            port_up: AtomicBool::new(true),
            paths: RwLock::new(HashMap::new()),
        }));
    }
    if devices.is_empty() {
        return Err(Error::new(
            ErrorKind::Unavailable,
            format!(
                "no RDMA devices with an active port: {}",
                skipped.join("; ")
            ),
        ));
    }
    devices.truncate(endpoint::MAX_DEVICES);
    Ok(devices)
}

/// Waits until `fd` or the stop pipe is readable; false when it is time to stop.
fn wait_readable(fd: i32, stop: &OwnedFd, what: &str, device: &str) -> bool {
    loop {
        let mut fds = [
            libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: stop.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if rc < 0 {
            if ffi::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            tracing::error!(device, error = %ffi::last_os_error(), "poll on the {what} failed");
            return false;
        }
        return fds[1].revents == 0;
    }
}

/// One device's completion thread: waits in poll(2) on the completion channel (and the
/// stop pipe), takes each event, acknowledges it, re-arms the CQ, then drains it. It
/// never polls a CQ without an event, so nothing spins.
pub(crate) fn completion_loop(dev: &Arc<Device>, stop: &OwnedFd) {
    let v = dev.ctx.v;
    let mut wc = vec![verbs::ibv_wc::default(); 32];
    while wait_readable(dev.ctx.channel_fd(), stop, "completion channel", &dev.name) {
        loop {
            let mut cq = std::ptr::null_mut();
            let mut tag = std::ptr::null_mut();
            // SAFETY: the channel is live and non-blocking; valid out-parameters.
            if unsafe { (v.ibv_get_cq_event)(dev.ctx.channel, &mut cq, &mut tag) } != 0 {
                break; // EAGAIN: no more events.
            }
            // SAFETY: `cq` is the CQ the event is for; acknowledged once.
            unsafe { (v.ibv_ack_cq_events)(cq, 1) };
            let path = dev.paths.read().get(&(tag as usize as u64)).cloned();
            let Some(path) = path else { continue };
            // Re-arm before draining, so a completion that lands after the drain
            // raises a new event.
            path.cq.arm();
            path::drain(&path, &mut wc);
        }
    }
}

/// One device's event thread: takes its async events until stopped. A QP error fails
/// that path (its work moves to other paths; the peer is rebuilt in the background);
/// a port going down fails every path on the device and keeps new paths off it until
/// it is back.
pub(crate) fn event_loop(dev: &Arc<Device>, shared: &Weak<Shared>, stop: &OwnedFd) {
    let v = dev.ctx.v;
    while wait_readable(dev.ctx.async_fd(), stop, "async event fd", &dev.name) {
        loop {
            let mut e = verbs::ibv_async_event::default();
            // SAFETY: a live context whose async fd is non-blocking; a valid out-parameter.
            if unsafe { (v.ibv_get_async_event)(dev.ctx.ctx, &mut e) } != 0 {
                break;
            }
            let hit = match e.event_type {
                verbs::IBV_EVENT_QP_FATAL
                | verbs::IBV_EVENT_QP_REQ_ERR
                | verbs::IBV_EVENT_QP_ACCESS_ERR => {
                    // SAFETY: a QP event's element is the QP, live until the event is
                    // acknowledged below; `qp_context` is the tag te set at creation.
                    let (tag, qpn) = unsafe {
                        (
                            (*e.element.qp).qp_context as usize as u64,
                            (*e.element.qp).qp_num,
                        )
                    };
                    let path = dev.paths.read().get(&tag).cloned();
                    if path.is_none() {
                        // A target-side QP: a peer's request broke it (a bad key or
                        // range); that peer's side sees the error in its completion.
                        tracing::warn!(device = %dev.name, qpn, event = e.event_type, "an RDMA peer's request moved a target QP to the error state");
                    }
                    path.into_iter().collect()
                }
                verbs::IBV_EVENT_PORT_ERR | verbs::IBV_EVENT_DEVICE_FATAL => {
                    dev.port_up.store(false, Ordering::Release);
                    tracing::error!(device = %dev.name, event = e.event_type, "RDMA port down: its paths fail over to other NICs");
                    dev.all_paths()
                }
                verbs::IBV_EVENT_PORT_ACTIVE => {
                    dev.port_up.store(true, Ordering::Release);
                    tracing::info!(device = %dev.name, "RDMA port active again");
                    Vec::new()
                }
                other => {
                    tracing::debug!(device = %dev.name, event = other, "RDMA async event");
                    Vec::new()
                }
            };
            let why = format!("async event {} on {}", e.event_type, dev.name);
            for p in hit {
                p.fail(&why);
            }
            // SAFETY: the event came from ibv_get_async_event and is acknowledged once.
            unsafe { (v.ibv_ack_async_event)(&mut e) };
            if e.event_type == verbs::IBV_EVENT_PORT_ACTIVE {
                if let Some(s) = shared.upgrade() {
                    s.repair_degraded();
                }
            }
        }
    }
}
