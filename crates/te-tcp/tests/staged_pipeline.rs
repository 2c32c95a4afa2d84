//! The staged path is a pipeline: a batch's frames of device memory are copied while
//! earlier ones are on the socket, on both sides, rather than each waiting for the one
//! before. fakedev here reports each copy group's end `LATENCY` late, as a GPU's event
//! wakes its waiter late while its copy engine goes on, and counts the groups whose end
//! is still unreported: a side that waited for each frame's copy before starting the
//! next would hold one of them at a time (and take a latency per frame; the count, not
//! the time, is checked, so a loaded machine cannot fail it). The fakedev settings hold
//! for this whole process, so this test has its binary to itself.

mod common;

use std::time::Duration;

use common::{assert_scattered, backend_with, requests, run, Pair, BLOCK, BLOCKS, SLICE};
use te_core::Op;

const LATENCY: Duration = Duration::from_millis(40);

#[test]
fn a_staged_batch_keeps_its_frames_copies_in_flight_together() {
    common::fakedev_costs(Duration::ZERO, LATENCY);
    // Staged over the socket on both sides, as to a peer on another host, and on
    // one connection, so that its frames have only each other to overlap with.
    let p = Pair::with(|| {
        backend_with(|c| {
            c.local_copies = false;
            c.connections_per_peer = 1;
        })
    });
    let dev = te_core::device::fakedev::process().expect("fakedev runs here");
    let frames = (BLOCK * BLOCKS / SLICE) as u32;
    assert_eq!(frames, 8);
    for (op, local) in [(Op::Write, 1), (Op::Read, 2)] {
        dev.most_unreported();
        run(&p.init, p.peer, &requests(op, local)).expect("the batch");
        let most = dev.most_unreported();
        // One side's frames at once (the initiator's copies of a WRITE, the target's of
        // a READ, each started as soon as staging memory is free), not one at a time
        // on each side.
        assert!(
            most >= u64::from(frames) / 2,
            "{op:?}: at most {most} copy groups in flight at once"
        );
    }
    assert_scattered(&p.remote.read(), &p.data);
    assert!(p.back.read() == p.data, "the read landed intact");
}
