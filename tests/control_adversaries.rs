//! Peers of the control plane, and metadata stores, that lie, flood, dawdle or go
//! silent, and what the engine must still do: keep its memory bounded, report each
//! peer's own life and end, hold every caller to its own deadline, not trust a stale
//! entry for ever, and serve everyone else.
//!
//! The tests run one at a time (they share the heap counter).

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use ciborium::value::Value;
use common::{engine, kind, serial, Counting, MIB};
use te::{Config, Engine, EngineConfig, PeerEventKind};

#[global_allocator]
static HEAP: Counting = Counting;

/// A raw peer's handshake with an engine that has `token`: hello, welcome, proof,
/// ready. Returns the stream, or the engine's error message.
fn handshake_with_token(
    addr: &str,
    token: &str,
    name: &str,
    epoch: u64,
) -> Result<TcpStream, String> {
    let mut s = common::raw(addr);
    let nonce = vec![7u8; 32]; // what common::hello sends
    s.write_all(&common::frame(
        kind::HELLO,
        0,
        &common::hello(te_core::CONTROL_VERSIONS, name, epoch),
    ))
    .map_err(|e| e.to_string())?;
    let (k, _, p) = common::read_frame(&mut s).map_err(|e| e.to_string())?;
    if k == kind::ERROR {
        return Err(common::error_message(&p));
    }
    assert_eq!(k, kind::WELCOME);
    let theirs = common::field(&p, "nonce")
        .and_then(|v| v.into_bytes().ok())
        .expect("a welcome carries a nonce");
    let proof = te_core::auth::prove(token.as_bytes(), "te-client", &nonce, &theirs);
    let body = common::cbor(vec![("proof", Value::Bytes(proof.to_vec()))]);
    s.write_all(&common::frame(kind::PROOF, 0, &body))
        .map_err(|e| e.to_string())?;
    let (k, _, p) = common::read_frame(&mut s).map_err(|e| e.to_string())?;
    if k == kind::ERROR {
        return Err(common::error_message(&p));
    }
    assert_eq!(k, kind::READY);
    Ok(s)
}

/// Every peer-event the engine is holding, after waiting up to `wait` for the first.
fn events(e: &Engine, wait: Duration) -> Vec<te::PeerEvent> {
    let mut out: Vec<te::PeerEvent> = e.recv_event(wait).into_iter().collect();
    std::thread::sleep(Duration::from_millis(200));
    out.extend(e.try_recv_events());
    out
}

#[test]
fn a_flood_of_short_visits_under_new_names_leaves_no_memory_behind() {
    let _s = serial();
    let target = engine(|_| {});
    let addr = target.address().to_string();
    // Settle the engine's own allocations first.
    drop(common::handshake(&addr, "warm-up", 1).unwrap());
    assert!(common::eventually(Duration::from_secs(5), || target
        .metrics()
        .peers_connected
        == 0));
    let _ = target.try_recv_events();
    let before = common::heap();

    // Each visitor: a hello under a fresh ~3.9 KB name (within the hello's 4 KiB),
    // then goodbye. Nothing about a visitor that has left needs to be kept.
    const VISITS: usize = 4000;
    let start = Instant::now();
    for i in 0..VISITS {
        if start.elapsed() > Duration::from_secs(60) {
            panic!("only {i} visits within 60 s");
        }
        let name = format!("{i:08}-{}", "v".repeat(3900));
        let (mut s, _) = common::handshake(&addr, &name, i as u64 + 1)
            .unwrap_or_else(|e| panic!("visit {i} refused: {e}"));
        s.write_all(&common::frame(kind::BYE, 0, &[])).unwrap();
        // Wait for the server to close its side.
        let _ = common::frames_until_closed(&mut s);
        // Read the events as a user does, so the bounded event queue holds nothing.
        if i % 256 == 0 {
            let _ = target.try_recv_events();
        }
    }
    assert!(
        common::eventually(Duration::from_secs(10), || target.metrics().peers_connected
            == 0),
        "every visitor left"
    );
    let _ = target.try_recv_events();
    std::thread::sleep(Duration::from_millis(300));
    let _ = target.try_recv_events();
    let growth = common::heap_growth(before);
    println!(
        "{VISITS} visits in {:?}: the heap grew {:.2} MiB and stays so",
        start.elapsed(),
        growth as f64 / MIB as f64
    );
    assert!(
        growth < 4 * MIB,
        "{VISITS} visitors that all left keep {:.2} MiB of the engine's heap",
        growth as f64 / MIB as f64
    );
}

#[test]
fn a_peer_claiming_a_live_peers_name_neither_fakes_its_restart_nor_hides_its_departure() {
    let _s = serial();
    let token = "s3cret";
    let with_token = |c: &mut EngineConfig| c.auth_token = Some(token.into());
    let target = engine(with_token);
    let addr = target.address().to_string();
    let prefill = engine(|c| {
        with_token(c);
        c.name = "prefill-0".into();
    });
    let _peer = prefill.connect(&addr).unwrap();
    let real_epoch = prefill.epoch();
    assert!(common::eventually(Duration::from_secs(5), || target
        .metrics()
        .peers_connected
        == 1));
    assert!(target.try_recv_events().is_empty());

    // Another holder of the token says it is prefill-0, in another life, while
    // prefill-0 is up and connected.
    let forger = handshake_with_token(&addr, token, "prefill-0", prefill.epoch() ^ 0x5a5a)
        .expect("the forger's handshake");
    let during = events(&target, Duration::from_millis(500));
    println!("while prefill-0 is up: {during:?}");
    drop(forger);
    let _ = events(&target, Duration::from_millis(300));

    // prefill-0 shuts down: its departure is reported.
    drop(_peer);
    drop(prefill);
    let after = events(&target, Duration::from_secs(3));
    println!("after prefill-0 shut down: {after:?}");
    let fake_restart = during
        .iter()
        .any(|e| e.kind == PeerEventKind::Restarted && e.name == "prefill-0");
    let departure = after.iter().any(|e| {
        e.name == "prefill-0"
            && matches!(e.kind, PeerEventKind::Left | PeerEventKind::Lost)
            && e.epoch == real_epoch
    });
    assert!(
        !fake_restart && departure,
        "a second session claiming prefill-0's name with another epoch, while prefill-0 was \
         connected, was reported as prefill-0 restarting ({fake_restart}), and prefill-0's \
         own departure was {}reported",
        if departure { "" } else { "never " }
    );
}

/// A TCP relay to `to` that holds each new connection `delay` before relaying it.
/// Returns its address; it relays until the process ends.
fn slow_relay(to: String, delay: Duration) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for c in l.incoming().take(64) {
            let Ok(c) = c else { continue };
            let to = to.clone();
            std::thread::spawn(move || {
                std::thread::sleep(delay);
                let Ok(up) = TcpStream::connect(&to) else {
                    return;
                };
                let (mut a, mut b) = (c.try_clone().unwrap(), up.try_clone().unwrap());
                let (mut c2, mut up2) = (c, up);
                let t = std::thread::spawn(move || {
                    let _ = std::io::copy(&mut a, &mut up2);
                    let _ = up2.shutdown(std::net::Shutdown::Write);
                });
                let _ = std::io::copy(&mut b, &mut c2);
                let _ = c2.shutdown(std::net::Shutdown::Write);
                let _ = t.join();
            });
        }
    });
    addr
}

#[test]
fn a_caller_with_a_long_deadline_is_not_failed_by_a_concurrent_callers_short_one() {
    let _s = serial();
    let target = engine(|_| {});
    let _dst = target
        .alloc("dst", 4096, te::Access::REMOTE_READ_WRITE)
        .unwrap();
    // The peer's control plane answers after 400 ms (a loaded or distant peer).
    let relay = slow_relay(target.address().to_string(), Duration::from_millis(400));
    let me = engine(|_| {});
    std::thread::scope(|scope| {
        let hasty = scope.spawn(|| {
            let start = Instant::now();
            let r = me.connect_with(&relay, Duration::from_millis(150));
            (r.map(|_| ()), start.elapsed())
        });
        std::thread::sleep(Duration::from_millis(30));
        let start = Instant::now();
        let patient = me.connect_with(&relay, Duration::from_secs(10));
        let took = start.elapsed();
        let (h, h_took) = hasty.join().unwrap();
        println!("hasty caller (150 ms): {h:?} after {h_took:?}");
        println!(
            "patient caller (10 s): {:?} after {took:?}",
            patient.as_ref().map(|_| ())
        );
        let e = patient.err();
        assert!(
            e.is_none(),
            "a connect given 10 s failed after {took:?}, at the deadline of another caller's \
             connect: {}",
            e.unwrap()
        );
    });
}

fn trickling_store(every: Duration, bound: Duration) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for c in l.incoming().take(8) {
            let Ok(mut c) = c else { continue };
            std::thread::spawn(move || {
                let start = Instant::now();
                // Take the request, as a server would.
                let mut buf = [0u8; 4096];
                c.set_read_timeout(Some(Duration::from_millis(200)))
                    .unwrap();
                let _ = c.read(&mut buf);
                let line = b"HTTP/1.1 200 OK and this line goes on and on and on and on\r\n";
                for b in line.iter().cycle() {
                    if start.elapsed() > bound || c.write_all(&[*b]).is_err() {
                        return;
                    }
                    std::thread::sleep(every);
                }
            });
        }
    });
    addr
}

#[test]
fn a_metadata_store_that_trickles_its_answer_cannot_hold_resolve_past_its_deadline() {
    let _s = serial();
    let store_addr = trickling_store(Duration::from_millis(200), Duration::from_secs(8));
    let mut c = Config::defaults();
    c.engine.metadata = format!("etcd://{store_addr}");
    let store = te_core::metadata::open(&c.engine).unwrap();
    let start = Instant::now();
    let r = store.resolve("decode-0", te_core::Deadline::after(Duration::from_secs(1)));
    let took = start.elapsed();
    println!(
        "resolve with a 1 s deadline: {:?} after {took:?}",
        r.as_ref().map(|_| ())
    );
    assert!(
        took < Duration::from_secs(3),
        "resolve given 1 s returned after {took:?}: a store that sends a byte now and then \
         kept it going"
    );
    assert!(r.is_err());
}

fn b64(data: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in data.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                out.push(T[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A fake etcd gateway: `/v3/kv/range` answers the entry `epoch` names now,
/// `/v3/watch` answers its headers and its "created" message, then says nothing more
/// and never closes (as a partitioned etcd's socket does). Returns its address and
/// the shared epoch.
fn silent_watch_store() -> (String, std::sync::Arc<std::sync::atomic::AtomicU64>) {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let epoch = Arc::new(AtomicU64::new(1));
    let e = epoch.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in l.incoming().take(256) {
            let Ok(mut c) = c else { continue };
            c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let mut req = Vec::new();
            let mut buf = [0u8; 4096];
            // The head, then the body its Content-Length announces.
            let (head, body_len) = loop {
                let Ok(n) = c.read(&mut buf) else {
                    break (String::new(), 0);
                };
                if n == 0 {
                    break (String::new(), 0);
                }
                req.extend_from_slice(&buf[..n]);
                if let Some(end) = req.windows(4).position(|w| w == b"\r\n\r\n") {
                    let head = String::from_utf8_lossy(&req[..end]).to_string();
                    let len = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                        })
                        .unwrap_or(0);
                    while req.len() < end + 4 + len {
                        match c.read(&mut buf) {
                            Ok(n) if n > 0 => req.extend_from_slice(&buf[..n]),
                            _ => break,
                        }
                    }
                    break (head, len);
                }
            };
            let _ = body_len;
            let path = head.split(' ').nth(1).unwrap_or("").to_string();
            if path == "/v3/watch" {
                let created = r#"{"result":{"header":{},"created":true}}"#;
                let _ = write!(
                    c,
                    "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{created}\r\n",
                    created.len()
                );
                held.push(c); // silent from now on, never closed
                continue;
            }
            let body = if path == "/v3/kv/range" {
                let n = e.load(Ordering::SeqCst);
                let entry = serde_json::json!({
                    "name": "decode-0",
                    "epoch": n,
                    "address": format!("127.0.0.1:{}", 40000 + n),
                    "backend": "tcp",
                });
                serde_json::json!({"kvs": [{
                    "key": b64(b"/te/engines/decode-0"),
                    "value": b64(entry.to_string().as_bytes()),
                }]})
                .to_string()
            } else {
                "{}".to_string()
            };
            let _ = write!(
                c,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    (addr, epoch)
}

#[test]
fn a_silent_watch_stream_does_not_make_resolve_trust_a_stale_entry_forever() {
    use std::sync::atomic::Ordering;
    let _s = serial();
    let (store_addr, epoch) = silent_watch_store();
    let mut c = Config::defaults();
    c.engine.metadata = format!("etcd://{store_addr}");
    c.engine.metadata_ttl = Duration::from_secs(2);
    let store = te_core::metadata::open(&c.engine).unwrap();
    let key_prefix = c.engine.metadata_prefix.clone();
    assert_eq!(
        key_prefix, "/te/",
        "the fake store serves /te/engines/decode-0"
    );
    let deadline = || te_core::Deadline::after(Duration::from_secs(2));
    let first = store
        .resolve("decode-0", deadline())
        .unwrap()
        .expect("found");
    assert_eq!(first.epoch, 1);
    // Let the watcher start (and go silent).
    std::thread::sleep(Duration::from_millis(500));
    // decode-0 restarts elsewhere; etcd would say so on the watch, but the watch is
    // silent. A bounded staleness (a few TTLs) is acceptable, forever is not.
    epoch.store(2, Ordering::SeqCst);
    let start = Instant::now();
    let mut seen = first.epoch;
    while start.elapsed() < Duration::from_secs(15) && seen != 2 {
        seen = store
            .resolve("decode-0", deadline())
            .unwrap()
            .expect("found")
            .epoch;
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        seen, 2,
        "15 s (7 metadata TTLs) after decode-0 restarted, resolve still answers its previous \
         life from the cache, trusted while a silent watch stream stays open"
    );
}

#[test]
fn one_senders_flood_of_notifications_does_not_lock_every_other_sender_out() {
    let _s = serial();
    const BUDGET: u64 = 256 << 10;
    let target = engine(|c| {
        c.notification_bytes = BUDGET;
        c.notification_max = 4 << 10;
    });
    let addr = target.address().to_string();
    let epoch = target.epoch();
    // The flooder sends 1 KiB notifications, one at a time, until it is refused.
    let (mut s, _) = common::handshake(&addr, "flooder", 1).unwrap();
    // The flooder sends 1 KiB notifications, one at a time, until it is refused, then
    // empty ones until those are refused too: the inbox is full to the byte.
    let mut acked = 0u64;
    let mut id = 0u64;
    for size in [1024usize, 0] {
        let mut refused = false;
        for _ in 0..20_000 {
            id += 1;
            s.write_all(&common::frame(
                kind::NOTIFY,
                id,
                &common::notice(epoch, &vec![1; size], vec![]),
            ))
            .unwrap();
            let (k, _, _) = common::read_frame(&mut s).unwrap();
            if k != kind::ACK {
                refused = true;
                break;
            }
            acked += 1;
        }
        assert!(refused, "the flooder was never refused");
    }
    println!("the flooder had {acked} notifications accepted");
    // A genuine sender, with its first small notification.
    let me = engine(|c| c.name = "genuine".into());
    let peer = me.connect(&addr).unwrap();
    let r = me.notify(&peer, b"hello".to_vec()).unwrap().wait();
    assert!(
        r.is_ok(),
        "a peer's first 5-byte notification is refused because another sender filled the \
         whole inbox (inbox.rs / engine/mod.rs keep_notification: one budget for all \
         senders, none per sender): {}",
        r.unwrap_err()
    );
}

/// A peer that claims a long heartbeat (its hello says 60 s) and then says nothing is
/// closed after three of the engine's own heartbeats: the peer's claim does not hold a
/// silent session, and its slot, open for minutes.
#[test]
fn a_silent_peer_claiming_a_long_heartbeat_is_closed_after_three_of_ours() {
    let _s = serial();
    let target = engine(|c| c.heartbeat = Duration::from_millis(200));
    let addr = target.address().to_string();
    let (mut s, _) = common::handshake(&addr, "quiet", 7).expect("handshake");
    let start = Instant::now();
    let _ = common::frames_until_closed(&mut s);
    let took = start.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "a silent session was kept {took:?} with the engine's heartbeat at 200 ms"
    );
}

/// The per-sender share of the notification budget always holds one largest
/// notification with what it is charged besides its message (its sender's name and
/// address), even where a quarter of the budget is no more than `notification_max`.
#[test]
fn a_notification_of_notification_max_bytes_fits_an_empty_inbox_whatever_the_share() {
    let _s = serial();
    let target = engine(|c| {
        c.notification_bytes = 64 << 10;
        c.notification_max = 16 << 10;
    });
    let me = engine(|_| {});
    let peer = me.connect(&target.address().to_string()).unwrap();
    let r = me.notify(&peer, vec![7; 16 << 10]).unwrap().wait();
    assert!(
        r.is_ok(),
        "a notification of notification_max bytes, inbox empty: {r:?}"
    );
    let n = target.recv_notification(Duration::from_secs(5)).unwrap();
    assert_eq!(n.message.len(), 16 << 10);
}

/// A connection to `to` from `from`, a loopback address other than 127.0.0.1, so that
/// the engine counts it as another source than the engines of this test.
fn connect_from(from: std::net::Ipv4Addr, to: std::net::SocketAddr) -> TcpStream {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let std::net::SocketAddr::V4(to) = to else {
        panic!("the control plane listens on IPv4 loopback")
    };
    let sockaddr = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: socket(2) takes no pointers; a failure is checked below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is a socket just opened here and owned by nothing else.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let (local, remote) = (sockaddr(from, 0), sockaddr(*to.ip(), to.port()));
    // SAFETY: `local` is a valid sockaddr_in of `len` bytes that outlives the call.
    let r = unsafe {
        libc::bind(
            socket.as_raw_fd(),
            (&local as *const libc::sockaddr_in).cast(),
            len,
        )
    };
    assert_eq!(r, 0, "bind {from}: {}", std::io::Error::last_os_error());
    // SAFETY: `remote` is a valid sockaddr_in of `len` bytes that outlives the call.
    let r = unsafe {
        libc::connect(
            socket.as_raw_fd(),
            (&remote as *const libc::sockaddr_in).cast(),
            len,
        )
    };
    assert_eq!(r, 0, "connect {to}: {}", std::io::Error::last_os_error());
    let s = TcpStream::from(socket);
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// A raw peer's session from `from` to a control plane without a token, with
/// `requests` backend requests sent on it, each claiming an hour to answer and asking
/// the handler to hold it.
fn hold_backend_workers(
    from: std::net::Ipv4Addr,
    to: std::net::SocketAddr,
    requests: u64,
) -> TcpStream {
    let mut s = connect_from(from, to);
    s.write_all(&common::frame(
        kind::HELLO,
        0,
        &common::hello((2, 2), &format!("hog-{from}"), 1),
    ))
    .unwrap();
    for expected in [kind::WELCOME, kind::READY] {
        let (k, _, p) = common::read_frame(&mut s).unwrap();
        assert_eq!(k, expected, "handshake: {}", common::error_message(&p));
    }
    let body = common::cbor(vec![
        ("timeout_ms", common::int(3_600_000)),
        ("payload", Value::Bytes(b"hold".to_vec())),
    ]);
    for id in 1..=requests {
        s.write_all(&common::frame(kind::BACKEND, id, &body))
            .unwrap();
    }
    s
}

/// A backend's message handler: a request starting with `hold` waits until its deadline
/// (or the test's end), anything else is answered at once.
#[derive(Default)]
struct Holder {
    /// Requests held now, and the release at the test's end.
    state: std::sync::Mutex<(usize, bool)>,
    changed: std::sync::Condvar,
    /// The time left of each held request's deadline, as the handler was given it.
    given: std::sync::Mutex<Vec<Duration>>,
}

impl Holder {
    fn held(&self) -> usize {
        self.state.lock().unwrap().0
    }

    fn release(&self) {
        self.state.lock().unwrap().1 = true;
        self.changed.notify_all();
    }
}

impl te::backend::MessageHandler for Holder {
    fn handle(
        &self,
        _from: &te::backend::PeerInfo,
        request: &[u8],
        deadline: te::backend::Deadline,
    ) -> te::Result<Vec<u8>> {
        if !request.starts_with(b"hold") {
            return Ok(b"answer".to_vec());
        }
        self.given.lock().unwrap().push(deadline.remaining());
        let mut st = self.state.lock().unwrap();
        st.0 += 1;
        self.changed.notify_all();
        // Bounded: the test releases it, and the deadline ends it.
        let left = deadline.remaining().min(Duration::from_secs(30));
        let (mut st, _) = self.changed.wait_timeout_while(st, left, |s| !s.1).unwrap();
        st.0 -= 1;
        Err(te::Error::new(
            te::ErrorKind::Timeout,
            "held until the deadline",
        ))
    }
}

/// A control plane serving a [`Holder`], configured by `set`.
fn holding_target(
    set: impl FnOnce(&mut EngineConfig),
) -> (te::backend::StandaloneControl, std::sync::Arc<Holder>) {
    let mut c = EngineConfig::default();
    set(&mut c);
    let control = te::backend::StandaloneControl::start(&c, 7).unwrap();
    let holder = std::sync::Arc::new(Holder::default());
    control.hook().serve(holder.clone()).unwrap();
    (control, holder)
}

/// Two sessions from one source flood slow backend requests (each claims an hour):
/// another peer's backend request is still answered at once, because one source
/// holds at most half of the engine's backend workers.
#[test]
fn one_source_flooding_slow_backend_requests_does_not_hold_every_worker() {
    let _s = serial();
    let (target, holder) = holding_target(|_| {});
    let hogs: Vec<TcpStream> = (0..3)
        .map(|_| hold_backend_workers([127, 0, 0, 2].into(), target.address(), 4))
        .collect();
    assert!(
        common::eventually(Duration::from_secs(5), || holder.held() >= 4),
        "the flood's requests reached the handler"
    );
    std::thread::sleep(Duration::from_millis(200));
    let held = holder.held();
    let me = te::backend::StandaloneControl::start(&EngineConfig::default(), 8).unwrap();
    let start = Instant::now();
    let r = me.hook().call(
        &target.address().to_string(),
        b"hello",
        te::backend::Deadline::after(Duration::from_secs(3)),
    );
    let took = start.elapsed();
    holder.release();
    drop(hogs);
    assert_eq!(
        r.as_deref().ok(),
        Some(&b"answer"[..]),
        "a backend request from a second source, while one source held {held} of the \
         engine's backend workers with slow requests, failed after {took:?}: {:?}",
        r.as_ref().err()
    );
}

/// A backend request's sender cannot make the handler work for it longer than the
/// engine's `handshake_timeout`, however long a deadline it claims.
#[test]
fn a_backend_request_is_served_at_most_handshake_timeout_whatever_deadline_it_claims() {
    let _s = serial();
    let (target, holder) = holding_target(|c| c.handshake_timeout = Duration::from_secs(1));
    let start = Instant::now();
    let mut hog = hold_backend_workers([127, 0, 0, 2].into(), target.address(), 1);
    let answer = common::read_frame(&mut hog);
    let took = start.elapsed();
    holder.release();
    let (k, id, p) = answer.unwrap_or_else(|e| panic!("no answer after {took:?}: {e}"));
    let given = holder.given.lock().unwrap().clone();
    println!("the handler was given {given:?}; answered after {took:?}");
    assert_eq!((k, id), (kind::ERROR, 1), "{}", common::error_message(&p));
    assert!(
        given.len() == 1 && given[0] <= Duration::from_secs(1),
        "a request claiming an hour was handed to the handler with {given:?} left, \
         with handshake_timeout at 1 s"
    );
    assert!(took < Duration::from_secs(3), "answered after {took:?}");
}

/// Every backend worker is held by slow requests from two sources: the engine's own
/// session to a peer named by host name still opens (its lookup does not wait behind
/// them), and a third source's request waits for the next free worker, not for the
/// flood behind it.
#[test]
fn a_flood_of_slow_backend_requests_holds_up_neither_the_engines_lookups_nor_a_third_peer() {
    let _s = serial();
    let (target, holder) = holding_target(|c| c.handshake_timeout = Duration::from_secs(1));
    let hogs: Vec<TcpStream> = [[127, 0, 0, 2], [127, 0, 0, 3]]
        .into_iter()
        .flat_map(|ip| (0..2).map(move |_| ip))
        .map(|ip| hold_backend_workers(ip.into(), target.address(), 8))
        .collect();
    assert!(
        common::eventually(Duration::from_secs(5), || holder.held() >= 8),
        "the flood's requests reached the handler"
    );
    let (other, _) = holding_target(|_| {});
    let by_name = format!("localhost:{}", other.address().port());
    let start = Instant::now();
    let r = target.hook().call(
        &by_name,
        b"hello",
        te::backend::Deadline::after(Duration::from_secs(3)),
    );
    let lookup_took = start.elapsed();
    let me = te::backend::StandaloneControl::start(&EngineConfig::default(), 8).unwrap();
    let start = Instant::now();
    let third = me.hook().call(
        &target.address().to_string(),
        b"hello",
        te::backend::Deadline::after(Duration::from_secs(3)),
    );
    let third_took = start.elapsed();
    holder.release();
    drop(hogs);
    assert_eq!(
        r.as_deref().ok(),
        Some(&b"answer"[..]),
        "the engine's own call to {by_name}, while slow backend requests held every \
         worker, failed after {lookup_took:?}: {:?}",
        r.as_ref().err()
    );
    assert_eq!(
        third.as_deref().ok(),
        Some(&b"answer"[..]),
        "a third source's request, while two sources' slow requests (each held 1 s at \
         most) held every worker, failed after {third_took:?}: {:?}",
        third.as_ref().err()
    );
}

/// `n` Backend frames (ids 1 to `n`) of the largest request a frame carries (1 MiB),
/// whose payload starts "hold" and claims an hour, so that a [`Holder`] holds it.
fn largest_hold_frames(n: u64) -> std::sync::Arc<Vec<Vec<u8>>> {
    let mut payload = b"hold".to_vec();
    payload.resize((1 << 20) - 64, 0x5a);
    let body = common::cbor(vec![
        ("timeout_ms", common::int(3_600_000)),
        ("payload", Value::Bytes(payload)),
    ]);
    assert!(body.len() <= 1 << 20 && body.len() > (1 << 20) - 128);
    std::sync::Arc::new(
        (1..=n)
            .map(|id| common::frame(kind::BACKEND, id, &body))
            .collect(),
    )
}

/// A raw peer's session from `from` to a control plane without a token.
fn session_from(from: std::net::Ipv4Addr, to: std::net::SocketAddr, name: &str) -> TcpStream {
    let mut s = connect_from(from, to);
    s.write_all(&common::frame(
        kind::HELLO,
        0,
        &common::hello((2, 2), name, 1),
    ))
    .unwrap();
    for expected in [kind::WELCOME, kind::READY] {
        let (k, _, p) = common::read_frame(&mut s).unwrap();
        assert_eq!(k, expected, "handshake: {}", common::error_message(&p));
    }
    s
}

/// One source opens many sessions and sends, on each, backend requests of the largest
/// size a frame allows, each claiming an hour and held by the handler: what the engine
/// keeps of them in memory is bounded per source, however many sessions the source
/// opens, the requests past the bound are refused with an error naming it, and another
/// peer's request is answered.
#[test]
fn one_sources_largest_slow_backend_requests_hold_a_bounded_amount_of_memory() {
    let _s = serial();
    // A session whose requests are still held ends a heartbeat after its peer closed it
    // (its last replies may go out until then): 1 s here, well within the wait below.
    let (target, holder) = holding_target(|c| {
        c.handshake_timeout = Duration::from_secs(10);
        c.heartbeat = Duration::from_secs(1);
    });
    const SESSIONS: usize = 8;
    const REQUESTS: u64 = 8;
    let frames = largest_hold_frames(REQUESTS);
    let before = common::reset_peak();
    let hogs: Vec<_> = (0..SESSIONS)
        .map(|i| {
            let frames = frames.clone();
            let to = target.address();
            std::thread::spawn(move || {
                let mut s = session_from([127, 0, 0, 2].into(), to, &format!("hog-{i}"));
                s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
                let mut sent = 0;
                for f in frames.iter() {
                    if s.write_all(f).is_err() {
                        break;
                    }
                    sent += 1;
                }
                (s, sent)
            })
        })
        .collect();
    // What the engine says it holds, sampled while the flood arrives.
    let mut gauge = 0;
    while hogs.iter().any(|t| !t.is_finished()) {
        gauge = gauge.max(target.metrics().control_request_bytes);
        std::thread::sleep(Duration::from_millis(5));
    }
    let hogs: Vec<(TcpStream, usize)> = hogs.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(
        common::eventually(Duration::from_secs(5), || holder.held() >= 4),
        "the flood's requests reached the handler"
    );
    std::thread::sleep(Duration::from_millis(300));
    gauge = gauge.max(target.metrics().control_request_bytes);
    let peak = common::peak_growth(before);
    let sent: Vec<usize> = hogs.iter().map(|h| h.1).collect();
    println!(
        "{SESSIONS} sessions sent {sent:?} requests of 1 MiB; the heap's peak grew {:.1} MiB; \
         the engine held at most {gauge} bytes of them",
        peak as f64 / MIB as f64
    );

    let me = te::backend::StandaloneControl::start(&EngineConfig::default(), 8).unwrap();
    let good = me.hook().call(
        &target.address().to_string(),
        b"hello",
        te::backend::Deadline::after(Duration::from_secs(3)),
    );
    // A session of the flood is told why its requests past the bound were refused.
    let mut hogs: Vec<TcpStream> = hogs.into_iter().map(|h| h.0).collect();
    let mut hog = hogs.pop().unwrap();
    drop(hogs);
    hog.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let refusal = common::read_frame(&mut hog).ok();
    // The source closes every session and opens a new one while its requests are
    // still held: the new session shares the old ones' budget, not a fresh one.
    drop(hog);
    assert!(
        common::eventually(Duration::from_secs(5), || target.metrics().peers_connected
            == 1),
        "the flood's sessions ended: {} peers connected, {} requests held",
        target.metrics().peers_connected,
        holder.held()
    );
    let mut again = session_from([127, 0, 0, 2].into(), target.address(), "hog-again");
    again.write_all(&frames[0]).unwrap();
    again
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let again = common::read_frame(&mut again).map(|(k, _, p)| (k, common::error_message(&p)));
    holder.release();
    assert!(
        gauge > 0 && gauge <= 4 * MIB as u64,
        "the engine's control_request_bytes rose to {gauge} with one source flooding"
    );
    assert!(
        common::eventually(Duration::from_secs(5), || target
            .metrics()
            .control_request_bytes
            == 0),
        "the requests' bytes are given back once they are answered"
    );
    assert!(
        peak < 16 * MIB,
        "one source's {SESSIONS} sessions of slow 1 MiB backend requests grew the engine's heap \
         by {:.1} MiB",
        peak as f64 / MIB as f64
    );
    assert_eq!(
        good.as_deref().ok(),
        Some(&b"answer"[..]),
        "another peer's backend request during the flood: {:?}",
        good.as_ref().err()
    );
    let (k, _, p) = refusal.expect("a refusal for a request past the source's bound");
    let m = common::error_message(&p);
    assert_eq!(k, kind::ERROR, "{m}");
    assert!(m.contains("MiB") && m.contains("127.0.0.2"), "{m}");
    let (k, m) = again.expect("an answer to a request from a new session of the source");
    assert!(
        k == kind::ERROR && m.contains("MiB"),
        "a new session of a source whose earlier sessions' requests are still held got a \
         fresh budget: {m}"
    );
}

/// Many source addresses each send as many of the largest backend requests as one
/// source may have waiting, held by the handler: what the engine holds of them all is
/// bounded too, and the requests past that bound are refused with an error naming it.
#[test]
fn many_sources_largest_slow_backend_requests_hold_a_bounded_amount_of_memory_together() {
    let _s = serial();
    let (target, holder) = holding_target(|c| c.handshake_timeout = Duration::from_secs(10));
    const SOURCES: u8 = 24;
    const REQUESTS: u64 = 4;
    let frames = largest_hold_frames(REQUESTS);
    let floods: Vec<_> = (0..SOURCES)
        .map(|i| {
            let frames = frames.clone();
            let to = target.address();
            std::thread::spawn(move || {
                let mut s = session_from([127, 0, 1, 10 + i].into(), to, &format!("src-{i}"));
                s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
                for f in frames.iter() {
                    if s.write_all(f).is_err() {
                        break;
                    }
                }
                s
            })
        })
        .collect();
    let mut gauge = 0;
    while floods.iter().any(|t| !t.is_finished()) {
        gauge = gauge.max(target.metrics().control_request_bytes);
        std::thread::sleep(Duration::from_millis(5));
    }
    let floods: Vec<TcpStream> = floods.into_iter().map(|t| t.join().unwrap()).collect();
    std::thread::sleep(Duration::from_millis(300));
    gauge = gauge.max(target.metrics().control_request_bytes);
    // The sessions told of requests refused for the engine's bound.
    let mut refusals = Vec::new();
    for mut s in floods {
        s.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        while let Ok((k, _, p)) = common::read_frame(&mut s) {
            if k == kind::ERROR {
                refusals.push(common::error_message(&p));
            }
        }
    }
    holder.release();
    let bound = 64 * MIB as u64;
    assert!(
        gauge > 0 && gauge <= bound,
        "{SOURCES} sources of 4 slow 1 MiB requests each: the engine held {gauge} bytes of \
         them at most"
    );
    assert!(
        refusals
            .iter()
            .any(|m| m.contains("all peers") && m.contains("64 MiB")),
        "no refusal names the engine's bound: {refusals:?}"
    );
}
