//! Counting and aggregation: many shipment records in three phrasings, from several towns,
//! scattered through the document; the question asks for a sum, a count over a threshold,
//! or the heaviest shipment of one town. Decoy sentences mention the same towns with other
//! numbers (delays, depot capacities in kg) that a careless pattern would add up.

use super::Generated;
use super::rng::Rng;
use super::text::{DocBuilder, Fact, Names};

/// Ways a shipment is recorded: `{N}` number, `{O}` origin town, `{W}` weight in kg.
pub const RECORD_TEMPLATES: &[&str] = &[
    "Shipment #{N} from {O} weighed {W} kg.",
    "From {O}, shipment #{N} came in at {W} kg.",
    "Shipment #{N} ({O}) was logged at {W} kg.",
];

/// What is asked about one town's shipments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ask {
    /// Total weight.
    Sum,
    /// Number of shipments heavier than a threshold.
    CountOver(u32),
    /// Number of the heaviest shipment.
    Heaviest,
}

/// The question for `ask` about `origin`.
pub fn question(ask: Ask, origin: &str) -> String {
    match ask {
        Ask::Sum => format!("What is the total weight, in kg, of all shipments from {origin}?"),
        Ask::CountOver(x) => format!("How many shipments from {origin} weighed more than {x} kg?"),
        Ask::Heaviest => format!("Which shipment from {origin} was the heaviest? Give its number."),
    }
}

/// Generates an aggregation task of about `target_chars` characters.
pub fn generate(rng: &mut Rng, target_chars: usize) -> Generated {
    let mut names = Names::new();
    let towns: Vec<String> = (0..rng.range(3, 6)).map(|_| names.city(rng)).collect();
    let target = towns[0].clone();
    let records = (target_chars / 1500).clamp(12, 400);
    let mut numbers: Vec<u32> = Vec::new();
    let mut shipments: Vec<(u32, usize, u32)> = Vec::new();
    while shipments.len() < records {
        let n = rng.range(1000, 9999) as u32;
        if numbers.contains(&n) {
            continue;
        }
        numbers.push(n);
        // The target town gets at least a few records.
        let town = if shipments.len() < 3 {
            0
        } else {
            rng.below(towns.len())
        };
        shipments.push((n, town, rng.range(5, 95) as u32));
    }
    let ask = match rng.below(3) {
        0 => Ask::Sum,
        1 => Ask::CountOver(rng.range(30, 70) as u32),
        _ => Ask::Heaviest,
    };
    if ask == Ask::Heaviest {
        // Make the heaviest of the target town unique.
        let max = shipments
            .iter()
            .filter(|s| s.1 == 0)
            .map(|s| s.2)
            .max()
            .unwrap_or(0);
        let mut first = true;
        for s in shipments.iter_mut().filter(|s| s.1 == 0 && s.2 == max) {
            if !first {
                s.2 -= 1;
            }
            first = false;
        }
    }
    let mine: Vec<&(u32, usize, u32)> = shipments.iter().filter(|s| s.1 == 0).collect();
    let answer = match ask {
        Ask::Sum => mine.iter().map(|s| s.2).sum::<u32>().to_string(),
        Ask::CountOver(x) => mine.iter().filter(|s| s.2 > x).count().to_string(),
        Ask::Heaviest => mine
            .iter()
            .max_by_key(|s| s.2)
            .map(|s| s.0)
            .unwrap_or(0)
            .to_string(),
    };
    let aliases = if ask == Ask::Heaviest {
        vec![format!("#{answer}")]
    } else {
        Vec::new()
    };
    let mut facts = Vec::new();
    let mut evidence_ix = Vec::new();
    for &(n, town, w) in &shipments {
        if town == 0 {
            evidence_ix.push(facts.len());
        }
        let text = rng
            .pick(RECORD_TEMPLATES)
            .replace("{N}", &n.to_string())
            .replace("{O}", &towns[town])
            .replace("{W}", &w.to_string());
        facts.push(Fact::sentence(rng, text));
    }
    for _ in 0..(records / 6).max(3) {
        let town = &towns[rng.below(towns.len())];
        let text = if rng.chance(0.5) {
            format!(
                "A shipment from {town} was delayed by {} days.",
                rng.range(2, 9)
            )
        } else {
            format!(
                "The depot in {town} can hold {} kg in total.",
                rng.range(200, 900)
            )
        };
        facts.push(Fact::sentence(rng, text));
    }
    let (document, spans) = DocBuilder::new(rng, towns.clone()).build(target_chars, &facts);
    Generated {
        document,
        question: question(ask, &target),
        answer,
        aliases,
        evidence: evidence_ix.into_iter().map(|i| spans[i]).collect(),
    }
}
