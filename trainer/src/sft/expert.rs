//! Variety for the scripted expert's SFT traces: a [`Style`] drawn per trace from a seeded
//! generator, and [`VariedExpert`], a [`Policy`] that runs `fathom_env`'s expert through it.
//!
//! What varies, and how:
//! - **Wording**: a short sentence before each code block (one of several per kind of turn),
//!   and several ways of giving the final answer.
//! - **Code surface**: the fence label (`repl` or `python`) and the names of the expert's
//!   variables and helper (renamed consistently across the whole trace).
//! - **Strategy**: for needle tasks, printing a window around each mention of the key
//!   instead of the sentences that mention it; or, when the recipe asks for it
//!   ([`crate::sft::TraceSettings::short_search`]), a two-line `re.findall` of the sentences
//!   that mention the key (short enough for a small model to learn to write). For multi-hop
//!   tasks, `short_search` makes one such search per hop: the sentence in which the current
//!   courier hands the parcel on, whose receiver ([`fathom_env::expert::next_courier`]) is
//!   the next one searched for.
//! - **Waste** (a configurable fraction of traces, so GRPO has something to improve): a first
//!   turn that prints a large slice of the document ([`Detour::Overread`]), or that sends a
//!   slice to `llm()` ([`Detour::LlmOveruse`]) before the expert's own work. The expert never
//!   sees that turn's output (it is removed from the conversation the expert reads), so its
//!   answer is unaffected; the trace still records the wasted tokens and call. Short
//!   multi-hop traces have no waste: up to four hops and the answer already fill the turns.
//!
//! Every variant only changes text the expert writes, never what it reads, so the traces stay
//! as correct as the expert (`tests/sft_traces.rs` runs them through the real environment).

use fathom_env::expert::{Expert, PROMPT_MARKER, Plan, next_courier, plan};
use fathom_env::policy::{Policy, PolicyError};
use fathom_rewards::record::{Family, Message, Role};
use rand::Rng;
use serde::{Deserialize, Serialize};

/// Sentences before a first code turn.
const OPENERS: &[&str] = &[
    "",
    "Let me search the document first.",
    "I'll look for the relevant part of the document.",
    "The document is too long to read whole, so I will search it.",
    "First, find where the question's subject is mentioned.",
];

/// Sentences before a later code turn.
const FOLLOW_UPS: &[&str] = &[
    "",
    "Next step.",
    "Now I can use what that printed.",
    "Continuing from the output above.",
    "Let me follow that up.",
];

/// Ways of giving the answer; `{}` is the answer.
const ANSWERS: &[&str] = &[
    "<answer>{}</answer>",
    "The output settles it.\n<answer>{}</answer>",
    "Found it.\n\n<answer>{}</answer>",
    "<answer>{}</answer>\n",
];

/// Names of the expert's helper and variables, renamed together.
const NAMES: &[[(&str, &str); 2]] = &[
    [("sentences_with", "sentences_with"), ("found", "found")],
    [("sentences_with", "mentions_of"), ("found", "hits")],
    [("sentences_with", "find_sentences"), ("found", "matches")],
];

/// A wasted first turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Detour {
    /// Prints this many characters of the document from its start (reading more than needed).
    Overread {
        /// Characters printed.
        chars: usize,
    },
    /// Sends this many characters from the document's start to `llm()` with the question
    /// (a sub-call that a search would have made unnecessary).
    LlmOveruse {
        /// Characters sent.
        chars: usize,
    },
}

/// How one trace is written.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Style {
    /// Index into the opening sentences.
    pub opener: usize,
    /// Index into the follow-up sentences.
    pub follow_up: usize,
    /// Index into the answer forms.
    pub answer: usize,
    /// Index into the name sets.
    pub names: usize,
    /// Fence label: `python` instead of `repl`.
    pub python_fence: bool,
    /// Needle tasks: print windows around the key instead of sentences.
    pub windows: bool,
    /// Needle tasks: a two-line `re.findall` of the key's sentences as the first code turn
    /// (overrides `windows`). Multi-hop tasks: one two-line `re.findall` per hop, of the
    /// sentence in which the current courier hands the parcel on.
    #[serde(default)]
    pub short_search: bool,
    /// Multi-hop tasks with `short_search`: each hop's code opens with `# hop K of N`.
    #[serde(default)]
    pub count_hops: bool,
    /// Multi-hop tasks with `short_search`: every turn, the answer's included, opens with the
    /// line `Handed on N times, hops left: R.` (N the chain's hops, copied from the question's
    /// own words, R those less the searches made so far), written before the choice between
    /// searching again and answering: the answer follows `hops left: 0.`
    #[serde(default)]
    pub tally_hops: bool,
    /// A wasted first turn, if any.
    pub detour: Option<Detour>,
    /// No sentences anywhere ([`Style::without_prose`]): the wasted `llm()` call's prompt is
    /// the question and a slice, without the instruction sentence.
    #[serde(default)]
    pub bare: bool,
}

impl Style {
    /// The expert's own style: no prose, its names, `repl` fences, no detour.
    pub fn plain() -> Style {
        Style {
            opener: 0,
            follow_up: 0,
            answer: 0,
            names: 0,
            python_fence: false,
            windows: false,
            short_search: false,
            count_hops: false,
            tally_hops: false,
            detour: None,
            bare: false,
        }
    }

    /// The same style with no sentences: bare code blocks, a bare `<answer>` tag, and a
    /// wasted `llm()` call (if any) whose prompt is just the question and the slice.
    pub fn without_prose(self) -> Style {
        Style {
            opener: 0,
            follow_up: 0,
            answer: 0,
            bare: true,
            ..self
        }
    }

    /// Draws a style for a trace of `family`; with probability `wasteful_fraction` it has
    /// a detour: an unneeded `llm()` call with probability `llm_share`, over-reading
    /// otherwise. With `short_search`,
    /// needle traces search with a two-line `re.findall` (no draw is spent on it, so the
    /// other choices are the same as without it), and multi-hop traces keep their detour only
    /// with `multi_hop_detours` (the draw is made either way, so the other choices do not
    /// depend on it).
    pub fn draw(
        rng: &mut impl Rng,
        family: Family,
        wasteful_fraction: f64,
        llm_share: f64,
        short_search: bool,
        multi_hop_detours: bool,
    ) -> Style {
        let detour = if rng.random_bool(wasteful_fraction.clamp(0.0, 1.0)) {
            let chars = rng.random_range(2000..=6000);
            // Drawn as "over-read" with 1 − llm_share, so at 0.5 the draws (and traces) are those
            // of recipes written before the setting existed.
            Some(if rng.random_bool(1.0 - llm_share.clamp(0.0, 1.0)) {
                Detour::Overread { chars }
            } else {
                Detour::LlmOveruse { chars }
            })
        } else {
            None
        };
        Style {
            opener: rng.random_range(0..OPENERS.len()),
            follow_up: rng.random_range(0..FOLLOW_UPS.len()),
            answer: rng.random_range(0..ANSWERS.len()),
            names: rng.random_range(0..NAMES.len()),
            python_fence: rng.random_bool(0.3),
            windows: family == Family::Needle && rng.random_bool(0.5),
            short_search: short_search && matches!(family, Family::Needle | Family::MultiHop),
            count_hops: false,
            tally_hops: false,
            // A short multi-hop trace already takes up to five turns (four hops and the
            // answer), so it wastes one only where the recipe gives it a sixth.
            detour: detour
                .filter(|_| multi_hop_detours || !(short_search && family == Family::MultiHop)),
            bare: false,
        }
    }
}

/// The expert, writing in a given style.
#[derive(Clone, Debug)]
pub struct VariedExpert {
    /// The style of every turn of the trace.
    pub style: Style,
}

/// The question of the first user message.
fn question(messages: &[Message]) -> Option<&str> {
    messages
        .iter()
        .find(|m| m.role == Role::User)?
        .content
        .strip_prefix("Question: ")?
        .split("\n\n")
        .next()
}

/// Python string literal of plain text.
fn py(s: &str) -> String {
    format!("{s:?}")
}

impl VariedExpert {
    fn fence(&self, preface: &str, code: &str) -> String {
        let label = if self.style.python_fence {
            "python"
        } else {
            "repl"
        };
        let block = format!("```{label}\n{}\n```", code.trim());
        if preface.is_empty() {
            block
        } else {
            format!("{preface}\n{block}")
        }
    }

    fn detour_turn(&self, detour: Detour, question: &str) -> String {
        let code = match detour {
            Detour::Overread { chars } => format!("print(context[:{chars}])"),
            Detour::LlmOveruse { chars } if self.style.bare => format!(
                "print(llm({qm} + context[:{chars}]))",
                qm = py(&format!("{question}{PROMPT_MARKER}")),
            ),
            Detour::LlmOveruse { chars } => format!(
                "reply = llm(\"Question: \" + {q} + \"\\nAnswer briefly, or 'unknown' if the text does not say.{marker}\" + context[:{chars}])\nprint(reply)",
                q = py(question),
                marker = PROMPT_MARKER.escape_default(),
            ),
        };
        self.fence(OPENERS[self.style.opener], &code)
    }

    /// The needle strategy with windows: every mention of the key with its surroundings.
    fn needle_windows(&self, key: &str) -> String {
        let code = format!(
            "import re\nkey = {k}\nfor m in re.finditer(r\"(?<![\\w-])\" + re.escape(key) + r\"(?![\\w-])\", context):\n    print(\"...\", context[max(0, m.start() - 120):m.end() + 120].replace(\"\\n\", \" \"), \"...\")",
            k = py(key)
        );
        self.fence(OPENERS[self.style.opener], &code)
    }

    /// The short needle strategy: the sentences that mention the key, by one regular expression.
    fn needle_short(&self, key: &str) -> String {
        let code = format!(
            "import re\nprint(re.findall(r\"[^.\\n]*\\b{k}\\b[^.\\n]*\\.?\", context))",
            k = re_escape(key)
        );
        self.fence(OPENERS[self.style.opener], &code)
    }

    /// One hop of the short multi-hop strategy: the sentence in which `courier` hands the
    /// parcel on. The three ways a hop is stated all put `courier <name>` right before `hands`,
    /// `go` or `carries` when `<name>` gives, and never when it receives. With
    /// [`Style::count_hops`] the code opens with `# hop {hop} of {hops}`.
    fn hop_short(&self, courier: &str, hop: usize, hops: usize) -> String {
        let preface = if hop == 1 {
            OPENERS[self.style.opener]
        } else {
            FOLLOW_UPS[self.style.follow_up]
        };
        let preface = self.tallied(hop - 1, hops, preface);
        let counter = if self.style.count_hops {
            format!("# hop {hop} of {hops}\n")
        } else {
            String::new()
        };
        let code = format!(
            "{counter}import re\nprint(re.findall(r\"[^.\\n]*courier {c} (?:hands|go|carries)[^.\\n]*\", context, re.I))",
            c = re_escape(courier)
        );
        self.fence(&preface, &code)
    }

    /// `text` after the line `Handed on {hops} times, hops left: {hops - done}.` where
    /// [`Style::tally_hops`] asks for it; `text` as it is otherwise.
    fn tallied(&self, done: usize, hops: usize, text: &str) -> String {
        match (self.style.tally_hops, text.is_empty()) {
            (false, _) => text.to_string(),
            (true, true) => format!("Handed on {hops} times, hops left: {}.", hops - done),
            (true, false) => format!(
                "Handed on {hops} times, hops left: {}.\n{text}",
                hops - done
            ),
        }
    }

    /// The short multi-hop strategy: search for the courier holding the parcel, read the
    /// receiver off the printed sentence, repeat once per hop, then answer with the last
    /// receiver.
    fn multihop_short(
        &self,
        start: &str,
        hops: usize,
        view: &[Message],
    ) -> Result<String, PolicyError> {
        let mut holder = start.to_string();
        // The observations that followed each search, in order.
        for observation in view.iter().filter(|m| m.role == Role::User).skip(1) {
            holder = next_courier(&holder, &observation.content).ok_or_else(|| {
                PolicyError(format!(
                    "no hop from courier {holder} in the observation {:?}",
                    observation.content
                ))
            })?;
        }
        let searched = view.iter().filter(|m| m.role == Role::Assistant).count();
        Ok(if searched < hops {
            self.hop_short(&holder, searched + 1, hops)
        } else {
            let answer = ANSWERS[self.style.answer % ANSWERS.len()].replace("{}", &holder);
            self.tallied(hops, hops, &answer)
        })
    }

    /// Rewrites one of the expert's messages in this style.
    fn restyle(&self, reply: &str, first_code_turn: bool) -> String {
        if let Some(body) = reply
            .strip_prefix("```repl\n")
            .and_then(|r| r.strip_suffix("\n```"))
        {
            let mut code = body.to_string();
            for (from, to) in NAMES[self.style.names % NAMES.len()] {
                code = rename(&code, from, to);
            }
            let preface = if first_code_turn {
                OPENERS[self.style.opener]
            } else {
                FOLLOW_UPS[self.style.follow_up]
            };
            return self.fence(preface, &code);
        }
        if let Some(answer) = reply
            .strip_prefix("<answer>")
            .and_then(|r| r.strip_suffix("</answer>"))
        {
            return ANSWERS[self.style.answer % ANSWERS.len()].replace("{}", answer);
        }
        reply.to_string()
    }
}

/// `s` as a literal in a Python regular expression outside a character class: its
/// metacharacters are escaped, nothing else (a vault label such as `O7-HARBOR` stays as it is,
/// so a model copies it from the question unchanged).
fn re_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 2);
    for c in s.chars() {
        if ".^$*+?{}[]\\|()".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Replaces the identifier `from` with `to` where it stands as a whole word.
fn rename(code: &str, from: &str, to: &str) -> String {
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    let mut out = String::with_capacity(code.len());
    let mut last = 0;
    for (i, _) in code.match_indices(from) {
        let before = code[..i].chars().last();
        let after = code[i + from.len()..].chars().next();
        if !before.is_some_and(is_word) && !after.is_some_and(is_word) {
            out.push_str(&code[last..i]);
            out.push_str(to);
            last = i + from.len();
        }
    }
    out.push_str(&code[last..]);
    out
}

impl Policy for VariedExpert {
    fn respond(&self, messages: &[Message]) -> Result<String, PolicyError> {
        let question = question(messages)
            .ok_or_else(|| PolicyError("the first user message has no question".into()))?
            .to_string();
        let assistant_turns = messages
            .iter()
            .filter(|m| m.role == Role::Assistant)
            .count();
        // The expert's view: the detour's turn and its observation removed.
        let view: Vec<Message> = match self.style.detour {
            Some(detour) if assistant_turns == 0 => return Ok(self.detour_turn(detour, &question)),
            Some(_) => {
                let first = messages
                    .iter()
                    .position(|m| m.role == Role::Assistant)
                    .unwrap_or(messages.len());
                messages
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| *i != first && *i != first + 1)
                    .map(|(_, m)| m.clone())
                    .collect()
            }
            None => messages.to_vec(),
        };
        let expert_turns = view.iter().filter(|m| m.role == Role::Assistant).count();
        match plan(&question) {
            Some(Plan::MultiHop { start, hops }) if self.style.short_search => {
                return self.multihop_short(&start, hops, &view);
            }
            Some(Plan::Needle { key })
                if expert_turns == 0 && (self.style.windows || self.style.short_search) =>
            {
                return Ok(if self.style.short_search {
                    self.needle_short(&key)
                } else {
                    self.needle_windows(&key)
                });
            }
            _ => {}
        }
        let reply = Expert.respond(&view)?;
        Ok(self.restyle(&reply, expert_turns == 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(role: Role, content: &str) -> Message {
        Message {
            role,
            content: content.to_string(),
        }
    }

    /// A system message and the question of a chain from RAVEN-71 with `hops` hand-overs.
    fn chain_view(hops: usize) -> Vec<Message> {
        vec![
            message(Role::System, "system"),
            message(
                Role::User,
                &format!(
                    "Question: A parcel starts with courier RAVEN-71 and is handed on {hops} times."
                ),
            ),
        ]
    }

    #[test]
    fn short_search_is_two_lines_with_the_key_escaped() {
        let expert = VariedExpert {
            style: Style {
                short_search: true,
                ..Style::plain()
            },
        };
        assert_eq!(
            expert.needle_short("O7-HARBOR"),
            "```repl\nimport re\nprint(re.findall(r\"[^.\\n]*\\bO7-HARBOR\\b[^.\\n]*\\.?\", context))\n```"
        );
    }

    #[test]
    fn multihop_short_reads_the_receiver_off_each_observation() {
        let expert = VariedExpert {
            style: Style {
                short_search: true,
                ..Style::plain().without_prose()
            },
        };
        let mut view = chain_view(2);
        assert_eq!(
            expert.multihop_short("RAVEN-71", 2, &view).unwrap(),
            "```repl\nimport re\nprint(re.findall(r\"[^.\\n]*courier RAVEN-71 (?:hands|go|carries)[^.\\n]*\", context, re.I))\n```"
        );
        // One search and its output, as the environment records them.
        let searched = |view: &mut Vec<Message>, output: &str| {
            view.push(message(Role::Assistant, "search"));
            view.push(message(Role::User, &format!("Output:\n{output}")));
            expert.multihop_short("RAVEN-71", 2, view)
        };
        let second = searched(
            &mut view,
            "['Parcels carried by courier RAVEN-71 go next to courier OSPREY-36']",
        );
        assert!(second.unwrap().contains("courier OSPREY-36 (?:"));
        let answer = searched(
            &mut view,
            "['Courier QUARTZ-79 takes over every parcel that courier OSPREY-36 carries']",
        );
        assert_eq!(answer.unwrap(), "<answer>QUARTZ-79</answer>");
        assert!(searched(&mut view, "[]").is_err());
        let error = expert.multihop_short("RAVEN-71", 3, &view).unwrap_err();
        assert!(error.0.contains("QUARTZ-79"), "{error}");
    }

    #[test]
    fn counted_hops_open_each_search_with_its_number() {
        let expert = VariedExpert {
            style: Style {
                short_search: true,
                count_hops: true,
                ..Style::plain().without_prose()
            },
        };
        let view = chain_view(3);
        assert_eq!(
            expert.multihop_short("RAVEN-71", 3, &view).unwrap(),
            "```repl\n# hop 1 of 3\nimport re\nprint(re.findall(r\"[^.\\n]*courier RAVEN-71 (?:hands|go|carries)[^.\\n]*\", context, re.I))\n```"
        );
    }

    #[test]
    fn tallied_hops_open_every_turn_with_the_hops_left() {
        let expert = VariedExpert {
            style: Style {
                short_search: true,
                tally_hops: true,
                ..Style::plain().without_prose()
            },
        };
        let mut view = chain_view(2);
        let first = expert.multihop_short("RAVEN-71", 2, &view).unwrap();
        assert!(
            first.starts_with("Handed on 2 times, hops left: 2.\n```repl\nimport re\n"),
            "{first}"
        );
        for (observation, tally) in [
            (
                "['Courier RAVEN-71 hands every parcel to courier OSPREY-36']",
                "Handed on 2 times, hops left: 1.\n```repl\n",
            ),
            (
                "['Parcels carried by courier OSPREY-36 go next to courier QUARTZ-79']",
                "Handed on 2 times, hops left: 0.\n<answer>QUARTZ-79</answer>",
            ),
        ] {
            view.push(message(Role::Assistant, "```repl\nsearch\n```"));
            view.push(message(Role::User, observation));
            let reply = expert.multihop_short("RAVEN-71", 2, &view).unwrap();
            assert!(reply.starts_with(tally), "{reply}");
        }
    }

    #[test]
    fn escapes_regex_metacharacters_only() {
        assert_eq!(re_escape("A1-B.c(d)*"), "A1-B\\.c\\(d\\)\\*");
    }

    #[test]
    fn renames_whole_words_only() {
        let code = "found = sentences_with(key)\nfor s in found:\n    unfound = found_x";
        assert_eq!(
            rename(code, "found", "hits"),
            "hits = sentences_with(key)\nfor s in hits:\n    unfound = found_x"
        );
    }

    #[test]
    fn styles_vary_with_the_seed_and_respect_the_waste_fraction() {
        use rand::SeedableRng;
        let mut rng = rand_chacha::ChaCha12Rng::seed_from_u64(3);
        let styles: Vec<Style> = (0..400)
            .map(|_| Style::draw(&mut rng, Family::Needle, 0.25, 0.5, false, false))
            .collect();
        let wasteful = styles.iter().filter(|s| s.detour.is_some()).count();
        assert!((70..=130).contains(&wasteful), "{wasteful} of 400");
        let distinct: std::collections::BTreeSet<_> = styles
            .iter()
            .map(|s| (s.opener, s.answer, s.names))
            .collect();
        assert!(distinct.len() > 30, "{}", distinct.len());
        assert!(styles.iter().any(|s| s.windows) && styles.iter().any(|s| !s.windows));
        let none = (0..100).all(|_| {
            Style::draw(&mut rng, Family::Compare, 0.0, 0.5, true, false)
                .detour
                .is_none()
        });
        assert!(none);
    }

    #[test]
    fn llm_share_picks_the_kind_of_detour() {
        use rand::SeedableRng;
        let kinds = |share: f64| {
            let mut rng = rand_chacha::ChaCha12Rng::seed_from_u64(9);
            let detours: Vec<Detour> = (0..400)
                .filter_map(|_| {
                    Style::draw(&mut rng, Family::Needle, 1.0, share, true, false).detour
                })
                .collect();
            let llm = detours
                .iter()
                .filter(|d| matches!(d, Detour::LlmOveruse { .. }))
                .count();
            (detours.len(), llm)
        };
        assert_eq!(kinds(1.0), (400, 400));
        assert_eq!(kinds(0.0), (400, 0));
        let (n, llm) = kinds(0.5);
        assert!(n == 400 && (150..=250).contains(&llm), "{llm} of {n}");
    }

    #[test]
    fn without_prose_turns_are_bare_blocks_and_tags() {
        use rand::SeedableRng;
        let mut rng = rand_chacha::ChaCha12Rng::seed_from_u64(5);
        for _ in 0..50 {
            let drawn = Style::draw(&mut rng, Family::Needle, 0.5, 0.5, true, false);
            let style = drawn.clone().without_prose();
            assert_eq!(
                (style.detour, style.names, style.python_fence),
                (drawn.detour, drawn.names, drawn.python_fence)
            );
            assert!(style.bare);
            if let Some(detour @ Detour::LlmOveruse { chars }) = style.detour {
                let turn = VariedExpert {
                    style: style.clone(),
                }
                .detour_turn(detour, "Who?");
                let label = if style.python_fence { "python" } else { "repl" };
                assert_eq!(
                    turn,
                    format!("```{label}\nprint(llm(\"Who?\\n---\\n\" + context[:{chars}]))\n```")
                );
            }
            let expert = VariedExpert { style };
            let first = expert.needle_short("A1-OAK");
            assert!(first.starts_with("```"), "{first}");
            assert!(
                expert
                    .restyle("```repl\nprint(1)\n```", false)
                    .starts_with("```")
            );
            assert_eq!(
                expert.restyle("<answer>42</answer>", false),
                "<answer>42</answer>"
            );
        }
    }
}
