//! Registrations and KV layouts: what the engine lends the backend, and how it is
//! taken back.

use super::*;

impl Inner {
    pub(super) fn register(self: &Arc<Self>, mut desc: MemoryDesc) -> Result<Registration> {
        let bad =
            |m: String| Err(Error::new(ErrorKind::InvalidRequest, m).with_operation("register"));
        if desc.len == 0 {
            return bad(format!("region `{}` has zero length", desc.name));
        }
        if desc.addr == 0 {
            return bad(format!("region `{}` has a null address", desc.name));
        }
        if desc.addr.checked_add(desc.len).is_none() {
            return bad(format!(
                "region `{}` wraps around the address space",
                desc.name
            ));
        }
        // What the memory is, as its owner says: `auto` becomes it, and `host` for a
        // device's memory is refused here rather than faulting at the first transfer.
        let owner = match desc.kind {
            MemoryKind::Auto | MemoryKind::Host => crate::device::owner(desc.addr),
            // The named runtime is asked below, with the range.
            MemoryKind::Device { .. } => None,
        };
        match (&desc.kind, owner) {
            (MemoryKind::Auto, Some((runtime, info))) => {
                desc.kind = MemoryKind::Device {
                    runtime: runtime.to_string(),
                    ordinal: info.ordinal,
                }
            }
            (MemoryKind::Auto, None) => desc.kind = MemoryKind::Host,
            (MemoryKind::Host, Some((runtime, info))) => {
                return bad(format!(
                    "region `{}` ({:#x}+{}) was registered as host memory, but it is memory of {runtime}:{}; register it as {runtime}:{} or as auto",
                    desc.name, desc.addr, desc.len, info.ordinal, info.ordinal
                ))
            }
            _ => {}
        }
        let caps = &self.backend.info().capabilities;
        if !caps.memory.iter().any(|m| m == desc.kind.runtime()) {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "backend `{}` cannot move {} memory (it moves: {})",
                    self.backend.info().name,
                    desc.kind,
                    caps.memory.join(", ")
                ),
            )
            .with_operation("register"));
        }
        if let MemoryKind::Device { runtime, ordinal } = &desc.kind {
            let info = crate::device::runtime(runtime)
                .and_then(|rt| rt.pointer_info(desc.addr))
                .map_err(|e| e.with_operation("register"))?;
            let inside = desc.addr >= info.base && fits(desc.addr - info.base, desc.len, info.len);
            if info.ordinal == *ordinal && !inside && desc.addr >= info.base {
                return bad(format!(
                    "region `{}` ({:#x}+{}) runs past the end of its allocation of {} ({:#x}+{}): a region lies inside one allocation; memory of several allocations mapped one after another (PyTorch's expandable segments) is registered one allocation at a time",
                    desc.name, desc.addr, desc.len, desc.kind, info.base, info.len
                ));
            }
            if info.ordinal != *ordinal || !inside {
                return bad(format!(
                    "region `{}` ({:#x}+{}) is not inside one allocation of {}: the address belongs to {runtime}:{} ({:#x}+{}); register it as {runtime}:{} or as auto, within that allocation",
                    desc.name, desc.addr, desc.len, desc.kind, info.ordinal, info.base, info.len, info.ordinal
                ));
            }
        }
        let table = self.add_region(desc)?;
        let region = table.desc.clone();
        self.metrics
            .registered(&region.kind.to_string(), region.len, true);
        Ok(Registration {
            engine: Arc::downgrade(self),
            region,
            table,
            done: false,
        })
    }

    /// Registers `desc` with the backend under a fresh id and enters it in the table.
    pub(super) fn add_region(&self, desc: MemoryDesc) -> Result<Arc<Region>> {
        let id = RegionId(self.next_region.fetch_add(1, Ordering::Relaxed));
        let key = self
            .backend
            .register(id, &desc)
            .map_err(|e| e.with_operation("register"))?;
        let region = RegionDesc {
            id,
            name: desc.name,
            addr: desc.addr,
            len: desc.len,
            kind: desc.kind,
            access: desc.access,
            key,
        };
        let table = Region::new(region);
        self.regions.write().insert(id, table.clone());
        Ok(table)
    }

    /// Deregisters region `id`: no new batch can name it; layouts built on it are
    /// withdrawn and slot views over it that another thread is withdrawing are waited
    /// for (a view's memory is the region's); batches pinning it are waited for until
    /// `deadline`, then aborted and waited for until they are released (the memory
    /// contract outranks the clock); then the backend forgets it. A view over it that
    /// could not be let go, now or before (see [`Inner::release_views`]), fails the
    /// region's deregistration too.
    pub(super) fn release_region(&self, id: RegionId, deadline: Deadline) -> Result<()> {
        // Out of the table first, under its lock: whoever finds the region gone finds
        // its deregistration under way (and waits for its end), and a layout being
        // registered over it finds it gone before it is published.
        let region = {
            let mut table = self.regions.write();
            let Some(region) = table.remove(&id) else {
                return Err(Error::new(
                    ErrorKind::NotRegistered,
                    format!("region {id} is not registered (or was deregistered already)"),
                )
                .with_operation("deregister"));
            };
            region.releasing();
            region
        };
        let unwinding = Abandon(std::slice::from_ref(&region));
        let mut views_failed = None;
        let built_on: Vec<String> = self
            .layouts
            .read()
            .iter()
            .filter(|(_, l)| l.views.iter().any(|(parent, _)| *parent == id))
            .map(|(name, _)| name.clone())
            .collect();
        for name in built_on {
            match self.withdraw_layout(&name, deadline) {
                // Withdrawn by another thread meanwhile: its views are waited for below.
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::NotRegistered => {}
                Err(e) => {
                    tracing::warn!(layout = %name, error = %e, "withdrawing a layout failed");
                    views_failed.get_or_insert(e);
                }
            }
        }
        if !region.wait_unpinned(Some(deadline.instant())) {
            let pinned = region.pinned();
            tracing::warn!(region = %id, batches = pinned.len(), "deregistering a region with batches in flight: aborting them");
            for b in pinned {
                b.request_abort(Abort::Deregister);
            }
            region.wait_unpinned(None);
        }
        // After the holds: a layout being registered over the region, and undone, has
        // listed its views by then.
        let views: Vec<Arc<Region>> = (self.withdrawing.lock().iter())
            .filter(|(parent, _)| *parent == id)
            .map(|(_, view)| view.clone())
            .collect();
        for view in views {
            if let Err(e) = view.release_result() {
                views_failed.get_or_insert(e);
            }
        }
        let r = self
            .backend
            .deregister(id, deadline)
            .and_then(|()| views_failed.map_or(Ok(()), Err))
            .map_err(|e| e.with_operation("deregister").with_context("region", id));
        region.released(&r);
        std::mem::forget(unwinding);
        r
    }

    pub(super) fn register_layout(&self, layout: KvLayout, access: Option<Access>) -> Result<()> {
        let fail = |e: Error| Err(e.with_operation("register layout"));
        if let Err(e) = layout.validate() {
            return fail(e);
        }
        if self.layouts.read().contains_key(&layout.name) {
            return fail(Error::new(
                ErrorKind::InvalidRequest,
                format!("a layout named `{}` is already registered", layout.name),
            ));
        }
        if let Err(e) = no_overlap(&layout) {
            return fail(e);
        }
        let mut entry = LayoutEntry {
            published: layout.clone(),
            local: Arc::new(layout),
            views: Vec::new(),
        };
        let deadline = self.deadline(None);
        // The views registered so far, with their parents, for an undo.
        let mut made: Vec<(RegionId, Arc<Region>)> = Vec::new();
        let undo = |made: &[(RegionId, Arc<Region>)], e: Error| {
            self.list_views(made);
            // A view that could not be let go stays listed, and fails its parent's
            // deregistration; the layout's own error is the one to report.
            let _ = self.release_views(made, deadline);
            fail(e)
        };
        let name = entry.local.name.clone();
        // Each parent is held until the layout is published or undone: a parent's
        // deregistration waits for that, so no view outlives it, even for a moment.
        // Dropped as this returns, after any undo.
        let mut holds = Vec::new();
        for gi in 0..entry.local.groups.len() {
            for si in 0..entry.local.groups[gi].slots.len() {
                let (g, s) = (&entry.local.groups[gi], &entry.local.groups[gi].slots[si]);
                let at = format!("layout `{name}` group `{}` slot `{}`", g.name, s.name);
                let held = self.regions.read().get(&s.region).map(|r| r.hold());
                // Still in the table once held: its deregistration, if it comes, began
                // after the hold, and waits for it.
                let parent = held.and_then(|h| {
                    let table = self.regions.read();
                    let p = table.get(&s.region).map(|r| r.desc.clone());
                    holds.push(h);
                    p
                });
                let Some(parent) = parent else {
                    let e = Error::new(
                        ErrorKind::NotRegistered,
                        format!("{at}: region {} is not registered here", s.region),
                    );
                    return undo(&made, e);
                };
                let len = s.blocks * s.bytes_per_block;
                if !fits(s.offset, len, parent.len) {
                    let e = Error::new(
                        ErrorKind::OutOfBounds,
                        format!("{at}: {} blocks of {} bytes from offset {} do not fit region {} of {} bytes", s.blocks, s.bytes_per_block, s.offset, s.region, parent.len),
                    );
                    return undo(&made, e);
                }
                let view = MemoryDesc {
                    name: format!("{name}/{}/{}", g.name, s.name),
                    addr: parent.addr + s.offset,
                    len,
                    kind: parent.kind.clone(),
                    access: access.unwrap_or(parent.access),
                };
                match self.add_region(view) {
                    Ok(v) => {
                        entry.views.push((parent.id, v.desc.id));
                        made.push((parent.id, v.clone()));
                        let published = &mut entry.published.groups[gi].slots[si];
                        published.region = v.desc.id;
                        published.offset = 0;
                    }
                    Err(e) => return undo(&made, e),
                }
            }
        }
        let mut layouts = self.layouts.write();
        if layouts.contains_key(&name) {
            drop(layouts);
            let e = Error::new(
                ErrorKind::InvalidRequest,
                format!("a layout named `{name}` is already registered"),
            );
            return undo(&made, e);
        }
        // A parent deregistered meanwhile did not see this layout (it was not published):
        // its views must not outlive it.
        let gone = {
            let table = self.regions.read();
            (entry.views.iter()).find(|(parent, _)| !table.contains_key(parent))
        };
        if let Some(&(parent, _)) = gone {
            drop(layouts);
            let e = Error::new(
                ErrorKind::NotRegistered,
                format!("layout `{name}`: region {parent} was deregistered while the layout was being registered"),
            );
            return undo(&made, e);
        }
        layouts.insert(name, entry);
        Ok(())
    }

    pub(super) fn withdraw_layout(&self, name: &str, deadline: Deadline) -> Result<KvLayout> {
        let (entry, views) = {
            let mut layouts = self.layouts.write();
            let entry = layouts.remove(name).ok_or_else(|| {
                Error::new(
                    ErrorKind::NotRegistered,
                    format!("no layout named `{name}`"),
                )
                .with_operation("deregister layout")
            })?;
            // Its views are listed while the layout is still in sight: a deregistration
            // of a parent that no longer finds it waits for them.
            let table = self.regions.read();
            let views: Vec<(RegionId, Arc<Region>)> = (entry.views.iter())
                .filter_map(|(parent, view)| table.get(view).map(|r| (*parent, r.clone())))
                .collect();
            self.list_views(&views);
            (entry, views)
        };
        match self.release_views(&views, deadline) {
            Err(e) => Err(e.with_operation("deregister layout")),
            Ok(()) => Ok(Arc::unwrap_or_clone(entry.local)),
        }
    }

    /// Marks slot views, `(parent, view)`, as being deregistered and lists them in
    /// `withdrawing`, where a deregistration of their parent finds them.
    fn list_views(&self, views: &[(RegionId, Arc<Region>)]) {
        for (_, view) in views {
            view.releasing();
        }
        self.withdrawing.lock().extend(views.iter().cloned());
    }

    /// Deregisters slot views listed by [`Inner::list_views`]. Those let go leave the
    /// list; one whose deregistration failed stays in it for good, so that its parent's
    /// deregistration fails too: the backend may still touch the parent's memory
    /// through it.
    ///
    /// # Errors
    /// The first view's error.
    fn release_views(&self, views: &[(RegionId, Arc<Region>)], deadline: Deadline) -> Result<()> {
        let held: Vec<Arc<Region>> = views.iter().map(|(_, v)| v.clone()).collect();
        let unwinding = Abandon(&held);
        let mut first_error = None;
        let mut let_go = Vec::new();
        for table in &held {
            let view = table.desc.id;
            let r = match self.release_region(view, deadline) {
                // Deregistered by another thread (an engine's close): its result.
                Err(e) if e.kind() == ErrorKind::NotRegistered => table.release_result(),
                r => r,
            };
            match r {
                Ok(()) => let_go.push(table.clone()),
                Err(e) => {
                    tracing::error!(region = %view, error = %e, "a layout slot's view could not be deregistered; its parent region's memory must never be freed");
                    first_error.get_or_insert(e);
                }
            }
        }
        self.withdrawing
            .lock()
            .retain(|(_, r)| !let_go.iter().any(|v| Arc::ptr_eq(r, v)));
        std::mem::forget(unwinding);
        first_error.map_or(Ok(()), Err)
    }
}

/// Marks `0`'s deregistrations as ended if the thread running them unwinds before they
/// end, so that no one waits for them for ever; forgotten where they end.
struct Abandon<'a>(&'a [Arc<Region>]);

impl Drop for Abandon<'_> {
    fn drop(&mut self) {
        for r in self.0 {
            r.abandon();
        }
    }
}

/// Registered memory; deregistered when dropped, or by [`Registration::deregister`].
///
/// Deregistration waits for the batches in flight on the region (up to the engine's
/// default timeout), then aborts them and waits until their backend has released them,
/// and only then asks the backend to forget the region: once it has returned, nothing
/// of te touches the memory.
///
/// A registration does not keep its engine open: dropping the [`Engine`](super::Engine)
/// deregisters every region still registered, the same way, and stops the backend (its
/// listener included). The registration's own deregistration then reports how that one
/// ended.
pub struct Registration {
    pub(super) engine: Weak<Inner>,
    pub(super) region: RegionDesc,
    /// The engine's entry for the region, which says how its deregistration ended.
    pub(super) table: Arc<Region>,
    pub(super) done: bool,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("region", &self.region)
            .finish()
    }
}

impl Registration {
    /// The region's id, for requests.
    pub fn id(&self) -> RegionId {
        self.region.id
    }

    /// The region as peers see it.
    pub fn region(&self) -> &RegionDesc {
        &self.region
    }

    /// Deregisters the region and says whether the backend let go of it.
    ///
    /// # Errors
    /// The backend's error if it could not promise that nothing touches the memory
    /// any more. The memory is then *quarantined*: its owner must never free or reuse
    /// it (te's own buffers leak it on purpose, and say so in the log).
    pub fn deregister(mut self) -> Result<()> {
        self.done = true;
        self.release()
    }

    fn release(&self) -> Result<()> {
        let r = &self.region;
        let Some(engine) = self.engine.upgrade() else {
            // The engine closed, deregistering the region.
            return self.table.release_result();
        };
        engine.metrics.registered(&r.kind.to_string(), r.len, false);
        match engine.release_region(r.id, engine.deadline(None)) {
            // The engine is closing and took it first.
            Err(e) if e.kind() == ErrorKind::NotRegistered => self.table.release_result(),
            r => r,
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if let Err(e) = self.release() {
            tracing::error!(
                region = %self.region.id,
                error = %e,
                "deregistration failed: the backend may still touch this memory; it must never be freed"
            );
        }
    }
}

/// Refuses a layout two of whose slots share bytes of one region: a block of one would
/// be a block of the other, and a push into either would overwrite both.
fn no_overlap(layout: &KvLayout) -> Result<()> {
    let mut spans: Vec<(RegionId, u64, u64, String)> = Vec::new();
    for g in &layout.groups {
        for s in &g.slots {
            // `validate` checked that blocks × bytes per block and the end fit.
            let end = s
                .offset
                .saturating_add(s.blocks.saturating_mul(s.bytes_per_block));
            spans.push((s.region, s.offset, end, format!("{}/{}", g.name, s.name)));
        }
    }
    spans.sort_by_key(|(region, offset, ..)| (*region, *offset));
    for w in spans.windows(2) {
        let ((ra, oa, ea, a), (rb, ob, eb, b)) = (&w[0], &w[1]);
        if ra == rb && ob < ea {
            return Err(Error::new(
                ErrorKind::InvalidRequest,
                format!(
                    "layout `{}`: slots `{a}` (bytes {oa}..{ea}) and `{b}` (bytes {ob}..{eb}) of region {ra} overlap; each slot needs bytes of its own",
                    layout.name
                ),
            ));
        }
    }
    Ok(())
}
