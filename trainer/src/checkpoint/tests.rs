//! Round trips, crashes mid-write, damaged checkpoints and resumption from the newest
//! complete one.

use super::*;
use burn::backend::Autodiff;
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use fathom_model::lora::init_rng;
use fathom_model::{Cpu, LoraSettings, Qwen2Config, Target, sequence_logprobs};
use rand::RngCore;

use crate::optim::AdamWSettings;
use crate::rapo::ReplaySettings;

type Ad = Autodiff<Cpu>;

fn config() -> Qwen2Config {
    Qwen2Config::with_shape(64, 16, 32, 2, 4, 2)
}

fn base() -> Qwen2ForCausalLM<Ad> {
    Qwen2ForCausalLM::random(config(), 3, false, &Default::default())
}

fn with_adapter() -> Qwen2ForCausalLM<Ad> {
    let settings = LoraSettings {
        rank: 2,
        alpha: 4.0,
        dropout: 0.0,
        rslora: false,
        targets: vec![Target::QProj, Target::VProj, Target::DownProj],
    };
    base().attach_lora(&settings, &mut init_rng(1), &Default::default())
}

fn adamw() -> AdamWSettings {
    AdamWSettings {
        lr: 1e-2,
        weight_decay: 0.01,
        betas: (0.9, 0.99),
        eps: 1e-8,
        grad_clip: None,
    }
}

fn grads(model: &Qwen2ForCausalLM<Ad>) -> GradientsParams {
    let ids = vec![vec![1u32, 5, 9, 2, 7, 30, 11], vec![3, 3, 8, 1, 0, 12, 40]];
    let mask = vec![vec![1u8; 7]; 2];
    let loss: Tensor<Ad, 1> = sequence_logprobs(model, &ids, &mask, 1.0, &Default::default())
        .unwrap()
        .sum()
        .neg();
    GradientsParams::from_grads(loss.backward(), model)
}

/// A model and optimiser after two steps (so the optimiser's moments are non-trivial).
fn trained() -> (Qwen2ForCausalLM<Ad>, AdamWOptimizer<Ad>) {
    let mut model = with_adapter();
    let mut optim = adamw().init::<Ad, Qwen2ForCausalLM<Ad>>();
    for _ in 0..2 {
        let g = grads(&model);
        model = optim.step(1e-2, model, g);
    }
    (model, optim)
}

fn state(step: u64) -> TrainerState {
    let mut rng = train_rng(42);
    for _ in 0..step * 3 + 1 {
        rng.next_u64();
    }
    let mut rapo = RapoState::default();
    rapo.solve_rates.record("train-00001", [true, false, true]);
    rapo.replay.offer(
        "train-00001",
        &crate::grpo::Sample {
            ids: vec![1, 2, 3],
            sampled: vec![false, true, true],
            logprobs: vec![0.0, -0.25, -1.0 / 3.0],
        },
        0.9,
        step,
        &ReplaySettings { min_reward: 0.5 },
    );
    TrainerState {
        step,
        stage: Stage::Grpo,
        data: DataCursor {
            epoch: 1,
            position: step * 4,
        },
        rng: RngState::capture(&rng),
        rapo,
    }
}

fn lora_values(model: &Qwen2ForCausalLM<Ad>) -> Vec<Vec<f32>> {
    model
        .projections()
        .into_iter()
        .filter_map(|(_, l)| l.lora.as_ref())
        .flat_map(|l| [l.lora_a.val(), l.lora_b.val()])
        .map(|t| t.into_data().to_vec::<f32>().unwrap())
        .collect()
}

const RECIPE: &str = "(model: \"tiny\")\n";

#[test]
fn round_trip_restores_adapter_optimizer_rng_and_state_exactly() {
    let root = tempfile::tempdir().unwrap();
    let (model, optim) = trained();
    let st = state(7);
    let dir = save(root.path(), &model, &optim, &st, RECIPE, 3).unwrap();
    assert_eq!(dir.file_name().unwrap(), "step-00000007");
    assert_eq!(latest(root.path(), Stage::Grpo).unwrap(), Some(dir.clone()));

    let fresh = adamw().init::<Ad, Qwen2ForCausalLM<Ad>>();
    let loaded = load(&dir, base(), fresh, &Default::default()).unwrap();
    assert_eq!(loaded.state, st);
    assert_eq!(loaded.recipe_text, RECIPE);
    assert_eq!(lora_values(&loaded.model), lora_values(&model));
    // The generator continues the same sequence.
    let mut a = st.rng.restore().unwrap();
    let mut b = {
        let mut rng = train_rng(42);
        for _ in 0..22 {
            rng.next_u64();
        }
        rng
    };
    assert_eq!(
        (0..5).map(|_| a.next_u64()).collect::<Vec<_>>(),
        (0..5).map(|_| b.next_u64()).collect::<Vec<_>>()
    );
    // The optimiser state is the same: one more identical step gives identical weights
    // (a fresh optimiser would not: Adam's first step differs from its third).
    let (mut m1, mut o1) = (model, optim);
    let (mut m2, mut o2) = (loaded.model, loaded.optim);
    let g1 = grads(&m1);
    let g2 = grads(&m2);
    m1 = o1.step(1e-2, m1, g1);
    m2 = o2.step(1e-2, m2, g2);
    assert_eq!(lora_values(&m1), lora_values(&m2));
    let (m3, _) = trained();
    let mut o3 = adamw().init::<Ad, Qwen2ForCausalLM<Ad>>();
    let g3 = grads(&m3);
    let m3 = o3.step(1e-2, m3, g3);
    assert_ne!(
        lora_values(&m3),
        lora_values(&m1),
        "state must matter for this test"
    );
}

#[test]
fn a_crash_mid_write_never_hides_the_latest_complete_checkpoint() {
    let root = tempfile::tempdir().unwrap();
    let (model, optim) = trained();
    let good = save(root.path(), &model, &optim, &state(10), RECIPE, 5).unwrap();
    // A writer killed mid-save leaves its temporary directory with partial files.
    let tmp = root.path().join(".tmp-step-00000020-99999");
    std::fs::create_dir_all(tmp.join("adapter")).unwrap();
    std::fs::write(tmp.join("adapter/adapter_model.safetensors"), b"partial").unwrap();
    std::fs::write(tmp.join("state.json"), b"{\"step\": 2").unwrap();
    assert_eq!(
        latest(root.path(), Stage::Grpo).unwrap(),
        Some(good.clone())
    );
    // A newer directory whose files were damaged after the rename, or which lacks its
    // manifest, is skipped too.
    let newer = save(root.path(), &model, &optim, &state(30), RECIPE, 5).unwrap();
    assert!(!tmp.exists(), "the next save removes leftover temporaries");
    let f = newer.join("optimizer.mpk");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let err = verify(&newer).unwrap_err().to_string();
    assert!(
        err.contains("optimizer.mpk") && err.contains("bytes"),
        "{err}"
    );
    assert_eq!(
        latest(root.path(), Stage::Grpo).unwrap(),
        Some(good.clone())
    );
    let no_manifest = root.path().join("step-00000040");
    std::fs::create_dir(&no_manifest).unwrap();
    let err = verify(&no_manifest).unwrap_err().to_string();
    assert!(
        err.contains("manifest.json") && err.contains("incomplete"),
        "{err}"
    );
    assert_eq!(
        latest(root.path(), Stage::Grpo).unwrap(),
        Some(good.clone())
    );
    // Resuming picks that one and loads.
    let fresh = adamw().init::<Ad, Qwen2ForCausalLM<Ad>>();
    let loaded = load(&good, base(), fresh, &Default::default()).unwrap();
    assert_eq!(loaded.state.step, 10);
    // Loading the damaged one names the file.
    let fresh = adamw().init::<Ad, Qwen2ForCausalLM<Ad>>();
    let err = load(&newer, base(), fresh, &Default::default())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("optimizer.mpk"), "{err}");
}

#[test]
fn only_the_newest_k_are_kept_and_same_step_saves_replace() {
    let root = tempfile::tempdir().unwrap();
    let (model, optim) = trained();
    for step in [5, 10, 15, 20] {
        save(root.path(), &model, &optim, &state(step), RECIPE, 2).unwrap();
    }
    let steps: Vec<u64> = list(root.path(), Stage::Grpo)
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(steps, vec![15, 20]);
    let again = save(
        root.path(),
        &model,
        &optim,
        &state(20),
        "(changed: true)",
        2,
    )
    .unwrap();
    verify(&again).unwrap();
    assert_eq!(
        std::fs::read_to_string(again.join("recipe.ron")).unwrap(),
        "(changed: true)"
    );
    // SFT checkpoints live beside GRPO's without interfering.
    let mut sft = state(3);
    sft.stage = Stage::Sft;
    let s = save(root.path(), &model, &optim, &sft, RECIPE, 2).unwrap();
    assert_eq!(s.file_name().unwrap(), "sft-step-00000003");
    assert_eq!(latest(root.path(), Stage::Sft).unwrap(), Some(s));
    assert_eq!(list(root.path(), Stage::Grpo).unwrap().len(), 2);
}

#[test]
fn loading_names_what_does_not_match() {
    let root = tempfile::tempdir().unwrap();
    let (model, optim) = trained();
    let dir = save(root.path(), &model, &optim, &state(1), RECIPE, 2).unwrap();
    // A manifest whose checksum no longer matches an edited file.
    std::fs::write(dir.join("recipe.ron"), "(model: \"other\")\n").unwrap();
    let err = verify(&dir).unwrap_err().to_string();
    assert!(err.contains("recipe.ron"), "{err}");

    // A model whose adapter differs from the saved optimiser's parameters: the saved
    // adapter attaches to q, v and down; the optimiser entries are checked by path.
    let dir = save(root.path(), &model, &optim, &state(2), RECIPE, 2).unwrap();
    let mut params: Vec<serde_json::Value> =
        serde_json::from_slice(&std::fs::read(dir.join("optimizer_params.json")).unwrap()).unwrap();
    params[0]["path"] = "model.layers.9.self_attn.q_proj.lora.lora_a".into();
    let text = serde_json::to_vec_pretty(&params).unwrap();
    std::fs::write(dir.join("optimizer_params.json"), &text).unwrap();
    // Re-seal the manifest so that only the content is wrong.
    let mut manifest: Manifest =
        serde_json::from_slice(&std::fs::read(dir.join(MANIFEST)).unwrap()).unwrap();
    for f in manifest.files.iter_mut() {
        if f.path == "optimizer_params.json" {
            f.bytes = text.len() as u64;
            f.crc32 = crc32fast::hash(&text);
        }
    }
    std::fs::write(dir.join(MANIFEST), json(&manifest)).unwrap();
    let fresh = adamw().init::<Ad, Qwen2ForCausalLM<Ad>>();
    let err = load(&dir, base(), fresh, &Default::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("optimizer_params.json") && err.contains("model.layers.9"),
        "{err}"
    );
}
