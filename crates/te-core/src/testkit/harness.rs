//! How the suite makes engines and targets of the backend under test.

use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::Failed;

use super::remote::{unhex, RemoteTarget};
use super::{e2f, fail};
use crate::{
    Access, BackendContext, Buffer, Config, Deadline, Engine, ErrorKind, KvGroup, KvLayout, KvSlot,
    MemoryKind, Notification, Peer, RegionDesc, RegionId, Registry, TransferBackend,
};

/// How the suite makes engines of the backend under test.
#[derive(Debug, Clone)]
pub struct Harness {
    label: String,
    config: Config,
    slow: Option<Config>,
    memory: (MemoryKind, MemoryKind),
    remote: Option<(String, Option<String>)>,
    /// The engine TOML behind `config` and `slow`, where the harness was made from
    /// tables ([`Harness::for_backend`]): what a child-process target is started with.
    toml: Option<(String, Option<String>)>,
}

/// The TOML text of an engine of backend `name` whose `[backends.NAME]` table is
/// `table` (TOML lines, may be empty).
pub fn engine_toml(name: &str, table: &str) -> String {
    format!("[engine]\nbackend = \"{name}\"\n[backends.{name}]\n{table}\n")
}

/// [`engine_toml`], parsed.
///
/// # Panics
/// On a table that does not parse: a test's own fixture is wrong.
pub fn engine_config(name: &str, table: &str) -> Config {
    Config::from_toml(
        &engine_toml(name, table),
        &format!("{name}-conformance.toml"),
        std::path::Path::new("."),
    )
    .unwrap_or_else(|e| panic!("the test's [backends.{name}] table is invalid: {e}"))
}

/// The directory cargo puts the workspace's cdylibs in (`target/<profile>`), found
/// from the running test executable (`target/<profile>/deps/…`).
///
/// # Panics
/// When the executable is not under such a directory.
pub fn plugin_dir() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("the test executable is in target/<profile>/deps")
        .to_path_buf()
}

/// The plugin file `lib<crate_name>.so` that `cargo build --workspace` built.
///
/// # Panics
/// When it is missing, saying to build the workspace first.
pub fn built_plugin(crate_name: &str) -> std::path::PathBuf {
    let lib = plugin_dir().join(format!("lib{crate_name}{}", std::env::consts::DLL_SUFFIX));
    assert!(
        lib.exists(),
        "{} is missing: run `cargo build --workspace` before `cargo test` (the README's test command does)",
        lib.display()
    );
    lib
}

impl Harness {
    /// A harness whose engines come from `config`.
    pub fn new(label: &str, config: Config) -> Harness {
        Harness {
            label: label.to_string(),
            config,
            slow: None,
            memory: (MemoryKind::Host, MemoryKind::Host),
            remote: None,
            toml: None,
        }
    }

    /// The harness every backend crate's conformance test starts from: engines of
    /// backend `name` with `table` as their `[backends.NAME]` table, and `slow` as the
    /// table whose batches take about 200 ms (the stub's `delay`, te-tcp's
    /// `debug_delay`). [`trials_everywhere`](super::trials_everywhere) runs it in one
    /// process and, where the backend reaches across processes, across two.
    pub fn for_backend(name: &str, table: &str, slow: Option<&str>) -> Harness {
        let mut h = Harness::new(name, engine_config(name, table));
        if let Some(slow) = slow {
            h = h.with_slow(engine_config(name, slow));
        }
        h.toml = Some((engine_toml(name, table), slow.map(|s| engine_toml(name, s))));
        h
    }

    /// Runs the backend from the plugin `lib<crate_name>.so` that `cargo build
    /// --workspace` built rather than the built-in one (for the normal and the slow
    /// configuration).
    ///
    /// # Panics
    /// When the plugin is missing or does not shadow the built-in backend, with the
    /// registry's reasons.
    pub fn with_built_plugin(mut self, crate_name: &str) -> Harness {
        let lib = built_plugin(crate_name);
        let dir = plugin_dir();
        let registry = Registry::discover(std::slice::from_ref(&dir));
        let name = &self.config.engine.backend;
        let origin = registry.get(name).map(|e| e.origin().clone());
        assert_eq!(
            origin.as_ref().ok(),
            Some(&crate::Origin::Plugin(lib)),
            "the {name} plugin must shadow the built-in {name}; plugin problems: {:?}",
            registry
                .problems()
                .iter()
                .map(|p| p.error.to_string())
                .collect::<Vec<_>>()
        );
        self.config.engine.plugin_dirs = vec![dir.clone()];
        if let Some(slow) = &mut self.slow {
            slow.engine.plugin_dirs = vec![dir];
        }
        self
    }

    /// The same harness under another label (test names start with it).
    pub fn labelled(mut self, label: &str) -> Harness {
        self.label = label.to_string();
        self
    }

    /// This harness with every target in a child process, where it was made by
    /// [`for_backend`](Self::for_backend); `None` otherwise.
    pub(super) fn across_processes(&self) -> Option<Harness> {
        let (normal, slow) = self.toml.clone()?;
        Some(
            self.clone()
                .labelled(&format!("{}_two_process", self.label))
                .with_remote_target(&normal, slow.as_deref()),
        )
    }

    /// Puts the initiator's buffers in `initiator` memory and the target's in `target`
    /// memory (`host`, `fakedev:0`, `cuda:0`, …) instead of host memory.
    pub fn with_memory(mut self, initiator: MemoryKind, target: MemoryKind) -> Harness {
        self.memory = (initiator, target);
        self
    }

    /// Adds a configuration whose batches take about 200 ms.
    pub fn with_slow(mut self, slow: Config) -> Harness {
        self.slow = Some(slow);
        self
    }

    /// Runs every target engine in a child process: this test binary again, started
    /// with the target's configuration (`config`, or `slow` for the slow tests) as TOML
    /// text. The test's `main` must call
    /// [`serve_target_if_asked`](super::serve_target_if_asked) first.
    pub fn with_remote_target(mut self, config: &str, slow: Option<&str>) -> Harness {
        self.remote = Some((config.to_string(), slow.map(str::to_string)));
        self
    }

    pub(super) fn label(&self) -> &str {
        &self.label
    }

    pub(super) fn config(&self) -> &Config {
        &self.config
    }

    pub(super) fn has_slow(&self) -> bool {
        self.slow.is_some()
    }

    /// The initiator's and the target's memory kinds.
    pub(super) fn memory(&self) -> &(MemoryKind, MemoryKind) {
        &self.memory
    }

    /// A backend of the kind under test, below any engine (for tests that must get
    /// past the engine's own checks, or count completions the engine would hide).
    pub(super) fn raw_backend(&self) -> Result<Arc<dyn TransferBackend>, Failed> {
        let registry = Registry::discover(&self.config.engine.plugin_dirs);
        let entry = registry.get(&self.config.engine.backend).map_err(e2f)?;
        let ctx: BackendContext = self.config.backend_context(&self.config.engine.backend);
        entry.create(&ctx).map_err(e2f)
    }

    pub(super) fn engine(&self, config: &Config, name: &str) -> Result<Engine, Failed> {
        let mut c = config.clone();
        c.engine.name = format!("{}-{name}", self.label);
        Engine::from_config(&c).map_err(|e| fail(format!("cannot create engine: {e}")))
    }

    pub(super) fn target(&self, slow: bool) -> Result<Target, Failed> {
        match &self.remote {
            None => {
                let config = if slow {
                    self.slow.as_ref().unwrap_or(&self.config)
                } else {
                    &self.config
                };
                Ok(Target::Local(
                    self.engine(config, "target")?,
                    self.memory.1.clone(),
                ))
            }
            Some((normal, slow_toml)) => {
                let toml = if slow {
                    slow_toml.as_ref().unwrap_or(normal)
                } else {
                    normal
                };
                Ok(Target::Remote(Arc::new(RemoteTarget::spawn(
                    toml,
                    &self.memory.1,
                )?)))
            }
        }
    }

    /// A target with a remotely readable and writable buffer, an initiator with a local
    /// buffer, and the initiator's peer for the target.
    pub(super) fn pair(&self, slow: bool, len: usize) -> Result<Pair, Failed> {
        let target = self.target(slow)?;
        let config = if slow {
            self.slow.as_ref().unwrap_or(&self.config)
        } else {
            &self.config
        };
        let initiator = self.engine(config, "initiator")?;
        let remote = target.alloc("dst", len, Access::REMOTE_READ_WRITE)?;
        let local = initiator
            .alloc_on(&self.memory.0, "src", len, Access::LOCAL)
            .map_err(e2f)?;
        let peer = initiator.connect(&target.address()).map_err(e2f)?;
        let remote_desc = peer
            .region("dst")
            .ok_or_else(|| fail("the target's region is not in its descriptor"))?;
        if remote_desc.kind != self.memory.1 {
            return Err(fail(format!(
                "the target's buffer is {} memory, not {}",
                remote_desc.kind, self.memory.1
            )));
        }
        Ok(Pair {
            remote_desc,
            peer,
            local,
            remote,
            initiator,
            target,
        })
    }
}

/// Field order matters: buffers deregister before their engines go.
pub(super) struct Pair {
    pub(super) remote_desc: RegionDesc,
    pub(super) peer: Peer,
    pub(super) local: Buffer,
    pub(super) remote: TargetBuffer,
    pub(super) initiator: Engine,
    pub(super) target: Target,
}

/// The deadline tests use for calls below the engine.
pub(super) fn soon() -> Deadline {
    Deadline::after(Duration::from_secs(10))
}

/// The target engine: in this process, or in a child process.
pub(super) enum Target {
    Local(Engine, MemoryKind),
    Remote(Arc<RemoteTarget>),
}

pub(super) enum TargetBuffer {
    Local(Buffer),
    Remote(Arc<RemoteTarget>, RegionId),
}

impl Target {
    pub(super) fn address(&self) -> String {
        match self {
            Target::Local(e, _) => e.address().to_string(),
            Target::Remote(r) => r.address.clone(),
        }
    }

    pub(super) fn epoch(&self) -> u64 {
        match self {
            Target::Local(e, _) => e.epoch(),
            Target::Remote(r) => r.epoch,
        }
    }

    pub(super) fn alloc(
        &self,
        name: &str,
        len: usize,
        access: Access,
    ) -> Result<TargetBuffer, Failed> {
        match self {
            Target::Local(e, kind) => e
                .alloc_on(kind, name, len, access)
                .map(TargetBuffer::Local)
                .map_err(e2f),
            Target::Remote(r) => {
                let access = format!(
                    "{}{}",
                    u8::from(access.remote_read),
                    u8::from(access.remote_write)
                );
                let id = r.call(&format!("alloc {name} {len} {access}"))?;
                let id = id
                    .parse()
                    .map_err(|_| fail(format!("bad region id from the target: {id}")))?;
                Ok(TargetBuffer::Remote(r.clone(), RegionId(id)))
            }
        }
    }

    /// Registers layout `name` on the target over `buffer`: one group `layer0` with a
    /// `key` and a `value` slot of `blocks` blocks of `bpb` bytes, back to back.
    pub(super) fn two_slot_layout(
        &self,
        name: &str,
        buffer: &TargetBuffer,
        bpb: u64,
        blocks: u64,
    ) -> Result<(), Failed> {
        match self {
            Target::Local(e, _) => e
                .register_layout(two_slots(name, buffer.id(), bpb, blocks))
                .map_err(e2f),
            Target::Remote(r) => r
                .call(&format!("layout {name} {} {bpb} {blocks}", buffer.id().0))
                .map(|_| ()),
        }
    }

    pub(super) fn recv_notification(
        &self,
        timeout: Duration,
    ) -> Result<Option<Notification>, Failed> {
        match self {
            Target::Local(e, _) => Ok(e.recv_notification(timeout)),
            Target::Remote(r) => {
                let reply = r.call(&format!("notification {}", timeout.as_millis()))?;
                if reply == "none" {
                    return Ok(None);
                }
                let mut parts = reply.split(' ');
                let mut next = || parts.next().unwrap_or("");
                let (epoch, message, from, from_address) = (next(), next(), next(), next());
                Ok(Some(Notification {
                    from: from.to_string(),
                    from_address: from_address.to_string(),
                    received: std::time::SystemTime::now(),
                    from_epoch: epoch
                        .parse()
                        .map_err(|_| fail(format!("bad notification: {reply}")))?,
                    message: unhex(message)?,
                }))
            }
        }
    }
}

impl TargetBuffer {
    pub(super) fn id(&self) -> RegionId {
        match self {
            TargetBuffer::Local(b) => b.id(),
            TargetBuffer::Remote(_, id) => *id,
        }
    }

    pub(super) fn to_vec(&self) -> crate::Result<Vec<u8>> {
        match self {
            TargetBuffer::Local(b) => b.to_vec(),
            TargetBuffer::Remote(r, id) => r
                .call(&format!("read {}", id.0))
                .map_err(|e| crate::Error::new(ErrorKind::Io, format!("{e:?}")))
                .and_then(|hex| {
                    unhex(&hex)
                        .map_err(|e| crate::Error::new(ErrorKind::Protocol, format!("{e:?}")))
                }),
        }
    }

    pub(super) fn read(&self, offset: usize, out: &mut [u8]) -> crate::Result<()> {
        let all = self.to_vec()?;
        let src = all
            .get(offset..offset + out.len())
            .ok_or_else(|| crate::Error::new(ErrorKind::OutOfBounds, "read past the buffer"))?;
        out.copy_from_slice(src);
        Ok(())
    }
}

impl Drop for TargetBuffer {
    fn drop(&mut self) {
        if let TargetBuffer::Remote(r, id) = self {
            let _ = r.call(&format!("free {}", id.0));
        }
    }
}

/// One group `layer0` with `key` and `value` slots of `blocks` blocks of `bpb` bytes,
/// back to back in `region`.
pub(super) fn two_slots(name: &str, region: RegionId, bpb: u64, blocks: u64) -> KvLayout {
    KvLayout {
        name: name.to_string(),
        groups: vec![KvGroup {
            name: "layer0".into(),
            slots: ["key", "value"]
                .iter()
                .enumerate()
                .map(|(i, n)| KvSlot {
                    name: n.to_string(),
                    region,
                    offset: i as u64 * bpb * blocks,
                    bytes_per_block: bpb,
                    blocks,
                })
                .collect(),
        }],
    }
}
