//! The RDMA backend's registrations: a region gets an MR on every device (for CUDA
//! memory through DMA-BUF, else nvidia-peermem), and the NICs that should move it.
//!
//! A slice pins its local region in the kit's table (`te_core::kit::Regions`).
//! `deregister` retires the region there (new batches are refused), waits for the pins
//! until the caller's deadline, and only then destroys the MRs, so that `Ok` means the
//! NICs refuse every key of the region.

#[cfg(feature = "cuda")]
use std::os::fd::AsRawFd;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use te_core::sync::Mutex;

use te_core::{Deadline, Error, ErrorKind, MemoryDesc, MemoryKind, RegionId, Result};

use crate::backend::RdmaBackend;
use crate::context::Mr;
use crate::device::Device;
use crate::endpoint;
use crate::topology;

/// What the backend keeps for a registered local region (the kit's table holds its
/// address, length and pins): one MR per device.
pub(crate) struct LocalRegion {
    /// Each MR's local key, by device: what slices post with. Kept apart from the MRs
    /// so that reading one never touches an MR that `deregister` destroyed.
    pub(crate) lkeys: Vec<u32>,
    /// The MRs, destroyed by [`LocalRegion::release`] (or when the region is dropped).
    mrs: Mutex<Vec<Mr>>,
    /// The local devices that should move this region's bytes (nearest to its memory);
    /// empty: any.
    pub(crate) nics: Vec<usize>,
    /// The DMA-BUF the MRs were made from; closed after them (field order).
    _dmabuf: Option<OwnedFd>,
}

impl std::fmt::Debug for LocalRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalRegion")
            .field("lkeys", &self.lkeys)
            .field("nics", &self.nics)
            .finish_non_exhaustive()
    }
}

impl LocalRegion {
    /// A region's MRs (one per device), and the devices that should move it.
    pub(crate) fn new(mrs: Vec<Mr>, nics: Vec<usize>, dmabuf: Option<OwnedFd>) -> LocalRegion {
        LocalRegion {
            lkeys: mrs.iter().map(Mr::lkey).collect(),
            mrs: Mutex::new(mrs),
            nics,
            _dmabuf: dmabuf,
        }
    }

    /// Destroys the MRs: from here on the NICs refuse every key of the region, local
    /// and remote, so nothing of this backend or its peers reaches the memory. Called
    /// only when no slice pins the region and none can any more (it was retired).
    pub(crate) fn release(&self) {
        self.mrs.lock().clear();
    }

    /// The remote key of each MR, by device.
    pub(crate) fn rkeys(&self) -> Vec<u32> {
        self.mrs.lock().iter().map(Mr::rkey).collect()
    }
}

/// The backend's registered regions, in the kit's table.
pub(crate) type Regions = te_core::kit::Regions<LocalRegion>;

/// Keeps a region registered while a slice uses it (each slice has its own).
pub(crate) type Pin = te_core::kit::Pin<LocalRegion>;

/// A peer's region: address and one rkey per peer device.
#[derive(Debug)]
pub(crate) struct RemoteRegion {
    pub(crate) addr: u64,
    pub(crate) rkeys: Vec<u32>,
}

impl RdmaBackend {
    /// `TransferBackend::register`: MRs for the region on every device, and its key
    /// (one rkey per device), empty for a region peers may not touch.
    pub(crate) fn register_region(&self, id: RegionId, mem: &MemoryDesc) -> Result<Vec<u8>> {
        let devices = &self.shared.devices;
        let (mrs, dmabuf) = match &mem.kind {
            MemoryKind::Host => (
                devices
                    .iter()
                    .map(|d| d.ctx.reg_mr(mem.addr, mem.len, mem.access))
                    .collect::<Result<Vec<_>>>()?,
                None,
            ),
            MemoryKind::Device { runtime, ordinal } if runtime == "cuda" => {
                register_cuda(devices, *ordinal, mem)?
            }
            other => {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!(
                        "the rdma backend registers {} memory, not {other}",
                        self.info.capabilities.memory.join(" and ")
                    ),
                ))
            }
        };
        // A region peers may not touch publishes no key: its MRs carry no remote
        // right anyway, and its rkeys are nobody's business.
        let remote = mem.access.remote_read || mem.access.remote_write;
        let region = LocalRegion::new(mrs, self.nics_for(&mem.kind), dmabuf);
        let key = if remote {
            endpoint::encode_key(&region.rkeys())
        } else {
            Vec::new()
        };
        self.shared
            .regions
            .insert(id, mem.addr, mem.len, mem.access, region);
        Ok(key)
    }

    /// `TransferBackend::deregister`: out of the table, then the MRs destroyed once no
    /// slice pins the region, or `Timeout` at `deadline` with the region kept refused.
    pub(crate) fn deregister_region(&self, id: RegionId, deadline: Deadline) -> Result<()> {
        // A region whose wait timed out before stays in the table, refused, and is
        // waited for again.
        if let Some(region) = self.shared.regions.retire(id, deadline.instant())? {
            region.data.release();
        }
        Ok(())
    }

    /// The local devices that should move memory of `kind`: the configured ones, else
    /// the nearest to its device on the PCIe tree; empty for any.
    fn nics_for(&self, kind: &MemoryKind) -> Vec<usize> {
        let names = self.shared.config.nic_affinity.get(&kind.to_string());
        if let Some(names) = names {
            return self
                .shared
                .devices
                .iter()
                .filter(|d| names.contains(&d.name))
                .map(|d| d.index)
                .collect();
        }
        let place = match kind {
            // The runtime names a CUDA device by its PCI address.
            MemoryKind::Device { runtime, ordinal } if runtime == "cuda" => {
                let rt = te_core::device::runtime(runtime).ok();
                match rt.and_then(|rt| rt.device_id(*ordinal)) {
                    Some(bus) => topology::pci_place(std::path::Path::new("/sys"), &bus),
                    None => return Vec::new(),
                }
            }
            _ => return Vec::new(),
        };
        let near = topology::nearest(&self.shared.nic_places, &place);
        if near.len() == self.shared.devices.len() {
            Vec::new()
        } else {
            near
        }
    }
}

#[cfg(feature = "cuda")]
fn register_cuda(
    devices: &[Arc<Device>],
    ordinal: u32,
    mem: &MemoryDesc,
) -> Result<(Vec<Mr>, Option<OwnedFd>)> {
    let (addr, len, access) = (mem.addr, mem.len, mem.access);
    crate::cuda::check_pointer(ordinal, addr, len)?;
    let dmabuf = crate::cuda::export_dmabuf(ordinal, addr, len).and_then(|buf| {
        let mrs = devices
            .iter()
            .map(|d| {
                d.ctx
                    .reg_dmabuf_mr(buf.fd.as_raw_fd(), buf.offset, len, addr, access)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((mrs, Some(buf.fd)))
    });
    match dmabuf {
        Ok(x) => Ok(x),
        Err(dmabuf_error) => {
            let peermem = devices
                .iter()
                .map(|d| d.ctx.reg_mr(addr, len, access))
                .collect::<Result<Vec<_>>>();
            match peermem {
                Ok(mrs) => {
                    tracing::info!(reason = %dmabuf_error, "DMA-BUF registration unavailable; cuda memory registered through nvidia-peermem");
                    Ok((mrs, None))
                }
                Err(e) => Err(Error::new(
                    ErrorKind::Unsupported,
                    format!(
                        "cuda:{ordinal} memory cannot be registered with the NIC: DMA-BUF: {dmabuf_error}; ibv_reg_mr (nvidia-peermem): {e}"
                    ),
                )),
            }
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn register_cuda(
    _: &[Arc<Device>],
    ordinal: u32,
    _: &MemoryDesc,
) -> Result<(Vec<Mr>, Option<OwnedFd>)> {
    Err(Error::new(
        ErrorKind::Unsupported,
        format!("cuda:{ordinal} memory: te-rdma was built without its `cuda` feature"),
    ))
}
