//! Hostile peers against an engine's control plane: each is refused with a clear
//! message, the engine's heap stays bounded (counted by this binary's allocator), and
//! a genuine peer is served meanwhile.
//!
//! The tests run one at a time (they share the heap counter).

mod common;

use std::io::Write;
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use ciborium::value::Value;
use common::{engine, kind, serial, Counting, MIB};
use te::{Access, Engine, EngineConfig, ErrorKind, TransferRequest};

#[global_allocator]
static HEAP: Counting = Counting;

/// A genuine peer connects to `target` (within 10 s), writes 4 KiB into its region
/// "dst" and reads it back there.
fn genuine_peer_is_served(target: &Engine, set: impl FnOnce(&mut EngineConfig)) {
    let me = engine(set);
    let src = me.alloc("src", 4096, Access::LOCAL).unwrap();
    src.write(0, &[0x5a; 4096]).unwrap();
    let start = Instant::now();
    let peer = me
        .connect_with(&target.address().to_string(), Duration::from_secs(10))
        .expect("a genuine peer connects");
    let rid = peer.region("dst").expect("the descriptor names dst").id;
    me.transfer(&peer, &[TransferRequest::write(src.id(), 0, rid, 0, 4096)])
        .unwrap()
        .wait()
        .expect("a genuine peer's write completes");
    println!("genuine peer served in {:?}", start.elapsed());
}

fn target_with_dst(set: impl FnOnce(&mut EngineConfig)) -> (Engine, te::Buffer) {
    let t = engine(set);
    let dst = t.alloc("dst", 4096, Access::REMOTE_READ_WRITE).unwrap();
    (t, dst)
}

#[test]
fn a_genuine_peer_is_served_while_two_thousand_idle_sockets_are_held() {
    let _s = serial();
    const IDLE: usize = 2000;
    if let Err(why) = common::raise_nofile(3 * IDLE as u64 + 1024) {
        println!("SKIP: {why}");
        return;
    }
    let (target, dst) = target_with_dst(|_| {});
    let addr = target.address().to_string();
    let before = common::heap();
    let idle: Vec<TcpStream> = (0..IDLE)
        .map(|_| TcpStream::connect(&addr).expect("an idle socket connects"))
        .collect();
    // Let the listener accept (and evict) them all.
    std::thread::sleep(Duration::from_millis(500));
    let growth = common::heap_growth(before);
    println!(
        "{IDLE} idle sockets held: engine heap +{:.2} MiB",
        growth as f64 / MIB as f64
    );
    genuine_peer_is_served(&target, |_| {});
    assert_eq!(dst.to_vec().unwrap(), vec![0x5a; 4096]);
    assert!(
        growth < 8 * MIB,
        "{IDLE} idle sockets grew the heap by {growth} bytes"
    );
    drop(idle);
}

#[test]
fn idle_sockets_against_te_serve_leave_its_memory_bounded() {
    let _s = serial();
    const IDLE: usize = 2000;
    if let Err(why) = common::raise_nofile(2 * IDLE as u64 + 1024) {
        println!("SKIP: {why}");
        return;
    }
    let serve = common::Serve::start(&["--backend", "tcp", "--buffer-size", "1MiB"]);
    let rss_before = serve.rss_kib();
    let idle: Vec<TcpStream> = (0..IDLE)
        .map(|_| TcpStream::connect(&serve.addr).expect("an idle socket connects"))
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let rss_during = serve.rss_kib();
    // A genuine peer still gets the descriptor (over a session of its own).
    let me = engine(|c| c.backend = "tcp".into());
    let peer = me
        .connect_with(&serve.addr, Duration::from_secs(10))
        .expect("a genuine peer connects to te serve");
    assert!(peer.region("buffer").is_some());
    println!(
        "te serve RSS: {rss_before} KiB before, {rss_during} KiB with {IDLE} idle sockets (+{} KiB)",
        rss_during.saturating_sub(rss_before)
    );
    assert!(
        rss_during < rss_before + 64 * 1024,
        "{IDLE} idle sockets grew te serve from {rss_before} to {rss_during} KiB"
    );
    drop(idle);
}

#[test]
fn a_header_announcing_64_mib_is_refused_without_allocating_it() {
    let _s = serial();
    let (target, _dst) = target_with_dst(|_| {});
    let addr = target.address().to_string();
    let before = common::reset_peak();
    let mut refusals = Vec::new();
    for k in [kind::HELLO, kind::SEGMENT, kind::NOTIFY] {
        for _ in 0..4 {
            let mut s = common::raw(&addr);
            s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
            s.write_all(&common::header(k, 64 << 20, 1)).unwrap();
            // The refusal comes at the header, before any of the payload.
            let (k, _, p) = common::read_frame(&mut s).expect("an error frame at once");
            assert_eq!(k, kind::ERROR);
            refusals.push(common::error_message(&p));
            // Bytes as if the payload were coming: none of them may be kept.
            let chunk = vec![0u8; 256 << 10];
            for _ in 0..16 {
                if s.write_all(&chunk).is_err() {
                    break;
                }
            }
            assert!(
                common::frames_until_closed(&mut s).is_empty(),
                "then closed"
            );
        }
    }
    let peak = common::peak_growth(before);
    println!(
        "12 headers announcing 64 MiB: heap peak +{:.2} MiB; {refusals:?}",
        peak as f64 / MIB as f64
    );
    assert!(
        refusals[0].contains("exceeds its 4096-byte limit"),
        "{refusals:?}"
    );
    assert!(
        refusals[4].contains("must start with hello"),
        "{refusals:?}"
    );
    assert!(
        refusals[8].contains("exceeds its 4096-byte limit"),
        "{refusals:?}"
    );
    assert!(peak < 4 * MIB, "the heap peaked {peak} bytes higher");
    genuine_peer_is_served(&target, |_| {});
}

#[test]
fn malformed_frames_and_garbage_are_refused_with_a_reason() {
    let _s = serial();
    let (target, _dst) = target_with_dst(|_| {});
    let addr = target.address().to_string();
    let mut old_format = common::header(kind::HELLO, 0, 0);
    old_format[2] = 1;
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            // Exactly a header's worth, so nothing is left unread at the close.
            b"GET / HTTP/1.1\r\n".to_vec(),
            "not a te control-plane peer",
        ),
        (old_format, "frame format 1"),
        (common::header(200, 0, 0), "unknown message kind 200"),
        (
            common::frame(kind::HELLO, 0, &[0xff; 40]),
            "hello is malformed",
        ),
        (
            common::frame(kind::GET_SEGMENT, 1, &[]),
            "must start with hello",
        ),
        (
            common::frame(kind::HELLO, 0, &common::cbor(vec![("name", Value::Null)])),
            "hello is malformed",
        ),
    ];
    for (bytes, reason) in &cases {
        let mut s = common::raw(&addr);
        s.write_all(bytes).unwrap();
        let start = Instant::now();
        let frames = common::frames_until_closed(&mut s);
        assert!(start.elapsed() < Duration::from_secs(5), "closed at once");
        let (k, _, p) = frames.first().expect("an error frame before the close");
        assert_eq!(*k, kind::ERROR);
        let m = common::error_message(p);
        assert!(m.contains(reason), "expected `{reason}` in `{m}`");
    }
    // Truncated: half a header, half a payload; the connection just ends.
    for bytes in [
        common::header(kind::HELLO, 100, 0)[..9].to_vec(),
        common::frame(kind::HELLO, 0, &common::hello((2, 2), "x", 1))[..40].to_vec(),
    ] {
        let mut s = common::raw(&addr);
        s.write_all(&bytes).unwrap();
        s.shutdown(Shutdown::Write).unwrap();
        let start = Instant::now();
        let frames = common::frames_until_closed(&mut s);
        assert!(start.elapsed() < Duration::from_secs(5), "closed at once");
        assert!(frames.iter().all(|f| f.0 == kind::ERROR), "{frames:?}");
    }
    genuine_peer_is_served(&target, |_| {});
}

/// Sends `notices` pipelined on a raw session and counts the answers: acks, and the
/// messages of the refusals.
fn flood(s: TcpStream, notices: Vec<Vec<u8>>) -> (usize, Vec<String>) {
    let n = notices.len();
    let mut w = s.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        for (i, body) in notices.iter().enumerate() {
            if w.write_all(&common::frame(kind::NOTIFY, i as u64 + 1, body))
                .is_err()
            {
                return;
            }
        }
    });
    let mut s = s;
    let (mut acks, mut refusals) = (0, Vec::new());
    while acks + refusals.len() < n {
        let (k, _, p) = common::read_frame(&mut s).expect("every notification is answered");
        match k {
            kind::ACK => acks += 1,
            kind::ERROR => refusals.push(common::error_message(&p)),
            other => panic!("unexpected frame kind {other}"),
        }
    }
    writer.join().unwrap();
    (acks, refusals)
}

#[test]
fn a_flood_of_notifications_is_refused_past_the_inbox_budget_with_memory_bounded() {
    let _s = serial();
    const BUDGET: u64 = 256 << 10;
    let (target, _dst) = target_with_dst(|c| {
        c.notification_bytes = BUDGET;
        c.notification_max = 4 << 10;
    });
    let addr = target.address().to_string();
    let before = common::reset_peak();
    let (s, _) = common::handshake(&addr, "flooder", 1).unwrap();
    // 1 KiB notifications, then empty ones: the budget counts both.
    let epoch = target.epoch();
    let mut notices: Vec<Vec<u8>> = (0..1000)
        .map(|_| common::notice(epoch, &[1; 1024], vec![]))
        .collect();
    let (big_acks, refusals) = flood(s, std::mem::take(&mut notices));
    assert!(
        big_acks > 0 && big_acks <= (BUDGET / 1024) as usize,
        "{big_acks} acked"
    );
    assert!(
        refusals.iter().all(|m| m.contains("budget")),
        "{:?}",
        refusals.first()
    );
    assert_eq!(big_acks + refusals.len(), 1000);
    let drained = target.try_recv_notifications().len();
    assert_eq!(
        drained, big_acks,
        "every acked notification is in the inbox"
    );

    let (s, _) = common::handshake(&addr, "flooder", 1).unwrap();
    let empties: Vec<Vec<u8>> = (0..20_000)
        .map(|_| common::notice(epoch, &[], vec![]))
        .collect();
    let (empty_acks, refusals) = flood(s, empties);
    let peak = common::peak_growth(before);
    println!(
        "flood: {big_acks}/1000 of 1 KiB and {empty_acks}/20000 empty notifications accepted \
         within a {BUDGET}-byte budget; heap peak +{:.2} MiB",
        peak as f64 / MIB as f64
    );
    assert!(empty_acks > 0 && empty_acks < 20_000, "{empty_acks} acked");
    assert!(refusals.iter().all(|m| m.contains("budget")));
    assert!(peak < 16 * MIB, "the heap peaked {peak} bytes higher");

    // A genuine peer is still served; once the inbox is read, notifications flow again.
    genuine_peer_is_served(&target, |_| {});
    assert_eq!(target.try_recv_notifications().len(), empty_acks);
    let me = engine(|_| {});
    let peer = me.connect(&addr).unwrap();
    me.notify(&peer, b"after the flood".to_vec())
        .unwrap()
        .wait()
        .unwrap();
    let n = target
        .recv_notification(Duration::from_secs(5))
        .expect("the genuine notification arrives");
    assert_eq!(n.message, b"after the flood");
}

#[test]
fn an_oversize_notification_is_refused_by_its_sender_and_the_session_survives() {
    let _s = serial();
    let (target, _dst) = target_with_dst(|c| c.notification_max = 4 << 10);
    let me = engine(|_| {});
    let peer = me.connect(&target.address().to_string()).unwrap();
    let e = me
        .notify(&peer, vec![0; 64 << 10])
        .unwrap()
        .wait()
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Busy, "{e}");
    assert!(
        e.to_string().contains("notification_max (4096 bytes)"),
        "{e}"
    );
    // Just over the limit: the receiver refuses it itself, also with Busy.
    let e = me
        .notify(&peer, vec![0; (4 << 10) + 1])
        .unwrap()
        .wait()
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Busy, "{e}");
    me.notify(&peer, vec![1; 4 << 10]).unwrap().wait().unwrap();
    assert_eq!(
        target
            .recv_notification(Duration::from_secs(5))
            .unwrap()
            .message,
        vec![1; 4 << 10]
    );
    assert!(
        target.try_recv_events().is_empty(),
        "the session was never lost"
    );
}

#[test]
fn without_the_token_a_peer_learns_nothing_and_cannot_fetch_the_descriptor() {
    let _s = serial();
    let token = |t: &'static str| move |c: &mut EngineConfig| c.auth_token = Some(t.into());
    let target = engine(token("s3cret"));
    let _dst = target
        .alloc("secret-region", 4096, Access::REMOTE_READ_WRITE)
        .unwrap();
    let addr = target.address().to_string();

    // A raw peer skips its proof and asks for the descriptor.
    let mut s = common::raw(&addr);
    s.write_all(&common::frame(
        kind::HELLO,
        0,
        &common::hello(te_core::CONTROL_VERSIONS, "mallory", 1),
    ))
    .unwrap();
    s.write_all(&common::frame(kind::GET_SEGMENT, 1, &[]))
        .unwrap();
    let frames = common::frames_until_closed(&mut s);
    let kinds: Vec<u8> = frames.iter().map(|f| f.0).collect();
    assert_eq!(kinds, [kind::WELCOME, kind::ERROR], "then closed");
    let m = common::error_message(&frames[1].2);
    assert!(m.contains("requires an auth_token"), "{m}");
    let all: Vec<u8> = frames.iter().flat_map(|f| f.2.clone()).collect();
    let text = String::from_utf8_lossy(&all);
    assert!(!text.contains("secret-region"), "leaked: {text}");
    assert!(
        !text.contains(&format!("{}", target.epoch())),
        "leaked the epoch"
    );

    for (who, set) in [("no token", None), ("a wrong token", Some("guess"))] {
        let me = engine(|c| c.auth_token = set.map(String::from));
        let e = me
            .connect_with(&addr, Duration::from_secs(5))
            .expect_err(who);
        assert_eq!(e.kind(), ErrorKind::Unauthorized, "{who}: {e}");
        assert!(e.to_string().contains("auth_token"), "{who}: {e}");
    }
    let me = engine(token("s3cret"));
    let peer = me.connect(&addr).expect("the right token connects");
    assert!(peer.region("secret-region").is_some());
}

#[test]
fn a_forged_notification_is_refused_and_the_sender_is_the_authenticated_one() {
    let _s = serial();
    let with_token = |c: &mut EngineConfig| c.auth_token = Some("s3cret".into());
    let target = engine(with_token);
    let addr = target.address().to_string();
    let prefill = engine(|c| {
        with_token(c);
        c.name = "prefill-0".into();
    });
    let peer = prefill.connect(&addr).unwrap();
    prefill
        .notify(&peer, b"real".to_vec())
        .unwrap()
        .wait()
        .unwrap();
    let n = target.recv_notification(Duration::from_secs(5)).unwrap();
    assert_eq!(
        (n.from.as_str(), n.from_epoch, &n.message[..]),
        ("prefill-0", prefill.epoch(), &b"real"[..])
    );

    // A forger with prefill-0's public name and epoch, without the token: it sends the
    // notification instead of a proof, or a made-up proof.
    let forged = common::notice(target.epoch(), b"forged", vec![]);
    for proof in [None, Some(vec![0u8; 32])] {
        let mut s = common::raw(&addr);
        s.write_all(&common::frame(
            kind::HELLO,
            0,
            &common::hello(te_core::CONTROL_VERSIONS, "prefill-0", prefill.epoch()),
        ))
        .unwrap();
        if let Some(p) = &proof {
            let body = common::cbor(vec![("proof", Value::Bytes(p.clone()))]);
            s.write_all(&common::frame(kind::PROOF, 0, &body)).unwrap();
        }
        s.write_all(&common::frame(kind::NOTIFY, 1, &forged))
            .unwrap();
        let frames = common::frames_until_closed(&mut s);
        let last = frames.last().expect("a refusal");
        assert_eq!(last.0, kind::ERROR);
        let m = common::error_message(&last.2);
        let reason = if proof.is_some() {
            "could not prove"
        } else {
            "instead of its proof"
        };
        assert!(m.contains(reason), "{m}");
        assert!(frames.iter().all(|f| f.0 != kind::ACK));
    }
    assert!(
        target
            .recv_notification(Duration::from_millis(300))
            .is_none(),
        "a forged notification was delivered"
    );

    // Without a token anyone may talk, but the sender is who its session says it is:
    // a "from" written into the notice is ignored, and a wrong epoch is refused.
    let open = engine(|_| {});
    let addr = open.address().to_string();
    let (mut s, _) = common::handshake(&addr, "mallory", 9).unwrap();
    let lie = vec![
        ("from", Value::Text("prefill-0".into())),
        ("from_epoch", common::int(prefill.epoch())),
    ];
    s.write_all(&common::frame(
        kind::NOTIFY,
        1,
        &common::notice(open.epoch(), b"hi", lie),
    ))
    .unwrap();
    assert_eq!(common::read_frame(&mut s).unwrap().0, kind::ACK);
    let n = open.recv_notification(Duration::from_secs(5)).unwrap();
    assert_eq!((n.from.as_str(), n.from_epoch), ("mallory", 9));
    s.write_all(&common::frame(
        kind::NOTIFY,
        2,
        &common::notice(open.epoch() ^ 1, b"hi", vec![]),
    ))
    .unwrap();
    let (k, id, p) = common::read_frame(&mut s).unwrap();
    assert_eq!((k, id), (kind::ERROR, 2));
    assert!(common::error_message(&p).contains("restarted"));
}

#[test]
fn a_slowloris_handshake_is_cut_at_the_handshake_timeout() {
    let _s = serial();
    let timeout = Duration::from_millis(500);
    let (target, _dst) = target_with_dst(|c| c.handshake_timeout = timeout);
    let addr = target.address().to_string();
    // Before the connect: the target's deadline starts at its accept, after this.
    let start = Instant::now();
    let mut s = common::raw(&addr);
    let mut w = s.try_clone().unwrap();
    let dribble = std::thread::spawn(move || {
        let hello = common::frame(kind::HELLO, 0, &common::hello((2, 2), "slow", 1));
        for b in hello {
            if w.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    });
    // Served meanwhile.
    genuine_peer_is_served(&target, |_| {});
    let frames = common::frames_until_closed(&mut s);
    let cut = start.elapsed();
    println!("slowloris cut after {cut:?}");
    // The upper bound also covers serving the genuine peer meanwhile.
    assert!(
        cut >= timeout - Duration::from_millis(50) && cut < timeout + Duration::from_secs(5),
        "cut after {cut:?}"
    );
    let (k, _, p) = frames.first().expect("an error frame before the close");
    assert_eq!(*k, kind::ERROR);
    assert!(common::error_message(p).contains("deadline"));
    let _ = s.shutdown(Shutdown::Both);
    dribble.join().unwrap();
}

/// CPU time a process has used (user and system), in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command name, which is in parentheses.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are the 14th and 15th fields of the line, 12th and 13th here.
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

#[test]
fn running_out_of_descriptors_neither_spins_nor_stops_accepting() {
    let _s = serial();
    let serve = common::Serve::start(&["--backend", "tcp", "--buffer-size", "1MiB"]);
    let pid = serve.child.id();
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count() as u64;
    let limit = libc::rlimit {
        rlim_cur: open + 16,
        rlim_max: open + 16,
    };
    // SAFETY: `limit` is a valid rlimit; the old value is not asked for.
    if unsafe {
        libc::prlimit(
            pid as i32,
            libc::RLIMIT_NOFILE,
            &limit,
            std::ptr::null_mut(),
        )
    } != 0
    {
        println!("SKIP: cannot lower te serve's RLIMIT_NOFILE");
        return;
    }
    // More connections than te serve has descriptors for.
    let idle: Vec<TcpStream> = (0..120)
        .map(|_| TcpStream::connect(&serve.addr).expect("an idle socket connects"))
        .collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let (before, start) = (cpu_ticks(pid), Instant::now());
    std::thread::sleep(Duration::from_secs(1));
    let used = (cpu_ticks(pid) - before) as f64 / hz as f64;
    let wall = start.elapsed().as_secs_f64();
    println!(
        "out of descriptors ({} allowed): te serve used {used:.2} s of CPU in {wall:.2} s",
        open + 16
    );
    assert!(used < 0.3 * wall, "the accept loop spins: {used} s of CPU");
    // A genuine peer gets in while the sockets are still held, and after.
    let start = Instant::now();
    let (mut s, _) = common::handshake(&serve.addr, "genuine", 1).expect("served meanwhile");
    s.write_all(&common::frame(kind::GET_SEGMENT, 1, &[]))
        .unwrap();
    assert_eq!(common::read_frame(&mut s).unwrap().0, kind::SEGMENT);
    println!("a genuine peer got the descriptor in {:?}", start.elapsed());
    drop((s, idle));
    let (mut s, _) = common::handshake(&serve.addr, "later", 2).expect("served after");
    s.write_all(&common::frame(kind::GET_SEGMENT, 1, &[]))
        .unwrap();
    assert_eq!(common::read_frame(&mut s).unwrap().0, kind::SEGMENT);
}

/// Every byte string in a decoded CBOR value (a frame's payload), however nested.
fn byte_strings(v: &Value, out: &mut Vec<Vec<u8>>) {
    match v {
        Value::Bytes(b) => out.push(b.clone()),
        Value::Array(a) => a.iter().for_each(|v| byte_strings(v, out)),
        Value::Map(m) => m.iter().for_each(|(k, v)| {
            byte_strings(k, out);
            byte_strings(v, out)
        }),
        Value::Tag(_, v) => byte_strings(v, out),
        _ => {}
    }
}

/// The byte strings of `payload` that a guesser can check a guessed token against:
/// a proof of the guess, for either role, over the two nonces in either order.
fn checkable(payload: &[u8], guess: &str, nonces: [&[u8]; 2]) -> Vec<Vec<u8>> {
    let mut found = Vec::new();
    if let Ok(v) = ciborium::from_reader::<Value, _>(payload) {
        byte_strings(&v, &mut found);
    }
    found.retain(|b| {
        ["te-server", "te-client"].iter().any(|role| {
            [(nonces[0], nonces[1]), (nonces[1], nonces[0])]
                .iter()
                .any(|(a, b2)| te_core::auth::verify(guess.as_bytes(), role, a, b2, b))
        })
    });
    found
}

/// Anyone who reaches the port may send a hello: what the engine answers before the
/// peer proved the token carries nothing a guessed token can be checked against
/// offline (a weak token would fall to a dictionary), and a wrong proof gets nothing
/// either. A peer that proves the token gets the engine's proof in `Ready`.
#[test]
fn a_hello_without_the_token_gets_nothing_to_check_a_guessed_token_against() {
    let _s = serial();
    let token = "s3cret";
    let target = engine(|c| c.auth_token = Some(token.into()));
    let addr = target.address().to_string();
    let versions = te_core::CONTROL_VERSIONS;
    let mine = vec![7u8; 32]; // what common::hello sends
    let hello = |s: &mut TcpStream| {
        s.write_all(&common::frame(
            kind::HELLO,
            0,
            &common::hello(versions, "guesser", 1),
        ))
        .unwrap();
        let (k, _, p) = common::read_frame(s).unwrap();
        assert_eq!(k, kind::WELCOME, "{}", common::error_message(&p));
        let theirs = common::field(&p, "nonce")
            .and_then(|v| v.into_bytes().ok())
            .expect("a welcome carries a nonce");
        (p, theirs)
    };

    // The guesser's first try at the dictionary is the right word.
    let mut s = common::raw(&addr);
    let (welcome, theirs) = hello(&mut s);
    let leaked = checkable(&welcome, token, [&mine, &theirs]);
    assert!(
        leaked.is_empty(),
        "the welcome to a hello from a peer that proved nothing carries {} byte string(s) \
         that verify as a proof of the guessed token: an offline guesser knows it was right",
        leaked.len()
    );
    let wrong = common::cbor(vec![("proof", Value::Bytes(vec![0; 32]))]);
    s.write_all(&common::frame(kind::PROOF, 0, &wrong)).unwrap();
    let after: Vec<u8> = common::frames_until_closed(&mut s)
        .into_iter()
        .flat_map(|f| f.2)
        .collect();
    assert!(checkable(&after, token, [&mine, &theirs]).is_empty());

    // The holder of the token proves it, and then learns the engine's proof.
    let mut s = common::raw(&addr);
    let (_, theirs) = hello(&mut s);
    let proof = te_core::auth::prove(token.as_bytes(), "te-client", &mine, &theirs);
    let body = common::cbor(vec![("proof", Value::Bytes(proof.to_vec()))]);
    s.write_all(&common::frame(kind::PROOF, 0, &body)).unwrap();
    let (k, _, ready) = common::read_frame(&mut s).unwrap();
    assert_eq!(k, kind::READY, "{}", common::error_message(&ready));
    let servers = common::field(&ready, "proof")
        .and_then(|v| v.into_bytes().ok())
        .expect("ready carries the engine's proof");
    assert!(te_core::auth::verify(
        token.as_bytes(),
        "te-server",
        &theirs,
        &mine,
        &servers
    ));
}

/// Control protocol 3 moved the server's proof after the client's. An engine with a
/// token refuses a version-2 hello, naming both versions; a client with a token
/// refuses a version-2 server that proves first, and sends it no proof. Without a
/// token the versions are the same on the wire, and version 2 is still spoken.
#[test]
fn with_a_token_the_previous_protocol_is_refused_by_both_sides_naming_both_versions() {
    let _s = serial();
    let token = |c: &mut EngineConfig| c.auth_token = Some("s3cret".into());
    let target = engine(token);
    let mut s = common::raw(&target.address().to_string());
    s.write_all(&common::frame(
        kind::HELLO,
        0,
        &common::hello((2, 2), "old", 1),
    ))
    .unwrap();
    let frames = common::frames_until_closed(&mut s);
    assert_eq!(frames.len(), 1, "one refusal, then closed");
    let m = common::error_message(&frames[0].2);
    assert_eq!(frames[0].0, kind::ERROR, "{m}");
    assert!(m.contains("version 3") && m.contains("2..=2"), "{m}");

    // A version-2 server with a token: its welcome carries its proof.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let (k, _, _) = common::read_frame(&mut s).unwrap();
        assert_eq!(k, kind::HELLO);
        let welcome = common::cbor(vec![
            ("version", common::int(2)),
            ("nonce", Value::Bytes(vec![1; 32])),
            ("proof", Value::Bytes(vec![2; 32])),
        ]);
        s.write_all(&common::frame(kind::WELCOME, 0, &welcome))
            .unwrap();
        common::frames_until_closed(&mut s)
    });
    let me = engine(token);
    let e = me
        .connect_with(&addr, Duration::from_secs(5))
        .expect_err("a version-2 server with a token is refused");
    assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
    assert!(
        e.to_string().contains("version 2") && e.to_string().contains("version 3"),
        "{e}"
    );
    let after = server.join().unwrap();
    assert!(
        after.is_empty(),
        "the client sent {after:?} after the welcome"
    );

    // Without a token, version 2 is agreed.
    let open = engine(|_| {});
    let (_s, ready) = common::handshake(&open.address().to_string(), "old", 1)
        .expect("a version-2 peer of an engine without a token");
    assert!(common::field(&ready, "proof").is_none());
}

/// A server that takes the client's proof but cannot prove the token back (none in
/// `Ready`, or a wrong one) is refused: the client checks the server's proof before it
/// trusts the session, and sends it no request.
#[test]
fn a_server_that_does_not_prove_the_token_back_is_refused() {
    let _s = serial();
    let me = engine(|c| c.auth_token = Some("s3cret".into()));
    for proof in [None, Some(vec![0u8; 32])] {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let ready_proof = proof.clone();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let (k, _, _) = common::read_frame(&mut s).unwrap();
            assert_eq!(k, kind::HELLO);
            let welcome = common::cbor(vec![
                ("version", common::int(te_core::CONTROL_VERSIONS.1.into())),
                ("nonce", Value::Bytes(vec![1; 32])),
                ("auth", Value::Bool(true)),
            ]);
            s.write_all(&common::frame(kind::WELCOME, 0, &welcome))
                .unwrap();
            let (k, _, _) = common::read_frame(&mut s).unwrap();
            assert_eq!(k, kind::PROOF, "the client proves first");
            let mut ready = vec![
                ("name", Value::Text("impostor".into())),
                ("epoch", common::int(1)),
                ("address", Value::Text("127.0.0.1:9".into())),
                ("heartbeat_ms", common::int(1000)),
            ];
            if let Some(p) = ready_proof {
                ready.push(("proof", Value::Bytes(p)));
            }
            s.write_all(&common::frame(kind::READY, 0, &common::cbor(ready)))
                .unwrap();
            common::frames_until_closed(&mut s)
        });
        let e = me
            .connect_with(&addr, Duration::from_secs(5))
            .expect_err("a server that does not prove the token");
        assert_eq!(e.kind(), ErrorKind::Unauthorized, "{proof:?}: {e}");
        assert!(e.to_string().contains("could not prove"), "{e}");
        let after = server.join().unwrap();
        assert!(
            after.iter().all(|f| f.0 != kind::GET_SEGMENT),
            "the client asked an unproven server for its descriptor"
        );
    }
}
