//! What the server benchmarks share: one scripted-expert episode on an environment, timed, and
//! the tally of many.

use std::sync::Mutex;
use std::time::Instant;

use fathom_env::env::{AgentAction, Environment, ResetRequest};
use fathom_env::expert::Expert;
use fathom_env::policy::Policy;
use fathom_env::tasks;
use fathom_rewards::Composite;
use fathom_rewards::record::{EndReason, Split};

/// Latencies and outcomes of the episodes run so far.
#[derive(Default)]
pub struct Tally {
    /// Step latencies (ms).
    pub steps_ms: Vec<f64>,
    /// Reset latencies (ms).
    pub resets_ms: Vec<f64>,
    /// Episodes that ran to their end.
    pub episodes: usize,
    /// Of those, the correct ones.
    pub correct: usize,
    /// What went wrong in the others.
    pub errors: Vec<String>,
}

/// The `p`-th percentile of sorted values (NaN when there are none).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// One expert episode on `index` of the eval split, added to `tally`.
pub fn episode(env: &mut dyn Environment, index: usize, tally: &Mutex<Tally>) {
    let task = tasks::split_task(Split::Eval, index, &Default::default()).expect("task");
    let (mut steps, mut error, mut correct) = (Vec::new(), None, false);
    let t = Instant::now();
    let reset = env.reset(ResetRequest::Split {
        split: Split::Eval,
        index,
    });
    let reset_ms = t.elapsed().as_secs_f64() * 1e3;
    match reset {
        Err(e) => error = Some(format!("{}: reset: {e}", task.id)),
        Ok(mut obs) => {
            while !obs.done {
                let message = match Expert.respond(&obs.messages) {
                    Ok(m) => m,
                    Err(e) => {
                        error = Some(format!("{}: expert: {e}", task.id));
                        break;
                    }
                };
                let t = Instant::now();
                match env.step(AgentAction::Message(message)) {
                    Ok(o) => obs = o,
                    Err(e) => {
                        error = Some(format!("{}: step: {e}", task.id));
                        break;
                    }
                }
                steps.push(t.elapsed().as_secs_f64() * 1e3);
            }
            if error.is_none() {
                match env.trajectory() {
                    Ok(t) if t.end_reason == EndReason::Answered => {
                        correct = Composite::default()
                            .score(&task, &t)
                            .is_ok_and(|s| s.correct);
                    }
                    Ok(t) => error = Some(format!("{}: ended with {:?}", task.id, t.end_reason)),
                    Err(e) => error = Some(format!("{}: trajectory: {e}", task.id)),
                }
            }
        }
    }
    let mut t = tally.lock().unwrap_or_else(|p| p.into_inner());
    t.resets_ms.push(reset_ms);
    t.steps_ms.extend(steps);
    match error {
        Some(e) => t.errors.push(e),
        None => {
            t.episodes += 1;
            t.correct += usize::from(correct);
        }
    }
}
