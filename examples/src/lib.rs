//! Custom rewards a Fathom user would write, and how they plug in.
//!
//! - [`grounded::Grounded`] (`"grounded"`): pays only answers whose text appeared in the
//!   output of a REPL cell that did not itself contain the answer — the answer was *found* in
//!   the document, not guessed or typed in.
//! - [`family::FamilyWeighted`] (`"family_weighted"`): pays correct answers by task family, so
//!   a recipe can weight hard families (multi-hop, aggregation) above easy ones.
//!
//! Rust has no dynamic plugins: a custom reward is compiled into the binary. [`register`] adds
//! both rewards to a [`RewardRegistry`]; `xtask` calls it before building a recipe's composite,
//! so recipes can name them (`Custom(name: "grounded", …)`). Each reward has a recipe and a
//! task + trajectory pair under `examples/<name>/`; `examples/README.md` walks through writing
//! your own.

pub mod family;
pub mod grounded;

use fathom_rewards::registry::{RegistryError, RewardRegistry};

/// Registers every example reward under its name.
///
/// ```
/// use fathom_rewards::RewardRegistry;
/// let mut registry = RewardRegistry::new();
/// fathom_examples::register(&mut registry).unwrap();
/// assert_eq!(registry.names().collect::<Vec<_>>(), ["family_weighted", "grounded"]);
/// ```
pub fn register(registry: &mut RewardRegistry) -> Result<(), RegistryError> {
    registry.register(grounded::NAME, grounded::Grounded::from_params)?;
    registry.register(family::NAME, family::FamilyWeighted::from_params)?;
    Ok(())
}
