//! Shared helpers for the parity tests: fixture paths and the reference tensors.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use fathom_model::checkpoint::Checkpoint;
use fathom_model::{ChatMessage, Tokenizer};
use serde::Deserialize;

/// Path of a fixture under the repository's `fixtures/`.
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures")).join(name)
}

/// `reference.safetensors` of a fixture model.
pub struct Reference {
    pub input_ids: Vec<Vec<u32>>,
    pub attention_mask: Vec<Vec<u8>>,
    pub logits: Vec<f32>,
    pub vocab: usize,
    pub greedy: Vec<Vec<u32>>,
}

fn i64s(ck: &Checkpoint, name: &str) -> (Vec<usize>, Vec<i64>) {
    let raw = ck.raw(name).unwrap();
    let values = raw
        .data
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    (raw.shape, values)
}

fn rows<T: Copy>(shape: &[usize], values: &[i64], f: impl Fn(i64) -> T) -> Vec<Vec<T>> {
    values
        .chunks(shape[1])
        .map(|r| r.iter().map(|&v| f(v)).collect())
        .collect()
}

impl Reference {
    pub fn read(dir: &Path) -> Self {
        Self::read_file(&dir.join("reference.safetensors"))
    }

    /// Reads a reference file of the same layout at any path.
    pub fn read_file(path: &Path) -> Self {
        let dir = path.parent().unwrap();
        let ck = Checkpoint::open_files(dir, &[path.to_path_buf()]).unwrap();
        let (s, ids) = i64s(&ck, "input_ids");
        let (_, mask) = i64s(&ck, "attention_mask");
        let (gs, greedy) = i64s(&ck, "greedy_ids");
        let shape = ck.shape("logits").unwrap();
        Self {
            input_ids: rows(&s, &ids, |v| v as u32),
            attention_mask: rows(&s, &mask, |v| v as u8),
            logits: ck.f32("logits", &shape).unwrap(),
            vocab: shape[2],
            greedy: rows(&gs, &greedy, |v| v as u32),
        }
    }
}

/// Largest |a - b| over positions where the attention mask is 1.
pub fn max_masked_diff(logits: &[f32], r: &Reference) -> f32 {
    let seq = r.input_ids[0].len();
    let mut max = 0f32;
    for (b, mask) in r.attention_mask.iter().enumerate() {
        for (t, &m) in mask.iter().enumerate() {
            if m == 0 {
                continue;
            }
            let off = (b * seq + t) * r.vocab;
            for v in 0..r.vocab {
                max = max.max((logits[off + v] - r.logits[off + v]).abs());
            }
        }
    }
    max
}

#[derive(Deserialize)]
struct TextCase {
    text: String,
    ids: Vec<u32>,
    ids_llama_cpp: Vec<u32>,
}

#[derive(Deserialize)]
struct ChatCase {
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    text: String,
    ids: Vec<u32>,
    ids_llama_cpp: Vec<u32>,
}

#[derive(Deserialize)]
struct TokenizerCases {
    texts: Vec<TextCase>,
    chats: Vec<ChatCase>,
}

/// Checks a tokenizer rebuilt from a GGUF with the `smollm` pre-tokenizer against a cases file
/// of `generate_gguf.py`: its ids are llama.cpp's (`ids_llama_cpp`, every numeral split off
/// before BPE, as SmolLM2 was trained), which are `transformers`' ids (`ids`) wherever the text
/// has no non-ASCII numeral — `transformers`' GGUF loader lacks the `smollm` split, and keeps
/// " ½" as one pre-token. Chat templates render to `transformers`' text exactly.
pub fn check_tokenizer(dir: &Path, cases_file: &Path) {
    let tok = Tokenizer::from_dir(dir).expect("rebuilt tokenizer loads");
    let cases: TokenizerCases =
        serde_json::from_str(&std::fs::read_to_string(cases_file).unwrap()).unwrap();
    assert!(!cases.texts.is_empty() && !cases.chats.is_empty());
    let non_ascii_numeral = |s: &str| s.chars().any(|c| c.is_numeric() && !c.is_ascii_digit());
    for c in &cases.texts {
        let ours = tok.encode(&c.text, true).unwrap();
        assert_eq!(ours, c.ids_llama_cpp, "ids of {:?}", c.text);
        if !non_ascii_numeral(&c.text) {
            assert_eq!(ours, c.ids, "transformers' ids of {:?}", c.text);
        }
        assert_eq!(
            tok.decode(&ours, false).unwrap(),
            c.text,
            "decode of {:?}",
            c.text
        );
    }
    for (i, c) in cases.chats.iter().enumerate() {
        let text = tok
            .apply_chat_template(&c.messages, c.add_generation_prompt)
            .unwrap();
        assert_eq!(text, c.text, "chat {i}: rendered text");
        let ours = tok.encode(&text, false).unwrap();
        assert_eq!(ours, c.ids_llama_cpp, "chat {i}: ids");
        if !non_ascii_numeral(&text) {
            assert_eq!(ours, c.ids, "chat {i}: transformers' ids");
        }
    }
    assert_eq!(tok.eos_id(), tok.token_id("<|im_end|>"));
}
