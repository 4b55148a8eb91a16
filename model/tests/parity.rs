//! Logits and greedy continuations match `transformers` on the fixtures (`fixtures/`).

mod common;

use common::{Reference, fixture, max_masked_diff};
use fathom_model::{Cpu, LoadOptions, Qwen2ForCausalLM};

/// Every reference is the checkpoint loaded fresh in f32 by `transformers`, so RoPE frequencies
/// are f32 (as ours are).

fn check_logits(dir: &str) {
    let device = Default::default();
    let model = Qwen2ForCausalLM::<Cpu>::load(&fixture(dir), &device, LoadOptions::default())
        .expect("loads");
    let r = Reference::read(&fixture(dir));
    let input = model
        .step_input(&r.input_ids, &r.attention_mask, &device)
        .unwrap();
    let logits = model
        .forward(&input, None)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    let diff = max_masked_diff(&logits, &r);
    assert!(diff < 1e-4, "{dir}: max |logit diff| {diff}");
}

#[test]
fn dense_bf16_logits_match_transformers() {
    check_logits("tiny-qwen2");
}

#[test]
fn llama_logits_match_transformers() {
    // No q/k/v biases, `head_dim` given, `rope_parameters` instead of `rope_theta`.
    check_logits("tiny-llama");
}

#[test]
fn nf4_double_quant_logits_match_bitsandbytes() {
    check_logits("tiny-qwen2-nf4");
}

#[test]
fn nf4_plain_logits_match_bitsandbytes() {
    check_logits("tiny-qwen2-nf4-plain");
}
