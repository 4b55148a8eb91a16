//! Fathom's environment as an OpenEnv server (axum): Python users drive it with OpenEnv's
//! `GenericEnvClient` like any OpenEnv environment, and the trainer drives it with
//! [`crate::client::RemoteEnv`] when one machine's CPUs are not enough.
//!
//! # Routes
//!
//! | route | what |
//! | --- | --- |
//! | `GET /health` | `{"status": "healthy"}` |
//! | `GET /metadata` | name, description, version, README |
//! | `GET /schema` | JSON Schemas of `action`, `observation`, `state` |
//! | `GET /openapi.json` | the OpenAPI 3.1 document, generated from the same types |
//! | `POST /reset` | opens an HTTP session (or reuses `session_id`), starts an episode |
//! | `POST /step` | one turn in an HTTP session (`session_id` required) |
//! | `GET /state` | `?session_id=…`: that session's state; without: an empty state |
//! | `POST /mcp` | JSON-RPC: `openenv/session/create`, `openenv/session/close`; tools: none |
//! | `GET /sessions` | `{"active_sessions", "max_sessions", "client_sessions", "max_sessions_per_client"}` |
//! | `GET /ws` | the WebSocket session OpenEnv's client speaks (`?session_id=` attaches) |
//!
//! `/openapi.json` states exactly what the server enforces: the bounds of every number, which
//! fields go together (an action is exactly one of its kinds, a reset names its task one way),
//! and every status each operation can answer; an outside fuzzer (schemathesis) checks it.
//! The wire types are in [`crate::wire`]; the README's "Server" section describes the
//! protocol end to end. Unlike OpenEnv's own HTTP routes, which build a fresh environment for
//! every request (useless for a stateful REPL), `POST /reset` opens a session and returns its
//! id in `metadata.session_id`; WebSocket clients need none of this.
//!
//! # Access and limits
//!
//! With [`ServerConfig::token`] set, every request but `GET /health` must carry
//! `Authorization: Bearer <token>` or is answered 401 (a WebSocket before its upgrade); a
//! server listening on a non-loopback address without one warns loudly when it starts.
//!
//! [`ServerConfig`] bounds the request body and WebSocket message size (413 / connection
//! closed), the number of sessions (a full server answers `CAPACITY_REACHED` on the socket
//! and 503 over HTTP, at once), the sessions one client address may hold (its share:
//! `CAPACITY_REACHED` and 429), the idle time of a session (WebSocket closed, HTTP session
//! reaped), and the wall-clock time of a reset or step including `llm()` calls (the session
//! is ended; each cell is separately bounded by the sandbox's own limit). Every session has
//! its own worker from the pool. Malformed JSON, unknown fields and wrong types are answered
//! with 422 (WebSocket: `VALIDATION_ERROR`) naming the field.
//!
//! # Shutdown
//!
//! [`EnvServer::serve`] stops accepting connections when its shutdown future resolves, tells
//! every WebSocket session (`SESSION_ERROR`, then a close frame), ends all sessions, and so
//! kills their workers; a step still running finishes its cell first (bounded by the cell
//! limit) and its worker is killed when it returns.

mod auth;
mod episode;
mod http;
mod mcp;
mod openapi;
mod sessions;
mod ws;

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use fathom_rewards::Composite;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

pub use auth::{AccessToken, TokenError};
pub use episode::{EnvSession, Fresh, SessionError};
pub use openapi::{ApiDoc, document as openapi_document, json_schemas};

use crate::env::Services;
use crate::sublm::{SubLm, SubLmError};
use sessions::{Registry, SessionCell};

/// The server's limits.
#[derive(Clone, Debug, PartialEq)]
pub struct ServerConfig {
    /// Sessions open at once (WebSocket and HTTP together).
    pub max_sessions: usize,
    /// Largest request body or WebSocket message, in bytes.
    pub max_body_bytes: usize,
    /// A session unused for this long is ended.
    pub idle_timeout: Duration,
    /// Longest reset or step, `llm()` calls included; past it the session is ended.
    pub step_timeout: Duration,
    /// How long a client-mode session waits for the client to answer one `llm()` call.
    pub llm_timeout: Duration,
    /// How long shutdown waits for WebSocket sessions to close.
    pub shutdown_grace: Duration,
    /// The share of `max_sessions` one client address may hold, in (0, 1]; at least one
    /// session. 1 lets one client take every session.
    pub max_client_share: f64,
    /// The access token clients must present (`Authorization: Bearer …`); `None` serves
    /// anyone who can reach the port.
    pub token: Option<AccessToken>,
}

impl ServerConfig {
    /// Sessions one client address may hold: `max_client_share × max_sessions`, rounded
    /// down, at least 1.
    pub fn max_sessions_per_client(&self) -> usize {
        ((self.max_client_share * self.max_sessions as f64).floor() as usize)
            .clamp(1, self.max_sessions.max(1))
    }
}

impl Default for ServerConfig {
    /// 32 sessions, 16 MiB bodies, 5 minutes idle, 2 minutes per step, 1 minute per
    /// client-answered `llm()` call, 5 seconds of shutdown grace, one client may hold every
    /// session, no token.
    fn default() -> ServerConfig {
        ServerConfig {
            max_sessions: 32,
            max_body_bytes: 16 << 20,
            idle_timeout: Duration::from_secs(300),
            step_timeout: Duration::from_secs(120),
            llm_timeout: Duration::from_secs(60),
            shutdown_grace: Duration::from_secs(5),
            max_client_share: 1.0,
            token: None,
        }
    }
}

/// Errors starting or running the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A limit is zero.
    #[error("server config: {field} must be greater than zero")]
    Config {
        /// The field.
        field: &'static str,
    },
    /// `max_client_share` is not in (0, 1].
    #[error("server config: max_client_share must be in (0, 1], not {0}")]
    ClientShare(f64),
    /// Binding or serving failed.
    #[error("server I/O on {addr}: {source}")]
    Io {
        /// The address.
        addr: String,
        /// The error.
        source: std::io::Error,
    },
}

/// The environment server: what every session shares.
pub struct EnvServer {
    services: Services,
    composite: Arc<Composite>,
    config: ServerConfig,
}

/// What handlers share.
pub(crate) struct App {
    pub config: ServerConfig,
    pub services: Services,
    pub composite: Arc<Composite>,
    pub registry: Registry,
    pub shutdown: watch::Receiver<bool>,
    /// Live WebSocket tasks (shutdown waits for them).
    pub sockets: AtomicUsize,
    pub openapi_json: String,
    pub schema_json: serde_json::Value,
}

impl EnvServer {
    /// A server whose sessions run episodes with `services` (the sandbox pool, the server's
    /// sub-LM, the episode settings) and score final steps with `composite`.
    pub fn new(
        services: Services,
        composite: Composite,
        config: ServerConfig,
    ) -> Result<EnvServer, ServerError> {
        for (field, zero) in [
            ("max_sessions", config.max_sessions == 0),
            ("max_body_bytes", config.max_body_bytes == 0),
            ("idle_timeout", config.idle_timeout.is_zero()),
            ("step_timeout", config.step_timeout.is_zero()),
            ("llm_timeout", config.llm_timeout.is_zero()),
        ] {
            if zero {
                return Err(ServerError::Config { field });
            }
        }
        let share = config.max_client_share;
        if !(share > 0.0 && share <= 1.0) {
            return Err(ServerError::ClientShare(share));
        }
        Ok(EnvServer {
            services,
            composite: Arc::new(composite),
            config,
        })
    }

    /// The server's limits.
    pub fn config(&self) -> &ServerConfig {
        &self.config
    }

    /// Serves on `listener` until `shutdown` resolves, then ends every session (see the
    /// module docs).
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServerError> {
        let addr = listener
            .local_addr()
            .map_or_else(|_| "?".to_string(), |a| a.to_string());
        let (tx, rx) = watch::channel(false);
        let exposed = listener.local_addr().is_ok_and(|a| !a.ip().is_loopback());
        if exposed && self.config.token.is_none() {
            tracing::warn!(
                %addr,
                "NO ACCESS TOKEN on a non-loopback address: anyone who can reach {addr} can open \
                 sessions and run code in the sandbox. Set a token (xtask serve --token-file F, \
                 or FATHOM_SERVE_TOKEN), or listen on 127.0.0.1."
            );
        }
        let openapi_json = openapi::document_json(&self.config);
        let app = Arc::new(App {
            registry: Registry::new(
                self.config.max_sessions,
                self.config.max_sessions_per_client(),
            ),
            config: self.config,
            services: self.services,
            composite: self.composite,
            shutdown: rx,
            sockets: AtomicUsize::new(0),
            openapi_json,
            schema_json: openapi::json_schemas(),
        });
        let reaper = tokio::spawn(reap(Arc::clone(&app)));
        tracing::info!(
            %addr,
            max_sessions = app.config.max_sessions,
            max_sessions_per_client = app.config.max_sessions_per_client(),
            token = app.config.token.is_some(),
            "environment server listening"
        );
        let signal = tx.clone();
        let service = router(Arc::clone(&app)).into_make_service_with_connect_info::<SocketAddr>();
        let served = axum::serve(listener, service)
            .with_graceful_shutdown(async move {
                shutdown.await;
                let _ = signal.send(true);
            })
            .await;
        let _ = tx.send(true);
        reaper.abort();
        let deadline = tokio::time::Instant::now() + app.config.shutdown_grace;
        while app.sockets.load(Ordering::SeqCst) > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let ended = app.registry.drain();
        let count = ended.len();
        let _ = tokio::task::spawn_blocking(move || drop(ended)).await;
        tracing::info!(%addr, ended_sessions = count, "environment server stopped");
        served.map_err(|source| ServerError::Io { addr, source })
    }

    /// Binds `addr` and serves until Ctrl-C or SIGTERM (blocking; builds its own runtime).
    pub fn run(self, addr: SocketAddr) -> Result<(), ServerError> {
        let io = |source| ServerError::Io {
            addr: addr.to_string(),
            source,
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("fathom-server")
            .build()
            .map_err(io)?;
        let result = runtime.block_on(async move {
            let listener = TcpListener::bind(addr).await.map_err(io)?;
            self.serve(listener, shutdown_signal()).await
        });
        // Steps still running finish their cell; their workers die when they return.
        runtime.shutdown_timeout(Duration::from_secs(30));
        result
    }
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => tracing::info!("Ctrl-C: shutting down"),
        _ = term => tracing::info!("SIGTERM: shutting down"),
    }
}

fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/health", get(http::health))
        .route("/metadata", get(http::metadata))
        .route("/schema", get(http::schema))
        .route("/openapi.json", get(http::openapi))
        .route("/sessions", get(http::sessions))
        .route("/reset", post(http::reset))
        .route("/step", post(http::step))
        .route("/state", get(http::state))
        .route("/mcp", post(http::mcp))
        .route("/ws", get(ws::handler))
        .fallback(http::not_found)
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&app),
            auth::require_token,
        ))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(
            http::panicked,
        ))
        .with_state(app)
}

/// Ends idle HTTP sessions every quarter of the idle timeout.
async fn reap(app: Arc<App>) {
    let every =
        (app.config.idle_timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
    loop {
        tokio::time::sleep(every).await;
        let stale = app.registry.reap(app.config.idle_timeout);
        if !stale.is_empty() {
            for cell in &stale {
                tracing::info!(session = %cell.id, "idle HTTP session ended");
            }
            tokio::task::spawn_blocking(move || drop(stale));
        }
    }
}

/// Why a reset or step run on a blocking thread did not produce a response.
#[derive(Debug)]
pub(crate) enum RunError {
    /// The environment said no.
    Session(SessionError),
    /// Another step of the same session is running.
    Busy,
    /// An earlier step panicked while holding the session.
    Broken,
    /// This step panicked.
    Panicked,
}

/// The address a session is charged to: IPv4-mapped IPv6 addresses count as the IPv4
/// address they carry, so one client is one address whichever way it connected.
pub(crate) fn client_ip(addr: SocketAddr) -> IpAddr {
    match addr.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

/// Runs `f` on the session's environment on a blocking thread, recording the state after.
pub(crate) fn spawn_env<R: Send + 'static>(
    cell: Arc<SessionCell>,
    f: impl FnOnce(&mut EnvSession) -> Result<R, SessionError> + Send + 'static,
) -> tokio::task::JoinHandle<Result<R, RunError>> {
    tokio::task::spawn_blocking(move || {
        let mut env = match cell.env.try_lock() {
            Ok(env) => env,
            Err(std::sync::TryLockError::WouldBlock) => return Err(RunError::Busy),
            Err(std::sync::TryLockError::Poisoned(_)) => return Err(RunError::Broken),
        };
        let result = f(&mut env);
        cell.set_state(env.state());
        cell.touch();
        result.map_err(RunError::Session)
    })
}

/// Flattens a finished [`spawn_env`] task.
pub(crate) fn joined<R>(
    r: Result<Result<R, RunError>, tokio::task::JoinError>,
) -> Result<R, RunError> {
    match r {
        Ok(inner) => inner,
        Err(e) => {
            tracing::error!(error = %e, "a session task panicked");
            Err(RunError::Panicked)
        }
    }
}

/// A fresh random id in the form of a UUID v4.
pub(crate) fn fresh_id() -> Result<String, SessionError> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b)
        .map_err(|e| SessionError::Internal(format!("no randomness for an id: {e}")))?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    ))
}

/// Random values for one reset.
pub(crate) fn fresh() -> Result<Fresh, SessionError> {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b)
        .map_err(|e| SessionError::Internal(format!("no randomness for a seed: {e}")))?;
    Ok(Fresh {
        episode_id: fresh_id()?,
        seed: u64::from_le_bytes(b),
    })
}

/// One `llm()` call on its way to a client-mode session's client.
pub(crate) struct PendingLlm {
    pub prompt: String,
    pub reply: std::sync::mpsc::Sender<Result<String, String>>,
}

/// The sub-LM of a client-mode session: forwards each call to the WebSocket task, which
/// sends it to the client and routes the client's `llm_result` back.
pub(crate) struct ClientSubLm {
    pub calls: mpsc::Sender<PendingLlm>,
    pub timeout: Duration,
}

impl SubLm for ClientSubLm {
    fn complete(&self, prompt: &str) -> Result<String, SubLmError> {
        let (reply, answer) = std::sync::mpsc::channel();
        self.calls
            .try_send(PendingLlm {
                prompt: prompt.to_string(),
                reply,
            })
            .map_err(|_| SubLmError("the client is not connected to take llm() calls".into()))?;
        match answer.recv_timeout(self.timeout) {
            Ok(Ok(text)) => Ok(text),
            Ok(Err(e)) => Err(SubLmError(format!("the client could not answer: {e}"))),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(SubLmError(format!(
                "the client did not answer within {} s",
                self.timeout.as_secs_f64()
            ))),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                Err(SubLmError("the client disconnected".into()))
            }
        }
    }
}
