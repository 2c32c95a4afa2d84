//! The initiator's side: how a batch becomes frames (`plan`, `slice`), the data
//! connections that carry them (`conn`, with its sender and receiver, and `carry`, the
//! bytes on their way out), the watcher that cuts batches past their deadlines
//! (`watch`), and the device copies to a peer in this process (`local`).

pub(crate) mod carry;
pub(crate) mod conn;
pub(crate) mod local;
pub(crate) mod plan;
pub(crate) mod slice;
pub(crate) mod watch;
