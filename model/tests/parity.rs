//! Logits and greedy continuations match `transformers` on the fixtures (`fixtures/`).

mod common;

use common::{Reference, fixture, max_masked_diff};
use fathom_model::{Cpu, LoadOptions, Qwen2ForCausalLM, RopeFrequencies};

/// `tiny-qwen2`'s reference was computed after `model.to(torch.bfloat16)`, which rounds the RoPE
/// frequency buffer; the NF4 and LoRA references come from models loaded fresh in f32.
fn rope_for(dir: &str) -> RopeFrequencies {
    if dir == "tiny-qwen2" {
        RopeFrequencies::Bf16
    } else {
        RopeFrequencies::F32
    }
}

fn check_logits(dir: &str) {
    let device = Default::default();
    let mut model = Qwen2ForCausalLM::<Cpu>::load(&fixture(dir), &device, LoadOptions::default())
        .expect("loads");
    model.rope_frequencies = rope_for(dir);
    let r = Reference::read(&fixture(dir));
    let input = model
        .step_input(&r.input_ids, &r.attention_mask, 0, &device)
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

#[test]
fn dense_with_f32_frequencies_differs_from_the_cast_reference() {
    // Guards the explanation above: without the bf16 rounding the dense reference is off.
    let device = Default::default();
    let model =
        Qwen2ForCausalLM::<Cpu>::load(&fixture("tiny-qwen2"), &device, LoadOptions::default())
            .unwrap();
    let r = Reference::read(&fixture("tiny-qwen2"));
    let input = model
        .step_input(&r.input_ids, &r.attention_mask, 0, &device)
        .unwrap();
    let logits = model
        .forward(&input, None)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    assert!(max_masked_diff(&logits, &r) > 1e-3);
}
