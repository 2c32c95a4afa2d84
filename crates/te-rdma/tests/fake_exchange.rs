//! The connect exchange on the engine's control plane, played against by hostile
//! peers: a QP request from an engine without the token, and malformed, oversized and
//! forged requests, each refused with what was wrong while the target keeps serving a
//! genuine initiator. Runs on the FAKE verbs provider, on 127.0.0.1.

use libtest_mimic::{Arguments, Failed, Trial};
use te_core::testkit::{self, soon};
use te_core::StandaloneControl;
use te_core::{EngineConfig, ErrorKind, SegmentDesc, TransferBackend};
use te_rdma::{RdmaBackend, RdmaConfig};

/// A backend with the control plane its exchange runs on (dropped after it).
struct Node {
    backend: RdmaBackend,
    control: StandaloneControl,
}

fn node(token: Option<&str>) -> Result<Node, Failed> {
    let epoch = te_core::random_nonzero();
    let engine = EngineConfig {
        auth_token: token.map(str::to_string),
        ..Default::default()
    };
    let control = StandaloneControl::start(&engine, epoch)?;
    let mut c = RdmaConfig::default();
    c.devices = vec!["fake0".into()];
    c.qps_per_path = 1;
    let backend = RdmaBackend::with_hook(c, epoch, control.hook())?;
    Ok(Node { backend, control })
}

fn segment(target: &Node) -> SegmentDesc {
    testkit::segment(
        te_rdma::NAME,
        target.backend.endpoint(),
        target.control.address().to_string(),
        Vec::new(),
    )
}

fn expect(
    r: te_core::Result<impl std::fmt::Debug>,
    kind: ErrorKind,
    text: &str,
    what: &str,
) -> Result<(), Failed> {
    match r {
        Err(e) if e.kind() == kind && e.to_string().contains(text) => Ok(()),
        other => Err(format!("{what}: expected {kind:?} naming {text:?}, got {other:?}").into()),
    }
}

fn a_qp_request_from_an_engine_without_the_token_is_refused() -> Result<(), Failed> {
    let target = node(Some("s3cret"))?;
    let stranger = node(None)?;
    expect(
        stranger.backend.connect(&segment(&target), soon()),
        ErrorKind::Unauthorized,
        "auth_token",
        "an initiator without a token",
    )?;
    let wrong = node(Some("guess"))?;
    expect(
        wrong.backend.connect(&segment(&target), soon()),
        ErrorKind::Unauthorized,
        "auth_token",
        "an initiator with another token",
    )?;
    let friend = node(Some("s3cret"))?;
    friend.backend.connect(&segment(&target), soon())?;
    Ok(())
}

/// A connect request as the exchange encodes it (version 3): `paths` copies of one
/// well-formed RoCE v2 path.
fn request(initiator: u64, target: u64, paths: usize) -> Vec<u8> {
    let mut v = b"TERC".to_vec();
    v.extend_from_slice(&3u16.to_le_bytes());
    v.push(1);
    v.extend_from_slice(&initiator.to_le_bytes());
    v.extend_from_slice(&target.to_le_bytes());
    v.extend_from_slice(&1u64.to_le_bytes());
    v.extend_from_slice(&(paths as u16).to_le_bytes());
    for i in 0..paths {
        v.extend_from_slice(&[0, 0]);
        v.extend_from_slice(&(i as u32 + 1).to_le_bytes());
        v.extend_from_slice(&7u32.to_le_bytes());
        v.extend_from_slice(&0u16.to_le_bytes());
        v.extend_from_slice(&[0; 16]);
        v.extend_from_slice(&[5, 2, 1, 2, 1]);
    }
    v
}

fn malformed_oversized_and_forged_qp_requests_are_refused_and_the_target_keeps_serving(
) -> Result<(), Failed> {
    let target = node(None)?;
    let address = target.control.address().to_string();
    let instance = u64::from_le_bytes(target.backend.endpoint()[1..9].try_into()?);
    // A hostile engine: authenticated (no token on either side), speaking raw bytes.
    let epoch = te_core::random_nonzero();
    let hostile = StandaloneControl::start(&EngineConfig::default(), epoch)?;
    let call = |bytes: &[u8]| hostile.hook().call(&address, bytes, soon());
    expect(
        call(b"not a request"),
        ErrorKind::Protocol,
        "magic",
        "garbage",
    )?;
    let good = request(epoch, instance, 1);
    expect(
        call(&good[..good.len() - 3]),
        ErrorKind::Protocol,
        "truncated",
        "a truncated request",
    )?;
    expect(
        call(&[&good[..], &[0]].concat()),
        ErrorKind::Protocol,
        "trailing",
        "trailing bytes",
    )?;
    // Well formed, far past what one request may ask (1 device, qps_per_path = 1).
    expect(
        call(&request(epoch, instance, 100)),
        ErrorKind::InvalidRequest,
        "qps_per_path",
        "a request for 100 QPs",
    )?;
    // Larger requests are refused too: past the format's 1,024 paths by te-rdma, past
    // the control plane's 64 KiB for a request before te-rdma sees it.
    expect(
        call(&request(epoch, instance, 1100)),
        ErrorKind::Protocol,
        "paths",
        "a request past the format's path limit",
    )?;
    let mut huge = good.clone();
    huge.resize(70 << 10, 0);
    expect(call(&huge), ErrorKind::Protocol, "", "a 70 KiB request")?;
    // Past the control plane's limit for a backend message: the connection is refused.
    let r = call(&vec![0u8; 2 << 20]);
    if r.is_ok() {
        return Err("a 2 MiB backend message was answered".into());
    }
    expect(
        call(&request(epoch ^ 1, instance, 1)),
        ErrorKind::InvalidRequest,
        "authenticated",
        "a request naming another initiator than the one authenticated",
    )?;
    expect(
        call(&request(epoch, instance ^ 1, 1)),
        ErrorKind::PeerRestarted,
        "stale",
        "a request for another life of the target",
    )?;
    // And a genuine initiator is served.
    let genuine = node(None)?;
    genuine.backend.connect(&segment(&target), soon())?;
    Ok(())
}

fn main() {
    if std::env::var_os(te_rdma::VERBS_LIB_ENV).is_none() {
        let exe = std::env::current_exe().expect("the test binary's path");
        std::env::set_var(
            te_rdma::VERBS_LIB_ENV,
            exe.with_file_name("libfakeverbs.so"),
        );
    }
    std::env::set_var("TE_FAKEVERBS_DEVICES", "fake0");
    if let Err(why) = te_rdma::probe() {
        eprintln!("the fake verbs provider does not load: {why}");
        std::process::exit(1);
    }
    type Test = fn() -> Result<(), Failed>;
    let tests: [(&str, Test); 2] = [
        (
            "a_qp_request_from_an_engine_without_the_token_is_refused",
            a_qp_request_from_an_engine_without_the_token_is_refused,
        ),
        (
            "malformed_oversized_and_forged_qp_requests_are_refused_and_the_target_keeps_serving",
            malformed_oversized_and_forged_qp_requests_are_refused_and_the_target_keeps_serving,
        ),
    ];
    let trials = tests
        .into_iter()
        .map(|(name, f)| Trial::test(name, f))
        .collect();
    libtest_mimic::run(&Arguments::from_args(), trials).exit();
}
