//! An engine closed while its registrations live: its close deregisters them, its
//! backend stops (te-tcp's data listener closes), no peer's request lands afterwards,
//! and each registration's own deregistration then reports success.

use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use te::{Access, Config, Engine, MemoryDesc, MemoryKind, TransferOptions, TransferRequest};

fn config(backend: &str) -> Config {
    let text = format!("[engine]\nbackend = \"{backend}\"\n");
    Config::from_toml(&text, "engine_close.toml", std::path::Path::new(".")).expect("config")
}

/// te-tcp's data address in its endpoint bytes (IPv4).
fn data_address(b: &[u8]) -> SocketAddr {
    assert!(matches!(&b[..2], [1 | 2, 4]), "an IPv4 tcp endpoint");
    let port = u16::from_le_bytes([b[2], b[3]]);
    SocketAddr::from((std::net::Ipv4Addr::new(b[4], b[5], b[6], b[7]), port))
}

fn closed_with_live_registrations(backend: &str) {
    let target = Engine::from_config(&config(backend)).expect("target engine");
    let mut memory = vec![0u8; 4096];
    // SAFETY: `memory` outlives the registration, which is deregistered below.
    let reg = unsafe {
        target.register(MemoryDesc {
            name: "user".into(),
            addr: memory.as_mut_ptr() as u64,
            len: memory.len() as u64,
            kind: MemoryKind::Host,
            access: Access::REMOTE_READ_WRITE,
        })
    }
    .expect("registered");
    let buffer = target
        .alloc("own", 4096, Access::REMOTE_READ_WRITE)
        .expect("te's own buffer");
    let data = target.segment().endpoint;

    let initiator = Engine::from_config(&config(backend)).expect("initiator engine");
    let src = initiator
        .alloc("src", 4096, Access::LOCAL)
        .expect("initiator buffer");
    src.write(0, &[7u8; 4096]).unwrap();
    let peer = initiator
        .connect(&target.address().to_string())
        .expect("connect");
    let write = [
        TransferRequest::write(src.id(), 0, reg.id(), 0, 4096),
        TransferRequest::write(src.id(), 0, buffer.id(), 0, 4096),
    ];
    initiator
        .transfer(&peer, &write)
        .expect("submitted")
        .wait()
        .expect("the write before the close lands");
    assert_eq!(memory, vec![7u8; 4096]);
    memory.fill(0);

    drop(target);
    if backend == "tcp" {
        let refused = TcpStream::connect_timeout(&data_address(&data), Duration::from_secs(2));
        assert!(
            refused.is_err(),
            "the closed engine's data listener still accepts connections"
        );
    }
    src.write(0, &[9u8; 4096]).unwrap();
    let options = TransferOptions {
        timeout: Some(Duration::from_secs(5)),
        ..Default::default()
    };
    let after = initiator
        .transfer_with(&peer, &write[..1], &options)
        .and_then(|h| h.wait());
    assert!(after.is_err(), "a write to a closed engine succeeded");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        memory,
        vec![0u8; 4096],
        "a byte landed after the engine closed"
    );
    reg.deregister()
        .expect("the engine's close deregistered the region, and the registration says so");
    drop(buffer);
}

#[test]
fn a_tcp_engine_closed_with_live_registrations_stops_serving_them() {
    closed_with_live_registrations("tcp");
}

#[test]
fn a_stub_engine_closed_with_live_registrations_stops_serving_them() {
    closed_with_live_registrations("stub");
}
