//! Deterministic long-document tasks: one generator per [`Family`], the fixed splits, and
//! the document length in tokens.
//!
//! - **Splits** are fixed by seed: task `index` of a split is generated from a seed derived
//!   from the split and the index only ([`split_seed`]), so `eval-00042` is the same task on
//!   every machine. Sizes: 1000 train, 200 eval, 500 held-out. Families take turns
//!   (`index % 5`), so each split is balanced across families.
//! - **Length** is drawn per task, log-uniformly between [`TaskConfig::min_doc_tokens`] and
//!   [`TaskConfig::max_window_factor`] × [`TaskConfig::context_window`] tokens (counted with
//!   [`crate::tokens::ApproxTokens`]: four characters a token), so most documents are short
//!   and some are far longer than the policy's window. Changing the config changes the
//!   documents; the defaults define the published splits.
//! - **Evidence** spans point at the sentences (or, for passages, the sentence inside the
//!   paragraph) that determine the answer.
//!
//! Generating a task is a single pass over its text; a 200 000-token document takes a few
//! milliseconds in a release build.

pub mod aggregate;
pub mod compare;
pub mod multihop;
pub mod needle;
pub mod passage;
pub mod rng;
pub mod text;

use fathom_rewards::record::{Family, Span, Split, Task};

use crate::tokens::CHARS_PER_TOKEN;
use rng::{Rng, mix};

/// The five families in the order they take turns within a split.
pub const FAMILIES: [Family; 5] = [
    Family::Needle,
    Family::MultiHop,
    Family::Aggregate,
    Family::Compare,
    Family::Passage,
];

/// How documents are sized.
#[derive(Clone, Debug, PartialEq)]
pub struct TaskConfig {
    /// The policy's context window, in tokens.
    pub context_window: usize,
    /// Shortest document, in tokens.
    pub min_doc_tokens: usize,
    /// Longest document as a multiple of the context window.
    pub max_window_factor: f64,
}

impl Default for TaskConfig {
    /// A 4096-token window; documents from 500 tokens to 50 windows (204 800 tokens).
    fn default() -> TaskConfig {
        TaskConfig {
            context_window: 4096,
            min_doc_tokens: 500,
            max_window_factor: 50.0,
        }
    }
}

impl TaskConfig {
    /// The longest document, in tokens.
    pub fn max_doc_tokens(&self) -> usize {
        ((self.context_window as f64 * self.max_window_factor) as usize).max(self.min_doc_tokens)
    }
}

/// Errors making tasks.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TaskError {
    /// The index is past the end of the split.
    #[error("index {index} is out of range for the {split} split, which has {len} tasks")]
    OutOfRange {
        /// The split's name.
        split: &'static str,
        /// The index asked for.
        index: usize,
        /// The split's size.
        len: usize,
    },
    /// A split name that is not train, eval or heldout.
    #[error("unknown split {0:?}: expected train, eval or heldout")]
    UnknownSplit(String),
}

/// What a family generator returns.
pub struct Generated {
    /// The document.
    pub document: String,
    /// The question.
    pub question: String,
    /// The gold answer.
    pub answer: String,
    /// Other accepted spellings.
    pub aliases: Vec<String>,
    /// Spans of the facts that determine the answer.
    pub evidence: Vec<Span>,
}

/// Number of tasks in a split.
pub fn split_len(split: Split) -> usize {
    match split {
        Split::Train => 1000,
        Split::Eval => 200,
        Split::Heldout => 500,
    }
}

/// The split's name as used in task ids and on the command line.
pub fn split_name(split: Split) -> &'static str {
    match split {
        Split::Train => "train",
        Split::Eval => "eval",
        Split::Heldout => "heldout",
    }
}

/// Parses a split name (`train`, `eval`, `heldout`).
pub fn parse_split(name: &str) -> Result<Split, TaskError> {
    match name {
        "train" => Ok(Split::Train),
        "eval" => Ok(Split::Eval),
        "heldout" | "held-out" => Ok(Split::Heldout),
        other => Err(TaskError::UnknownSplit(other.to_string())),
    }
}

/// The seed of task `index` of `split`.
pub fn split_seed(split: Split, index: usize) -> u64 {
    let tag: u64 = match split {
        Split::Train => 1,
        Split::Eval => 2,
        Split::Heldout => 3,
    };
    mix(0xFA7B_0000_0000_0000 ^ (tag << 40) ^ index as u64)
}

/// Task `index` of `split`.
pub fn split_task(split: Split, index: usize, config: &TaskConfig) -> Result<Task, TaskError> {
    let len = split_len(split);
    if index >= len {
        return Err(TaskError::OutOfRange {
            split: split_name(split),
            index,
            len,
        });
    }
    let id = format!("{}-{index:05}", split_name(split));
    Ok(generate(
        id,
        split,
        index,
        split_seed(split, index),
        FAMILIES[index % FAMILIES.len()],
        config,
    ))
}

/// A task outside the fixed splits, generated from `seed` (family chosen by the seed).
/// Its split is recorded as train and its index as 0; its id is `seed-<seed>`.
pub fn seeded_task(seed: u64, config: &TaskConfig) -> Task {
    let family = FAMILIES[(mix(seed) % FAMILIES.len() as u64) as usize];
    generate(
        format!("seed-{seed}"),
        Split::Train,
        0,
        seed,
        family,
        config,
    )
}

/// Generates the task of `family` from `seed`.
pub fn generate(
    id: String,
    split: Split,
    index: usize,
    seed: u64,
    family: Family,
    config: &TaskConfig,
) -> Task {
    let mut rng = Rng::new(seed);
    let (lo, hi) = (
        config.min_doc_tokens.max(1) as f64,
        config.max_doc_tokens() as f64,
    );
    let tokens = (lo * (hi / lo).powf(rng.unit())).round() as usize;
    let target_chars = tokens * CHARS_PER_TOKEN;
    let g = match family {
        Family::Needle => needle::generate(&mut rng, target_chars),
        Family::MultiHop => multihop::generate(&mut rng, target_chars),
        Family::Aggregate => aggregate::generate(&mut rng, target_chars),
        Family::Compare => compare::generate(&mut rng, target_chars),
        Family::Passage => passage::generate(&mut rng, target_chars),
    };
    Task {
        id,
        split,
        index,
        seed,
        family,
        doc_tokens: g.document.len().div_ceil(CHARS_PER_TOKEN),
        document: g.document,
        question: g.question,
        answer: g.answer,
        aliases: g.aliases,
        evidence: g.evidence,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_tasks_are_deterministic_and_named() {
        let c = TaskConfig::default();
        let a = split_task(Split::Eval, 42, &c).unwrap();
        let b = split_task(Split::Eval, 42, &c).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.id, "eval-00042");
        assert_eq!(a.family, FAMILIES[42 % 5]);
        assert_ne!(
            a.document,
            split_task(Split::Train, 42, &c).unwrap().document
        );
    }

    #[test]
    fn out_of_range_index_names_the_split() {
        let err = split_task(Split::Eval, 200, &TaskConfig::default()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "index 200 is out of range for the eval split, which has 200 tasks"
        );
    }

    #[test]
    fn evidence_and_answers_are_consistent_across_a_split() {
        let c = TaskConfig {
            context_window: 1024,
            ..TaskConfig::default()
        };
        for index in 0..100 {
            let t = split_task(Split::Train, index, &c).unwrap();
            assert!(t.document.is_ascii(), "{}", t.id);
            assert!(!t.evidence.is_empty(), "{}", t.id);
            assert!(!t.answer.is_empty(), "{}", t.id);
            for span in &t.evidence {
                assert!(
                    span.start < span.end && span.end <= t.document.len(),
                    "{}",
                    t.id
                );
                let fact = &t.document[span.start..span.end];
                assert!(fact.ends_with('.'), "{}: {fact:?}", t.id);
                match t.family {
                    Family::Needle | Family::Passage => {
                        assert!(fact.contains(&t.answer), "{}: {fact:?}", t.id)
                    }
                    Family::MultiHop => assert!(fact.contains("courier"), "{}: {fact:?}", t.id),
                    Family::Aggregate => assert!(fact.contains("hipment #"), "{}: {fact:?}", t.id),
                    Family::Compare => assert!(fact.contains("census"), "{}: {fact:?}", t.id),
                }
            }
        }
    }

    #[test]
    fn lengths_span_short_to_fifty_windows() {
        let c = TaskConfig::default();
        let lens: Vec<usize> = (0..200)
            .map(|i| split_task(Split::Eval, i, &c).unwrap().doc_tokens)
            .collect();
        let (min, max) = (*lens.iter().min().unwrap(), *lens.iter().max().unwrap());
        assert!(min < 1000, "shortest {min}");
        assert!(
            max > 20 * c.context_window && max <= c.max_doc_tokens() + 200,
            "longest {max}"
        );
    }

    #[test]
    fn unknown_split_is_named() {
        assert_eq!(
            parse_split("dev").unwrap_err().to_string(),
            "unknown split \"dev\": expected train, eval or heldout"
        );
        assert_eq!(parse_split("heldout").unwrap(), Split::Heldout);
    }
}
