//! Reading an assistant turn into an action (DESIGN §4: one action per turn).
//!
//! - Code is a fenced block labelled `repl`, `python` or `py`, or unlabelled. Blocks with
//!   another label (e.g. `text`) are not code. A fence left open at the end of the message
//!   (generation stopped on the closing fence) runs to the end of the message.
//! - The answer is the text between `<answer>` and `</answer>` outside code blocks; an
//!   `<answer>` never closed (generation stopped on the closing tag) runs to the end.
//! - A turn with code **and** an answer runs the code and ignores the answer: answering
//!   before seeing the output is a guess, and the model is told so in the observation.
//! - A turn with several code blocks runs only the first; the model is told the others were
//!   ignored.
//! - A turn with neither, or with only an empty block, is invalid: nothing runs, the model is
//!   told the format, and the turn counts against the iteration cap.

use fathom_rewards::record::Action;

/// An assistant turn as the environment reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedTurn {
    /// What to do.
    pub action: Action,
    /// Remarks for the model about parts of the turn that were ignored.
    pub notes: Vec<String>,
}

const CODE_LABELS: &[&str] = &["repl", "python", "py", "python3", ""];

struct Block {
    code: String,
    start: usize,
    end: usize,
}

/// Finds the code blocks of `text`, with their byte ranges (fences included).
fn code_blocks(text: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut open: Option<(usize, bool, usize)> = None; // (block start, is code, body start)
    let mut pos = 0;
    for line in text.split_inclusive('\n') {
        let trimmed = line.trim();
        match open {
            None => {
                if let Some(label) = trimmed.strip_prefix("```") {
                    let label = label.trim().to_ascii_lowercase();
                    open = Some((pos, CODE_LABELS.contains(&label.as_str()), pos + line.len()));
                }
            }
            Some((start, is_code, body)) => {
                if trimmed == "```" {
                    if is_code {
                        blocks.push(Block {
                            code: text[body..pos].to_string(),
                            start,
                            end: pos + line.len(),
                        });
                    }
                    open = None;
                }
            }
        }
        pos += line.len();
    }
    if let Some((start, true, body)) = open {
        blocks.push(Block {
            code: text[body.min(text.len())..].to_string(),
            start,
            end: text.len(),
        });
    }
    blocks
}

/// Finds the answer outside the given blocks: `Some(text)` when an `<answer>` tag is there.
fn answer(text: &str, blocks: &[Block]) -> Option<String> {
    let mut outside = String::with_capacity(text.len());
    let mut last = 0;
    for b in blocks {
        outside.push_str(&text[last..b.start]);
        last = b.end;
    }
    outside.push_str(&text[last.min(text.len())..]);
    let start = outside.find("<answer>")? + "<answer>".len();
    let rest = &outside[start..];
    let body = rest.find("</answer>").map_or(rest, |end| &rest[..end]);
    Some(body.trim().to_string())
}

/// Reads one assistant message.
///
/// ```
/// use fathom_env::parse::parse_turn;
/// use fathom_rewards::record::Action;
/// let turn = parse_turn("Let me look.\n```repl\nprint(len(context))\n```");
/// assert_eq!(turn.action, Action::Code { code: "print(len(context))\n".into() });
/// assert_eq!(parse_turn("<answer> 42 </answer>").action, Action::Answer { text: "42".into() });
/// ```
pub fn parse_turn(text: &str) -> ParsedTurn {
    let blocks = code_blocks(text);
    let answer = answer(text, &blocks);
    let mut notes = Vec::new();
    if let Some(first) = blocks.first() {
        if first.code.trim().is_empty() {
            return ParsedTurn {
                action: Action::Invalid {
                    reason: "The code block is empty.".into(),
                },
                notes,
            };
        }
        if blocks.len() > 1 {
            notes.push(format!(
                "Only the first of your {} code blocks was run; put a turn's code in one block.",
                blocks.len()
            ));
        }
        if answer.is_some() {
            notes.push(
                "Your <answer> was ignored because the turn also ran code; answer in a turn of its own once you have read the output."
                    .into(),
            );
        }
        return ParsedTurn {
            action: Action::Code {
                code: first.code.clone(),
            },
            notes,
        };
    }
    match answer {
        Some(text) => ParsedTurn { action: Action::Answer { text }, notes },
        None => ParsedTurn {
            action: Action::Invalid {
                reason: "No action found: write Python in a ```repl block, or give the final answer as <answer>...</answer>."
                    .into(),
            },
            notes,
        },
    }
}

/// The assistant message for explicit code (what a turn running `code` looks like).
pub fn code_message(code: &str) -> String {
    let nl = if code.ends_with('\n') { "" } else { "\n" };
    format!("```repl\n{code}{nl}```")
}

/// The assistant message for an explicit answer.
pub fn answer_message(answer: &str) -> String {
    format!("<answer>{answer}</answer>")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(text: &str) -> Action {
        Action::Code { code: text.into() }
    }

    #[test]
    fn python_and_unlabelled_fences_are_code() {
        assert_eq!(parse_turn("```python\nx = 1\n```").action, code("x = 1\n"));
        assert_eq!(parse_turn("```\nx = 1\n```").action, code("x = 1\n"));
        assert_eq!(
            parse_turn("  ```py\nx = 1\n  ```\n").action,
            code("x = 1\n")
        );
    }

    #[test]
    fn other_labels_are_not_code() {
        let turn = parse_turn("```text\nhello\n```\n<answer>hi</answer>");
        assert_eq!(turn.action, Action::Answer { text: "hi".into() });
    }

    #[test]
    fn unclosed_fence_runs_to_the_end() {
        assert_eq!(parse_turn("```repl\nprint(1)\n").action, code("print(1)\n"));
    }

    #[test]
    fn code_with_answer_runs_code_and_says_the_answer_was_ignored() {
        let turn = parse_turn("```repl\nprint(1)\n```\n<answer>1</answer>");
        assert_eq!(turn.action, code("print(1)\n"));
        assert_eq!(turn.notes.len(), 1);
        assert!(turn.notes[0].contains("ignored"));
    }

    #[test]
    fn two_blocks_run_the_first_only() {
        let turn = parse_turn("```repl\na = 1\n```\ntext\n```repl\nb = 2\n```");
        assert_eq!(turn.action, code("a = 1\n"));
        assert!(turn.notes[0].contains("first of your 2"));
    }

    #[test]
    fn answer_tags_inside_code_do_not_count() {
        let turn = parse_turn("```repl\nprint('<answer>x</answer>')\n```");
        assert_eq!(turn.action, code("print('<answer>x</answer>')\n"));
        assert!(turn.notes.is_empty());
    }

    #[test]
    fn unclosed_answer_runs_to_the_end() {
        assert_eq!(
            parse_turn("<answer>Oslo").action,
            Action::Answer {
                text: "Oslo".into()
            }
        );
    }

    #[test]
    fn nothing_actionable_is_invalid() {
        assert!(matches!(
            parse_turn("I think so.").action,
            Action::Invalid { .. }
        ));
        assert!(matches!(
            parse_turn("```repl\n\n```").action,
            Action::Invalid { .. }
        ));
    }

    #[test]
    fn explicit_messages_parse_back() {
        assert_eq!(parse_turn(&code_message("x = 1")).action, code("x = 1\n"));
        assert_eq!(
            parse_turn(&answer_message("7")).action,
            Action::Answer { text: "7".into() }
        );
    }
}
