//! The fake devices, as `TE_FAKEVERBS_DEVICES` describes them.
//!
//! The variable holds whitespace-separated entries `NAME[:KEY=VALUE[,KEY=VALUE]…]`;
//! unset or empty, it is `fake0 fake1`. Keys:
//!
//! | key | values | default | meaning |
//! |-----|--------|---------|---------|
//! | `link` | `eth`, `ib` | `eth` | link layer: RoCE (addressed by GID) or InfiniBand (by LID) |
//! | `roce` | `v1v2`, `v1`, `v2` | `v1v2` | the GID types the port offers (Ethernet only) |
//! | `state` | `active`, `down` | `active` | the port's state at start |
//! | `vectors` | 1–64 | `4` | completion vectors (`num_comp_vectors`) |
//! | `rd_atom` | 1–16 | `16` | `max_qp_rd_atom` and `max_qp_init_rd_atom` |
//! | `mtu` | 256–4096 | `4096` | the port's active MTU |
//! | `delay` | a duration (`200ms`, `50us`, `1s`) | `0` | every work request waits this long before it runs |

use std::time::Duration;

/// The GID types a RoCE port offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Roce {
    Both,
    V1,
    V2,
}

/// One fake device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeviceSpec {
    pub(crate) name: String,
    pub(crate) infiniband: bool,
    pub(crate) roce: Roce,
    pub(crate) active: bool,
    pub(crate) vectors: i32,
    pub(crate) rd_atom: i32,
    /// `ibv_mtu` code.
    pub(crate) mtu: u32,
    pub(crate) delay: Duration,
}

/// The variable that lists the fake devices.
pub(crate) const DEVICES_ENV: &str = "TE_FAKEVERBS_DEVICES";

/// Parses a duration such as `200ms`, `50us`, `1s` or `0`.
pub(crate) fn duration(s: &str) -> Option<Duration> {
    let (n, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map_or((s, ""), |i| s.split_at(i));
    let n: u64 = n.parse().ok()?;
    Some(match unit {
        "" if n == 0 => Duration::ZERO,
        "us" => Duration::from_micros(n),
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        _ => return None,
    })
}

fn entry(text: &str) -> Result<DeviceSpec, String> {
    let (name, opts) = text.split_once(':').unwrap_or((text, ""));
    if name.is_empty() || name.len() > 63 || !name.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "{text:?}: a device name is 1–63 printable characters"
        ));
    }
    let mut d = DeviceSpec {
        name: name.to_string(),
        infiniband: false,
        roce: Roce::Both,
        active: true,
        vectors: 4,
        rd_atom: 16,
        mtu: 5,
        delay: Duration::ZERO,
    };
    for kv in opts.split(',').filter(|s| !s.is_empty()) {
        let bad = || format!("{name}: bad option {kv:?}");
        let (k, v) = kv.split_once('=').ok_or_else(bad)?;
        match (k, v) {
            ("link", "eth") => d.infiniband = false,
            ("link", "ib") => d.infiniband = true,
            ("roce", "v1v2") => d.roce = Roce::Both,
            ("roce", "v1") => d.roce = Roce::V1,
            ("roce", "v2") => d.roce = Roce::V2,
            ("state", "active") => d.active = true,
            ("state", "down") => d.active = false,
            ("vectors", n) => {
                d.vectors = n
                    .parse()
                    .ok()
                    .filter(|n| (1..=64).contains(n))
                    .ok_or_else(bad)?
            }
            ("rd_atom", n) => {
                d.rd_atom = n
                    .parse()
                    .ok()
                    .filter(|n| (1..=16).contains(n))
                    .ok_or_else(bad)?
            }
            ("mtu", n) => {
                d.mtu = match n {
                    "256" => 1,
                    "512" => 2,
                    "1024" => 3,
                    "2048" => 4,
                    "4096" => 5,
                    _ => return Err(bad()),
                }
            }
            ("delay", t) => d.delay = duration(t).ok_or_else(bad)?,
            _ => return Err(bad()),
        }
    }
    Ok(d)
}

/// The devices `text` (the variable's value, `None` when unset) describes.
///
/// # Errors
/// A message naming the entry and option that is wrong, or a name used twice.
pub(crate) fn devices(text: Option<&str>) -> Result<Vec<DeviceSpec>, String> {
    let text = text
        .filter(|t| !t.trim().is_empty())
        .unwrap_or("fake0 fake1");
    let specs = text
        .split_whitespace()
        .map(entry)
        .collect::<Result<Vec<_>, _>>()?;
    for (i, d) in specs.iter().enumerate() {
        if specs[..i].iter().any(|e| e.name == d.name) {
            return Err(format!("{}: named twice", d.name));
        }
    }
    if specs.len() > 32 {
        return Err("at most 32 devices".into());
    }
    Ok(specs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_two_active_roce_devices() {
        let d = devices(None).unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!((d[0].name.as_str(), d[1].name.as_str()), ("fake0", "fake1"));
        assert!(d
            .iter()
            .all(|d| d.active && !d.infiniband && d.roce == Roce::Both));
        assert_eq!(devices(Some("  ")).unwrap(), d);
    }

    #[test]
    fn options_are_parsed_and_bad_ones_are_named() {
        let d = devices(Some(
            "a:link=ib,vectors=2 b:delay=200ms,state=down,roce=v1,rd_atom=4,mtu=1024",
        ))
        .unwrap();
        assert!(d[0].infiniband && d[0].vectors == 2);
        assert_eq!(d[1].delay, Duration::from_millis(200));
        assert!(!d[1].active && d[1].roce == Roce::V1 && d[1].rd_atom == 4 && d[1].mtu == 3);
        for (text, what) in [
            ("a:vectors=0", "vectors=0"),
            ("a:delay=3h", "delay=3h"),
            ("a:colour=red", "colour=red"),
            ("a a", "named twice"),
            (":x", "printable"),
        ] {
            let e = devices(Some(text)).unwrap_err();
            assert!(e.contains(what), "{text}: {e}");
        }
    }

    #[test]
    fn durations_take_units() {
        assert_eq!(duration("50us"), Some(Duration::from_micros(50)));
        assert_eq!(duration("2s"), Some(Duration::from_secs(2)));
        assert_eq!(duration("0"), Some(Duration::ZERO));
        assert_eq!(duration("5"), None);
        assert_eq!(duration("ms"), None);
    }
}
