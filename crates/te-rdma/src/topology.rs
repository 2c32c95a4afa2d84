//! Which NICs move a device's memory: the ones nearest to the device on the PCIe tree,
//! as sysfs shows it. GPUDirect RDMA between a GPU and a NIC under different root
//! complexes (or NUMA nodes) is slow or refused, so striping a GPU's slices over every
//! NIC would put most of them on bad paths.
//!
//! A PCI device's place is its canonical sysfs path
//! (`/sys/devices/pci0000:00/0000:00:01.0/0000:03:00.0`): each component below the
//! root is a bridge or switch port. The distance between two devices is the number of
//! components below their deepest common ancestor on both sides; devices under
//! different root complexes are further apart than any two under one, and devices on
//! different NUMA nodes further still. The nearest NICs are those at the smallest
//! distance; when a place is unknown (no sysfs entry, a fake device) every NIC is.

use std::path::{Component, Path, PathBuf};

/// Where a PCI device sits.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Place {
    /// Its canonical sysfs device path.
    pub(crate) pci: Option<PathBuf>,
    /// Its NUMA node, where the platform reports one.
    pub(crate) numa: Option<i32>,
}

fn place(device_link: &Path) -> Place {
    let numa = std::fs::read_to_string(device_link.join("numa_node"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .filter(|n: &i32| *n >= 0);
    Place {
        pci: std::fs::canonicalize(device_link).ok(),
        numa,
    }
}

/// The place of RDMA device `nic` under the sysfs root `sys` (`/sys`).
pub(crate) fn nic_place(sys: &Path, nic: &str) -> Place {
    place(&sys.join("class/infiniband").join(nic).join("device"))
}

/// The place of the PCI device `bus_id` (`0000:3b:00.0`) under the sysfs root `sys`.
pub(crate) fn pci_place(sys: &Path, bus_id: &str) -> Place {
    place(
        &sys.join("bus/pci/devices")
            .join(bus_id.to_ascii_lowercase()),
    )
}

/// How far apart two places are; `None` if either is unknown.
pub(crate) fn distance(a: &Place, b: &Place) -> Option<u32> {
    let (pa, pb) = (a.pci.as_ref()?, b.pci.as_ref()?);
    let ca: Vec<Component<'_>> = pa.components().collect();
    let cb: Vec<Component<'_>> = pb.components().collect();
    let common = ca.iter().zip(&cb).take_while(|(x, y)| x == y).count();
    let mut d = (ca.len() - common + cb.len() - common) as u32;
    let same_root = ca[..common]
        .iter()
        .any(|c| c.as_os_str().to_string_lossy().starts_with("pci"));
    if !same_root {
        d += 100;
    }
    if matches!((a.numa, b.numa), (Some(x), Some(y)) if x != y) {
        d += 1000;
    }
    Some(d)
}

/// The indices of the NICs nearest to `target`; every NIC when no distance is known.
pub(crate) fn nearest(nics: &[Place], target: &Place) -> Vec<usize> {
    let d: Vec<Option<u32>> = nics.iter().map(|n| distance(n, target)).collect();
    match d.iter().flatten().min() {
        Some(best) => (0..nics.len()).filter(|&i| d[i] == Some(*best)).collect(),
        None => (0..nics.len()).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// A sysfs tree: two root complexes on two NUMA nodes; root 0 has a switch with a
    /// GPU and NIC 0 below it and NIC 1 on another port; root 1 has NIC 2.
    fn tree() -> (PathBuf, PathBuf) {
        let root = std::env::temp_dir().join(format!("te-topology-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dev = |p: &str, numa: i32| {
            let d = root.join("devices").join(p);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("numa_node"), format!("{numa}\n")).unwrap();
            d
        };
        let gpu = dev("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0", 0);
        let nic0 = dev("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0", 0);
        let nic1 = dev("pci0000:00/0000:00:02.0/0000:05:00.0", 0);
        let nic2 = dev("pci0000:80/0000:80:01.0/0000:81:00.0", 1);
        for (name, d) in [("mlx5_0", &nic0), ("mlx5_1", &nic1), ("mlx5_2", &nic2)] {
            let c = root.join("class/infiniband").join(name);
            std::fs::create_dir_all(&c).unwrap();
            symlink(d, c.join("device")).unwrap();
        }
        let bus = root.join("bus/pci/devices");
        std::fs::create_dir_all(&bus).unwrap();
        symlink(&gpu, bus.join("0000:02:00.0")).unwrap();
        (root, gpu)
    }

    #[test]
    fn the_nic_under_the_gpus_switch_is_nearest_and_another_root_is_furthest() {
        let (sys, _) = tree();
        let nics: Vec<Place> = ["mlx5_0", "mlx5_1", "mlx5_2"]
            .iter()
            .map(|n| nic_place(&sys, n))
            .collect();
        let gpu = pci_place(&sys, "0000:02:00.0");
        assert_eq!(gpu.numa, Some(0));
        let d: Vec<u32> = nics.iter().map(|n| distance(n, &gpu).unwrap()).collect();
        assert!(d[0] < d[1] && d[1] < d[2], "{d:?}");
        assert!(
            d[2] > 1000,
            "another root complex on another NUMA node: {d:?}"
        );
        assert_eq!(nearest(&nics, &gpu), [0]);
        let _ = std::fs::remove_dir_all(sys);
    }

    #[test]
    fn unknown_places_use_every_nic() {
        let nics = vec![Place::default(), Place::default()];
        assert_eq!(nearest(&nics, &Place::default()), [0, 1]);
        let sys = Path::new("/nonexistent-sysfs");
        assert_eq!(nic_place(sys, "fake0"), Place::default());
        assert_eq!(distance(&nic_place(sys, "fake0"), &Place::default()), None);
    }
}
