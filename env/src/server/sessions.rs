//! The server's sessions: each holds one [`EnvSession`] (and so at most one sandbox worker),
//! and the registry counts them against the configured maximum.
//!
//! A WebSocket connection owns the session it opens and ends it when it closes. HTTP
//! sessions (opened by `POST /reset` or MCP `openenv/session/create`) live until closed over
//! MCP or reaped after the idle timeout; a WebSocket may attach to one with
//! `/ws?session_id=…`, as in OpenEnv. The registry's lock is held only for map operations,
//! never across a step: the environment has its own lock, taken on a blocking thread.
//!
//! Every session is charged to the address of the client that opened it, and one address may
//! hold at most its share of the sessions ([`Refusal::ClientShare`]), so a single client cannot
//! take every session for the idle timeout.

use std::collections::HashMap;
use std::net::IpAddr;
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
    /// The address of the client that opened it (charged against that client's share).
    pub client: IpAddr,
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

/// Why a session was not opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The server holds as many sessions as it allows.
    #[error("Server at capacity: {active}/{max} sessions active. Cannot accept new connections.")]
    Full {
        /// Sessions open.
        active: usize,
        /// Sessions allowed.
        max: usize,
    },
    /// This client's address already holds its share of the sessions.
    #[error(
        "Client {client} holds {held} of the {max} sessions it may hold on this server \
         ({active}/{total} open in all); close one before opening another"
    )]
    ClientShare {
        /// The client's address.
        client: IpAddr,
        /// Sessions it holds.
        held: usize,
        /// Sessions one address may hold.
        max: usize,
        /// Sessions open in all.
        active: usize,
        /// Sessions allowed in all.
        total: usize,
    },
}

/// All open sessions.
pub struct Registry {
    max: usize,
    per_client: usize,
    sessions: Mutex<HashMap<String, Arc<SessionCell>>>,
}

impl Registry {
    /// An empty registry allowing `max` sessions, at most `per_client` of them to one address.
    pub fn new(max: usize, per_client: usize) -> Registry {
        Registry {
            max,
            per_client,
            sessions: Mutex::new(HashMap::new()),
        }
    }

    /// Opens a session for `client`, or says why not: the server is full (checked first), or
    /// the client holds its share.
    pub fn open(
        &self,
        id: String,
        kind: Kind,
        env: EnvSession,
        client: IpAddr,
    ) -> Result<Arc<SessionCell>, Refusal> {
        let mut sessions = lock(&self.sessions);
        let active = sessions.len();
        let held = sessions.values().filter(|c| c.client == client).count();
        if active >= self.max {
            return Err(Refusal::Full {
                active,
                max: self.max,
            });
        }
        if held >= self.per_client {
            return Err(Refusal::ClientShare {
                client,
                held,
                max: self.per_client,
                active,
                total: self.max,
            });
        }
        let state = env.state();
        let cell = Arc::new(SessionCell {
            id: id.clone(),
            kind,
            client,
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

    /// Sessions held by `client`.
    pub fn held_by(&self, client: IpAddr) -> usize {
        lock(&self.sessions)
            .values()
            .filter(|c| c.client == client)
            .count()
    }

    /// Removes every session (at shutdown).
    pub fn drain(&self) -> Vec<Arc<SessionCell>> {
        lock(&self.sessions).drain().map(|(_, c)| c).collect()
    }
}
