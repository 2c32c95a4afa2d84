//! Submitting a batch: every request checked against both sides, local regions
//! pinned, and the backend's completion and the submission joined into one result.

use super::*;

impl Inner {
    /// Checks every request and pins the batch's local regions; nothing is pinned
    /// unless every request passes.
    pub(super) fn check(
        &self,
        peer: &Peer,
        requests: &[TransferRequest],
        state: &Arc<BatchState>,
    ) -> Result<Pins> {
        let mut segment = peer.segment();
        // A batch's requests come grouped by region (a KV batch: every block of one
        // slot, then the next), so each lookup first tries the region found last:
        // thousands of requests cost one scan of the tables per region, not per request.
        let mut remote = Last::default();
        if requests
            .iter()
            .any(|r| remote.find(r.remote, |id| segment.region(id)).is_none())
        {
            self.refresh(peer, state.deadline())?;
            segment = peer.segment();
        }
        let (mut remote, mut own) = (Last::default(), Last::default());
        let caps = &self.backend.info().capabilities;
        let local = self.regions.read();
        let mut pinned: Vec<Arc<Region>> = Vec::new();
        for (i, r) in requests.iter().enumerate() {
            let fail = |kind: ErrorKind, m: String| {
                Err(Error::new(kind, m)
                    .with_operation("transfer")
                    .with_context("request", i))
            };
            if r.len == 0 {
                return fail(ErrorKind::InvalidRequest, "zero-length request".into());
            }
            if r.len > caps.max_request_size {
                return fail(
                    ErrorKind::Unsupported,
                    format!(
                        "{} bytes exceed the backend's largest request ({}); split it",
                        r.len, caps.max_request_size
                    ),
                );
            }
            let (allowed, right) = match r.op {
                Op::Read => (caps.read, "remotely readable"),
                Op::Write => (caps.write, "remotely writable"),
            };
            if !allowed {
                return fail(
                    ErrorKind::Unsupported,
                    format!("backend `{}` cannot {}", self.backend.info().name, r.op),
                );
            }
            let Some(l) = own.find(r.local, |id| local.get(&id)) else {
                return fail(
                    ErrorKind::NotRegistered,
                    format!(
                        "local region {} is not registered (or was deregistered)",
                        r.local
                    ),
                );
            };
            if !fits(r.local_offset, r.len, l.desc.len) {
                return fail(
                    ErrorKind::OutOfBounds,
                    format!(
                        "local range {}+{} is outside region {} of {} bytes",
                        r.local_offset, r.len, r.local, l.desc.len
                    ),
                );
            }
            let Some(rem) = remote.find(r.remote, |id| segment.region(id)) else {
                return fail(
                    ErrorKind::NotRegistered,
                    format!(
                        "the peer has no region {} (never registered, or deregistered)",
                        r.remote
                    ),
                );
            };
            if !rem.access.allows(r.op) {
                return fail(
                    ErrorKind::InvalidRequest,
                    format!(
                        "the peer's region {} (`{}`) is not {right}",
                        r.remote, rem.name
                    ),
                );
            }
            if !fits(r.remote_offset, r.len, rem.len) {
                return fail(
                    ErrorKind::OutOfBounds,
                    format!(
                        "remote range {}+{} is outside the peer's region {} of {} bytes",
                        r.remote_offset, r.len, r.remote, rem.len
                    ),
                );
            }
            if pinned.last().is_none_or(|p| p.desc.id != r.local)
                && !pinned.iter().any(|p| p.desc.id == r.local)
            {
                pinned.push(l.clone());
            }
        }
        // Pinned under the table's read lock: a deregistration either removed the
        // region before this check (which then failed) or waits for this batch.
        Ok(Pins::new(state, pinned))
    }

    pub(super) fn transfer(
        &self,
        peer: &Peer,
        requests: &[TransferRequest],
        deadline: Deadline,
        notify: Option<Vec<u8>>,
    ) -> Result<TransferHandle> {
        let state = BatchState::new(
            BatchId(self.next_batch.fetch_add(1, Ordering::Relaxed)),
            deadline,
        );
        let peer = self.current(peer, deadline)?;
        let pins = self.check(&peer, requests, &state)?;
        // Measured from here: a batch the checks refused is an error of the call.
        let metrics = peer.inner.metrics.clone();
        // The fields are computed only when a subscriber wants the span.
        let span = tracing::debug_span!(
            "batch",
            id = state.id().0,
            peer = %peer.inner.addr,
            requests = requests.len(),
            bytes = requests.iter().map(|r| r.len).sum::<u64>(),
        );
        if self.config.metrics {
            state.meter(BatchMeter::start(
                self.metrics.clone(),
                metrics,
                requests,
                span,
            ));
        }
        self.timer.add(&state);
        let handle = TransferHandle::new(state.clone());
        let finisher = Finisher {
            state: state.clone(),
            pins,
            peer: peer.clone(),
            metrics: self.metrics.clone(),
            notify: notify.map(|message| {
                (
                    self.control.clone(),
                    wire::Notice {
                        to_epoch: peer.inner.epoch,
                        message,
                    },
                )
            }),
        };
        if requests.is_empty() {
            finisher.finish(Ok(()));
            return Ok(handle);
        }
        // The batch ends when both the backend's completion and `submit`'s return are
        // in, so an error returned by `submit` is never masked by the dropped completion.
        // The pins go with the finisher: they are released once the backend has
        // released the batch, after its result is set and before it wakes anyone (see
        // `Finisher::pins`).
        let join = Arc::new(Mutex::new(Join::default()));
        let (j, f) = (join.clone(), Arc::new(Mutex::new(Some(finisher))));
        let f2 = f.clone();
        let done = Completion::build(
            state.id(),
            deadline,
            state.signals(),
            Box::new(move |r, dropped| {
                let r = if dropped {
                    Err(r
                        .err()
                        .unwrap_or_else(|| Error::new(ErrorKind::Cancelled, "dropped")))
                } else {
                    r
                };
                Join::arrive(&j, &f2, Some(r), None);
            }),
        );
        let backend_id = peer.inner.backend_id;
        let submitted = {
            let _entered = state.span().map(tracing::Span::enter);
            self.backend.submit(backend_id, requests, done)
        };
        state.posted();
        let ok = submitted.is_ok();
        Join::arrive(
            &join,
            &f,
            None,
            Some(submitted.map_err(|e| e.with_operation("transfer"))),
        );
        if ok {
            let backend = Arc::downgrade(&self.backend);
            let batch = state.id();
            let driver = backend.clone();
            state.set_hook(Arc::new(move || {
                if let Some(b) = backend.upgrade() {
                    b.abort(backend_id, batch);
                }
            }));
            state.set_drive(Arc::new(move |until| {
                driver
                    .upgrade()
                    .is_some_and(|b| b.drive(backend_id, batch, until))
            }));
        }
        Ok(handle)
    }
}

/// The region a lookup found last, tried before the table.
struct Last<'a, T> {
    hit: Option<(RegionId, &'a T)>,
}

impl<T> Default for Last<'_, T> {
    fn default() -> Self {
        Last { hit: None }
    }
}

impl<'a, T> Last<'a, T> {
    fn find(
        &mut self,
        id: RegionId,
        lookup: impl FnOnce(RegionId) -> Option<&'a T>,
    ) -> Option<&'a T> {
        match self.hit {
            Some((last, found)) if last == id => Some(found),
            _ => {
                let found = lookup(id)?;
                self.hit = Some((id, found));
                Some(found)
            }
        }
    }
}

#[derive(Default)]
pub(super) struct Join {
    pub(super) completed: Option<Result<()>>,
    pub(super) submitted: Option<Result<()>>,
}

impl Join {
    fn arrive(
        join: &Mutex<Join>,
        finisher: &Mutex<Option<Finisher>>,
        completed: Option<Result<()>>,
        submitted: Option<Result<()>>,
    ) {
        let result = {
            let mut j = join.lock();
            if completed.is_some() {
                j.completed = completed;
            }
            if submitted.is_some() {
                j.submitted = submitted;
            }
            match (&j.submitted, &j.completed) {
                (Some(Err(e)), Some(_)) => Err(e.clone()),
                (Some(Ok(())), Some(r)) => r.clone(),
                _ => return,
            }
        };
        if let Some(f) = finisher.lock().take() {
            f.finish(result);
        }
    }
}

/// What happens when the backend has released a batch: peer bookkeeping, then either
/// the notification or the final result. It runs on whichever thread completed the
/// batch (often the backend's own), so it holds nothing that could make it the last
/// owner of the engine or the backend.
pub(super) struct Finisher {
    pub(super) state: Arc<BatchState>,
    /// The batch's pins on its local regions: dropped once the backend has released
    /// the batch and its result is set, before that result wakes anyone, so that a
    /// deregistration finds the batch done and whatever the result wakes (a waker, a C
    /// callback) may deregister those regions at once.
    pub(super) pins: Pins,
    pub(super) peer: Peer,
    pub(super) notify: Option<(Arc<control::Shared>, wire::Notice)>,
    /// The engine's count of notifications the peer accepted.
    pub(super) metrics: Arc<Counters>,
}

impl Finisher {
    fn finish(self, result: Result<()>) {
        // The backend released the batch: nothing touches its regions any more. The
        // pins go after the result is set (a deregistration they held up then finds the
        // batch done) and before it wakes anyone: a waker that deregisters one of them
        // would otherwise wait for pins only its own return would drop.
        let pins = self.pins;
        // An abort (deadline, cancel, deregistration) decides the result once the
        // backend has released the batch, whatever the backend reported.
        let result = match self.state.aborted() {
            Some(why) => Err(why.error()),
            None => result,
        };
        if let Err(e) = &result {
            if matches!(
                e.kind(),
                ErrorKind::PeerUnreachable | ErrorKind::PeerRestarted
            ) {
                self.peer.inner.valid.store(false, Ordering::Release);
            }
        }
        match (result, self.notify) {
            (Ok(()), Some((control, notice))) => {
                if let Some(why) = self.state.enter_notify() {
                    self.state.finish_then(Err(why.error()), move || drop(pins));
                    return;
                }
                // The data moved; only the notification is left, which touches none
                // of the batch's regions.
                drop(pins);
                // Queued on the peer's session, pipelined with others; its answer (or
                // the batch's deadline, whichever comes first) ends the batch.
                let state = self.state.clone();
                let counters = self.metrics.clone();
                control.send(
                    &self.peer.inner.addr,
                    Kind::Notify,
                    wire::encode(&notice),
                    self.state.deadline(),
                    Box::new(move |r| {
                        if r.is_ok() {
                            counters.notifications_sent.fetch_add(1, Ordering::Relaxed);
                        }
                        state.finish(r.map(|_| ()).map_err(|e| e.with_operation("notify")));
                    }),
                );
            }
            (result, _) => {
                self.state.finish_then(result, move || drop(pins));
            }
        }
    }
}
