//! Where the kernel refuses cross-memory attach, a same-host peer still gets its channel
//! for device memory and host memory goes over the socket. This process makes itself
//! non-dumpable and runs `te serve` without `CAP_SYS_PTRACE`, so the target may not
//! reach this process's memory (as between two users, or under Yama's ptrace scope).
//! One test in this binary: the process-wide setting would leak into others.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use te::{Access, Config, Engine, TransferRequest};
use te_core::TransferBackend;
use te_tcp::{PeerPath, TcpBackend, TcpConfig};

#[test]
fn without_cross_memory_attach_host_memory_goes_over_the_socket_and_arrives() {
    if Command::new("setpriv").arg("--version").output().is_err() {
        eprintln!("skipped: setpriv (util-linux) is not installed");
        return;
    }
    // SAFETY: plain prctl call with valid arguments.
    assert_eq!(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) }, 0);
    let mut child = Command::new("setpriv")
        .args(["--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace", "--"])
        .arg(env!("CARGO_BIN_EXE_te"))
        .args([
            "serve",
            "--backend",
            "tcp",
            "--buffer-size",
            "4MiB",
            "--mem",
            "host",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("te serve starts");
    let mut addr = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut addr)
        .unwrap();
    let c = Config::from_toml(
        "[engine]\nbackend = \"tcp\"\n",
        "no_cma.toml",
        std::path::Path::new("."),
    )
    .unwrap();
    let e = Engine::from_config(&c).unwrap();
    let peer = e.connect(addr.trim()).unwrap();
    let b = TcpBackend::new(TcpConfig::default(), &te_core::BackendContext::default()).unwrap();
    let id = b
        .connect(
            &peer.segment(),
            te_core::Deadline::after(Duration::from_secs(10)),
        )
        .unwrap();
    let path = b.peer_path(id).unwrap();
    let src = e.alloc("src", 4 << 20, Access::LOCAL).unwrap();
    let back = e.alloc("back", 4 << 20, Access::LOCAL).unwrap();
    let data: Vec<u8> = (0..4u32 << 20).map(|i| (i % 253) as u8).collect();
    src.write(0, &data).unwrap();
    let remote = peer.region("buffer").unwrap().id;
    let w = TransferRequest::write(src.id(), 0, remote, 0, 4 << 20);
    e.transfer(&peer, &[w]).unwrap().wait().unwrap();
    let r = TransferRequest::read(back.id(), 0, remote, 0, 4 << 20);
    e.transfer(&peer, &[r]).unwrap().wait().unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(
        path,
        PeerPath::SameHost {
            cross_memory_attach: false
        }
    );
    assert!(back.to_vec().unwrap() == data, "bytes read back differ");
}
