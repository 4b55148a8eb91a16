//! The scripted expert: a [`Policy`] that solves every task family through the real
//! environment by writing REPL code the way a good RLM would (search, read what it found,
//! compute, answer), and [`PassageReader`], the deterministic sub-LM it relies on for the
//! passage family. Its episodes prove the tasks solvable and become SFT traces.
//!
//! The expert knows the generators' question forms and phrasings (it is a script), but it
//! only ever learns the answer from what its code prints: it never sees the document or the
//! gold answer. The passage reader likewise answers from the passage in its prompt alone.

use regex::Regex;

use fathom_rewards::record::{Message, Role};

use crate::policy::{Policy, PolicyError};
use crate::sublm::{SubLm, SubLmError};
use crate::tasks::{aggregate, compare, multihop, needle, passage};

/// Separates the question from the passage in the expert's `llm()` prompts (the same marker
/// the environment's default [`crate::sublm::SubContext`] splits recursive prompts on).
pub const PROMPT_MARKER: &str = "\n---\n";

/// The scripted expert policy.
#[derive(Debug, Default, Clone, Copy)]
pub struct Expert;

/// The sub-LM the expert's passage code talks to: reads the passage after
/// [`PROMPT_MARKER`] and answers the `Question:` line before it, or says "unknown".
#[derive(Debug, Default, Clone, Copy)]
pub struct PassageReader;

impl SubLm for PassageReader {
    fn complete(&self, prompt: &str) -> Result<String, SubLmError> {
        let Some((head, passage)) = prompt.split_once(PROMPT_MARKER) else {
            return Ok("unknown".into());
        };
        let question = head
            .lines()
            .find_map(|l| l.strip_prefix("Question: "))
            .unwrap_or("");
        Ok(passage::read_passage(question, passage).unwrap_or_else(|| "unknown".into()))
    }
}

/// A task as the expert reads it from the question: its family and the names the question
/// gives. Other policies built on the expert (the trainer's varied SFT experts) read
/// questions through it too, so the question forms are parsed in one place.
#[derive(Clone, Debug, PartialEq)]
pub enum Plan {
    /// Find a vault's access code.
    Needle {
        /// The vault's label, as the question spells it.
        key: String,
    },
    /// Follow a parcel along a chain of couriers.
    MultiHop {
        /// The courier the parcel starts with.
        start: String,
        /// How many times it is handed on.
        hops: usize,
    },
    /// Sum, count or rank one town's shipments.
    Aggregate {
        /// The town whose shipments count.
        town: String,
        /// What to compute over them.
        ask: aggregate::Ask,
    },
    /// Compare two towns' latest census populations.
    Compare {
        /// The first town named.
        a: String,
        /// The second town named.
        b: String,
        /// Which comparison is asked.
        ask: compare::Ask,
    },
    /// Answer a question about one passage (the family that needs `llm()`).
    Passage {
        /// The question, whole.
        question: String,
    },
}

/// Reads `question` as one of the generators' question forms; `None` when it is none of them.
pub fn plan(question: &str) -> Option<Plan> {
    if let Some(key) = question
        .strip_prefix("What is the access code for vault ")
        .and_then(|r| r.strip_suffix('?'))
    {
        return Some(Plan::Needle {
            key: key.to_string(),
        });
    }
    let re =
        Regex::new(r"^A parcel starts with courier (\S+) and is handed on (\d+) times\.").ok()?;
    if let Some(c) = re.captures(question) {
        return Some(Plan::MultiHop {
            start: c[1].to_string(),
            hops: c[2].parse().ok()?,
        });
    }
    let agg = [
        (
            r"^What is the total weight, in kg, of all shipments from (\w+)\?$",
            0,
        ),
        (
            r"^How many shipments from (\w+) weighed more than (\d+) kg\?$",
            1,
        ),
        (
            r"^Which shipment from (\w+) was the heaviest\? Give its number\.$",
            2,
        ),
    ];
    for (pattern, kind) in agg {
        if let Some(c) = Regex::new(pattern).ok()?.captures(question) {
            let ask = match kind {
                0 => aggregate::Ask::Sum,
                1 => aggregate::Ask::CountOver(c[2].parse().ok()?),
                _ => aggregate::Ask::Heaviest,
            };
            return Some(Plan::Aggregate {
                town: c[1].to_string(),
                ask,
            });
        }
    }
    let cmp = [
        (
            r"^Which town had the larger population at the latest census, (\w+) or (\w+)\?$",
            compare::Ask::Larger,
        ),
        (
            r"^Which town had the smaller population at the latest census, (\w+) or (\w+)\?$",
            compare::Ask::Smaller,
        ),
        (
            r"^By how many people did the population of (\w+) exceed that of (\w+) at the latest census\?$",
            compare::Ask::Difference,
        ),
    ];
    for (pattern, ask) in cmp {
        if let Some(c) = Regex::new(pattern).ok()?.captures(question) {
            return Some(Plan::Compare {
                a: c[1].to_string(),
                b: c[2].to_string(),
                ask,
            });
        }
    }
    passage::parse_question(question).map(|_| Plan::Passage {
        question: question.to_string(),
    })
}

/// Turns a template like `"Vault {K} holds access code {C}."` into a regex with the given
/// replacements (each a literal or a capture group); the rest is matched literally.
fn template_regex(template: &str, slots: &[(&str, &str)]) -> String {
    let mut out = regex::escape(template);
    for (slot, with) in slots {
        out = out.replace(&regex::escape(slot), with);
    }
    out
}

/// A code turn.
fn code(body: &str) -> String {
    format!("```repl\n{}\n```", body.trim())
}

/// An answer turn.
fn answer(text: &str) -> String {
    format!("<answer>{text}</answer>")
}

/// Python string literal for `s` (the generators only produce plain ASCII names).
fn py(s: &str) -> String {
    format!("{s:?}")
}

impl Expert {
    fn needle(key: &str, observations: &[&str]) -> String {
        let Some(obs) = observations.first() else {
            return code(&format!(
                "{HELPER}{}",
                SEARCH_KEY.replace("@KEY@", &py(key))
            ));
        };
        for template in needle::RECORD_TEMPLATES {
            let pattern = template_regex(
                template,
                &[("{K}", &regex::escape(key)), ("{C}", r"(\d{4}-[A-Z]{2})")],
            );
            if let Some(c) = Regex::new(&pattern).ok().and_then(|re| re.captures(obs)) {
                return answer(&c[1]);
            }
        }
        answer("unknown")
    }

    fn multihop(start: &str, hops: usize, observations: &[&str]) -> String {
        let mut current = start.to_string();
        for obs in observations {
            match next_courier(&current, obs) {
                Some(next) => current = next,
                None => return answer("unknown"),
            }
        }
        if observations.len() >= hops {
            return answer(&current);
        }
        let cell = FOLLOW_COURIER
            .replace("@CUR@", &py(&current))
            .replace("@HOP@", &(observations.len() + 1).to_string())
            .replace("@HOPS@", &hops.to_string());
        code(&if observations.is_empty() {
            format!("{HELPER}{cell}")
        } else {
            cell
        })
    }

    fn aggregate(town: &str, ask: aggregate::Ask, observations: &[&str]) -> String {
        match observations {
            [] => code(&format!("{HELPER}{}", SHAPES.replace("@TOWN@", &py(town)))),
            [shapes] => {
                let mut patterns = Vec::new();
                for template in aggregate::RECORD_TEMPLATES {
                    let shape = template
                        .replace("{N}", "N")
                        .replace("{W}", "N")
                        .replace("{O}", "TOWN");
                    if shapes.contains(&shape) {
                        let re = template_regex(
                            template,
                            &[("{N}", r"(\d+)"), ("{W}", r"(\d+)"), ("{O}", town)],
                        );
                        patterns.push(format!(
                            "    r{},",
                            py(&re).replace("\\\\", "\\").replace(r"\#", "#")
                        ));
                    }
                }
                let report = match ask {
                    aggregate::Ask::Sum => {
                        "print(\"answer:\", sum(w for n, w in rows))".to_string()
                    }
                    aggregate::Ask::CountOver(x) => {
                        format!("print(\"answer:\", sum(1 for n, w in rows if w > {x}))")
                    }
                    aggregate::Ask::Heaviest => {
                        "print(\"answer:\", max(rows, key=lambda r: r[1])[0])".to_string()
                    }
                };
                code(
                    &COMPUTE
                        .replace("@PATTERNS@", &patterns.join("\n"))
                        .replace("@TOWN@", &py(town))
                        .replace("@REPORT@", &report),
                )
            }
            [_, result, ..] => {
                let found = result.lines().find_map(|l| l.strip_prefix("answer: "));
                answer(found.map(str::trim).unwrap_or("unknown"))
            }
        }
    }

    fn compare(a: &str, b: &str, ask: compare::Ask, observations: &[&str]) -> String {
        let Some(obs) = observations.first() else {
            return code(&format!(
                "{HELPER}{}",
                CENSUS.replace("@TOWNS@", &format!("[{}, {}]", py(a), py(b)))
            ));
        };
        let population = |town: &str| -> Option<u32> {
            compare::CENSUS_TEMPLATES.iter().find_map(|template| {
                let re = template_regex(
                    template,
                    &[("{T}", &regex::escape(town)), ("{P}", r"([\d,]+)")],
                );
                let c = Regex::new(&re).ok()?.captures(obs)?;
                c[1].replace(',', "").parse().ok()
            })
        };
        let (Some(pa), Some(pb)) = (population(a), population(b)) else {
            return answer("unknown");
        };
        match ask {
            compare::Ask::Larger => answer(if pa > pb { a } else { b }),
            compare::Ask::Smaller => answer(if pa < pb { a } else { b }),
            compare::Ask::Difference => answer(&pa.saturating_sub(pb).to_string()),
        }
    }

    fn passage(question: &str, observations: &[&str]) -> String {
        let Some(obs) = observations.first() else {
            let name = passage::parse_question(question)
                .map(|(_, n)| n)
                .unwrap_or_default();
            return code(
                &READ_PASSAGES
                    .replace("@NAME@", &py(&name))
                    .replace("@QUESTION@", &py(question)),
            );
        };
        let found = obs
            .lines()
            .filter_map(|l| l.rsplit_once(" -> ").map(|(_, r)| r.trim()))
            .find(|r| !r.eq_ignore_ascii_case("unknown") && !r.starts_with('['));
        answer(found.unwrap_or("unknown"))
    }
}

/// The courier `current` hands the parcel to, according to the hop sentences in `obs` (any
/// of the generator's three phrasings, read in their direction; a sentence's final period
/// may be missing, as when a search printed the sentence up to it). `None` when `obs` states
/// no hop from `current`.
pub fn next_courier(current: &str, obs: &str) -> Option<String> {
    let name = r"([A-Z]+-\d+)";
    for template in multihop::HOP_TEMPLATES {
        let template = template.strip_suffix('.').unwrap_or(template);
        let re = Regex::new(&template_regex(template, &[("{A}", name), ("{B}", name)])).ok()?;
        let a_first = template.find("{A}") < template.find("{B}");
        for c in re.captures_iter(obs) {
            let (a, b) = if a_first {
                (&c[1], &c[2])
            } else {
                (&c[2], &c[1])
            };
            if a == current {
                return Some(b.to_string());
            }
        }
    }
    None
}

impl Policy for Expert {
    fn respond(&self, messages: &[Message]) -> Result<String, PolicyError> {
        let first = messages
            .iter()
            .find(|m| m.role == Role::User)
            .ok_or_else(|| PolicyError("no user message".into()))?;
        let question = first
            .content
            .strip_prefix("Question: ")
            .and_then(|r| r.split("\n\n").next())
            .ok_or_else(|| PolicyError("the first user message has no question".into()))?;
        let observations: Vec<&str> = messages
            .iter()
            .filter(|m| m.role == Role::User)
            .skip(1)
            .map(|m| m.content.as_str())
            .collect();
        let Some(plan) = plan(question) else {
            return Ok(answer("unknown"));
        };
        Ok(match plan {
            Plan::Needle { key } => Expert::needle(&key, &observations),
            Plan::MultiHop { start, hops } => Expert::multihop(&start, hops, &observations),
            Plan::Aggregate { town, ask } => Expert::aggregate(&town, ask, &observations),
            Plan::Compare { a, b, ask } => Expert::compare(&a, &b, ask, &observations),
            Plan::Passage { question } => Expert::passage(&question, &observations),
        })
    }
}

/// Defines `sentences_with(word)`: every sentence of the document that mentions `word`.
const HELPER: &str = r#"
import re

def sentences_with(word):
    found = []
    for m in re.finditer(r"(?<![\w-])" + re.escape(word) + r"(?![\w-])", context):
        start = max(context.rfind(".", 0, m.start()), context.rfind("\n", 0, m.start())) + 1
        end = context.find(".", m.end()) + 1 or len(context)
        found.append(context[start:end].strip())
    return found
"#;

const SEARCH_KEY: &str = r#"
key = @KEY@
found = sentences_with(key)
print(len(found), "sentences mention", key)
for s in found:
    print("-", s)
"#;

const FOLLOW_COURIER: &str = r#"
cur = @CUR@  # hop @HOP@ of @HOPS@: whom does this courier pass parcels to?
for s in sentences_with(cur):
    print("-", s)
"#;

const SHAPES: &str = r#"
town = @TOWN@
found = sentences_with(town)
print(len(found), "sentences mention", town)
shapes = {}
for s in found:
    shape = re.sub(r"\d+", "N", s.replace(town, "TOWN"))
    shapes[shape] = shapes.get(shape, 0) + 1
for shape, n in sorted(shapes.items(), key=lambda kv: -kv[1]):
    print(n, "x", shape)
"#;

const COMPUTE: &str = r#"
patterns = [
@PATTERNS@
]
rows = []
for p in patterns:
    rows += [(int(n), int(w)) for n, w in re.findall(p, context)]
print(len(rows), "shipments from", @TOWN@)
@REPORT@
"#;

const CENSUS: &str = r#"
for town in @TOWNS@:
    print("==", town)
    for s in sentences_with(town):
        if re.search(r"census|population|residents|people", s):
            print("-", s)
"#;

const READ_PASSAGES: &str = r#"
import re
name = @NAME@
question = @QUESTION@
seen = set()
for m in re.finditer(re.escape(name), context):
    start = context.rfind("\n\n", 0, m.start()) + 2
    if start in seen:
        continue
    seen.add(start)
    end = context.find("\n\n", m.end())
    passage = context[start:end if end != -1 else len(context)]
    reply = llm("Question: " + question + "\nAnswer with just the city, or 'unknown' if the passage does not say.\n---\n" + passage)
    print(repr(passage[:50]), "->", reply)
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_question_form_is_planned() {
        let c = crate::tasks::TaskConfig {
            context_window: 256,
            ..Default::default()
        };
        for i in 0..60 {
            let t = crate::tasks::split_task(fathom_rewards::record::Split::Train, i, &c).unwrap();
            assert!(plan(&t.question).is_some(), "{}: {}", t.id, t.question);
        }
    }

    #[test]
    fn next_courier_reads_each_phrasing_in_its_direction() {
        for template in multihop::HOP_TEMPLATES {
            let sentence = template
                .replace("{A}", "QUARTZ-79")
                .replace("{B}", "SWIFT-78");
            let printed = format!("Output:\n[{:?}]", sentence.trim_end_matches('.'));
            for obs in [sentence.as_str(), printed.as_str()] {
                assert_eq!(
                    next_courier("QUARTZ-79", obs).as_deref(),
                    Some("SWIFT-78"),
                    "{obs}"
                );
                assert_eq!(next_courier("SWIFT-78", obs), None, "{obs}");
            }
        }
        assert_eq!(next_courier("QUARTZ-79", "Output:\n[]"), None);
    }

    #[test]
    fn reader_answers_from_the_passage_only() {
        let prompt = "Question: In which city was Ada Mork born?\nAnswer with just the city.\n---\nAda Mork was a weaver. She was born in Kelby.";
        assert_eq!(PassageReader.complete(prompt).unwrap(), "Kelby");
        let other = "Question: In which city was Ada Mork born?\n---\nIvo Thaln was a weaver. He was born in Kelby.";
        assert_eq!(PassageReader.complete(other).unwrap(), "unknown");
    }
}
