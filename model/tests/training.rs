//! The training path against plain burn operations: the custom autodiff operations (NF4 and
//! dense projections, attention, SwiGLU, chunked log-probabilities) give the values and gradients of
//! the straightforward computations they replace, per-layer checkpointing gives the gradients
//! of the ordinary backward pass, attention matches a naive host implementation, and full
//! fine-tuning gives every weight the gradient central differences measure; scoring only some
//! tokens gives those tokens the values and gradients of scoring all; the gradients of passes
//! over parts of a batch add up to one pass over all of it.

use burn::backend::Autodiff;
use burn::module::{AutodiffModule, Module, ModuleMapper, Param};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData, TensorPrimitive};
use fathom_model::backend::{Heads, ModelBackend, Span, reference};
use fathom_model::linear::Nf4Weight;
use fathom_model::lora::init_rng;
use fathom_model::{
    Cpu, LoraSettings, Qwen2Config, Qwen2ForCausalLM, SequenceLogprobs, Target, TrainPass,
    add_gradients, forward_backward, forward_backward_scored, packed_logprobs,
};

type Ad = Autodiff<Cpu>;

fn float<B: burn::tensor::backend::Backend, const D: usize>(
    t: burn::tensor::ops::FloatTensor<B>,
) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

fn prim<B: burn::tensor::backend::Backend, const D: usize>(
    t: Tensor<B, D>,
) -> burn::tensor::ops::FloatTensor<B> {
    t.into_primitive().tensor()
}

fn values<B: burn::tensor::backend::Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn seeded(shape: [usize; 2], seed: u64) -> Tensor<Ad, 2> {
    let n = shape[0] * shape[1];
    let v: Vec<f32> = (0..n)
        .map(|i| ((((i as u64 + 1) * (seed * 2654435761 + 97)) % 2001) as f32 / 1000.0) - 1.0)
        .collect();
    Tensor::from_data(TensorData::new(v, shape), &Default::default())
}

#[test]
fn swiglu_op_values_and_gradients_equal_burns_silu_times_up() {
    // Values spread over [-4, 4], plus a column far outside exp's range.
    let scale = |t: Tensor<Ad, 2>| t * 4.0;
    let (gate, up, r) = (
        scale(seeded([37, 29], 5)),
        seeded([37, 29], 6),
        seeded([37, 29], 7),
    );
    let gate = Tensor::cat(
        vec![gate, Tensor::full([37, 1], 120.0, &Default::default())],
        1,
    );
    let gate = Tensor::cat(
        vec![gate, Tensor::full([37, 1], -120.0, &Default::default())],
        1,
    );
    let up = Tensor::cat(vec![up, seeded([37, 2], 8)], 1);
    let r = Tensor::cat(vec![r, seeded([37, 2], 9)], 1);
    let run = |custom: bool| {
        let (g, u) = (gate.clone().require_grad(), up.clone().require_grad());
        let out: Tensor<Ad, 2> = if custom {
            float(Ad::swiglu(prim(g.clone()), prim(u.clone())))
        } else {
            burn::tensor::activation::silu(g.clone()) * u.clone()
        };
        let grads = (out.clone() * r.clone()).sum().backward();
        [
            values(out),
            values(g.grad(&grads).unwrap()),
            values(u.grad(&grads).unwrap()),
        ]
    };
    let (custom, plain) = (run(true), run(false));
    for (name, (a, b)) in ["value", "d_gate", "d_up"]
        .iter()
        .zip(custom.iter().zip(&plain))
    {
        assert!(a.iter().all(|v| v.is_finite()), "{name} is not finite");
        let diff = max_diff(a, b);
        assert!(diff < 1e-5 * 120.0, "{name}: {diff}");
    }
    // The default (burn's operations, what GPU backends run) against the host loop.
    let (gi, ui, ri) = (gate.clone().inner(), up.clone().inner(), r.clone().inner());
    let host = values(float::<Cpu, 2>(Cpu::swiglu(
        prim(gi.clone()),
        prim(ui.clone()),
    )));
    let default = values(float::<Cpu, 2>(reference::swiglu::<Cpu>(
        prim(gi.clone()),
        prim(ui.clone()),
    )));
    assert!(max_diff(&host, &default) < 1e-5 * 120.0);
    let (dg, du) = Cpu::swiglu_backward(prim(gi.clone()), prim(ui.clone()), prim(ri.clone()));
    let (rg, ru) = reference::swiglu_backward::<Cpu>(prim(gi), prim(ui), prim(ri));
    assert!(max_diff(&values(float::<Cpu, 2>(dg)), &values(float::<Cpu, 2>(rg))) < 1e-5);
    assert!(max_diff(&values(float::<Cpu, 2>(du)), &values(float::<Cpu, 2>(ru))) < 1e-5 * 120.0);
}

#[test]
fn nf4_op_gradient_equals_dequantize_then_matmul() {
    let device = Default::default();
    let (rows, cols, m) = (40, 160, 7);
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 70.0)
        .collect();
    let nf4 = Nf4Weight::<Ad>::quantize(&w, rows, cols, &device);
    let dense = nf4.dequantize(); // a constant [rows, cols]
    let r = seeded([m, rows], 3);
    let x = seeded([m, cols], 5).require_grad();
    let y_op = float::<Ad, 2>(Ad::nf4_linear(
        prim(x.clone()),
        nf4.codes.clone().into_primitive(),
        prim(nf4.absmax.clone()),
        prim(nf4.table.clone()),
        rows,
        cols,
    ));
    let g_op = x
        .grad(&(y_op.clone() * r.clone()).sum().backward())
        .unwrap();
    let x2 = seeded([m, cols], 5).require_grad();
    let y_ref = x2.clone().matmul(dense.transpose());
    let g_ref = x2.grad(&(y_ref.clone() * r).sum().backward()).unwrap();
    assert!(max_diff(&values(y_op), &values(y_ref)) < 1e-4);
    assert!(max_diff(&values(g_op), &values(g_ref)) < 1e-4);
}

#[test]
fn dense_op_gradients_cover_a_trainable_weight_and_bf16_weights() {
    let (rows, cols, m) = (24, 40, 5);
    let r = seeded([m, rows], 7);
    // A trainable f32 weight: gradients for the input and the weight.
    let x = seeded([m, cols], 1).require_grad();
    let w = seeded([rows, cols], 2).require_grad();
    let y = float::<Ad, 2>(Ad::dense_linear(prim(x.clone()), prim(w.clone())));
    let grads = (y * r.clone()).sum().backward();
    let (gx, gw) = (x.grad(&grads).unwrap(), w.grad(&grads).unwrap());
    let x2 = seeded([m, cols], 1).require_grad();
    let w2 = seeded([rows, cols], 2).require_grad();
    let grads2 = (x2.clone().matmul(w2.clone().transpose()) * r.clone())
        .sum()
        .backward();
    assert!(max_diff(&values(gx), &values(x2.grad(&grads2).unwrap())) < 1e-4);
    assert!(max_diff(&values(gw), &values(w2.grad(&grads2).unwrap())) < 1e-4);
    // A frozen bf16 weight (as the tied embedding is kept): the host kernel widens tiles.
    let w16 = seeded([rows, cols], 2).cast(burn::tensor::DType::BF16);
    let x3 = seeded([m, cols], 1).require_grad();
    let y3 = float::<Ad, 2>(Ad::dense_linear(prim(x3.clone()), prim(w16.clone())));
    let g3 = x3.grad(&(y3.clone() * r.clone()).sum().backward()).unwrap();
    let w32 = w16.cast(burn::tensor::DType::F32);
    let x4 = seeded([m, cols], 1).require_grad();
    let y4 = x4.clone().matmul(w32.transpose());
    let g4 = x4.grad(&(y4.clone() * r).sum().backward()).unwrap();
    assert!(max_diff(&values(y3), &values(y4)) < 1e-4);
    assert!(max_diff(&values(g3), &values(g4)) < 1e-4);
}

/// Naive causal grouped-query attention on the host, one query at a time.
fn naive_attention(q: &[f32], k: &[f32], v: &[f32], spans: &[Span], h: Heads) -> Vec<f32> {
    let (d, hq, hk) = (h.head_dim, h.heads * h.head_dim, h.kv_heads * h.head_dim);
    let mut out = vec![0f32; q.len()];
    for s in spans {
        for t in 0..s.len {
            for head in 0..h.heads {
                let g = head / h.group();
                let qrow = &q[(s.start + t) * hq + head * d..][..d];
                let scores: Vec<f64> = (0..=t)
                    .map(|j| {
                        let krow = &k[(s.start + j) * hk + g * d..][..d];
                        qrow.iter()
                            .zip(krow)
                            .map(|(a, b)| (a * b) as f64)
                            .sum::<f64>()
                            * h.scale()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let z: f64 = e.iter().sum();
                for c in 0..d {
                    let acc: f64 = (0..=t)
                        .map(|j| e[j] / z * v[(s.start + j) * hk + g * d + c] as f64)
                        .sum();
                    out[(s.start + t) * hq + head * d + c] = acc as f32;
                }
            }
        }
    }
    out
}

#[test]
fn packed_attention_matches_naive_and_its_backward_matches_autodiff() {
    let heads = Heads {
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
    };
    let spans = [
        Span { start: 0, len: 5 },
        Span { start: 5, len: 40 },
        Span { start: 45, len: 1 },
    ];
    let n = 46;
    let q = seeded([n, 32], 11);
    let k = seeded([n, 16], 12);
    let v = seeded([n, 16], 13);
    let r = seeded([n, 32], 14);
    // Forward against the naive host version; small blocks so several blocks per sequence.
    for budget in [usize::MAX, 4 * 40 * 16, 4 * 40 * 3] {
        let (out, _) = reference::packed_attention_with_budget::<Cpu>(
            prim(q.clone().inner()),
            prim(k.clone().inner()),
            prim(v.clone().inner()),
            &spans,
            heads,
            budget,
        );
        let want = naive_attention(
            &values(q.clone()),
            &values(k.clone()),
            &values(v.clone()),
            &spans,
            heads,
        );
        let diff = max_diff(&values(float::<Cpu, 2>(out)), &want);
        assert!(diff < 1e-5, "budget {budget}: {diff}");
    }
    // The custom op's gradients against burn's autodiff through the same computation.
    let grads_of = |custom: bool| {
        let (q, k, v) = (
            q.clone().require_grad(),
            k.clone().require_grad(),
            v.clone().require_grad(),
        );
        let out = if custom {
            Ad::packed_attention(
                prim(q.clone()),
                prim(k.clone()),
                prim(v.clone()),
                &spans,
                heads,
            )
            .0
        } else {
            reference::packed_attention::<Ad>(
                prim(q.clone()),
                prim(k.clone()),
                prim(v.clone()),
                &spans,
                heads,
            )
            .0
        };
        let grads = (float::<Ad, 2>(out) * r.clone()).sum().backward();
        [q.grad(&grads), k.grad(&grads), v.grad(&grads)].map(|g| values(g.unwrap()))
    };
    let (custom, plain) = (grads_of(true), grads_of(false));
    for (name, (a, b)) in ["q", "k", "v"].iter().zip(custom.iter().zip(&plain)) {
        let diff = max_diff(a, b);
        assert!(diff < 1e-5, "d{name}: {diff}");
    }
    // The blocked backward pass, with several blocks per sequence, gives the same gradients.
    let (qi, ki, vi) = (q.clone().inner(), k.clone().inner(), v.clone().inner());
    let (out, lse) = reference::packed_attention::<Cpu>(
        prim(qi.clone()),
        prim(ki.clone()),
        prim(vi.clone()),
        &spans,
        heads,
    );
    for budget in [4 * 40 * 16, 4 * 40 * 3] {
        let (dq, dk, dv) = reference::attention_backward_with_budget::<Cpu>(
            prim(qi.clone()),
            prim(ki.clone()),
            prim(vi.clone()),
            out.clone(),
            lse.clone(),
            prim(r.clone().inner()),
            &spans,
            heads,
            budget,
        );
        for (name, (got, want)) in ["q", "k", "v"]
            .iter()
            .zip([dq, dk, dv].into_iter().zip(&plain))
        {
            let diff = max_diff(&values(float::<Cpu, 2>(got)), want);
            assert!(diff < 1e-5, "budget {budget}, d{name}: {diff}");
        }
    }
}

/// The CPU backend's host attention kernels (`backend::attention`) against the naive version and
/// the reference built from tensor operations: packed sequences (output and log-sum-exp), and
/// cached sequences read in place from views of larger buffers, as the KV cache hands them out.
#[test]
fn cpu_attention_kernel_matches_naive_and_reference() {
    let heads = Heads {
        heads: 6,
        kv_heads: 2,
        head_dim: 8,
    };
    let spans = [
        Span { start: 0, len: 70 },
        Span { start: 70, len: 1 },
        Span { start: 71, len: 9 },
    ];
    let n = 80;
    let q = seeded([n, 48], 21).inner();
    let k = seeded([n, 16], 22).inner();
    let v = seeded([n, 16], 23).inner();
    let (out, lse) = Cpu::packed_attention(
        prim(q.clone()),
        prim(k.clone()),
        prim(v.clone()),
        &spans,
        heads,
    );
    let (want_out, want_lse) = reference::packed_attention::<Cpu>(
        prim(q.clone()),
        prim(k.clone()),
        prim(v.clone()),
        &spans,
        heads,
    );
    let out = values(float::<Cpu, 2>(out));
    let naive = naive_attention(
        &values(q.clone()),
        &values(k.clone()),
        &values(v.clone()),
        &spans,
        heads,
    );
    assert!(max_diff(&out, &naive) < 1e-5, "against naive");
    assert!(
        max_diff(&out, &values(float::<Cpu, 2>(want_out))) < 1e-5,
        "against reference"
    );
    let diff = max_diff(
        &values(float::<Cpu, 2>(lse)),
        &values(float::<Cpu, 2>(want_lse)),
    );
    assert!(diff < 1e-5, "log-sum-exp: {diff}");
    // Cached: each sequence's keys and values are the first positions of a larger
    // [kv_heads, capacity, head_dim] buffer; the new queries are its last `len` positions.
    let capacity = 96;
    let cache = |seed: u64| {
        seeded([2 * capacity, 8], seed)
            .inner()
            .reshape([2, capacity, 8])
    };
    let (kc, vc) = (cache(24), cache(25));
    let lens = [(40, 1), (33, 4), (7, 7)]; // (positions cached including the new ones, new)
    let mut start = 0;
    let mut cached_spans = Vec::new();
    let mut kv = Vec::new();
    for &(positions, new) in &lens {
        cached_spans.push(Span { start, len: new });
        start += new;
        kv.push((
            kc.clone().narrow(1, 0, positions),
            vc.clone().narrow(1, 0, positions),
        ));
    }
    let q = seeded([start, 48], 26).inner();
    let prims = |kv: &[(Tensor<Cpu, 3>, Tensor<Cpu, 3>)]| {
        kv.iter()
            .map(|(k, v)| (prim(k.clone()), prim(v.clone())))
            .collect::<Vec<_>>()
    };
    let got = Cpu::cached_attention(prim(q.clone()), prims(&kv), &cached_spans, heads);
    let want = reference::cached_attention::<Cpu>(prim(q), prims(&kv), &cached_spans, heads);
    let diff = max_diff(
        &values(float::<Cpu, 2>(got)),
        &values(float::<Cpu, 2>(want)),
    );
    assert!(diff < 1e-5, "cached: {diff}");
    // The backward pass against the reference's, from the same saved output and log-sum-exp.
    let q = seeded([n, 48], 27).inner();
    let k = seeded([n, 16], 28).inner();
    let v = seeded([n, 16], 29).inner();
    let dout = seeded([n, 48], 30).inner();
    let (out, lse) = reference::packed_attention::<Cpu>(
        prim(q.clone()),
        prim(k.clone()),
        prim(v.clone()),
        &spans,
        heads,
    );
    let args = || {
        (
            prim(q.clone()),
            prim(k.clone()),
            prim(v.clone()),
            out.clone(),
            lse.clone(),
            prim(dout.clone()),
        )
    };
    let (a, b, c, d, e, f) = args();
    let got = Cpu::attention_backward(a, b, c, d, e, f, &spans, heads);
    let (a, b, c, d, e, f) = args();
    let want = reference::attention_backward::<Cpu>(a, b, c, d, e, f, &spans, heads);
    let pairs = [(got.0, want.0), (got.1, want.1), (got.2, want.2)];
    for (name, (g, w)) in ["dq", "dk", "dv"].iter().zip(pairs) {
        let diff = max_diff(&values(float::<Cpu, 2>(g)), &values(float::<Cpu, 2>(w)));
        assert!(diff < 1e-5, "{name}: {diff}");
    }
}

fn tiny_config(tied: bool) -> Qwen2Config {
    let mut c = Qwen2Config::with_shape(48, 16, 24, 2, 4, 2);
    c.tie_word_embeddings = tied;
    c
}

/// Sets every `lora_b` to small non-zero values, so every adapter parameter has a gradient.
struct NudgeB;
impl ModuleMapper<Ad> for NudgeB {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<Ad, D>>) -> Param<Tensor<Ad, D>> {
        let (id, t, mapper) = param.consume();
        let dims = t.dims();
        let is_b = D == 2 && dims[1] == 2;
        let t = if is_b {
            let n: usize = dims.iter().product();
            let v: Vec<f32> = (0..n).map(|i| ((i * 7 % 5) as f32 - 2.0) * 0.1).collect();
            Tensor::<Ad, D>::from_data(TensorData::new(v, dims), &t.device()).require_grad()
        } else {
            t
        };
        Param::from_mapped_value(id, t, mapper)
    }
}

fn lora_model(tied: bool, nf4: bool) -> Qwen2ForCausalLM<Ad> {
    let device = Default::default();
    let settings = LoraSettings {
        rank: 2,
        alpha: 4.0,
        dropout: 0.0,
        rslora: false,
        targets: Target::ALL.to_vec(),
    };
    Qwen2ForCausalLM::<Ad>::random(tiny_config(tied), 21, nf4, &device)
        .attach_lora(&settings, &mut init_rng(3), &device)
        .map(&mut NudgeB)
}

/// Every adapter gradient, in parameter order.
fn lora_grads(model: &Qwen2ForCausalLM<Ad>, grads: &burn::optim::GradientsParams) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    for (_, p) in model.projections() {
        if let Some(l) = &p.lora {
            for param in [&l.lora_a, &l.lora_b] {
                let g = grads
                    .get::<Cpu, 2>(param.id)
                    .expect("every adapter parameter has a gradient");
                out.push(values(g));
            }
        }
    }
    out
}

const SEQS: [&[u32]; 3] = [&[1, 5, 9, 2, 7, 30, 44, 3], &[3, 3, 8], &[47, 0, 12, 19, 6]];

/// `Σ w_i · logp_i + 0.1 · Σ entropy_i` with position-dependent weights.
fn weighted(out: &fathom_model::SequenceLogprobs<Ad>) -> (Tensor<Ad, 1>, ()) {
    let n = out.logprobs.dims()[0];
    let w: Vec<f32> = (0..n).map(|i| 1.0 + (i % 3) as f32).collect();
    let w = Tensor::<Ad, 1>::from_data(TensorData::new(w, [n]), &Default::default());
    (
        (out.logprobs.clone() * w).sum() + out.entropy.clone().sum().mul_scalar(0.1),
        (),
    )
}

#[test]
fn chunked_logprobs_and_entropy_equal_the_unchunked_computation() {
    for (tied, nf4) in [(true, false), (false, true)] {
        let device = Default::default();
        let model = lora_model(tied, nf4);
        // Unchunked: full logits, log_softmax, gather, entropy — plain burn operations.
        let input = model.packed_input(&SEQS, &device).unwrap();
        let logits = model
            .logits(model.forward_hidden(&input, None))
            .div_scalar(0.7);
        let logp_all = log_softmax(logits, 1);
        let mut rows = Vec::new();
        let mut targets = Vec::new();
        let mut start = 0;
        for s in SEQS {
            rows.extend((start..start + s.len() - 1).map(|r| r as i64));
            targets.extend(s[1..].iter().map(|&t| t as i64));
            start += s.len();
        }
        let m = rows.len();
        let rows = Tensor::<Ad, 1, Int>::from_data(TensorData::new(rows, [m]), &device);
        let picked = logp_all.select(0, rows);
        let t = Tensor::<Ad, 2, Int>::from_data(TensorData::new(targets, [m, 1]), &device);
        let logp = picked.clone().gather(1, t).reshape([m]);
        let entropy = (picked.clone().exp() * picked)
            .sum_dim(1)
            .neg()
            .reshape([m]);
        let plain = fathom_model::SequenceLogprobs {
            logprobs: logp,
            entropy,
            offsets: vec![],
        };
        let (loss_plain, _) = weighted(&plain);
        let plain_grads = burn::optim::GradientsParams::from_grads(loss_plain.backward(), &model);
        for chunk in [1, 4, 1000] {
            let out = packed_logprobs(&model, &SEQS, 0.7, chunk, &device).unwrap();
            assert_eq!(out.offsets, vec![0, 7, 9, 13]);
            let lp_diff = max_diff(
                &values(out.logprobs.clone()),
                &values(plain.logprobs.clone()),
            );
            let ent_diff = max_diff(&values(out.entropy.clone()), &values(plain.entropy.clone()));
            assert!(
                lp_diff < 1e-5 && ent_diff < 1e-5,
                "chunk {chunk}: {lp_diff} {ent_diff}"
            );
            let (loss, _) = weighted(&out);
            let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &model);
            for (a, b) in lora_grads(&model, &grads)
                .iter()
                .zip(lora_grads(&model, &plain_grads))
            {
                let diff = max_diff(a, &b);
                assert!(diff < 1e-4, "tied {tied} nf4 {nf4} chunk {chunk}: {diff}");
            }
        }
    }
}

#[test]
fn checkpointing_gives_the_ordinary_gradients() {
    let device = Default::default();
    for nf4 in [false, true] {
        let model = lora_model(true, nf4);
        let run = |checkpointing: bool| {
            let pass = TrainPass {
                checkpointing,
                chunk: 3,
                temperature: 1.0,
                share_prefix: 0,
            };
            forward_backward(&model, &SEQS, pass, &device, weighted).unwrap()
        };
        let (plain, ckpt) = (run(false), run(true));
        assert!(
            (plain.loss - ckpt.loss).abs() < 1e-4,
            "{} vs {}",
            plain.loss,
            ckpt.loss
        );
        let (a, b) = (
            lora_grads(&model, &plain.grads),
            lora_grads(&model, &ckpt.grads),
        );
        assert_eq!(a.len(), 2 * 7 * 2);
        for (x, y) in a.iter().zip(&b) {
            assert!(max_diff(x, y) < 1e-5, "nf4 {nf4}: {}", max_diff(x, y));
        }
        assert!(
            a.iter().flatten().any(|g| g.abs() > 1e-4),
            "gradients are not all zero"
        );
    }
}

/// Every gradient in `grads` of the parameters `model` visits, by module path.
struct AllGrads<'a> {
    grads: &'a burn::optim::GradientsParams,
    path: Vec<String>,
    out: Vec<(String, burn::module::ParamId, Vec<f32>)>,
}

impl burn::module::ModuleVisitor<Ad> for AllGrads<'_> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Ad, D>>) {
        let g = self
            .grads
            .get::<Cpu, D>(param.id)
            .unwrap_or_else(|| panic!("`{}` has no gradient", self.path.join(".")));
        self.out.push((self.path.join("."), param.id, values(g)));
    }
}

fn all_grads(
    model: &Qwen2ForCausalLM<Ad>,
    grads: &burn::optim::GradientsParams,
) -> Vec<(String, burn::module::ParamId, Vec<f32>)> {
    let mut v = AllGrads {
        grads,
        path: Vec::new(),
        out: Vec::new(),
    };
    model.visit(&mut v);
    v.out
}

/// Adds `delta` to element `index` of the parameter `id`.
struct Nudge {
    id: burn::module::ParamId,
    index: usize,
    delta: f32,
}

impl ModuleMapper<Cpu> for Nudge {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<Cpu, D>>) -> Param<Tensor<Cpu, D>> {
        if param.id != self.id {
            return param;
        }
        let (id, t, mapper) = param.consume();
        let dims = t.dims();
        let mut v = values(t.clone());
        v[self.index] += self.delta;
        let t = Tensor::<Cpu, D>::from_data(TensorData::new(v, dims), &t.device());
        Param::from_mapped_value(id, t, mapper)
    }
}

/// `weighted`'s value on the inner backend.
fn weighted_value(model: &Qwen2ForCausalLM<Cpu>) -> f64 {
    let out = packed_logprobs(model, &SEQS, 1.0, 3, &Default::default()).unwrap();
    let (lp, ent) = (values(out.logprobs), values(out.entropy));
    let weighted: f64 = lp
        .iter()
        .enumerate()
        .map(|(i, v)| (1.0 + (i % 3) as f64) * *v as f64)
        .sum();
    weighted + 0.1 * ent.iter().map(|v| *v as f64).sum::<f64>()
}

#[test]
fn full_fine_tuning_gives_every_weight_its_gradient() {
    let device = Default::default();
    for tied in [true, false] {
        let model = Qwen2ForCausalLM::<Ad>::random(tiny_config(tied), 21, false, &device)
            .into_full_tuning()
            .unwrap();
        assert_eq!(model.num_trainable(), model.num_weights());
        let run = |checkpointing: bool| {
            let pass = TrainPass {
                checkpointing,
                chunk: 3,
                temperature: 1.0,
                share_prefix: 0,
            };
            forward_backward(&model, &SEQS, pass, &device, weighted).unwrap()
        };
        let (plain, ckpt) = (run(false), run(true));
        let (a, b) = (
            all_grads(&model, &plain.grads),
            all_grads(&model, &ckpt.grads),
        );
        // Embedding, 2 × (2 norms, 7 projections, 3 biases), final norm, and an untied head.
        assert_eq!(a.len(), 1 + 2 * 12 + 1 + usize::from(!tied));
        for ((path, _, x), (_, _, y)) in a.iter().zip(&b) {
            assert!(
                max_diff(x, y) < 1e-4,
                "tied {tied}: `{path}` differs with checkpointing by {}",
                max_diff(x, y)
            );
        }
        // Central differences on the inner model, for one element of each kind of weight.
        let inner = model.valid();
        let probes = [
            ("model.embed_tokens.blocks", 5 * 16 + 3),
            ("model.norm.weight", 2),
            ("model.layers.0.input_layernorm.weight", 7),
            ("model.layers.1.post_attention_layernorm.weight", 11),
            ("model.layers.1.self_attn.q_proj.bias", 4),
            ("model.layers.0.self_attn.v_proj.weight", 17),
            ("model.layers.1.mlp.down_proj.weight", 3 * 24 + 5),
            ("lm_head.weight", 9 * 16 + 1),
        ];
        for (path, index) in probes {
            let Some((_, id, grad)) = a.iter().find(|(p, _, _)| p.starts_with(path)) else {
                assert!(tied && path == "lm_head.weight", "`{path}` not found");
                continue;
            };
            let eps = 1e-2;
            let at = |delta: f32| {
                weighted_value(&inner.clone().map(&mut Nudge {
                    id: *id,
                    index,
                    delta,
                }))
            };
            let numeric = (at(eps) - at(-eps)) / (2.0 * eps as f64);
            let analytic = grad[index] as f64;
            assert!(
                (numeric - analytic).abs() < 2e-2 + 0.05 * analytic.abs(),
                "tied {tied}: `{path}`[{index}]: analytic {analytic}, numeric {numeric}"
            );
        }
    }
}

#[test]
fn full_fine_tuning_refuses_nf4_and_adapters() {
    let device = Default::default();
    let nf4 = Qwen2ForCausalLM::<Ad>::random(tiny_config(true), 21, true, &device);
    let err = nf4.into_full_tuning().unwrap_err().to_string();
    assert!(err.contains("NF4") && err.contains("q_proj"), "{err}");
    let err = lora_model(true, false)
        .into_full_tuning()
        .unwrap_err()
        .to_string();
    assert!(err.contains("LoRA"), "{err}");
}

#[test]
fn checkpointing_refuses_lora_dropout() {
    let device = Default::default();
    let settings = LoraSettings {
        rank: 2,
        alpha: 4.0,
        dropout: 0.1,
        rslora: false,
        targets: vec![Target::QProj],
    };
    let model = Qwen2ForCausalLM::<Ad>::random(tiny_config(true), 1, false, &device).attach_lora(
        &settings,
        &mut init_rng(1),
        &device,
    );
    let pass = TrainPass {
        checkpointing: true,
        ..TrainPass::default()
    };
    let err = forward_backward(&model, &SEQS, pass, &device, weighted)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("dropout"), "{err}");
}

#[test]
fn random_inputs_do_not_produce_nan_gradients_through_long_sequences() {
    // A longer sequence than any block, through the full model with checkpointing.
    let device = Default::default();
    let model = lora_model(true, true);
    let long: Vec<u32> = (0..300).map(|i| (i * 17 % 48) as u32).collect();
    let seqs: [&[u32]; 1] = [&long];
    let pass = TrainPass {
        checkpointing: true,
        chunk: 64,
        temperature: 1.0,
        share_prefix: 0,
    };
    let out = forward_backward(&model, &seqs, pass, &device, weighted).unwrap();
    assert!(out.loss.is_finite());
    for g in lora_grads(&model, &out.grads) {
        assert!(g.iter().all(|v| v.is_finite()));
    }
}

/// Token flags of [`SEQS`]: which tokens a loss reads (token 0 of each is never predicted).
fn scored_flags() -> Vec<Vec<bool>> {
    SEQS.iter()
        .enumerate()
        .map(|(i, s)| (0..s.len()).map(|t| t > 0 && (t + i) % 3 != 0).collect())
        .collect()
}

#[test]
fn scoring_some_tokens_gives_them_the_values_and_gradients_of_scoring_all() {
    let device = Default::default();
    let flags = scored_flags();
    let scored: Vec<&[bool]> = flags.iter().map(Vec::as_slice).collect();
    // 1 where an entry (token t + 1 of its sequence) is scored, in the packed layout.
    let keep: Vec<f32> = flags
        .iter()
        .flat_map(|f| f[1..].iter().map(|&k| if k { 1.0 } else { 0.0 }))
        .collect();
    let n = keep.len();
    assert!(keep.contains(&0.0) && keep.contains(&1.0));
    for (nf4, checkpointing) in [(false, false), (true, false), (false, true)] {
        let model = lora_model(true, nf4);
        let pass = TrainPass {
            checkpointing,
            chunk: 3,
            temperature: 0.8,
            share_prefix: 0,
        };
        let seen = std::cell::RefCell::new(Vec::new());
        // The weighted loss restricted to the scored entries; records what it was given.
        let masked = |out: &fathom_model::SequenceLogprobs<Ad>| {
            let k = Tensor::<Ad, 1>::from_data(TensorData::new(keep.clone(), [n]), &device);
            seen.borrow_mut()
                .push((values(out.logprobs.clone()), values(out.entropy.clone())));
            let (lp, ent) = (out.logprobs.clone() * k.clone(), out.entropy.clone() * k);
            weighted(&fathom_model::SequenceLogprobs {
                logprobs: lp,
                entropy: ent,
                offsets: out.offsets.clone(),
            })
        };
        let all = forward_backward(&model, &SEQS, pass, &device, masked).unwrap();
        let some = forward_backward_scored(&model, &SEQS, &scored, pass, &device, masked).unwrap();
        let seen = seen.into_inner();
        let ((lp_all, ent_all), (lp_some, ent_some)) = (&seen[0], &seen[1]);
        assert_eq!(lp_some.len(), n);
        for e in 0..n {
            if keep[e] == 1.0 {
                assert!((lp_all[e] - lp_some[e]).abs() < 1e-5, "entry {e}");
                assert!((ent_all[e] - ent_some[e]).abs() < 1e-5, "entry {e}");
            } else {
                assert_eq!((lp_some[e], ent_some[e]), (0.0, 0.0), "entry {e}");
            }
        }
        assert!(
            (all.loss - some.loss).abs() < 1e-4,
            "nf4 {nf4} checkpointing {checkpointing}: {} vs {}",
            all.loss,
            some.loss
        );
        let (a, b) = (
            lora_grads(&model, &all.grads),
            lora_grads(&model, &some.grads),
        );
        assert_eq!(a.len(), 2 * 7 * 2);
        for (x, y) in a.iter().zip(&b) {
            assert!(x.iter().any(|v| *v != 0.0), "a gradient is all zero");
            let diff = max_diff(x, y);
            assert!(
                diff < 1e-5,
                "nf4 {nf4} checkpointing {checkpointing}: {diff}"
            );
        }
    }
}

/// Two groups whose members begin alike (a GRPO group's prompt), with one sequence between
/// them that shares nothing, and a group member that equals its prompt plus one token.
const GROUPED: [&[u32]; 7] = [
    &[1, 5, 9, 2, 7, 30, 44, 3, 8],
    &[1, 5, 9, 2, 7, 30, 12],
    &[1, 5, 9, 2, 7, 30, 44, 19, 6, 0],
    &[47, 0, 12],
    &[3, 3, 8, 40, 41],
    &[3, 3, 8, 40, 2, 2, 2, 9],
    &[3, 3, 8, 40, 41, 11],
];

#[test]
fn shared_prefixes_give_the_values_and_gradients_of_whole_sequences() {
    let device = Default::default();
    let packing = fathom_model::SharedPacking::new(&GROUPED, 3);
    // Rows: 6 + 3 + 1 + 4 (the first group) + 3 + 4 + 1 + 4 + 2 (the second) = 28 of 48.
    assert!(packing.shares());
    assert_eq!(packing.len(), 6 + 3 + 1 + 4 + 3 + 4 + 1 + 4 + 2);
    assert_eq!(packing.sequence_rows(1), &[0, 1, 2, 3, 4, 5, 9]);
    let flags: Vec<Vec<bool>> = GROUPED
        .iter()
        .enumerate()
        .map(|(i, s)| (0..s.len()).map(|t| t > 0 && (t + i) % 3 != 0).collect())
        .collect();
    let scored: Vec<&[bool]> = flags.iter().map(Vec::as_slice).collect();
    for (nf4, checkpointing, some) in [
        (false, false, false),
        (true, false, false),
        (false, true, false),
        (false, false, true),
    ] {
        let model = lora_model(true, nf4);
        let seen = std::cell::RefCell::new(Vec::new());
        let recorded = |out: &fathom_model::SequenceLogprobs<Ad>| {
            seen.borrow_mut()
                .push((values(out.logprobs.clone()), values(out.entropy.clone())));
            weighted(out)
        };
        let run = |share_prefix: usize| {
            let pass = TrainPass {
                checkpointing,
                chunk: 5,
                temperature: 0.9,
                share_prefix,
            };
            if some {
                forward_backward_scored(&model, &GROUPED, &scored, pass, &device, recorded)
            } else {
                forward_backward(&model, &GROUPED, pass, &device, recorded)
            }
            .unwrap()
        };
        let (whole, shared) = (run(0), run(3));
        let seen = seen.into_inner();
        let ((lp_whole, ent_whole), (lp_shared, ent_shared)) = (&seen[0], &seen[1]);
        assert_eq!(
            lp_whole.len(),
            GROUPED.iter().map(|s| s.len() - 1).sum::<usize>()
        );
        let case = format!("nf4 {nf4} checkpointing {checkpointing} scored {some}");
        assert!(max_diff(lp_whole, lp_shared) < 1e-5, "{case}");
        assert!(max_diff(ent_whole, ent_shared) < 1e-5, "{case}");
        assert!(
            (whole.loss - shared.loss).abs() < 1e-4,
            "{case}: {} vs {}",
            whole.loss,
            shared.loss
        );
        let (a, b) = (
            lora_grads(&model, &whole.grads),
            lora_grads(&model, &shared.grads),
        );
        assert_eq!(a.len(), 2 * 7 * 2);
        for (x, y) in a.iter().zip(&b) {
            assert!(
                x.iter().any(|v| *v != 0.0),
                "{case}: a gradient is all zero"
            );
            let diff = max_diff(x, y);
            let scale = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(diff < 1e-5 * scale.max(1.0), "{case}: {diff}");
        }
    }
}

#[test]
fn a_shared_packing_must_come_from_the_same_sequences() {
    let device = Default::default();
    let model = lora_model(true, false);
    let packing = fathom_model::SharedPacking::new(&GROUPED[..3], 2);
    let err = model
        .shared_input(&GROUPED[..2], &packing, &device)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("built from other sequences"), "{err}");
    let other: [&[u32]; 3] = [GROUPED[0], GROUPED[1], GROUPED[3]];
    let err = model
        .shared_input(&other, &packing, &device)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("built from other sequences"), "{err}");
}

#[test]
fn scored_flags_must_match_the_sequences() {
    let device = Default::default();
    let model = lora_model(true, false);
    let mut flags = scored_flags();
    let run = |flags: &[Vec<bool>]| {
        let scored: Vec<&[bool]> = flags.iter().map(Vec::as_slice).collect();
        forward_backward_scored(
            &model,
            &SEQS,
            &scored,
            TrainPass::default(),
            &device,
            weighted,
        )
    };
    flags[1].pop();
    let err = run(&flags).err().expect("refused").to_string();
    assert!(
        err.contains("sequence 1 has 3 tokens but 2 scored flags"),
        "{err}"
    );
    let err = run(&flags[..2]).err().expect("refused").to_string();
    assert!(err.contains("2 scored masks for 3 sequences"), "{err}");
    // Nothing scored: every entry is computed, as without flags.
    let none: Vec<Vec<bool>> = SEQS.iter().map(|s| vec![false; s.len()]).collect();
    let (a, b) = (
        run(&none).unwrap(),
        forward_backward(&model, &SEQS, TrainPass::default(), &device, weighted).unwrap(),
    );
    assert!((a.loss - b.loss).abs() < 1e-6, "{} vs {}", a.loss, b.loss);
}

#[test]
fn gradients_of_passes_over_parts_add_up_to_one_pass_over_all() {
    let device = Default::default();
    // A loss that is a sum over sequences (as the trainers' are).
    let loss = |out: &SequenceLogprobs<Ad>| {
        (
            out.logprobs.clone().sum() + out.entropy.clone().sum().mul_scalar(0.1),
            (),
        )
    };
    for (tied, nf4) in [(true, false), (false, true)] {
        let model = lora_model(tied, nf4);
        let pass = TrainPass::default();
        let whole = forward_backward(&model, &SEQS, pass, &device, loss).unwrap();
        let first = forward_backward(&model, &SEQS[..1], pass, &device, loss).unwrap();
        let rest = forward_backward(&model, &SEQS[1..], pass, &device, loss).unwrap();
        assert!((first.loss + rest.loss - whole.loss).abs() < 1e-4 * whole.loss.abs().max(1.0));
        let mut sum = rest.grads;
        add_gradients(&model, first.grads, &mut sum);
        let (want, got) = (lora_grads(&model, &whole.grads), lora_grads(&model, &sum));
        assert_eq!(want.len(), got.len());
        for (w, g) in want.iter().zip(&got) {
            let scale = w.iter().fold(1f32, |m, v| m.max(v.abs()));
            assert!(max_diff(w, g) < 1e-5 * scale, "tied {tied}, nf4 {nf4}");
        }
    }
}
