//! Per-step metrics: the record ([`StepMetrics`]), `metrics.jsonl` (one JSON object per line,
//! flushed as each step ends, so a crash loses at most the line being written), plots
//! ([`plot`]) and progress bars ([`progress`]).
//!
//! A resumed run first cuts the log back to the checkpoint's step ([`MetricsLog::resume`]),
//! dropping what the interrupted run wrote after it, so the log of a resumed run equals that
//! of an uninterrupted one.

pub mod plot;
pub mod progress;

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::checkpoint::Stage;

/// Wall-clock time of one step, by phase.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTime {
    /// Generating tokens (prefill and decode, `llm()` sub-calls included).
    pub generation_s: f64,
    /// Stepping environments (sandboxed code, observations), not overlapped with generation.
    pub environment_s: f64,
    /// The learner: log-probabilities, loss, backward, optimiser.
    pub learning_s: f64,
}

impl StepTime {
    /// The sum of the phases.
    pub fn total_s(&self) -> f64 {
        self.generation_s + self.environment_s + self.learning_s
    }
}

/// What the rollouts of a GRPO step looked like (means over the step's episodes).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RolloutMetrics {
    /// Mean total reward.
    pub reward: f64,
    /// Mean value of each reward component (unweighted), by name, in `[0, 1]` for built-ins.
    pub reward_components: BTreeMap<String, f64>,
    /// Mean k3 KL to the reference, when computed.
    pub kl: Option<f64>,
    /// Mean per-token entropy, when computed.
    pub entropy: Option<f64>,
    /// Mean tokens the policy sampled per episode.
    pub completion_tokens: f64,
    /// Variance of the advantages.
    pub advantage_variance: f64,
    /// Fraction of groups whose rewards were all equal.
    pub zero_variance_groups: f64,
    /// Fraction of loss tokens clipped below.
    pub clip_low: f64,
    /// Fraction of loss tokens clipped above.
    pub clip_high: f64,
    /// Mean `llm()` calls per episode.
    pub llm_calls: f64,
    /// Mean tool tokens (code and observations) per episode.
    pub tool_tokens: f64,
    /// Fraction of episodes that answered correctly.
    pub solve_rate: f64,
}

/// One line of `metrics.jsonl`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepMetrics {
    /// The stage.
    pub stage: Stage,
    /// The optimiser step within the stage (1 for the first).
    pub step: u64,
    /// The loss (policy loss for GRPO, cross-entropy for SFT).
    pub loss: f64,
    /// The learning rate of the step.
    pub learning_rate: f64,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    /// Tokens processed per second over the step (sampled tokens for GRPO, trained tokens
    /// for SFT).
    pub tokens_per_second: f64,
    /// Time by phase.
    pub time: StepTime,
    /// GRPO only: what the rollouts looked like.
    pub rollout: Option<RolloutMetrics>,
}

impl StepMetrics {
    /// Every scalar of the record under a flat name (`reward`, `reward/correctness`,
    /// `time/generation_s`, …), for plots; absent values are left out.
    pub fn series(&self) -> Vec<(String, f64)> {
        let mut out = vec![
            ("loss".to_string(), self.loss),
            ("learning_rate".into(), self.learning_rate),
            ("grad_norm".into(), self.grad_norm),
            ("tokens_per_second".into(), self.tokens_per_second),
            ("time/generation_s".into(), self.time.generation_s),
            ("time/environment_s".into(), self.time.environment_s),
            ("time/learning_s".into(), self.time.learning_s),
        ];
        if let Some(r) = &self.rollout {
            out.push(("reward".into(), r.reward));
            for (name, v) in &r.reward_components {
                out.push((format!("reward/{name}"), *v));
            }
            if let Some(kl) = r.kl {
                out.push(("kl".into(), kl));
            }
            if let Some(e) = r.entropy {
                out.push(("entropy".into(), e));
            }
            out.extend([
                ("completion_tokens".into(), r.completion_tokens),
                ("advantage_variance".into(), r.advantage_variance),
                ("zero_variance_groups".into(), r.zero_variance_groups),
                ("clip_low".into(), r.clip_low),
                ("clip_high".into(), r.clip_high),
                ("llm_calls".into(), r.llm_calls),
                ("tool_tokens".into(), r.tool_tokens),
                ("solve_rate".into(), r.solve_rate),
            ]);
        }
        out
    }
}

/// Errors of the metrics log and plots.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// A file-system operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A line of the log is not a metrics record.
    #[error("{path}:{line}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// A plot could not be drawn.
    #[error("plot {path}: {message}")]
    Plot {
        /// The image being drawn.
        path: PathBuf,
        /// The drawing library's message.
        message: String,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> MetricsError + '_ {
    move |source| MetricsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// `metrics.jsonl`, open for appending.
#[derive(Debug)]
pub struct MetricsLog {
    path: PathBuf,
    file: File,
}

impl MetricsLog {
    /// Starts a new log at `path` (an existing one is replaced).
    pub fn create(path: &Path) -> Result<Self, MetricsError> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(io(parent))?;
        }
        let file = File::create(path).map_err(io(path))?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
        })
    }

    /// Reopens the log of an interrupted run that resumes after `step` of `stage`: keeps the
    /// records of earlier stages and of this stage up to `step`, drops everything after (and
    /// a partly written last line), then appends. Records of a later stage are dropped too.
    pub fn resume(path: &Path, stage: Stage, step: u64) -> Result<Self, MetricsError> {
        let kept: Vec<StepMetrics> = if path.exists() {
            read_log(path)?
                .into_iter()
                .filter(|m| match (m.stage, stage) {
                    (Stage::Sft, Stage::Grpo) => true,
                    (a, b) if a == b => m.step <= step,
                    _ => false,
                })
                .collect()
        } else {
            Vec::new()
        };
        let mut text = String::new();
        for m in &kept {
            text.push_str(&line(m));
        }
        fathom_model::checkpoint::write_atomic(path, text.as_bytes()).map_err(|e| {
            MetricsError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::other(e.to_string()),
            }
        })?;
        let file = OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(io(path))?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
        })
    }

    /// Appends one record as a line and flushes it to the file.
    pub fn append(&mut self, metrics: &StepMetrics) -> Result<(), MetricsError> {
        self.file
            .write_all(line(metrics).as_bytes())
            .and_then(|_| self.file.flush())
            .map_err(io(&self.path))
    }

    /// The log's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn line(m: &StepMetrics) -> String {
    let mut s = serde_json::to_string(m).expect("metrics serialise");
    s.push('\n');
    s
}

/// Reads a metrics log. A last line without its newline (a write cut short by a crash) is
/// ignored; any other malformed line is an error naming its number.
pub fn read_log(path: &Path) -> Result<Vec<StepMetrics>, MetricsError> {
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    let complete = match text.rfind('\n') {
        Some(i) => &text[..=i],
        None => "",
    };
    complete
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| MetricsError::Parse {
                path: path.to_path_buf(),
                line: i + 1,
                message: e.to_string(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn record(stage: Stage, step: u64) -> StepMetrics {
        let s = step as f64;
        StepMetrics {
            stage,
            step,
            loss: 1.0 / (1.0 + s),
            learning_rate: 5e-6,
            grad_norm: 0.5 + 0.1 * s,
            tokens_per_second: 120.0 + s,
            time: StepTime {
                generation_s: 1.5,
                environment_s: 0.25,
                learning_s: 0.75 + s / 10.0,
            },
            rollout: (stage == Stage::Grpo).then(|| RolloutMetrics {
                reward: 0.1 + 0.05 * s,
                reward_components: [
                    ("correctness".to_string(), 0.1 * s),
                    ("format_gate".into(), 1.0),
                ]
                .into_iter()
                .collect(),
                kl: None,
                entropy: Some(1.25 - s / 100.0),
                completion_tokens: 300.0 - s,
                advantage_variance: 0.9,
                zero_variance_groups: 0.25,
                clip_low: 0.01,
                clip_high: 0.02,
                llm_calls: 2.0 - s / 20.0,
                tool_tokens: 1500.0 - 10.0 * s,
                solve_rate: 0.1 * s,
            }),
        }
    }

    #[test]
    fn jsonl_round_trips_and_resume_cuts_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/metrics.jsonl");
        let mut log = MetricsLog::create(&path).unwrap();
        let mut all = vec![record(Stage::Sft, 1), record(Stage::Sft, 2)];
        all.extend((1..=5).map(|s| record(Stage::Grpo, s)));
        for m in &all {
            log.append(m).unwrap();
        }
        // Flushed per line: readable while the log is still open.
        assert_eq!(read_log(&path).unwrap(), all);
        drop(log);
        // A crash mid-line leaves a partial record; reading ignores it.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"stage\":\"grpo\",\"step\":6,\"lo").unwrap();
        assert_eq!(read_log(&path).unwrap(), all);
        // Resuming after GRPO step 3 keeps SFT and GRPO 1..=3, then appends.
        let mut log = MetricsLog::resume(&path, Stage::Grpo, 3).unwrap();
        log.append(&record(Stage::Grpo, 4)).unwrap();
        let mut want = all[..5].to_vec();
        want.push(record(Stage::Grpo, 4));
        assert_eq!(read_log(&path).unwrap(), want);
        // Resuming inside SFT drops GRPO entirely.
        MetricsLog::resume(&path, Stage::Sft, 1).unwrap();
        assert_eq!(read_log(&path).unwrap(), all[..1].to_vec());
    }

    #[test]
    fn a_malformed_line_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let good = line(&record(Stage::Grpo, 1));
        std::fs::write(&path, format!("{good}{{\"stage\":\"grpo\"}}\n{good}")).unwrap();
        let err = read_log(&path).unwrap_err().to_string();
        assert!(
            err.contains("metrics.jsonl:2:") && err.contains("missing field"),
            "{err}"
        );
    }

    #[test]
    fn series_flattens_components() {
        let names: Vec<String> = record(Stage::Grpo, 2)
            .series()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        for want in [
            "reward",
            "reward/correctness",
            "entropy",
            "llm_calls",
            "time/learning_s",
        ] {
            assert!(names.iter().any(|n| n == want), "{want} in {names:?}");
        }
        assert!(
            !names.iter().any(|n| n == "kl"),
            "absent values are left out"
        );
        assert!(
            !record(Stage::Sft, 1)
                .series()
                .iter()
                .any(|(n, _)| n == "reward")
        );
    }
}
