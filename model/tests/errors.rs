//! Bad model directories give errors that name the problem, never a panic; the real
//! Qwen2.5-Coder-1.5B shape builds.

mod common;

use common::fixture;
use fathom_model::checkpoint::{OutTensor, write_safetensors};
use fathom_model::{Cpu, LoadOptions, Qwen2Config, Qwen2ForCausalLM};

fn load_err(dir: &std::path::Path) -> String {
    Qwen2ForCausalLM::<Cpu>::load(dir, &Default::default(), LoadOptions::default())
        .unwrap_err()
        .to_string()
}

#[test]
fn missing_directory_and_files() {
    assert!(load_err(std::path::Path::new("/nonexistent/model")).contains("/nonexistent/model"));
    let dir = tempfile::tempdir().unwrap();
    assert!(load_err(dir.path()).contains("config.json"));
    std::fs::copy(
        fixture("tiny-qwen2/config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    assert!(load_err(dir.path()).contains("model.safetensors"));
}

#[test]
fn malformed_config_names_the_field() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"vocab_size": 10, "hidden_size": "big"}"#,
    )
    .unwrap();
    let err = load_err(dir.path());
    assert!(err.contains("hidden_size"), "{err}");
}

#[test]
fn missing_and_misshapen_tensors_are_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture("tiny-qwen2/config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    write_safetensors(
        &dir.path().join("model.safetensors"),
        &[OutTensor::f32(
            "model.embed_tokens.weight",
            vec![1024, 64],
            &vec![0.0; 1024 * 64],
        )],
        None,
    )
    .unwrap();
    let err = load_err(dir.path());
    assert!(
        err.contains("model.layers.0.self_attn.q_proj.weight"),
        "{err}"
    );
    write_safetensors(
        &dir.path().join("model.safetensors"),
        &[OutTensor::f32(
            "model.embed_tokens.weight",
            vec![10, 64],
            &vec![0.0; 640],
        )],
        None,
    )
    .unwrap();
    // the first tensor read is a layer projection; make sure a wrong embedding shape is named too
    let ck = fathom_model::checkpoint::Checkpoint::open_dir(dir.path()).unwrap();
    let err = ck
        .f32("model.embed_tokens.weight", &[1024, 64])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.embed_tokens.weight") && err.contains("[10, 64]"),
        "{err}"
    );
}

#[test]
fn truncated_weights_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture("tiny-qwen2/config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let bytes = std::fs::read(fixture("tiny-qwen2/model.safetensors")).unwrap();
    std::fs::write(
        dir.path().join("model.safetensors"),
        &bytes[..bytes.len() / 2],
    )
    .unwrap();
    let err = load_err(dir.path());
    assert!(err.contains("model.safetensors"), "{err}");
}

#[test]
fn qwen2_5_coder_1_5b_shape_builds() {
    let config = Qwen2Config::qwen2_5_1_5b();
    let model = Qwen2ForCausalLM::<Cpu>::zeros(config.clone(), &Default::default());
    assert_eq!(model.model.layers.len(), 28);
    let attn = &model.model.layers[0].self_attn;
    assert_eq!(
        (attn.num_heads, attn.num_kv_heads, attn.head_dim),
        (12, 2, 128)
    );
    assert_eq!(attn.k_proj.shape(), [256, 1536]);
    assert_eq!(model.model.layers[27].mlp.down_proj.shape(), [1536, 8960]);
    assert!(model.lm_head.is_none(), "tied embeddings");
    // 1,543,714,304 weights: Qwen2.5-1.5B's published parameter count.
    assert_eq!(model.num_weights(), 1_543_714_304);
}
