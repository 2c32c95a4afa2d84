//! A WRITE torn by a peer that dies mid-payload reaches the target engine's user as a
//! peer event naming the region and the range, with te-tcp built in and loaded as a
//! plugin (the event then crosses the plugin boundary). The peer is a raw socket that
//! speaks te-tcp's handshake and frame header by hand.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use te::{Access, Config, Engine, PeerEventKind, TornRange};

fn tcp_config(plugin_dir: Option<PathBuf>) -> Config {
    let text = "[engine]\nbackend = \"tcp\"\n[backends.tcp]\nslice_size = \"1MiB\"\n";
    let mut c = Config::from_toml(text, "tcp_peer_events.toml", std::path::Path::new("."))
        .expect("valid config");
    c.engine.plugin_dirs = plugin_dir.into_iter().collect();
    c
}

/// The directory cargo puts the workspace's cdylibs in (`target/<profile>`).
fn plugin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>")
        .to_path_buf()
}

/// The data address and instance in te-tcp's endpoint bytes (IPv4; version 2 adds the
/// host's boot id after them).
fn endpoint(b: &[u8]) -> (SocketAddr, u64) {
    assert!(
        matches!(&b[..2], [1 | 2, 4]),
        "a version-1 or version-2 IPv4 endpoint"
    );
    let port = u16::from_le_bytes([b[2], b[3]]);
    let ip = std::net::Ipv4Addr::new(b[4], b[5], b[6], b[7]);
    let instance = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
    (SocketAddr::from((ip, port)), instance)
}

/// Opens a data connection and passes the handshake (no token).
fn raw_peer(addr: SocketAddr, instance: u64) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut hello = [0u8; 48];
    hello[..4].copy_from_slice(b"TETC");
    hello[4..6].copy_from_slice(&3u16.to_le_bytes());
    hello[8..16].copy_from_slice(&instance.to_le_bytes());
    s.write_all(&hello).unwrap();
    let mut challenge_and_terms = [0u8; 44 + 12];
    s.read_exact(&mut challenge_and_terms).unwrap();
    assert_eq!(&challenge_and_terms[6..8], &[0, 0], "the challenge accepts");
    let mut proof = [0u8; 36];
    proof[..4].copy_from_slice(b"TETC");
    s.write_all(&proof).unwrap();
    let mut welcome = [0u8; 40];
    s.read_exact(&mut welcome).unwrap();
    assert_eq!(&welcome[4..6], &[0, 0], "welcomed");
    s
}

fn torn_write_is_a_peer_event(config: Config) {
    let target = Engine::from_config(&config).expect("engine");
    let mem = target
        .alloc("buf", 1 << 20, Access::REMOTE_READ_WRITE)
        .expect("registered memory");
    let region = mem.id();
    let (addr, instance) = endpoint(&target.segment().endpoint);
    let mut s = raw_peer(addr, instance);
    // A WRITE header announcing 64 KiB at offset 4096, then 100 bytes, then death.
    let mut h = [0u8; 40];
    h[0] = 1;
    h[8..16].copy_from_slice(&1u64.to_le_bytes());
    h[16..24].copy_from_slice(&region.0.to_le_bytes());
    h[24..32].copy_from_slice(&4096u64.to_le_bytes());
    h[32..40].copy_from_slice(&(64u64 << 10).to_le_bytes());
    s.write_all(&h).unwrap();
    s.write_all(&[7u8; 100]).unwrap();
    let peer_addr = s.local_addr().unwrap().to_string();
    drop(s);
    let end = Instant::now() + Duration::from_secs(10);
    let event = loop {
        let events = target.try_recv_events();
        if let Some(e) = events
            .into_iter()
            .find(|e| e.kind == PeerEventKind::TornWrite)
        {
            break e;
        }
        assert!(Instant::now() < end, "no torn-write event within 10 s");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        event.torn,
        Some(TornRange {
            region,
            start: 4096,
            end: 4096 + (64 << 10),
        })
    );
    assert_eq!(event.address, peer_addr);
}

#[test]
fn a_write_torn_mid_payload_is_a_peer_event_with_tcp_built_in() {
    torn_write_is_a_peer_event(tcp_config(None));
}

#[test]
fn a_write_torn_mid_payload_is_a_peer_event_with_tcp_loaded_as_a_plugin() {
    let dir = plugin_dir();
    let lib = dir.join(format!("libte_tcp{}", std::env::consts::DLL_SUFFIX));
    assert!(
        lib.exists(),
        "{} is missing: run `cargo build --workspace` before `cargo test`",
        lib.display()
    );
    torn_write_is_a_peer_event(tcp_config(Some(dir)));
}
