//! Fathom's command line: one `match` over subcommands, one module per task.

use clap::{Parser, Subcommand};

mod score;

/// Fathom: teach a small language model to work as a Recursive Language Model.
#[derive(Parser)]
#[command(name = "cargo xtask", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Score a trajectory against its task and print every reward component as JSON.
    Score(score::ScoreArgs),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Score(args) => score::run(args),
    }
}
