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
        &common::hello((2, 2), name, epoch),
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
