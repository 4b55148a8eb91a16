//! The run's report: `report.md` with PNG plots — the GRPO reward curve and its components,
//! held-out results of the base, after SFT and after GRPO (overall and per family), `llm()`
//! calls and tool tokens before and after, and three trajectories of the trained model
//! printed in full.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use fathom_rewards::record::{Action, Role, Trajectory};
use plotters::prelude::*;

use crate::checkpoint::Stage;
use crate::eval::Summary;
use crate::metrics::plot::{FONT, collect, register_font};
use crate::metrics::{MetricsError, read_log};
use crate::recipe::Plan;
use crate::train::RunSummary;

/// Why the report could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// Reading metrics or drawing failed.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    /// Writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// Writes `<out>/report.md` (and its plots under `<out>/plots`); returns its path.
pub fn write(plan: &Plan, run: &RunSummary) -> Result<PathBuf, ReportError> {
    let plots = run.out.join("plots");
    std::fs::create_dir_all(&plots).map_err(|source| ReportError::Io {
        path: plots.clone(),
        source,
    })?;
    register_font()?;
    let mut md = String::new();
    let _ = writeln!(md, "# Fathom training report\n");
    let _ = writeln!(
        md,
        "Recipe `{}`; base {}; {} SFT steps and {} GRPO steps ({} prompts × {} samples per \
         step); held-out split: {} tasks of {:?}.\n",
        plan.origin,
        run.base,
        run.sft_steps,
        run.grpo_steps,
        plan.grpo.prompts_per_step,
        plan.grpo.group_size,
        plan.heldout_tasks.len(),
        plan.data.families
    );

    // Curves.
    let records = read_log(&run.metrics)?;
    let grpo = collect(&records, Stage::Grpo);
    if !grpo.is_empty() {
        let reward: Vec<(&str, &[(f64, f64)])> = ["reward", "solve_rate"]
            .iter()
            .filter_map(|k| grpo.get(*k).map(|v| (*k, v.as_slice())))
            .collect();
        let components: Vec<(&str, &[(f64, f64)])> = grpo
            .iter()
            .filter(|(k, _)| k.starts_with("reward/"))
            .map(|(k, v)| (k.as_str(), v.as_slice()))
            .collect();
        lines(
            &plots.join("report_reward.png"),
            "GRPO reward and solve rate",
            &reward,
        )?;
        lines(
            &plots.join("report_components.png"),
            "reward components (unweighted means)",
            &components,
        )?;
        let _ = writeln!(md, "## GRPO curves\n");
        let _ = writeln!(md, "![reward](plots/report_reward.png)\n");
        let _ = writeln!(md, "![components](plots/report_components.png)\n");
        let _ = writeln!(
            md,
            "Every metric has its own plot in `plots/` (`grpo_*.png`, `sft_*.png`) and an \
             8-panel summary (`grpo_summary.png`).\n"
        );
    }

    if run.evals.is_empty() {
        let _ = writeln!(md, "No evaluation was run (`--no-eval`).\n");
    } else {
        let _ = writeln!(md, "## Held-out results\n");
        let _ = writeln!(
            md,
            "| model | episodes | accuracy | mean reward | llm() calls | tool tokens | turns |"
        );
        let _ = writeln!(md, "| --- | --- | --- | --- | --- | --- | --- |");
        for e in &run.evals {
            row(&mut md, &e.label, &e.report.overall);
        }
        let _ = writeln!(md);
        let mut families: Vec<String> = run
            .evals
            .iter()
            .flat_map(|e| e.report.families.keys().cloned())
            .collect();
        families.sort();
        families.dedup();
        let _ = writeln!(md, "### Per family (accuracy / mean reward)\n");
        let _ = write!(md, "| family |");
        for e in &run.evals {
            let _ = write!(md, " {} |", e.label);
        }
        let _ = writeln!(md);
        let _ = writeln!(md, "| --- |{}", " --- |".repeat(run.evals.len()));
        for f in &families {
            let _ = write!(md, "| {f} |");
            for e in &run.evals {
                match e.report.families.get(f) {
                    Some(s) => {
                        let _ = write!(md, " {:.2} / {:.3} |", s.accuracy, s.reward);
                    }
                    None => {
                        let _ = write!(md, " – |");
                    }
                }
            }
            let _ = writeln!(md);
        }
        let labels: Vec<&str> = run.evals.iter().map(|e| e.label.as_str()).collect();
        let accuracy: Vec<(String, Vec<f64>)> = families
            .iter()
            .map(|f| {
                let v = run
                    .evals
                    .iter()
                    .map(|e| e.report.families.get(f).map(|s| s.accuracy).unwrap_or(0.0))
                    .collect();
                (f.clone(), v)
            })
            .collect();
        bars(
            &plots.join("report_families.png"),
            "held-out accuracy per family",
            &labels,
            &accuracy,
        )?;
        let usage: Vec<(String, Vec<f64>)> = vec![
            (
                "llm() calls".into(),
                run.evals
                    .iter()
                    .map(|e| e.report.overall.llm_calls)
                    .collect(),
            ),
            (
                "tool tokens / 100".into(),
                run.evals
                    .iter()
                    .map(|e| e.report.overall.tool_tokens / 100.0)
                    .collect(),
            ),
            (
                "turns".into(),
                run.evals.iter().map(|e| e.report.overall.turns).collect(),
            ),
        ];
        bars(
            &plots.join("report_usage.png"),
            "per episode, held-out",
            &labels,
            &usage,
        )?;
        let _ = writeln!(md, "\n![families](plots/report_families.png)\n");
        let _ = writeln!(md, "### `llm()` calls and tool tokens, before and after\n");
        let _ = writeln!(md, "![usage](plots/report_usage.png)\n");
        if let Some(last) = run.evals.last() {
            let _ = writeln!(
                md,
                "## Three trajectories of the trained model ({})\n",
                last.label
            );
            let correct: Vec<bool> = last.report.episodes.iter().map(|e| e.correct).collect();
            let families: Vec<_> = last.report.episodes.iter().map(|e| e.family).collect();
            for (i, t) in pick_three(&last.trajectories, &correct, &families)
                .into_iter()
                .enumerate()
            {
                let e = &last.report.episodes[t.0];
                let _ = writeln!(
                    md,
                    "### {}. {} ({}): {}, reward {:.3}, {} turns, {} llm() calls\n",
                    i + 1,
                    e.task_id,
                    crate::eval::family_name(e.family),
                    if e.correct { "correct" } else { "wrong" },
                    e.reward,
                    e.turns,
                    e.llm_calls
                );
                trajectory(&mut md, t.1);
            }
        }
    }
    let path = run.out.join("report.md");
    std::fs::write(&path, md).map_err(|source| ReportError::Io {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

fn row(md: &mut String, label: &str, s: &Summary) {
    let _ = writeln!(
        md,
        "| {label} | {} | {:.3} | {:.3} | {:.2} | {:.0} | {:.2} |",
        s.episodes, s.accuracy, s.reward, s.llm_calls, s.tool_tokens, s.turns
    );
}

/// Up to three episodes to print: correct ones first; among them, those that ran two or more
/// different programs (code, output, more code, answer: a turn that repeats an earlier
/// program word for word does not count), then those that ran code at all. Within one such
/// class, an episode of a family not yet shown comes before one of a family already shown,
/// then held-out order decides.
fn pick_three<'a, F: PartialEq>(
    trajectories: &'a [Option<Trajectory>],
    correct: &[bool],
    families: &[F],
) -> Vec<(usize, &'a Trajectory)> {
    // Each episode's class, computed once: (wrong, fewer than two programs, no program).
    let mut left: Vec<(usize, &Trajectory, (bool, bool, bool))> = trajectories
        .iter()
        .enumerate()
        .filter_map(|(i, t)| t.as_ref().map(|t| (i, t)))
        .map(|(i, t)| {
            let programs = distinct_programs(t);
            (i, t, (!correct[i], programs < 2, programs == 0))
        })
        .collect();
    let mut picked: Vec<(usize, &Trajectory)> = Vec::new();
    while picked.len() < 3 {
        let shown = |i: usize| picked.iter().any(|(p, _)| families[*p] == families[i]);
        let Some(best) = (0..left.len()).min_by_key(|&k| {
            let (i, _, class) = left[k];
            (class, shown(i), i)
        }) else {
            break;
        };
        let (i, t, _) = left.remove(best);
        picked.push((i, t));
    }
    picked
}

/// How many different programs an episode ran (code turns that produced output, compared by
/// their text with surrounding whitespace trimmed).
fn distinct_programs(t: &Trajectory) -> usize {
    let mut seen: Vec<&str> = Vec::new();
    for step in t.steps.iter().filter(|s| s.output.is_some()) {
        if let Action::Code { code } = &step.action
            && !seen.contains(&code.trim())
        {
            seen.push(code.trim());
        }
    }
    seen.len()
}

fn trajectory(md: &mut String, t: &Trajectory) {
    for m in &t.messages {
        let who = match m.role {
            Role::System => continue,
            Role::User => "user",
            Role::Assistant => "assistant",
        };
        let _ = writeln!(
            md,
            "**{who}**\n\n````text\n{}\n````\n",
            m.content.trim_end()
        );
    }
}

fn draw_err(path: &Path) -> impl Fn(String) -> ReportError + '_ {
    move |message| {
        ReportError::Metrics(MetricsError::Plot {
            path: path.to_path_buf(),
            message,
        })
    }
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// A line chart of several series.
fn lines(path: &Path, title: &str, series: &[(&str, &[(f64, f64)])]) -> Result<(), ReportError> {
    let err = draw_err(path);
    let root = BitMapBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let xs = series.iter().flat_map(|(_, p)| p.iter().map(|q| q.0));
    let ys = series.iter().flat_map(|(_, p)| p.iter().map(|q| q.1));
    let (x0, x1) = xs.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    let (y0, y1) = ys.fold((f64::MAX, f64::MIN), |(a, b), y| (a.min(y), b.max(y)));
    if x0 > x1 {
        return Ok(());
    }
    let pad = ((y1 - y0) * 0.1).max(1e-3);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, (FONT, 22))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(x0..x1.max(x0 + 1.0), (y0 - pad)..(y1 + pad))
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .label_style((FONT, 14))
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (i, (name, points)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| err(e.to_string()))?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// A grouped bar chart: one group per series name, one bar per label (base, SFT, GRPO).
fn bars(
    path: &Path,
    title: &str,
    labels: &[&str],
    groups: &[(String, Vec<f64>)],
) -> Result<(), ReportError> {
    let err = draw_err(path);
    let root = BitMapBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let top = groups
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.15;
    let width = labels.len() as f64 + 1.0;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, (FONT, 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..(groups.len() as f64 * width), 0.0..top)
        .map_err(|e| err(e.to_string()))?;
    let names: BTreeMap<i64, String> = groups
        .iter()
        .enumerate()
        .map(|(g, (n, _))| (((g as f64 + 0.5) * width) as i64, n.clone()))
        .collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(groups.len().max(1) * 4)
        .x_label_formatter(&|x| names.get(&(*x as i64)).cloned().unwrap_or_default())
        .label_style((FONT, 14))
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (l, label) in labels.iter().enumerate() {
        let color = COLORS[l % COLORS.len()];
        let rects: Vec<Rectangle<(f64, f64)>> = groups
            .iter()
            .enumerate()
            .map(|(g, (_, v))| {
                let x = g as f64 * width + 0.5 + l as f64;
                Rectangle::new([(x, 0.0), (x + 0.9, v[l])], color.filled())
            })
            .collect();
        chart
            .draw_series(rects)
            .map_err(|e| err(e.to_string()))?
            .label(*label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], color.filled()));
    }
    chart
        .configure_series_labels()
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use fathom_rewards::record::{Action, EndReason, ExecOutput, Step};

    /// The held-out indices `pick_three` chooses.
    fn picked<F: PartialEq>(
        trajectories: &[Option<Trajectory>],
        correct: &[bool],
        families: &[F],
    ) -> Vec<usize> {
        pick_three(trajectories, correct, families)
            .into_iter()
            .map(|(i, _)| i)
            .collect()
    }

    /// An episode with `code` code turns and then an answer.
    fn episode(code: usize) -> Option<Trajectory> {
        let step = |action, output| Step {
            assistant: String::new(),
            action,
            output,
            llm_calls: Vec::new(),
            accesses: Vec::new(),
            completion_tokens: 1,
            code_tokens: 1,
            output_tokens: 1,
        };
        let mut steps: Vec<Step> = (0..code)
            .map(|k| {
                let code = Action::Code {
                    code: format!("print({k})"),
                };
                step(code, Some(ExecOutput::default()))
            })
            .collect();
        steps.push(step(Action::Answer { text: "x".into() }, None));
        Some(Trajectory {
            task_id: format!("t{code}"),
            messages: Vec::new(),
            steps,
            end_reason: EndReason::Answered,
            elapsed_ms: 0.0,
        })
    }

    #[test]
    fn correct_episodes_with_most_code_turns_come_first() {
        let trajectories = vec![
            episode(1),
            None,
            episode(0),
            episode(2),
            episode(3),
            episode(1),
        ];
        let correct = [true, true, true, false, true, true];
        let chosen = picked(&trajectories, &correct, &[0; 6]);
        // Correct with two or more code turns, then correct with one, in order; the wrong
        // three-turn episode and the correct answer-only one come after.
        assert_eq!(chosen, vec![4, 0, 5]);
        let all_wrong = [false; 6];
        assert_eq!(picked(&trajectories, &all_wrong, &[0; 6]), vec![3, 4, 0]);
    }

    #[test]
    fn a_repeated_program_is_not_a_second_code_turn() {
        // Episode 0 runs the same search twice; episode 1 runs two different ones.
        let mut repeated = episode(2);
        if let Some(t) = repeated.as_mut() {
            let first = t.steps[0].action.clone();
            t.steps[1].action = first;
        }
        let trajectories = vec![repeated, episode(2), episode(1)];
        assert_eq!(distinct_programs(trajectories[0].as_ref().unwrap()), 1);
        assert_eq!(distinct_programs(trajectories[1].as_ref().unwrap()), 2);
        assert_eq!(picked(&trajectories, &[true; 3], &[0; 3]), vec![1, 0, 2]);
    }

    #[test]
    fn another_family_comes_first_within_a_class() {
        let trajectories = vec![episode(2), episode(2), episode(2), episode(1)];
        let pick = |families: &[char]| picked(&trajectories, &[true; 4], families);
        // Two multi-program episodes of family a, one of b: b's comes second.
        assert_eq!(pick(&['a', 'a', 'b', 'b']), vec![0, 2, 1]);
        // b's only episode ran one program: the class decides before the family does.
        assert_eq!(pick(&['a', 'a', 'a', 'b']), vec![0, 1, 2]);
    }
}
