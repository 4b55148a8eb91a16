//! Greedy continuations match `transformers`' `generate()` on every fixture, with the KV cache
//! and without it; batched left-padded rows behave like single rows; teacher-forced
//! log-probabilities agree with the ones generation reports.

mod common;

use common::{Reference, fixture};
use fathom_model::{
    Cpu, GenerateConfig, LoadOptions, Qwen2ForCausalLM, generate, sequence_logprobs,
};

fn model(dir: &str, adapter: Option<&str>) -> Qwen2ForCausalLM<Cpu> {
    let device = Default::default();
    let base = if adapter.is_some() { "tiny-qwen2" } else { dir };
    let mut m =
        Qwen2ForCausalLM::<Cpu>::load(&fixture(base), &device, LoadOptions::default()).unwrap();
    if let Some(a) = adapter {
        m = m.load_adapter(&fixture(a), &device).unwrap();
    }
    m
}

/// The unpadded prompt of each reference row.
fn prompts(r: &Reference) -> Vec<Vec<u32>> {
    r.input_ids
        .iter()
        .zip(&r.attention_mask)
        .map(|(ids, m)| {
            ids.iter()
                .zip(m)
                .filter(|p| *p.1 == 1)
                .map(|p| *p.0)
                .collect()
        })
        .collect()
}

fn check(dir: &str, adapter: Option<&str>) {
    let device = Default::default();
    let m = model(dir, adapter);
    let r = Reference::read(&fixture(adapter.unwrap_or(dir)));
    for use_cache in [true, false] {
        let mut config = GenerateConfig::greedy(r.greedy[0].len());
        config.use_cache = use_cache;
        let out = generate(&m, &prompts(&r), &config, None, &device).unwrap();
        assert_eq!(out.tokens, r.greedy, "{dir} (cache: {use_cache})");
    }
}

#[test]
fn dense_greedy_matches() {
    check("tiny-qwen2", None);
}

#[test]
fn llama_greedy_matches() {
    check("tiny-llama", None);
}

#[test]
fn nf4_greedy_matches() {
    check("tiny-qwen2-nf4", None);
    check("tiny-qwen2-nf4-plain", None);
}

#[test]
fn lora_greedy_matches() {
    check("tiny-qwen2-lora", Some("tiny-qwen2-lora"));
}

#[test]
fn rows_are_independent_of_their_batch() {
    let device = Default::default();
    let m = model("tiny-qwen2-nf4", None);
    let r = Reference::read(&fixture("tiny-qwen2-nf4"));
    let p = prompts(&r);
    let config = GenerateConfig::greedy(8);
    let batched = generate(&m, &p, &config, None, &device).unwrap();
    for (i, prompt) in p.iter().enumerate() {
        let alone = generate(&m, std::slice::from_ref(prompt), &config, None, &device).unwrap();
        assert_eq!(alone.tokens[0], batched.tokens[i]);
        for (a, b) in alone.logprobs[0].iter().zip(&batched.logprobs[i]) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
    }
}

#[test]
fn eos_stops_a_row_and_logprobs_match_teacher_forcing() {
    let device = Default::default();
    let m = model("tiny-qwen2-nf4", None);
    let r = Reference::read(&fixture("tiny-qwen2-nf4"));
    let p = prompts(&r);
    // Stop row 0 at the third greedy token.
    let mut config = GenerateConfig::greedy(16);
    config.eos_ids = vec![r.greedy[0][2]];
    let out = generate(&m, &p[..1], &config, None, &device).unwrap();
    assert_eq!(out.tokens[0], r.greedy[0][..3].to_vec());
    assert_eq!(out.finish[0], fathom_model::generate::FinishReason::Eos);
    // Teacher-forced log-probabilities of prompt + generated tokens equal those reported.
    let full: Vec<u32> = p[0].iter().chain(&out.tokens[0]).copied().collect();
    let lp = sequence_logprobs(&m, &[full.clone()], &[vec![1; full.len()]], 1.0, &device).unwrap();
    let lp: Vec<f32> = lp.into_data().to_vec().unwrap();
    let tail = &lp[lp.len() - 3..];
    for (a, b) in tail.iter().zip(&out.logprobs[0]) {
        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
    }
}

#[test]
fn sampling_is_reproducible_by_seed() {
    let device = Default::default();
    let m = model("tiny-qwen2-nf4", None);
    let r = Reference::read(&fixture("tiny-qwen2-nf4"));
    let p = prompts(&r);
    let mut config = GenerateConfig::greedy(12);
    config.sampling = fathom_model::Sampling::Sample {
        temperature: 1.3,
        top_p: 0.95,
        top_k: 50,
    };
    config.seed = 42;
    let a = generate(&m, &p, &config, None, &device).unwrap();
    let b = generate(&m, &p, &config, None, &device).unwrap();
    assert_eq!(a, b);
    config.seed = 43;
    let c = generate(&m, &p, &config, None, &device).unwrap();
    assert_ne!(a.tokens, c.tokens);
}
