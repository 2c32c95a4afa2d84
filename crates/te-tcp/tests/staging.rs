//! What staging device memory costs in synchronisations, counted by `fakedev`.
//!
//! This binary holds one test, so nothing else in its process moves `fakedev` bytes
//! while it counts the runtime's synchronisations: the count is exact, not timed.

mod common;

use common::{deregister, requests, run, Pair, BLOCK, BLOCKS, SLICE};
use te_core::Op;

#[test]
fn a_batch_of_small_device_blocks_synchronises_once_per_frame_on_each_side_not_once_per_block() {
    // The target is in this process; without local copies its frames are staged and
    // sent as they would be to another process.
    let Pair {
        target,
        init,
        remote,
        src: _src,
        back,
        data,
        peer,
    } = Pair::new(false);
    let dev =
        te_core::device::fakedev::process().expect("the process's fakedev runtime is running");
    // 4 MiB in frames of 512 KiB: 8 frames of 16 blocks. Each frame is staged by one
    // group of copies at the initiator and one at the target; one synchronisation per
    // block (each side) would be 256.
    let frames = BLOCK * BLOCKS / SLICE;
    let most = 2 * frames;

    let before = dev.syncs();
    run(&init, peer, &requests(Op::Write, 1)).expect("write 128 x 32 KiB");
    let write_syncs = dev.syncs() - before;
    common::assert_scattered(&remote.read(), &data);

    let before = dev.syncs();
    run(&init, peer, &requests(Op::Read, 2)).expect("read 128 x 32 KiB");
    let read_syncs = dev.syncs() - before;
    assert!(back.read() == data, "the blocks read back intact");

    assert!(
        write_syncs <= most,
        "the write synchronised {write_syncs} times, more than {most}"
    );
    assert!(
        read_syncs <= most,
        "the read synchronised {read_syncs} times, more than {most}"
    );
    deregister(&init, &[1, 2]);
    deregister(&target, &[1]);
}
