//! The etcd store, over etcd's HTTP/JSON gateway (`/v3/…`, etcd 3.4 and later).
//!
//! Two background threads at most: a keeper that renews this engine's lease every
//! third of the TTL (and publishes the entry again when the lease is gone: an etcd
//! restart, or an outage longer than the TTL), and a watcher, started by the first
//! name resolved, that blocks on a watch stream over the prefix and reports resolved
//! entries that change or disappear. Both wait on a condition variable between tries.

use crate::signals::SpawnMasked as _;
use crate::sync::{Condvar, Mutex};
use std::collections::HashMap;
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use serde_json::{json, Value};

use super::http;
use super::{EngineEntry, MetadataStore, OnStale};
use crate::error::{Error, ErrorKind, Result};
use crate::time::Deadline;

/// The longest a background request to etcd may take.
const REQUEST: Duration = Duration::from_secs(3);
/// The pause before the watcher tries again after its stream broke.
const RETRY: Duration = Duration::from_secs(1);
/// The least time a call gives one endpoint before it tries the next (where the
/// caller's deadline leaves that much).
const ENDPOINT_FLOOR: Duration = Duration::from_millis(250);

pub(super) struct Etcd {
    shared: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

struct Shared {
    endpoints: Vec<String>,
    prefix: String,
    ttl: Duration,
    state: Mutex<State>,
    wake: Condvar,
    /// Entries resolved, by name (the ones whose changes are reported), and when the
    /// store last confirmed each.
    cache: Mutex<HashMap<String, (EngineEntry, Instant)>>,
    on_stale: Mutex<Option<Arc<OnStale>>>,
    /// The endpoint that answered last, tried first.
    preferred: AtomicUsize,
}

#[derive(Default)]
struct State {
    stop: bool,
    published: Option<EngineEntry>,
    lease: i64,
    watching: bool,
    /// The watch stream's socket, shut down to stop the watcher.
    watch: Option<TcpStream>,
}

impl Etcd {
    pub(super) fn new(endpoints: Vec<String>, prefix: &str, ttl: Duration) -> Etcd {
        Etcd {
            shared: Arc::new(Shared {
                endpoints,
                prefix: prefix.to_string(),
                ttl,
                state: Mutex::new(State::default()),
                wake: Condvar::new(),
                cache: Mutex::new(HashMap::new()),
                on_stale: Mutex::new(None),
                preferred: AtomicUsize::new(0),
            }),
            threads: Mutex::new(Vec::new()),
        }
    }

    fn spawn(&self, name: &str, f: impl FnOnce(Arc<Shared>) + Send + 'static) -> Result<()> {
        let shared = self.shared.clone();
        let t = std::thread::Builder::new()
            .name(name.to_string())
            .spawn_masked(move || f(shared))
            .map_err(|e| Error::io("start metadata thread", "cannot start a thread", e))?;
        self.threads.lock().push(t);
        Ok(())
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        {
            let mut st = self.shared.state.lock();
            st.stop = true;
            if let Some(s) = st.watch.take() {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        }
        self.shared.wake.notify_all();
        for t in self.threads.lock().drain(..) {
            // The last engine reference may be dropped on the watcher itself (from
            // its stale-entry callback); it ends on its own once it sees `stop`.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

impl MetadataStore for Etcd {
    fn describe(&self) -> String {
        format!("etcd://{}", self.shared.endpoints.join(","))
    }

    fn publish(&self, entry: &EngineEntry, deadline: Deadline) -> Result<()> {
        self.shared.state.lock().published = Some(entry.clone());
        self.shared.put_with_lease(deadline)?;
        self.spawn("te-etcd-lease", keep)
    }

    fn resolve(&self, name: &str, deadline: Deadline) -> Result<Option<EngineEntry>> {
        // While the watch is up, what it has not reported stale is current, for one
        // TTL: a watch stream can go silent without breaking (etcd's host gone, a
        // partition), and then it reports nothing again.
        if self.shared.state.lock().watch.is_some() {
            if let Some((e, at)) = self.shared.cache.lock().get(name) {
                if at.elapsed() < self.shared.ttl {
                    return Ok(Some(e.clone()));
                }
            }
        }
        let found = self.shared.get(name, deadline)?;
        if found.is_none() {
            self.shared.cache.lock().remove(name);
        }
        if let Some(e) = &found {
            self.shared
                .cache
                .lock()
                .insert(name.to_string(), (e.clone(), Instant::now()));
            let start = {
                let mut st = self.shared.state.lock();
                !std::mem::replace(&mut st.watching, true)
            };
            if start {
                self.spawn("te-etcd-watch", watch)?;
            }
        }
        Ok(found)
    }

    fn list(&self, deadline: Deadline) -> Result<Vec<EngineEntry>> {
        let start = self.shared.key("");
        let end = range_end(start.as_bytes());
        let answer = self.shared.call(
            "/v3/kv/range",
            json!({"key": B64.encode(&start), "range_end": B64.encode(end)}),
            deadline,
        )?;
        let mut entries = Vec::new();
        for kv in answer["kvs"].as_array().into_iter().flatten() {
            if let Some(e) = decode_entry(kv) {
                entries.push(e);
            }
        }
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(entries)
    }

    fn on_stale(&self, f: OnStale) {
        *self.shared.on_stale.lock() = Some(Arc::new(f));
    }

    fn withdraw(&self, deadline: Deadline) {
        let (entry, lease) = {
            let mut st = self.shared.state.lock();
            (st.published.take(), std::mem::take(&mut st.lease))
        };
        self.shared.wake.notify_all();
        if let Some(e) = entry {
            let key = self.shared.key(&e.name);
            let _ = self.shared.call(
                "/v3/kv/deleterange",
                json!({"key": B64.encode(key)}),
                deadline,
            );
        }
        if lease != 0 {
            let _ = self.shared.call(
                "/v3/lease/revoke",
                json!({"ID": lease.to_string()}),
                deadline,
            );
        }
    }
}

impl Shared {
    fn key(&self, name: &str) -> String {
        format!("{}engines/{name}", self.prefix)
    }

    /// POSTs to the first endpoint that answers, starting with the last one that did.
    ///
    /// Each endpoint gets its share of the time left: that time over the endpoints not
    /// yet tried, at least [`ENDPOINT_FLOOR`], the last one all of it. So an endpoint
    /// whose lookup, connection or answer hangs leaves time for the next, instead of
    /// taking the whole deadline.
    fn call(&self, path: &str, body: Value, deadline: Deadline) -> Result<Value> {
        let n = self.endpoints.len();
        let first = self.preferred.load(Ordering::Relaxed);
        let mut failures = Vec::new();
        for i in 0..n {
            let left = deadline.remaining();
            if left.is_zero() {
                break;
            }
            let share = (left / (n - i) as u32).max(ENDPOINT_FLOOR).min(left);
            let at = (first + i) % n;
            let answer = http::post(&self.endpoints[at], path, &body, Deadline::after(share))
                .and_then(|r| r.json());
            match answer {
                Ok(v) => {
                    self.preferred.store(at, Ordering::Relaxed);
                    return Ok(v);
                }
                Err(e) if matches!(e.kind(), ErrorKind::PeerUnreachable | ErrorKind::Timeout) => {
                    failures.push(e.to_string())
                }
                Err(e) => return Err(e),
            }
        }
        let (kind, why) = if deadline.is_past() {
            (
                ErrorKind::Timeout,
                "the deadline passed before one answered",
            )
        } else {
            (ErrorKind::PeerUnreachable, "is etcd running there?")
        };
        if failures.len() < n {
            failures.push(format!("{} not tried", n - failures.len()));
        }
        Err(Error::new(
            kind,
            format!(
                "cannot reach the metadata store etcd://{} ({}); {why}",
                self.endpoints.join(","),
                failures.join("; ")
            ),
        ))
    }

    fn get(&self, name: &str, deadline: Deadline) -> Result<Option<EngineEntry>> {
        let answer = self.call(
            "/v3/kv/range",
            json!({"key": B64.encode(self.key(name))}),
            deadline,
        )?;
        Ok(answer["kvs"]
            .as_array()
            .and_then(|kvs| kvs.first())
            .and_then(decode_entry))
    }

    /// Grants a new lease and puts the published entry under it.
    fn put_with_lease(&self, deadline: Deadline) -> Result<()> {
        let Some(entry) = self.state.lock().published.clone() else {
            return Ok(());
        };
        let ttl = self.ttl.as_secs().max(1);
        let granted = self.call("/v3/lease/grant", json!({"TTL": ttl.to_string()}), deadline)?;
        let lease = int(&granted["ID"]).ok_or_else(|| {
            Error::new(
                ErrorKind::Protocol,
                format!("etcd granted no lease: {granted}"),
            )
        })?;
        let value = serde_json::to_vec(&entry).map_err(|e| {
            Error::new(ErrorKind::Protocol, "cannot encode the entry").with_source(e)
        })?;
        self.call(
            "/v3/kv/put",
            json!({"key": B64.encode(self.key(&entry.name)), "value": B64.encode(value), "lease": lease.to_string()}),
            deadline,
        )?;
        let mut st = self.state.lock();
        if st.published.is_some() {
            st.lease = lease;
        }
        Ok(())
    }

    /// Renews the lease, or publishes anew if etcd no longer knows it.
    fn renew(&self, deadline: Deadline) -> Result<()> {
        let lease = self.state.lock().lease;
        if lease != 0 {
            match self.call(
                "/v3/lease/keepalive",
                json!({"ID": lease.to_string()}),
                deadline,
            ) {
                Ok(v) if int(&v["result"]["TTL"]).is_some_and(|t| t > 0) => return Ok(()),
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::PeerUnreachable => return Err(e),
                Err(_) => {}
            }
        }
        self.put_with_lease(deadline)
    }

    /// Reports a resolved entry that changed or disappeared, and forgets it.
    fn changed(&self, name: &str, now: Option<EngineEntry>) {
        let old = {
            let mut cache = self.cache.lock();
            match cache.get(name) {
                Some((old, _)) if now.as_ref() != Some(old) => cache.remove(name).map(|(e, _)| e),
                _ => None,
            }
        };
        if let Some(old) = old {
            tracing::info!(peer = %old.name, address = %old.address, "metadata: the peer's entry changed or disappeared");
            let f = self.on_stale.lock().clone();
            if let Some(f) = f {
                f(&old);
            }
        }
    }

    /// Checks every resolved entry against the store (after the watch was down).
    fn resync(&self) {
        let names: Vec<String> = self.cache.lock().keys().cloned().collect();
        for name in names {
            if let Ok(now) = self.get(&name, Deadline::after(REQUEST)) {
                self.changed(&name, now);
            }
        }
    }

    /// Applies one message of the watch stream; false once the watch is over.
    fn apply(&self, message: &Value) -> bool {
        let result = &message["result"];
        if result["canceled"].as_bool() == Some(true) {
            return false;
        }
        let prefix = self.key("");
        for ev in result["events"].as_array().into_iter().flatten() {
            let kv = &ev["kv"];
            let Some(key) = kv["key"].as_str().and_then(|k| B64.decode(k).ok()) else {
                continue;
            };
            let key = String::from_utf8_lossy(&key);
            let Some(name) = key.strip_prefix(&prefix) else {
                continue;
            };
            let now = match ev["type"].as_str() {
                Some("DELETE") => None,
                _ => decode_entry(kv),
            };
            self.changed(name, now);
        }
        true
    }

    /// Waits up to `wait` unless stopped; true if stopped.
    fn pause(&self, wait: Duration) -> bool {
        let st = self.state.lock();
        let (st, _) = self.wake.wait_timeout_while(st, wait, |s| !s.stop);
        st.stop
    }
}

/// The keeper thread: renews the lease until the engine withdraws.
fn keep(shared: Arc<Shared>) {
    let period = (shared.ttl / 3).max(Duration::from_millis(100));
    let mut failing = false;
    loop {
        let wait = if failing { period.min(RETRY) } else { period };
        if shared.pause(wait) {
            return;
        }
        if shared.state.lock().published.is_none() {
            return;
        }
        match shared.renew(Deadline::after(period.min(REQUEST))) {
            Ok(()) if failing => {
                tracing::info!("metadata: etcd is back; this engine's entry is published");
                failing = false;
            }
            Ok(()) => {}
            Err(e) => {
                if !failing {
                    tracing::warn!("metadata: cannot renew this engine's entry ({e}); known peers keep working, retrying");
                }
                failing = true;
            }
        }
    }
}

/// The watcher thread: reports resolved entries that change, until stopped.
fn watch(shared: Arc<Shared>) {
    let start = shared.key("");
    let body = json!({"create_request": {
        "key": B64.encode(&start),
        "range_end": B64.encode(range_end(start.as_bytes())),
    }});
    loop {
        let n = shared.endpoints.len();
        let at = shared.preferred.load(Ordering::Relaxed) % n;
        if let Ok(response) = http::post(
            &shared.endpoints[at],
            "/v3/watch",
            &body,
            Deadline::after(REQUEST),
        ) {
            {
                let mut st = shared.state.lock();
                if st.stop {
                    return;
                }
                st.watch = response.socket();
            }
            shared.resync();
            let _ = response.stream(|v| shared.apply(&v));
            shared.state.lock().watch = None;
        } else {
            shared.preferred.store((at + 1) % n, Ordering::Relaxed);
        }
        if shared.pause(RETRY) {
            return;
        }
    }
}

fn decode_entry(kv: &Value) -> Option<EngineEntry> {
    let value = B64.decode(kv["value"].as_str()?).ok()?;
    serde_json::from_slice(&value).ok()
}

/// etcd's 64-bit integers come as strings in JSON.
fn int(v: &Value) -> Option<i64> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

/// The end of the key range that holds every key starting with `prefix`.
fn range_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_range_ends_past_every_key_under_it() {
        assert_eq!(range_end(b"/te/"), b"/te0".to_vec());
        assert_eq!(range_end(b"a\xff"), b"b".to_vec());
        assert_eq!(range_end(b"\xff"), vec![0]);
    }

    #[test]
    fn integers_come_as_strings_or_numbers() {
        assert_eq!(int(&json!("694d77aa9e38260f")), None);
        assert_eq!(
            int(&json!("7587861231286405647")),
            Some(7587861231286405647)
        );
        assert_eq!(int(&json!(10)), Some(10));
        assert_eq!(int(&Value::Null), None);
    }
}
