//! What the model reads: the system prompt (short and concrete, for small models, with one
//! worked example), the first user turn (question, document size, a preview), and each
//! observation (the cell's output as the next user turn).

use fathom_rewards::record::ExecOutput;

/// Settings the prompts mention.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptSettings {
    /// Assistant turns allowed per episode.
    pub max_turns: usize,
    /// Characters of output shown per cell (per stream).
    pub max_output_chars: usize,
    /// Characters of the document shown in the first user turn.
    pub preview_chars: usize,
}

/// The system prompt.
pub fn system_prompt(s: &PromptSettings) -> String {
    format!(
        r#"You answer a question about a long document that you cannot see directly. The document is loaded in a Python REPL as the string `context`.

Each turn, do exactly one of these:
1. Run Python: write one code block, like
```repl
print(len(context))
```
   You will see what it prints. Variables persist between turns.
2. Answer: write <answer>your answer</answer>. This ends the episode, so answer only once you are sure.

In the REPL:
- `context` is the document (a str). Search it with `re` or str methods and print only short slices; never print the whole document.
- `llm(prompt)` asks a helper model about a short text (a few pages at most) and returns its reply as a str. Use it to read a passage you found, not the whole document.
- Output past {out} characters is cut. You have {turns} turns.

Example.
Question: What is the access code for vault K-12?
```repl
import re
for m in re.finditer(r"K-12\b", context):
    print(context[max(0, m.start() - 100):m.end() + 100])
```
Output: ...the staff confirmed that vault K-12 holds access code 7731-QX. The courier...
<answer>7731-QX</answer>"#,
        out = s.max_output_chars,
        turns = s.max_turns,
    )
}

/// The first user turn: the question, the document's size and its beginning.
pub fn first_user_message(
    question: &str,
    document: &str,
    doc_tokens: usize,
    s: &PromptSettings,
) -> String {
    let chars = document.chars().count();
    let preview: String = document.chars().take(s.preview_chars).collect();
    let more = if chars > s.preview_chars { "..." } else { "" };
    format!(
        "Question: {question}\n\nThe document is in `context`: {chars} characters (about {doc_tokens} tokens). It begins:\n\"\"\"\n{preview}{more}\n\"\"\""
    )
}

/// The observation for a cell: its output (stdout, stderr, traceback), then any notes.
pub fn observation(output: &ExecOutput, notes: &[String], turns_left: usize) -> String {
    let mut text = String::from("Output:");
    let body: String = [
        output.stdout.as_str(),
        output.stderr.as_str(),
        output.error.as_deref().unwrap_or(""),
    ]
    .iter()
    .filter(|s| !s.is_empty())
    .map(|s| {
        if s.ends_with('\n') {
            s.to_string()
        } else {
            format!("{s}\n")
        }
    })
    .collect();
    if body.is_empty() {
        text.push_str(" (nothing was printed; use print() to see values)\n");
    } else {
        text.push('\n');
        text.push_str(&body);
    }
    push_notes(&mut text, notes, turns_left);
    text
}

/// The observation for a turn that could not be acted on.
pub fn invalid_observation(reason: &str, notes: &[String], turns_left: usize) -> String {
    let mut text = format!("{reason}\n");
    push_notes(&mut text, notes, turns_left);
    text
}

fn push_notes(text: &mut String, notes: &[String], turns_left: usize) {
    for note in notes {
        text.push_str(&format!("Note: {note}\n"));
    }
    if turns_left == 1 {
        text.push_str(
            "Note: this is your last turn; give your answer now as <answer>...</answer>.\n",
        );
    }
    let trimmed = text.trim_end().len();
    text.truncate(trimmed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observation_shows_traceback_after_output() {
        let out = ExecOutput {
            stdout: "3\n".into(),
            error: Some(
                "Traceback (most recent call last):\nZeroDivisionError: division by zero\n".into(),
            ),
            ..ExecOutput::default()
        };
        let text = observation(&out, &[], 5);
        assert_eq!(
            text,
            "Output:\n3\nTraceback (most recent call last):\nZeroDivisionError: division by zero"
        );
    }

    #[test]
    fn empty_output_says_so_and_last_turn_is_announced() {
        let text = observation(&ExecOutput::default(), &[], 1);
        assert!(text.contains("nothing was printed"));
        assert!(text.ends_with("give your answer now as <answer>...</answer>."));
    }

    #[test]
    fn preview_is_cut_with_an_ellipsis() {
        let s = PromptSettings {
            max_turns: 3,
            max_output_chars: 10,
            preview_chars: 4,
        };
        let text = first_user_message("Q?", "abcdefgh", 2, &s);
        assert!(text.contains("8 characters (about 2 tokens)"));
        assert!(text.contains("\"\"\"\nabcd...\n\"\"\""));
    }
}
