//! The GRPO loss and its gradients on a hand-built batch, computed by hand; masking.

use super::*;
use burn::backend::Autodiff;
use fathom_model::Cpu;

type Ad = Autodiff<Cpu>;

const EPS_LOW: f64 = 0.2;
const EPS_HIGH: f64 = 0.28;

fn settings(normalization: LossNormalization, beta: f64) -> LossSettings {
    LossSettings {
        epsilon_low: EPS_LOW,
        epsilon_high: EPS_HIGH,
        beta,
        normalization,
        scale_by_std: true,
    }
}

/// Two episodes, three predicted positions each.
///
/// Row 0 (advantage +0.5): position 0 has ratio e^0.5 ≈ 1.649 > 1.28, clipped high (loss
/// −1.28·0.5, no gradient); position 1 has ratio e^−0.5, unclipped for a positive advantage
/// (loss −r·0.5, gradient −r·0.5); position 2 is an observation token (mask 0).
///
/// Row 1 (advantage −1): position 0 ratio 1 (loss 1, gradient 1); position 1 ratio e^0.4 ≈
/// 1.49, unclipped for a negative advantage (loss r, gradient r); position 2 ratio e^−0.5 <
/// 0.8, clipped low (loss 0.8, no gradient).
fn host() -> HostBatch {
    HostBatch {
        ids: vec![vec![0; 4], vec![0; 4]],
        attention: vec![vec![1; 4], vec![1; 4]],
        loss_mask: vec![1.0, 1.0, 0.0, 1.0, 1.0, 1.0],
        old_logprobs: vec![-1.0, -2.0, 0.0, -1.0, -0.5, -1.5],
        row_tokens: vec![2, 3],
    }
}

const NEW: [f32; 6] = [-0.5, -2.5, -3.0, -1.0, -0.1, -2.0];
const ADV: [f64; 2] = [0.5, -1.0];

/// Per-token loss and d loss_t / d ℓ_t, by hand (see [`host`]).
fn by_hand() -> ([f64; 6], [f64; 6]) {
    let r01 = (-0.5f64).exp();
    let r11 = 0.4f64.exp();
    let loss = [-1.28 * 0.5, -r01 * 0.5, 0.0, 1.0, r11, 0.8];
    let grad = [0.0, -r01 * 0.5, 0.0, 1.0, r11, 0.0];
    (loss, grad)
}

fn run(
    new: [f32; 6],
    reference: Option<[f32; 6]>,
    settings: &LossSettings,
) -> (f64, Vec<f32>, LossStats) {
    let device = Default::default();
    let batch = LossBatch::<Ad>::new(&host(), &ADV, settings.normalization, &device).unwrap();
    let new =
        Tensor::<Ad, 2>::from_data(TensorData::new(new.to_vec(), [2, 3]), &device).require_grad();
    let reference =
        reference.map(|r| Tensor::<Ad, 2>::from_data(TensorData::new(r.to_vec(), [2, 3]), &device));
    let out = policy_loss(new.clone(), &batch, reference, None, settings).unwrap();
    let loss = out.loss.clone().into_scalar() as f64;
    let grads = out.loss.backward();
    let grad = new
        .grad(&grads)
        .unwrap()
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    (loss, grad, out.stats)
}

fn assert_close(got: &[f32], want: &[f64], what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (*g as f64 - w).abs() < 1e-5,
            "{what}[{i}]: got {g}, want {w} ({got:?})"
        );
    }
}

#[test]
fn loss_and_gradients_match_the_hand_computation_for_each_normalisation() {
    let (loss_t, grad_t) = by_hand();
    // Per-token weights of each normalisation: row 0 has 2 loss tokens, row 1 has 3.
    let cases = [
        (LossNormalization::PerSequence, [0.25, 1.0 / 6.0]),
        (LossNormalization::TokenLevel, [0.2, 0.2]),
        (LossNormalization::DrGrpo { max_tokens: 10 }, [0.05, 0.05]),
    ];
    for (normalization, row_weight) in cases {
        let weight = |i: usize| if i < 3 { row_weight[0] } else { row_weight[1] };
        let want_loss: f64 = (0..6).map(|i| loss_t[i] * weight(i)).sum();
        let want_grad: Vec<f64> = (0..6).map(|i| grad_t[i] * weight(i)).collect();
        let (loss, grad, stats) = run(NEW, None, &settings(normalization, 0.0));
        assert!(
            (loss - want_loss).abs() < 1e-5,
            "{normalization:?}: loss {loss}, want {want_loss}"
        );
        assert_close(&grad, &want_grad, &format!("{normalization:?} grad"));
        // One of five loss tokens clipped on each side; the mean ratio over loss tokens.
        assert!((stats.clip_low - 0.2).abs() < 1e-12, "{stats:?}");
        assert!((stats.clip_high - 0.2).abs() < 1e-12, "{stats:?}");
        let ratios = [
            0.5f64.exp(),
            (-0.5f64).exp(),
            1.0,
            0.4f64.exp(),
            (-0.5f64).exp(),
        ];
        let mean = ratios.iter().sum::<f64>() / 5.0;
        assert!((stats.mean_ratio - mean).abs() < 1e-5, "{stats:?}");
        assert_eq!(stats.tokens, 5);
        assert_eq!(stats.kl, None);
    }
}

#[test]
fn the_k3_penalty_adds_its_hand_computed_value_and_gradient() {
    let (loss_t, grad_t) = by_hand();
    let reference: [f32; 6] = [-0.7, -2.0, 5.0, -1.2, -0.1, -1.0];
    let beta = 0.1;
    let s = settings(LossNormalization::TokenLevel, beta);
    let (loss, grad, stats) = run(NEW, Some(reference), &s);
    let mask = host().loss_mask;
    let mut want_loss = 0.0;
    let mut want_grad = [0.0f64; 6];
    let mut kl = 0.0;
    for i in 0..6 {
        if mask[i] == 0.0 {
            continue;
        }
        let d = reference[i] as f64 - NEW[i] as f64;
        let k3 = d.exp() - d - 1.0;
        kl += k3 / 5.0;
        // d k3 / d ℓ = 1 − exp(ℓ_ref − ℓ).
        want_loss += (loss_t[i] + beta * k3) / 5.0;
        want_grad[i] = (grad_t[i] + beta * (1.0 - d.exp())) / 5.0;
    }
    assert!(
        (loss - want_loss).abs() < 1e-5,
        "loss {loss}, want {want_loss}"
    );
    assert_close(&grad, &want_grad, "grad");
    assert!((stats.kl.unwrap() - kl).abs() < 1e-5, "{stats:?}");
    // β = 0 with a reference: the KL is reported but not added.
    let (loss0, _, stats0) = run(
        NEW,
        Some(reference),
        &settings(LossNormalization::TokenLevel, 0.0),
    );
    let plain: f64 = loss_t.iter().map(|l| l / 5.0).sum();
    assert!((loss0 - plain).abs() < 1e-5);
    assert!(stats0.kl.is_some());
}

#[test]
fn masked_tokens_change_neither_loss_nor_gradients() {
    for normalization in [
        LossNormalization::PerSequence,
        LossNormalization::TokenLevel,
        LossNormalization::DrGrpo { max_tokens: 7 },
    ] {
        let s = settings(normalization, 0.3);
        let reference: [f32; 6] = [-0.7, -2.0, 0.0, -1.2, -0.1, -1.0];
        let (loss, grad, stats) = run(NEW, Some(reference), &s);
        // Position 2 (an observation token) gets absurd values: far off-policy, far from
        // the reference (exp would overflow), and not even finite.
        for wild in [-1e4f32, 90.0, f32::NAN] {
            let mut new = NEW;
            new[2] = wild;
            let mut r = reference;
            r[2] = 80.0;
            let (l2, g2, s2) = run(new, Some(r), &s);
            assert_eq!(loss.to_bits(), l2.to_bits(), "{normalization:?} {wild}");
            assert_eq!(grad, g2, "{normalization:?} {wild}");
            assert_eq!(stats, s2);
            assert_eq!(g2[2], 0.0);
        }
    }
}

#[test]
fn advantages_normalise_groups_and_report_flat_ones() {
    let rewards = [1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 0.3, 0.3];
    let a = group_advantages(&rewards, 4, true).unwrap();
    // Group 0: mean 0.5, sample std sqrt(1/3).
    let std = (1.0f64 / 3.0).sqrt();
    let want = 0.5 / (std + STD_EPS);
    assert!((a.values[0] - want).abs() < 1e-12);
    assert!((a.values[1] + want).abs() < 1e-12);
    assert_eq!(&a.values[4..], &[0.0; 4]);
    assert_eq!(a.zero_variance, vec![false, true]);
    assert_eq!(a.zero_variance_fraction(), 0.5);
    let unscaled = group_advantages(&rewards, 4, false).unwrap();
    assert_eq!(&unscaled.values[..4], &[0.5, -0.5, -0.5, 0.5]);
    assert!(matches!(
        group_advantages(&rewards, 3, true),
        Err(GrpoError::Groups { .. })
    ));
    assert!(group_advantages(&[], 2, true).is_err());
}

#[test]
fn host_batch_shifts_and_pads() {
    let a = Sample {
        ids: vec![10, 11, 12, 13],
        sampled: vec![false, true, false, true],
        logprobs: vec![0.0, -0.5, 0.0, -0.7],
    };
    let b = Sample {
        ids: vec![20, 21],
        sampled: vec![false, true],
        logprobs: vec![0.0, -0.1],
    };
    let batch = host_batch(&[&a, &b], 0).unwrap();
    assert_eq!(batch.ids, vec![vec![10, 11, 12, 13], vec![20, 21, 0, 0]]);
    assert_eq!(batch.attention, vec![vec![1, 1, 1, 1], vec![1, 1, 0, 0]]);
    assert_eq!(batch.loss_mask, vec![1.0, 0.0, 1.0, 1.0, 0.0, 0.0]);
    assert_eq!(batch.old_logprobs, vec![-0.5, 0.0, -0.7, -0.1, 0.0, 0.0]);
    assert_eq!(batch.row_tokens, vec![2, 1]);
    let bad = Sample {
        ids: vec![1, 2],
        sampled: vec![true, true],
        logprobs: vec![0.0, 0.0],
    };
    let err = host_batch(&[&a, &bad], 0).unwrap_err().to_string();
    assert!(
        err.contains("sample 1") && err.contains("first token"),
        "{err}"
    );
    let short = Sample {
        ids: vec![1, 2, 3],
        sampled: vec![false, true],
        logprobs: vec![0.0, 0.0, 0.0],
    };
    assert!(host_batch(&[&short], 0).is_err());
}

#[test]
fn shape_errors_are_reported() {
    let device = Default::default();
    let batch =
        LossBatch::<Ad>::new(&host(), &ADV, LossNormalization::TokenLevel, &device).unwrap();
    let wrong = Tensor::<Ad, 2>::zeros([2, 4], &device);
    let s = settings(LossNormalization::TokenLevel, 0.0);
    let err = policy_loss(wrong, &batch, None, None, &s).unwrap_err();
    assert!(err.to_string().contains("new_logprobs"), "{err}");
    let new = Tensor::<Ad, 2>::zeros([2, 3], &device);
    let s = settings(LossNormalization::TokenLevel, 0.1);
    assert!(policy_loss(new, &batch, None, None, &s).is_err());
    assert!(LossBatch::<Ad>::new(&host(), &[1.0], LossNormalization::TokenLevel, &device).is_err());
}

/// Episodes whose recorded log-probabilities are the learner's own: after right-padding into
/// a batch, the learner's log-probabilities line up with them (ratio 1 on every loss token).
#[test]
fn the_batch_lines_up_with_the_learners_log_probabilities() {
    use fathom_model::{Qwen2Config, Qwen2ForCausalLM, sequence_logprobs};
    let device = Default::default();
    let model = Qwen2ForCausalLM::<Ad>::random(
        Qwen2Config::with_shape(48, 16, 32, 2, 4, 2),
        4,
        false,
        &device,
    );
    let episode = |ids: Vec<u32>, sampled: Vec<bool>| {
        let mask = vec![vec![1u8; ids.len()]];
        let lp: Vec<f32> =
            sequence_logprobs(&model, std::slice::from_ref(&ids), &mask, 1.0, &device)
                .unwrap()
                .into_data()
                .to_vec()
                .unwrap();
        let logprobs = (0..ids.len())
            .map(|t| if t > 0 && sampled[t] { lp[t - 1] } else { 0.0 })
            .collect();
        Sample {
            ids,
            sampled,
            logprobs,
        }
    };
    // Prompt, sampled turn, observation, sampled answer.
    let a = episode(
        vec![1, 2, 3, 10, 11, 12, 20, 21, 30, 31],
        vec![
            false, false, false, true, true, true, false, false, true, true,
        ],
    );
    let b = episode(vec![4, 5, 40, 41, 42], vec![false, false, true, true, true]);
    let host = host_batch(&[&a, &b], 0).unwrap();
    let batch =
        LossBatch::<Ad>::new(&host, &[0.7, -0.7], LossNormalization::PerSequence, &device).unwrap();
    let new = sequence_logprobs(&model, &host.ids, &host.attention, 1.0, &device).unwrap();
    let out = policy_loss(
        new,
        &batch,
        None,
        None,
        &settings(LossNormalization::PerSequence, 0.0),
    )
    .unwrap();
    assert!((out.stats.mean_ratio - 1.0).abs() < 1e-5, "{:?}", out.stats);
    assert_eq!((out.stats.clip_low, out.stats.clip_high), (0.0, 0.0));
    assert_eq!(out.stats.tokens, 8);
    // At ratio 1 the loss is −Σ_b A_b · (n_b / n_b) / B = −(0.7 − 0.7) / 2 = 0.
    assert!((out.loss.into_scalar() as f64).abs() < 1e-6);
}

#[test]
fn the_rows_of_a_partition_add_up_to_the_whole_batch() {
    let device = Default::default();
    for normalization in [
        LossNormalization::TokenLevel,
        LossNormalization::PerSequence,
        LossNormalization::DrGrpo { max_tokens: 5 },
    ] {
        let s = settings(normalization, 0.0);
        let (whole_loss, whole_grad, whole_stats) = run(NEW, None, &s);
        let batch = LossBatch::<Ad>::new(&host(), &ADV, normalization, &device).unwrap();
        let (mut loss, mut grad, mut stats) = (0f64, Vec::new(), Vec::new());
        for row in 0..2 {
            let part = batch.rows(row..row + 1);
            assert_eq!(part.dims(), [1, 3]);
            let new = Tensor::<Ad, 2>::from_data(
                TensorData::new(NEW[row * 3..row * 3 + 3].to_vec(), [1, 3]),
                &device,
            )
            .require_grad();
            let out = policy_loss(new.clone(), &part, None, None, &s).unwrap();
            loss += out.loss.clone().into_scalar() as f64;
            let grads = out.loss.backward();
            grad.extend(
                new.grad(&grads)
                    .unwrap()
                    .into_data()
                    .to_vec::<f32>()
                    .unwrap(),
            );
            stats.push(out.stats);
        }
        assert!((loss - whole_loss).abs() < 1e-6, "{loss} vs {whole_loss}");
        let want: Vec<f64> = whole_grad.iter().map(|g| *g as f64).collect();
        assert_close(&grad, &want, "gradient of the parts");
        let merged = LossStats::merge(&stats);
        assert_eq!(merged.tokens, whole_stats.tokens);
        for (got, want) in [
            (merged.clip_low, whole_stats.clip_low),
            (merged.clip_high, whole_stats.clip_high),
            (merged.mean_ratio, whole_stats.mean_ratio),
        ] {
            assert!((got - want).abs() < 1e-9, "{merged:?} vs {whole_stats:?}");
        }
    }
}

#[test]
#[should_panic(expected = "rows 1..3 of a batch of 2")]
fn rows_past_the_batch_are_refused() {
    let batch = LossBatch::<Ad>::new(
        &host(),
        &ADV,
        LossNormalization::TokenLevel,
        &Default::default(),
    )
    .unwrap();
    let _ = batch.rows(1..3);
}
