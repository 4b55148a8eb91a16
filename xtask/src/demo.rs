//! `cargo xtask demo`: the browser demo. One offline page (inline HTML, CSS and JavaScript in
//! the binary; no build step, no CDN) where a user pastes or uploads a document, types a
//! question — or loads a task from the splits — and watches the episode stream in through
//! server-sent events: the turn being written, each turn's code (highlighted), the REPL's
//! output (collapsible), the `llm()` answers, the answer, and the reward breakdown when the
//! question came from the task set.
//!
//! The model is loaded once, on a thread of its own that runs one episode at a time (later
//! requests wait their turn; an episode runs to its end even if its page is closed).
//!
//! Routes: `GET /` (the page), `GET /api/info`, `GET /api/task?split=eval&index=3`,
//! `POST /api/run` (JSON `{document, question, task?: {split, index}}`, answered with an
//! event stream of `session::InferEvent`s as JSON, or `{"type": "error", "message"}`).

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use anyhow::{Context, Result};
use axum::Json;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use clap::Args;
use fathom_env::tasks::{self, TaskConfig};
use fathom_model::ModelBackend;
use fathom_rewards::record::Split;
use serde::{Deserialize, Serialize};
use std::sync::mpsc::{Receiver, Sender, channel, sync_channel};
use tokio::sync::mpsc;

use crate::infer::LoadArgs;
use crate::infer::session::{EpisodeRequest, InferEvent, Session, SessionOptions};

/// The page, served as is.
const PAGE: &str = include_str!("demo/page.html");

/// Largest request (a document and its question), in bytes.
const MAX_BODY: usize = 64 << 20;

/// Arguments of `demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {
    #[command(flatten)]
    load: LoadArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on.
    #[arg(long, default_value_t = 8080)]
    port: u16,
}

/// What the page is told about the server.
#[derive(Clone, Debug, Serialize)]
struct Info {
    model: String,
    backend: String,
    max_turns: usize,
    recursion_depth: u32,
    splits: Vec<SplitInfo>,
}

#[derive(Clone, Debug, Serialize)]
struct SplitInfo {
    name: &'static str,
    tasks: usize,
}

/// What the page streams: an episode's events, or why it failed.
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum Message {
    Event(InferEvent),
    Error {
        #[serde(rename = "type")]
        kind: &'static str,
        message: String,
    },
}

impl Message {
    fn error(message: String) -> Self {
        Message::Error {
            kind: "error",
            message,
        }
    }
}

/// An episode for the model thread, with where its events go.
struct Job {
    request: EpisodeRequest,
    events: mpsc::UnboundedSender<Message>,
}

struct AppState {
    info: Info,
    tasks: TaskConfig,
    jobs: Sender<Job>,
}

/// Loads the model, then serves the page until the process is stopped.
pub fn run(args: DemoArgs) -> Result<()> {
    let options = args.load.options()?;
    let (jobs, queue) = channel::<Job>();
    let (ready_tx, ready) = sync_channel(1);
    let backend = args.load.backend;
    std::thread::Builder::new()
        .name("demo-model".into())
        .spawn(move || {
            crate::with_backend!(backend, |B, device| model_thread::<B>(
                &options, device, queue, ready_tx
            ))
        })
        .context("starting the model thread")?;
    let (info, tasks) = ready
        .recv()
        .context("the model thread stopped while loading")??;
    let addr = SocketAddr::new(args.host, args.port);
    let state = Arc::new(AppState { info, tasks, jobs });
    let app = axum::Router::new()
        .route("/", get(|| async { Html(PAGE) }))
        .route("/api/info", get(info_route))
        .route("/api/task", get(task_route))
        .route("/api/run", post(run_route))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(state.clone());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        eprintln!(
            "demo: {} on {} — open http://{addr}/",
            state.info.model, state.info.backend
        );
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
            .context("serving the demo")
    })
}

/// Loads the session and runs the queued episodes one at a time.
fn model_thread<B: ModelBackend>(
    options: &SessionOptions,
    device: B::Device,
    queue: Receiver<Job>,
    ready: std::sync::mpsc::SyncSender<Result<(Info, TaskConfig)>>,
) {
    let session = match Session::<B>::load(options, device) {
        Ok(s) => s,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let plan = session.plan();
    let splits = [Split::Train, Split::Eval, Split::Heldout]
        .into_iter()
        .map(|s| SplitInfo {
            name: tasks::split_name(s),
            tasks: tasks::split_len(s),
        })
        .collect();
    let info = Info {
        model: session.label().to_string(),
        backend: session.backend().to_string(),
        max_turns: plan.env.max_turns,
        recursion_depth: plan.env.llm.max_depth,
        splits,
    };
    let _ = ready.send(Ok((info, plan.env.tasks.clone())));
    for job in queue {
        if job.events.is_closed() {
            continue; // the page went away while the job waited
        }
        let events = job.events.clone();
        let result = session.run(job.request, &mut |e| {
            let _ = events.send(Message::Event(e));
        });
        if let Err(e) = result {
            let _ = job.events.send(Message::error(format!("{e:#}")));
        }
    }
}

async fn info_route(State(state): State<Arc<AppState>>) -> Json<Info> {
    Json(state.info.clone())
}

#[derive(Debug, Deserialize)]
struct TaskQuery {
    split: String,
    index: usize,
}

/// A task as the page shows it (without its answer).
#[derive(Debug, Serialize)]
struct TaskView {
    id: String,
    family: serde_json::Value,
    question: String,
    document: String,
}

fn bad_request(message: String) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(serde_json::json!({ "error": message })),
    )
        .into_response()
}

fn task_of(config: &TaskConfig, query: &TaskQuery) -> Result<fathom_rewards::record::Task, String> {
    let split = tasks::parse_split(&query.split).map_err(|e| e.to_string())?;
    tasks::split_task(split, query.index, config).map_err(|e| e.to_string())
}

async fn task_route(
    State(state): State<Arc<AppState>>,
    Query(query): Query<TaskQuery>,
) -> Response {
    let config = state.tasks.clone();
    let task = tokio::task::spawn_blocking(move || task_of(&config, &query)).await;
    match task {
        Ok(Ok(task)) => Json(TaskView {
            id: task.id.clone(),
            family: serde_json::to_value(task.family).unwrap_or_default(),
            question: task.question,
            document: task.document,
        })
        .into_response(),
        Ok(Err(e)) => bad_request(e),
        Err(e) => bad_request(format!("making the task failed: {e}")),
    }
}

#[derive(Debug, Deserialize)]
struct RunRequest {
    document: String,
    question: String,
    #[serde(default)]
    task: Option<TaskQuery>,
}

async fn run_route(State(state): State<Arc<AppState>>, Json(body): Json<RunRequest>) -> Response {
    if body.document.trim().is_empty() {
        return bad_request("the document is empty: paste or upload one, or load a task".into());
    }
    if body.question.trim().is_empty() {
        return bad_request("the question is empty".into());
    }
    // A loaded task is scored only if its document and question were left as they were.
    let task = match body.task {
        Some(query) => {
            let config = state.tasks.clone();
            match tokio::task::spawn_blocking(move || task_of(&config, &query)).await {
                Ok(Ok(task)) => Some(task),
                Ok(Err(e)) => return bad_request(e),
                Err(e) => return bad_request(format!("making the task failed: {e}")),
            }
        }
        None => None,
    };
    let task = task.filter(|t| t.document == body.document && t.question == body.question);
    let (tx, rx) = mpsc::unbounded_channel();
    let job = Job {
        request: EpisodeRequest {
            document: body.document,
            question: body.question,
            task,
        },
        events: tx,
    };
    if state.jobs.send(job).is_err() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "the model thread has stopped",
        )
            .into_response();
    }
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        let message = rx.recv().await?;
        let data = serde_json::to_string(&message)
            .unwrap_or_else(|e| format!("{{\"type\":\"error\",\"message\":\"{e}\"}}"));
        Some((Ok::<_, Infallible>(Event::default().data(data)), rx))
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}
