//! The `rewards` section of a recipe: a serde type with unknown fields rejected, validated once
//! into a [`Composite`] (the resolved plan).
//!
//! ```ron
//! rewards: (
//!     incorrect_cap: Some(0.25),            // None: no cap
//!     incorrect_floor: None,                // Some(x): a wrong answer scores at least x
//!     matching: (numeric_tolerance: 1e-9),
//!     components: [
//!         FormatGate(weight: 0.1),
//!         Correctness(weight: 0.7),
//!         TokenBudget(weight: -0.15, free_tokens: 2048, saturate_tokens: 16384),
//!         RecursionEfficiency(weight: 0.15, free_calls: 0, max_calls: 10),
//!         // off by default:
//!         // StepLevel(weight: 0.2, format_bonus: 0.1, correct_floor: 0.5, search_credit: 0.2,
//!         //           query_credit: 0.2, search_cap: 8, query_cap: 16, verification_budget: 1),
//!         // Custom(name: "grounded", weight: 0.2, params: (require_correct: true)),
//!     ],
//! )
//! ```
//!
//! Every field except `StepLevel`'s and `Custom`'s `weight` (and `Custom`'s `name`) may be
//! omitted and takes the default shown; an omitted `components` list is the default composite.
//! The components are scored and logged in the order listed.
//!
//! The trainer's recipe (a later issue) owns the other top-level fields and their validation;
//! [`rewards_from_recipe`] reads only the `rewards` field of a recipe and ignores the rest.

use serde::de::{self, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use thiserror::Error;

use crate::components::{Correctness, FormatGate, RecursionEfficiency, TokenBudget};
use crate::composite::{Composite, CompositeError};
use crate::normalize::AnswerMatcher;
use crate::registry::{Params, RegistryError, RewardRegistry};
use crate::reward::Reward;
use crate::step_level::StepLevel;

/// Default cap on the total of incorrect episodes.
pub const DEFAULT_INCORRECT_CAP: f64 = 0.25;

/// Why a rewards configuration could not be read or validated.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// The text is not valid RON for this schema (an unknown field, a wrong type, a syntax
    /// error); the message has the position and names the field.
    #[error("rewards recipe: {0}")]
    Ron(ron::error::SpannedError),
    /// The recipe has no top-level `rewards` field.
    #[error("recipe has no top-level `rewards` field")]
    MissingRewards,
    /// A value is out of its allowed range.
    #[error("{field}: {message}")]
    Invalid {
        /// Path of the offending field, e.g. `rewards.components[2].saturate_tokens`.
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// A `Custom` component could not be built.
    #[error("rewards.components[{index}]: {error}")]
    Custom {
        /// Position in `components`.
        index: usize,
        /// What went wrong.
        error: RegistryError,
    },
    /// The components do not form a valid composite (e.g. duplicate names).
    #[error("rewards.components: {0}")]
    Composite(CompositeError),
}

// Written out rather than `#[from]`, which would also make the inner error the `source()` and
// print its message twice in an error chain.
impl From<ron::error::SpannedError> for ConfigError {
    fn from(error: ron::error::SpannedError) -> Self {
        Self::Ron(error)
    }
}

impl From<CompositeError> for ConfigError {
    fn from(error: CompositeError) -> Self {
        Self::Composite(error)
    }
}

/// The `rewards` section of a recipe.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardsConfig {
    /// Cap on the total when the answer is not correct (default `Some(0.25)`); `None` disables
    /// it. A bare number (`incorrect_cap: 0.3`) is read as `Some(0.3)`.
    #[serde(default = "default_cap", deserialize_with = "cap_setting")]
    pub incorrect_cap: Option<f64>,
    /// Floor on the total when the answer is not correct (default `None`), applied after the
    /// cap and not above it: with `incorrect_cap: Some(0.0), incorrect_floor: Some(0.0)` every
    /// wrong answer scores exactly 0, so negative components rank only correct answers. A bare
    /// number is read as `Some(x)`.
    #[serde(default, deserialize_with = "cap_setting")]
    pub incorrect_floor: Option<f64>,
    /// How answers are matched.
    #[serde(default)]
    pub matching: AnswerMatcher,
    /// The weighted components, in scoring and logging order.
    #[serde(default = "default_components")]
    pub components: Vec<ComponentConfig>,
}

fn default_cap() -> Option<f64> {
    Some(DEFAULT_INCORRECT_CAP)
}

/// Reads `Some(x)`, `None` or a bare number `x`.
fn cap_setting<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<f64>, D::Error> {
    struct CapVisitor;

    impl<'de> Visitor<'de> for CapVisitor {
        type Value = Option<f64>;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a number, Some(number) or None")
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
            Ok(Some(v))
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
            Ok(Some(v as f64))
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Ok(Some(v as f64))
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            f64::deserialize(d).map(Some)
        }
    }

    deserializer.deserialize_any(CapVisitor)
}

fn default_components() -> Vec<ComponentConfig> {
    let budget = TokenBudget::default();
    let recursion = RecursionEfficiency::default();
    vec![
        ComponentConfig::FormatGate { weight: w_format() },
        ComponentConfig::Correctness {
            weight: w_correct(),
        },
        ComponentConfig::TokenBudget {
            weight: w_budget(),
            free_tokens: budget.free_tokens,
            saturate_tokens: budget.saturate_tokens,
        },
        ComponentConfig::RecursionEfficiency {
            weight: w_recursion(),
            free_calls: recursion.free_calls,
            max_calls: recursion.max_calls,
        },
    ]
}

impl Default for RewardsConfig {
    /// DESIGN §5: format gate +0.10, correctness 0.70, token budget −0.15, recursion efficiency
    /// 0.15, the 0.25 cap on incorrect answers, default matching; step-level off.
    fn default() -> Self {
        Self {
            incorrect_cap: default_cap(),
            incorrect_floor: None,
            matching: AnswerMatcher::default(),
            components: default_components(),
        }
    }
}

fn w_format() -> f64 {
    0.10
}
fn w_correct() -> f64 {
    0.70
}
fn w_budget() -> f64 {
    -0.15
}
fn w_recursion() -> f64 {
    0.15
}
fn d_free_tokens() -> usize {
    TokenBudget::default().free_tokens
}
fn d_saturate_tokens() -> usize {
    TokenBudget::default().saturate_tokens
}
fn d_free_calls() -> usize {
    RecursionEfficiency::default().free_calls
}
fn d_max_calls() -> usize {
    RecursionEfficiency::default().max_calls
}
fn d_format_bonus() -> f64 {
    StepLevel::default().format_bonus
}
fn d_floor() -> f64 {
    StepLevel::default().correct_floor
}
fn d_credit() -> f64 {
    StepLevel::default().search_credit
}
fn d_search_cap() -> usize {
    StepLevel::default().search_cap
}
fn d_query_cap() -> usize {
    StepLevel::default().query_cap
}
fn d_budget() -> usize {
    StepLevel::default().verification_budget
}

/// One component of the `rewards` section. Built-ins are variants; user rewards are `Custom`,
/// found by name in a [`RewardRegistry`]. See [`crate::components`] and [`crate::step_level`]
/// for the formulas.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum ComponentConfig {
    /// [`FormatGate`]; weight must be ≥ 0 (default 0.10).
    FormatGate {
        /// Weight in the composite.
        #[serde(default = "w_format")]
        weight: f64,
    },
    /// [`Correctness`]; weight must be ≥ 0 (default 0.70).
    Correctness {
        /// Weight in the composite.
        #[serde(default = "w_correct")]
        weight: f64,
    },
    /// [`TokenBudget`]; weight must be ≤ 0 (default −0.15).
    TokenBudget {
        /// Weight in the composite (the maximum penalty, negative).
        #[serde(default = "w_budget")]
        weight: f64,
        /// Tool tokens that cost nothing (default 2048).
        #[serde(default = "d_free_tokens")]
        free_tokens: usize,
        /// Tool tokens at which the penalty saturates; > `free_tokens` (default 16384).
        #[serde(default = "d_saturate_tokens")]
        saturate_tokens: usize,
    },
    /// [`RecursionEfficiency`]; weight must be ≥ 0 (default 0.15).
    RecursionEfficiency {
        /// Weight in the composite.
        #[serde(default = "w_recursion")]
        weight: f64,
        /// `llm()` calls that cost nothing (default 0).
        #[serde(default = "d_free_calls")]
        free_calls: usize,
        /// Calls at which the bonus reaches zero; > `free_calls` (default 10).
        #[serde(default = "d_max_calls")]
        max_calls: usize,
    },
    /// [`StepLevel`] (RAPO); weight must be ≥ 0 and given.
    StepLevel {
        /// Weight in the composite.
        weight: f64,
        /// `b` (default 0.1).
        #[serde(default = "d_format_bonus")]
        format_bonus: f64,
        /// `floor`, in `[0, 1]` (default 0.5).
        #[serde(default = "d_floor")]
        correct_floor: f64,
        /// `c_S` (default 0.2).
        #[serde(default = "d_credit")]
        search_credit: f64,
        /// `c_Q` (default 0.2).
        #[serde(default = "d_credit")]
        query_credit: f64,
        /// `C_S`, ≥ 1 (default 8).
        #[serde(default = "d_search_cap")]
        search_cap: usize,
        /// `C_Q`, ≥ 1 (default 16).
        #[serde(default = "d_query_cap")]
        query_cap: usize,
        /// `B_v` (default 1).
        #[serde(default = "d_budget")]
        verification_budget: usize,
    },
    /// A reward from the registry.
    Custom {
        /// The name it was registered under; also its key in logs.
        name: String,
        /// Weight in the composite (any finite value).
        weight: f64,
        /// Its parameters, parsed by its factory (default: empty).
        #[serde(default)]
        params: Params,
    },
}

impl RewardsConfig {
    /// Parses a standalone `rewards` section, e.g. `(components: [Correctness()])`.
    ///
    /// ```
    /// use fathom_rewards::config::RewardsConfig;
    /// let config = RewardsConfig::from_ron("(components: [Correctness(weight: 1.0)])").unwrap();
    /// assert_eq!(config.components.len(), 1);
    /// let err = RewardsConfig::from_ron("(components: [Correctness(wieght: 1.0)])").unwrap_err();
    /// assert!(err.to_string().contains("wieght"));
    /// ```
    pub fn from_ron(text: &str) -> Result<Self, ConfigError> {
        Ok(ron::from_str(text)?)
    }

    /// Validates the configuration into a composite, building custom rewards from `registry`.
    ///
    /// ```
    /// use fathom_rewards::config::RewardsConfig;
    /// use fathom_rewards::registry::RewardRegistry;
    ///
    /// let bad = RewardsConfig::from_ron("(components: [TokenBudget(free_tokens: 10, saturate_tokens: 5)])")
    ///     .unwrap()
    ///     .build(&RewardRegistry::new())
    ///     .unwrap_err();
    /// assert!(bad.to_string().starts_with("rewards.components[0].saturate_tokens"));
    /// ```
    pub fn build(&self, registry: &RewardRegistry) -> Result<Composite, ConfigError> {
        if let Some(cap) = self.incorrect_cap
            && !cap.is_finite()
        {
            return Err(invalid(
                "rewards.incorrect_cap",
                format!("must be finite, got {cap}"),
            ));
        }
        let tol = self.matching.numeric_tolerance;
        if !(tol.is_finite() && (0.0..1.0).contains(&tol)) {
            return Err(invalid(
                "rewards.matching.numeric_tolerance",
                format!("must be in [0, 1), got {tol}"),
            ));
        }
        if self.components.is_empty() {
            return Err(invalid(
                "rewards.components",
                "must list at least one component".to_owned(),
            ));
        }
        let mut built: Vec<(f64, Box<dyn Reward>)> = Vec::with_capacity(self.components.len());
        for (index, component) in self.components.iter().enumerate() {
            built.push(build_component(index, component, registry)?);
        }
        // The composite checks the floor (finite, not above the cap); the error names the field.
        Composite::new(built, self.incorrect_cap, self.matching.clone())?
            .with_incorrect_floor(self.incorrect_floor)
            .map_err(|e| invalid("rewards.incorrect_floor", e.to_string()))
    }
}

fn invalid(field: &str, message: String) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_owned(),
        message,
    }
}

fn build_component(
    index: usize,
    component: &ComponentConfig,
    registry: &RewardRegistry,
) -> Result<(f64, Box<dyn Reward>), ConfigError> {
    let path = |field: &str| format!("rewards.components[{index}].{field}");
    let weight_sign = |weight: f64, positive: bool| -> Result<(), ConfigError> {
        let ok = weight.is_finite()
            && if positive {
                weight >= 0.0
            } else {
                weight <= 0.0
            };
        if ok {
            Ok(())
        } else {
            let want = if positive {
                "a finite number ≥ 0"
            } else {
                "a finite number ≤ 0 (it is a penalty)"
            };
            Err(invalid(
                &path("weight"),
                format!("must be {want}, got {weight}"),
            ))
        }
    };
    let non_negative = |field: &str, value: f64| -> Result<(), ConfigError> {
        if value.is_finite() && value >= 0.0 {
            Ok(())
        } else {
            Err(invalid(
                &path(field),
                format!("must be a finite number ≥ 0, got {value}"),
            ))
        }
    };
    Ok(match component {
        ComponentConfig::FormatGate { weight } => {
            weight_sign(*weight, true)?;
            (*weight, Box::new(FormatGate))
        }
        ComponentConfig::Correctness { weight } => {
            weight_sign(*weight, true)?;
            (*weight, Box::new(Correctness))
        }
        ComponentConfig::TokenBudget {
            weight,
            free_tokens,
            saturate_tokens,
        } => {
            weight_sign(*weight, false)?;
            if saturate_tokens <= free_tokens {
                return Err(invalid(
                    &path("saturate_tokens"),
                    format!(
                        "must be greater than free_tokens ({free_tokens}), got {saturate_tokens}"
                    ),
                ));
            }
            (
                *weight,
                Box::new(TokenBudget {
                    free_tokens: *free_tokens,
                    saturate_tokens: *saturate_tokens,
                }),
            )
        }
        ComponentConfig::RecursionEfficiency {
            weight,
            free_calls,
            max_calls,
        } => {
            weight_sign(*weight, true)?;
            if max_calls <= free_calls {
                return Err(invalid(
                    &path("max_calls"),
                    format!("must be greater than free_calls ({free_calls}), got {max_calls}"),
                ));
            }
            (
                *weight,
                Box::new(RecursionEfficiency {
                    free_calls: *free_calls,
                    max_calls: *max_calls,
                }),
            )
        }
        ComponentConfig::StepLevel {
            weight,
            format_bonus,
            correct_floor,
            search_credit,
            query_credit,
            search_cap,
            query_cap,
            verification_budget,
        } => {
            weight_sign(*weight, true)?;
            non_negative("format_bonus", *format_bonus)?;
            non_negative("search_credit", *search_credit)?;
            non_negative("query_credit", *query_credit)?;
            if !(0.0..=1.0).contains(correct_floor) {
                return Err(invalid(
                    &path("correct_floor"),
                    format!("must be in [0, 1], got {correct_floor}"),
                ));
            }
            for (field, cap) in [("search_cap", search_cap), ("query_cap", query_cap)] {
                if *cap == 0 {
                    return Err(invalid(
                        &path(field),
                        "must be at least 1, got 0".to_owned(),
                    ));
                }
            }
            let step = StepLevel {
                format_bonus: *format_bonus,
                correct_floor: *correct_floor,
                search_credit: *search_credit,
                query_credit: *query_credit,
                search_cap: *search_cap,
                query_cap: *query_cap,
                verification_budget: *verification_budget,
            };
            (*weight, Box::new(step))
        }
        ComponentConfig::Custom {
            name,
            weight,
            params,
        } => {
            if !weight.is_finite() {
                return Err(invalid(
                    &path("weight"),
                    format!("must be finite, got {weight}"),
                ));
            }
            let reward = registry
                .build(name, params)
                .map_err(|error| ConfigError::Custom { index, error })?;
            (*weight, reward)
        }
    })
}

/// Reads the `rewards` field of a whole recipe, ignoring every other top-level field (the
/// trainer's recipe owns and validates those). The recipe may be a named or unnamed RON struct.
///
/// ```
/// use fathom_rewards::config::rewards_from_recipe;
/// let recipe = r#"Recipe(model: "qwen", rewards: (components: [Correctness()]), steps: 10)"#;
/// assert_eq!(rewards_from_recipe(recipe).unwrap().components.len(), 1);
/// assert!(rewards_from_recipe("(model: \"qwen\")").unwrap_err().to_string().contains("`rewards`"));
/// ```
pub fn rewards_from_recipe(text: &str) -> Result<RewardsConfig, ConfigError> {
    let view: RecipeView = ron::from_str(text)?;
    view.rewards.ok_or(ConfigError::MissingRewards)
}

/// A recipe seen only through its `rewards` field.
struct RecipeView {
    rewards: Option<RewardsConfig>,
}

impl<'de> Deserialize<'de> for RecipeView {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ViewVisitor;

        impl<'de> Visitor<'de> for ViewVisitor {
            type Value = RecipeView;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a recipe struct with a `rewards` field")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RecipeView, A::Error> {
                let mut rewards = None;
                while let Some(key) = map.next_key::<String>()? {
                    if key == "rewards" {
                        if rewards.is_some() {
                            return Err(de::Error::duplicate_field("rewards"));
                        }
                        rewards = Some(map.next_value::<RewardsConfig>()?);
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(RecipeView { rewards })
            }
        }

        deserializer.deserialize_any(ViewVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reward::{Episode, ValueRange};

    fn err(text: &str) -> String {
        match RewardsConfig::from_ron(text).and_then(|c| c.build(&RewardRegistry::new())) {
            Ok(_) => panic!("{text} should be rejected"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn default_config_round_trips_through_ron() {
        let text =
            ron::ser::to_string_pretty(&RewardsConfig::default(), Default::default()).unwrap();
        assert_eq!(
            RewardsConfig::from_ron(&text).unwrap(),
            RewardsConfig::default()
        );
        assert_eq!(
            RewardsConfig::from_ron("()").unwrap(),
            RewardsConfig::default()
        );
    }

    #[test]
    fn unknown_fields_are_rejected_with_their_name() {
        for (text, field) in [
            ("(component: [])", "component"),
            ("(matching: (tolerance: 0.1))", "tolerance"),
            ("(components: [FormatGate(wieght: 0.1)])", "wieght"),
            ("(components: [TokenBudget(free: 10)])", "free"),
            ("(components: [RecursionEfficiency(max: 3)])", "max"),
            ("(components: [StepLevel(weight: 1.0, c1: 0.2)])", "c1"),
            (
                "(components: [Custom(name: \"x\", weight: 1.0, parms: ())])",
                "parms",
            ),
            ("(components: [Grounded(weight: 1.0)])", "Grounded"),
        ] {
            let message = err(text);
            assert!(message.contains(field), "{text}: {message}");
        }
    }

    #[test]
    fn invalid_values_name_their_field() {
        for (text, field) in [
            ("(incorrect_cap: Some(inf))", "rewards.incorrect_cap"),
            ("(incorrect_floor: Some(-inf))", "rewards.incorrect_floor"),
            (
                "(incorrect_cap: Some(0.0), incorrect_floor: 0.1)",
                "rewards.incorrect_floor",
            ),
            (
                "(matching: (numeric_tolerance: -1.0))",
                "rewards.matching.numeric_tolerance",
            ),
            ("(components: [])", "rewards.components"),
            (
                "(components: [Correctness(weight: -0.7)])",
                "rewards.components[0].weight",
            ),
            (
                "(components: [FormatGate(), TokenBudget(weight: 0.15)])",
                "rewards.components[1].weight",
            ),
            (
                "(components: [RecursionEfficiency(free_calls: 4, max_calls: 4)])",
                "rewards.components[0].max_calls",
            ),
            (
                "(components: [StepLevel(weight: 1.0, correct_floor: 1.5)])",
                "rewards.components[0].correct_floor",
            ),
            (
                "(components: [StepLevel(weight: 1.0, query_cap: 0)])",
                "rewards.components[0].query_cap",
            ),
            (
                "(components: [StepLevel(weight: 1.0, search_credit: -0.2)])",
                "rewards.components[0].search_credit",
            ),
            (
                "(components: [Correctness(), Correctness()])",
                "\"correctness\"",
            ),
            (
                "(components: [Custom(name: \"grounded\", weight: 1.0)])",
                "no custom reward named \"grounded\"",
            ),
        ] {
            let message = err(text);
            assert!(message.contains(field), "{text}: {message}");
        }
    }

    #[test]
    fn step_level_requires_a_weight() {
        assert!(err("(components: [StepLevel()])").contains("weight"));
    }

    struct Constant(f64);
    impl Reward for Constant {
        fn name(&self) -> &str {
            "constant"
        }
        fn range(&self) -> ValueRange {
            ValueRange {
                min: -10.0,
                max: 10.0,
            }
        }
        fn score(&self, _: &Episode<'_>) -> f64 {
            self.0
        }
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct ConstantParams {
        value: f64,
    }

    fn registry() -> RewardRegistry {
        let mut registry = RewardRegistry::new();
        registry
            .register("constant", |p: &Params| {
                let ConstantParams { value } = p.parse()?;
                Ok(Box::new(Constant(value)) as Box<dyn Reward>)
            })
            .unwrap();
        registry
    }

    #[test]
    fn custom_components_are_built_from_the_registry() {
        let config = RewardsConfig::from_ron(
            "(components: [Correctness(), Custom(name: \"constant\", weight: 0.5, params: (value: 2.0))])",
        )
        .unwrap();
        let composite = config.build(&registry()).unwrap();
        assert_eq!(
            composite.names().collect::<Vec<_>>(),
            ["correctness", "constant"]
        );
        assert_eq!(composite.weights().collect::<Vec<_>>(), [0.7, 0.5]);
    }

    #[test]
    fn custom_params_errors_name_the_component_and_field() {
        let config = RewardsConfig::from_ron(
            "(components: [Correctness(), Custom(name: \"constant\", weight: 0.5, params: (valu: 2.0))])",
        )
        .unwrap();
        let message = config.build(&registry()).unwrap_err().to_string();
        assert!(message.contains("rewards.components[1]"), "{message}");
        assert!(
            message.contains("constant") && message.contains("valu"),
            "{message}"
        );
    }

    #[test]
    fn recipe_extraction_ignores_other_fields_and_reports_positions() {
        let recipe = "#![enable(implicit_some)]\n(\n  model: (path: \"m\", lora: (r: 16)),\n  rewards: (incorrect_cap: 0.3),\n)";
        assert_eq!(
            rewards_from_recipe(recipe).unwrap().incorrect_cap,
            Some(0.3)
        );
        for (cap, want) in [
            ("Some(0.5)", Some(0.5)),
            ("None", None),
            ("1", Some(1.0)),
            ("0.2", Some(0.2)),
        ] {
            let recipe = format!("(rewards: (incorrect_cap: {cap}))");
            assert_eq!(
                rewards_from_recipe(&recipe).unwrap().incorrect_cap,
                want,
                "{cap}"
            );
        }
        assert!(rewards_from_recipe("(rewards: (incorrect_cap: \"high\"))").is_err());
        let broken =
            "(\n  steps: 3,\n  rewards: (components: [TokenBudget(free_tokens: \"many\")]),\n)";
        let message = rewards_from_recipe(broken).unwrap_err().to_string();
        assert!(message.contains("3:"), "{message}");
        assert!(matches!(
            rewards_from_recipe("(steps: 3)"),
            Err(ConfigError::MissingRewards)
        ));
        assert!(
            rewards_from_recipe("(rewards: (), rewards: ())")
                .unwrap_err()
                .to_string()
                .contains("rewards")
        );
        assert!(rewards_from_recipe("not ron at all {").is_err());
        assert!(rewards_from_recipe("[1, 2]").is_err());
    }
}
