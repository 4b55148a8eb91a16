//! The raw material of documents: vocabularies, name makers, filler prose, and
//! [`DocBuilder`], which lays facts into filler at chosen relative positions and records the
//! exact span of each.
//!
//! Everything generated is ASCII, so byte offsets equal the Python `str` indices that
//! [`fathom_rewards::record::Span`] uses. Filler never uses the phrasings of any family's facts
//! (no "access code", "courier", "shipment", "census", "born"), so a fact can only be found
//! where a generator put it; each family adds its own look-alike decoys on top.

use std::collections::BTreeSet;

use fathom_rewards::record::Span;

use super::rng::Rng;

const SUBJECTS: &[&str] = &[
    "The committee",
    "A junior clerk",
    "The harbour master",
    "Our survey team",
    "The night shift",
    "The regional office",
    "A visiting inspector",
    "The archive staff",
    "The maintenance crew",
    "The finance desk",
    "A local supplier",
    "The weather station",
    "The planning board",
    "An old ferryman",
    "The school governors",
    "The guild secretary",
    "Two apprentices",
    "The district nurse",
    "A travelling surveyor",
    "The mill owners",
    "The lamp keepers",
];
const VERBS: &[&str] = &[
    "reviewed",
    "postponed",
    "discussed",
    "approved",
    "questioned",
    "summarised",
    "recorded",
    "revisited",
    "documented",
    "catalogued",
    "misplaced",
    "corrected",
    "copied out",
    "debated",
    "set aside",
    "checked",
    "rewrote",
    "filed",
    "read aloud",
    "signed off",
];
const OBJECTS: &[&str] = &[
    "the quarterly figures",
    "the revised schedule",
    "a backlog of requests",
    "the drainage plans",
    "the staffing rota",
    "the annual budget",
    "several old ledgers",
    "the supply contracts",
    "the safety checklist",
    "a stack of permits",
    "the tide tables",
    "the minutes of the last meeting",
    "the boundary maps",
    "a complaint about the noise",
    "the repair estimates",
    "the list of volunteers",
    "the ferry timetable",
    "the inventory of the east store",
    "a proposal for a new bridge",
];
const TAILS: &[&str] = &[
    "before the holiday",
    "after a long delay",
    "without much debate",
    "in the east wing",
    "during the morning meeting",
    "for the third time this year",
    "with some reluctance",
    "at the request of the board",
    "while the roads were closed",
    "late into the evening",
    "as the rain set in",
    "under a borrowed lamp",
    "to nobody's surprise",
    "in a hurry",
    "once the bell had rung",
    "with unusual care",
    "before anyone objected",
];
const WEEKDAYS: &[&str] = &[
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const SEASONS: &[&str] = &["spring", "summer", "autumn", "winter"];

const CITY_HEADS: &[&str] = &[
    "Ash", "Bel", "Cor", "Dun", "El", "Fen", "Gal", "Har", "Ir", "Kel", "Lor", "Mar", "Nor", "Os",
    "Pel", "Quen", "Ros", "Sel", "Tor", "Ul", "Val", "Wex", "Yar", "Zan", "Brin", "Cal", "Drey",
    "Tam",
];
const CITY_TAILS: &[&str] = &[
    "wick", "mere", "holt", "ford", "by", "stead", "haven", "moor", "field", "gate", "burg",
    "vale", "port", "ton", "mouth", "crest", "bridge", "combe",
];
/// First names with the pronoun each takes (`true`: she/her).
const FIRST_NAMES: &[(&str, bool)] = &[
    ("Ilse", true),
    ("Mara", true),
    ("Tove", true),
    ("Edith", true),
    ("Noor", true),
    ("Lena", true),
    ("Agnes", true),
    ("Rosa", true),
    ("Wilma", true),
    ("Greta", true),
    ("Ada", true),
    ("Hanne", true),
    ("Sabine", true),
    ("Yara", true),
    ("Clara", true),
    ("Odile", true),
    ("Petra", true),
    ("Ines", true),
    ("Anton", false),
    ("Bram", false),
    ("Cyril", false),
    ("Dorian", false),
    ("Emil", false),
    ("Felix", false),
    ("Gideon", false),
    ("Hugo", false),
    ("Ivo", false),
    ("Jonas", false),
    ("Karel", false),
    ("Lucan", false),
    ("Milo", false),
    ("Nils", false),
    ("Otto", false),
    ("Pavel", false),
    ("Ruben", false),
    ("Silas", false),
];
const SURNAME_HEADS: &[&str] = &[
    "Var", "Mor", "Hal", "Esk", "Brun", "Cald", "Dra", "Fal", "Gor", "Hest", "Lind", "Mart", "Orm",
    "Pend", "Rask", "Sten", "Thal", "Vos", "Wend", "Ald",
];
const SURNAME_TAILS: &[&str] = &[
    "n", "row", "sby", "ke", "dahl", "well", "ing", "mark", "holm", "ley", "strom", "wick", "ard",
    "ett",
];
const CODE_WORDS: &[&str] = &[
    "ALDER", "BIRCH", "CEDAR", "ELM", "HAZEL", "MAPLE", "ROWAN", "WILLOW", "ASPEN", "LARCH",
    "HERON", "PLOVER", "WREN", "FINCH", "KESTREL", "OSPREY", "RAVEN", "SWIFT", "ORCHID", "THISTLE",
    "TANSY", "SORREL", "YARROW", "BRAMBLE", "FLINT", "GARNET", "JASPER", "ONYX", "QUARTZ", "SLATE",
    "COBALT", "AMBER", "CINDER", "EMBER", "FROST", "GALE", "HARBOR", "LANTERN", "MARSH", "NORTH",
];

/// Makes unique names of each kind, never repeating one within a task.
pub struct Names {
    used: BTreeSet<String>,
}

/// A person: full name and pronouns.
#[derive(Clone, Debug)]
pub struct Person {
    /// "Ilse Varrow".
    pub name: String,
    /// Whether the person is "she" (else "he").
    pub she: bool,
}

impl Person {
    /// "she" / "he".
    pub fn pron(&self) -> &'static str {
        if self.she { "she" } else { "he" }
    }
    /// "She" / "He".
    pub fn pron_cap(&self) -> &'static str {
        if self.she { "She" } else { "He" }
    }
    /// "her" / "his".
    pub fn poss(&self) -> &'static str {
        if self.she { "her" } else { "his" }
    }
    /// "Her" / "His".
    pub fn poss_cap(&self) -> &'static str {
        if self.she { "Her" } else { "His" }
    }
    /// "her" / "him".
    pub fn obj(&self) -> &'static str {
        if self.she { "her" } else { "him" }
    }
}

impl Default for Names {
    fn default() -> Names {
        Names::new()
    }
}

impl Names {
    /// No names used yet.
    pub fn new() -> Names {
        Names {
            used: BTreeSet::new(),
        }
    }

    fn fresh(&mut self, rng: &mut Rng, make: impl Fn(&mut Rng) -> String) -> String {
        loop {
            let name = make(rng);
            if self.used.insert(name.clone()) {
                return name;
            }
        }
    }

    /// A city, e.g. "Dunmere".
    pub fn city(&mut self, rng: &mut Rng) -> String {
        self.fresh(rng, |r| {
            format!("{}{}", r.pick(CITY_HEADS), r.pick(CITY_TAILS))
        })
    }

    /// A person with a first name and a surname.
    pub fn person(&mut self, rng: &mut Rng) -> Person {
        let mut she = false;
        let name = self.fresh(rng, |r| {
            let (first, _) = r.pick(FIRST_NAMES);
            format!("{first} {}{}", r.pick(SURNAME_HEADS), r.pick(SURNAME_TAILS))
        });
        if let Some((_, s)) = FIRST_NAMES
            .iter()
            .find(|(f, _)| name.starts_with(&format!("{f} ")))
        {
            she = *s;
        }
        Person { name, she }
    }

    /// An upper-case code name with a number, e.g. "HERON-41".
    pub fn codename(&mut self, rng: &mut Rng) -> String {
        self.fresh(rng, |r| {
            format!("{}-{}", r.pick(CODE_WORDS), r.range(10, 99))
        })
    }

    /// A label like "Q7-ALDER".
    pub fn label(&mut self, rng: &mut Rng) -> String {
        self.fresh(rng, |r| {
            format!(
                "{}{}-{}",
                (b'A' + r.below(26) as u8) as char,
                r.range(1, 9),
                r.pick(CODE_WORDS)
            )
        })
    }

    /// Registers `name` as used (for look-alikes made by hand); false if it already was.
    pub fn claim(&mut self, name: &str) -> bool {
        self.used.insert(name.to_string())
    }
}

/// A weekday name.
pub fn weekday(rng: &mut Rng) -> &'static str {
    rng.pick(WEEKDAYS)
}

/// A season name.
pub fn season(rng: &mut Rng) -> &'static str {
    rng.pick(SEASONS)
}

/// Appends one filler sentence (with a leading space when not at a paragraph start).
fn filler_sentence(rng: &mut Rng, cities: &[String], out: &mut String) {
    match rng.below(10) {
        0 if !cities.is_empty() => {
            out.push_str("Travellers from ");
            out.push_str(&rng.pick(cities));
            out.push_str(" arrived late on ");
            out.push_str(weekday(rng));
            out.push('.');
        }
        1 => {
            out.push_str("Nothing of note happened in the ");
            out.push_str(season(rng));
            out.push_str(" of that year, apart from ");
            out.push_str(rng.pick(OBJECTS));
            out.push_str(" going missing.");
        }
        _ => {
            out.push_str(rng.pick(SUBJECTS));
            out.push(' ');
            out.push_str(rng.pick(VERBS));
            out.push(' ');
            out.push_str(rng.pick(OBJECTS));
            out.push(' ');
            out.push_str(rng.pick(TAILS));
            out.push('.');
        }
    }
}

/// A fact to lay into the document.
pub struct Fact {
    /// The text: one sentence, or a whole paragraph.
    pub text: String,
    /// Where it goes, as a fraction of the document (0 = start, 1 = end).
    pub at: f64,
    /// Whether it is a paragraph of its own (else a sentence inside a filler paragraph).
    pub paragraph: bool,
}

impl Fact {
    /// A sentence placed at a random position.
    pub fn sentence(rng: &mut Rng, text: String) -> Fact {
        Fact {
            text,
            at: rng.unit(),
            paragraph: false,
        }
    }
}

/// Lays facts into filler prose of a given length.
pub struct DocBuilder<'a> {
    rng: &'a mut Rng,
    cities: Vec<String>,
}

impl<'a> DocBuilder<'a> {
    /// A builder whose filler mentions `cities` now and then.
    pub fn new(rng: &'a mut Rng, cities: Vec<String>) -> DocBuilder<'a> {
        DocBuilder { rng, cities }
    }

    /// Builds a document of about `target_chars` characters holding `facts`; returns the text
    /// and, for each fact in the order given, its span.
    pub fn build(self, target_chars: usize, facts: &[Fact]) -> (String, Vec<Span>) {
        let rng = self.rng;
        let fact_chars: usize = facts.iter().map(|f| f.text.len() + 2).sum();
        let filler_chars = target_chars.saturating_sub(fact_chars);
        let mut order: Vec<usize> = (0..facts.len()).collect();
        order.sort_by(|&a, &b| facts[a].at.total_cmp(&facts[b].at).then(a.cmp(&b)));
        let mut spans = vec![Span { start: 0, end: 0 }; facts.len()];
        let mut text = String::with_capacity(target_chars + 256);
        let mut filler_written = 0usize;
        let mut next = 0;
        let mut section = 1;
        let mut paragraphs = 0;
        while next < order.len() || filler_written < filler_chars {
            if paragraphs % 7 == 0 {
                text.push_str(&format!("## Section {section}\n\n"));
                section += 1;
            }
            paragraphs += 1;
            let para_start = text.len();
            let sentences = rng.range(3, 7);
            for i in 0..sentences {
                let due = next < order.len()
                    && facts[order[next]].at * filler_chars as f64 <= filler_written as f64;
                if due && !facts[order[next]].paragraph && i > 0 {
                    let f = order[next];
                    text.push(' ');
                    let start = text.len();
                    text.push_str(&facts[f].text);
                    spans[f] = Span {
                        start,
                        end: text.len(),
                    };
                    next += 1;
                    continue;
                }
                if i > 0 {
                    text.push(' ');
                }
                let before = text.len();
                filler_sentence(rng, &self.cities, &mut text);
                filler_written += text.len() - before;
            }
            text.push_str("\n\n");
            debug_assert!(text.len() > para_start);
            while next < order.len()
                && facts[order[next]].paragraph
                && facts[order[next]].at * filler_chars as f64 <= filler_written as f64
            {
                let f = order[next];
                let start = text.len();
                text.push_str(&facts[f].text);
                spans[f] = Span {
                    start,
                    end: text.len(),
                };
                text.push_str("\n\n");
                next += 1;
            }
            // Sentence facts due exactly at the end are placed in the next paragraph.
            if filler_written >= filler_chars && next < order.len() && !facts[order[next]].paragraph
            {
                let f = order[next];
                let start = text.len();
                text.push_str(&facts[f].text);
                spans[f] = Span {
                    start,
                    end: text.len(),
                };
                text.push_str("\n\n");
                next += 1;
            }
        }
        let end = text.trim_end().len();
        text.truncate(end);
        text.push('\n');
        (text, spans)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_land_where_their_spans_say() {
        let mut rng = Rng::new(7);
        let facts = vec![
            Fact {
                text: "Fact one is here.".into(),
                at: 0.9,
                paragraph: false,
            },
            Fact {
                text: "A whole paragraph of fact.".into(),
                at: 0.1,
                paragraph: true,
            },
            Fact {
                text: "Fact at the very end.".into(),
                at: 1.0,
                paragraph: false,
            },
        ];
        let (text, spans) = DocBuilder::new(&mut rng, vec!["Dunmere".into()]).build(5000, &facts);
        assert!(text.is_ascii());
        for (fact, span) in facts.iter().zip(&spans) {
            assert_eq!(&text[span.start..span.end], fact.text);
        }
        assert!(spans[1].start < spans[0].start, "ordered by position");
        assert!((4500..6500).contains(&text.len()), "length {}", text.len());
    }

    #[test]
    fn names_are_unique() {
        let mut rng = Rng::new(3);
        let mut names = Names::new();
        let cities: BTreeSet<String> = (0..300).map(|_| names.city(&mut rng)).collect();
        assert_eq!(cities.len(), 300);
    }
}
