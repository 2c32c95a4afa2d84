//! The `[backends.rdma]` table. Every knob is described in the crate docs and in
//! `docs/rdma.md`.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;
use te_core::{Error, ErrorKind, Result};

/// The RDMA backend's options.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct RdmaConfig {
    /// The RDMA devices to use (`mlx5_0`, …); empty uses every device with an active port.
    pub devices: Vec<String>,
    /// The port of each device (ports are numbered from 1).
    pub port: u8,
    /// The one GID index to use (its type, RoCE v1 or v2, is then the only one
    /// offered); `None` picks, per GID type, the port's first non-zero GID, IPv4-mapped
    /// ones first.
    pub gid_index: Option<u8>,
    /// Deprecated and ignored (a warning says so): the connect exchange runs on the
    /// engine's control plane (`[engine] listen`). Accepted so that old files still load.
    pub listen: Option<String>,
    /// Deprecated and ignored, like `listen` (`[engine] advertise` is what peers use).
    pub advertise: Option<String>,
    /// Requests longer than this are cut into slices, striped across NICs and QPs.
    #[serde(deserialize_with = "te_core::config::de::size")]
    pub slice_size: u64,
    /// Reliable-connection QPs per (local NIC, peer NIC) path.
    pub qps_per_path: usize,
    /// Work requests one QP may have outstanding; more wait in the QP's queue.
    pub max_outstanding: u32,
    /// One work request in this many is signalled (the last one of every post always is).
    pub signal_every: u32,
    /// The NICs that move each device's memory, by memory kind (`"cuda:0" = ["mlx5_0"]`).
    /// Kinds not named here use the NICs nearest to the device on the PCIe tree (read
    /// from sysfs); host memory, and memory whose device cannot be placed, uses every NIC.
    pub nic_affinity: BTreeMap<String, Vec<String>>,
    /// The most QPs this backend holds, as the target, for all its initiators together.
    /// Beyond it the oldest set goes, those of initiators that have since come back with
    /// another epoch (restarted) first; an initiator still using an evicted set sees
    /// its paths fail and rebuilds them. Bounds what initiators that vanish without
    /// releasing their sets can hold.
    pub max_served_qps: usize,
    /// Limit for the connect exchange with one peer (at most 1 h); also what closing a QP set waits
    /// where no caller gives a deadline (a set a repair replaced, the backend closing):
    /// this long at most for its QPs' flushes, and again for telling its target. So a
    /// backend closing while its peers hang takes at most five times this (a rebuild
    /// under way and its own sets).
    #[serde(deserialize_with = "te_core::config::de::duration")]
    pub connect_timeout: Duration,
    /// Path MTU cap in bytes (256, 512, 1024, 2048, 4096); the port's active MTU and the
    /// peer's are used when smaller.
    pub mtu: u32,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout (14 ≈ 67 ms).
    pub timeout: u8,
    /// Transport retries before a work request fails with `RETRY_EXC_ERR` (0–7).
    pub retry_count: u8,
    /// RNR retries (7 = infinite).
    pub rnr_retry: u8,
    /// Service level.
    pub service_level: u8,
    /// RoCE traffic class (DSCP << 2).
    pub traffic_class: u8,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            devices: Vec::new(),
            port: 1,
            gid_index: None,
            listen: None,
            advertise: None,
            slice_size: 64 << 10,
            qps_per_path: 2,
            max_served_qps: 8192,
            max_outstanding: 128,
            signal_every: 16,
            nic_affinity: BTreeMap::new(),
            connect_timeout: Duration::from_secs(5),
            mtu: 4096,
            timeout: 14,
            retry_count: 7,
            rnr_retry: 7,
            service_level: 0,
            traffic_class: 0,
        }
    }
}

/// The longest `connect_timeout`: an hour is far beyond any exchange's round trip, and
/// a backend closing while its peers hang waits a few times it.
pub(crate) const MAX_CONNECT_TIMEOUT: Duration = Duration::from_secs(3600);

/// The largest slice: one work request moves at most 2^31 bytes, and slices this big
/// would defeat striping anyway.
pub(crate) const MAX_SLICE: u64 = 1 << 30;

impl te_core::BackendConfig for RdmaConfig {
    /// Checks values serde cannot.
    ///
    /// # Errors
    /// `ConfigInvalid`, naming the key and the accepted range.
    fn validate(&self) -> Result<()> {
        let bad = |m: String| {
            Err(
                Error::new(ErrorKind::ConfigInvalid, format!("[backends.rdma] {m}"))
                    .with_operation("create backend"),
            )
        };
        if self.port == 0 {
            return bad("port = 0: ports are numbered from 1".into());
        }
        if !(4096..=MAX_SLICE).contains(&self.slice_size) {
            return bad(format!(
                "slice_size = {} is outside 4KiB..=1GiB",
                self.slice_size
            ));
        }
        if !(1..=16).contains(&self.qps_per_path) {
            return bad(format!(
                "qps_per_path = {} is outside 1..=16",
                self.qps_per_path
            ));
        }
        if self.max_served_qps == 0 {
            return bad("max_served_qps = 0: a target must hold its initiators' QPs".into());
        }
        if !(1..=16384).contains(&self.max_outstanding) {
            return bad(format!(
                "max_outstanding = {} is outside 1..=16384",
                self.max_outstanding
            ));
        }
        if self.signal_every == 0 || self.signal_every > self.max_outstanding {
            return bad(format!(
                "signal_every = {} must be between 1 and max_outstanding ({})",
                self.signal_every, self.max_outstanding
            ));
        }
        if crate::qp::mtu_enum(self.mtu).is_none() {
            return bad(format!(
                "mtu = {} is not one of 256, 512, 1024, 2048, 4096",
                self.mtu
            ));
        }
        if self.timeout > 31 || self.retry_count > 7 || self.rnr_retry > 7 {
            return bad("timeout is 0–31, retry_count and rnr_retry are 0–7".into());
        }
        if self.service_level > 15 {
            return bad(format!(
                "service_level = {} is outside 0–15",
                self.service_level
            ));
        }
        for (kind, nics) in &self.nic_affinity {
            match kind.parse::<te_core::MemoryKind>() {
                Ok(te_core::MemoryKind::Device { .. }) if !nics.is_empty() => {}
                _ => {
                    return bad(format!(
                        "nic_affinity key {kind:?} must be a device memory kind (like \"cuda:0\") with at least one NIC"
                    ))
                }
            }
        }
        if self.connect_timeout.is_zero() || self.connect_timeout > MAX_CONNECT_TIMEOUT {
            return bad(format!(
                "connect_timeout = {:?} is outside (0, 1h]: it bounds one request and its answer, and closing a QP set nobody waits for",
                self.connect_timeout
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_core::BackendContext;

    fn parse(text: &str) -> Result<RdmaConfig> {
        let ctx = BackendContext {
            epoch: 0,
            engine: "t".into(),
            table: text.parse().expect("toml"),
            source: "test.toml".into(),
            ..Default::default()
        };
        ctx.config(crate::NAME)
    }

    #[test]
    fn defaults_are_valid_and_the_slice_is_64_kib() {
        let c = parse("").unwrap();
        assert_eq!(c, RdmaConfig::default());
        assert_eq!(c.slice_size, 64 << 10);
    }

    #[test]
    fn options_parse_with_units() {
        let c = parse(
            "devices = [\"mlx5_0\", \"mlx5_1\"]\ngid_index = 3\nslice_size = \"1MiB\"\nnic_affinity = { \"cuda:1\" = [\"mlx5_1\"] }",
        )
        .unwrap();
        assert_eq!(c.devices, ["mlx5_0", "mlx5_1"]);
        assert_eq!(c.gid_index, Some(3));
        assert_eq!(c.slice_size, 1 << 20);
        assert_eq!(c.nic_affinity["cuda:1"], ["mlx5_1"]);
    }

    #[test]
    fn unknown_keys_and_bad_values_are_refused_with_the_key() {
        let e = parse("device = [\"mlx5_0\"]").unwrap_err();
        assert!(e.to_string().contains("device"), "{e}");
        assert!(e.to_string().contains("test.toml"), "{e}");
        for (text, key) in [
            ("slice_size = 100", "slice_size"),
            ("qps_per_path = 0", "qps_per_path"),
            ("signal_every = 0", "signal_every"),
            ("max_outstanding = 8\nsignal_every = 9", "signal_every"),
            ("mtu = 1500", "mtu"),
            ("port = 0", "port"),
            ("retry_count = 8", "retry_count"),
            ("adaptive_poll = \"20us\"", "adaptive_poll"),
            ("nic_affinity = { host = [\"mlx5_0\"] }", "nic_affinity"),
            ("nic_affinity = { \"cuda:0\" = [] }", "nic_affinity"),
            ("connect_timeout = \"0s\"", "connect_timeout"),
            ("connect_timeout = \"61m\"", "connect_timeout"),
        ] {
            let e = parse(text).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::ConfigInvalid, "{text}");
            assert!(e.to_string().contains(key), "{text}: {e}");
        }
    }
}
