//! Tests that need an NVIDIA GPU and driver. They are ignored by default; on a GPU
//! machine run them with:
//!
//! ```sh
//! cargo test --test gpu -- --ignored --nocapture
//! ```

use te::{Access, Config, Engine, ErrorKind, MemoryDesc, TransferRequest};

fn cuda0() -> te::MemoryKind {
    "cuda:0".parse().unwrap()
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cuda_buffers_round_trip_and_bogus_pointers_are_refused() {
    let rt = te_core::device::runtime("cuda").expect("the cuda runtime is available");
    assert!(rt.device_count().unwrap() >= 1);
    let e = Engine::from_config(&Config::defaults()).unwrap();
    let buf = e
        .alloc_on(&cuda0(), "gpu", 8 << 20, Access::REMOTE_READ_WRITE)
        .unwrap();
    let data: Vec<u8> = (0..8 << 20).map(|i| (i % 253) as u8).collect();
    buf.write(0, &data).unwrap();
    assert_eq!(buf.to_vec().unwrap(), data);
    let info = rt.pointer_info(buf.as_ptr() as u64 + 4096).unwrap();
    assert_eq!((info.ordinal, info.base), (0, buf.as_ptr() as u64));
    let host = vec![0u8; 4096];
    let desc = MemoryDesc {
        name: "x".into(),
        addr: host.as_ptr() as u64,
        len: 4096,
        kind: cuda0(),
        access: Access::LOCAL,
    };
    // SAFETY: refused before use: host memory is not CUDA device memory.
    let err = unsafe { e.register(desc) }.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidRequest, "{err}");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cuda_memory_moves_between_engines_with_every_byte_verified() {
    let config = Config::defaults();
    let target = Engine::from_config(&config).unwrap();
    let initiator = Engine::from_config(&config).unwrap();
    let len = 64 << 20;
    let dst = target
        .alloc_on(&cuda0(), "dst", len, Access::REMOTE_READ_WRITE)
        .unwrap();
    let src = initiator
        .alloc_on(&cuda0(), "src", len, Access::LOCAL)
        .unwrap();
    let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    src.write(0, &data).unwrap();
    let peer = initiator.connect(&target.address().to_string()).unwrap();
    let rid = peer.region("dst").unwrap().id;
    let reqs: Vec<_> = (0..64u64)
        .map(|i| TransferRequest::write(src.id(), i << 20, rid, i << 20, 1 << 20))
        .collect();
    initiator.transfer(&peer, &reqs).unwrap().wait().unwrap();
    assert!(
        dst.to_vec().unwrap() == data,
        "bytes differ after a cuda:0 -> cuda:0 write"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cuda_memory_moves_over_tcp_both_ways_with_every_byte_verified() {
    // Two engines on the tcp backend, cuda:0 memory on both sides, staged through
    // pinned host buffers: a WRITE then a READ back, every byte checked.
    let mut config = Config::defaults();
    config.engine.backend = "tcp".into();
    let target = Engine::from_config(&config).unwrap();
    let initiator = Engine::from_config(&config).unwrap();
    let len = 64 << 20;
    let dst = target
        .alloc_on(&cuda0(), "dst", len, Access::REMOTE_READ_WRITE)
        .unwrap();
    let src = initiator
        .alloc_on(&cuda0(), "src", len, Access::LOCAL)
        .unwrap();
    let back = initiator
        .alloc_on(&cuda0(), "back", len, Access::LOCAL)
        .unwrap();
    let data: Vec<u8> = (0..len).map(|i| (i * 13 % 251) as u8).collect();
    src.write(0, &data).unwrap();
    let peer = initiator.connect(&target.address().to_string()).unwrap();
    let rid = peer.region("dst").unwrap().id;
    let writes: Vec<_> = (0..64u64)
        .map(|i| TransferRequest::write(src.id(), i << 20, rid, i << 20, 1 << 20))
        .collect();
    initiator.transfer(&peer, &writes).unwrap().wait().unwrap();
    assert!(
        dst.to_vec().unwrap() == data,
        "bytes differ after a cuda:0 -> cuda:0 write over tcp"
    );
    let reads: Vec<_> = (0..64u64)
        .map(|i| TransferRequest::read(back.id(), i << 20, rid, i << 20, 1 << 20))
        .collect();
    initiator.transfer(&peer, &reads).unwrap().wait().unwrap();
    assert!(
        back.to_vec().unwrap() == data,
        "bytes differ after a cuda:0 <- cuda:0 read over tcp"
    );
}
