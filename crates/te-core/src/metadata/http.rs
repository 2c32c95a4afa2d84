//! Just enough HTTP/1.1 to speak JSON to etcd's gateway: one POST per connection,
//! and a chunked response read as a stream of JSON values (for watches).

use crate::signals::SpawnMasked as _;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, ErrorKind, Result};
use crate::sync::{Condvar, Mutex};
use crate::time::Deadline;

/// The largest response body read (etcd's own request limit is 1.5 MiB).
const MAX_BODY: usize = 16 << 20;

fn unreachable(endpoint: &str, what: &str, e: impl std::fmt::Display) -> Error {
    Error::new(
        ErrorKind::PeerUnreachable,
        format!("metadata store at {endpoint}: {what}: {e}"),
    )
}

/// Connects to `endpoint` and sends `POST path` with a JSON body; the response's
/// status line and headers are read, the body is left on the returned reader.
pub(super) fn post(
    endpoint: &str,
    path: &str,
    body: &serde_json::Value,
    deadline: Deadline,
) -> Result<Response> {
    let addrs = resolve(endpoint, deadline)?;
    let mut last = None;
    let mut stream = None;
    for a in addrs {
        let left = deadline.remaining();
        if left.is_zero() {
            break;
        }
        match TcpStream::connect_timeout(&a, left) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = Some(e),
        }
    }
    let Some(mut stream) = stream else {
        return Err(match last {
            Some(e) => unreachable(endpoint, "cannot connect", e),
            None => unreachable(endpoint, "cannot connect", "the deadline passed"),
        });
    };
    let timeout = deadline.remaining().max(Duration::from_millis(1));
    let _ = stream.set_write_timeout(Some(timeout));
    let _ = stream.set_nodelay(true);
    let body = body.to_string();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {endpoint}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream
        .write_all(request.as_bytes())
        .map_err(|e| unreachable(endpoint, "cannot send a request", e))?;
    let mut reader = BufReader::new(Timed {
        stream,
        deadline: Some(deadline),
    });
    let mut line = String::new();
    read_line(&mut reader, &mut line, endpoint)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| protocol(endpoint, format!("not an HTTP status line: {line:?}")))?;
    let mut length = None;
    let mut chunked = false;
    loop {
        line.clear();
        read_line(&mut reader, &mut line, endpoint)?;
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        let (name, value) = header.split_once(':').unwrap_or((header, ""));
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            length = value.parse::<usize>().ok();
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.eq_ignore_ascii_case("chunked");
        }
    }
    Ok(Response {
        endpoint: endpoint.to_string(),
        status,
        length,
        chunked,
        reader,
    })
}

/// The addresses `endpoint` (`host:port`) names, before `deadline`. An IP address is
/// taken as it is; a host name is looked up on a thread of its own, because
/// `getaddrinfo` takes no deadline (a DNS server that drops queries holds it for the
/// resolver's timeouts, 10 s and more).
fn resolve(endpoint: &str, deadline: Deadline) -> Result<Vec<SocketAddr>> {
    if let Ok(a) = endpoint.parse::<SocketAddr>() {
        return Ok(vec![a]);
    }
    resolve_with(endpoint, deadline, |e| {
        e.to_socket_addrs().map(Iterator::collect)
    })
}

/// A name lookup under way, which every caller resolving the same name waits for.
#[derive(Default)]
struct Lookup {
    /// The addresses, or why there are none; `None` until the lookup ends.
    answer: Mutex<Option<std::result::Result<Vec<SocketAddr>, String>>>,
    done: Condvar,
}

/// Lookups under way, by name: callers of one name share one lookup, so a resolver
/// that never answers holds a thread per name (the store's few endpoints), not one per
/// call.
static LOOKUPS: Mutex<BTreeMap<String, Arc<Lookup>>> = Mutex::new(BTreeMap::new());

/// [`resolve`] for a host name, through `lookup`.
fn resolve_with(
    endpoint: &str,
    deadline: Deadline,
    lookup: fn(&str) -> std::io::Result<Vec<SocketAddr>>,
) -> Result<Vec<SocketAddr>> {
    let under_way = {
        let mut lookups = LOOKUPS.lock();
        match lookups.get(endpoint) {
            Some(l) => l.clone(),
            None => {
                let l = Arc::new(Lookup::default());
                let (name, mine) = (endpoint.to_string(), l.clone());
                std::thread::Builder::new()
                    .name("te-etcd-lookup".into())
                    .spawn_masked(move || {
                        let answer = lookup(&name).map_err(|e| e.to_string());
                        *mine.answer.lock() = Some(answer);
                        mine.done.notify_all();
                        let mut lookups = LOOKUPS.lock();
                        if lookups.get(&name).is_some_and(|l| Arc::ptr_eq(l, &mine)) {
                            lookups.remove(&name);
                        }
                    })
                    .map_err(|e| Error::io("resolve", "cannot start a thread", e))?;
                lookups.insert(endpoint.to_string(), l.clone());
                l
            }
        }
    };
    let answer = under_way.answer.lock();
    let (answer, _) = under_way
        .done
        .wait_timeout_while(answer, deadline.remaining(), |a| a.is_none());
    match &*answer {
        Some(Ok(addrs)) => Ok(addrs.clone()),
        Some(Err(e)) => Err(unreachable(endpoint, "cannot resolve", e)),
        None => Err(Error::new(
            ErrorKind::Timeout,
            format!(
                "metadata store at {endpoint}: the deadline passed before its host name resolved \
                 (is the DNS server in /etc/resolv.conf answering?); name the store by IP address \
                 to need no lookup"
            ),
        )),
    }
}

/// A socket whose reads end at a deadline: each read waits only for what is left of
/// it, so a store that trickles its answer a byte at a time cannot stretch a call past
/// its deadline (a read timeout alone applies afresh to every read).
pub(super) struct Timed {
    stream: TcpStream,
    /// `None`: reads wait as long as it takes (a watch stream).
    deadline: Option<Deadline>,
}

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if let Some(deadline) = self.deadline {
            let left = deadline.remaining();
            if left.is_zero() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the deadline passed while the answer was read",
                ));
            }
            self.stream.set_read_timeout(Some(left))?;
        }
        self.stream.read(buf)
    }
}

/// A failed read of an answer: `Timeout` where the deadline ended it.
fn broke(endpoint: &str, e: std::io::Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => Error::new(
            ErrorKind::Timeout,
            format!("metadata store at {endpoint}: the deadline passed before it answered"),
        ),
        _ => unreachable(endpoint, "the connection broke", e),
    }
}

fn protocol(endpoint: &str, what: String) -> Error {
    Error::new(
        ErrorKind::Protocol,
        format!("metadata store at {endpoint}: {what}; is it etcd (3.4 or later)?"),
    )
}

fn read_line(r: &mut impl BufRead, line: &mut String, endpoint: &str) -> Result<()> {
    let n = r
        .by_ref()
        .take(64 << 10)
        .read_line(line)
        .map_err(|e| broke(endpoint, e))?;
    if n == 0 {
        return Err(unreachable(
            endpoint,
            "the connection broke",
            "closed mid-response",
        ));
    }
    Ok(())
}

/// A response whose body is still to be read.
pub(super) struct Response {
    endpoint: String,
    status: u16,
    length: Option<usize>,
    chunked: bool,
    reader: BufReader<Timed>,
}

impl Response {
    /// The whole body as one JSON value; an HTTP error status becomes an error
    /// carrying etcd's message.
    pub(super) fn json(mut self) -> Result<serde_json::Value> {
        let mut body = Vec::new();
        if self.chunked {
            while let Some(chunk) = self.chunk()? {
                body.extend_from_slice(&chunk);
                if body.len() > MAX_BODY {
                    return Err(protocol(&self.endpoint, "response too large".into()));
                }
            }
        } else {
            let limit = self.length.unwrap_or(MAX_BODY).min(MAX_BODY);
            (&mut self.reader)
                .take(limit as u64)
                .read_to_end(&mut body)
                .map_err(|e| broke(&self.endpoint, e))?;
        }
        let value: serde_json::Value = serde_json::from_slice(&body).map_err(|e| {
            protocol(
                &self.endpoint,
                format!("the answer is not JSON ({e}), status {}", self.status),
            )
        })?;
        if self.status != 200 {
            let message = value
                .get("message")
                .or_else(|| value.get("error"))
                .and_then(|m| m.as_str())
                .unwrap_or("no message");
            return Err(Error::new(
                ErrorKind::Protocol,
                format!(
                    "metadata store at {}: HTTP {}: {message}",
                    self.endpoint, self.status
                ),
            ));
        }
        Ok(value)
    }

    /// The next chunk of a chunked body; `None` at its end.
    fn chunk(&mut self) -> Result<Option<Vec<u8>>> {
        let mut line = String::new();
        read_line(&mut self.reader, &mut line, &self.endpoint)?;
        let size = line.trim_end().split(';').next().unwrap_or("");
        let size = usize::from_str_radix(size.trim(), 16)
            .map_err(|_| protocol(&self.endpoint, format!("bad chunk size {line:?}")))?;
        if size > MAX_BODY {
            return Err(protocol(&self.endpoint, "chunk too large".into()));
        }
        let mut chunk = vec![0; size + 2];
        self.reader
            .read_exact(&mut chunk)
            .map_err(|e| broke(&self.endpoint, e))?;
        chunk.truncate(size);
        Ok((size > 0).then_some(chunk))
    }

    /// Calls `f` with each JSON value of a streamed (chunked) body until the stream
    /// ends, breaks, or `f` returns false. Blocks between values; the read timeout is
    /// lifted, so only the stream's end or a shutdown of its socket ends the wait.
    pub(super) fn stream(mut self, mut f: impl FnMut(serde_json::Value) -> bool) -> Result<()> {
        self.reader.get_mut().deadline = None;
        let _ = self.reader.get_ref().stream.set_read_timeout(None);
        if self.status != 200 {
            return self.json().map(drop);
        }
        let mut pending = Vec::new();
        while let Some(chunk) = self.chunk()? {
            pending.extend_from_slice(&chunk);
            let mut values = serde_json::Deserializer::from_slice(&pending).into_iter();
            let mut used = 0;
            loop {
                match values.next() {
                    None => break,
                    Some(Ok(v)) => {
                        used = values.byte_offset();
                        if !f(v) {
                            return Ok(());
                        }
                    }
                    Some(Err(e)) if e.is_eof() => break,
                    Some(Err(e)) => {
                        return Err(protocol(&self.endpoint, format!("bad stream: {e}")))
                    }
                }
            }
            pending.drain(..used);
            if pending.len() > MAX_BODY {
                return Err(protocol(&self.endpoint, "streamed value too large".into()));
            }
        }
        Ok(())
    }

    /// A second handle on the socket, to shut it down from another thread.
    pub(super) fn socket(&self) -> Option<TcpStream> {
        self.reader.get_ref().stream.try_clone().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A resolver that never answers in time (a DNS server that drops every query).
    fn stuck(_: &str) -> std::io::Result<Vec<SocketAddr>> {
        std::thread::sleep(Duration::from_secs(10));
        Err(std::io::Error::other("no answer"))
    }

    #[test]
    fn a_name_whose_lookup_hangs_fails_at_the_callers_deadline() {
        let start = std::time::Instant::now();
        let r = resolve_with(
            "etcd-0.cluster.example:2379",
            Deadline::after(Duration::from_millis(300)),
            stuck,
        );
        let took = start.elapsed();
        let e = r.expect_err("a lookup that never answered");
        assert!(
            took < Duration::from_secs(2),
            "a lookup given 300 ms returned after {took:?}: {e}"
        );
        assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
        assert!(e.to_string().contains("etcd-0.cluster.example"), "{e}");
    }

    static STUCK_CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    fn stuck_counted(name: &str) -> std::io::Result<Vec<SocketAddr>> {
        STUCK_CALLS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        stuck(name)
    }

    #[test]
    fn callers_of_a_name_whose_lookup_hangs_share_one_lookup() {
        for _ in 0..5 {
            let r = resolve_with(
                "etcd-1.cluster.example:2379",
                Deadline::after(Duration::from_millis(50)),
                stuck_counted,
            );
            assert_eq!(r.unwrap_err().kind(), ErrorKind::Timeout);
        }
        assert_eq!(
            STUCK_CALLS.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "five calls while one lookup hangs started more lookups (threads)"
        );
    }

    #[test]
    fn an_ip_address_needs_no_lookup_and_a_lookups_answer_is_used() {
        let d = || Deadline::after(Duration::from_secs(5));
        assert_eq!(
            resolve("127.0.0.1:2379", Deadline::after(Duration::ZERO)).unwrap(),
            vec!["127.0.0.1:2379".parse().unwrap()]
        );
        assert_eq!(
            resolve("[::1]:2379", d()).unwrap(),
            vec!["[::1]:2379".parse().unwrap()]
        );
        let r = resolve_with("etcd-2.cluster.example:2379", d(), |_| {
            Ok(vec!["10.0.0.7:2379".parse().unwrap()])
        });
        assert_eq!(r.unwrap(), vec!["10.0.0.7:2379".parse().unwrap()]);
        let e = resolve_with("etcd-3.cluster.example:2379", d(), |_| {
            Err(std::io::Error::other("no such host"))
        })
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::PeerUnreachable, "{e}");
        assert!(e.to_string().contains("no such host"), "{e}");
    }
}
