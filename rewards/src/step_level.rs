//! RAPO's steerable step-level reward (Fathom-DeepResearch), with a deterministic classifier
//! in place of the paper's LLM judge.
//!
//! # Tool calls and their classes
//!
//! The tool calls of an episode are its code cells ([`Action::Code`] steps) and the `llm()`
//! calls each cell made, in order (a cell, then its `llm()` calls). [`classify`] gives each one
//! class from what the environment recorded — the code, the cell's document accesses
//! ([`crate::record::Access`]) and the `llm()` prompts. A cell takes the first class that fits:
//!
//! 1. [`CallClass::RedundantSearch`] — the same code (whitespace-collapsed) as an earlier cell;
//! 2. [`CallClass::UniqueSearch`] — it ran a search (a regex pattern or a substring) over a span
//!    on which that same search text was never run before;
//! 3. [`CallClass::Exploration`] — it sliced a region of the document not already covered by
//!    earlier slices;
//! 4. [`CallClass::Verification`] — it re-reads or re-searches the *answer span* after the
//!    candidate answer first appeared, within a budget of `verification_budget` such cells (the
//!    paper's B_v = 1 cross-check per claim); further ones fall through to 5. The answer span is
//!    the slices (or, if it sliced nothing, the searches) of the first cell whose output
//!    contains the final answer as whole words, plus the task's evidence spans when the answer
//!    is correct;
//! 5. [`CallClass::RedundantSearch`] — it touched the document, but only with searches and
//!    slices already made;
//! 6. [`CallClass::Compute`] — it did not touch the document at all (arithmetic, printing).
//!
//! An `llm()` call is a [`CallClass::RedundantQuery`] when the same prompt (trimmed) was already
//! asked in the episode, and a [`CallClass::Query`] otherwise.
//!
//! `Compute` and `Query` are ours: in the paper every web tool call is a search or a page query,
//! while a REPL cell can compute without reading, and a fresh `llm()` call is neither redundant
//! nor a read of the document by itself. Both count as tool calls but earn no credit.
//!
//! # The reward
//!
//! With `T` tool calls, `ρ = (n_RedundantSearch + n_RedundantQuery) / T` (`0` when `T = 0`),
//! `ΔS = n_UniqueSearch`, `ΔQ = n_Exploration + n_Verification` and `F` the format gate
//! (`1` for exactly one well-formed answer):
//!
//! ```text
//! correct:    r = b·F + max(1 − ρ, floor)
//! otherwise:  r = b·F + c_S·min(1, ΔS / C_S) + c_Q·min(1, ΔQ / C_Q)
//! ```
//!
//! with the paper's constants as defaults: `b = 0.1`, `floor = 0.5`, `c_S = c_Q = 0.2`,
//! `C_S = 8`, `C_Q = 16`, `B_v = 1`. Values lie in `[0, b + max(1, c_S + c_Q)]`.
//!
//! Mapping the paper's "query" credit ΔQ onto document reads (not `llm()` calls) is deliberate:
//! a wrong answer earns nothing for `llm()` calls, and a trajectory that never reads the
//! document earns no exploration credit. Because `ρ` is a ratio, fresh non-redundant calls
//! dilute it; in a composite, the token budget and recursion efficiency price such padding.
//! The component is off by default; add `StepLevel(..)` to a recipe to use it.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::normalize::contains_words;
use crate::record::{AccessKind, Action, Span};
use crate::reward::{Episode, Reward, ValueRange};

/// The class of one tool call (see the module docs for the rules).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallClass {
    /// A search not run before over that span.
    UniqueSearch,
    /// Repeated code, or only searches and slices already made.
    RedundantSearch,
    /// A slice of a region not read before.
    Exploration,
    /// A re-read of the answer span after the answer appeared, within the budget.
    Verification,
    /// An `llm()` prompt already asked.
    RedundantQuery,
    /// A fresh `llm()` prompt.
    Query,
    /// A cell that did not touch the document.
    Compute,
}

/// Which tool call a classification is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CallRef {
    /// The code cell of step `step`.
    Cell {
        /// Index into `Trajectory::steps`.
        step: usize,
    },
    /// The `call`-th `llm()` call of step `step`.
    Llm {
        /// Index into `Trajectory::steps`.
        step: usize,
        /// Index into that step's `llm_calls`.
        call: usize,
    },
}

/// One classified tool call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassifiedCall {
    /// The call.
    pub call: CallRef,
    /// Its class.
    pub class: CallClass,
}

/// How many tool calls fell in each class.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallCounts {
    /// [`CallClass::UniqueSearch`] calls.
    pub unique_search: usize,
    /// [`CallClass::RedundantSearch`] calls.
    pub redundant_search: usize,
    /// [`CallClass::Exploration`] calls.
    pub exploration: usize,
    /// [`CallClass::Verification`] calls.
    pub verification: usize,
    /// [`CallClass::RedundantQuery`] calls.
    pub redundant_query: usize,
    /// [`CallClass::Query`] calls.
    pub query: usize,
    /// [`CallClass::Compute`] calls.
    pub compute: usize,
}

impl CallCounts {
    /// Counts the classes of a classification.
    pub fn of(calls: &[ClassifiedCall]) -> Self {
        let mut counts = Self::default();
        for c in calls {
            *match c.class {
                CallClass::UniqueSearch => &mut counts.unique_search,
                CallClass::RedundantSearch => &mut counts.redundant_search,
                CallClass::Exploration => &mut counts.exploration,
                CallClass::Verification => &mut counts.verification,
                CallClass::RedundantQuery => &mut counts.redundant_query,
                CallClass::Query => &mut counts.query,
                CallClass::Compute => &mut counts.compute,
            } += 1;
        }
        counts
    }

    /// `T`, the number of tool calls.
    pub fn total(&self) -> usize {
        self.unique_search
            + self.redundant_search
            + self.exploration
            + self.verification
            + self.redundant_query
            + self.query
            + self.compute
    }

    /// `ρ = (redundant searches + redundant queries) / T`, `0` when there were no calls.
    pub fn redundancy_ratio(&self) -> f64 {
        match self.total() {
            0 => 0.0,
            t => (self.redundant_search + self.redundant_query) as f64 / t as f64,
        }
    }
}

/// Classifies every tool call of an episode, in order (see the module docs).
///
/// ```
/// use fathom_rewards::fixture::{task, TrajectoryBuilder};
/// use fathom_rewards::normalize::AnswerMatcher;
/// use fathom_rewards::record::Family;
/// use fathom_rewards::reward::Episode;
/// use fathom_rewards::step_level::{classify, CallClass};
///
/// let task = task("t", Family::Needle, "..key 7 = Paris..", "key 7?", "Paris");
/// let traj = TrajectoryBuilder::new("t")
///     .code("re.search('key 7', context)", "2").search("key 7", 0, 17)
///     .code("re.search('key 7', context)", "2").search("key 7", 0, 17)
///     .code("print(context[2:15])", "key 7 = Paris").slice(2, 15)
///     .code("print(context[2:15])  # again", "key 7 = Paris").slice(2, 15)
///     .llm("Which city?", "Paris").llm("Which city?", "Paris")
///     .answer("<answer>Paris</answer>")
///     .build();
/// let ep = Episode::new(&task, &traj, &AnswerMatcher::default());
/// let classes: Vec<_> = classify(&ep, 1).into_iter().map(|c| c.class).collect();
/// assert_eq!(classes, [
///     CallClass::UniqueSearch, CallClass::RedundantSearch, CallClass::Exploration,
///     CallClass::Verification, CallClass::Query, CallClass::RedundantQuery,
/// ]);
/// ```
pub fn classify(episode: &Episode<'_>, verification_budget: usize) -> Vec<ClassifiedCall> {
    let steps = &episode.trajectory.steps;
    let (answer_step, answer_spans) = answer_source(episode);
    let mut seen_code: HashSet<String> = HashSet::new();
    let mut seen_searches: HashSet<(&str, Span)> = HashSet::new();
    let mut read = Coverage::default();
    let mut asked: HashSet<&str> = HashSet::new();
    let mut verifications = 0;
    let mut out = Vec::new();

    for (index, step) in steps.iter().enumerate() {
        let Action::Code { code } = &step.action else {
            continue;
        };
        let collapsed = code.split_whitespace().collect::<Vec<_>>().join(" ");
        let repeated_code = !seen_code.insert(collapsed);

        let mut new_search = false;
        let mut new_region = false;
        let mut touches_answer = false;
        for access in &step.accesses {
            let span = access.span;
            touches_answer |= answer_spans.iter().any(|a| a.overlaps(&span));
            match &access.kind {
                AccessKind::Slice => new_region |= read.insert(span),
                AccessKind::Search { pattern: text } | AccessKind::Find { needle: text } => {
                    new_search |= seen_searches.insert((text.as_str(), span));
                }
            }
        }

        let after_answer = answer_step.is_some_and(|a| index > a);
        let class = if repeated_code {
            CallClass::RedundantSearch
        } else if new_search {
            CallClass::UniqueSearch
        } else if new_region {
            CallClass::Exploration
        } else if after_answer && touches_answer && verifications < verification_budget {
            verifications += 1;
            CallClass::Verification
        } else if !step.accesses.is_empty() {
            CallClass::RedundantSearch
        } else {
            CallClass::Compute
        };
        out.push(ClassifiedCall {
            call: CallRef::Cell { step: index },
            class,
        });

        for (call, llm) in step.llm_calls.iter().enumerate() {
            let class = if asked.insert(llm.prompt.trim()) {
                CallClass::Query
            } else {
                CallClass::RedundantQuery
            };
            out.push(ClassifiedCall {
                call: CallRef::Llm { step: index, call },
                class,
            });
        }
    }
    out
}

/// The step after which re-reading the answer span counts as verification, and that span.
fn answer_source(episode: &Episode<'_>) -> (Option<usize>, Vec<Span>) {
    let steps = &episode.trajectory.steps;
    let mut spans = Vec::new();
    let mut first = None;
    if let Some(answer) = episode.answer.text() {
        let shown = steps.iter().position(|s| {
            matches!(s.action, Action::Code { .. })
                && s.output
                    .as_ref()
                    .is_some_and(|o| contains_words(&o.stdout, answer))
        });
        if let Some(i) = shown {
            first = Some(i);
            let accesses = &steps[i].accesses;
            let slices: Vec<Span> = accesses
                .iter()
                .filter(|a| a.kind == AccessKind::Slice)
                .map(|a| a.span)
                .collect();
            spans = if slices.is_empty() {
                accesses.iter().map(|a| a.span).collect()
            } else {
                slices
            };
        }
    }
    if episode.correct && !episode.task.evidence.is_empty() {
        spans.extend_from_slice(&episode.task.evidence);
        let read_evidence = steps.iter().position(|s| {
            s.accesses.iter().any(|a| {
                a.kind == AccessKind::Slice
                    && episode.task.evidence.iter().any(|e| e.overlaps(&a.span))
            })
        });
        first = match (first, read_evidence) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
    (first, spans)
}

/// The union of the spans read so far, as sorted, disjoint, non-adjacent ranges.
#[derive(Debug, Default)]
struct Coverage {
    ranges: Vec<Span>,
}

impl Coverage {
    /// Adds `span`; returns whether it covered any index not covered before.
    fn insert(&mut self, span: Span) -> bool {
        if span.start >= span.end {
            return false;
        }
        let covered = self
            .ranges
            .iter()
            .any(|r| r.start <= span.start && span.end <= r.end);
        if covered {
            return false;
        }
        let mut merged = span;
        self.ranges.retain(|r| {
            let touches = r.start <= merged.end && merged.start <= r.end;
            if touches {
                merged = Span {
                    start: merged.start.min(r.start),
                    end: merged.end.max(r.end),
                };
            }
            !touches
        });
        let at = self.ranges.partition_point(|r| r.start < merged.start);
        self.ranges.insert(at, merged);
        true
    }
}

/// RAPO's step-level reward (see the module docs for the formula).
///
/// ```
/// use fathom_rewards::fixture::{task, TrajectoryBuilder};
/// use fathom_rewards::normalize::AnswerMatcher;
/// use fathom_rewards::record::Family;
/// use fathom_rewards::reward::{Episode, Reward};
/// use fathom_rewards::step_level::StepLevel;
///
/// let task = task("t", Family::Needle, "..key 7 = Paris..", "key 7?", "Paris");
/// let spam = TrajectoryBuilder::new("t")
///     .code("find()", "2").find("key 7", 0, 17)
///     .code("find()", "2").find("key 7", 0, 17)
///     .code("find() ", "2").find("key 7", 0, 17)
///     .answer("<answer>Paris</answer>")
///     .build();
/// let ep = Episode::new(&task, &spam, &AnswerMatcher::default());
/// // ρ = 2/3, so 1 − ρ falls below the floor: 0.1 + 0.5.
/// assert!((StepLevel::default().score(&ep) - 0.6).abs() < 1e-12);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepLevel {
    /// `b`, the weight of the format gate inside this reward (paper: 0.1).
    pub format_bonus: f64,
    /// `floor`, the least a correct trajectory earns however redundant (paper: 0.5).
    pub correct_floor: f64,
    /// `c_S`, the credit for distinct searches on a wrong answer (paper: 0.2).
    pub search_credit: f64,
    /// `c_Q`, the credit for distinct reads on a wrong answer (paper: 0.2).
    pub query_credit: f64,
    /// `C_S`, the number of distinct searches that earns the full `c_S` (paper: 8).
    pub search_cap: usize,
    /// `C_Q`, the number of distinct reads that earns the full `c_Q` (paper: 16).
    pub query_cap: usize,
    /// `B_v`, verification cells credited (paper: 1).
    pub verification_budget: usize,
}

impl Default for StepLevel {
    fn default() -> Self {
        Self {
            format_bonus: 0.1,
            correct_floor: 0.5,
            search_credit: 0.2,
            query_credit: 0.2,
            search_cap: 8,
            query_cap: 16,
            verification_budget: 1,
        }
    }
}

impl StepLevel {
    /// The reward for given class counts, answer correctness and format.
    pub fn from_counts(&self, counts: &CallCounts, correct: bool, well_formed: bool) -> f64 {
        let format = if well_formed { self.format_bonus } else { 0.0 };
        if correct {
            format + (1.0 - counts.redundancy_ratio()).max(self.correct_floor)
        } else {
            let search = (counts.unique_search as f64 / self.search_cap.max(1) as f64).min(1.0);
            let reads = counts.exploration + counts.verification;
            let query = (reads as f64 / self.query_cap.max(1) as f64).min(1.0);
            // Clamped to the declared maximum only to absorb floating-point rounding:
            // `(b + c_S) + c_Q` may exceed `b + (c_S + c_Q)` by one ulp.
            (format + self.search_credit * search + self.query_credit * query).min(self.range().max)
        }
    }
}

impl Reward for StepLevel {
    fn name(&self) -> &str {
        "step_level"
    }

    fn range(&self) -> ValueRange {
        let best = 1.0_f64
            .max(self.correct_floor)
            .max(self.search_credit + self.query_credit);
        ValueRange {
            min: 0.0,
            max: self.format_bonus + best,
        }
    }

    fn score(&self, episode: &Episode<'_>) -> f64 {
        let calls = classify(episode, self.verification_budget);
        let counts = CallCounts::of(&calls);
        self.from_counts(&counts, episode.correct, episode.answer.text().is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture::{TrajectoryBuilder, task};
    use crate::normalize::AnswerMatcher;
    use crate::record::{Family, Task, Trajectory};

    const DOC: &str = "filler filler key 7 = Paris filler filler";

    fn classes(task: &Task, traj: &Trajectory) -> Vec<CallClass> {
        let ep = Episode::new(task, traj, &AnswerMatcher::default());
        classify(&ep, 1).into_iter().map(|c| c.class).collect()
    }

    fn score(task: &Task, traj: &Trajectory) -> f64 {
        StepLevel::default().score(&Episode::new(task, traj, &AnswerMatcher::default()))
    }

    #[test]
    fn masked_trajectory_earns_no_exploration_credit() {
        let task = task("t", Family::Needle, DOC, "key 7?", "Paris");
        let mut b = TrajectoryBuilder::new("t");
        for i in 0..20 {
            b = b
                .code(&format!("print({i})"), "x")
                .llm(&format!("guess {i}"), "Lyon");
        }
        let traj = b.answer("<answer>Lyon</answer>").build();
        assert!(
            classes(&task, &traj)
                .iter()
                .all(|c| matches!(c, CallClass::Compute | CallClass::Query))
        );
        assert!((score(&task, &traj) - 0.1).abs() < 1e-12);
    }

    #[test]
    fn wrong_answers_earn_capped_exploration_credit() {
        let task = task("t", Family::Needle, DOC, "key 7?", "Paris");
        let mut b = TrajectoryBuilder::new("t");
        for i in 0..40 {
            b = b
                .code(&format!("search {i}"), "")
                .search(&format!("p{i}"), 0, 40);
            b = b.code(&format!("read {i}"), "").slice(i, i + 1);
        }
        let traj = b.answer("<answer>Lyon</answer>").build();
        assert!(
            (score(&task, &traj) - 0.5).abs() < 1e-12,
            "{}",
            score(&task, &traj)
        );
        let half = TrajectoryBuilder::new("t")
            .code("a", "")
            .search("p", 0, 40)
            .code("b", "")
            .search("q", 0, 40)
            .code("c", "")
            .slice(0, 4)
            .answer("<answer>Lyon</answer>")
            .build();
        // 0.1 + 0.2·(2/8) + 0.2·(1/16)
        assert!((score(&task, &half) - (0.1 + 0.05 + 0.0125)).abs() < 1e-12);
    }

    #[test]
    fn correct_answers_score_by_redundancy_with_a_floor() {
        let task = task("t", Family::Needle, DOC, "key 7?", "Paris");
        let direct = TrajectoryBuilder::new("t")
            .answer("<answer>Paris</answer>")
            .build();
        assert!((score(&task, &direct) - 1.1).abs() < 1e-12);
        let one_of_four = TrajectoryBuilder::new("t")
            .code("a", "")
            .find("key 7", 0, 40)
            .code("b", "")
            .find("key 7", 0, 40)
            .code("c", "key 7 = Paris")
            .slice(16, 27)
            .code("d", "")
            .slice(0, 3)
            .answer("<answer>Paris</answer>")
            .build();
        assert!((score(&task, &one_of_four) - (0.1 + 0.75)).abs() < 1e-12);
        let unformatted = TrajectoryBuilder::new("t").answer("<answer>Paris").build();
        assert_eq!(score(&task, &unformatted), 0.0);
    }

    #[test]
    fn verification_needs_the_answer_first_and_respects_the_budget() {
        let task = task("t", Family::Needle, DOC, "key 7?", "Paris");
        let traj = TrajectoryBuilder::new("t")
            .code("a", "")
            .slice(0, 10)
            .code("b", "")
            .slice(0, 10)
            .code("c", "key 7 = Paris")
            .slice(16, 27)
            .code("d", "")
            .slice(18, 25)
            .code("e", "")
            .slice(16, 20)
            .answer("<answer>Paris</answer>")
            .build();
        assert_eq!(
            classes(&task, &traj),
            [
                CallClass::Exploration,
                CallClass::RedundantSearch,
                CallClass::Exploration,
                CallClass::Verification,
                CallClass::RedundantSearch,
            ]
        );
    }

    #[test]
    fn evidence_spans_count_as_the_answer_span_for_correct_answers() {
        let mut task = task("t", Family::Needle, DOC, "key 7?", "Paris");
        task.evidence = vec![Span { start: 16, end: 27 }];
        // The answer never appears in an output (it came from an llm() response), but the
        // evidence was read, so re-reading it later is a verification.
        let traj = TrajectoryBuilder::new("t")
            .code("a", "")
            .slice(10, 30)
            .llm("what is key 7?", "Paris")
            .code("b", "")
            .slice(16, 27)
            .answer("<answer>Paris</answer>")
            .build();
        assert_eq!(
            classes(&task, &traj),
            [
                CallClass::Exploration,
                CallClass::Query,
                CallClass::Verification
            ]
        );
        let wrong = TrajectoryBuilder::new("t")
            .code("a", "")
            .slice(10, 30)
            .code("b", "")
            .slice(16, 27)
            .answer("<answer>Lyon</answer>")
            .build();
        assert_eq!(
            classes(&task, &wrong),
            [CallClass::Exploration, CallClass::RedundantSearch]
        );
    }

    #[test]
    fn full_exploration_credit_stays_within_the_declared_range() {
        // (0.01 + 0.12) + 0.95 > 0.01 + (0.12 + 0.95) in f64, and c_S + c_Q > 1 sets the
        // declared maximum: the clamp absorbs the ulp.
        let step = StepLevel {
            format_bonus: 0.01,
            search_credit: 0.12,
            query_credit: 0.95,
            ..StepLevel::default()
        };
        let counts = CallCounts {
            unique_search: 8,
            exploration: 16,
            ..CallCounts::default()
        };
        let value = step.from_counts(&counts, false, true);
        assert!(
            step.range().contains(value),
            "{value} outside {:?}",
            step.range()
        );
        assert!((value - 1.08).abs() < 1e-12);
    }

    #[test]
    fn coverage_detects_new_regions() {
        let mut c = Coverage::default();
        assert!(c.insert(Span { start: 10, end: 20 }));
        assert!(!c.insert(Span { start: 12, end: 18 }));
        assert!(c.insert(Span { start: 15, end: 25 }));
        assert!(!c.insert(Span { start: 10, end: 25 }));
        assert!(c.insert(Span { start: 0, end: 5 }));
        assert!(c.insert(Span { start: 5, end: 10 }));
        assert!(!c.insert(Span { start: 0, end: 25 }));
        assert!(!c.insert(Span { start: 7, end: 7 }));
        assert_eq!(c.ranges, vec![Span { start: 0, end: 25 }]);
    }
}
