//! `quantize_checkpoint` writes the same keys and bytes bitsandbytes wrote for the fixtures
//! (`tiny-qwen2-nf4`, `tiny-qwen2-nf4-plain`), and the result loads back.

mod common;

use common::fixture;
use fathom_model::checkpoint::Checkpoint;
use fathom_model::nf4::export::{QuantizeOptions, StorageDtype, quantize_checkpoint};
use fathom_model::{Cpu, LoadOptions, Qwen2ForCausalLM};

fn compare(double_quant: bool, reference: &str) {
    let out = tempfile::tempdir().unwrap();
    let report = quantize_checkpoint(
        &fixture("tiny-qwen2"),
        out.path(),
        QuantizeOptions {
            double_quant,
            dtype: Some(StorageDtype::F32),
            torch_threads: 1,
        },
    )
    .unwrap();
    assert_eq!(report.quantized, 14);
    let ours = Checkpoint::open_dir(out.path()).unwrap();
    let theirs = Checkpoint::open_dir(&fixture(reference)).unwrap();
    assert_eq!(ours.names(), theirs.names(), "same keys");
    for name in theirs.names() {
        let (a, b) = (ours.raw(&name).unwrap(), theirs.raw(&name).unwrap());
        assert_eq!(
            (a.dtype, &a.shape),
            (b.dtype, &b.shape),
            "{name}: dtype/shape"
        );
        assert!(a.data == b.data, "{name}: bytes differ");
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap())
            .unwrap();
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture(reference).join("config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        config["quantization_config"],
        expected["quantization_config"]
    );
    let model =
        Qwen2ForCausalLM::<Cpu>::load(out.path(), &Default::default(), LoadOptions::default())
            .unwrap();
    assert!(model.projections().iter().all(|(_, p)| p.is_nf4()));
}

#[test]
fn double_quant_checkpoint_is_byte_identical_to_bitsandbytes() {
    compare(true, "tiny-qwen2-nf4");
}

#[test]
fn plain_checkpoint_is_byte_identical_to_bitsandbytes() {
    compare(false, "tiny-qwen2-nf4-plain");
}

#[test]
fn quantize_on_load_equals_loading_the_quantized_checkpoint() {
    let device = Default::default();
    let on_load = Qwen2ForCausalLM::<Cpu>::load(
        &fixture("tiny-qwen2"),
        &device,
        LoadOptions { quantize_nf4: true },
    )
    .unwrap();
    let stored = Qwen2ForCausalLM::<Cpu>::load(
        &fixture("tiny-qwen2-nf4-plain"),
        &device,
        LoadOptions::default(),
    )
    .unwrap();
    for ((pa, a), (_, b)) in on_load.projections().iter().zip(stored.projections()) {
        let (fathom_model::linear::BaseWeight::Nf4(a), fathom_model::linear::BaseWeight::Nf4(b)) =
            (&a.weight, &b.weight)
        else {
            panic!("{pa} is not NF4");
        };
        assert_eq!(a.packed_bytes(), b.packed_bytes(), "{pa}");
        assert_eq!(a.absmax.to_data(), b.absmax.to_data(), "{pa}");
    }
}

#[test]
fn already_quantized_input_is_refused() {
    let out = tempfile::tempdir().unwrap();
    let err = quantize_checkpoint(
        &fixture("tiny-qwen2-nf4"),
        out.path(),
        QuantizeOptions {
            double_quant: true,
            dtype: None,
            torch_threads: 1,
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("already quantized"), "{err}");
}
