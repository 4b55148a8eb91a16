//! The server's sessions: each holds one [`EnvSession`] (and so at most one sandbox worker),
//! and the registry counts them against the configured maximum.
//!
//! A WebSocket connection owns the session it opens and ends it when it closes. HTTP
//! sessions (opened by `POST /reset` or MCP `openenv/session/create`) live until closed over
//! MCP or reaped after the idle timeout; a WebSocket may attach to one with
//! `/ws?session_id=…`, as in OpenEnv. The registry's lock is held only for map operations,
//! never across a step: the environment has its own lock, taken on a blocking thread.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use super::episode::EnvSession;
use crate::wire::StateBody;

/// Who owns a session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Opened over HTTP; lives until closed or idle.
    Http,
    /// Opened by a WebSocket connection; ends with it.
    Socket,
}

/// One session.
pub struct SessionCell {
    /// The session's id.
    pub id: String,
    /// Who owns it.
    pub kind: Kind,
    /// The environment (locked on a blocking thread for the length of a reset or step).
    pub env: Mutex<EnvSession>,
    /// The state after the last reset or step, readable while a step runs.
    state: Mutex<StateBody>,
    last_active: Mutex<Instant>,
    /// An HTTP session with a WebSocket attached (not reaped while attached).
    pub attached: AtomicBool,
    /// Closing was asked for while a WebSocket was attached; the socket ends it.
    pub pending_close: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl SessionCell {
    /// Marks the session as used now.
    pub fn touch(&self) {
        *lock(&self.last_active) = Instant::now();
    }

    /// How long since the session was last used.
    pub fn idle_for(&self) -> Duration {
        lock(&self.last_active).elapsed()
    }

    /// The state after the last reset or step.
    pub fn state(&self) -> StateBody {
        lock(&self.state).clone()
    }

    /// Records the state after a reset or step.
    pub fn set_state(&self, state: StateBody) {
        *lock(&self.state) = state;
    }
}

/// The server is full.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("Server at capacity: {active}/{max} sessions active. Cannot accept new connections.")]
pub struct Capacity {
    /// Sessions open.
    pub active: usize,
    /// Sessions allowed.
    pub max: usize,
}

/// All open sessions.
pub struct Registry {
    max: usize,
    sessions: Mutex<HashMap<String, Arc<SessionCell>>>,
}

impl Registry {
    /// An empty registry allowing `max` sessions.
    pub fn new(max: usize) -> Registry {
        Registry {
            max,
            sessions: Mutex::new(HashMap::new()),
        }
    }

    /// Opens a session, or says the server is full.
    pub fn open(
        &self,
        id: String,
        kind: Kind,
        env: EnvSession,
    ) -> Result<Arc<SessionCell>, Capacity> {
        let mut sessions = lock(&self.sessions);
        if sessions.len() >= self.max {
            return Err(Capacity {
                active: sessions.len(),
                max: self.max,
            });
        }
        let state = env.state();
        let cell = Arc::new(SessionCell {
            id: id.clone(),
            kind,
            env: Mutex::new(env),
            state: Mutex::new(state),
            last_active: Mutex::new(Instant::now()),
            attached: AtomicBool::new(false),
            pending_close: AtomicBool::new(false),
        });
        sessions.insert(id, Arc::clone(&cell));
        Ok(cell)
    }

    /// The HTTP session with this id.
    pub fn http(&self, id: &str) -> Option<Arc<SessionCell>> {
        lock(&self.sessions)
            .get(id)
            .filter(|c| c.kind == Kind::Http)
            .cloned()
    }

    /// Removes a session; the caller drops it (ending its worker) off the async threads.
    pub fn close(&self, id: &str) -> Option<Arc<SessionCell>> {
        lock(&self.sessions).remove(id)
    }

    /// Sessions open and allowed.
    pub fn counts(&self) -> (usize, usize) {
        (lock(&self.sessions).len(), self.max)
    }

    /// Removes HTTP sessions without an attached WebSocket that have been idle longer than
    /// `idle` (a session in the middle of a step is not idle).
    pub fn reap(&self, idle: Duration) -> Vec<Arc<SessionCell>> {
        let mut sessions = lock(&self.sessions);
        let stale: Vec<String> = sessions
            .values()
            .filter(|c| {
                c.kind == Kind::Http
                    && !c.attached.load(Ordering::SeqCst)
                    && c.idle_for() > idle
                    && !matches!(c.env.try_lock(), Err(TryLockError::WouldBlock))
            })
            .map(|c| c.id.clone())
            .collect();
        stale.iter().filter_map(|id| sessions.remove(id)).collect()
    }

    /// Removes every session (at shutdown).
    pub fn drain(&self) -> Vec<Arc<SessionCell>> {
        lock(&self.sessions).drain().map(|(_, c)| c).collect()
    }
}
