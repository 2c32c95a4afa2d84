//! A gate: the count of users of one thing (a registered region), which a closer shuts
//! and then waits to see empty.
//!
//! Deregistration is a barrier in every backend: once the gate is closed no new user
//! gets in, and the closer waits (until a deadline) for those inside to leave. The
//! wait blocks on a condition variable; leaving wakes it only when the last user goes.

use std::time::{Duration, Instant};

use crate::sync::{Condvar, Mutex};

/// Users counted in and out: closed, it refuses newcomers, and its closer waits for
/// the last user to leave.
#[derive(Debug)]
pub struct Gate {
    state: Mutex<State>,
    idle: Condvar,
}

#[derive(Debug)]
struct State {
    open: bool,
    users: usize,
}

impl Default for Gate {
    fn default() -> Gate {
        Gate::new()
    }
}

impl Gate {
    /// An open gate with no users.
    pub fn new() -> Gate {
        Gate {
            state: Mutex::new(State {
                open: true,
                users: 0,
            }),
            idle: Condvar::new(),
        }
    }

    /// Counts one user in; false (and nobody counted) once the gate is closed.
    pub fn enter(&self) -> bool {
        let mut s = self.state.lock();
        if s.open {
            s.users += 1;
        }
        s.open
    }

    /// Counts one more user in whether or not the gate is closed: for a user that
    /// already holds the gate (one of its own pins), which the closer waits for anyway.
    pub fn enter_again(&self) {
        self.state.lock().users += 1;
    }

    /// Counts one user out, waking the closer when it was the last.
    pub fn leave(&self) {
        let mut s = self.state.lock();
        s.users -= 1;
        if s.users == 0 {
            self.idle.notify_all();
        }
    }

    /// Closes the gate: [`Gate::enter`] refuses from now on.
    pub fn close(&self) {
        self.state.lock().open = false;
    }

    /// Whether the gate is still open.
    pub fn is_open(&self) -> bool {
        self.state.lock().open
    }

    /// The users inside now.
    pub fn users(&self) -> usize {
        self.state.lock().users
    }

    /// Waits until no user is inside, until `until` (or for good with `None`); returns
    /// how many still are (0: none).
    pub fn wait_empty(&self, until: Option<Instant>) -> usize {
        let mut s = self.state.lock();
        while s.users > 0 {
            s = match until {
                None => self.idle.wait(s),
                Some(end) => {
                    let left = end.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    // A deadline far away is waited for in hours, never overflowing.
                    let left = left.min(Duration::from_secs(3600));
                    self.idle.wait_timeout(s, left).0
                }
            };
        }
        s.users
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_closed_gate_refuses_newcomers_and_its_closer_waits_for_the_last_user() {
        let g = Arc::new(Gate::new());
        assert!(g.enter());
        assert!(g.enter());
        g.close();
        assert!(!g.enter(), "a closed gate let a user in");
        g.enter_again();
        assert_eq!(g.users(), 3);
        let soon = Instant::now() + Duration::from_millis(10);
        assert_eq!(g.wait_empty(Some(soon)), 3);
        let g2 = g.clone();
        let closer = std::thread::spawn(move || g2.wait_empty(None));
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(10));
            assert!(!closer.is_finished(), "the closer woke with users inside");
            g.leave();
        }
        assert_eq!(closer.join().unwrap(), 0);
    }
}
