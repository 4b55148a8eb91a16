//! `cargo xtask data`: export tasks of a split as JSONL, one serialized `Task` per line.

use std::io::{BufWriter, Write};
use std::path::PathBuf;

use anyhow::{Context, bail};
use fathom_env::tasks::{self, TaskConfig};

/// Arguments of `xtask data`.
#[derive(clap::Args)]
pub struct DataArgs {
    /// The split: train, eval or heldout.
    #[arg(long)]
    split: String,
    /// How many tasks, from index 0 (default: the whole split).
    #[arg(long)]
    n: Option<usize>,
    /// Where to write the JSONL file.
    #[arg(long)]
    out: PathBuf,
    /// The policy's context window in tokens (documents reach 50 windows).
    #[arg(long, default_value_t = TaskConfig::default().context_window)]
    context_window: usize,
}

/// Writes the tasks.
pub fn run(args: DataArgs) -> anyhow::Result<()> {
    let split = tasks::parse_split(&args.split)?;
    let len = tasks::split_len(split);
    let n = args.n.unwrap_or(len);
    if n > len {
        bail!(
            "--n {n} is more than the {} split's {len} tasks",
            args.split
        );
    }
    if args.context_window == 0 {
        bail!("--context-window must be positive");
    }
    let config = TaskConfig {
        context_window: args.context_window,
        ..TaskConfig::default()
    };
    let file = std::fs::File::create(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let mut out = BufWriter::new(file);
    for index in 0..n {
        let task = tasks::split_task(split, index, &config)?;
        serde_json::to_writer(&mut out, &task)?;
        out.write_all(b"\n")?;
    }
    out.flush()
        .with_context(|| format!("cannot write {}", args.out.display()))?;
    tracing::info!(split = %args.split, n, out = %args.out.display(), "tasks written");
    Ok(())
}
