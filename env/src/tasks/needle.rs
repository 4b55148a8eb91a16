//! Needle lookup: one vault's access code, stated once among many other vaults' codes
//! (some with look-alike labels), plus mentions of the same vault without its code and, at
//! times, a retired code for it. Finding the key is easy; taking the right sentence is not.

use super::Generated;
use super::rng::Rng;
use super::text::{DocBuilder, Fact, Names, season, weekday};

/// Ways a vault's current code is stated; `{K}` is the label, `{C}` the code.
pub const RECORD_TEMPLATES: &[&str] = &[
    "Vault {K} holds access code {C}.",
    "The access code for vault {K} is {C}.",
    "For vault {K}, staff use access code {C}.",
];

/// The question asked about label `key`.
pub fn question(key: &str) -> String {
    format!("What is the access code for vault {key}?")
}

fn record(template: &str, key: &str, code: &str) -> String {
    template.replace("{K}", key).replace("{C}", code)
}

fn code(rng: &mut Rng) -> String {
    let l = |r: &mut Rng| (b'A' + r.below(26) as u8) as char;
    format!("{}-{}{}", rng.range(1000, 9999), l(rng), l(rng))
}

/// A label that differs from `key` by its prefix or its word.
fn look_alike(rng: &mut Rng, key: &str, names: &mut Names) -> Option<String> {
    let (prefix, word) = key.split_once('-')?;
    for _ in 0..20 {
        let candidate = if rng.chance(0.5) {
            format!(
                "{}{}-{word}",
                (b'A' + rng.below(26) as u8) as char,
                rng.range(1, 9)
            )
        } else {
            format!("{prefix}-{word}S")
        };
        if names.claim(&candidate) {
            return Some(candidate);
        }
    }
    None
}

/// Generates a needle task of about `target_chars` characters.
pub fn generate(rng: &mut Rng, target_chars: usize) -> Generated {
    let mut names = Names::new();
    let cities: Vec<String> = (0..8).map(|_| names.city(rng)).collect();
    let key = names.label(rng);
    let answer = code(rng);
    let first = record(rng.pick(RECORD_TEMPLATES), &key, &answer);
    let mut facts = vec![Fact::sentence(rng, first)];
    let decoys = (target_chars / 2500).clamp(4, 200);
    for i in 0..decoys {
        let label = if i < 3 {
            look_alike(rng, &key, &mut names)
        } else {
            None
        };
        let label = label.unwrap_or_else(|| names.label(rng));
        let mut other = code(rng);
        while other == answer {
            other = code(rng);
        }
        let text = record(rng.pick(RECORD_TEMPLATES), &label, &other);
        facts.push(Fact::sentence(rng, text));
    }
    for _ in 0..rng.range(1, 3) {
        let mention = if rng.chance(0.5) {
            format!("Vault {key} was repainted in the {}.", season(rng))
        } else {
            format!(
                "Nobody could find the ledger for vault {key} on {}.",
                weekday(rng)
            )
        };
        facts.push(Fact::sentence(rng, mention));
    }
    if rng.chance(0.5) {
        let mut retired = code(rng);
        while retired == answer {
            retired = code(rng);
        }
        facts.push(Fact::sentence(
            rng,
            format!("A retired code, {retired}, was once used for vault {key}."),
        ));
    }
    let (document, spans) = DocBuilder::new(rng, cities).build(target_chars, &facts);
    Generated {
        document,
        question: question(&key),
        answer,
        aliases: Vec::new(),
        evidence: vec![spans[0]],
    }
}
