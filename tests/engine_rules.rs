//! The engine core's own rules, through the public API: a batch's completion may
//! deregister the batch's own region, a kit lock is never held across a completion, an
//! engine configuration made in code is checked as a file's is, the deadline thread
//! sleeps while the engine is idle, and a region is never reported let go while the
//! backend holds a view over its memory.
//!
//! Most tests drive `Manual` (tests/common/manual.rs) through `Engine::with_backend`,
//! so they decide when each batch completes and which deregistration fails.

mod common;

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::{mpsc, Arc, Mutex};
use std::task::{Context, Wake, Waker};
use std::time::{Duration, Instant};

use common::manual::{engine, register, Manual};
use common::serial;
use te::{Access, ErrorKind, KvGroup, KvLayout, KvSlot, RegionId, TransferRequest};

/// Deregisters the registration it holds when woken, and reports how that ended: a
/// completion callback that frees the batch's buffer once the batch is done (te-capi's
/// `te_batch_on_complete` runs its callbacks from exactly such a waker).
struct DeregisterOnWake {
    registration: Mutex<Option<te::Registration>>,
    ended: Mutex<mpsc::Sender<te::Result<()>>>,
}

impl Wake for DeregisterOnWake {
    fn wake(self: Arc<Self>) {
        let taken = self.registration.lock().unwrap().take();
        if let Some(r) = taken {
            let result = r.deregister();
            let _ = self.ended.lock().unwrap().send(result);
        }
    }
}

#[test]
fn a_completion_waker_may_deregister_its_own_batchs_region() {
    let _serial = serial();
    let backend = Manual::new(false);
    let initiator = engine(&backend, |c| c.default_timeout = Duration::from_secs(1));
    let target = engine(&Manual::new(true), |_| {});
    let src = register(&initiator, "src", 4096, Access::LOCAL);
    let dst = register(&target, "dst", 4096, Access::REMOTE_READ_WRITE);
    let peer = initiator
        .connect(&target.address().to_string())
        .expect("connect");
    let write = [TransferRequest::write(src.id(), 0, dst.id(), 0, 4096)];
    let mut handle = initiator.transfer(&peer, &write).expect("submitted");
    let (tx, rx) = mpsc::channel();
    let waker = Waker::from(Arc::new(DeregisterOnWake {
        registration: Mutex::new(Some(src)),
        ended: Mutex::new(tx),
    }));
    assert!(Pin::new(&mut handle)
        .poll(&mut Context::from_waker(&waker))
        .is_pending());
    // The backend releases the batch on a thread of its own.
    let done = backend.take();
    std::thread::spawn(move || done.complete(Ok(())));
    match rx.recv_timeout(Duration::from_secs(5)) {
        Ok(r) => r.expect("the deregistration of a region no batch uses any more"),
        Err(_) => panic!(
            "a deregistration started by the batch's own completion waker has not returned after 5 s \
             (the engine's default_timeout is 1 s): the batch's pins are dropped only after its waker \
             returns, so it waits for itself for ever, on the backend's completion thread"
        ),
    }
    assert!(handle.wait().is_ok());
}

#[test]
fn a_countdowns_completion_runs_with_none_of_its_locks_held() {
    use te::backend::kit::Countdown;
    use te::backend::Completion;
    use te::Error;
    let _serial = serial();
    // The completion's callback stands for the engine's: it runs the batch's wakers and
    // C callbacks, which may take a while.
    let (release, released) = mpsc::channel::<()>();
    let (entered, inside) = mpsc::channel::<()>();
    let done = Completion::new(Duration::from_secs(30), move |_, _| {
        let _ = entered.send(());
        let _ = released.recv_timeout(Duration::from_secs(10));
    });
    let count = Arc::new(Countdown::new(1, done, ()));
    let c = count.clone();
    let last = std::thread::spawn(move || c.finish(Ok(())));
    inside
        .recv_timeout(Duration::from_secs(5))
        .expect("the completion ran");
    // Meanwhile another thread of the backend records an error (te-rdma's abort does,
    // from the engine's deadline thread) or reads it.
    let c = count.clone();
    let (tx, failed) = mpsc::channel();
    std::thread::spawn(move || {
        c.fail(Error::new(ErrorKind::Timeout, "late"));
        let _ = tx.send(());
    });
    let waited = failed.recv_timeout(Duration::from_secs(2));
    let _ = release.send(());
    assert!(last.join().unwrap());
    assert!(
        waited.is_ok(),
        "Countdown::fail waited for the completion's callback to return: finish_then holds the \
         countdown's error lock across Completion::complete (the lock guard is a temporary of that \
         statement)"
    );
}

#[test]
fn an_engine_config_made_in_code_is_checked_as_a_files_is() {
    use te::{Engine, EngineConfig, Origin};
    let _serial = serial();
    type Set = fn(&mut EngineConfig);
    let cases: [(&str, Set); 3] = [
        ("heartbeat = 0s", |c| c.heartbeat = Duration::ZERO),
        ("default_timeout = 0s", |c| {
            c.default_timeout = Duration::ZERO
        }),
        ("max_sessions = 0", |c| c.max_sessions = 0),
    ];
    for (what, set) in cases {
        // A file with this value is refused (Config::from_toml validates it)...
        let mut c = te::Config::defaults();
        c.engine.name = format!("rules-config-{}", std::process::id());
        set(&mut c.engine);
        // ...and the same configuration built in code must be too, rather than, for a
        // zero heartbeat, panicking the control plane's thread at the first connect.
        match Engine::from_config(&c) {
            Err(e) => assert_eq!(e.kind(), ErrorKind::ConfigInvalid, "{what}: {e}"),
            Ok(_) => panic!(
                "an engine was built from a configuration with {what}, which a file is refused for"
            ),
        }
        // So must an engine around a backend made by hand.
        c.engine.backend = "manual".into();
        match Engine::with_backend(c.engine, Manual::new(true), Origin::BuiltIn, 0) {
            Err(e) => assert_eq!(e.kind(), ErrorKind::ConfigInvalid, "{what}: {e}"),
            Ok(_) => panic!(
                "an engine was built around a backend with {what}, which a file is refused for"
            ),
        }
    }
}

/// The threads of this process named `name`.
fn threads_named(name: &str) -> HashSet<String> {
    std::fs::read_dir("/proc/self/task")
        .expect("tasks")
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim_end() == name)
        })
        .map(|t| t.file_name().to_string_lossy().into_owned())
        .collect()
}

/// Thread `tid`'s voluntary context switches (each sleep it woke from).
fn wakeups(tid: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("voluntary_ctxt_switches")
}

#[test]
fn the_deadline_thread_sleeps_once_every_batch_has_ended() {
    let _serial = serial();
    let before = threads_named("te-deadlines");
    let backend = Manual::new(true);
    let e = engine(&backend, |c| c.default_timeout = Duration::from_secs(1));
    // A thread names itself once it runs: look until it has.
    let end = Instant::now() + Duration::from_secs(5);
    let mine: Vec<String> = loop {
        let new: Vec<String> = threads_named("te-deadlines")
            .difference(&before)
            .cloned()
            .collect();
        if !new.is_empty() || Instant::now() > end {
            break new;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(mine.len(), 1, "the engine's deadline thread");
    let target = engine(&Manual::new(true), |_| {});
    let src = register(&e, "src", 4096, Access::LOCAL);
    let dst = register(&target, "dst", 4096, Access::REMOTE_READ_WRITE);
    let peer = e.connect(&target.address().to_string()).expect("connect");
    let write = [TransferRequest::write(src.id(), 0, dst.id(), 0, 4096)];
    // 200 batches, each done at once, with deadlines spread over 200 ms or more.
    for _ in 0..200 {
        e.transfer(&peer, &write).unwrap().wait().unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    // Every batch has ended: the engine is idle. Their deadlines (1 s after each was
    // submitted) all fall in the 2 s measured.
    let start = wakeups(&mine[0]);
    std::thread::sleep(Duration::from_secs(2));
    let woke = wakeups(&mine[0]) - start;
    assert!(
        woke <= 3,
        "with no batch in flight the deadline thread woke {woke} times in 2 s: once at the deadline \
         of each batch that had already ended (idle must mean no wake-ups)"
    );
}

#[test]
fn a_parent_whose_view_could_not_be_let_go_is_not_reported_let_go() {
    let _serial = serial();
    let backend = Manual::new(true);
    let e = engine(&backend, |c| c.default_timeout = Duration::from_secs(1));
    let parent = register(&e, "cache", 4096, Access::REMOTE_READ_WRITE);
    e.register_layout(KvLayout {
        name: "kv".into(),
        groups: vec![KvGroup {
            name: "layer0".into(),
            slots: vec![KvSlot {
                name: "key".into(),
                region: parent.id(),
                offset: 0,
                bytes_per_block: 1024,
                blocks: 4,
            }],
        }],
    })
    .expect("layout");
    let view = e.segment().layouts[0].groups[0].slots[0].region;
    // A peer's transfer holds the slot's view: its deregistration fails, and the
    // backend may still write bytes 0..4096 of the parent through it.
    backend.stuck.lock().unwrap().insert(view);
    let withdrawn = e.deregister_layout("kv");
    assert!(
        withdrawn.is_err(),
        "the view's deregistration failed, so must the layout's"
    );
    let parent_id = parent.id();
    let r = parent.deregister();
    assert!(
        backend.registered.lock().unwrap().contains(&view),
        "the backend still holds the view"
    );
    assert!(
        r.is_err(),
        "region {parent_id}'s deregistration returned Ok, so its owner may free it, while the \
         backend still holds view {view} over its bytes 0..4096 (that view's deregistration failed: {})",
        withdrawn.unwrap_err()
    );
}

#[test]
fn a_layout_whose_undone_view_could_not_be_let_go_keeps_its_parent_held() {
    let _serial = serial();
    let backend = Manual::new(true);
    let e = engine(&backend, |c| c.default_timeout = Duration::from_secs(1));
    let parent = register(&e, "cache", 4096, Access::REMOTE_READ_WRITE);
    // Region ids are handed out in order: the first slot's view is the next one.
    let view = RegionId(parent.id().0 + 1);
    backend.stuck.lock().unwrap().insert(view);
    let slot = |name: &str, offset| KvSlot {
        name: name.into(),
        region: parent.id(),
        offset,
        bytes_per_block: 1024,
        blocks: 2,
    };
    // The second slot runs past the region: the layout is undone, and the first
    // slot's view, already registered, cannot be let go.
    let refused = e.register_layout(KvLayout {
        name: "kv".into(),
        groups: vec![KvGroup {
            name: "layer0".into(),
            slots: vec![slot("key", 0), slot("value", 3072)],
        }],
    });
    assert_eq!(refused.unwrap_err().kind(), ErrorKind::OutOfBounds);
    assert!(
        backend.registered.lock().unwrap().contains(&view),
        "the backend still holds the undone layout's view {view}"
    );
    let parent_id = parent.id();
    let r = parent.deregister();
    assert!(
        r.is_err(),
        "region {parent_id}'s deregistration returned Ok, so its owner may free it, while the \
         backend still holds view {view} over its bytes 0..2048 (register_layout's undo ignored \
         that view's failed deregistration)"
    );
}
