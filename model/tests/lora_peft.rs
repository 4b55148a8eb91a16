//! LoRA: PEFT adapters load and match `peft`'s logits; our adapters round-trip through PEFT's
//! format; merging matches the unmerged model; gradients reach only the adapter and agree with
//! finite differences.

mod common;

use burn::backend::Autodiff;
use burn::module::{AutodiffModule, Module};
use burn::tensor::Tensor;
use common::{Reference, fixture, max_masked_diff};
use fathom_model::lora::init_rng;
use fathom_model::{
    Cpu, LoadOptions, LoraSettings, Qwen2Config, Qwen2ForCausalLM, Target, sequence_logprobs,
};

fn base() -> Qwen2ForCausalLM<Cpu> {
    Qwen2ForCausalLM::<Cpu>::load(
        &fixture("tiny-qwen2"),
        &Default::default(),
        LoadOptions::default(),
    )
    .unwrap()
}

#[test]
fn peft_adapter_logits_match_peft() {
    let device = Default::default();
    let model = base()
        .load_adapter(&fixture("tiny-qwen2-lora"), &device)
        .expect("adapter loads");
    assert_eq!(model.lora_targets().len(), 7);
    let r = Reference::read(&fixture("tiny-qwen2-lora"));
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

#[test]
fn adapter_on_nf4_base_loads() {
    let device = Default::default();
    let model =
        Qwen2ForCausalLM::<Cpu>::load(&fixture("tiny-qwen2-nf4"), &device, LoadOptions::default())
            .unwrap()
            .load_adapter(&fixture("tiny-qwen2-lora"), &device)
            .unwrap();
    let r = Reference::read(&fixture("tiny-qwen2-lora"));
    let input = model
        .step_input(&r.input_ids, &r.attention_mask, &device)
        .unwrap();
    let logits = model
        .forward(&input, None)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    // NF4 rounding moves the logits, but the adapter's effect must be there: closer to the
    // adapted reference than the plain NF4 model is.
    let plain =
        Qwen2ForCausalLM::<Cpu>::load(&fixture("tiny-qwen2-nf4"), &device, LoadOptions::default())
            .unwrap();
    let plain_logits = plain
        .forward(&input, None)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    assert!(max_masked_diff(&logits, &r) < max_masked_diff(&plain_logits, &r));
}

#[test]
fn save_then_load_round_trips_and_merge_matches() {
    let device = Default::default();
    let model = base()
        .load_adapter(&fixture("tiny-qwen2-lora"), &device)
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    model.save_adapter(dir.path(), Some("tiny-qwen2")).unwrap();
    // Our files equal PEFT's tensors exactly.
    let ours = fathom_model::checkpoint::Checkpoint::open_files(
        dir.path(),
        &[dir.path().join("adapter_model.safetensors")],
    )
    .unwrap();
    let peft = fathom_model::checkpoint::Checkpoint::open_files(
        &fixture("tiny-qwen2-lora"),
        &[fixture("tiny-qwen2-lora").join("adapter_model.safetensors")],
    )
    .unwrap();
    assert_eq!(ours.names(), peft.names());
    for name in peft.names() {
        let shape = peft.shape(&name).unwrap();
        assert_eq!(
            ours.f32(&name, &shape).unwrap(),
            peft.f32(&name, &shape).unwrap(),
            "{name}"
        );
    }
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["r"], 8);
    assert_eq!(config["lora_alpha"], 16.0);
    assert_eq!(config["peft_type"], "LORA");

    let reloaded = base().load_adapter(dir.path(), &device).unwrap();
    let r = Reference::read(&fixture("tiny-qwen2-lora"));
    let input = model
        .step_input(&r.input_ids, &r.attention_mask, &device)
        .unwrap();
    let a = model.forward(&input, None);
    let b = reloaded.forward(&input, None);
    assert_eq!(a.clone().into_data(), b.into_data());
    let merged = model.merge_adapters();
    assert!(merged.lora_targets().is_empty());
    let c = merged.forward(&input, None);
    let diff = (a - c).abs().max().into_scalar();
    assert!(diff < 1e-4, "merged differs by {diff}");
}

#[test]
fn malformed_adapters_are_refused_by_name() {
    let device = Default::default();
    let dir = tempfile::tempdir().unwrap();
    let src = fixture("tiny-qwen2-lora");
    std::fs::copy(
        src.join("adapter_model.safetensors"),
        dir.path().join("adapter_model.safetensors"),
    )
    .unwrap();
    let config = std::fs::read_to_string(src.join("adapter_config.json")).unwrap();
    std::fs::write(
        dir.path().join("adapter_config.json"),
        config.replace("\"use_dora\": false", "\"use_dora\": true"),
    )
    .unwrap();
    let err = base()
        .load_adapter(dir.path(), &device)
        .unwrap_err()
        .to_string();
    assert!(err.contains("use_dora"), "{err}");
    std::fs::write(dir.path().join("adapter_config.json"), "{not json").unwrap();
    let err = base()
        .load_adapter(dir.path(), &device)
        .unwrap_err()
        .to_string();
    assert!(err.contains("adapter_config.json"), "{err}");
    let missing = tempfile::tempdir().unwrap();
    assert!(base().load_adapter(missing.path(), &device).is_err());
}

#[test]
fn adapter_for_a_different_base_shape_is_refused_as_such() {
    let device = Default::default();
    let adapter = fixture("tiny-qwen2-lora"); // made for tiny-qwen2: 2 layers, hidden 64
    // Narrower projections: the LoRA matrices do not fit.
    let narrow = Qwen2ForCausalLM::<Cpu>::random(
        Qwen2Config::with_shape(1024, 32, 96, 2, 4, 2),
        0,
        false,
        &device,
    );
    let err = narrow
        .load_adapter(&adapter, &device)
        .unwrap_err()
        .to_string();
    assert!(err.contains("made for a different base shape"), "{err}");
    assert!(err.contains("hidden size 32"), "{err}");
    assert!(err.contains("tiny-qwen2-lora"), "the adapter's path: {err}");
    // Same widths, one layer fewer: the adapter's second layer has nowhere to go.
    let shallow = Qwen2ForCausalLM::<Cpu>::random(
        Qwen2Config::with_shape(1024, 64, 192, 1, 4, 2),
        0,
        false,
        &device,
    );
    let err = shallow
        .load_adapter(&adapter, &device)
        .unwrap_err()
        .to_string();
    assert!(err.contains("made for a different base shape"), "{err}");
    assert!(err.contains("layers.1."), "names the tensor: {err}");
    assert!(err.contains("1 layers"), "{err}");
}

type Ad = Autodiff<Cpu>;

fn tiny_config() -> Qwen2Config {
    let mut c = Qwen2Config::with_shape(32, 16, 24, 2, 4, 2);
    c.tie_word_embeddings = false;
    c
}

fn loss(model: &Qwen2ForCausalLM<Ad>, ids: &[Vec<u32>]) -> Tensor<Ad, 1> {
    let mask: Vec<Vec<u8>> = ids.iter().map(|r| vec![1; r.len()]).collect();
    sequence_logprobs(model, ids, &mask, 1.0, &Default::default())
        .unwrap()
        .sum()
}

#[test]
fn lora_gradients_match_finite_differences_and_base_gets_none() {
    let device = Default::default();
    let settings = LoraSettings {
        rank: 2,
        alpha: 4.0,
        dropout: 0.0,
        rslora: false,
        targets: vec![Target::QProj, Target::DownProj],
    };
    let mut rng = init_rng(5);
    let model = Qwen2ForCausalLM::<Ad>::random(tiny_config(), 11, false, &device)
        .attach_lora(&settings, &mut rng, &device);
    // Give B non-zero values so the gradient of A is not trivially zero.
    let model = model.map(&mut NudgeB);
    let ids = vec![vec![1, 5, 9, 2, 7, 30], vec![3, 3, 8, 1, 0, 12]];
    // Only the adapter is trainable.
    let trainable = model.num_trainable();
    assert_eq!(trainable, 2 * ((2 * 16 + 16 * 2) + (2 * 24 + 16 * 2)));
    let grads = loss(&model, &ids).backward();
    let layer = &model.model.layers[1];
    let base_q = match &layer.self_attn.q_proj.weight {
        fathom_model::linear::BaseWeight::Dense(w) => w.val(),
        _ => unreachable!(),
    };
    assert!(
        base_q.grad(&grads).is_none(),
        "the frozen base must get no gradient"
    );
    let lora = layer.mlp.down_proj.lora.as_ref().unwrap();
    let analytic = lora
        .lora_a
        .val()
        .grad(&grads)
        .expect("lora_a has a gradient");
    let analytic: Vec<f32> = analytic.into_data().to_vec().unwrap();
    // Central differences on the inner (non-autodiff) model.
    let inner = model.valid();
    let a0: Vec<f32> = inner.model.layers[1]
        .mlp
        .down_proj
        .lora
        .as_ref()
        .unwrap()
        .lora_a
        .val()
        .into_data()
        .to_vec()
        .unwrap();
    let eps = 1e-2f32;
    let mut worst = 0f32;
    let mut largest = 0f32;
    for (i, &g) in analytic.iter().enumerate() {
        let eval = |delta: f32| {
            let mut a = a0.clone();
            a[i] += delta;
            let m = inner.clone().map(&mut SetA {
                layer: 1,
                values: a,
            });
            let mask: Vec<Vec<u8>> = ids.iter().map(|r| vec![1; r.len()]).collect();
            sequence_logprobs(&m, &ids, &mask, 1.0, &device)
                .unwrap()
                .sum()
                .into_scalar() as f32
        };
        let fd = (eval(eps) - eval(-eps)) / (2.0 * eps);
        // f32 resolves the loss (~30) to ~4e-6, i.e. the difference quotient to ~2e-4.
        let allowed = 5e-4 + 3e-2 * g.abs();
        worst = worst.max((fd - g).abs() / allowed);
        largest = largest.max(g.abs());
    }
    assert!(largest > 1e-2, "gradients too small to test ({largest})");
    assert!(
        worst <= 1.0,
        "finite differences disagree: worst error {worst} of the allowance"
    );
}

/// Sets every `lora_b` to small non-zero values.
struct NudgeB;
impl burn::module::ModuleMapper<Ad> for NudgeB {
    fn map_float<const D: usize>(
        &mut self,
        param: burn::module::Param<Tensor<Ad, D>>,
    ) -> burn::module::Param<Tensor<Ad, D>> {
        let (id, t, mapper) = param.consume();
        let dims = t.dims();
        let is_b = D == 2 && dims[1] == 2 && dims[0] != 2;
        let t = if is_b {
            let n: usize = dims.iter().product();
            let values: Vec<f32> = (0..n).map(|i| ((i * 7 % 5) as f32 - 2.0) * 0.1).collect();
            Tensor::<Ad, D>::from_data(burn::tensor::TensorData::new(values, dims), &t.device())
                .require_grad()
        } else {
            t
        };
        burn::module::Param::from_mapped_value(id, t, mapper)
    }
}

/// Replaces `lora_a` of `layers[layer].mlp.down_proj` (the `layer`-th `[2, 24]` parameter).
struct SetA {
    layer: usize,
    values: Vec<f32>,
}
impl burn::module::ModuleMapper<Cpu> for SetA {
    fn map_float<const D: usize>(
        &mut self,
        param: burn::module::Param<Tensor<Cpu, D>>,
    ) -> burn::module::Param<Tensor<Cpu, D>> {
        let (id, t, mapper) = param.consume();
        let dims = t.dims();
        // down_proj's A is [2, 24]; only those parameters have that shape, one per layer.
        let t = if D == 2 && dims[0] == 2 && dims[1] == 24 {
            let hit = self.layer == 0;
            self.layer = self.layer.wrapping_sub(1);
            if hit {
                let values = std::mem::take(&mut self.values);
                Tensor::<Cpu, D>::from_data(
                    burn::tensor::TensorData::new(values, dims),
                    &t.device(),
                )
            } else {
                t
            }
        } else {
            t
        };
        burn::module::Param::from_mapped_value(id, t, mapper)
    }
}
