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
    // Each device has a host-wide name, its PCI address, by which another process
    // (whatever its CUDA_VISIBLE_DEVICES) finds it again.
    for ordinal in 0..rt.device_count().unwrap() {
        let id = rt
            .device_id(ordinal)
            .expect("a CUDA device has a PCI address");
        let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
        let parts: Vec<&str> = id.split([':', '.']).collect();
        assert!(
            parts.len() == 4 && hex(parts[0], 4) && hex(parts[1], 2) && hex(parts[2], 2),
            "cuda:{ordinal} is named `{id}`"
        );
        assert_eq!(rt.ordinal_of(&id), Some(ordinal), "{id}");
    }
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

/// The device memory kind the tests below move: `cuda:0`, or `TE_GPU_MEM` (for
/// example `fakedev:0`, to check the tests themselves on a machine without a GPU).
fn gpu_mem() -> te::MemoryKind {
    std::env::var("TE_GPU_MEM")
        .unwrap_or_else(|_| "cuda:0".into())
        .parse()
        .expect("TE_GPU_MEM names a memory kind")
}

fn tcp_engine(local_copies: bool) -> Engine {
    let mut c = Config::defaults();
    c.engine.backend = "tcp".into();
    let table: te_core::config::Table = format!("local_copies = {local_copies}").parse().unwrap();
    c.backends.insert("tcp".into(), table);
    Engine::from_config(&c).unwrap()
}

fn pattern(len: usize, seed: usize) -> Vec<u8> {
    te_core::testkit::pattern(len, seed as u8)
}

/// 128 scattered blocks each way, every shape the copy groups take: staged over the
/// socket (gathered into pinned frames by one batched call or the gather kernel) and,
/// with `local_copies`, device to device in this process (te's list-copy kernel).
/// Block `i` of the source goes to block `i * 37 mod 128` of the target, so no two
/// copies merge; every byte of both ops is checked, and the bytes around each block
/// stay as they were.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn scattered_device_blocks_move_intact_staged_and_device_to_device() {
    const N: usize = 128;
    for local_copies in [false, true] {
        for block in [4usize << 10, 32 << 10, 1 << 20] {
            let (target, init) = (tcp_engine(local_copies), tcp_engine(local_copies));
            let len = N * block;
            let dst = target
                .alloc_on(&gpu_mem(), "dst", len, Access::REMOTE_READ_WRITE)
                .unwrap();
            let src = init
                .alloc_on(&gpu_mem(), "src", len, Access::LOCAL)
                .unwrap();
            let back = init
                .alloc_on(&gpu_mem(), "back", len, Access::LOCAL)
                .unwrap();
            let data = pattern(len, block);
            let old = pattern(len, 7);
            src.write(0, &data).unwrap();
            dst.write(0, &old).unwrap();
            back.write(0, &old).unwrap();
            let peer = init.connect(&target.address().to_string()).unwrap();
            let rid = peer.region("dst").unwrap().id;
            let b = block as u64;
            // Only the even blocks move, so the odd ones show any stray byte.
            let moved: Vec<usize> = (0..N).filter(|i| i % 2 == 0).collect();
            let writes: Vec<_> = moved
                .iter()
                .map(|&i| {
                    TransferRequest::write(src.id(), i as u64 * b, rid, (i * 37 % N) as u64 * b, b)
                })
                .collect();
            init.transfer(&peer, &writes).unwrap().wait().unwrap();
            let got = dst.to_vec().unwrap();
            for i in 0..N {
                let at = (i * 37 % N) * block;
                let want = if i % 2 == 0 {
                    &data[i * block..][..block]
                } else {
                    &old[at..at + block]
                };
                assert!(
                    &got[at..at + block] == want,
                    "write, local_copies = {local_copies}, {block}-byte block {i}"
                );
            }
            let reads: Vec<_> = moved
                .iter()
                .map(|&i| {
                    TransferRequest::read(
                        back.id(),
                        (i * 53 % N) as u64 * b,
                        rid,
                        (i * 37 % N) as u64 * b,
                        b,
                    )
                })
                .collect();
            init.transfer(&peer, &reads).unwrap().wait().unwrap();
            let got = back.to_vec().unwrap();
            for i in 0..N {
                let at = (i * 53 % N) * block;
                let want = if i % 2 == 0 {
                    &data[i * block..][..block]
                } else {
                    &old[at..at + block]
                };
                assert!(
                    &got[at..at + block] == want,
                    "read, local_copies = {local_copies}, {block}-byte block {i}"
                );
            }
        }
    }
}

/// Host and device memory in one batch, both directions, over the socket: each side
/// stages only its device slices.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn host_and_device_memory_mixed_in_one_batch_move_intact() {
    const N: u64 = 64;
    const B: u64 = 32 << 10;
    let (target, init) = (tcp_engine(false), tcp_engine(false));
    let len = (N * B) as usize;
    let dev_dst = target
        .alloc_on(&gpu_mem(), "dev", len, Access::REMOTE_READ_WRITE)
        .unwrap();
    let host_dst = target
        .alloc_on(
            &te::MemoryKind::Host,
            "host",
            len,
            Access::REMOTE_READ_WRITE,
        )
        .unwrap();
    let dev_src = init
        .alloc_on(&gpu_mem(), "src", len, Access::LOCAL)
        .unwrap();
    let host_src = init
        .alloc_on(&te::MemoryKind::Host, "hsrc", len, Access::LOCAL)
        .unwrap();
    let (from_dev, from_host) = (pattern(len, 1), pattern(len, 2));
    dev_src.write(0, &from_dev).unwrap();
    host_src.write(0, &from_host).unwrap();
    let peer = init.connect(&target.address().to_string()).unwrap();
    let (rd, rh) = (
        peer.region("dev").unwrap().id,
        peer.region("host").unwrap().id,
    );
    // Device → host and host → device, interleaved block by block.
    let reqs: Vec<_> = (0..N)
        .flat_map(|i| {
            [
                TransferRequest::write(dev_src.id(), i * B, rh, (N - 1 - i) * B, B),
                TransferRequest::write(host_src.id(), i * B, rd, (N - 1 - i) * B, B),
            ]
        })
        .collect();
    init.transfer(&peer, &reqs).unwrap().wait().unwrap();
    let (gh, gd) = (host_dst.to_vec().unwrap(), dev_dst.to_vec().unwrap());
    for i in 0..N as usize {
        let (from, at, b) = (
            i * B as usize,
            (N as usize - 1 - i) * B as usize,
            B as usize,
        );
        assert!(
            gh[at..at + b] == from_dev[from..from + b],
            "device → host block {i}"
        );
        assert!(
            gd[at..at + b] == from_host[from..from + b],
            "host → device block {i}"
        );
    }
}

/// KV blocks by random id on device memory, pulled and pushed between two tcp engines
/// of this process (device-to-device groups) and staged over the socket: every byte of
/// every slot checked.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn random_kv_blocks_on_the_device_move_intact() {
    use te::{BlockOptions, KvLayout};
    const LAYERS: usize = 4;
    const BLOCKS: u64 = 64;
    const BPB: u64 = 16 << 10;
    let byte = |s: usize, b: u64, i: u64| (s as u64 * 131 + b * 7 + i).wrapping_mul(29) as u8;
    for local_copies in [true, false] {
        let (target, init) = (tcp_engine(local_copies), tcp_engine(local_copies));
        let slot_bytes = (BLOCKS * BPB) as usize;
        let side = 2 * LAYERS * slot_bytes;
        let remote = target
            .alloc_on(&gpu_mem(), "kv", side, Access::REMOTE_READ_WRITE)
            .unwrap();
        let local = init
            .alloc_on(&gpu_mem(), "kv", side, Access::REMOTE_READ_WRITE)
            .unwrap();
        let all: Vec<u8> = (0..2 * LAYERS)
            .flat_map(|s| (0..BLOCKS).flat_map(move |b| (0..BPB).map(move |i| byte(s, b, i))))
            .collect();
        remote.write(0, &all).unwrap();
        local.write(0, &vec![0u8; side]).unwrap();
        let layout = |id| {
            let regions: Vec<_> = (0..LAYERS).map(|_| (id, id)).collect();
            let mut l = KvLayout::per_layer_kv("m", &regions, BPB, BLOCKS);
            for (g, group) in l.groups.iter_mut().enumerate() {
                for (k, slot) in group.slots.iter_mut().enumerate() {
                    slot.offset = ((2 * g + k) * slot_bytes) as u64;
                }
            }
            l
        };
        target.register_layout(layout(remote.id())).unwrap();
        init.register_layout(layout(local.id())).unwrap();
        let peer = init.connect(&target.address().to_string()).unwrap();
        let remote_ids: Vec<u64> = (0..32).map(|i| i * 37 % BLOCKS).collect();
        let local_ids: Vec<u64> = (0..32).map(|i| i * 29 % BLOCKS).collect();
        init.pull_blocks(
            &peer,
            "m",
            &remote_ids,
            &local_ids,
            &BlockOptions::default(),
        )
        .unwrap()
        .wait()
        .unwrap();
        let got = local.to_vec().unwrap();
        for s in 0..2 * LAYERS {
            for (r, l) in remote_ids.iter().zip(&local_ids) {
                let at = s * slot_bytes + (*l * BPB) as usize;
                let ok = (0..BPB).all(|i| got[at + i as usize] == byte(s, *r, i));
                assert!(
                    ok,
                    "pull, local_copies = {local_copies}: slot {s} block {r} -> {l}"
                );
            }
        }
        // Push the pulled blocks back to other ids: they must equal the originals.
        let push_to: Vec<u64> = (0..32).map(|i| (i * 37 + 1) % BLOCKS).collect();
        init.push_blocks(&peer, "m", &push_to, &local_ids, &BlockOptions::default())
            .unwrap()
            .wait()
            .unwrap();
        let got = remote.to_vec().unwrap();
        for s in 0..2 * LAYERS {
            for (r, t) in remote_ids.iter().zip(&push_to) {
                let at = s * slot_bytes + (*t * BPB) as usize;
                let ok = (0..BPB).all(|i| got[at + i as usize] == byte(s, *r, i));
                assert!(
                    ok,
                    "push, local_copies = {local_copies}: slot {s} block {r} -> {t}"
                );
            }
        }
    }
}

/// The `te` binary under test (`TE_BIN`, as `scripts/gpu-check.sh` sets it).
fn te_bin() -> String {
    std::env::var("TE_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_te").into())
}

/// Starts `te serve --buffer-size 64MiB ARGS...` and returns it with the address it
/// prints first.
fn serve(args: &[&str]) -> (std::process::Child, String) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(te_bin())
        .args(["serve", "--buffer-size", "64MiB"])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("te serve starts");
    let mut addr = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut addr)
        .unwrap();
    (child, addr.trim().to_string())
}

/// Two processes of this host with `cuda:0` memory on both sides: the target (`te
/// serve`) maps the initiator's allocation through its CUDA IPC handle and copies on
/// the GPU; every byte of scattered writes and reads checked.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cuda_memory_moves_between_two_processes_through_ipc() {
    use te_core::TransferBackend;
    let mem = std::env::var("TE_GPU_MEM").unwrap_or_else(|_| "cuda:0".into());
    let (mut child, addr) = serve(&["--backend", "tcp", "--mem", &mem]);
    let e = tcp_engine(true);
    let peer = e.connect(&addr).unwrap();
    let b = te_tcp::TcpBackend::new(
        te_tcp::TcpConfig::default(),
        &te_core::BackendContext::default(),
    )
    .unwrap();
    let id = b
        .connect(
            &peer.segment(),
            te_core::Deadline::after(std::time::Duration::from_secs(10)),
        )
        .unwrap();
    let path = b.peer_path(id).unwrap();
    let remote = peer.region("buffer").unwrap().id;
    for block in [32u64 << 10, 1 << 20] {
        let n = (64 << 20) / block;
        let len = (64 << 20) as usize;
        let src = e.alloc_on(&gpu_mem(), "src", len, Access::LOCAL).unwrap();
        let back = e.alloc_on(&gpu_mem(), "back", len, Access::LOCAL).unwrap();
        let data = pattern(len, block as usize);
        src.write(0, &data).unwrap();
        let writes: Vec<_> = (0..n)
            .map(|i| {
                TransferRequest::write(src.id(), i * block, remote, (i * 37 % n) * block, block)
            })
            .collect();
        e.transfer(&peer, &writes).unwrap().wait().unwrap();
        let reads: Vec<_> = (0..n)
            .map(|i| {
                TransferRequest::read(back.id(), i * block, remote, (i * 37 % n) * block, block)
            })
            .collect();
        e.transfer(&peer, &reads).unwrap().wait().unwrap();
        assert!(
            back.to_vec().unwrap() == data,
            "{block}-byte blocks differ after a write and read between processes"
        );
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        matches!(path, te_tcp::PeerPath::SameHost { .. }),
        "the peer took {path:?}, not the same-host channel"
    );
}

/// Two processes of this host whose `cuda:0` memory comes from `cuMemCreate` (`vmm =
/// true`, as PyTorch's expandable segments allocate): the initiator's allocation goes
/// to the target as a POSIX descriptor, not a legacy IPC handle, and the target copies
/// on the GPU. `te bench --verify` checks every byte of scattered writes and reads, and
/// its device call count shows the initiator staged nothing (the channel took every
/// frame; the socket would stage each through pinned memory).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn vmm_memory_moves_between_two_processes_as_a_descriptor() {
    let dir = std::env::temp_dir().join(format!("te-gpu-vmm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("te.toml");
    std::fs::write(
        &config,
        "[engine]\nbackend = \"tcp\"\n[runtimes.cuda]\nvmm = true\n",
    )
    .unwrap();
    let config = config.to_str().unwrap().to_string();
    let (mut child, addr) = serve(&["--config", &config, "--mem", "cuda:0"]);
    let mut points = Vec::new();
    for (op, block, batch) in [("write", "32KiB", "128"), ("read", "1MiB", "32")] {
        let out = std::process::Command::new(te_bin())
            .args(["bench", "--config", &config, "--target", &addr])
            .args(["--mem", "cuda:0", "--op", op, "--block-size", block])
            .args([
                "--batch",
                batch,
                "--duration",
                "500ms",
                "--verify",
                "--json",
            ])
            .output()
            .expect("te bench runs");
        points.push((op, out));
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    for (op, out) in points {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "te bench --op {op} failed: {}{stdout}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line = stdout.lines().find(|l| l.starts_with('{')).unwrap();
        assert!(
            line.contains("\"device_calls_per_batch\":0.0"),
            "the initiator staged device memory, so the channel did not take the VMM allocation: {line}"
        );
    }
}
