//! Multi-hop chains: couriers pass parcels along; each hop is stated once, far from the
//! others, in one of several phrasings (one names the receiver first). Decoy couriers hand
//! parcels into the chain and the chain's last courier passes on further, so both the
//! direction and the number of hops matter.

use super::Generated;
use super::rng::Rng;
use super::text::{DocBuilder, Fact, Names, weekday};

/// Ways a hop is stated; `{A}` gives the parcel to `{B}`.
pub const HOP_TEMPLATES: &[&str] = &[
    "Courier {A} hands every parcel to courier {B}.",
    "Parcels carried by courier {A} go next to courier {B}.",
    "Courier {B} takes over every parcel that courier {A} carries.",
];

/// The question for a chain starting at `start` with `hops` hops.
pub fn question(start: &str, hops: usize) -> String {
    format!(
        "A parcel starts with courier {start} and is handed on {hops} times. Which courier holds it at the end?"
    )
}

fn hop(rng: &mut Rng, from: &str, to: &str) -> String {
    rng.pick(HOP_TEMPLATES)
        .replace("{A}", from)
        .replace("{B}", to)
}

/// Generates a multi-hop task of about `target_chars` characters.
pub fn generate(rng: &mut Rng, target_chars: usize) -> Generated {
    let mut names = Names::new();
    let cities: Vec<String> = (0..8).map(|_| names.city(rng)).collect();
    let hops = rng.range(2, 4);
    let chain: Vec<String> = (0..=hops + 1).map(|_| names.codename(rng)).collect();
    let mut facts = Vec::new();
    // The chain's hops, spread over the document; then one hop past its end.
    for i in 0..=hops {
        let text = hop(rng, &chain[i], &chain[i + 1]);
        let mut fact = Fact::sentence(rng, text);
        if i < hops {
            fact.at = (i as f64 + rng.unit()) / hops as f64;
        }
        facts.push(fact);
    }
    let decoys = (target_chars / 3000).clamp(4, 150);
    for i in 0..decoys {
        let from = names.codename(rng);
        let to = if i % 3 == 0 {
            chain[rng.range(1, hops)].clone()
        } else {
            names.codename(rng)
        };
        let text = hop(rng, &from, &to);
        facts.push(Fact::sentence(rng, text));
    }
    for _ in 0..rng.range(2, 4) {
        let who = &chain[rng.below(hops + 1)];
        let noise = if rng.chance(0.5) {
            format!(
                "Courier {who} was praised for punctuality on {}.",
                weekday(rng)
            )
        } else {
            format!("Courier {who} asked the office for a new satchel.")
        };
        facts.push(Fact::sentence(rng, noise));
    }
    let (document, spans) = DocBuilder::new(rng, cities).build(target_chars, &facts);
    Generated {
        document,
        question: question(&chain[0], hops),
        answer: chain[hops].clone(),
        aliases: Vec::new(),
        evidence: spans[..hops].to_vec(),
    }
}
