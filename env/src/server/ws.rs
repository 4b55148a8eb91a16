//! The WebSocket session (`/ws`), as OpenEnv's `EnvClient` speaks it: one session per
//! connection (or an attached HTTP session with `?session_id=`), JSON text messages
//! `{"type": "reset" | "step" | "state" | "close" | "mcp", "data": …}` answered by
//! `observation`, `state`, `mcp` or `error` (with OpenEnv's error codes).
//!
//! A full server accepts the connection, sends `CAPACITY_REACHED` and closes it, as OpenEnv
//! does, so a client fails at once instead of hanging. While a reset or step runs, the
//! connection task also watches the socket (a client that disconnects ends its session; the
//! step's worker is killed when the step returns), the step's deadline, the server's
//! shutdown, and — for sessions reset with `"llm": "client"` — the `llm()` calls to forward
//! to the client as `llm` messages, answered by `llm_result`.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::{ConnectInfo, RawQuery, State};
use axum::response::Response;
use serde::Deserialize;
use serde_json::Value;
use tokio::sync::{mpsc, watch};

use super::episode::EnvSession;
use super::sessions::{Kind, Refusal, SessionCell};
use super::{
    App, ClientSubLm, PendingLlm, RunError, SessionError, client_ip, fresh, fresh_id, joined,
    spawn_env,
};
use crate::sublm::SubLm;
use crate::wire::{
    self, ActionParams, ErrorCode, FieldError, LlmMode, LlmRequest, LlmResult, ResetParams,
    ServerMessage, StepResponse, ValidReset, WireAction, WsError,
};

/// The query of `/ws`.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct WsQuery {
    session_id: Option<String>,
}

/// `GET /ws`: upgrades to the session protocol.
pub(crate) async fn handler(
    ws: WebSocketUpgrade,
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    RawQuery(query): RawQuery,
) -> Response {
    let client = client_ip(peer);
    let query = serde_urlencoded::from_str::<WsQuery>(query.as_deref().unwrap_or(""))
        .map_err(|e| WsError::invalid(vec![FieldError::value(&["query"], format!("query: {e}"))]));
    let limit = app.config.max_body_bytes;
    ws.max_message_size(limit)
        .max_frame_size(limit)
        .on_upgrade(move |socket| run(socket, app, query, client))
}

/// Counts a live connection task for the length of its life.
struct Live(Arc<App>);

impl Drop for Live {
    fn drop(&mut self) {
        self.0.sockets.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One incoming message, validated.
enum Incoming {
    Reset(ValidReset),
    Step(WireAction),
    State,
    Close,
    Mcp(Value),
    LlmResult(LlmResult),
}

/// What came off the socket.
enum Frame {
    Text(String),
    Binary,
    Gone,
}

/// How a connection's loop ended.
enum End {
    /// Keep serving.
    Continue,
    /// Close the connection.
    Stop,
}

async fn run(socket: WebSocket, app: Arc<App>, query: Result<WsQuery, WsError>, client: IpAddr) {
    app.sockets.fetch_add(1, Ordering::SeqCst);
    let _live = Live(Arc::clone(&app));
    let (calls_tx, calls) = mpsc::channel(4);
    let mut conn = Conn {
        shutdown: app.shutdown.clone(),
        app,
        socket,
        calls,
        calls_tx,
        next_llm: 0,
        client,
    };
    let cell = match query.and_then(|q| conn.open(q.session_id)) {
        Ok(cell) => cell,
        Err(e) => {
            conn.send(&ServerMessage::Error(e)).await;
            conn.close().await;
            return;
        }
    };
    tracing::info!(session = %cell.id, "WebSocket session open");
    let _session = Owned {
        app: Arc::clone(&conn.app),
        cell: Arc::clone(&cell),
    };
    conn.serve(&cell).await;
    conn.close().await;
}

/// Ends (or detaches from) the connection's session when the connection task ends, however
/// it ends, so a session is never left counted against the limit.
struct Owned {
    app: Arc<App>,
    cell: Arc<SessionCell>,
}

impl Drop for Owned {
    fn drop(&mut self) {
        let cell = &self.cell;
        let close = match cell.kind {
            Kind::Socket => true,
            Kind::Http => {
                cell.attached.store(false, Ordering::SeqCst);
                cell.pending_close.load(Ordering::SeqCst)
            }
        };
        if close && let Some(ended) = self.app.registry.close(&cell.id) {
            // Ending the env kills its worker; off the async threads. A step still running
            // holds another reference and ends it when it returns.
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn_blocking(move || drop(ended));
                }
                Err(_) => drop(ended),
            }
        }
        tracing::info!(session = %cell.id, "WebSocket session closed");
    }
}

struct Conn {
    app: Arc<App>,
    socket: WebSocket,
    shutdown: watch::Receiver<bool>,
    calls: mpsc::Receiver<PendingLlm>,
    calls_tx: mpsc::Sender<PendingLlm>,
    next_llm: u64,
    /// The client's address, charged for the session.
    client: IpAddr,
}

impl Conn {
    /// Opens this connection's session, or attaches to an HTTP one.
    fn open(&self, attach: Option<String>) -> Result<Arc<SessionCell>, WsError> {
        match attach {
            Some(id) => {
                let cell = self.app.registry.http(&id).ok_or_else(|| {
                    WsError::new(ErrorCode::SessionError, format!("Unknown session_id: {id}"))
                })?;
                if cell.attached.swap(true, Ordering::SeqCst) {
                    return Err(WsError::new(
                        ErrorCode::SessionError,
                        format!("Session {id} already has an attached WebSocket"),
                    ));
                }
                cell.touch();
                Ok(cell)
            }
            None => {
                let env =
                    EnvSession::new(self.app.services.clone(), Arc::clone(&self.app.composite));
                let id =
                    fresh_id().map_err(|e| WsError::new(ErrorCode::FactoryError, e.to_string()))?;
                self.app
                    .registry
                    .open(id, Kind::Socket, env, self.client)
                    .map_err(|refusal| {
                        let (active, max) = match refusal {
                            Refusal::Full { active, max } => (active, max),
                            Refusal::ClientShare { active, total, .. } => (active, total),
                        };
                        WsError {
                            active_sessions: Some(active),
                            max_sessions: Some(max),
                            ..WsError::new(ErrorCode::CapacityReached, refusal.to_string())
                        }
                    })
            }
        }
    }

    async fn serve(&mut self, cell: &Arc<SessionCell>) {
        let idle = self.app.config.idle_timeout;
        loop {
            let frame = tokio::select! {
                biased;
                _ = shut_down(&mut self.shutdown) => {
                    self.error(ErrorCode::SessionError, "the server is shutting down").await;
                    return;
                }
                f = tokio::time::timeout(idle, next_frame(&mut self.socket)) => f,
            };
            let text = match frame {
                Err(_) => {
                    let secs = idle.as_secs_f64();
                    self.error(
                        ErrorCode::SessionError,
                        format!("session idle for more than {secs} s; closed"),
                    )
                    .await;
                    return;
                }
                Ok(Frame::Gone) => return,
                Ok(Frame::Binary) => {
                    self.error(
                        ErrorCode::InvalidJson,
                        "Invalid JSON: binary frames are not supported; send JSON text",
                    )
                    .await;
                    continue;
                }
                Ok(Frame::Text(t)) => t,
            };
            cell.touch();
            let incoming = match parse(&text) {
                Ok(i) => i,
                Err(e) => {
                    self.send(&ServerMessage::Error(e)).await;
                    continue;
                }
            };
            let end = match incoming {
                Incoming::Close => End::Stop,
                Incoming::State => {
                    self.send(&ServerMessage::State(Box::new(cell.state())))
                        .await;
                    End::Continue
                }
                Incoming::Mcp(request) => {
                    let response =
                        super::mcp::handle(&self.app, request, Some(&cell.id), self.client);
                    self.send(&ServerMessage::Mcp(response)).await;
                    End::Continue
                }
                Incoming::LlmResult(r) => {
                    let msg = format!("no llm() call with id {} is waiting for a result", r.id);
                    self.error(ErrorCode::ValidationError, msg).await;
                    End::Continue
                }
                Incoming::Reset(valid) => {
                    let lm: Option<Arc<dyn SubLm>> = (valid.llm == LlmMode::Client).then(|| {
                        Arc::new(ClientSubLm {
                            calls: self.calls_tx.clone(),
                            timeout: self.app.config.llm_timeout,
                        }) as Arc<dyn SubLm>
                    });
                    match fresh() {
                        Ok(fresh) => self.run(cell, move |s| s.reset(valid, fresh, lm)).await,
                        Err(e) => {
                            self.error(ErrorCode::ExecutionError, e.to_string()).await;
                            End::Continue
                        }
                    }
                }
                Incoming::Step(action) => self.run(cell, move |s| s.step(action)).await,
            };
            if matches!(end, End::Stop) {
                return;
            }
        }
    }

    /// Runs a reset or step while watching the socket, the deadline, shutdown and `llm()`.
    async fn run(
        &mut self,
        cell: &Arc<SessionCell>,
        f: impl FnOnce(&mut EnvSession) -> Result<StepResponse, SessionError> + Send + 'static,
    ) -> End {
        let mut task = spawn_env(Arc::clone(cell), f);
        let limit = self.app.config.step_timeout;
        let deadline = tokio::time::sleep(limit);
        tokio::pin!(deadline);
        let mut waiting: Option<(u64, std::sync::mpsc::Sender<Result<String, String>>)> = None;
        loop {
            tokio::select! {
                biased;
                done = &mut task => {
                    let msg = match joined(done) {
                        Ok(response) => ServerMessage::Observation(Box::new(response)),
                        Err(e) => ServerMessage::Error(run_error(e)),
                    };
                    self.send(&msg).await;
                    return End::Continue;
                }
                _ = shut_down(&mut self.shutdown) => {
                    self.error(ErrorCode::SessionError, "the server is shutting down").await;
                    return End::Stop;
                }
                _ = &mut deadline => {
                    tracing::warn!(session = %cell.id, "step ran past its limit; session ended");
                    let msg = format!("the step ran past its {} s limit; the session is closed", limit.as_secs_f64());
                    self.error(ErrorCode::SessionError, msg).await;
                    return End::Stop;
                }
                Some(call) = self.calls.recv() => {
                    self.next_llm += 1;
                    let request = LlmRequest { id: self.next_llm, prompt: call.prompt };
                    waiting = Some((self.next_llm, call.reply));
                    self.send(&ServerMessage::Llm(request)).await;
                }
                frame = next_frame(&mut self.socket) => match frame {
                    Frame::Gone => {
                        tracing::info!(session = %cell.id, "client disconnected during a step");
                        return End::Stop;
                    }
                    Frame::Binary => {
                        self.error(ErrorCode::InvalidJson, "Invalid JSON: binary frames are not supported").await;
                    }
                    Frame::Text(text) => match parse(&text) {
                        Ok(Incoming::LlmResult(r)) if waiting.as_ref().is_some_and(|w| w.0 == r.id) => {
                            let (_, reply) = waiting.take().expect("a call is waiting");
                            let answer = match (r.response, r.error) {
                                (Some(text), None) => Ok(text),
                                (_, Some(e)) => Err(e),
                                (None, None) => Err("the llm_result had neither response nor error".into()),
                            };
                            let _ = reply.send(answer);
                        }
                        Ok(Incoming::LlmResult(r)) => {
                            let msg = format!("no llm() call with id {} is waiting for a result", r.id);
                            self.error(ErrorCode::ValidationError, msg).await;
                        }
                        Ok(Incoming::Close) => return End::Stop,
                        Ok(_) => {
                            self.error(ErrorCode::ExecutionError, "a reset or step is running: only llm_result messages are accepted until its observation").await;
                        }
                        Err(e) => self.send(&ServerMessage::Error(e)).await,
                    },
                },
            }
        }
    }

    async fn send(&mut self, msg: &ServerMessage) {
        match serde_json::to_string(msg) {
            Ok(text) => {
                if let Err(e) = self.socket.send(Message::Text(text.into())).await {
                    tracing::debug!(error = %e, "could not send to a WebSocket client");
                }
            }
            Err(e) => tracing::error!(error = %e, "could not serialise a message"),
        }
    }

    async fn error(&mut self, code: ErrorCode, message: impl Into<String>) {
        self.send(&ServerMessage::Error(WsError::new(code, message)))
            .await;
    }

    async fn close(&mut self) {
        let frame = CloseFrame {
            code: 1000,
            reason: "session closed".into(),
        };
        let _ = self.socket.send(Message::Close(Some(frame))).await;
    }
}

/// The next text or binary message; pings and pongs are skipped (they are not activity).
async fn next_frame(socket: &mut WebSocket) -> Frame {
    loop {
        match socket.recv().await {
            Some(Ok(Message::Text(t))) => return Frame::Text(t.to_string()),
            Some(Ok(Message::Binary(_))) => return Frame::Binary,
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
            Some(Ok(Message::Close(_))) | None => return Frame::Gone,
            Some(Err(e)) => {
                tracing::info!(error = %e, "WebSocket connection failed");
                return Frame::Gone;
            }
        }
    }
}

/// Resolves once the server is shutting down.
async fn shut_down(rx: &mut watch::Receiver<bool>) {
    loop {
        if *rx.borrow_and_update() {
            return;
        }
        if rx.changed().await.is_err() {
            return;
        }
    }
}

fn run_error(e: RunError) -> WsError {
    match e {
        RunError::Session(SessionError::Invalid(errors)) => {
            WsError::invalid(errors.into_iter().map(|e| e.under(&["data"])).collect())
        }
        RunError::Session(e) => WsError::new(ErrorCode::ExecutionError, e.to_string()),
        RunError::Busy => WsError::new(
            ErrorCode::ExecutionError,
            "a step is already running in this session",
        ),
        RunError::Broken => WsError::new(
            ErrorCode::SessionError,
            "the session broke in an earlier step; reconnect",
        ),
        RunError::Panicked => WsError::new(
            ErrorCode::ExecutionError,
            "the step failed inside the server",
        ),
    }
}

/// Validates one text message.
fn parse(text: &str) -> Result<Incoming, WsError> {
    let value: Value = serde_json::from_str(text)
        .map_err(|e| WsError::new(ErrorCode::InvalidJson, format!("Invalid JSON: {e}")))?;
    let Value::Object(mut map) = value else {
        return Err(WsError::invalid(vec![FieldError::value(
            &["type"],
            "a message is a JSON object: {\"type\": …, \"data\": …}",
        )]));
    };
    let kind = match map.remove("type") {
        Some(Value::String(s)) => s,
        None => String::new(),
        Some(_) => {
            return Err(WsError::invalid(vec![FieldError::value(
                &["type"],
                "type: must be a string",
            )]));
        }
    };
    let data = map.remove("data");
    if let Some(extra) = map.keys().next() {
        let msg = format!("{extra}: unknown field `{extra}`, expected `type` or `data`");
        return Err(WsError::invalid(vec![FieldError {
            loc: vec![extra.clone()],
            msg,
            kind: "extra_forbidden".into(),
        }]));
    }
    let under = |e: FieldError| WsError::invalid(vec![e.under(&["data"])]);
    let required = |data: Option<Value>| {
        data.ok_or_else(|| {
            WsError::invalid(vec![FieldError::missing(&["data"], "data: field required")])
        })
    };
    let no_data = |data: Option<Value>, kind: &str| match data {
        None => Ok(()),
        Some(_) => Err(WsError::invalid(vec![FieldError {
            loc: vec!["data".into()],
            msg: format!("data: a {kind} message has no data"),
            kind: "extra_forbidden".into(),
        }])),
    };
    match kind.as_str() {
        "reset" => {
            let params: ResetParams = match data {
                None | Some(Value::Null) => ResetParams::default(),
                Some(v) => wire::from_value(v).map_err(under)?,
            };
            if params.session_id.is_some() {
                return Err(under(FieldError::value(
                    &["session_id"],
                    "session_id is for HTTP resets: a WebSocket is its own session (attach with /ws?session_id=…)",
                )));
            }
            params.validate().map(Incoming::Reset).map_err(|errors| {
                WsError::invalid(errors.into_iter().map(|e| e.under(&["data"])).collect())
            })
        }
        "step" => {
            let params: ActionParams = wire::from_value(required(data)?).map_err(under)?;
            params.validate().map(Incoming::Step).map_err(under)
        }
        "state" => no_data(data, "state").map(|_| Incoming::State),
        "close" => no_data(data, "close").map(|_| Incoming::Close),
        "mcp" => match required(data)? {
            v @ Value::Object(_) => Ok(Incoming::Mcp(v)),
            _ => Err(WsError::invalid(vec![FieldError::value(
                &["data"],
                "data: must be a JSON-RPC request object",
            )])),
        },
        "llm_result" => wire::from_value(required(data)?)
            .map(Incoming::LlmResult)
            .map_err(under),
        other => Err(WsError::new(
            ErrorCode::UnknownType,
            format!("Unknown message type: {other}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(text: &str) -> (ErrorCode, String) {
        match parse(text) {
            Err(e) => (e.code, e.message),
            Ok(_) => panic!("{text} parsed"),
        }
    }

    #[test]
    fn malformed_messages_get_openenv_codes_naming_the_field() {
        assert_eq!(code("{not json").0, ErrorCode::InvalidJson);
        assert_eq!(
            code(r#"{"type": "dance"}"#),
            (ErrorCode::UnknownType, "Unknown message type: dance".into())
        );
        assert_eq!(code(r#"{"data": {}}"#).0, ErrorCode::UnknownType);
        let (c, m) = code(r#"{"type": "step", "data": {"code": 1}}"#);
        assert_eq!(c, ErrorCode::ValidationError);
        assert!(m.contains("data.code: invalid type"), "{m}");
        let (_, m) = code(r#"{"type": "step", "data": {"kode": "x"}}"#);
        assert!(m.contains("data.kode: unknown field `kode`"), "{m}");
        let (_, m) = code(r#"{"type": "reset", "data": {"split": "eval"}, "extra": 1}"#);
        assert!(m.contains("extra: unknown field"), "{m}");
        let (_, m) = code(r#"{"type": "reset", "data": {"split": "dev", "index": 1}}"#);
        assert!(m.contains("data.split: unknown variant `dev`"), "{m}");
        let (_, m) = code(r#"{"type": "step"}"#);
        assert!(m.contains("data: field required"), "{m}");
        let (_, m) = code(r#"{"type": "reset", "data": {"session_id": "x"}}"#);
        assert!(m.contains("session_id is for HTTP resets"), "{m}");
    }

    #[test]
    fn good_messages_parse() {
        assert!(matches!(
            parse(r#"{"type": "reset"}"#),
            Ok(Incoming::Reset(_))
        ));
        assert!(matches!(
            parse(r#"{"type": "reset", "data": {}}"#),
            Ok(Incoming::Reset(_))
        ));
        assert!(matches!(
            parse(r#"{"type": "step", "data": {"message": "hi"}}"#),
            Ok(Incoming::Step(_))
        ));
        assert!(matches!(parse(r#"{"type": "state"}"#), Ok(Incoming::State)));
        assert!(matches!(parse(r#"{"type": "close"}"#), Ok(Incoming::Close)));
        assert!(matches!(
            parse(r#"{"type": "llm_result", "data": {"id": 1, "response": "x"}}"#),
            Ok(Incoming::LlmResult(_))
        ));
    }
}
