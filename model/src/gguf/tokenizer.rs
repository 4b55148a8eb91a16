//! Rebuilding a Hugging Face tokenizer from GGUF metadata: `tokenizer.json` for the `tokenizers`
//! library and `tokenizer_config.json` with the special tokens and the chat template.
//!
//! Only byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`) are handled: the tokens
//! (already spelled in GPT-2's byte alphabet), the merges in rank order, and the tokens llama.cpp
//! marks as control (special added tokens) or user-defined (plain added tokens). How text is split
//! before BPE depends on `tokenizer.ggml.pre`, llama.cpp's name for the pre-tokenizer the
//! vocabulary was trained with; each supported name maps to the `tokenizers` pre-tokenizer that
//! reproduces llama.cpp's regexes for it ([`PreTokenizer`]).

use serde_json::{Value as Json, json};

use super::GgufError;
use super::reader::GgufFile;

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// The pre-tokenizers this converter rebuilds, by llama.cpp's `tokenizer.ggml.pre` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// `gpt2` (and `default`, `mpt`, `olmo`, …): GPT-2's regex.
    Gpt2,
    /// `smollm` (and `starcoder`, `refact`, `codeshell`): every digit on its own, then GPT-2's
    /// regex — llama.cpp's `\p{N}` split, and `Digits(individual_digits)` in the tokenizers of
    /// SmolLM and StarCoder.
    DigitsThenGpt2,
    /// `llama-bpe` / `llama3`: Llama 3's regex (numbers in groups of up to three).
    Llama3,
    /// `qwen2`: Qwen2's regex (single digits).
    Qwen2,
}

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

impl PreTokenizer {
    /// The pre-tokenizer for llama.cpp's name, if supported.
    pub fn from_llama_cpp(name: &str) -> Option<Self> {
        Some(match name {
            "default" | "gpt2" | "gpt-2" | "mpt" | "olmo" | "jais" => PreTokenizer::Gpt2,
            "smollm" | "starcoder" | "refact" | "codeshell" => PreTokenizer::DigitsThenGpt2,
            "llama-bpe" | "llama3" | "llama-v3" | "smaug-bpe" | "dbrx" => PreTokenizer::Llama3,
            "qwen2" | "deepseek-r1-qwen" => PreTokenizer::Qwen2,
            _ => return None,
        })
    }

    const SUPPORTED: &'static str = "default, gpt2, mpt, olmo, jais, smollm, starcoder, refact, \
                                     codeshell, llama-bpe, llama3, llama-v3, smaug-bpe, dbrx, \
                                     qwen2, deepseek-r1-qwen";

    fn to_json(self) -> Json {
        let byte_level = |use_regex: bool| {
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                   "use_regex": use_regex})
        };
        let split = |regex: &str| {
            json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated",
                   "invert": false})
        };
        match self {
            PreTokenizer::Gpt2 => byte_level(true),
            PreTokenizer::DigitsThenGpt2 => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
            PreTokenizer::Llama3 => json!({"type": "Sequence", "pretokenizers": [
                split(LLAMA3_SPLIT), byte_level(false)]}),
            PreTokenizer::Qwen2 => json!({"type": "Sequence", "pretokenizers": [
                split(QWEN2_SPLIT), byte_level(false)]}),
        }
    }
}

/// GPT-2's byte-to-character table: printable bytes stand for themselves, the others are
/// shifted past U+00FF.
fn byte_alphabet() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut shift = 0;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).expect("latin-1")
            } else {
                shift += 1;
                char::from_u32(255 + shift).expect("shifted")
            }
        })
        .collect()
}

/// The rebuilt tokenizer files.
#[derive(Debug)]
pub struct TokenizerFiles {
    /// `tokenizer.json`.
    pub tokenizer: Json,
    /// `tokenizer_config.json`.
    pub config: Json,
    /// The special tokens' ids: beginning and end of sequence, padding.
    pub bos_id: Option<u32>,
    /// End of sequence.
    pub eos_id: Option<u32>,
    /// Padding.
    pub pad_id: Option<u32>,
}

/// Rebuilds the tokenizer of a byte-level BPE GGUF.
pub fn rebuild(file: &GgufFile) -> Result<TokenizerFiles, GgufError> {
    let unsupported = |message: String| GgufError::Unsupported {
        path: file.path().to_path_buf(),
        message,
    };
    let model = file.str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(unsupported(format!(
            "tokenizer.ggml.model is `{model}`; only byte-level BPE (`gpt2`) vocabularies are \
             rebuilt (a sentencepiece `llama` vocabulary needs its original tokenizer.json)"
        )));
    }
    let pre_name = file
        .get("tokenizer.ggml.pre")
        .map(|_| file.str("tokenizer.ggml.pre"))
        .transpose()?
        .unwrap_or("default");
    let pre = PreTokenizer::from_llama_cpp(pre_name).ok_or_else(|| {
        unsupported(format!(
            "tokenizer.ggml.pre is `{pre_name}`, a pre-tokenizer this converter does not \
             rebuild; supported: {}",
            PreTokenizer::SUPPORTED
        ))
    })?;
    let tokens = file.strings("tokenizer.ggml.tokens")?;
    let merges = file.strings("tokenizer.ggml.merges")?;
    let types = file.opt_ints("tokenizer.ggml.token_type")?;
    if let Some(t) = &types
        && t.len() != tokens.len()
    {
        return Err(GgufError::Metadata {
            path: file.path().to_path_buf(),
            key: "tokenizer.ggml.token_type".into(),
            message: format!("{} types for {} tokens", t.len(), tokens.len()),
        });
    }
    let alphabet = byte_alphabet();
    let in_alphabet = |t: &str| t.chars().all(|c| alphabet.contains(&c));
    // A token outside the byte alphabet (a real space, say) is respelled byte by byte, as
    // `transformers` does, so that BPE can reach it.
    let spelled: Vec<String> = tokens
        .iter()
        .map(|t| {
            if in_alphabet(t) {
                t.to_string()
            } else {
                t.bytes().map(|b| alphabet[b as usize]).collect()
            }
        })
        .collect();
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    for (id, t) in spelled.iter().enumerate() {
        if vocab.insert(t.clone(), json!(id)).is_some() {
            return Err(GgufError::Metadata {
                path: file.path().to_path_buf(),
                key: "tokenizer.ggml.tokens".into(),
                message: format!("token {t:?} appears twice (again at id {id})"),
            });
        }
    }
    let mut merge_pairs = Vec::with_capacity(merges.len());
    for (i, m) in merges.iter().enumerate() {
        let (a, b) = m.split_once(' ').ok_or_else(|| GgufError::Metadata {
            path: file.path().to_path_buf(),
            key: "tokenizer.ggml.merges".into(),
            message: format!("merge {i} ({m:?}) is not two tokens separated by a space"),
        })?;
        merge_pairs.push(json!([a, b]));
    }
    let mut added = Vec::new();
    for (id, (token, kind)) in tokens
        .iter()
        .zip(types.iter().flatten().copied())
        .enumerate()
    {
        // A control token outside the byte alphabet is a mislabel in llama.cpp's export;
        // `transformers` skips it too.
        let special = kind == CONTROL && in_alphabet(token);
        if special || kind == USER_DEFINED {
            added.push(json!({"id": id, "content": token, "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": special}));
        }
    }
    let id_of = |key: &str| -> Result<Option<u32>, GgufError> {
        match file.opt_u64(key)? {
            None => Ok(None),
            Some(id) if (id as usize) < tokens.len() => Ok(Some(id as u32)),
            Some(id) => Err(GgufError::Metadata {
                path: file.path().to_path_buf(),
                key: key.into(),
                message: format!("id {id} is outside the vocabulary ({})", tokens.len()),
            }),
        }
    };
    let bos_id = id_of("tokenizer.ggml.bos_token_id")?;
    let eos_id = id_of("tokenizer.ggml.eos_token_id")?;
    let pad_id = id_of("tokenizer.ggml.padding_token_id")?;
    let unk_id = id_of("tokenizer.ggml.unknown_token_id")?;
    let add_bos = file
        .opt_bool("tokenizer.ggml.add_bos_token")?
        .unwrap_or(false);
    let add_eos = file
        .opt_bool("tokenizer.ggml.add_eos_token")?
        .unwrap_or(false);
    let text = |id: Option<u32>| id.map(|i| tokens[i as usize].to_string());
    let piece = |id: Option<u32>, on: bool| -> Vec<Json> {
        match (id, on) {
            (Some(i), true) => {
                vec![json!({"SpecialToken": {"id": tokens[i as usize], "type_id": 0}})]
            }
            _ => vec![],
        }
    };
    let seq = |name: &str, type_id: u32| json!({"Sequence": {"id": name, "type_id": type_id}});
    let mut special_tokens = serde_json::Map::new();
    for (id, on) in [(bos_id, add_bos), (eos_id, add_eos)] {
        if let (Some(i), true) = (id, on) {
            let t = tokens[i as usize];
            special_tokens.insert(t.into(), json!({"id": t, "ids": [i], "tokens": [t]}));
        }
    }
    let single: Vec<Json> = [
        piece(bos_id, add_bos),
        vec![seq("A", 0)],
        piece(eos_id, add_eos),
    ]
    .concat();
    let pair: Vec<Json> = [
        single.clone(),
        piece(bos_id, add_bos),
        vec![seq("B", 1)],
        piece(eos_id, add_eos),
    ]
    .concat();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre.to_json(),
        "post_processor": {"type": "TemplateProcessing", "single": single, "pair": pair,
                           "special_tokens": special_tokens},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merge_pairs},
    });
    let mut config = json!({
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": text(bos_id),
        "eos_token": text(eos_id),
        "pad_token": text(pad_id),
        "unk_token": text(unk_id),
        "clean_up_tokenization_spaces": false,
        "tokenizer_class": "PreTrainedTokenizerFast",
    });
    let arch = file.str("general.architecture")?;
    if let Some(n) = file.opt_u64(&format!("{arch}.context_length"))? {
        config["model_max_length"] = json!(n);
    }
    if file.get("tokenizer.chat_template").is_some() {
        config["chat_template"] = json!(file.str("tokenizer.chat_template")?);
    }
    Ok(TokenizerFiles {
        tokenizer,
        config,
        bos_id,
        eos_id,
        pad_id,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_is_gpt2s() {
        let a = byte_alphabet();
        assert_eq!(a[b' ' as usize], 'Ġ');
        assert_eq!(a[b'\n' as usize], 'Ċ');
        assert_eq!(a[b'A' as usize], 'A');
        assert_eq!(a[0xAD], 'Ń');
        let mut sorted = a.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 256);
    }

    #[test]
    fn pre_tokenizer_names() {
        assert_eq!(
            PreTokenizer::from_llama_cpp("smollm"),
            Some(PreTokenizer::DigitsThenGpt2)
        );
        assert_eq!(PreTokenizer::from_llama_cpp("tekken"), None);
    }
}
