//! The Qwen2.5 tokenizer and chat template reproduce `transformers`' `apply_chat_template`
//! text and token ids (`fixtures/chat-cases.json`).

mod common;

use common::fixture;
use fathom_model::{ChatMessage, Tokenizer};
use serde::Deserialize;

#[derive(Deserialize)]
struct Case {
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    text: String,
    ids: Vec<u32>,
}

#[test]
fn chat_cases_match_transformers() {
    let tok = Tokenizer::from_dir(&fixture("qwen2.5-tokenizer")).expect("tokenizer loads");
    let cases: Vec<Case> =
        serde_json::from_str(&std::fs::read_to_string(fixture("chat-cases.json")).unwrap())
            .unwrap();
    assert_eq!(cases.len(), 6);
    for (i, case) in cases.iter().enumerate() {
        let text = tok
            .apply_chat_template(&case.messages, case.add_generation_prompt)
            .unwrap();
        assert_eq!(text, case.text, "case {i}: rendered text");
        assert_eq!(tok.encode(&text, false).unwrap(), case.ids, "case {i}: ids");
        assert_eq!(
            tok.encode(&text, true).unwrap(),
            case.ids,
            "case {i}: ids with special tokens"
        );
        assert_eq!(
            tok.decode(&case.ids, false).unwrap(),
            case.text,
            "case {i}: decode"
        );
    }
    assert_eq!(tok.eos_id(), tok.token_id("<|im_end|>"));
    assert_eq!(tok.pad_id(), tok.token_id("<|endoftext|>"));
}

#[test]
fn missing_or_broken_tokenizer_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
    std::fs::write(dir.path().join("tokenizer.json"), "{\"version\": 1}").unwrap();
    assert!(Tokenizer::from_dir(dir.path()).is_err());
}

#[test]
fn broken_template_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture("qwen2.5-tokenizer/tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"chat_template": "{% for m in messages %}{{ m.content "}"#,
    )
    .unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("chat template"), "{err}");
}
