//! Fathom's RLM environment.

pub mod sandbox;
