//! te-rdma's connect through the FAKE verbs provider: what two backends agree on
//! (RoCE version, READ depth, QPs per path), when a connect to a silent control plane
//! gives up, and the epoch a backend names itself with.
//!
//! Run as `cargo test -p te-rdma --test fake_connect`.

mod common;

use std::time::{Duration, Instant};

use common::{
    backend, backend_with, check, host, node, node_with, pattern, region, run, segment, segment_at,
    soon, Fake,
};
use libtest_mimic::Failed;
use te_core::{Access, Deadline, ErrorKind, RegionId, TransferBackend, TransferRequest};
use te_rdma::{RdmaBackend, RdmaConfig};

fn a_peer_with_only_roce_v1_and_fewer_read_slots_is_reached_over_v1_with_a_capped_read_depth(
) -> Result<(), Failed> {
    let fake = Fake::open();
    // fakev1 offers RoCE v1 only and serves 4 READs at once; fake0 offers v1 and v2
    // and would issue 16. The fake drops requests of a mismatched GID type, and of a
    // requester whose read depth exceeds what the responder serves.
    let target = backend(&["fakev1"]);
    let src = pattern(1 << 20, 5);
    let key = target.register(RegionId(1), &host(&src, Access::REMOTE_READ))?;
    let initiator = backend(&["fake0"]);
    let dst = vec![0u8; 1 << 20];
    initiator.register(RegionId(1), &host(&dst, Access::LOCAL))?;
    let peer = initiator.connect(&segment(&target, vec![region(1, &src, key)]), soon())?;
    let req = TransferRequest::read(RegionId(1), 0, RegionId(1), 0, dst.len() as u64);
    run(&initiator, peer, &[req], &fake).0?;
    check(dst == src, "the READ did not land".into())
}

fn a_request_for_more_qps_than_the_cap_is_refused_with_the_reason() -> Result<(), Failed> {
    let target = backend_with(&["fake0"], 1);
    let initiator = backend_with(&["fake0"], 4);
    match initiator.connect(&segment(&target, Vec::new()), soon()) {
        Err(e)
            if e.kind() == ErrorKind::InvalidRequest && e.to_string().contains("qps_per_path") =>
        {
            Ok(())
        }
        other => Err(format!("expected a refusal naming qps_per_path, got {other:?}").into()),
    }
}

fn connect_ends_at_the_callers_deadline_or_at_connect_timeout_whichever_is_sooner(
) -> Result<(), Failed> {
    let target = backend(&["fake0"]);
    // A control plane that accepts connections (the kernel does) and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0")?;
    let seg = segment_at(
        target.endpoint(),
        silent.local_addr()?.to_string(),
        Vec::new(),
    );

    let initiator = backend(&["fake0"]);
    let start = Instant::now();
    let r = initiator.connect(&seg, Deadline::after(Duration::from_millis(300)));
    let took = start.elapsed();
    check(
        matches!(&r, Err(e) if e.kind() == ErrorKind::Timeout),
        format!("a deadline sooner than connect_timeout: {r:?}"),
    )?;
    check(
        took >= Duration::from_millis(250) && took < Duration::from_millis(1500),
        format!("connect returned after {took:?}, its deadline was 300 ms"),
    )?;

    let mut c = RdmaConfig::default();
    c.devices = vec!["fake0".into()];
    c.connect_timeout = Duration::from_millis(300);
    let impatient = node(c)?;
    let start = Instant::now();
    let r = impatient.connect(&seg, Deadline::after(Duration::from_secs(10)));
    let took = start.elapsed();
    check(
        matches!(&r, Err(e) if e.kind() == ErrorKind::PeerUnreachable
            && e.to_string().contains("connect_timeout")),
        format!("connect_timeout sooner than the deadline: {r:?}"),
    )?;
    check(
        took >= Duration::from_millis(250) && took < Duration::from_millis(1500),
        format!("connect returned after {took:?}, connect_timeout was 300 ms"),
    )?;
    drop(silent);
    Ok(())
}

fn the_backend_names_itself_to_peers_with_the_engines_epoch() -> Result<(), Failed> {
    let config = || {
        let mut c = RdmaConfig::default();
        c.devices = vec!["fake0".into()];
        c
    };
    let epoch = 0x1234_5678_9abc_def0u64;
    let b = node_with(config(), epoch)?;
    // The endpoint: version, then the instance id.
    let endpoint = b.endpoint();
    check(
        endpoint[0] == 3 && endpoint[1..9] == epoch.to_le_bytes(),
        format!("the endpoint does not carry epoch {epoch:#x}: {endpoint:?}"),
    )?;
    // A target names itself by epoch: a request for another instance is refused.
    let initiator = backend(&["fake0"]);
    let mut stale = endpoint.clone();
    stale[1..9].copy_from_slice(&(epoch + 1).to_le_bytes());
    let address = b.control.address().to_string();
    let r = initiator.connect(&segment_at(stale, address.clone(), Vec::new()), soon());
    check(
        matches!(&r, Err(e) if e.kind() == ErrorKind::PeerRestarted && e.to_string().contains("stale")),
        format!("a descriptor of another life: {r:?}"),
    )?;
    initiator.connect(&segment_at(endpoint, address, Vec::new()), soon())?;
    // Created by an engine, through the registry, with the engine's epoch.
    let ctx = te_core::BackendContext {
        engine: "e".into(),
        epoch: epoch + 2,
        table: "devices = [\"fake0\"]".parse()?,
        source: "test".into(),
        ..Default::default()
    };
    let made = te_core::Registry::discover(&[])
        .get(te_rdma::NAME)?
        .create(&ctx)?;
    check(
        made.endpoint()[1..9] == (epoch + 2).to_le_bytes(),
        "the registry's backend does not name itself with its context's epoch".into(),
    )?;
    let r = RdmaBackend::with_epoch(config(), 0);
    check(
        matches!(&r, Err(e) if e.kind() == ErrorKind::ConfigInvalid),
        format!("a zero epoch: {:?}", r.map(|_| ())),
    )
}

/// A `connect_timeout` beyond what the backend can wait (an hour) is refused when the
/// backend is made, naming the key, instead of overflowing the clock at connect.
fn a_connect_timeout_beyond_an_hour_is_refused_when_the_backend_is_made() -> Result<(), Failed> {
    let target = backend(&["fake0"]);
    for timeout in [Duration::from_secs(u64::MAX), Duration::from_secs(3601)] {
        let mut c = RdmaConfig::default();
        c.devices = vec!["fake0".into()];
        c.qps_per_path = 1;
        c.connect_timeout = timeout;
        match node(c) {
            Err(e)
                if e.kind() == ErrorKind::ConfigInvalid
                    && e.to_string().contains("connect_timeout") => {}
            Err(e) => return Err(format!("connect_timeout = {timeout:?}: {e}").into()),
            Ok(b) => {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    b.connect(&segment(&target, Vec::new()), soon()).map(|_| ())
                }));
                return Err(format!(
                    "connect_timeout = {timeout:?} was accepted; a connect then gave {}",
                    match r {
                        Ok(r) => format!("{r:?}"),
                        Err(_) => "a panic".into(),
                    }
                )
                .into());
            }
        }
    }
    let mut c = RdmaConfig::default();
    c.devices = vec!["fake0".into()];
    c.qps_per_path = 1;
    c.connect_timeout = Duration::from_secs(3600);
    let b = node(c)?;
    b.connect(&segment(&target, Vec::new()), soon())?;
    Ok(())
}

fn main() {
    common::use_the_fake();
    common::run_tests(vec![
        (
            "a_peer_with_only_roce_v1_and_fewer_read_slots_is_reached_over_v1_with_a_capped_read_depth",
            a_peer_with_only_roce_v1_and_fewer_read_slots_is_reached_over_v1_with_a_capped_read_depth,
        ),
        (
            "a_request_for_more_qps_than_the_cap_is_refused_with_the_reason",
            a_request_for_more_qps_than_the_cap_is_refused_with_the_reason,
        ),
        (
            "connect_ends_at_the_callers_deadline_or_at_connect_timeout_whichever_is_sooner",
            connect_ends_at_the_callers_deadline_or_at_connect_timeout_whichever_is_sooner,
        ),
        (
            "the_backend_names_itself_to_peers_with_the_engines_epoch",
            the_backend_names_itself_to_peers_with_the_engines_epoch,
        ),
        (
            "a_connect_timeout_beyond_an_hour_is_refused_when_the_backend_is_made",
            a_connect_timeout_beyond_an_hour_is_refused_when_the_backend_is_made,
        ),
    ]);
}
