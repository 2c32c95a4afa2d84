//! The stub on fake-device memory: a batch's device copies reach the runtime in groups
//! whose copies do not depend on one another, as a GPU runs a group's copies in no order.

use std::path::Path;

use te_core::{Access, Config, Engine, MemoryKind, TransferRequest};

// Link the stub so its registration is in this test's registry.
use te_stub as _;

#[test]
fn a_batch_whose_requests_overlap_on_device_memory_moves_every_byte() {
    let config = Config::from_toml("[backends.stub]\n", "stub-test.toml", Path::new(".")).unwrap();
    let kind: MemoryKind = "fakedev:0".parse().unwrap();
    let target = Engine::from_config(&config).unwrap();
    let initiator = Engine::from_config(&config).unwrap();
    let dst = target
        .alloc_on(&kind, "dst", 8192, Access::REMOTE_READ_WRITE)
        .unwrap();
    let src = initiator
        .alloc_on(&kind, "src", 8192, Access::LOCAL)
        .unwrap();
    let ours: Vec<u8> = (0..8192).map(|i| (i % 251) as u8).collect();
    src.write(0, &ours).unwrap();
    let peer = initiator.connect(&target.address().to_string()).unwrap();
    let remote = peer.region("dst").unwrap().id;
    // Two WRITEs to the same remote bytes, and a READ of bytes the first one writes:
    // the requests of a batch are not ordered, but none may be lost or fail.
    let batch = [
        TransferRequest::write(src.id(), 0, remote, 0, 4096),
        TransferRequest::read(src.id(), 6144, remote, 6144, 2048),
        TransferRequest::write(src.id(), 4096, remote, 4096, 4096),
        TransferRequest::write(src.id(), 4096, remote, 4096, 2048),
    ];
    initiator.transfer(&peer, &batch).unwrap().wait().unwrap();
    let back = dst.to_vec().unwrap();
    assert_eq!(&back[..6144], &ours[..6144]);
    let tail = &src.to_vec().unwrap()[6144..];
    assert!(
        tail == &ours[6144..] || tail.iter().all(|&b| b == 0),
        "the READ saw the bytes before the WRITE or after it, not a mix"
    );
}
