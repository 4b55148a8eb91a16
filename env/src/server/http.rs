//! The HTTP routes: health, metadata, schemas, sessions, and the reset / step / state of HTTP
//! sessions. Bodies are read with the configured size limit and parsed strictly; errors are
//! FastAPI-shaped JSON (`{"detail": [{"loc", "msg", "type"}]}` for 422, `{"detail": "…"}`
//! otherwise), so OpenEnv tooling reads them as it reads OpenEnv's own.
//!
//! Every status a route can answer is listed in its `utoipa::path` (401 is added to every
//! route but `/health` by the document when a token is configured); the schemathesis test
//! checks that the server answers nothing else.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::episode::{EnvSession, SessionError};
use super::sessions::{Kind, Refusal};
use super::{App, RunError, client_ip, fresh, fresh_id, joined, spawn_env};
use crate::wire::{
    self, FieldError, LlmMode, MAX_REQUEST_ID_CHARS, ResetParams, StateBody, StepParams,
    StepResponse,
};

/// An HTTP error response.
#[derive(Debug)]
pub(crate) enum ApiError {
    /// 422 with one entry per field.
    Invalid(Vec<FieldError>),
    /// Any other status with a message.
    Status(StatusCode, String),
}

/// A 422 body.
#[derive(Serialize, Deserialize, ToSchema)]
pub struct ValidationErrorBody {
    /// One entry per offending field.
    pub detail: Vec<FieldError>,
}

/// The body of every other error.
#[derive(Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// What went wrong.
    pub detail: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            ApiError::Invalid(detail) => (
                StatusCode::UNPROCESSABLE_ENTITY,
                Json(ValidationErrorBody { detail }),
            )
                .into_response(),
            ApiError::Status(status, detail) => {
                (status, Json(ErrorBody { detail })).into_response()
            }
        }
    }
}

impl ApiError {
    fn body(errors: Vec<FieldError>) -> ApiError {
        ApiError::Invalid(errors.into_iter().map(|e| e.under(&["body"])).collect())
    }
}

impl From<SessionError> for ApiError {
    fn from(e: SessionError) -> ApiError {
        match e {
            SessionError::Invalid(errors) => ApiError::body(errors),
            SessionError::Conflict(m) => ApiError::Status(StatusCode::CONFLICT, m),
            SessionError::Unavailable(m) => ApiError::Status(StatusCode::SERVICE_UNAVAILABLE, m),
            SessionError::Internal(m) => ApiError::Status(StatusCode::INTERNAL_SERVER_ERROR, m),
        }
    }
}

impl From<Refusal> for ApiError {
    fn from(r: Refusal) -> ApiError {
        let status = match r {
            Refusal::Full { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Refusal::ClientShare { .. } => StatusCode::TOO_MANY_REQUESTS,
        };
        ApiError::Status(status, r.to_string())
    }
}

fn run_error(e: RunError, session: &str) -> ApiError {
    match e {
        RunError::Session(e) => e.into(),
        RunError::Busy => ApiError::Status(
            StatusCode::CONFLICT,
            format!("a step is already running in session {session}"),
        ),
        RunError::Broken => ApiError::Status(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("session {session} broke in an earlier step; open a new one"),
        ),
        RunError::Panicked => ApiError::Status(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the step failed inside the server".to_string(),
        ),
    }
}

/// Reads a request body of at most `limit` bytes.
pub(crate) async fn read_body(req: Request, limit: usize) -> Result<axum::body::Bytes, ApiError> {
    let too_large = || {
        ApiError::Status(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than the server's limit of {limit} bytes"),
        )
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    axum::body::to_bytes(req.into_body(), limit)
        .await
        .map_err(|e| {
            if e.to_string().contains("length limit") {
                too_large()
            } else {
                ApiError::Status(
                    StatusCode::BAD_REQUEST,
                    format!("cannot read the request body: {e}"),
                )
            }
        })
}

/// `GET /health`.
#[derive(Serialize, Deserialize, ToSchema)]
pub struct HealthBody {
    /// Always `healthy` while the server answers.
    pub status: String,
}

/// `GET /metadata`.
#[derive(Serialize, Deserialize, ToSchema)]
pub struct MetadataBody {
    /// The environment's name.
    pub name: String,
    /// What it does.
    pub description: String,
    /// The crate's README.
    pub readme_content: Option<String>,
    /// The crate's version.
    pub version: Option<String>,
    /// Who wrote it.
    pub author: Option<String>,
    /// Where it is documented.
    pub documentation_url: Option<String>,
}

/// `GET /sessions`.
#[derive(Serialize, Deserialize, ToSchema)]
pub struct CapacityBody {
    /// Sessions open (WebSocket and HTTP).
    pub active_sessions: usize,
    /// Sessions allowed.
    pub max_sessions: usize,
    /// Sessions held by the address that asked.
    pub client_sessions: usize,
    /// Sessions one client address may hold.
    pub max_sessions_per_client: usize,
}

/// `GET /schema`.
#[derive(Serialize, Deserialize, ToSchema)]
pub struct SchemaBody {
    /// JSON Schema of the action.
    #[schema(value_type = Object)]
    pub action: serde_json::Value,
    /// JSON Schema of the observation.
    #[schema(value_type = Object)]
    pub observation: serde_json::Value,
    /// JSON Schema of the state.
    #[schema(value_type = Object)]
    pub state: serde_json::Value,
}

/// The server's health.
#[utoipa::path(get, path = "/health", tag = "Health", responses((status = 200, body = HealthBody)))]
pub(crate) async fn health() -> Json<HealthBody> {
    Json(HealthBody {
        status: "healthy".into(),
    })
}

/// What this environment is.
#[utoipa::path(get, path = "/metadata", tag = "Environment Info", responses((status = 200, body = MetadataBody)))]
pub(crate) async fn metadata() -> Json<MetadataBody> {
    Json(MetadataBody {
        name: "fathom".into(),
        description: "Fathom's RLM environment: answer a question about a long document held \
                      in a sandboxed Python REPL as `context`, with llm() for sub-calls."
            .into(),
        readme_content: Some(include_str!("../../README.md").into()),
        version: Some(env!("CARGO_PKG_VERSION").into()),
        author: None,
        documentation_url: None,
    })
}

/// JSON Schemas of the action, observation and state.
#[utoipa::path(get, path = "/schema", tag = "Schema", responses((status = 200, body = SchemaBody)))]
pub(crate) async fn schema(State(app): State<Arc<App>>) -> Json<serde_json::Value> {
    Json(app.schema_json.clone())
}

/// The OpenAPI document.
pub(crate) async fn openapi(State(app): State<Arc<App>>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        app.openapi_json.clone(),
    )
        .into_response()
}

/// Sessions open and allowed.
#[utoipa::path(get, path = "/sessions", tag = "Health", responses((status = 200, body = CapacityBody)))]
pub(crate) async fn sessions(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
) -> Json<CapacityBody> {
    let (active_sessions, max_sessions) = app.registry.counts();
    Json(CapacityBody {
        active_sessions,
        max_sessions,
        client_sessions: app.registry.held_by(client_ip(peer)),
        max_sessions_per_client: app.config.max_sessions_per_client(),
    })
}

/// Starts an episode in a new HTTP session (or in `session_id`'s).
#[utoipa::path(
    post, path = "/reset", tag = "Environment Control", request_body = ResetParams,
    responses(
        (status = 200, description = "The first observation; `metadata.session_id` names the session", body = StepResponse),
        (status = 400, description = "The body could not be read (the connection failed)", body = ErrorBody),
        (status = 404, description = "Unknown session_id", body = ErrorBody),
        (status = 409, description = "A step is already running in session_id", body = ErrorBody),
        (status = 413, description = "Body larger than the server's limit", body = ErrorBody),
        (status = 422, description = "Invalid request, naming the field", body = ValidationErrorBody),
        (status = 429, description = "This client's address already holds its share of the sessions", body = ErrorBody),
        (status = 500, description = "The server failed (a bug)", body = ErrorBody),
        (status = 503, description = "Server at capacity, or no sandbox worker (OpenEnv treats capacity as a server condition)", body = ErrorBody),
        (status = 504, description = "The reset ran past the server's step limit; the session was ended", body = ErrorBody),
    )
)]
pub(crate) async fn reset(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request,
) -> Result<Json<StepResponse>, ApiError> {
    let bytes = read_body(req, app.config.max_body_bytes).await?;
    let params: ResetParams = if bytes.iter().all(u8::is_ascii_whitespace) {
        ResetParams::default()
    } else {
        wire::parse_json(&bytes).map_err(|e| ApiError::body(vec![e]))?
    };
    let valid = params.validate().map_err(ApiError::body)?;
    if valid.llm == LlmMode::Client {
        return Err(ApiError::body(vec![FieldError::value(
            &["llm"],
            "llm=client needs a WebSocket session (/ws): HTTP cannot carry llm() calls back to the client",
        )]));
    }
    let fresh = fresh()?;
    let (cell, opened) = match &valid.session_id {
        Some(id) => (
            app.registry.http(id).ok_or_else(|| unknown_session(id))?,
            false,
        ),
        None => {
            let env = EnvSession::new(app.services.clone(), Arc::clone(&app.composite));
            let client = client_ip(peer);
            (
                app.registry.open(fresh_id()?, Kind::Http, env, client)?,
                true,
            )
        }
    };
    let id = cell.id.clone();
    cell.touch();
    tracing::info!(session = %id, opened, "HTTP reset");
    let task = spawn_env(cell, move |s| s.reset(valid, fresh, None));
    let result = match tokio::time::timeout(app.config.step_timeout, task).await {
        Ok(done) => joined(done).map_err(|e| run_error(e, &id)),
        Err(_) => Err(timed_out(&app, &id, app.config.step_timeout)),
    };
    match result {
        Ok(mut response) => {
            response.metadata = Some(session_metadata(&id));
            Ok(Json(response))
        }
        Err(e) => {
            if opened && let Some(cell) = app.registry.close(&id) {
                tokio::task::spawn_blocking(move || drop(cell));
            }
            Err(e)
        }
    }
}

/// Takes one turn in an HTTP session.
#[utoipa::path(
    post, path = "/step", tag = "Environment Control", request_body = StepParams,
    responses(
        (status = 200, description = "The observation after the turn", body = StepResponse),
        (status = 400, description = "The body could not be read (the connection failed)", body = ErrorBody),
        (status = 404, description = "Unknown session_id", body = ErrorBody),
        (status = 409, description = "No episode, episode over, or a step already running", body = ErrorBody),
        (status = 413, description = "Body larger than the server's limit", body = ErrorBody),
        (status = 422, description = "Invalid request, naming the field", body = ValidationErrorBody),
        (status = 500, description = "The server failed (a bug), or the session broke in an earlier step", body = ErrorBody),
        (status = 503, description = "The session's sandbox worker could not be restarted", body = ErrorBody),
        (status = 504, description = "The step ran past its limit (the server's, or timeout_s); the session was ended", body = ErrorBody),
    )
)]
pub(crate) async fn step(
    State(app): State<Arc<App>>,
    req: Request,
) -> Result<Json<StepResponse>, ApiError> {
    let bytes = read_body(req, app.config.max_body_bytes).await?;
    let params: StepParams = wire::parse_json(&bytes).map_err(|e| ApiError::body(vec![e]))?;
    let action = params
        .action
        .validate()
        .map_err(|e| ApiError::body(vec![e.under(&["action"])]))?;
    let Some(id) = params.session_id else {
        return Err(ApiError::body(vec![FieldError::missing(
            &["session_id"],
            "session_id is required: POST /reset returns it in metadata.session_id",
        )]));
    };
    let mut limit = app.config.step_timeout;
    if let Some(t) = params.timeout_s {
        if !(t.is_finite() && t > 0.0) {
            return Err(ApiError::body(vec![FieldError::value(
                &["timeout_s"],
                "timeout_s must be a positive number of seconds",
            )]));
        }
        limit = limit.min(Duration::from_secs_f64(t.min(1e9)));
    }
    if let Some(r) = &params.request_id
        && r.chars().count() > MAX_REQUEST_ID_CHARS
    {
        return Err(ApiError::body(vec![FieldError::value(
            &["request_id"],
            format!("request_id must have at most {MAX_REQUEST_ID_CHARS} characters"),
        )]));
    }
    let cell = app.registry.http(&id).ok_or_else(|| unknown_session(&id))?;
    cell.touch();
    tracing::debug!(session = %id, request_id = ?params.request_id, "HTTP step");
    let task = spawn_env(cell, move |s| s.step(action));
    let response = match tokio::time::timeout(limit, task).await {
        Ok(done) => joined(done).map_err(|e| run_error(e, &id))?,
        Err(_) => return Err(timed_out(&app, &id, limit)),
    };
    Ok(Json(StepResponse {
        metadata: Some(session_metadata(&id)),
        ..response
    }))
}

/// The query of `GET /state`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StateQuery {
    session_id: Option<String>,
}

/// The state of an HTTP session (or, without `session_id`, of a session with no episode).
#[utoipa::path(
    get, path = "/state", tag = "State Management",
    params(("session_id" = Option<String>, Query, description = "An HTTP session")),
    responses(
        (status = 200, body = StateBody),
        (status = 404, description = "Unknown session_id", body = ErrorBody),
        (status = 422, description = "Unknown query parameter", body = ValidationErrorBody),
    )
)]
pub(crate) async fn state(
    State(app): State<Arc<App>>,
    req: Request,
) -> Result<Json<StateBody>, ApiError> {
    let query = req.uri().query().unwrap_or("");
    let q: StateQuery = serde_urlencoded::from_str(query).map_err(|e| {
        let text = e.to_string();
        let field = text.split('`').nth(1).unwrap_or("query").to_string();
        ApiError::Invalid(vec![FieldError {
            loc: vec!["query".into(), field.clone()],
            msg: format!("{field}: {text}"),
            kind: "extra_forbidden".into(),
        }])
    })?;
    match q.session_id {
        Some(id) => {
            let cell = app.registry.http(&id).ok_or_else(|| unknown_session(&id))?;
            Ok(Json(cell.state()))
        }
        None => Ok(Json(StateBody {
            max_turns: app.services.config.max_turns,
            ..StateBody::default()
        })),
    }
}

/// JSON-RPC 2.0 (MCP). Errors are JSON-RPC errors with status 200, as in OpenEnv.
#[utoipa::path(
    post, path = "/mcp", tag = "MCP", request_body(content = Object, description = "A JSON-RPC 2.0 request"),
    responses(
        (status = 200, description = "A JSON-RPC 2.0 response (errors too, as in OpenEnv)", body = Object),
        (status = 400, description = "The body could not be read (the connection failed)", body = ErrorBody),
        (status = 413, description = "Body larger than the server's limit", body = ErrorBody),
    )
)]
pub(crate) async fn mcp(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request,
) -> Result<Json<serde_json::Value>, ApiError> {
    let bytes = read_body(req, app.config.max_body_bytes).await?;
    Ok(Json(super::mcp::handle_bytes(
        &app,
        &bytes,
        None,
        client_ip(peer),
    )))
}

/// Unknown routes.
pub(crate) async fn not_found() -> ApiError {
    ApiError::Status(StatusCode::NOT_FOUND, "Not Found".into())
}

/// A handler panicked (never expected; answered rather than dropping the connection).
pub(crate) fn panicked(_: Box<dyn std::any::Any + Send + 'static>) -> Response<Body> {
    tracing::error!("a request handler panicked");
    ApiError::Status(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal server error".into(),
    )
    .into_response()
}

fn unknown_session(id: &str) -> ApiError {
    ApiError::Status(StatusCode::NOT_FOUND, format!("Unknown session_id: {id}"))
}

fn timed_out(app: &App, id: &str, limit: Duration) -> ApiError {
    if let Some(cell) = app.registry.close(id) {
        tokio::task::spawn_blocking(move || drop(cell));
    }
    tracing::warn!(session = %id, "step ran past its limit; session ended");
    ApiError::Status(
        StatusCode::GATEWAY_TIMEOUT,
        format!(
            "the step ran past its {} s limit; session {id} was ended",
            limit.as_secs_f64()
        ),
    )
}

fn session_metadata(id: &str) -> serde_json::Map<String, serde_json::Value> {
    let mut m = serde_json::Map::new();
    m.insert(
        "session_id".into(),
        serde_json::Value::String(id.to_string()),
    );
    m
}
