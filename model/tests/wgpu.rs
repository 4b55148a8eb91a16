//! The CubeCL NF4 kernel on wgpu (run through Mesa's lavapipe Vulkan driver on machines without
//! a GPU) dequantizes exactly as the CPU path does, and the NF4 model matches bitsandbytes'
//! logits on it. Built with `--features wgpu`.

#![cfg(feature = "wgpu")]

mod common;

use common::{Reference, fixture, max_masked_diff};
use fathom_model::linear::Nf4Weight;
use fathom_model::{Cpu, LoadOptions, Qwen2ForCausalLM, Wgpu};

fn weight(rows: usize, cols: usize) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| {
            (((i * 2654435761) % 10007) as f32 / 10007.0 - 0.5) * (1.0 + (i % 97) as f32 / 50.0)
        })
        .collect()
}

#[test]
fn wgpu_kernel_dequantizes_bit_identically_to_the_cpu_path() {
    // Sizes that exercise partial words, partial blocks and rows that straddle blocks.
    for (rows, cols) in [(64, 64), (96, 160), (7, 9), (3, 1)] {
        let w = weight(rows, cols);
        let cpu = Nf4Weight::<Cpu>::quantize(&w, rows, cols, &Default::default()).dequantize();
        let gpu = Nf4Weight::<Wgpu>::quantize(&w, rows, cols, &Default::default()).dequantize();
        let cpu: Vec<f32> = cpu.into_data().to_vec().unwrap();
        let gpu: Vec<f32> = gpu.into_data().to_vec().unwrap();
        assert_eq!(cpu.len(), gpu.len());
        let first = cpu
            .iter()
            .zip(&gpu)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        assert!(
            first.is_none(),
            "{rows}x{cols}: first difference at {first:?}"
        );
    }
}

#[test]
fn nf4_model_on_wgpu_matches_bitsandbytes() {
    let device = Default::default();
    let model =
        Qwen2ForCausalLM::<Wgpu>::load(&fixture("tiny-qwen2-nf4"), &device, LoadOptions::default())
            .unwrap();
    let r = Reference::read(&fixture("tiny-qwen2-nf4"));
    let input = model
        .step_input(&r.input_ids, &r.attention_mask, &device)
        .unwrap();
    let logits = model
        .forward(&input, None)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    let diff = max_masked_diff(&logits, &r);
    assert!(diff < 1e-4, "max |logit diff| {diff}");
}
