//! A checkpoint whose weights are exactly Q4_1 / Q8_0 blocks (as one converted from a GGUF file
//! is) loads with block copies beside its dense weights, and the model decodes with the same
//! logits, to the bit, and the same tokens as without them; a checkpoint of other values gets
//! no copies; full fine-tuning drops them.

use burn::tensor::{Tensor, TensorData};
use fathom_model::blocks::{self, BlockFormat};
use fathom_model::linear::{BaseWeight, frozen};
use fathom_model::save::SaveDtype;
use fathom_model::{Cpu, GenerateConfig, LoadOptions, Qwen2Config, Qwen2ForCausalLM, generate};

/// Block words for `rows × cols` weights: scales and minimums that vary by block, codes from a
/// simple generator, with each block's extreme codes present (as a quantizer leaves them: the
/// smallest weight is Q4_1's `q = 0`, the largest `q = 15`; Q8_0's largest magnitude `q = 127`).
fn block_words(format: BlockFormat, rows: usize, cols: usize, seed: u32) -> Vec<u32> {
    let mut s = seed.wrapping_mul(2_654_435_761) | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        s
    };
    let mut words = Vec::new();
    for b in 0..rows * cols / blocks::BLOCK {
        let d = half::f16::from_f32((2 + b % 5) as f32 * 7e-4).to_f32();
        words.push(d.to_bits());
        match format {
            BlockFormat::Q4_1 => {
                let m = half::f16::from_f32(-((3 + b % 4) as f32) * 3e-3).to_f32();
                words.push(m.to_bits());
                // Byte 0 holds codes 0 (low) and 15 (high).
                words.push((next() & !0xff) | 0xf0);
                words.extend((0..3).map(|_| next()));
            }
            BlockFormat::Q8_0 => {
                let codes = (0..8).map(|_| next() & 0x7f7f_7f7f);
                let mut codes: Vec<u32> = codes.collect();
                codes[0] = (codes[0] & !0xff) | 127;
                words.extend(codes);
            }
        }
    }
    words
}

fn exact(format: BlockFormat, rows: usize, cols: usize, seed: u32) -> Tensor<Cpu, 2> {
    let values = blocks::dequantize(format, &block_words(format, rows, cols, seed), rows, cols);
    Tensor::from_data(TensorData::new(values, [rows, cols]), &Default::default())
}

/// A random model whose projections are Q4_1 blocks and whose output head (the embedding
/// when `tied`) is Q8_0 blocks, saved and loaded back.
fn exact_model(tied: bool) -> (Qwen2ForCausalLM<Cpu>, tempfile::TempDir) {
    let device = Default::default();
    let mut config = Qwen2Config::with_shape(96, 64, 96, 2, 4, 2);
    config.tie_word_embeddings = tied;
    let mut model = Qwen2ForCausalLM::<Cpu>::random(config, 7, false, &device);
    for (i, (_, p)) in model.layer_projections_mut().into_iter().enumerate() {
        let [rows, cols] = p.shape();
        p.weight = BaseWeight::Dense(frozen(exact(BlockFormat::Q4_1, rows, cols, i as u32)));
    }
    let head = exact(BlockFormat::Q8_0, 96, 64, 99);
    match &mut model.lm_head {
        Some(lm_head) => lm_head.weight = BaseWeight::Dense(frozen(head)),
        None => model.model.embed_tokens.blocks = vec![frozen(head)],
    }
    let dir = tempfile::tempdir().unwrap();
    model.save_pretrained(dir.path(), SaveDtype::F32).unwrap();
    let back = Qwen2ForCausalLM::<Cpu>::load(dir.path(), &device, LoadOptions::default()).unwrap();
    (back, dir)
}

/// The model with every block copy dropped: it multiplies by the dense weights.
fn without_copies(model: &Qwen2ForCausalLM<Cpu>) -> Qwen2ForCausalLM<Cpu> {
    let mut plain = model.clone();
    plain.drop_block_copies();
    plain
}

fn logits(model: &Qwen2ForCausalLM<Cpu>, ids: &[Vec<u32>]) -> Vec<u32> {
    let device = Default::default();
    let mask: Vec<Vec<u8>> = ids.iter().map(|s| vec![1; s.len()]).collect();
    let input = model.step_input(ids, &mask, &device).unwrap();
    let out = model
        .forward(&input, None)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    out.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn block_exact_checkpoints_decode_the_same_with_their_copies() {
    for tied in [true, false] {
        let (model, _dir) = exact_model(tied);
        for (path, p) in model.projections() {
            let copy = p.block_copy.as_ref();
            let expected = if path == "lm_head" {
                BlockFormat::Q8_0
            } else {
                BlockFormat::Q4_1
            };
            assert_eq!(copy.map(|c| c.format), Some(expected), "{path}");
        }
        let embedding = model.model.embed_tokens.block_copy.as_ref();
        assert_eq!(
            embedding.map(|c| c.format),
            tied.then_some(BlockFormat::Q8_0),
            "the embedding has a copy only when it is the head"
        );
        let plain = without_copies(&model);
        // A few rows (the decoding kernels read the copies) and many (`gemm` reads the f32).
        for ids in [
            vec![vec![1u32, 5, 9]],
            vec![vec![3u32; 5], vec![4; 5], vec![8; 5]],
            vec![(0..40).collect::<Vec<u32>>()],
        ] {
            assert_eq!(logits(&model, &ids), logits(&plain, &ids), "tied {tied}");
        }
        let prompts = vec![vec![1u32, 2, 3], vec![7u32, 11], vec![5u32; 4]];
        let config = GenerateConfig::greedy(12);
        let device = Default::default();
        let a = generate(&model, &prompts, &config, None, &device).unwrap();
        let b = generate(&plain, &prompts, &config, None, &device).unwrap();
        assert_eq!(a.tokens, b.tokens, "tied {tied}");
    }
}

#[test]
fn checkpoints_of_other_values_get_no_copies() {
    let device = Default::default();
    let config = Qwen2Config::with_shape(96, 64, 96, 2, 4, 2);
    let model = Qwen2ForCausalLM::<Cpu>::random(config, 3, false, &device);
    let dir = tempfile::tempdir().unwrap();
    model.save_pretrained(dir.path(), SaveDtype::F32).unwrap();
    let back = Qwen2ForCausalLM::<Cpu>::load(dir.path(), &device, LoadOptions::default()).unwrap();
    for (path, p) in back.projections() {
        assert!(p.block_copy.is_none(), "{path}");
    }
    assert!(back.model.embed_tokens.block_copy.is_none());
}

#[test]
fn full_fine_tuning_drops_the_copies() {
    type Ad = burn::backend::Autodiff<Cpu>;
    let (_, dir) = exact_model(true);
    let device = Default::default();
    let model = Qwen2ForCausalLM::<Ad>::load(dir.path(), &device, LoadOptions::default()).unwrap();
    assert!(
        model
            .projections()
            .iter()
            .all(|(_, p)| p.block_copy.is_some())
    );
    assert!(model.model.embed_tokens.block_copy.is_some());
    let full = model.into_full_tuning().unwrap();
    assert!(
        full.projections()
            .iter()
            .all(|(_, p)| p.block_copy.is_none())
    );
    assert!(full.model.embed_tokens.block_copy.is_none());
}
