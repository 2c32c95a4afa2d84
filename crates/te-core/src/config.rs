//! Configuration: `plugins.toml`, or any file given with `--config` or `TE_CONFIG`.
//!
//! ```toml
//! [engine]
//! backend = "stub"
//! plugin_dirs = ["target/release"]   # relative to this file's directory
//! listen = "127.0.0.1:0"
//! default_timeout = "30s"
//!
//! [backends.stub]                    # each backend reads its own table
//! mode = "copy"
//! ```
//!
//! Unknown keys anywhere are errors that name the key, the file and the line.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// A configuration table (`[backends.NAME]`, `[runtimes.NAME]`), as TOML parsed it.
pub use toml::Table;

use crate::backend::BackendContext;
use crate::error::{Error, ErrorKind, Result};

/// The environment variable naming a configuration file when `--config` is absent.
pub const CONFIG_ENV: &str = "TE_CONFIG";

/// The `[engine]` table.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// The engine's name, shown to peers. Default: `te-<pid>`.
    pub name: String,
    /// The backend's registry name.
    pub backend: String,
    /// Directories scanned for backend plugins (`libte_*.so`), in order.
    pub plugin_dirs: Vec<PathBuf>,
    /// The control plane's listen address; port 0 picks a free port.
    pub listen: String,
    /// The host or IP peers reach the control plane at; required when `listen` binds
    /// every interface.
    pub advertise: Option<String>,
    /// A secret every engine of a deployment shares: peers prove it (HMAC
    /// challenge–response) before the control plane or any backend's connections say
    /// or accept anything. Unset: no authentication.
    pub auth_token: Option<String>,
    /// Where engines find each other: `p2p` (by `host:port`, descriptors from each
    /// engine's control plane) or `etcd://HOST:PORT[,HOST:PORT…]` (by name too).
    pub metadata: String,
    /// The key prefix under which engines publish themselves in the metadata store.
    pub metadata_prefix: String,
    /// How long an engine's entry outlives the engine's last renewal of it.
    #[serde(deserialize_with = "de::duration")]
    pub metadata_ttl: Duration,
    /// The deadline of a batch or connect that sets none.
    #[serde(deserialize_with = "de::duration")]
    pub default_timeout: Duration,
    /// Bytes of received notifications kept until read, each counted with its sender's
    /// name and address and a fixed overhead; senders get `Busy` beyond, and so does
    /// one sender holding a quarter of it (or one `notification_max` with its overhead,
    /// if larger).
    #[serde(deserialize_with = "de::size")]
    pub notification_bytes: u64,
    /// The largest notification accepted, in bytes.
    #[serde(deserialize_with = "de::size")]
    pub notification_max: u64,
    /// How often a session proves it is alive; a peer silent for three of these is
    /// lost.
    #[serde(deserialize_with = "de::duration")]
    pub heartbeat: Duration,
    /// The whole control-plane handshake of a new connection must end within this;
    /// it also bounds how long a peer's backend request is served, whatever deadline
    /// the peer claims for it.
    #[serde(deserialize_with = "de::duration")]
    pub handshake_timeout: Duration,
    /// Connections not yet authenticated; past it the oldest is closed.
    pub max_pending: usize,
    /// Connections not yet authenticated from one address; past it that source's
    /// oldest is closed.
    pub max_pending_per_source: usize,
    /// Authenticated sessions served at once.
    pub max_sessions: usize,
    /// Authenticated sessions served at once for one address.
    pub max_sessions_per_source: usize,
    /// Where the metrics endpoint listens (`HOST:PORT`): `GET /metrics` answers the
    /// engine's metrics in the OpenMetrics text format. Unset: no endpoint.
    pub metrics_listen: Option<String>,
    /// Count each batch (bytes, requests, outcome, latency, per engine and per peer)
    /// and keep its telemetry for the handle; `false` skips that per-batch work, so the
    /// snapshot shows no batches and handles no telemetry (what `scripts/metrics-cost.sh`
    /// compares against).
    pub metrics: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            name: format!("te-{}", std::process::id()),
            backend: "stub".to_string(),
            plugin_dirs: Vec::new(),
            listen: "127.0.0.1:0".to_string(),
            metadata: "p2p".to_string(),
            metadata_prefix: "/te/".to_string(),
            metadata_ttl: Duration::from_secs(10),
            default_timeout: Duration::from_secs(30),
            advertise: None,
            auth_token: None,
            notification_bytes: 32 << 20,
            notification_max: 64 << 10,
            heartbeat: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            max_pending: 1024,
            max_pending_per_source: 256,
            max_sessions: 4096,
            max_sessions_per_source: 1024,
            metrics_listen: None,
            metrics: true,
        }
    }
}

impl EngineConfig {
    /// Checks the table's values: what a file is refused for, a configuration built in
    /// code is refused for too, before an engine starts with it (a zero heartbeat,
    /// say, would stop its control plane).
    ///
    /// # Errors
    /// `ConfigInvalid`, naming the key and what it must be.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| {
            Err(Error::new(ErrorKind::ConfigInvalid, msg).with_operation("check config"))
        };
        if self.backend.is_empty() {
            return bad("[engine] backend is empty; name a backend (`te info` lists them)".into());
        }
        if let Err(e) = metadata_location(&self.metadata) {
            return bad(e.message().to_string());
        }
        if self.metadata_ttl < Duration::from_secs(1) {
            return bad(
                "[engine] metadata_ttl must be at least 1s (etcd leases count seconds)".into(),
            );
        }
        if self.metadata_prefix.is_empty() {
            return bad(
                "[engine] metadata_prefix is empty; use a key prefix such as \"/te/\"".into(),
            );
        }
        if self.default_timeout.is_zero() {
            return bad("[engine] default_timeout must be greater than zero".into());
        }
        if self.notification_max == 0 || self.notification_max > self.notification_bytes {
            return bad(
                "[engine] notification_max must be at least 1 byte and at most notification_bytes"
                    .into(),
            );
        }
        if self.notification_max > 16 << 20 {
            return bad(
                "[engine] notification_max is at most 16MiB; send bulk data as a transfer".into(),
            );
        }
        if self.heartbeat < Duration::from_millis(50) || self.handshake_timeout.is_zero() {
            return bad(
                "[engine] heartbeat must be at least 50ms and handshake_timeout above zero".into(),
            );
        }
        if [
            self.max_pending,
            self.max_pending_per_source,
            self.max_sessions,
            self.max_sessions_per_source,
        ]
        .contains(&0)
        {
            return bad("[engine] max_pending, max_pending_per_source, max_sessions and max_sessions_per_source must be at least 1".into());
        }
        if self.auth_token.as_deref() == Some("") {
            return bad("[engine] auth_token is empty; set a secret or leave it out".into());
        }
        Ok(())
    }
}

/// A whole configuration: the engine table and each backend's own raw table.
#[derive(Debug, Clone, Default)]
pub struct Config {
    /// The `[engine]` table.
    pub engine: EngineConfig,
    /// `[backends.NAME]` tables, handed to each backend unparsed.
    pub backends: BTreeMap<String, toml::Table>,
    /// `[runtimes.NAME]` tables, handed to each device runtime when it starts.
    pub runtimes: BTreeMap<String, toml::Table>,
    /// Where it came from (a path, or `defaults`), for messages.
    pub source: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    engine: EngineConfig,
    #[serde(default)]
    backends: BTreeMap<String, toml::Table>,
    #[serde(default)]
    runtimes: BTreeMap<String, toml::Table>,
}

pub use crate::units::{de, parse_duration, parse_size};

impl Config {
    /// The defaults, as if from an empty file.
    pub fn defaults() -> Config {
        Config {
            source: "defaults".to_string(),
            ..Config::default()
        }
    }

    /// Parses a configuration from TOML text; relative plugin directories are taken
    /// relative to `base`.
    ///
    /// # Errors
    /// `ConfigInvalid`, naming the file, the line and the offending key or value.
    pub fn from_toml(text: &str, source: &str, base: &Path) -> Result<Config> {
        let file: File = toml::from_str(text).map_err(|e| {
            let line = e
                .span()
                .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1);
            let place = match line {
                Some(l) => format!("{source}:{l}"),
                None => source.to_string(),
            };
            Error::new(
                ErrorKind::ConfigInvalid,
                format!("{place}: {}", e.message().trim()),
            )
            .with_operation("load config")
        })?;
        let mut engine = file.engine;
        for dir in &mut engine.plugin_dirs {
            if dir.is_relative() {
                *dir = base.join(&*dir);
            }
        }
        let config = Config {
            engine,
            backends: file.backends,
            runtimes: file.runtimes,
            source: source.to_string(),
        };
        config.validate()?;
        Ok(config)
    }

    /// Reads a configuration file.
    ///
    /// # Errors
    /// `ConfigInvalid` if it cannot be read or parsed.
    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::new(
                ErrorKind::ConfigInvalid,
                format!("cannot read config file {}", path.display()),
            )
            .with_operation("load config")
            .with_source(e)
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        Config::from_toml(&text, &path.display().to_string(), base)
    }

    /// The configuration a program should use: `path` if given, else the file named by
    /// `TE_CONFIG`, else the defaults.
    ///
    /// # Errors
    /// As [`Config::load`].
    pub fn resolve(path: Option<&Path>) -> Result<Config> {
        match path {
            Some(p) => Config::load(p),
            None => match std::env::var_os(CONFIG_ENV) {
                Some(p) if !p.is_empty() => Config::load(Path::new(&p)),
                _ => Ok(Config::defaults()),
            },
        }
    }

    /// Checks the engine table's values, naming this configuration's source in the
    /// error: what [`Config::from_toml`] does for a file, and every engine constructor
    /// for a configuration however it was made.
    ///
    /// # Errors
    /// `ConfigInvalid`, naming the source, the key and what it must be.
    pub(crate) fn validate(&self) -> Result<()> {
        self.engine.validate().map_err(|e| {
            let message = match self.source.as_str() {
                "" => e.message().to_string(),
                source => format!("{source}: {}", e.message()),
            };
            Error::new(ErrorKind::ConfigInvalid, message).with_operation("load config")
        })
    }

    /// The context handed to backend `name`: its table (empty if absent) and the source.
    /// The epoch is 0 (unset); the engine that creates the backend sets it.
    pub fn backend_context(&self, name: &str) -> BackendContext {
        BackendContext {
            engine: self.engine.name.clone(),
            epoch: 0,
            auth_token: self.engine.auth_token.clone(),
            hook: Default::default(),
            table: self.backends.get(name).cloned().unwrap_or_default(),
            source: self.source.clone(),
            listen_host: self
                .engine
                .listen
                .rsplit_once(':')
                .map(|(host, _)| host.to_string()),
            advertise: self.engine.advertise.clone(),
        }
    }
}

/// The field names of a struct that serde's derive deserializes (its config keys),
/// found by asking its `Deserialize` impl: the derive names every field when it asks
/// for a struct, and this deserializer answers nothing else. Empty for anything that
/// is not such a struct.
pub fn fields<T: serde::de::DeserializeOwned>() -> &'static [&'static str] {
    struct Fields(Option<&'static [&'static str]>);
    impl<'de> serde::de::Deserializer<'de> for &mut Fields {
        type Error = serde::de::value::Error;
        fn deserialize_any<V: serde::de::Visitor<'de>>(
            self,
            _: V,
        ) -> std::result::Result<V::Value, Self::Error> {
            Err(serde::de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: serde::de::Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> std::result::Result<V::Value, Self::Error> {
            self.0 = Some(fields);
            Err(serde::de::Error::custom("fields taken"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut f = Fields(None);
    let _ = T::deserialize(&mut f);
    f.0.unwrap_or(&[])
}

/// A parsed `metadata` value.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum MetadataLocation {
    P2p,
    Etcd(Vec<String>),
}

/// Parses `p2p` or `etcd://host:port[,host:port…]`.
pub(crate) fn metadata_location(s: &str) -> Result<MetadataLocation> {
    let bad = |why: &str| {
        Err(Error::new(
            ErrorKind::ConfigInvalid,
            format!("[engine] metadata = \"{s}\": {why}; use \"p2p\" or \"etcd://HOST:PORT[,HOST:PORT…]\""),
        ))
    };
    if s == "p2p" {
        return Ok(MetadataLocation::P2p);
    }
    let Some(rest) = s.strip_prefix("etcd://") else {
        return bad("unknown metadata store");
    };
    let mut endpoints = Vec::new();
    for ep in rest.trim_end_matches('/').split(',') {
        match ep.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                endpoints.push(ep.to_string())
            }
            _ => return bad(&format!("endpoint `{ep}` is not HOST:PORT")),
        }
    }
    Ok(MetadataLocation::Etcd(endpoints))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_parse_and_bad_ones_say_what_to_write() {
        assert_eq!(metadata_location("p2p").unwrap(), MetadataLocation::P2p);
        assert_eq!(
            metadata_location("etcd://a:1,10.0.0.2:2379/").unwrap(),
            MetadataLocation::Etcd(vec!["a:1".into(), "10.0.0.2:2379".into()])
        );
        for bad in ["zk://a:1", "etcd://", "etcd://a", "etcd://a:x", "etcd://:1"] {
            let e = metadata_location(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::ConfigInvalid);
            assert!(e.to_string().contains("etcd://HOST:PORT"), "{e}");
        }
    }

    fn parse(text: &str) -> Result<Config> {
        Config::from_toml(text, "test.toml", Path::new("/etc/te"))
    }

    #[test]
    fn sizes_parse_in_binary_and_decimal_units() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64KiB").unwrap(), 64 << 10);
        assert_eq!(parse_size("1mib").unwrap(), 1 << 20);
        assert_eq!(parse_size("1GB").unwrap(), 1_000_000_000);
        for bad in [
            "",
            "KiB",
            "1.5MiB",
            "-1",
            "1TiB",
            "99999999999999999999",
            "1GiBs",
        ] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
        assert!(parse_size("20000000000GiB").is_err());
    }

    #[test]
    fn an_empty_file_gives_the_defaults() {
        let c = parse("").unwrap();
        assert_eq!(c.engine.backend, "stub");
        assert_eq!(c.engine.default_timeout, Duration::from_secs(30));
    }

    #[test]
    fn durations_and_relative_plugin_dirs_are_understood() {
        let c = parse("[engine]\ndefault_timeout = \"250ms\"\nplugin_dirs = [\"p\", \"/abs\"]\n")
            .unwrap();
        assert_eq!(c.engine.default_timeout, Duration::from_millis(250));
        assert_eq!(
            c.engine.plugin_dirs,
            vec![PathBuf::from("/etc/te/p"), PathBuf::from("/abs")]
        );
    }

    #[test]
    fn unknown_keys_name_the_key_the_file_and_the_line() {
        let e = parse("[engine]\nbackend = \"stub\"\nbakcend = \"tcp\"\n").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ConfigInvalid);
        let msg = e.to_string();
        assert!(
            msg.contains("bakcend") && msg.contains("test.toml:3"),
            "{msg}"
        );
        let e = parse("[engin]\n").unwrap_err();
        assert!(e.to_string().contains("engin"), "{e}");
    }

    #[test]
    fn bad_values_are_refused_with_the_reason() {
        let e = parse("[engine]\ndefault_timeout = \"soon\"\n").unwrap_err();
        assert!(e.to_string().contains("not a duration"), "{e}");
        let e = parse("[engine]\nmetadata = \"zk://x:2181\"\n").unwrap_err();
        assert!(e.to_string().contains("etcd://HOST:PORT"), "{e}");
        let c = parse("[engine]\nmetadata = \"etcd://x:2379\"\nmetadata_ttl = \"3s\"\n").unwrap();
        assert_eq!(c.engine.metadata_ttl, Duration::from_secs(3));
        let e = parse("[engine]\nmetadata_ttl = \"10ms\"\n").unwrap_err();
        assert!(e.to_string().contains("at least 1s"), "{e}");
    }

    #[test]
    fn backend_tables_reach_their_backend_unparsed() {
        let c = parse("[backends.stub]\nmode = \"noop\"\n").unwrap();
        let ctx = c.backend_context("stub");
        assert_eq!(ctx.table.get("mode").and_then(|v| v.as_str()), Some("noop"));
        assert!(c.backend_context("tcp").table.is_empty());
    }
}
