//! Fathom's RLM environment (under construction: see issue 4).
