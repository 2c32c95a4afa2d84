//! Device memory: registration asks the device runtime, so a bogus device pointer is an
//! error at `register`, and device buffers move through the runtime's copies.

use te::{Access, Config, Engine, ErrorKind, MemoryDesc, MemoryKind};

/// The stub moves device memory through the runtime's copies.
fn engine() -> Engine {
    let mut c = Config::defaults();
    c.engine.backend = "stub".into();
    Engine::from_config(&c).unwrap()
}

fn desc(kind: &str, addr: u64, len: u64) -> MemoryDesc {
    MemoryDesc {
        name: "d".into(),
        addr,
        len,
        kind: kind.parse().unwrap(),
        access: Access::REMOTE_READ_WRITE,
    }
}

#[test]
fn a_bogus_device_pointer_is_refused_at_register() {
    let e = engine();
    // SAFETY: each registration below is refused before the address is used.
    let r = unsafe { e.register(desc("fakedev:0", 0x1234_0000, 4096)) };
    let err = r.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest);
    assert!(
        err.to_string().contains("not fakedev device memory"),
        "{err}"
    );
}

#[test]
fn a_device_range_must_lie_in_one_allocation_of_the_named_device() {
    let e = engine();
    let buf = e
        .alloc_on(&"fakedev:1".parse().unwrap(), "b", 8192, Access::LOCAL)
        .unwrap();
    let addr = buf.as_ptr() as u64;
    // SAFETY: refused before use.
    let err = unsafe { e.register(desc("fakedev:0", addr, 4096)) }.unwrap_err();
    assert!(err.to_string().contains("belongs to fakedev:1"), "{err}");
    // SAFETY: refused before use.
    let err = unsafe { e.register(desc("fakedev:1", addr + 4096, 8192)) }.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest, "{err}");
    assert!(
        err.to_string()
            .contains("runs past the end of its allocation"),
        "{err}"
    );
    // SAFETY: the range is inside the live allocation `buf` owns, which outlives it.
    let ok = unsafe { e.register(desc("fakedev:1", addr + 4096, 4096)) };
    assert!(ok.is_ok(), "{ok:?}");
}

#[test]
fn an_unknown_device_runtime_is_a_clear_error() {
    let e = engine();
    let err = e
        .alloc_on(
            &MemoryKind::Device {
                runtime: "nosuch".into(),
                ordinal: 0,
            },
            "b",
            64,
            Access::LOCAL,
        )
        .unwrap_err();
    assert!(err.to_string().contains("nosuch"), "{err}");
}

#[test]
fn device_buffers_round_trip_through_the_runtime() {
    let e = engine();
    let buf = e
        .alloc_on(&"fakedev:0".parse().unwrap(), "b", 1 << 20, Access::LOCAL)
        .unwrap();
    let data: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    buf.write(0, &data).unwrap();
    assert_eq!(buf.to_vec().unwrap(), data);
    assert_eq!(
        buf.write(1 << 20, &[1]).unwrap_err().kind(),
        ErrorKind::OutOfBounds
    );
}

#[test]
fn auto_memory_becomes_what_its_owner_says_and_device_memory_named_host_is_refused() {
    let e = engine();
    let dev = e
        .alloc_on(&"fakedev:1".parse().unwrap(), "dev", 8192, Access::LOCAL)
        .unwrap();
    let addr = dev.as_ptr() as u64;
    // SAFETY: refused before use.
    let err = unsafe { e.register(desc("host", addr, 4096)) }.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest, "{err}");
    assert!(
        err.to_string()
            .contains("registered as host memory, but it is memory of fakedev:1"),
        "{err}"
    );
    // SAFETY: the range is inside the live allocation `dev` owns, which outlives it.
    let auto = unsafe { e.register(desc("auto", addr + 4096, 4096)) }.unwrap();
    assert_eq!(auto.region().kind.to_string(), "fakedev:1");
    // Host memory as auto stays host memory.
    let host = vec![7u8; 4096];
    // SAFETY: `host` outlives the registration, which is dropped first.
    let h = unsafe { e.register(desc("auto", host.as_ptr() as u64, 4096)) }.unwrap();
    assert_eq!(h.region().kind, MemoryKind::Host);
    drop(h);
    // `auto` describes existing memory; it allocates nothing.
    let err = e
        .alloc_on(&MemoryKind::Auto, "b", 64, Access::LOCAL)
        .unwrap_err();
    assert!(err.to_string().contains("name `host` or a device"), "{err}");
}

#[test]
fn device_memory_registered_as_auto_moves_like_device_memory() {
    let target = engine();
    let dst = target
        .alloc("dst", 4096, Access::REMOTE_READ_WRITE)
        .unwrap();
    let me = engine();
    let dev = me
        .alloc_on(&"fakedev:0".parse().unwrap(), "dev", 4096, Access::LOCAL)
        .unwrap();
    let data: Vec<u8> = (0..4096).map(|i| (i % 253) as u8).collect();
    dev.write(0, &data).unwrap();
    // A second registration of the same device memory, found by asking.
    // SAFETY: `dev` owns the allocation and outlives this registration.
    let reg = unsafe { me.register(desc("auto", dev.as_ptr() as u64, 4096)) }.unwrap();
    let peer = me.connect(&target.address().to_string()).unwrap();
    let rid = peer.region("dst").unwrap().id;
    me.transfer(
        &peer,
        &[te::TransferRequest::write(reg.id(), 0, rid, 0, 4096)],
    )
    .unwrap()
    .wait()
    .unwrap();
    assert_eq!(dst.to_vec().unwrap(), data);
}
