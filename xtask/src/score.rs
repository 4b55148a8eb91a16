//! `cargo xtask score`: score one trajectory against its task and print every component.
//!
//! ```text
//! cargo xtask score --task TASK.json --trajectory TRAJ.json [--recipe RECIPE.ron]
//! {"total": 0.95, "components": {"format_gate": 1.0, …}, "weights": {…}, "correct": true, "capped": false}
//! ```
//!
//! TASK.json is one `Task` object (one line of `xtask data`'s JSONL); TRAJ.json is one
//! `Trajectory` (what `xtask episode --json` prints). Without `--recipe` the default composite
//! of DESIGN §5 is used; with it, only the recipe's top-level `rewards` field is read (the
//! trainer's recipe owns the rest). Custom rewards named by a recipe must be registered here:
//! this binary registers the `fathom-examples` rewards.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use fathom_rewards::record::{Task, Trajectory};
use fathom_rewards::{RewardRegistry, RewardsConfig, rewards_from_recipe};
use serde::de::DeserializeOwned;

/// Arguments of `xtask score`.
#[derive(clap::Args, Debug)]
pub struct ScoreArgs {
    /// One serialised task (a line of `xtask data`'s JSONL).
    #[arg(long)]
    pub task: PathBuf,
    /// One serialised trajectory (`xtask episode --json`'s output).
    #[arg(long)]
    pub trajectory: PathBuf,
    /// A recipe whose top-level `rewards` field configures the composite (default: DESIGN §5).
    #[arg(long)]
    pub recipe: Option<PathBuf>,
}

/// Scores the trajectory and prints the breakdown as JSON on stdout.
pub fn run(args: ScoreArgs) -> anyhow::Result<()> {
    let task: Task = read_json(&args.task, "Task")?;
    let trajectory: Trajectory = read_json(&args.trajectory, "Trajectory")?;

    let mut registry = RewardRegistry::new();
    fathom_examples::register(&mut registry).context("registering the example rewards")?;
    let config = match &args.recipe {
        Some(path) => {
            let text = read(path)?;
            rewards_from_recipe(&text).with_context(|| format!("reading {}", path.display()))?
        }
        None => RewardsConfig::default(),
    };
    let origin = args
        .recipe
        .as_deref()
        .map_or("the default rewards".to_owned(), |p| {
            p.display().to_string()
        });
    let composite = config
        .build(&registry)
        .with_context(|| format!("validating {origin}"))?;

    let breakdown = composite.score(&task, &trajectory).with_context(|| {
        format!(
            "scoring {} against {}",
            args.trajectory.display(),
            args.task.display()
        )
    })?;
    println!("{}", serde_json::to_string_pretty(&breakdown)?);
    Ok(())
}

fn read(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

/// Parses a file holding exactly one JSON object of type `T`.
fn read_json<T: DeserializeOwned>(path: &Path, what: &str) -> anyhow::Result<T> {
    let text = read(path)?;
    serde_json::from_str(&text).or_else(|e| {
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        if lines.len() > 1 && lines.iter().all(|l| serde_json::from_str::<serde_json::Value>(l).is_ok()) {
            bail!(
                "{} holds {} JSON lines; pass a file with exactly one {what} (one line of the JSONL)",
                path.display(),
                lines.len()
            );
        }
        Err(e).with_context(|| format!("{} is not one serialised {what}", path.display()))
    })
}
