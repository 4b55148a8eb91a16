//! One recipe run over several seeds: the held-out scores of each stage (base, after SFT,
//! after GRPO) as mean, seed-to-seed spread and range, and whether GRPO's gain over SFT is
//! larger than that spread.
//!
//! The spread is the sample standard deviation over seeds (n − 1 in the denominator). GRPO
//! "improves on SFT beyond the spread" when its mean gain over SFT, seed for seed, is larger
//! than the spread of either stage: a rise in accuracy or mean reward, or a cut in `llm()`
//! calls or tool tokens per episode (what the recursion-efficiency and token-budget rewards
//! ask for).

use serde::{Deserialize, Serialize};

use crate::eval::Summary;
use crate::recipe::Seeds;

/// The held-out results of one seed's run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SeedRun {
    /// The seeds the run used.
    pub seeds: Seeds,
    /// Overall held-out scores by stage label (`base` or `start`, `sft`, `grpo`), in the order
    /// evaluated.
    pub stages: Vec<(String, Summary)>,
}

impl SeedRun {
    /// The scores of the stage labelled `label`.
    pub fn stage(&self, label: &str) -> Option<&Summary> {
        self.stages.iter().find(|(l, _)| l == label).map(|(_, s)| s)
    }
}

/// Mean, spread and range of one measure over seeds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stat {
    /// Seeds measured.
    pub n: usize,
    /// Mean.
    pub mean: f64,
    /// Sample standard deviation (0 for a single seed).
    pub std: f64,
    /// Smallest value.
    pub min: f64,
    /// Largest value.
    pub max: f64,
}

impl Stat {
    /// The statistics of `values`; `None` when there are none.
    pub fn of(values: &[f64]) -> Option<Stat> {
        let n = values.len();
        if n == 0 {
            return None;
        }
        let mean = values.iter().sum::<f64>() / n as f64;
        let std = if n > 1 {
            (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
        } else {
            0.0
        };
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        Some(Stat {
            n,
            mean,
            std,
            min,
            max,
        })
    }

    fn cell(&self, digits: usize) -> String {
        if self.n == 1 {
            format!("{:.digits$}", self.mean)
        } else {
            format!(
                "{:.digits$} ± {:.digits$} ({:.digits$}–{:.digits$})",
                self.mean, self.std, self.min, self.max
            )
        }
    }
}

/// The statistics of one stage over the seeds that evaluated it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageStats {
    /// The stage's label.
    pub label: String,
    /// Held-out accuracy.
    pub accuracy: Stat,
    /// Mean reward.
    pub reward: Stat,
    /// `llm()` calls per episode.
    pub llm_calls: Stat,
    /// Tool tokens per episode.
    pub tool_tokens: Stat,
    /// Assistant turns per episode.
    pub turns: Stat,
}

/// GRPO against SFT over the seeds that evaluated both.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Gain {
    /// GRPO's accuracy minus SFT's, seed for seed.
    pub accuracy: Stat,
    /// GRPO's mean reward minus SFT's, seed for seed.
    pub reward: Stat,
    /// Whether the mean accuracy gain exceeds the seed-to-seed spread of both stages.
    pub accuracy_beyond_spread: bool,
    /// Whether the mean reward gain exceeds the seed-to-seed spread of both stages.
    pub reward_beyond_spread: bool,
    /// GRPO's `llm()` calls per episode minus SFT's, seed for seed (negative: fewer calls).
    pub llm_calls: Stat,
    /// GRPO's tool tokens per episode minus SFT's, seed for seed (negative: fewer tokens).
    pub tool_tokens: Stat,
    /// Whether the mean cut in `llm()` calls exceeds the seed-to-seed spread of both stages.
    pub llm_calls_cut_beyond_spread: bool,
    /// Whether the mean cut in tool tokens exceeds the seed-to-seed spread of both stages.
    pub tool_tokens_cut_beyond_spread: bool,
}

/// Everything [`summarise`] finds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SeedSummary {
    /// The runs, in seed order.
    pub runs: Vec<SeedRun>,
    /// Each stage evaluated by at least one run, in order of first appearance.
    pub stages: Vec<StageStats>,
    /// GRPO against SFT, when at least one run evaluated both.
    pub gain: Option<Gain>,
}

/// The statistics of every stage of `runs`, and GRPO's gain over SFT.
pub fn summarise(runs: &[SeedRun]) -> SeedSummary {
    let mut labels: Vec<&str> = Vec::new();
    for run in runs {
        for (label, _) in &run.stages {
            if !labels.contains(&label.as_str()) {
                labels.push(label);
            }
        }
    }
    let stages: Vec<StageStats> = labels
        .iter()
        .filter_map(|label| {
            let summaries: Vec<&Summary> = runs.iter().filter_map(|r| r.stage(label)).collect();
            let stat = |f: fn(&Summary) -> f64| {
                Stat::of(&summaries.iter().map(|s| f(s)).collect::<Vec<_>>())
            };
            Some(StageStats {
                label: label.to_string(),
                accuracy: stat(|s| s.accuracy)?,
                reward: stat(|s| s.reward)?,
                llm_calls: stat(|s| s.llm_calls)?,
                tool_tokens: stat(|s| s.tool_tokens)?,
                turns: stat(|s| s.turns)?,
            })
        })
        .collect();
    let pairs: Vec<(&Summary, &Summary)> = runs
        .iter()
        .filter_map(|r| Some((r.stage("sft")?, r.stage("grpo")?)))
        .collect();
    let gain = (!pairs.is_empty()).then(|| {
        // GRPO − SFT of one measure, and the spread to beat: the larger of the two stages'.
        let diff = |f: fn(&Summary) -> f64| {
            let d: Vec<f64> = pairs.iter().map(|(s, g)| f(g) - f(s)).collect();
            let sft: Vec<f64> = pairs.iter().map(|(s, _)| f(s)).collect();
            let grpo: Vec<f64> = pairs.iter().map(|(_, g)| f(g)).collect();
            let (d, sft, grpo) = (
                Stat::of(&d).expect("pairs is not empty"),
                Stat::of(&sft).expect("pairs is not empty"),
                Stat::of(&grpo).expect("pairs is not empty"),
            );
            (d, sft.std.max(grpo.std))
        };
        let several = pairs.len() > 1;
        let (accuracy, a_spread) = diff(|s| s.accuracy);
        let (reward, r_spread) = diff(|s| s.reward);
        let (llm_calls, l_spread) = diff(|s| s.llm_calls);
        let (tool_tokens, t_spread) = diff(|s| s.tool_tokens);
        Gain {
            accuracy,
            reward,
            accuracy_beyond_spread: several && accuracy.mean > a_spread,
            reward_beyond_spread: several && reward.mean > r_spread,
            llm_calls,
            tool_tokens,
            llm_calls_cut_beyond_spread: several && -llm_calls.mean > l_spread,
            tool_tokens_cut_beyond_spread: several && -tool_tokens.mean > t_spread,
        }
    });
    SeedSummary {
        runs: runs.to_vec(),
        stages,
        gain,
    }
}

impl SeedSummary {
    /// The summary as Markdown: a table of the stages (mean ± spread (range)), each seed's
    /// accuracy and reward, and GRPO's gain over SFT with the verdict.
    pub fn markdown(&self) -> String {
        let mut md = String::new();
        md.push_str(&format!(
            "Held-out results over {} seed{} (mean ± sample standard deviation (min–max); one \
             value where one run evaluated the stage):\n\n",
            self.runs.len(),
            if self.runs.len() == 1 { "" } else { "s" }
        ));
        md.push_str(
            "| model | seeds | accuracy | mean reward | `llm()` calls | tool tokens | turns |\n",
        );
        md.push_str("| --- | --- | --- | --- | --- | --- | --- |\n");
        for s in &self.stages {
            md.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} |\n",
                s.label,
                s.accuracy.n,
                s.accuracy.cell(3),
                s.reward.cell(3),
                s.llm_calls.cell(2),
                s.tool_tokens.cell(0),
                s.turns.cell(2)
            ));
        }
        md.push_str("\nPer seed (accuracy / mean reward):\n\n| seeds (model, data, sampling) |");
        for s in &self.stages {
            md.push_str(&format!(" {} |", s.label));
        }
        md.push_str("\n| --- |");
        for _ in &self.stages {
            md.push_str(" --- |");
        }
        md.push('\n');
        for run in &self.runs {
            md.push_str(&format!(
                "| {}, {}, {} |",
                run.seeds.model, run.seeds.data, run.seeds.sampling
            ));
            for s in &self.stages {
                match run.stage(&s.label) {
                    Some(v) => md.push_str(&format!(" {:.3} / {:.3} |", v.accuracy, v.reward)),
                    None => md.push_str(" — |"),
                }
            }
            md.push('\n');
        }
        if let Some(g) = &self.gain {
            let verdict = |beyond: bool| {
                if beyond {
                    "larger than the seed-to-seed spread of SFT and of GRPO"
                } else {
                    "**not** larger than the seed-to-seed spread of SFT or of GRPO"
                }
            };
            let cut = |beyond: bool| {
                if beyond {
                    "a cut larger than the seed-to-seed spread of SFT and of GRPO"
                } else {
                    "**not** a cut larger than the seed-to-seed spread of SFT or of GRPO"
                }
            };
            md.push_str(&format!(
                "\nGRPO − SFT, seed for seed: accuracy {:+.3} ± {:.3}, {}; mean reward {:+.4} ± \
                 {:.4}, {}; `llm()` calls per episode {:+.2} ± {:.2}, {}; tool tokens per \
                 episode {:+.0} ± {:.0}, {}.\n",
                g.accuracy.mean,
                g.accuracy.std,
                verdict(g.accuracy_beyond_spread),
                g.reward.mean,
                g.reward.std,
                verdict(g.reward_beyond_spread),
                g.llm_calls.mean,
                g.llm_calls.std,
                cut(g.llm_calls_cut_beyond_spread),
                g.tool_tokens.mean,
                g.tool_tokens.std,
                cut(g.tool_tokens_cut_beyond_spread)
            ));
        }
        md
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(accuracy: f64, reward: f64) -> Summary {
        Summary {
            episodes: 20,
            accuracy,
            reward,
            llm_calls: 0.5,
            tool_tokens: 100.0,
            turns: 2.0,
            ..Summary::default()
        }
    }

    fn with_calls(k: u64, sft_calls: f64, grpo_calls: f64) -> SeedRun {
        let mut r = run(k, &[("sft", 0.8, 0.8), ("grpo", 0.8, 0.8)]);
        r.stages[0].1.llm_calls = sft_calls;
        r.stages[1].1.llm_calls = grpo_calls;
        r
    }

    fn run(k: u64, stages: &[(&str, f64, f64)]) -> SeedRun {
        SeedRun {
            seeds: Seeds {
                model: k,
                data: 1 + k,
                sampling: 2 + k,
            },
            stages: stages
                .iter()
                .map(|(l, a, r)| (l.to_string(), summary(*a, *r)))
                .collect(),
        }
    }

    #[test]
    fn stat_is_the_sample_statistics() {
        let s = Stat::of(&[0.6, 0.7, 0.8]).unwrap();
        assert_eq!(s.n, 3);
        assert!((s.mean - 0.7).abs() < 1e-12);
        assert!((s.std - 0.1).abs() < 1e-12);
        assert_eq!((s.min, s.max), (0.6, 0.8));
        let one = Stat::of(&[0.25]).unwrap();
        assert_eq!((one.std, one.min, one.max), (0.0, 0.25, 0.25));
        assert!(Stat::of(&[]).is_none());
    }

    #[test]
    fn a_gain_larger_than_the_spread_is_called_so() {
        let runs = [
            run(
                0,
                &[("base", 0.0, 0.0), ("sft", 0.60, 0.6), ("grpo", 0.80, 0.8)],
            ),
            run(1, &[("sft", 0.65, 0.65), ("grpo", 0.85, 0.85)]),
            run(2, &[("sft", 0.70, 0.7), ("grpo", 0.80, 0.8)]),
        ];
        let s = summarise(&runs);
        let labels: Vec<&str> = s.stages.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(labels, ["base", "sft", "grpo"]);
        assert_eq!(s.stages[0].accuracy.n, 1);
        let g = s.gain.as_ref().unwrap();
        assert!((g.accuracy.mean - 0.5 / 3.0).abs() < 1e-12);
        assert!(g.accuracy_beyond_spread);
        let md = s.markdown();
        assert!(md.contains("| base | 1 | 0.000 |"), "{md}");
        assert!(
            md.contains("| sft | 3 | 0.650 ± 0.050 (0.600–0.700) |"),
            "{md}"
        );
        assert!(
            md.contains("| 1, 2, 3 | — | 0.650 / 0.650 | 0.850 / 0.850 |"),
            "{md}"
        );
        assert!(md.contains("accuracy +0.167"), "{md}");
    }

    #[test]
    fn a_gain_within_the_spread_is_not() {
        // GRPO is ahead on average, but SFT's seeds vary by more than the gain.
        let runs = [
            run(0, &[("sft", 0.50, 0.5), ("grpo", 0.55, 0.55)]),
            run(1, &[("sft", 0.70, 0.7), ("grpo", 0.75, 0.75)]),
            run(2, &[("sft", 0.90, 0.9), ("grpo", 0.90, 0.9)]),
        ];
        let g = summarise(&runs).gain.unwrap();
        assert!(g.accuracy.mean > 0.0);
        assert!(!g.accuracy_beyond_spread);
        assert!(!g.reward_beyond_spread);
        assert!(summarise(&runs).markdown().contains("**not** larger"));
    }

    #[test]
    fn a_cut_in_calls_is_judged_against_the_spread_of_calls() {
        let clear = [
            with_calls(0, 0.9, 0.1),
            with_calls(1, 0.8, 0.0),
            with_calls(2, 1.0, 0.2),
        ];
        let g = summarise(&clear).gain.unwrap();
        assert!((g.llm_calls.mean + 0.8).abs() < 1e-12);
        assert!(g.llm_calls_cut_beyond_spread);
        assert!(
            !g.tool_tokens_cut_beyond_spread,
            "tool tokens did not change"
        );
        assert!(!g.accuracy_beyond_spread);
        let md = summarise(&clear).markdown();
        assert!(
            md.contains("`llm()` calls per episode -0.80 ± 0.00, a cut larger"),
            "{md}"
        );
        // More calls after GRPO is never a cut; nor is a cut within SFT's spread.
        let up = [with_calls(0, 0.1, 0.9), with_calls(1, 0.0, 0.8)];
        assert!(!summarise(&up).gain.unwrap().llm_calls_cut_beyond_spread);
        let noisy = [
            with_calls(0, 0.0, 0.0),
            with_calls(1, 1.0, 0.8),
            with_calls(2, 0.5, 0.3),
        ];
        assert!(!summarise(&noisy).gain.unwrap().llm_calls_cut_beyond_spread);
    }

    #[test]
    fn one_seed_never_shows_a_gain_beyond_the_spread() {
        let g = summarise(&[run(0, &[("sft", 0.1, 0.1), ("grpo", 0.9, 0.9)])])
            .gain
            .unwrap();
        assert!(!g.accuracy_beyond_spread && !g.reward_beyond_spread);
    }
}
