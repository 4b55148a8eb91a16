//! Progress bars for long work (SFT, GRPO, evaluation), through `indicatif`.
//!
//! Bars draw on standard error and only when it is a terminal (indicatif hides them
//! otherwise), so logs and CI output stay clean. A bar made with `visible: false` never draws.

use indicatif::{ProgressBar, ProgressStyle};

use super::StepMetrics;

/// A bar of `len` steps labelled `label` (`sft`, `grpo`, `eval`, …).
pub fn bar(len: u64, label: &str, visible: bool) -> ProgressBar {
    if !visible {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    let style = ProgressStyle::with_template(
        "{prefix:>5} [{elapsed_precise}] {bar:32.cyan/blue} {pos}/{len} (eta {eta}) {msg}",
    )
    .expect("the template is valid")
    .progress_chars("=> ");
    bar.set_style(style);
    bar.set_prefix(label.to_string());
    bar
}

/// The one-line summary a bar shows after a step.
///
/// ```
/// use fathom_trainer::checkpoint::Stage;
/// use fathom_trainer::metrics::{StepMetrics, StepTime};
/// use fathom_trainer::metrics::progress::step_message;
/// let m = StepMetrics {
///     stage: Stage::Sft, step: 3, loss: 1.25, learning_rate: 1e-4, grad_norm: 0.5,
///     tokens_per_second: 812.0, time: StepTime::default(), rollout: None,
/// };
/// assert_eq!(step_message(&m), "loss 1.250 lr 1.0e-4 812 tok/s");
/// ```
pub fn step_message(m: &StepMetrics) -> String {
    let mut s = format!(
        "loss {:.3} lr {:.1e} {:.0} tok/s",
        m.loss, m.learning_rate, m.tokens_per_second
    );
    if let Some(r) = &m.rollout {
        s = format!(
            "reward {:.3} solved {:.0}% llm() {:.1} {s}",
            r.reward,
            100.0 * r.solve_rate,
            r.llm_calls
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_count_and_hidden_bars_stay_hidden() {
        let b = bar(10, "grpo", true);
        b.inc(3);
        assert_eq!(b.position(), 3);
        assert_eq!(b.length(), Some(10));
        b.finish_and_clear();
        assert!(bar(5, "eval", false).is_hidden());
    }
}
