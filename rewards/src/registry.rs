//! The registry of custom rewards: how a recipe names a reward that is not built in.
//!
//! Rust has no dynamic plugins, so a custom reward is compiled into the binary that trains or
//! scores: its crate exposes a factory, the binary registers the factory under a name before
//! building the recipe's composite, and the recipe then says `Custom(name: "…", weight: …,
//! params: (…))`. `xtask` registers the rewards of the `fathom-examples` crate this way; a user
//! with their own rewards adds one `register` call next to it (see `examples/README.md`).

use std::collections::BTreeMap;
use std::fmt;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use thiserror::Error;

use crate::reward::Reward;

/// Names of the built-in components, which custom rewards may not take.
pub const BUILT_IN_NAMES: [&str; 5] = [
    "format_gate",
    "correctness",
    "token_budget",
    "recursion_efficiency",
    "step_level",
];

/// The `params` of a `Custom(…)` component: kept as the recipe's RON text, and parsed by the
/// reward's factory into its own parameter type — so params can use all of RON, enums
/// included (`mode: strict`, `{multi_hop: 1.5}`).
///
/// Omitted params read as `()`, which parses as a struct whose fields all have defaults.
///
/// ```
/// use fathom_rewards::registry::Params;
/// use serde::Deserialize;
///
/// #[derive(Debug, Deserialize)]
/// #[serde(deny_unknown_fields)]
/// struct Grounding { min_chars: usize }
///
/// let params = Params::from_ron("(min_chars: 3)").unwrap();
/// assert_eq!(params.parse::<Grounding>().unwrap().min_chars, 3);
/// let err = Params::from_ron("(min_chars: 3, typo: 1)").unwrap().parse::<Grounding>().unwrap_err();
/// assert!(err.to_string().contains("typo"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Params(Box<ron::value::RawValue>);

impl Default for Params {
    fn default() -> Self {
        Self::from_ron("()").expect("`()` is valid RON")
    }
}

impl Params {
    /// Parses params from RON text (checked to be one well-formed RON value).
    pub fn from_ron(text: &str) -> Result<Self, ParamsError> {
        ron::value::RawValue::from_boxed_ron(text.into())
            .map(Self)
            .map_err(|e| ParamsError::new(e.to_string()))
    }

    /// The params' RON text, as written in the recipe.
    pub fn as_ron(&self) -> &str {
        self.0.get_ron()
    }

    /// Deserialises the params into the reward's own parameter type; unknown fields are
    /// rejected by types that use `#[serde(deny_unknown_fields)]`, with the field's name and
    /// its position within the params.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, ParamsError> {
        self.0
            .into_rust()
            .map_err(|e| ParamsError::new(e.to_string()))
    }
}

impl<'de> Deserialize<'de> for Params {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Box::<ron::value::RawValue>::deserialize(deserializer).map(Self)
    }
}

impl Serialize for Params {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

/// A custom reward's params were rejected; the message says which and why.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("{0}")]
pub struct ParamsError(String);

impl ParamsError {
    /// An error with this message (name the offending field in it).
    pub fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

/// Why registering or building a custom reward failed.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum RegistryError {
    /// The name is already registered.
    #[error("a custom reward named {0:?} is already registered")]
    Duplicate(String),
    /// The name belongs to a built-in component.
    #[error("{0:?} is a built-in reward component and cannot be registered as a custom one")]
    Reserved(String),
    /// The name is empty or has characters other than `a-z`, `0-9` and `_`.
    #[error("custom reward name {0:?} must be non-empty and use only a-z, 0-9 and _")]
    InvalidName(String),
    /// No reward is registered under the name.
    #[error("no custom reward named {name:?} is registered (registered: {known})")]
    Unknown {
        /// The name asked for.
        name: String,
        /// The registered names, comma-separated, or `none`.
        known: String,
    },
    /// The factory rejected the params.
    #[error("params of custom reward {name:?}: {error}")]
    Params {
        /// The reward's name.
        name: String,
        /// What the factory said.
        error: ParamsError,
    },
    /// The factory built a reward whose `name()` differs from its registered name.
    #[error("custom reward registered as {registered:?} reports the name {reported:?}")]
    NameMismatch {
        /// The registered name.
        registered: String,
        /// What `Reward::name` returned.
        reported: String,
    },
}

/// Builds a custom reward from its recipe params.
pub type Factory = Box<dyn Fn(&Params) -> Result<Box<dyn Reward>, ParamsError> + Send + Sync>;

/// Custom rewards by name.
///
/// ```
/// use fathom_rewards::registry::{Params, RewardRegistry};
/// use fathom_rewards::reward::{Episode, Reward};
///
/// struct Answered;
/// impl Reward for Answered {
///     fn name(&self) -> &str { "answered" }
///     fn score(&self, ep: &Episode<'_>) -> f64 { f64::from(u8::from(ep.answer.text().is_some())) }
/// }
///
/// let mut registry = RewardRegistry::new();
/// registry.register("answered", |_params: &Params| Ok(Box::new(Answered) as Box<dyn Reward>)).unwrap();
/// assert!(registry.register("correctness", |_p: &Params| Ok(Box::new(Answered) as Box<dyn Reward>)).is_err());
/// assert_eq!(registry.build("answered", &Params::default()).unwrap().name(), "answered");
/// ```
#[derive(Default)]
pub struct RewardRegistry {
    factories: BTreeMap<String, Factory>,
}

impl fmt::Debug for RewardRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RewardRegistry")
            .field("names", &self.factories.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl RewardRegistry {
    /// An empty registry (the built-in components need no registration).
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a factory under `name`.
    pub fn register<F>(&mut self, name: &str, factory: F) -> Result<(), RegistryError>
    where
        F: Fn(&Params) -> Result<Box<dyn Reward>, ParamsError> + Send + Sync + 'static,
    {
        if name.is_empty()
            || !name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        {
            return Err(RegistryError::InvalidName(name.to_owned()));
        }
        if BUILT_IN_NAMES.contains(&name) {
            return Err(RegistryError::Reserved(name.to_owned()));
        }
        if self.factories.contains_key(name) {
            return Err(RegistryError::Duplicate(name.to_owned()));
        }
        self.factories.insert(name.to_owned(), Box::new(factory));
        Ok(())
    }

    /// Registered names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.factories.keys().map(String::as_str)
    }

    /// Builds the reward registered under `name` from `params`.
    pub fn build(&self, name: &str, params: &Params) -> Result<Box<dyn Reward>, RegistryError> {
        let factory = self.factories.get(name).ok_or_else(|| {
            let known = self.names().collect::<Vec<_>>().join(", ");
            RegistryError::Unknown {
                name: name.to_owned(),
                known: if known.is_empty() {
                    "none".to_owned()
                } else {
                    known
                },
            }
        })?;
        let reward = factory(params).map_err(|error| RegistryError::Params {
            name: name.to_owned(),
            error,
        })?;
        if reward.name() != name {
            return Err(RegistryError::NameMismatch {
                registered: name.to_owned(),
                reported: reward.name().to_owned(),
            });
        }
        Ok(reward)
    }
}
