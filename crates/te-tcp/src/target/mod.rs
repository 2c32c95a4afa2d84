//! The target's side: the data listener and the connections it serves (`serve`), and
//! the responder that stages device memory for them (`respond`).

pub(crate) mod respond;
pub(crate) mod serve;
