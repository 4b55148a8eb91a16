//! [`RemoteEnv`]: an [`Environment`] whose episodes run on Fathom environment servers, so a
//! trainer steps remote environments exactly as it steps [`crate::env::ReplEnv`].
//!
//! Each `RemoteEnv` holds one WebSocket session (blocking I/O with timeouts, no async
//! runtime). [`ServerPool`] is a shared list of server URLs: every connection takes the next
//! URL in turn, so G environments built over one pool spread their sessions across the
//! servers, and a server that refuses (down, or at capacity) is skipped for the next. A lost
//! connection fails the current episode's call with [`EnvError::Remote`]; the next `reset`
//! reconnects.
//!
//! `llm()` calls are answered by the server's sub-LM, unless the environment is built with
//! [`RemoteEnv::with_sub_lm`]: then episodes are reset with `"llm": "client"` and each call
//! comes back over the socket to be answered locally (by the trainer's policy), so remote
//! rollouts see the same sub-LM as local ones. Plain URLs only (`ws://` or `http://`): put a
//! TLS-terminating proxy in front of servers reached over untrusted networks. A server started
//! with an access token needs [`ClientConfig::token`], sent as `Authorization: Bearer …` when
//! each session's WebSocket opens.

use std::io::ErrorKind;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use fathom_rewards::record::Trajectory;
use tungstenite::client::IntoClientRequest;
use tungstenite::http::HeaderValue;
use tungstenite::protocol::WebSocketConfig;
use tungstenite::{Message, WebSocket};

use crate::env::{AgentAction, EnvError, Environment, Observation, ResetRequest};
use crate::sublm::SubLm;
use crate::wire::{
    ActionParams, ClientMessage, ErrorCode, LlmMode, LlmResult, ResetParams, ServerMessage,
    StateBody, StepResponse, WireAction, WsError,
};

/// Errors of the client itself.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// A URL the client cannot use.
    #[error("server URL {url:?}: {why}")]
    BadUrl {
        /// The URL.
        url: String,
        /// Why.
        why: String,
    },
    /// The pool has no URLs.
    #[error("the server pool is empty")]
    NoServers,
    /// The configured token cannot be sent in a header.
    #[error("the access token must be non-empty visible ASCII (no spaces or control characters)")]
    BadToken,
    /// No server in the pool accepted a session.
    #[error("no server accepted a session: {}", .0.join("; "))]
    NoServerAvailable(Vec<String>),
    /// The connection failed or timed out.
    #[error("connection to {url}: {why}")]
    Connection {
        /// The server.
        url: String,
        /// Why.
        why: String,
    },
    /// The server answered with an error.
    #[error("server {url}: {} ({:?})", .error.message, .error.code)]
    Server {
        /// The server.
        url: String,
        /// Its error.
        error: WsError,
    },
    /// The server sent something this client does not understand.
    #[error("server {url} broke the protocol: {why}")]
    Protocol {
        /// The server.
        url: String,
        /// What.
        why: String,
    },
}

impl From<ClientError> for EnvError {
    fn from(e: ClientError) -> EnvError {
        EnvError::Remote(e.to_string())
    }
}

/// One server's address, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Server {
    /// As given.
    url: String,
    /// `host:port`.
    authority: String,
    /// The WebSocket URL (`ws://host:port/prefix/ws`).
    ws_url: String,
}

impl Server {
    fn parse(url: &str) -> Result<Server, ClientError> {
        let bad = |why: &str| ClientError::BadUrl {
            url: url.to_string(),
            why: why.to_string(),
        };
        let rest = ["ws://", "http://"]
            .iter()
            .find_map(|scheme| url.strip_prefix(scheme))
            .ok_or_else(|| {
                if url.starts_with("wss://") || url.starts_with("https://") {
                    bad("TLS is not supported: use ws:// or http:// (terminate TLS in a proxy)")
                } else {
                    bad("expected ws://host:port or http://host:port")
                }
            })?;
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        if authority.is_empty() {
            return Err(bad("no host"));
        }
        let authority = if authority
            .rsplit_once(':')
            .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        {
            authority.to_string()
        } else {
            format!("{authority}:80")
        };
        let prefix = path.trim_end_matches('/');
        let prefix = if prefix == "ws" {
            ""
        } else {
            prefix.strip_suffix("/ws").unwrap_or(prefix)
        };
        let ws_url = if prefix.is_empty() {
            format!("ws://{authority}/ws")
        } else {
            format!("ws://{authority}/{prefix}/ws")
        };
        Ok(Server {
            url: url.to_string(),
            authority,
            ws_url,
        })
    }
}

/// Timeouts, sizes and the access token of client connections.
#[derive(Clone, PartialEq)]
pub struct ClientConfig {
    /// Connecting and the WebSocket handshake.
    pub connect_timeout: Duration,
    /// Waiting for one answer (a reset or step, `llm()` calls answered locally excluded).
    pub message_timeout: Duration,
    /// Largest message accepted from a server.
    pub max_message_bytes: usize,
    /// The servers' access token, sent as `Authorization: Bearer <token>`; `None` sends none.
    pub token: Option<String>,
}

impl std::fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConfig")
            .field("connect_timeout", &self.connect_timeout)
            .field("message_timeout", &self.message_timeout)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl Default for ClientConfig {
    /// 10 s to connect, 180 s per answer (longer than the server's default step limit),
    /// 64 MiB messages, no token.
    fn default() -> ClientConfig {
        ClientConfig {
            connect_timeout: Duration::from_secs(10),
            message_timeout: Duration::from_secs(180),
            max_message_bytes: 64 << 20,
            token: None,
        }
    }
}

/// A shared list of servers; connections take them in turn.
#[derive(Clone, Debug)]
pub struct ServerPool {
    inner: Arc<PoolInner>,
}

#[derive(Debug)]
struct PoolInner {
    servers: Vec<Server>,
    next: AtomicUsize,
    config: ClientConfig,
}

impl ServerPool {
    /// A pool over `urls` (`ws://host:port` or `http://host:port`, optionally with a path
    /// prefix) with default timeouts.
    pub fn new<S: AsRef<str>>(urls: &[S]) -> Result<ServerPool, ClientError> {
        ServerPool::with_config(urls, ClientConfig::default())
    }

    /// A pool over `urls` with the given timeouts and token.
    pub fn with_config<S: AsRef<str>>(
        urls: &[S],
        config: ClientConfig,
    ) -> Result<ServerPool, ClientError> {
        if urls.is_empty() {
            return Err(ClientError::NoServers);
        }
        if let Some(token) = &config.token
            && (token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()))
        {
            return Err(ClientError::BadToken);
        }
        let servers = urls
            .iter()
            .map(|u| Server::parse(u.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ServerPool {
            inner: Arc::new(PoolInner {
                servers,
                next: AtomicUsize::new(0),
                config,
            }),
        })
    }

    /// The servers' URLs, as given.
    pub fn urls(&self) -> Vec<String> {
        self.inner.servers.iter().map(|s| s.url.clone()).collect()
    }

    fn next(&self) -> &Server {
        let i = self.inner.next.fetch_add(1, Ordering::Relaxed);
        &self.inner.servers[i % self.inner.servers.len()]
    }
}

/// An open session on one server.
struct Connection {
    server: Server,
    socket: WebSocket<TcpStream>,
}

/// The client side of the current episode.
struct Remote {
    task_id: String,
    done: bool,
    trajectory: Option<Trajectory>,
}

/// An [`Environment`] served by a Fathom environment server.
pub struct RemoteEnv {
    pool: ServerPool,
    sub_lm: Option<Arc<dyn SubLm>>,
    conn: Option<Connection>,
    episode: Option<Remote>,
    last: Option<StepResponse>,
}

impl RemoteEnv {
    /// An environment on `pool`'s servers, whose `llm()` calls the server answers.
    pub fn new(pool: ServerPool) -> RemoteEnv {
        RemoteEnv {
            pool,
            sub_lm: None,
            conn: None,
            episode: None,
            last: None,
        }
    }

    /// An environment whose `llm()` calls are sent back and answered by `sub_lm` here.
    pub fn with_sub_lm(pool: ServerPool, sub_lm: Arc<dyn SubLm>) -> RemoteEnv {
        let mut env = RemoteEnv::new(pool);
        env.sub_lm = Some(sub_lm);
        env
    }

    /// The URL of the server holding the current session, if connected.
    pub fn server(&self) -> Option<&str> {
        self.conn.as_ref().map(|c| c.server.url.as_str())
    }

    /// The last full response (observation with reward, score and trajectory fields).
    pub fn last_response(&self) -> Option<&StepResponse> {
        self.last.as_ref()
    }

    /// Asks the server for the session's state.
    pub fn state(&mut self) -> Result<StateBody, ClientError> {
        match self.exchange(&ClientMessage::State)? {
            ServerMessage::State(s) => Ok(*s),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Ends the session (the next reset opens a new one).
    pub fn close(&mut self) {
        if let Some(mut conn) = self.conn.take() {
            if let Ok(text) = serde_json::to_string(&ClientMessage::Close) {
                let _ = conn.socket.send(Message::Text(text.into()));
            }
            let _ = conn.socket.close(None);
            let _ = conn.socket.flush();
        }
        self.episode = None;
    }

    /// Connects to the pool's next server that accepts, trying each at most once.
    fn connect(&mut self, reset: &ClientMessage) -> Result<ServerMessage, ClientError> {
        let mut refusals = Vec::new();
        for _ in 0..self.pool.inner.servers.len() {
            let server = self.pool.next().clone();
            let url = server.url.clone();
            match open(&server, &self.pool.inner.config) {
                Ok(socket) => {
                    self.conn = Some(Connection { server, socket });
                    match self.exchange(reset) {
                        Ok(ServerMessage::Error(e)) if e.code == ErrorCode::CapacityReached => {
                            refusals.push(format!("{url}: {}", e.message));
                            self.conn = None;
                        }
                        Err(e) => {
                            refusals.push(e.to_string());
                            self.conn = None;
                        }
                        Ok(answer) => return Ok(answer),
                    }
                }
                Err(e) => refusals.push(e.to_string()),
            }
        }
        Err(ClientError::NoServerAvailable(refusals))
    }

    /// Sends one message and reads the answer, answering `llm` messages on the way.
    fn exchange(&mut self, msg: &ClientMessage) -> Result<ServerMessage, ClientError> {
        let text = serde_json::to_string(msg).map_err(|e| ClientError::Protocol {
            url: self.server().unwrap_or("?").into(),
            why: e.to_string(),
        })?;
        let sub_lm = self.sub_lm.clone();
        let Some(conn) = self.conn.as_mut() else {
            return Err(ClientError::Connection {
                url: "-".into(),
                why: "not connected".into(),
            });
        };
        let url = conn.server.url.clone();
        let lost = |why: String| ClientError::Connection {
            url: url.clone(),
            why,
        };
        let result = (|| {
            // A refused session (a full server) sends its error and closes; if the close
            // beats our send, the error is still there to read.
            let sent = conn.socket.send(Message::Text(text.into()));
            if let Err(e) = sent {
                return match conn.socket.read() {
                    Ok(Message::Text(t)) => {
                        serde_json::from_str::<ServerMessage>(&t).map_err(|_| lost(e.to_string()))
                    }
                    _ => Err(lost(e.to_string())),
                };
            }
            loop {
                let frame = match conn.socket.read() {
                    Ok(Message::Text(t)) => t,
                    Ok(Message::Close(_)) => {
                        return Err(lost("the server closed the session".into()));
                    }
                    Ok(_) => continue,
                    Err(tungstenite::Error::Io(e))
                        if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
                    {
                        return Err(lost("no answer within the message timeout".into()));
                    }
                    Err(e) => return Err(lost(e.to_string())),
                };
                let msg: ServerMessage =
                    serde_json::from_str(&frame).map_err(|e| ClientError::Protocol {
                        url: url.clone(),
                        why: format!("{e} in {}", frame.chars().take(200).collect::<String>()),
                    })?;
                let ServerMessage::Llm(call) = msg else {
                    return Ok(msg);
                };
                let result = match &sub_lm {
                    Some(lm) => match lm.complete(&call.prompt) {
                        Ok(text) => LlmResult {
                            id: call.id,
                            response: Some(text),
                            error: None,
                        },
                        Err(e) => LlmResult {
                            id: call.id,
                            response: None,
                            error: Some(e.to_string()),
                        },
                    },
                    None => LlmResult {
                        id: call.id,
                        response: None,
                        error: Some("this client answers no llm() calls".into()),
                    },
                };
                let reply = serde_json::to_string(&ClientMessage::LlmResult(result))
                    .map_err(|e| lost(e.to_string()))?;
                conn.socket
                    .send(Message::Text(reply.into()))
                    .map_err(|e| lost(e.to_string()))?;
            }
        })();
        // After a connection failure, or a SESSION_ERROR (the server ends the session and
        // closes the socket), this connection is done.
        let gone = match &result {
            Err(ClientError::Connection { .. }) => true,
            Ok(ServerMessage::Error(e)) => {
                matches!(e.code, ErrorCode::SessionError | ErrorCode::CapacityReached)
            }
            _ => false,
        };
        if gone {
            self.conn = None;
        }
        result
    }

    fn unexpected(&self, msg: &ServerMessage) -> ClientError {
        let url = self.server().unwrap_or("?").to_string();
        match msg {
            ServerMessage::Error(error) => ClientError::Server {
                url,
                error: error.clone(),
            },
            other => ClientError::Protocol {
                url,
                why: format!("unexpected {:?}", std::mem::discriminant(other)),
            },
        }
    }

    /// Applies an observation answer to the local episode record.
    fn observe(&mut self, msg: ServerMessage) -> Result<Observation, EnvError> {
        let ServerMessage::Observation(response) = msg else {
            return Err(self.unexpected(&msg).into());
        };
        let obs = response.observation.to_observation(response.done);
        self.episode = Some(Remote {
            task_id: response.observation.task_id.clone(),
            done: response.done,
            trajectory: response.observation.trajectory.clone(),
        });
        if response.done && response.observation.trajectory.is_none() {
            return Err(EnvError::Remote(
                "the server ended the episode without its trajectory".into(),
            ));
        }
        self.last = Some(*response);
        Ok(obs)
    }

    fn running(&self) -> Result<&Remote, EnvError> {
        let ep = self.episode.as_ref().ok_or(EnvError::NoEpisode)?;
        if ep.done {
            return Err(EnvError::EpisodeOver(ep.task_id.clone()));
        }
        Ok(ep)
    }

    fn send_action(&mut self, action: WireAction) -> Result<Observation, EnvError> {
        self.running()?;
        let msg = ClientMessage::Step(ActionParams::from_action(&action));
        let result = match self.exchange(&msg) {
            Ok(answer) => self.observe(answer),
            Err(e) => Err(e.into()),
        };
        // The episode cannot continue without its session.
        if self.conn.is_none() {
            self.episode = None;
        }
        result
    }
}

/// Opens a WebSocket to `server` with the configured timeouts.
fn open(server: &Server, config: &ClientConfig) -> Result<WebSocket<TcpStream>, ClientError> {
    let fail = |why: String| ClientError::Connection {
        url: server.url.clone(),
        why,
    };
    let addrs = server
        .authority
        .to_socket_addrs()
        .map_err(|e| fail(format!("cannot resolve {}: {e}", server.authority)))?;
    let mut last = format!("{} resolves to no address", server.authority);
    for addr in addrs {
        let stream = match TcpStream::connect_timeout(&addr, config.connect_timeout) {
            Ok(s) => s,
            Err(e) => {
                last = format!("{addr}: {e}");
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        stream
            .set_read_timeout(Some(config.connect_timeout))
            .and_then(|_| stream.set_write_timeout(Some(config.connect_timeout)))
            .map_err(|e| fail(e.to_string()))?;
        let ws_config = WebSocketConfig::default()
            .max_message_size(Some(config.max_message_bytes))
            .max_frame_size(Some(config.max_message_bytes));
        let mut request = server
            .ws_url
            .as_str()
            .into_client_request()
            .map_err(|e| fail(format!("WebSocket request: {e}")))?;
        if let Some(token) = &config.token {
            let value = HeaderValue::from_str(&format!("Bearer {token}"))
                .map_err(|_| ClientError::BadToken)?;
            request.headers_mut().insert("authorization", value);
        }
        let (socket, _) = tungstenite::client::client_with_config(request, stream, Some(ws_config))
            .map_err(|e| match e {
                tungstenite::HandshakeError::Failure(tungstenite::Error::Http(response))
                    if response.status() == 401 =>
                {
                    fail(if config.token.is_some() {
                        "the server refused the access token (401): check ClientConfig::token"
                            .to_string()
                    } else {
                        "the server needs an access token (401): set ClientConfig::token"
                            .to_string()
                    })
                }
                e => fail(format!("WebSocket handshake: {e}")),
            })?;
        socket
            .get_ref()
            .set_read_timeout(Some(config.message_timeout))
            .and_then(|_| {
                socket
                    .get_ref()
                    .set_write_timeout(Some(config.message_timeout))
            })
            .map_err(|e| fail(e.to_string()))?;
        return Ok(socket);
    }
    Err(fail(last))
}

impl Environment for RemoteEnv {
    fn reset(&mut self, request: ResetRequest) -> Result<Observation, EnvError> {
        self.episode = None;
        self.last = None;
        let mut params = ResetParams::from_request(&request);
        if self.sub_lm.is_some() {
            params.llm = Some(LlmMode::Client);
        }
        let msg = ClientMessage::Reset(params);
        let answer = match self.conn {
            Some(_) => match self.exchange(&msg) {
                Ok(answer) => answer,
                // A stale connection (server restarted, idle timeout): open a fresh session.
                Err(ClientError::Connection { .. }) => self.connect(&msg)?,
                Err(e) => return Err(e.into()),
            },
            None => self.connect(&msg)?,
        };
        self.observe(answer)
    }

    fn step(&mut self, action: AgentAction) -> Result<Observation, EnvError> {
        self.send_action(WireAction::Turn(action))
    }

    fn abort(&mut self, reason: &str) -> Result<(), EnvError> {
        self.send_action(WireAction::Abort(reason.to_string()))
            .map(|_| ())
    }

    fn trajectory(&self) -> Result<Trajectory, EnvError> {
        let ep = self.episode.as_ref().ok_or(EnvError::NoEpisode)?;
        match (&ep.trajectory, ep.done) {
            (Some(t), true) => Ok(t.clone()),
            _ => Err(EnvError::NotFinished(ep.task_id.clone())),
        }
    }
}

impl Drop for RemoteEnv {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_map_to_websocket_endpoints() {
        let s = Server::parse("http://127.0.0.1:8000").unwrap();
        assert_eq!(
            (s.authority.as_str(), s.ws_url.as_str()),
            ("127.0.0.1:8000", "ws://127.0.0.1:8000/ws")
        );
        assert_eq!(Server::parse("ws://h:9/ws").unwrap().ws_url, "ws://h:9/ws");
        assert_eq!(
            Server::parse("http://h/envs/a/").unwrap().ws_url,
            "ws://h:80/envs/a/ws"
        );
        assert_eq!(
            Server::parse("ws://h:1/news").unwrap().ws_url,
            "ws://h:1/news/ws"
        );
        assert!(
            Server::parse("https://h:1")
                .unwrap_err()
                .to_string()
                .contains("TLS")
        );
        assert!(Server::parse("h:1").is_err());
        assert!(matches!(
            ServerPool::new::<&str>(&[]),
            Err(ClientError::NoServers)
        ));
    }

    #[test]
    fn the_pool_takes_servers_in_turn() {
        let pool = ServerPool::new(&["ws://a:1", "ws://b:2"]).unwrap();
        let order: Vec<String> = (0..4).map(|_| pool.next().authority.clone()).collect();
        assert_eq!(order, ["a:1", "b:2", "a:1", "b:2"]);
    }

    #[test]
    fn misuse_is_caught_locally() {
        let mut env = RemoteEnv::new(ServerPool::new(&["ws://127.0.0.1:1"]).unwrap());
        assert!(matches!(
            env.step(AgentAction::Code("1".into())),
            Err(EnvError::NoEpisode)
        ));
        assert!(matches!(env.trajectory(), Err(EnvError::NoEpisode)));
        // Nothing listens on port 1: the reset names the refusal.
        let err = env.reset(ResetRequest::Seed(1)).unwrap_err().to_string();
        assert!(err.contains("no server accepted a session"), "{err}");
    }
}
