//! Fathom's RLM environment.

pub mod env;
pub mod expert;
pub mod parse;
pub mod policy;
pub mod prompt;
pub mod recursion;
pub mod sandbox;
pub mod sublm;
pub mod tasks;
pub mod tokens;
