//! Reading a passage: short biographies, each a paragraph that names its subject once and
//! then uses pronouns, stating where the person was born, worked and spent their last years
//! in varied phrasings, in shuffled order, next to other places (trips, relatives, letters).
//! Other biographies mention the same person in passing. Finding the right paragraph takes a
//! search; reading it is what `llm()` is for.
//!
//! [`read_passage`] is the rule-based reader the scripted sub-LM uses: it knows these
//! phrasings, but answers only from the passage it is given.

use super::Generated;
use super::rng::Rng;
use super::text::{DocBuilder, Fact, Names, Person};

/// What is asked about a person.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Where they were born.
    Born,
    /// Where they worked most of their career.
    Worked,
    /// Where they spent their final years.
    Final,
}

const ROLES: [Role; 3] = [Role::Born, Role::Worked, Role::Final];

/// Phrasings per role: `{P}`/`{p}` pronoun (capitalised or not), `{S}`/`{s}` possessive,
/// `{C}` the city, `{J}` the profession.
const BORN: &[&str] = &[
    "{P} was born in {C}.",
    "{C} was {s} birthplace.",
    "{P} came into the world in {C}.",
];
const WORKED: &[&str] = &[
    "For most of {s} career, {p} worked in {C}.",
    "{P} spent many years working in {C}.",
    "{C} was where {p} earned a living as a {J}.",
];
const FINAL: &[&str] = &[
    "{P} spent {s} final years in {C}.",
    "{P} eventually settled in {C}, where {p} died.",
    "{C} was where {p} lived out {s} last years.",
];
const ASIDES: &[&str] = &[
    "{P} once visited {C} on a short trip.",
    "{S} brother lived in {C} for a while.",
    "A letter from {C} reached {o} one winter.",
];
const JOBS: &[&str] = &[
    "cartographer",
    "glassblower",
    "bookbinder",
    "schoolteacher",
    "clockmaker",
    "surveyor",
    "pilot",
    "printer",
    "botanist",
    "stonemason",
    "archivist",
    "weaver",
];

fn templates(role: Role) -> &'static [&'static str] {
    match role {
        Role::Born => BORN,
        Role::Worked => WORKED,
        Role::Final => FINAL,
    }
}

fn fill(template: &str, who: &Person, city: &str, job: &str) -> String {
    template
        .replace("{P}", who.pron_cap())
        .replace("{p}", who.pron())
        .replace("{S}", who.poss_cap())
        .replace("{s}", who.poss())
        .replace("{o}", who.obj())
        .replace("{C}", city)
        .replace("{J}", job)
}

/// The question about `name` for `role`.
pub fn question(role: Role, name: &str) -> String {
    match role {
        Role::Born => format!("In which city was {name} born?"),
        Role::Worked => format!("In which city did {name} work for most of their career?"),
        Role::Final => format!("In which city did {name} spend their final years?"),
    }
}

/// Reads a question made by [`question`]: the role and the person's name.
pub fn parse_question(q: &str) -> Option<(Role, String)> {
    let q = q.trim();
    if let Some(rest) = q.strip_prefix("In which city was ") {
        return Some((Role::Born, rest.strip_suffix(" born?")?.to_string()));
    }
    let rest = q.strip_prefix("In which city did ")?;
    if let Some(name) = rest.strip_suffix(" work for most of their career?") {
        return Some((Role::Worked, name.to_string()));
    }
    Some((
        Role::Final,
        rest.strip_suffix(" spend their final years?")?.to_string(),
    ))
}

/// The biography of `who`: the naming sentence first, then the role sentences and asides
/// in random order. Returns the paragraph and the byte range of each role's sentence.
fn biography(
    rng: &mut Rng,
    who: &Person,
    cities: &[String; 3],
    asides: &[String],
    others: &[String],
) -> (String, [(usize, usize); 3]) {
    let job = rng.pick(JOBS);
    let mut sentences: Vec<(Option<usize>, String)> = Vec::new();
    for (i, role) in ROLES.iter().enumerate() {
        sentences.push((
            Some(i),
            fill(rng.pick(templates(*role)), who, &cities[i], job),
        ));
    }
    for (city, template) in asides.iter().zip(ASIDES.iter()) {
        sentences.push((None, fill(template, who, city, job)));
    }
    for other in others {
        sentences.push((
            None,
            format!("{} often exchanged letters with {other}.", who.pron_cap()),
        ));
    }
    rng.shuffle(&mut sentences);
    let mut text = format!("{} was a {job}.", who.name);
    let mut ranges = [(0, 0); 3];
    for (role, s) in sentences {
        text.push(' ');
        if let Some(i) = role {
            ranges[i] = (text.len(), text.len() + s.len());
        }
        text.push_str(&s);
    }
    (text, ranges)
}

/// Generates a passage task of about `target_chars` characters.
pub fn generate(rng: &mut Rng, target_chars: usize) -> Generated {
    let mut names = Names::new();
    let pool: Vec<String> = (0..24).map(|_| names.city(rng)).collect();
    let people: Vec<Person> = (0..(target_chars / 2500).clamp(4, 120))
        .map(|_| names.person(rng))
        .collect();
    let subject = &people[0];
    let role = rng.pick(&ROLES);
    let mut facts = Vec::new();
    let mut answer = String::new();
    let mut evidence = (0, 0);
    for (i, who) in people.iter().enumerate() {
        let mut picked: Vec<String> = Vec::new();
        while picked.len() < 3 + ASIDES.len() {
            let c = rng.pick(&pool);
            if !picked.contains(&c) {
                picked.push(c);
            }
        }
        let asides: Vec<String> = picked[3..]
            .iter()
            .take(rng.range(1, ASIDES.len()))
            .cloned()
            .collect();
        let cities = [picked[0].clone(), picked[1].clone(), picked[2].clone()];
        // Some other biographies mention the subject in passing.
        let others = if i > 0 && i <= 2 {
            vec![subject.name.clone()]
        } else {
            Vec::new()
        };
        let (text, ranges) = biography(rng, who, &cities, &asides, &others);
        if i == 0 {
            let ix = ROLES.iter().position(|r| *r == role).unwrap_or(0);
            answer = cities[ix].clone();
            evidence = ranges[ix];
        }
        facts.push(Fact {
            text,
            at: rng.unit(),
            paragraph: true,
        });
    }
    let (document, spans) = DocBuilder::new(rng, pool).build(target_chars, &facts);
    let base = spans[0].start;
    Generated {
        document,
        question: question(role, &subject.name),
        answer,
        aliases: Vec::new(),
        evidence: vec![fathom_rewards::record::Span {
            start: base + evidence.0,
            end: base + evidence.1,
        }],
    }
}

/// Answers a question made by [`question`] from a passage, the way a careful reader would:
/// the passage must be the person's own biography (it opens by naming them), and the answer
/// is the city of the sentence that states the asked role. `None` when the passage does not
/// say.
pub fn read_passage(q: &str, passage: &str) -> Option<String> {
    let (role, name) = parse_question(q)?;
    let passage = passage.trim();
    let rest = passage.strip_prefix(&format!("{name} was a "))?;
    for sentence in rest.split(". ").map(|s| s.trim_end_matches('.').trim()) {
        for template in templates(role) {
            if let Some(city) = match_city(template, sentence) {
                return Some(city);
            }
        }
    }
    None
}

/// Matches one sentence against a template, returning the city (`{C}`) if it fits.
fn match_city(template: &str, sentence: &str) -> Option<String> {
    let template = template.trim_end_matches('.');
    let (before, after) = template.split_once("{C}")?;
    let after = after.trim_start_matches(',');
    let words = |s: &str| s.split(' ').map(str::to_string).collect::<Vec<_>>();
    let (tb, ta, sw) = (words(before.trim()), words(after.trim()), words(sentence));
    let city_at = tb.iter().filter(|w| !w.is_empty()).count();
    let tail: Vec<&String> = ta.iter().filter(|w| !w.is_empty()).collect();
    if sw.len() != city_at + 1 + tail.len() {
        return None;
    }
    let fits = |t: &str, w: &str| match t {
        "{P}" => w == "She" || w == "He",
        "{p}" => w == "she" || w == "he",
        "{S}" => w == "Her" || w == "His",
        "{s}" => w == "her" || w == "his",
        "{o}" => w == "her" || w == "him",
        "{J}" => !w.is_empty(),
        _ => t == w,
    };
    let head_ok = tb
        .iter()
        .filter(|w| !w.is_empty())
        .zip(&sw)
        .all(|(t, w)| fits(t, w));
    let (city, tail_words) = (&sw[city_at], &sw[city_at + 1..]);
    let city = city.trim_end_matches(',');
    let tail_ok = tail.iter().zip(tail_words).all(|(t, w)| fits(t, w));
    (head_ok && tail_ok && !city.is_empty()).then(|| city.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reader_finds_each_role_in_each_phrasing() {
        let who = Person {
            name: "Ilse Varrow".into(),
            she: true,
        };
        for role in ROLES {
            for template in templates(role) {
                let sentence = fill(template, &who, "Dunmere", "weaver");
                let passage = format!(
                    "Ilse Varrow was a weaver. She once visited Oswick on a short trip. {sentence}"
                );
                let q = question(role, "Ilse Varrow");
                assert_eq!(
                    read_passage(&q, &passage).as_deref(),
                    Some("Dunmere"),
                    "{sentence}"
                );
            }
        }
    }

    #[test]
    fn reader_refuses_someone_elses_biography() {
        let passage = "Anton Brunke was a printer. He often exchanged letters with Ilse Varrow. He was born in Kelby.";
        assert_eq!(
            read_passage(&question(Role::Born, "Ilse Varrow"), passage),
            None
        );
    }

    #[test]
    fn questions_parse_back() {
        for role in ROLES {
            assert_eq!(
                parse_question(&question(role, "Ada Mork")),
                Some((role, "Ada Mork".to_string()))
            );
        }
    }
}
