//! Comparisons across distant sections: two towns' populations at the latest census, one
//! stated early in the document and one late, in varied phrasings, among other towns'
//! figures and older census figures for the same two towns.

use super::Generated;
use super::rng::Rng;
use super::text::{DocBuilder, Fact, Names};

/// Ways the latest census figure is stated: `{T}` town, `{P}` population ("48,210").
pub const CENSUS_TEMPLATES: &[&str] = &[
    "At the latest census, {T} had a population of {P}.",
    "The latest census counted {P} residents in {T}.",
    "{T} is home to {P} people, according to the latest census.",
];

/// What is asked about towns `a` and `b`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ask {
    /// Which has more people.
    Larger,
    /// Which has fewer people.
    Smaller,
    /// By how many people `a` exceeds `b`.
    Difference,
}

/// The question for `ask` about towns `a` and `b`.
pub fn question(ask: Ask, a: &str, b: &str) -> String {
    match ask {
        Ask::Larger => {
            format!("Which town had the larger population at the latest census, {a} or {b}?")
        }
        Ask::Smaller => {
            format!("Which town had the smaller population at the latest census, {a} or {b}?")
        }
        Ask::Difference => {
            format!(
                "By how many people did the population of {a} exceed that of {b} at the latest census?"
            )
        }
    }
}

/// `48210` as "48,210".
pub fn with_commas(n: u32) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn census(rng: &mut Rng, town: &str, population: u32) -> String {
    rng.pick(CENSUS_TEMPLATES)
        .replace("{T}", town)
        .replace("{P}", &with_commas(population))
}

/// Generates a comparison task of about `target_chars` characters.
pub fn generate(rng: &mut Rng, target_chars: usize) -> Generated {
    let mut names = Names::new();
    let a = names.city(rng);
    let b = names.city(rng);
    let pa = rng.range(10_000, 99_999) as u32;
    let mut pb = rng.range(10_000, 99_999) as u32;
    while pa.abs_diff(pb) < 100 {
        pb = rng.range(10_000, 99_999) as u32;
    }
    let ask = match rng.below(3) {
        0 => Ask::Larger,
        1 => Ask::Smaller,
        _ => Ask::Difference,
    };
    // For a difference, the first-named town is the larger one.
    let (a, b, pa, pb) = if ask == Ask::Difference && pa < pb {
        (b, a, pb, pa)
    } else {
        (a, b, pa, pb)
    };
    let (answer, aliases) = match ask {
        Ask::Larger => (if pa > pb { a.clone() } else { b.clone() }, Vec::new()),
        Ask::Smaller => (if pa < pb { a.clone() } else { b.clone() }, Vec::new()),
        Ask::Difference => ((pa - pb).to_string(), vec![with_commas(pa - pb)]),
    };
    let (early, late) = if rng.chance(0.5) {
        ((&a, pa), (&b, pb))
    } else {
        ((&b, pb), (&a, pa))
    };
    let mut facts = vec![
        Fact {
            text: census(rng, early.0, early.1),
            at: 0.0,
            paragraph: false,
        },
        Fact {
            text: census(rng, late.0, late.1),
            at: 0.0,
            paragraph: false,
        },
    ];
    facts[0].at = 0.05 + 0.3 * rng.unit();
    facts[1].at = 0.65 + 0.3 * rng.unit();
    for town in [&a, &b] {
        if rng.chance(0.7) {
            let year = rng.range(1850, 1950);
            let old = rng.range(1_000, 9_999) as u32;
            let text = format!("In {year}, {town} had only {} residents.", with_commas(old));
            facts.push(Fact::sentence(rng, text));
        }
        let text = format!("{town} lies {} metres above sea level.", rng.range(5, 900));
        facts.push(Fact::sentence(rng, text));
    }
    let others = (target_chars / 4000).clamp(4, 80);
    let mut towns = vec![a.clone(), b.clone()];
    for _ in 0..others {
        let town = names.city(rng);
        let population = rng.range(10_000, 99_999) as u32;
        let text = census(rng, &town, population);
        facts.push(Fact::sentence(rng, text));
        towns.push(town);
    }
    let (document, spans) = DocBuilder::new(rng, towns).build(target_chars, &facts);
    Generated {
        document,
        question: question(ask, &a, &b),
        answer,
        aliases,
        evidence: spans[..2].to_vec(),
    }
}
