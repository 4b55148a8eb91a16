//! Models for the `infer` and `demo` tests, written to temporary directories with the Qwen2.5
//! tokenizer of `fixtures/`: a random small Qwen2, and a *scripted* one whose weights are set by
//! hand so that greedy decoding plays a fixed two-turn episode:
//!
//! 1. `` ```repl\n\nprint(llm(context[:60]))\n `` — code that calls `llm()` on the document's
//!    start (the `llm()` call, answered by the same model, writes this code again);
//! 2. `<answer>\n42</answer>` — once the REPL's output has come back.
//!
//! How: the decoder layer's MLP and attention write nothing but one *flag*, so the residual
//! stream is the current token's embedding plus that flag, and the `lm_head` reads it as a
//! bigram table: each token of the two scripts has its own one-hot embedding, and the `lm_head`
//! row of its successor points at it. Every turn starts after the same token (the `\n` of
//! `<|im_start|>assistant\n`), so which script runs is decided by the flag: the attention
//! head's key is non-zero only at the token `(ll`, which the first script writes and no prompt
//! holds; with a large constant query, attention then lands on it and copies a fixed value into
//! the flag dimension. Query and key sit in the slowest rotary pair, so positions barely move
//! the score. With the flag set, the start token prefers `<` (the answer script) over
//! `` ``` ``; without it, `` ``` ``. Margins are wide (logits 10 against 6), so the episode is
//! the same on every backend.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use fathom_model::config::ModelType;
use fathom_model::save::SaveDtype;
use fathom_model::{Cpu, Qwen2Config, Qwen2ForCausalLM, Tokenizer};
use safetensors::{Dtype, tensor::TensorView};

/// The code the scripted model writes first.
pub const SCRIPTED_CODE: &str = "print(llm(context[:60]))";
/// The answer it gives next.
pub const SCRIPTED_ANSWER: &str = "42";

/// The fixtures' Qwen2.5 tokenizer directory.
pub fn tokenizer_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/qwen2.5-tokenizer")
}

fn copy_tokenizer(dir: &Path) {
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tokenizer_dir().join(f), dir.join(f)).unwrap();
    }
}

/// Writes a random Qwen2 (hidden 64, 2 layers) with the Qwen2.5 tokenizer to `dir`.
pub fn random_model(dir: &Path, seed: u64) {
    let tok = Tokenizer::from_dir(&tokenizer_dir()).unwrap();
    let config = Qwen2Config::with_shape(tok.vocab_size(), 64, 128, 2, 4, 2);
    Qwen2ForCausalLM::<Cpu>::random(config, seed, false, &Default::default())
        .save_pretrained(dir, SaveDtype::F32)
        .unwrap();
    copy_tokenizer(dir);
}

const HIDDEN: usize = 32;
const MARKER_DIM: usize = 30;
const FLAG_DIM: usize = 31;
/// The slowest rotary pair of a 32-wide head is (15, 31); query and key use dimension 15.
const ROPE_DIM: usize = 15;

/// Writes the scripted model to `dir`.
pub fn scripted_model(dir: &Path) {
    let tok = Tokenizer::from_dir(&tokenizer_dir()).unwrap();
    let vocab = tok.vocab_size();
    let enc = |s: &str| tok.encode(s, false).unwrap();
    let start = enc("\n");
    assert_eq!(start.len(), 1);
    let start = start[0];
    let eot = tok.token_id("<|im_end|>").unwrap();
    let code: Vec<u32> = enc(&format!("```repl\n\n{SCRIPTED_CODE}\n"));
    // The closing tag spelled `</` `ans` `wer` `>`, so no token repeats within the scripts.
    let answer: Vec<u32> = [
        enc(&format!("<answer>\n{SCRIPTED_ANSWER}</")),
        enc("ans"),
        enc("wer"),
        enc(">"),
    ]
    .concat();
    let marker = code
        .iter()
        .copied()
        .find(|&id| tok.decode(&[id], false).unwrap() == "(ll")
        .expect("the code script holds the token `(ll`");
    let mut all = vec![start];
    all.extend(&code);
    all.extend(&answer);
    let distinct: std::collections::BTreeSet<u32> = all.iter().copied().collect();
    assert_eq!(distinct.len(), all.len(), "script tokens repeat: {all:?}");
    assert!(
        all.len() < MARKER_DIM,
        "too many script tokens for the hidden size"
    );
    let dim: BTreeMap<u32, usize> = all.iter().enumerate().map(|(i, &t)| (t, i)).collect();

    let mut embed = vec![0f32; vocab * HIDDEN];
    for (&t, &d) in &dim {
        embed[t as usize * HIDDEN + d] = 1.0;
    }
    embed[marker as usize * HIDDEN + MARKER_DIM] = 1.0;

    let mut head = vec![0f32; vocab * HIDDEN];
    let mut set = |to: u32, from_dim: usize, w: f32| head[to as usize * HIDDEN + from_dim] = w;
    for script in [&code, &answer] {
        let mut prev = None;
        for &t in script.iter() {
            if let Some(p) = prev {
                set(t, dim[&p], 10.0);
            }
            prev = Some(t);
        }
        set(eot, dim[&prev.unwrap()], 10.0);
    }
    set(code[0], dim[&start], 10.0); // no flag: the code script
    set(answer[0], dim[&start], 6.0); // with the flag: 6 + 6 > 10
    set(answer[0], FLAG_DIM, 6.0);

    // Attention: constant query on the slow rotary pair; key and value read the marker
    // dimension (which RMSNorm scales to 4 at the marker); the output writes 4 · 0.25 = 1 into
    // the flag dimension. Score at the marker: 42.4 · 4 / sqrt(32) = 30.
    let mut q_bias = vec![0f32; HIDDEN];
    q_bias[ROPE_DIM] = 42.4;
    let mut k = vec![0f32; HIDDEN * HIDDEN];
    k[ROPE_DIM * HIDDEN + MARKER_DIM] = 1.0;
    let mut v = vec![0f32; HIDDEN * HIDDEN];
    v[MARKER_DIM] = 0.25; // row 0
    let mut o = vec![0f32; HIDDEN * HIDDEN];
    o[FLAG_DIM * HIDDEN] = 1.0; // row FLAG_DIM, column 0
    let inter = 8;
    let ones = vec![1f32; HIDDEN];
    let zeros = |n: usize| vec![0f32; n];

    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = vec![
        (
            "model.embed_tokens.weight".into(),
            vec![vocab, HIDDEN],
            embed,
        ),
        ("lm_head.weight".into(), vec![vocab, HIDDEN], head),
        ("model.norm.weight".into(), vec![HIDDEN], ones.clone()),
    ];
    let l = "model.layers.0";
    tensors.extend([
        (
            format!("{l}.input_layernorm.weight"),
            vec![HIDDEN],
            ones.clone(),
        ),
        (
            format!("{l}.post_attention_layernorm.weight"),
            vec![HIDDEN],
            ones.clone(),
        ),
        (
            format!("{l}.self_attn.q_proj.weight"),
            vec![HIDDEN, HIDDEN],
            zeros(HIDDEN * HIDDEN),
        ),
        (format!("{l}.self_attn.q_proj.bias"), vec![HIDDEN], q_bias),
        (
            format!("{l}.self_attn.k_proj.weight"),
            vec![HIDDEN, HIDDEN],
            k,
        ),
        (
            format!("{l}.self_attn.k_proj.bias"),
            vec![HIDDEN],
            zeros(HIDDEN),
        ),
        (
            format!("{l}.self_attn.v_proj.weight"),
            vec![HIDDEN, HIDDEN],
            v,
        ),
        (
            format!("{l}.self_attn.v_proj.bias"),
            vec![HIDDEN],
            zeros(HIDDEN),
        ),
        (
            format!("{l}.self_attn.o_proj.weight"),
            vec![HIDDEN, HIDDEN],
            o,
        ),
        (
            format!("{l}.mlp.gate_proj.weight"),
            vec![inter, HIDDEN],
            zeros(inter * HIDDEN),
        ),
        (
            format!("{l}.mlp.up_proj.weight"),
            vec![inter, HIDDEN],
            zeros(inter * HIDDEN),
        ),
        (
            format!("{l}.mlp.down_proj.weight"),
            vec![HIDDEN, inter],
            zeros(inter * HIDDEN),
        ),
    ]);
    std::fs::create_dir_all(dir).unwrap();
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, s, v)| (n, s, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();

    let mut config = Qwen2Config::with_shape(vocab, HIDDEN, inter, 1, 1, 1);
    config.tie_word_embeddings = false;
    config.model_type = Some(ModelType::Qwen2);
    config.eos_token_id = Some(fathom_model::config::TokenIds::One(eot));
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config).unwrap(),
    )
    .unwrap();
    copy_tokenizer(dir);
}
