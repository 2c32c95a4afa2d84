//! The conformance suite: te's contract, as tests any backend runs.
//!
//! Each test is named as a sentence of the contract and selected by the backend's
//! capabilities. A backend's test target (with `harness = false`) runs it:
//!
//! ```ignore
//! use te_core::testkit::{self, Harness};
//! fn main() {
//!     testkit::serve_target_if_asked();
//!     let h = Harness::for_backend(my_backend::NAME, "", Some("delay = \"200ms\""));
//!     testkit::run(testkit::trials_everywhere(&h));
//! }
//! ```
//! (`crates/te-stub/tests/conformance.rs` is that test.) The second table is one of the
//! same backend whose batches take about 200 ms (the stub's `delay`, te-tcp's
//! `debug_delay`); tests about deadlines, cancelling, waiting and shutdown with work in
//! flight need it and are skipped without it.
//!
//! The tests live by area: [`transfers`] (what must work), [`refusals`] (what must be
//! refused, and where), [`deadlines`] (time and shutdown), [`memory`] (the caller's
//! memory is the caller's again only when te says so). Tests that drive a backend
//! directly, without an engine, share the helpers of `direct` ([`pattern`],
//! [`soon`], [`segment`], [`run_batch`], [`HostPair`], [`run_tests`]).

use libtest_mimic::{Arguments, Failed};

use crate::{Capabilities, ErrorKind, Registry};

/// Fails the test with a message unless the condition holds.
macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(fail(format!($($msg)+)));
        }
    };
}

mod deadlines;
mod direct;
mod harness;
mod memory;
mod refusals;
mod remote;
mod transfers;

pub use direct::{
    byte, host_memory, host_region, pattern, run_batch, run_tests, segment, soon, AsBackend,
    DirectTest, HostPair,
};
pub use harness::{built_plugin, engine_config, engine_toml, plugin_dir, Harness};
pub use libtest_mimic::Trial;
pub use remote::serve_target_if_asked;

pub(crate) fn fail(m: impl Into<String>) -> Failed {
    Failed::from(m.into())
}

pub(crate) fn e2f(e: crate::Error) -> Failed {
    fail(e.to_string())
}

pub(crate) fn expect_kind(
    r: crate::Result<impl std::fmt::Debug>,
    kind: ErrorKind,
    what: &str,
) -> Result<(), Failed> {
    match r {
        Err(e) if e.kind() == kind => Ok(()),
        Err(e) => Err(fail(format!("{what}: expected {kind}, got {:?}", e))),
        Ok(v) => Err(fail(format!("{what}: expected {kind}, got Ok({v:?})"))),
    }
}

type Test = fn(&Harness) -> Result<(), Failed>;

/// One trial as declared: its name (the function's), when it applies, and whether it
/// needs the slow configuration.
struct Spec {
    name: &'static str,
    test: Test,
    applies: bool,
    slow: bool,
}

/// Declares trials once, each named by its function:
/// `[slow] module::test [if condition];`.
macro_rules! specs {
    ($($(#[$slow:ident])? $module:ident :: $test:ident $(if $cond:expr)?;)*) => {
        vec![$(Spec {
            name: stringify!($test),
            test: $module::$test,
            applies: true $(&& $cond)?,
            slow: false $(|| stringify!($slow) == "slow")?,
        },)*]
    };
}

fn specs(caps: &Capabilities) -> Vec<Spec> {
    let (read, write) = (caps.read, caps.write);
    specs![
        transfers::an_empty_batch_completes;
        transfers::completion_is_delivered_exactly_once;
        transfers::write_then_read_back_gives_the_same_bytes if read && write;
        transfers::the_stages_a_backend_times_lie_within_their_batch if write;
        transfers::notifications_arrive_after_the_data if write;
        transfers::many_concurrent_batches_from_several_threads_all_complete if write;
        transfers::a_second_connect_returns_the_cached_peer;
        transfers::regions_registered_after_connect_are_reachable if write;
        refusals::out_of_bounds_requests_are_refused_before_posting;
        refusals::each_request_is_checked_against_its_own_regions if write;
        refusals::unknown_region_requests_are_refused_before_posting;
        refusals::zero_length_requests_are_refused;
        refusals::deregistered_regions_are_refused if write;
        refusals::a_write_into_a_region_without_remote_write_is_refused if write;
        refusals::a_read_of_a_region_without_remote_read_is_refused if read;
        refusals::requests_with_unsupported_memory_are_refused_at_register;
        refusals::a_block_write_outside_its_slot_is_refused_by_the_target if write && caps.checks_at_target;
        #[slow] deadlines::a_batch_past_its_deadline_fails_with_timeout_and_is_released if write;
        #[slow] deadlines::a_waiting_thread_uses_almost_no_cpu if write;
        #[slow] deadlines::dropping_the_engine_with_batches_in_flight_neither_hangs_nor_crashes if write;
        #[slow] deadlines::a_handle_can_be_awaited_as_a_future if write;
        #[slow] deadlines::every_clone_of_a_handle_wakes if write;
        #[slow] memory::a_timed_out_batch_never_writes_afterwards if read && write;
        #[slow] memory::a_cancelled_batch_never_writes_afterwards if read && write;
        #[slow] memory::deregistration_waits_for_batches_in_flight if read && write;
    ]
}

/// The capabilities of the harness's backend, or why it cannot be created.
fn capabilities(h: &Harness) -> Result<Capabilities, String> {
    Registry::discover(&h.config().engine.plugin_dirs)
        .get(&h.config().engine.backend)
        .and_then(|e| e.create(&h.config().backend_context(&h.config().engine.backend)))
        .map(|b| b.info().capabilities.clone())
        .map_err(|e| e.to_string())
}

/// Every contract test, for the harness's backend; those its capabilities (or a
/// missing slow configuration) rule out are marked ignored.
pub fn trials(h: &Harness) -> Vec<Trial> {
    let caps = match capabilities(h) {
        Ok(caps) => caps,
        Err(msg) => {
            return vec![Trial::test(
                format!("{}::backend_can_be_created", h.label()),
                move || Err(fail(msg)),
            )];
        }
    };
    specs(&caps)
        .into_iter()
        .map(|s| {
            let h = h.clone();
            let ignored = !s.applies || (s.slow && !h.has_slow());
            Trial::test(format!("{}::{}", h.label(), s.name), move || (s.test)(&h))
                .with_ignored_flag(ignored)
        })
        .collect()
}

/// [`trials`] in this process, and again with every target engine in a child process
/// when the backend reaches across processes and the harness was made by
/// [`Harness::for_backend`]. The test's `main` must call [`serve_target_if_asked`]
/// first.
pub fn trials_everywhere(h: &Harness) -> Vec<Trial> {
    let mut all = trials(h);
    if capabilities(h).is_ok_and(|c| c.cross_process) {
        if let Some(remote) = h.across_processes() {
            all.extend(trials(&remote));
        }
    }
    all
}

/// Runs trials as a test binary's `main` does, exiting with the result.
pub fn run(trials: Vec<Trial>) -> ! {
    libtest_mimic::run(&Arguments::from_args(), trials).exit()
}

/// Context switches so far of every thread of process `pid` (voluntary and not, from
/// `/proc/PID/task/*/status`): what a test of "idle means no wake-ups" counts over an
/// idle time. A thread that ends meanwhile is left out.
///
/// # Panics
/// If the process's task directory cannot be read.
pub fn context_switches(pid: u32) -> u64 {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the process's tasks");
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("status")).ok())
        .flat_map(|status| {
            status
                .lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}
