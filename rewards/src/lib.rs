//! Deterministic, composable rewards for Fathom's RLM episodes, and the plain data they score.
//!
//! Everything the policy learns comes from this signal, so every number here is a pure,
//! documented function of the task and the trajectory record ([`record`]); there is no LLM
//! judge and no state. `rewards/README.md` restates the formulas for readers of the repository.
//!
//! # The default composite (DESIGN §5)
//!
//! | weight | component | value in `[0, 1]` |
//! | --- | --- | --- |
//! | +0.10 | `format_gate` ([`components::FormatGate`]) | 1 iff the final turn holds exactly one well-formed `<answer>…</answer>` ([`answer`]) |
//! | +0.70 | `correctness` ([`components::Correctness`]) | 1 iff that answer matches the gold answer or an alias ([`normalize`]) |
//! | −0.15 | `token_budget` ([`components::TokenBudget`]) | `min(1, max(0, tool_tokens − 2048) / (16384 − 2048))` |
//! | +0.15 | `recursion_efficiency` ([`components::RecursionEfficiency`]) | `correct · max(0, 1 − llm_calls / 10)` |
//!
//! `total = Σ weight · value`, then, when the answer is not correct, `total = min(total, 0.25)`
//! ([`composite`]). So a correct answer with no tool use and no `llm()` call scores 0.95, a
//! wrong but well-formed one at most 0.10, and a missing one at most 0. All constants are
//! configurable from a recipe's `rewards` section ([`config`]).
//!
//! # Optional: RAPO's step-level reward
//!
//! [`step_level`] classifies every tool call deterministically (unique search, redundant
//! search, exploration, verification, redundant query, plus two neutral classes) and scores
//! correct trajectories by their redundancy ratio (floor 0.5) and incorrect ones by distinct
//! exploration (capped credits). Off by default.
//!
//! # Custom rewards
//!
//! Implement [`reward::Reward`], register a factory in a [`registry::RewardRegistry`], and name
//! it in a recipe as `Custom(name: …, weight: …, params: …)`. The `fathom-examples` crate and
//! its README show two.
//!
//! # The reward audit
//!
//! `cargo test -p fathom-rewards --test audit` (or `cargo test -p fathom-rewards audit`) runs
//! one adversarial probe per known attack (masked context, format only, length gaming,
//! recursion spam, copy-pasted gold) against the bound it must respect; `--test properties` checks ranges and the composite's arithmetic on
//! arbitrary trajectories.

pub mod answer;
pub mod components;
pub mod composite;
pub mod config;
pub mod fixture;
pub mod normalize;
pub mod record;
pub mod registry;
pub mod reward;
pub mod step_level;

pub use composite::{Breakdown, Composite, ScoreError};
pub use config::{ComponentConfig, ConfigError, RewardsConfig, rewards_from_recipe};
pub use registry::{Params, ParamsError, RewardRegistry};
pub use reward::{Episode, Reward, ValueRange};
