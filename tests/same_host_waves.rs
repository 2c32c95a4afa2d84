//! Two processes of this host on the tcp backend, device memory on the same-host
//! channel: requests of one batch whose ranges overlap one another (on the target, or
//! on the initiator) never share a device group in the target, whose copies a
//! list-copy kernel runs at once, and take effect in the batch's order; a batch
//! without such overlaps is still one group. This test is the initiator; the target is
//! this binary again (its ignored test `waves_target`, started with `TE_WAVES_TARGET`
//! set), with `listcopy` (`crates/te-tcp/tests/common/listcopy.rs`): a runtime over
//! fakedev that counts groups whose copies overlap and runs each group's copies last
//! to first. The target says what it counted when asked on its stdin.

#[path = "../crates/te-tcp/tests/common/listcopy.rs"]
mod listcopy;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use te::{Access, Config, Engine, Peer, TransferRequest};
use te_core::device::DeviceRuntime;

const BLOCK: u64 = 4096;
const BLOCKS: u64 = 16;
const LEN: usize = (BLOCK * BLOCKS) as usize;
/// Set in the target process's environment.
const CHILD: &str = "TE_WAVES_TARGET";

fn engine() -> Engine {
    let text = "[engine]\nbackend = \"tcp\"\ndefault_timeout = \"30s\"\n";
    let c = Config::from_toml(text, "same_host_waves.toml", std::path::Path::new(".")).unwrap();
    Engine::from_config(&c).expect("engine")
}

fn kind() -> te::MemoryKind {
    format!("{}:0", listcopy::NAME).parse().unwrap()
}

/// The target process: an engine with a `buffer` of `listcopy` memory; prints its
/// address, then the groups its runtime counted for each line read, until its stdin
/// closes (or a minute has passed).
#[test]
#[ignore = "the target process of the test below, which starts it"]
fn waves_target() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(60));
        std::process::exit(2);
    });
    let e = engine();
    let _buffer = e
        .alloc_on(&kind(), "buffer", LEN, Access::REMOTE_READ_WRITE)
        .unwrap();
    println!("address {}", e.address());
    for line in std::io::stdin().lock().lines() {
        if line.is_err() {
            break;
        }
        let (groups, overlapping) = listcopy::groups();
        println!("groups {groups} {overlapping}");
    }
}

/// The target process, killed when dropped.
struct Target {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Target {
    fn start() -> (Target, String) {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "waves_target", "--ignored", "--nocapture"])
            .env(CHILD, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("the target starts");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut t = Target {
            child,
            stdin,
            stdout,
        };
        let addr = t.line("address ");
        (t, addr)
    }

    /// The rest of the target's next line that starts with `prefix` (libtest prints
    /// its own lines around ours).
    fn line(&mut self, prefix: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).unwrap();
            assert!(n > 0, "the target ended before it printed {prefix:?}");
            if let Some(rest) = line.trim().strip_prefix(prefix) {
                return rest.to_string();
            }
        }
    }

    /// The device-to-device groups the target started so far, and those of them with
    /// overlapping copies.
    fn groups(&mut self) -> (u64, u64) {
        writeln!(self.stdin).unwrap();
        let counts = self.line("groups ");
        let (g, o) = counts.split_once(' ').unwrap();
        (g.parse().unwrap(), o.parse().unwrap())
    }
}

/// A move of blocks: (from block, to block, blocks). A WRITE moves from the initiator's
/// memory to the target's buffer, a READ from the buffer to the initiator's memory.
type Move = (u64, u64, u64);

/// The bytes of `into` once `moves` ran one after another, copying from `from`.
fn in_order(from: &[u8], into: &[u8], moves: &[Move]) -> Vec<u8> {
    let mut v = into.to_vec();
    for &(f, t, n) in moves {
        let (f, t, n) = (
            (f * BLOCK) as usize,
            (t * BLOCK) as usize,
            (n * BLOCK) as usize,
        );
        v[t..t + n].copy_from_slice(&from[f..f + n]);
    }
    v
}

/// Moves `moves` as one batch of `write`s (or reads) between `mine` and the peer's
/// buffer.
fn transfer(e: &Engine, peer: &Peer, mine: &te::Buffer, write: bool, moves: &[Move]) {
    let remote = peer.region("buffer").unwrap().id;
    let reqs: Vec<TransferRequest> = moves
        .iter()
        .map(|&(f, t, n)| match write {
            true => TransferRequest::write(mine.id(), f * BLOCK, remote, t * BLOCK, n * BLOCK),
            false => TransferRequest::read(mine.id(), t * BLOCK, remote, f * BLOCK, n * BLOCK),
        })
        .collect();
    e.transfer(peer, &reqs).unwrap().wait().unwrap();
}

#[test]
fn requests_that_overlap_one_another_never_share_a_device_group_in_the_target() {
    let (mut target, addr) = Target::start();
    let e = engine();
    let mine = e.alloc_on(&kind(), "mine", LEN, Access::LOCAL).unwrap();
    let peer = e.connect(&addr).unwrap();
    // Until the target has mapped `mine`, its frames take the socket: staged here.
    let dev = te_core::device::fakedev::process().expect("fakedev");
    for i in 0.. {
        assert!(i < 100, "the target never took the channel");
        let before = dev.stats();
        transfer(&e, &peer, &mine, true, &[(0, 0, 1)]);
        if dev.stats().since(&before).copies == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }

    // Each case: (WRITE, moves); the first two write one block twice, on the target's
    // side, then on this one's.
    let mut cases: Vec<(bool, Vec<Move>)> = vec![
        (true, vec![(0, 5, 2), (3, 6, 2)]),
        (false, vec![(5, 0, 2), (8, 1, 2)]),
    ];
    // Random moves of 1 to 3 blocks, from a fixed seed.
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |m: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % m
    };
    for k in 0..16 {
        let moves = (0..12)
            .map(|_| {
                let n = 1 + next(3);
                (next(BLOCKS - n + 1), next(BLOCKS - n + 1), n)
            })
            .collect();
        cases.push((k % 2 == 0, moves));
    }
    for (k, (write, moves)) in cases.iter().enumerate() {
        let (was, ours) = (
            te_core::testkit::pattern(LEN, k as u8),
            te_core::testkit::pattern(LEN, k as u8 ^ 0x5a),
        );
        // The target's buffer holds `was`, written whole; this memory `ours`.
        mine.write(0, &was).unwrap();
        transfer(&e, &peer, &mine, true, &[(0, 0, BLOCKS)]);
        mine.write(0, &ours).unwrap();
        transfer(&e, &peer, &mine, *write, moves);
        assert_eq!(
            target.groups().1,
            0,
            "case {k} ({moves:?}): no device group held copies that overlap"
        );
        let ok = if *write {
            transfer(&e, &peer, &mine, false, &[(0, 0, BLOCKS)]);
            mine.to_vec().unwrap() == in_order(&ours, &was, moves)
        } else {
            mine.to_vec().unwrap() == in_order(&was, &ours, moves)
        };
        assert!(
            ok,
            "case {k} ({moves:?}): the requests took effect in order"
        );
    }

    // Requests apart from one another are one group.
    for write in [true, false] {
        let before = target.groups().0;
        transfer(
            &e,
            &peer,
            &mine,
            write,
            &[(0, 8, 2), (2, 10, 2), (5, 13, 3)],
        );
        assert_eq!(target.groups().0 - before, 1, "one group");
    }
}
