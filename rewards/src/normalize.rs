//! Answer normalisation and matching: when does a predicted answer count as the gold one?
//!
//! Matching is an exact comparison after normalisation, never a containment or similarity test,
//! so an answer that lists several candidates or wraps the gold answer in extra words does not
//! match. Two answers match when
//!
//! 1. both parse as plain decimal numbers ([`parse_number`]) and are numerically equal within a
//!    relative tolerance (`|a − b| ≤ tol · max(|a|, |b|)`, default `tol = 1e-9`); when both parse,
//!    this verdict is final — `"7"` and `"7.0"` match, `"7"` and `"8"` never fall back to text;
//! 2. otherwise, their [`normalize`]d texts are equal: Unicode NFKC, lower case, articles
//!    (`a`, `an`, `the` as whole words) dropped, every character that is neither alphanumeric nor a
//!    combining mark treated as a separator, whitespace collapsed.
//!
//! A task's aliases are accepted exactly like its gold answer.

use serde::{Deserialize, Serialize};
use unicode_normalization::UnicodeNormalization;
use unicode_normalization::char::is_combining_mark;

/// Words dropped by [`normalize`] (compared after lower-casing).
pub const ARTICLES: [&str; 3] = ["a", "an", "the"];

/// Default relative tolerance for numeric answers.
pub const DEFAULT_NUMERIC_TOLERANCE: f64 = 1e-9;

/// Normalises an answer for exact matching.
///
/// Steps, in order: Unicode NFKC; lower case; split on whitespace; drop words that are an
/// article once leading and trailing punctuation is stripped (`"The"`, `"the,"`); in the other
/// words, replace every character that is neither alphanumeric nor a combining mark by a space;
/// join the remaining pieces with single spaces.
///
/// ```
/// use fathom_rewards::normalize::normalize;
/// assert_eq!(normalize("  The Eiffel-Tower! "), "eiffel tower");
/// assert_eq!(normalize("ＡＢＣ　１２３"), "abc 123"); // NFKC folds full-width forms
/// assert_eq!(normalize("A-17"), "a 17"); // an article only counts as a whole word
/// ```
pub fn normalize(text: &str) -> String {
    let folded: String = text.nfkc().flat_map(char::to_lowercase).collect();
    let mut out = String::with_capacity(folded.len());
    for word in folded.split_whitespace() {
        let core = word.trim_matches(|c: char| !is_word_char(c));
        if ARTICLES.contains(&core) {
            continue;
        }
        let mut pending_space = !out.is_empty();
        for c in word.chars() {
            if is_word_char(c) {
                if pending_space {
                    out.push(' ');
                    pending_space = false;
                }
                out.push(c);
            } else {
                pending_space = !out.is_empty();
            }
        }
    }
    out
}

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || is_combining_mark(c)
}

/// Parses a plain decimal number: an optional sign, digits with an optional fractional part,
/// and optionally `,` thousands separators in groups of three (`"1,234.5"`). Surrounding
/// whitespace is ignored; exponents, `inf`, `nan`, units and currency signs are not numbers.
/// The text is NFKC-normalised first, so full-width digits parse.
///
/// ```
/// use fathom_rewards::normalize::parse_number;
/// assert_eq!(parse_number(" 1,234.50 "), Some(1234.5));
/// assert_eq!(parse_number("-.5"), Some(-0.5));
/// assert_eq!(parse_number("12,34"), None);
/// assert_eq!(parse_number("1e3"), None);
/// assert_eq!(parse_number("NaN"), None);
/// ```
pub fn parse_number(text: &str) -> Option<f64> {
    let text: String = text.nfkc().collect();
    let s = text.trim();
    let unsigned = s.strip_prefix(['-', '+']).unwrap_or(s);
    let (int, frac) = match unsigned.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (unsigned, None),
    };
    if let Some(f) = frac
        && (f.is_empty() || !f.bytes().all(|b| b.is_ascii_digit()))
    {
        return None;
    }
    if int.is_empty() && frac.is_none() {
        return None;
    }
    let digits: String = if int.contains(',') {
        let mut groups = int.split(',');
        let first = groups.next().unwrap_or_default();
        let first_ok = (1..=3).contains(&first.len()) && first.bytes().all(|b| b.is_ascii_digit());
        if !first_ok || !groups.all(|g| g.len() == 3 && g.bytes().all(|b| b.is_ascii_digit())) {
            return None;
        }
        int.replace(',', "")
    } else if int.bytes().all(|b| b.is_ascii_digit()) {
        int.to_owned()
    } else {
        return None;
    };
    let sign = if s.starts_with('-') { "-" } else { "" };
    let literal = match frac {
        Some(f) => format!(
            "{sign}{}.{f}",
            if digits.is_empty() { "0" } else { &digits }
        ),
        None => format!("{sign}{digits}"),
    };
    literal.parse::<f64>().ok().filter(|v| v.is_finite())
}

/// How predicted answers are compared with the gold answer and its aliases.
///
/// ```
/// use fathom_rewards::normalize::AnswerMatcher;
/// let m = AnswerMatcher::default();
/// assert!(m.matches("the Louvre.", "Louvre", &[]));
/// assert!(m.matches("7.0", "7", &[]));
/// assert!(m.matches("seven", "7", &["seven".to_owned()]));
/// assert!(!m.matches("Louvre, Orsay", "Louvre", &[]));
/// assert!(!m.matches("It is the Louvre", "Louvre", &[]));
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AnswerMatcher {
    /// Relative tolerance when both answers are numbers: `|a − b| ≤ tol · max(|a|, |b|)`.
    pub numeric_tolerance: f64,
}

impl Default for AnswerMatcher {
    fn default() -> Self {
        Self {
            numeric_tolerance: DEFAULT_NUMERIC_TOLERANCE,
        }
    }
}

impl AnswerMatcher {
    /// Whether `predicted` matches `gold` or one of `aliases` (see the module docs).
    pub fn matches(&self, predicted: &str, gold: &str, aliases: &[String]) -> bool {
        let predicted_number = parse_number(predicted);
        let mut predicted_text: Option<String> = None;
        std::iter::once(gold)
            .chain(aliases.iter().map(String::as_str))
            .any(|accepted| {
                if let (Some(a), Some(b)) = (predicted_number, parse_number(accepted)) {
                    return numbers_equal(a, b, self.numeric_tolerance);
                }
                let norm = predicted_text.get_or_insert_with(|| normalize(predicted));
                !norm.is_empty() && *norm == normalize(accepted)
            })
    }
}

fn numbers_equal(a: f64, b: f64, tolerance: f64) -> bool {
    a == b || (a - b).abs() <= tolerance * a.abs().max(b.abs())
}

/// Whether the normalised `needle` occurs in the normalised `haystack` as a run of whole words.
///
/// Used to decide whether an answer appeared in some output. An empty needle never occurs.
///
/// ```
/// use fathom_rewards::normalize::contains_words;
/// assert!(contains_words("Found: key 42 -> The Louvre.", "louvre"));
/// assert!(!contains_words("Louvres", "Louvre"));
/// ```
pub fn contains_words(haystack: &str, needle: &str) -> bool {
    let needle = normalize(needle);
    if needle.is_empty() {
        return false;
    }
    let haystack = normalize(haystack);
    haystack.match_indices(&needle).any(|(at, _)| {
        let before_ok = at == 0 || haystack.as_bytes()[at - 1] == b' ';
        let end = at + needle.len();
        let after_ok = end == haystack.len() || haystack.as_bytes()[end] == b' ';
        before_ok && after_ok
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_handles_case_punctuation_articles_and_whitespace() {
        assert_eq!(normalize("The  quick,\tbrown FOX."), "quick brown fox");
        assert_eq!(normalize("an apple a day"), "apple day");
        assert_eq!(normalize("\"the\""), "");
        assert_eq!(normalize("Theatre"), "theatre");
        assert_eq!(normalize("ﬁsh"), "fish"); // NFKC ligature
    }

    #[test]
    fn normalize_keeps_combining_marks() {
        // Devanagari vowel signs are combining marks, not separators.
        assert_eq!(normalize("हिंदी"), "हिंदी");
        assert_eq!(normalize("Cafe\u{301}"), "café");
    }

    #[test]
    fn numbers_compare_numerically_only_when_both_parse() {
        let m = AnswerMatcher::default();
        assert!(m.matches("1,000", "1000", &[]));
        assert!(m.matches("0.30000000000000004", "0.3", &[]));
        assert!(!m.matches("8", "7", &[]));
        assert!(!m.matches("7 apples", "7", &[]));
        assert!(m.matches("007", "7", &[]));
    }

    #[test]
    fn empty_answer_never_matches() {
        let m = AnswerMatcher::default();
        assert!(!m.matches("", "", &[]));
        assert!(!m.matches("the", "a", &[]));
    }

    #[test]
    fn parse_number_rejects_malformed() {
        for bad in [
            "", "-", ".", "1.", "1.2.3", "1,2", ",123", "1,2345", "abc", "1 000", "+-1",
        ] {
            assert_eq!(parse_number(bad), None, "{bad:?}");
        }
        assert_eq!(parse_number("+3"), Some(3.0));
        assert_eq!(parse_number("１２"), Some(12.0));
    }
}
