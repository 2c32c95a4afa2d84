//! KV-cache layouts on the engine's face: registering and withdrawing them, and block
//! transfers planned over a local layout and the peer's of the same name.

use super::*;

/// Options of [`Engine::pull_blocks`] and [`Engine::push_blocks`].
#[derive(Debug, Clone, Default)]
pub struct BlockOptions {
    /// Which groups and slots move; all by default.
    pub selection: KvSelection,
    /// Deadline and notification, as for any batch.
    pub transfer: TransferOptions,
}

impl Engine {
    /// Registers a KV-cache layout and publishes it to peers (in the descriptor they
    /// fetch from now on). Every slot must lie inside a region registered here. Each
    /// slot is also registered as a region of its own (a view, with its region's
    /// access), and peers address the slot through it, so the receiving side refuses a
    /// block transfer that reaches outside its slot, not only outside the region.
    ///
    /// # Errors
    /// `InvalidRequest` for a malformed layout or a name already registered;
    /// `NotRegistered` for a slot in an unknown region; `OutOfBounds` for a slot that
    /// does not fit its region; the backend's error if it refuses a slot's view.
    pub fn register_layout(&self, layout: KvLayout) -> Result<()> {
        self.inner.register_layout(layout, None)
    }

    /// As [`Engine::register_layout`], with the slots' views published with `access`
    /// instead of their regions' (so a framework can keep its allocation local and
    /// expose only the slots).
    ///
    /// # Errors
    /// As [`Engine::register_layout`].
    pub fn register_layout_with(&self, layout: KvLayout, access: Access) -> Result<()> {
        self.inner.register_layout(layout, Some(access))
    }

    /// Withdraws a layout, and deregisters its slots' views (waiting for transfers on
    /// them, as any deregistration does).
    ///
    /// # Errors
    /// `NotRegistered` if no layout has that name; a view's deregistration error.
    pub fn deregister_layout(&self, name: &str) -> Result<KvLayout> {
        let deadline = self.inner.deadline(None);
        self.inner.withdraw_layout(name, deadline)
    }

    /// READs blocks `remote_ids` of the peer's layout `layout` into blocks `local_ids`
    /// of the local layout of the same name (pairwise), merging runs of consecutive
    /// ids into single requests (cut to the backend's `max_request_size`). One deadline
    /// covers refreshing the peer's descriptor and the batch.
    ///
    /// # Errors
    /// As [`kv::plan`] for the block lists; `NotRegistered` if either side has no such
    /// layout; as [`Engine::transfer_with`] for the requests.
    pub fn pull_blocks(
        &self,
        peer: &Peer,
        layout: &str,
        remote_ids: &[u64],
        local_ids: &[u64],
        options: &BlockOptions,
    ) -> Result<TransferHandle> {
        self.blocks(Op::Read, peer, layout, remote_ids, local_ids, options)
    }

    /// WRITEs blocks `local_ids` of the local layout `layout` into blocks `remote_ids`
    /// of the peer's layout of the same name (pairwise).
    ///
    /// # Errors
    /// As [`Engine::pull_blocks`].
    pub fn push_blocks(
        &self,
        peer: &Peer,
        layout: &str,
        remote_ids: &[u64],
        local_ids: &[u64],
        options: &BlockOptions,
    ) -> Result<TransferHandle> {
        self.blocks(Op::Write, peer, layout, remote_ids, local_ids, options)
    }

    fn blocks(
        &self,
        op: Op,
        peer: &Peer,
        layout: &str,
        remote_ids: &[u64],
        local_ids: &[u64],
        options: &BlockOptions,
    ) -> Result<TransferHandle> {
        let operation = match op {
            Op::Read => "pull blocks",
            Op::Write => "push blocks",
        };
        let deadline = self.inner.deadline(options.transfer.timeout);
        let local = self
            .inner
            .layouts
            .read()
            .get(layout)
            .map(|l| l.local.clone())
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::NotRegistered,
                    format!("no local layout named `{layout}`; register it first"),
                )
                .with_operation(operation)
            })?;
        let peer = self.inner.current(peer, deadline)?;
        // The peer's descriptor, held while its layout is planned against (not copied).
        let mut segment = peer.segment();
        if segment.layout(layout).is_none() {
            self.inner.refresh(&peer, deadline)?;
            segment = peer.segment();
        }
        let remote = segment.layout(layout).ok_or_else(|| {
            Error::new(
                ErrorKind::NotRegistered,
                format!("the peer has no layout named `{layout}`"),
            )
            .with_operation(operation)
        })?;
        let requests = kv::plan(
            op,
            &local,
            remote,
            remote_ids,
            local_ids,
            &options.selection,
        )
        .map_err(|e| e.with_operation(operation))?;
        // Runs of blocks were merged by te, not the caller: cut them to what the
        // backend takes in one request.
        let max = self.inner.backend.info().capabilities.max_request_size;
        let requests = kv::split_to(requests, max);
        self.inner
            .transfer(&peer, &requests, deadline, options.transfer.notify.clone())
    }
}
