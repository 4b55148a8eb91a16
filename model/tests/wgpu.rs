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

/// Largest |a − b| over two equally long slices.
fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn argmax(v: &[f32]) -> usize {
    (0..v.len()).fold(0, |best, i| if v[i] > v[best] { i } else { best })
}

/// Absolute tolerance on the logits of the cached path, wgpu against the CPU (f32 both): the
/// two backends sum in different orders (tiled matmuls, reductions), so logits agree to a few
/// ulps of their magnitude, not bit for bit.
const CACHED_LOGIT_TOLERANCE: f32 = 1e-4;

/// The inference path (the rollout engine's calls: a batched prefill of unequal segments on a
/// KV cache, then one token per row per step) on wgpu against the CPU, for a dense and an NF4
/// model: logits within [`CACHED_LOGIT_TOLERANCE`] at every step and the same greedy tokens.
#[test]
fn cached_decoding_on_wgpu_matches_the_cpu() {
    use fathom_model::{KvCache, Qwen2Config, prefill};

    fn run<B: fathom_model::ModelBackend>(
        nf4: bool,
        steps: usize,
        forced: Option<&[Vec<u32>]>,
    ) -> (Vec<Vec<f32>>, Vec<Vec<u32>>) {
        let device = Default::default();
        let config = Qwen2Config::with_shape(512, 64, 128, 2, 4, 2);
        let model = Qwen2ForCausalLM::<B>::random(config, 11, nf4, &device);
        let mut cache: KvCache<B> = model.new_cache();
        let rows = [cache.add_row(), cache.add_row()];
        let prompts: [Vec<u32>; 2] = [
            (0..23).map(|i| (i * 37 + 5) % 512).collect(),
            (0..9).map(|i| (i * 91 + 2) % 512).collect(),
        ];
        let mut segments: Vec<Vec<u32>> = prompts.to_vec();
        let (mut logits, mut tokens) = (Vec::new(), vec![Vec::new(), Vec::new()]);
        for step in 0..steps {
            let refs: Vec<(usize, &[u32])> = rows
                .iter()
                .zip(&segments)
                .map(|(&r, s)| (r, s.as_slice()))
                .collect();
            let out: Vec<f32> = prefill(&model, &mut cache, &refs, &device)
                .unwrap()
                .into_data()
                .to_vec()
                .unwrap();
            for (r, row) in out.chunks(512).enumerate() {
                let next = match forced {
                    Some(f) => f[r][step],
                    None => argmax(row) as u32,
                };
                tokens[r].push(next);
                segments[r] = vec![next];
            }
            // Mid-way, row 1 takes a long segment (an observation) while row 0 decodes.
            if step == steps / 2 {
                segments[1].extend((0..31).map(|i| (i * 13 + 7) % 512));
            }
            logits.push(out);
        }
        (logits, tokens)
    }

    for nf4 in [false, true] {
        let (cpu_logits, cpu_tokens) = run::<Cpu>(nf4, 12, None);
        // wgpu is fed the CPU's tokens, so every step compares the same inputs.
        let (gpu_logits, gpu_tokens) = run::<Wgpu>(nf4, 12, Some(&cpu_tokens));
        let mut worst = 0f32;
        for (step, (c, g)) in cpu_logits.iter().zip(&gpu_logits).enumerate() {
            let diff = max_abs_diff(c, g);
            worst = worst.max(diff);
            assert!(
                diff <= CACHED_LOGIT_TOLERANCE,
                "nf4 {nf4}, step {step}: max |logit diff| {diff}"
            );
            for (r, (cr, gr)) in c.chunks(512).zip(g.chunks(512)).enumerate() {
                assert_eq!(argmax(cr), argmax(gr), "nf4 {nf4}, step {step}, row {r}");
            }
        }
        assert_eq!(cpu_tokens, gpu_tokens);
        eprintln!("nf4 {nf4}: max |logit diff| over the run {worst:e}");
    }
}

/// A deterministic head weight `[rows, cols]` and input `[m, cols]` on `B`'s default device.
fn head_and_input<B: fathom_model::ModelBackend>(
    rows: usize,
    cols: usize,
    m: usize,
) -> (
    burn::tensor::ops::FloatTensor<B>,
    burn::tensor::ops::FloatTensor<B>,
) {
    use burn::tensor::{Tensor, TensorData};
    let device = Default::default();
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919) % 1013) as f32 / 1013.0 - 0.5)
        .collect();
    let x: Vec<f32> = (0..m * cols)
        .map(|i| ((i * 31) % 17) as f32 / 17.0 - 0.5)
        .collect();
    let w = Tensor::<B, 2>::from_data(TensorData::new(w, [rows, cols]), &device);
    let x = Tensor::<B, 2>::from_data(TensorData::new(x, [m, cols]), &device);
    (w.into_primitive().tensor(), x.into_primitive().tensor())
}

/// Regression: the output head over a vocabulary wider than wgpu's 65,535 workgroups per
/// dispatch dimension (Qwen2.5's 151,936) computes every logit on wgpu, as on the CPU.
#[test]
fn head_over_a_large_vocabulary_matches_the_cpu() {
    use burn::tensor::{Tensor, TensorPrimitive};
    use fathom_model::ModelBackend;

    fn head<B: ModelBackend>(rows: usize, cols: usize, m: usize) -> Vec<f32> {
        let (w, x) = head_and_input::<B>(rows, cols, m);
        let y = B::dense_linear(x, w);
        Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(y))
            .into_data()
            .to_vec()
            .unwrap()
    }
    for m in [1, 3] {
        let cpu = head::<Cpu>(151_936, 32, m);
        let gpu = head::<Wgpu>(151_936, 32, m);
        let first_bad = cpu.iter().zip(&gpu).position(|(a, b)| (a - b).abs() > 1e-4);
        assert!(
            first_bad.is_none(),
            "m {m}: first logit that differs: {first_bad:?} of {}",
            cpu.len()
        );
    }
}

/// A model whose f32 embedding table is larger than the adapter lets one buffer be (lavapipe:
/// 128 MiB; a vocabulary of 151,936 × 256 is 155.6 MB) loads on wgpu with the table in row
/// blocks and decodes as on the CPU: logits within [`CACHED_LOGIT_TOLERANCE`], same greedy
/// tokens, with prompt ids from every block.
#[test]
fn embedding_larger_than_one_wgpu_buffer_is_held_in_blocks() {
    use fathom_model::{KvCache, ModelBackend, Qwen2Config, prefill};

    let (vocab, hidden) = (151_936, 256);
    fn run<B: ModelBackend>(
        config: &Qwen2Config,
        forced: Option<&[u32]>,
    ) -> (Vec<Vec<f32>>, Vec<u32>, usize) {
        let device = Default::default();
        let model = Qwen2ForCausalLM::<B>::random(config.clone(), 3, true, &device);
        let blocks = model.model.embed_tokens.blocks.len();
        let mut cache: KvCache<B> = model.new_cache();
        let row = cache.add_row();
        let mut segment: Vec<u32> = vec![7, 21_000, 43_690, 65_536, 100_000, 151_935, 131_072, 12];
        let (mut logits, mut tokens) = (Vec::new(), Vec::new());
        for step in 0..4 {
            let out: Vec<f32> = prefill(&model, &mut cache, &[(row, segment.as_slice())], &device)
                .unwrap()
                .into_data()
                .to_vec()
                .unwrap();
            let next = match forced {
                Some(f) => f[step],
                None => argmax(&out) as u32,
            };
            tokens.push(next);
            segment = vec![next];
            logits.push(out);
        }
        (logits, tokens, blocks)
    }
    let config = Qwen2Config::with_shape(vocab, hidden, 512, 1, 4, 2);
    let limit = Wgpu::max_buffer_bytes(&Default::default()).unwrap_or(usize::MAX);
    let (cpu_logits, cpu_tokens, cpu_blocks) = run::<Cpu>(&config, None);
    let (gpu_logits, gpu_tokens, gpu_blocks) = run::<Wgpu>(&config, Some(&cpu_tokens));
    assert_eq!(cpu_blocks, 1);
    let table = vocab * hidden * 4;
    assert_eq!(
        gpu_blocks,
        table.div_ceil(limit / (hidden * 4) * hidden * 4).max(1),
        "limit {limit}"
    );
    eprintln!("wgpu buffer limit {limit} bytes: the {table}-byte table in {gpu_blocks} blocks");
    for (step, (c, g)) in cpu_logits.iter().zip(&gpu_logits).enumerate() {
        let diff = max_abs_diff(c, g);
        assert!(
            diff <= CACHED_LOGIT_TOLERANCE,
            "step {step}: max |logit diff| {diff}"
        );
        assert_eq!(argmax(c), argmax(g), "step {step}");
    }
    assert_eq!(cpu_tokens, gpu_tokens);
}

/// Regression: chunked log-probabilities, entropies and their hidden-state gradient over an odd
/// vocabulary wider than 65,535 (the row reductions' failure case on wgpu) agree with the CPU.
#[test]
fn token_logprobs_over_an_odd_large_vocabulary_match_the_cpu() {
    use burn::tensor::{Int, Tensor, TensorData, TensorPrimitive};
    use fathom_model::ModelBackend;
    use fathom_model::backend::Head;

    fn run<B: ModelBackend>(rows: usize, cols: usize, m: usize) -> (Vec<f32>, Vec<f32>) {
        let device = Default::default();
        let (w, x) = head_and_input::<B>(rows, cols, m);
        let head = Head::<B>::Dense(w);
        let t: Vec<i64> = (0..m).map(|i| ((i * 40_009 + 3) % rows) as i64).collect();
        let g: Vec<f32> = (0..m * 2).map(|i| 0.5 - (i % 3) as f32 * 0.25).collect();
        let t = Tensor::<B, 1, Int>::from_data(TensorData::new(t, [m]), &device).into_primitive();
        let g = Tensor::<B, 2>::from_data(TensorData::new(g, [m, 2]), &device)
            .into_primitive()
            .tensor();
        let read = |p| {
            Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(p))
                .into_data()
                .to_vec::<f32>()
                .unwrap()
        };
        let out = B::token_logprobs(x.clone(), &head, t.clone(), 0.7, 2);
        let grad = B::token_logprobs_backward(x, &head, t, 0.7, 2, g);
        (read(out), read(grad))
    }
    let (cpu, cpu_grad) = run::<Cpu>(70_001, 16, 3);
    let (gpu, gpu_grad) = run::<Wgpu>(70_001, 16, 3);
    assert!(
        cpu.iter().all(|v| v.is_finite()) && gpu.iter().all(|v| v.is_finite()),
        "{cpu:?} {gpu:?}"
    );
    let (d, dg) = (max_abs_diff(&cpu, &gpu), max_abs_diff(&cpu_grad, &gpu_grad));
    assert!(
        d < 1e-3 && dg < 1e-3,
        "log-probs/entropies differ by {d}, gradients by {dg}: {cpu:?} vs {gpu:?}"
    );
}
