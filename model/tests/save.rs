//! Saving a checkpoint and loading it back gives the same model; a merged adapter exports as a
//! dense checkpoint with the adapted model's logits.

mod common;

use common::{Reference, fixture};
use fathom_model::save::SaveDtype;
use fathom_model::{Cpu, LoadOptions, Qwen2Config, Qwen2ForCausalLM};

#[test]
fn f32_round_trip_is_exact() {
    let device = Default::default();
    let mut config = Qwen2Config::with_shape(64, 32, 48, 2, 4, 2);
    config.tie_word_embeddings = false;
    let model = Qwen2ForCausalLM::<Cpu>::random(config, 3, false, &device);
    let dir = tempfile::tempdir().unwrap();
    model.save_pretrained(dir.path(), SaveDtype::F32).unwrap();
    let back = Qwen2ForCausalLM::<Cpu>::load(dir.path(), &device, LoadOptions::default()).unwrap();
    assert!(back.lm_head.is_some());
    let ids = vec![vec![1u32, 5, 9, 63, 2]];
    let mask = vec![vec![1u8; 5]];
    let a = model.forward(&model.step_input(&ids, &mask, &device).unwrap(), None);
    let b = back.forward(&back.step_input(&ids, &mask, &device).unwrap(), None);
    assert_eq!(a.into_data(), b.into_data());
}

#[test]
fn merged_adapter_exports_with_the_adapted_logits() {
    let device = Default::default();
    let model =
        Qwen2ForCausalLM::<Cpu>::load(&fixture("tiny-qwen2"), &device, LoadOptions::default())
            .unwrap()
            .load_adapter(&fixture("tiny-qwen2-lora"), &device)
            .unwrap();
    let dir = tempfile::tempdir().unwrap();
    assert!(
        model.save_pretrained(dir.path(), SaveDtype::F32).is_err(),
        "unmerged adapters are refused"
    );
    model
        .merge_adapters()
        .save_pretrained(dir.path(), SaveDtype::F32)
        .unwrap();
    let merged =
        Qwen2ForCausalLM::<Cpu>::load(dir.path(), &device, LoadOptions::default()).unwrap();
    let r = Reference::read(&fixture("tiny-qwen2-lora"));
    let input = merged
        .step_input(&r.input_ids, &r.attention_mask, &device)
        .unwrap();
    let logits = merged
        .forward(&input, None)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    let diff = common::max_masked_diff(&logits, &r);
    assert!(
        diff < 1e-4,
        "merged export differs from peft's logits by {diff}"
    );
}

#[test]
fn a_llama_checkpoint_saves_as_llama_and_round_trips() {
    // A Llama (no q/k/v biases, `head_dim`, transformers 5's `rope_parameters`) must come back as
    // a Llama: saved as Qwen2 it would be loaded expecting biases it does not have.
    let device = Default::default();
    let model =
        Qwen2ForCausalLM::<Cpu>::load(&fixture("tiny-llama"), &device, LoadOptions::default())
            .unwrap();
    let dir = tempfile::tempdir().unwrap();
    model.save_pretrained(dir.path(), SaveDtype::F32).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["model_type"], "llama");
    assert_eq!(config["architectures"][0], "LlamaForCausalLM");
    let back = Qwen2ForCausalLM::<Cpu>::load(dir.path(), &device, LoadOptions::default()).unwrap();
    assert!(back.model.layers[0].self_attn.q_proj.bias.is_none());
    let r = Reference::read(&fixture("tiny-llama"));
    let a = model.forward(
        &model
            .step_input(&r.input_ids, &r.attention_mask, &device)
            .unwrap(),
        None,
    );
    let b = back.forward(
        &back
            .step_input(&r.input_ids, &r.attention_mask, &device)
            .unwrap(),
        None,
    );
    assert_eq!(a.into_data(), b.into_data());
}
