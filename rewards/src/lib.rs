//! Deterministic, composable rewards for Fathom's RLM episodes (under construction: see issue 6),
//! and the plain data they score.

pub mod record;
