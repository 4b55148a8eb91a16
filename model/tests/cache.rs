//! The KV cache made for multi-turn rollouts: appending multi-token segments to some rows while
//! others decode, forking a shared prefix and dropping rows all give the logits of a fresh
//! forward pass over each whole sequence.

mod common;

use common::fixture;
use fathom_model::generate::last_positions;
use fathom_model::{Cpu, LoadOptions, Qwen2ForCausalLM, prefill};

fn model() -> Qwen2ForCausalLM<Cpu> {
    Qwen2ForCausalLM::<Cpu>::load(
        &fixture("tiny-qwen2"),
        &Default::default(),
        LoadOptions::default(),
    )
    .unwrap()
}

/// Next-token logits of each whole sequence, computed from scratch.
fn fresh(model: &Qwen2ForCausalLM<Cpu>, seqs: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let device = Default::default();
    let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
    let input = model.packed_input(&refs, &device).unwrap();
    let logits = model.logits(last_positions(
        model.forward_hidden(&input, None),
        &input.spans,
    ));
    rows(logits)
}

fn rows(t: burn::tensor::Tensor<Cpu, 2>) -> Vec<Vec<f32>> {
    let [_, v] = t.dims();
    t.into_data()
        .to_vec::<f32>()
        .unwrap()
        .chunks(v)
        .map(<[f32]>::to_vec)
        .collect()
}

fn assert_close(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (g, w) in got.iter().zip(want) {
        let diff = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(diff < 1e-4, "{what}: max diff {diff}");
    }
}

#[test]
fn segments_forks_and_drops_match_fresh_forward_passes() {
    let m = model();
    let device = Default::default();
    let mut cache = m.new_cache();
    // Two prompts sharing nothing, of different lengths, prefilled together without padding.
    let mut a: Vec<u32> = vec![11, 52, 7, 300, 4];
    let mut b: Vec<u32> = vec![9, 8, 900, 12, 1, 40, 41, 42];
    let (ra, rb) = (cache.add_row(), cache.add_row());
    let got = rows(prefill(&m, &mut cache, &[(ra, &a), (rb, &b)], &device).unwrap());
    assert_close(&got, &fresh(&m, &[a.clone(), b.clone()]), "prefill");
    // One row decodes a token while the other receives a multi-token observation.
    let obs = [77u32, 78, 79, 80, 81, 82];
    let got = rows(prefill(&m, &mut cache, &[(ra, &[5]), (rb, &obs)], &device).unwrap());
    a.push(5);
    b.extend(obs);
    assert_close(&got, &fresh(&m, &[a.clone(), b.clone()]), "mixed step");
    assert_eq!(cache.row_lens(), vec![6, 14]);
    // Fork `a` into a group of three samples that continue differently.
    let forks: Vec<usize> = (0..2).map(|_| cache.fork_row(ra).unwrap()).collect();
    let got = rows(
        prefill(
            &m,
            &mut cache,
            &[(ra, &[1]), (forks[0], &[2, 3]), (forks[1], &[4])],
            &device,
        )
        .unwrap(),
    );
    let (mut a0, mut a1, mut a2) = (a.clone(), a.clone(), a.clone());
    a0.push(1);
    a1.extend([2, 3]);
    a2.push(4);
    assert_close(
        &got,
        &fresh(&m, &[a0.clone(), a1.clone(), a2.clone()]),
        "forks",
    );
    // Drop `a` and `b`; the forks continue in their new places.
    cache.retain_rows(&[forks[1], forks[0]]).unwrap();
    let got = rows(prefill(&m, &mut cache, &[(0, &[6]), (1, &[7, 8, 9])], &device).unwrap());
    a2.push(6);
    a1.extend([7, 8, 9]);
    assert_close(&got, &fresh(&m, &[a2, a1]), "after drop");
    assert!(cache.memory_bytes() > 0);
}

#[test]
fn growing_past_a_block_keeps_the_cache_exact() {
    let m = model();
    let device = Default::default();
    let mut cache = fathom_model::KvCache::with_block(m.model.layers.len(), 4);
    let row = cache.add_row();
    let mut seq = vec![3u32, 1, 4];
    prefill(&m, &mut cache, &[(row, &seq)], &device).unwrap();
    for t in 0..10u32 {
        let tok = [100 + t];
        let got = rows(prefill(&m, &mut cache, &[(row, &tok)], &device).unwrap());
        seq.push(tok[0]);
        assert_close(&got, &fresh(&m, std::slice::from_ref(&seq)), "decode");
    }
}

#[test]
fn bad_rows_are_errors() {
    let m = model();
    let device = Default::default();
    let mut cache = m.new_cache();
    let row = cache.add_row();
    let err = prefill(&m, &mut cache, &[(row + 1, &[1])], &device).unwrap_err();
    assert!(err.to_string().contains("cache row 1"), "{err}");
    let err = prefill(&m, &mut cache, &[(row, &[1]), (row, &[2])], &device).unwrap_err();
    assert!(err.to_string().contains("twice"), "{err}");
    let err = prefill(&m, &mut cache, &[(row, &[])], &device).unwrap_err();
    assert!(err.to_string().contains("no new tokens"), "{err}");
    let err = prefill(&m, &mut cache, &[(row, &[5000])], &device).unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
}
