//! Token log-probabilities and entropies on the host, a chunk of positions at a time: the CPU
//! backend's [`token_logprobs`](super::ModelBackend::token_logprobs) and its backward pass. The
//! reference ([`super::reference`]) holds four or five `[chunk, vocab]` tensors at once (the
//! logits, their exponentials, products, probabilities); here each chunk's logits are the only
//! such buffer: the statistics of a row are taken in one pass over it, and the backward pass
//! turns the recomputed logits into their gradient in place before multiplying by the head.
//!
//! The arithmetic is the reference's: `z = logits / temperature`, `lse = max + ln Σ exp(z − max)`,
//! `logp = z[target] − lse`, `entropy = lse − Σ exp(z − max) · z / Σ exp(z − max)`; and
//! `dz = g_logp · (onehot − p) − g_entropy · p · (z − Σ p z)`, divided by the temperature.

use rayon::prelude::*;

use super::vmath;

/// `[n, 2]` (log-probability, entropy) of each position. `head(rows, m)` returns the logits
/// `[m, vocab]` of `m` rows of `hidden` (`[n, width]`).
pub fn token_logprobs(
    hidden: &[f32],
    width: usize,
    targets: &[u32],
    temperature: f32,
    chunk: usize,
    head: impl Fn(&[f32], usize) -> Vec<f32>,
) -> Vec<f32> {
    let n = targets.len();
    assert_eq!(hidden.len(), n * width, "hidden states have the wrong size");
    let chunk = chunk.max(1);
    let mut out = vec![0f32; 2 * n];
    for (c, out) in out.chunks_mut(2 * chunk).enumerate() {
        let start = c * chunk;
        let m = out.len() / 2;
        let mut z = head(&hidden[start * width..(start + m) * width], m);
        let vocab = z.len() / m.max(1);
        z.par_chunks_mut(vocab)
            .zip(out.par_chunks_mut(2))
            .zip(&targets[start..start + m])
            .for_each(|((row, o), &t)| {
                let s = stats(row, temperature);
                o[0] = row[t as usize] - s.lse;
                o[1] = s.lse - s.weighted / s.sum;
            });
    }
    out
}

/// [`token_logprobs`] and, from the same chunks' logits, the log-probabilities' own gradient
/// with respect to `hidden` (`[n, width]`: `((onehot(target) − p) / temperature) · W` for each
/// position), for a pass whose entropies receive no gradient. Its backward pass is then one
/// scaling by each position's log-probability gradient, instead of recomputing every chunk's
/// logits and multiplying their gradient by the head ([`token_logprobs_backward`]): two head
/// products in all instead of three. `head` and `head_backward` are as there.
pub fn token_logprobs_with_gradient(
    hidden: &[f32],
    width: usize,
    targets: &[u32],
    temperature: f32,
    chunk: usize,
    head: impl Fn(&[f32], usize) -> Vec<f32>,
    head_backward: impl Fn(Vec<f32>, usize) -> Vec<f32>,
) -> (Vec<f32>, Vec<f32>) {
    let n = targets.len();
    assert_eq!(hidden.len(), n * width, "hidden states have the wrong size");
    let chunk = chunk.max(1);
    let mut out = vec![0f32; 2 * n];
    let mut grad = Vec::with_capacity(n * width);
    for (c, out) in out.chunks_mut(2 * chunk).enumerate() {
        let start = c * chunk;
        let m = out.len() / 2;
        let mut z = head(&hidden[start * width..(start + m) * width], m);
        let vocab = z.len() / m.max(1);
        z.par_chunks_mut(vocab)
            .zip(out.par_chunks_mut(2))
            .zip(&targets[start..start + m])
            .for_each(|((row, o), &t)| {
                let s = stats(row, temperature);
                o[0] = row[t as usize] - s.lse;
                o[1] = s.lse - s.weighted / s.sum;
                // The backward pass's logit gradient for a unit log-probability gradient.
                vmath::logit_grad(row, s.max, s.sum, s.weighted / s.sum, 1.0, 0.0, temperature);
                row[t as usize] += 1.0 / temperature;
            });
        grad.extend(head_backward(z, m));
    }
    (out, grad)
}

/// The hidden-state gradient from [`token_logprobs_with_gradient`]'s `dlogp` (`[n, width]`)
/// for the output gradient `grad` (`[n, 2]`): each row of `dlogp` scaled by its position's
/// log-probability gradient. `None` when an entropy has a non-zero gradient, which `dlogp`
/// does not cover (then [`token_logprobs_backward`] recomputes).
pub fn scale_logprob_gradient(dlogp: &[f32], width: usize, grad: &[f32]) -> Option<Vec<f32>> {
    assert_eq!(
        dlogp.len() * 2,
        grad.len() * width,
        "gradients have mismatched sizes"
    );
    if grad.chunks(2).any(|g| g[1] != 0.0) {
        return None;
    }
    let mut out = dlogp.to_vec();
    if width > 0 {
        out.par_chunks_mut(width)
            .zip(grad.par_chunks(2))
            .for_each(|(row, g)| row.iter_mut().for_each(|v| *v *= g[0]));
    }
    Some(out)
}

/// The gradient `[n, width]` of [`token_logprobs`] with respect to `hidden`, for the output
/// gradient `grad` `[n, 2]`. `head` is as there; `head_backward(dz, m)` returns `dz · W`
/// `[m, width]` for `dz` `[m, vocab]`.
pub fn token_logprobs_backward(
    hidden: &[f32],
    width: usize,
    targets: &[u32],
    temperature: f32,
    chunk: usize,
    grad: &[f32],
    head: impl Fn(&[f32], usize) -> Vec<f32>,
    head_backward: impl Fn(Vec<f32>, usize) -> Vec<f32>,
) -> Vec<f32> {
    let n = targets.len();
    assert_eq!(hidden.len(), n * width, "hidden states have the wrong size");
    assert_eq!(grad.len(), 2 * n, "the gradient has the wrong size");
    let chunk = chunk.max(1);
    let mut out = Vec::with_capacity(n * width);
    let mut start = 0;
    while start < n {
        let m = chunk.min(n - start);
        let mut z = head(&hidden[start * width..(start + m) * width], m);
        let vocab = z.len() / m;
        z.par_chunks_mut(vocab)
            .zip(grad[2 * start..2 * (start + m)].par_chunks(2))
            .zip(&targets[start..start + m])
            .for_each(|((row, g), &t)| {
                let s = stats(row, temperature);
                let (g_logp, g_entropy) = (g[0], g[1]);
                // E_p[z], with p = exp(z − max) / sum
                let mean = s.weighted / s.sum;
                vmath::logit_grad(row, s.max, s.sum, mean, g_logp, g_entropy, temperature);
                row[t as usize] += g_logp / temperature;
            });
        out.extend(head_backward(z, m));
        start += m;
    }
    out
}

/// Statistics of one row of logits, which it scales by `1 / temperature` in place.
struct RowStats {
    max: f32,
    /// `Σ exp(z − max)`
    sum: f32,
    /// `Σ exp(z − max) · z`
    weighted: f32,
    lse: f32,
}

fn stats(row: &mut [f32], temperature: f32) -> RowStats {
    let max = vmath::divide_max(row, temperature);
    let (sum, weighted) = vmath::exp_sums(row, max);
    RowStats {
        max,
        sum,
        weighted,
        lse: max + sum.ln(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `x · Wᵀ` and `g · W` for a small dense `W` `[vocab, width]`.
    fn head(
        w: &[f32],
        width: usize,
    ) -> (
        impl Fn(&[f32], usize) -> Vec<f32> + '_,
        impl Fn(Vec<f32>, usize) -> Vec<f32> + '_,
    ) {
        let vocab = w.len() / width;
        let forward = move |x: &[f32], m: usize| {
            (0..m * vocab)
                .map(|e| {
                    (0..width)
                        .map(|c| x[(e / vocab) * width + c] * w[(e % vocab) * width + c])
                        .sum()
                })
                .collect()
        };
        let backward = move |g: Vec<f32>, m: usize| {
            (0..m * width)
                .map(|e| {
                    (0..vocab)
                        .map(|j| g[(e / width) * vocab + j] * w[j * width + e % width])
                        .sum()
                })
                .collect()
        };
        (forward, backward)
    }

    #[test]
    fn the_forward_gradient_equals_the_recomputing_backward_pass() {
        let (n, width, vocab) = (7, 4, 11);
        let w: Vec<f32> = (0..vocab * width)
            .map(|i| ((i * 29 % 13) as f32 - 6.0) / 5.0)
            .collect();
        let hidden: Vec<f32> = (0..n * width)
            .map(|i| ((i * 17 % 9) as f32 - 4.0) / 3.0)
            .collect();
        let targets = [0u32, 10, 3, 3, 7, 1, 5];
        let (fwd, bwd) = head(&w, width);
        for (chunk, temperature) in [(1, 1.0f32), (3, 0.7), (7, 1.3), (20, 1.0)] {
            let plain = token_logprobs(&hidden, width, &targets, temperature, chunk, &fwd);
            let (values, dlogp) = token_logprobs_with_gradient(
                &hidden,
                width,
                &targets,
                temperature,
                chunk,
                &fwd,
                &bwd,
            );
            assert_eq!(values, plain, "chunk {chunk}: values");
            let grad: Vec<f32> = (0..2 * n)
                .map(|i| {
                    if i % 2 == 0 {
                        (i as f32 - 5.0) / 4.0
                    } else {
                        0.0
                    }
                })
                .collect();
            let want = token_logprobs_backward(
                &hidden,
                width,
                &targets,
                temperature,
                chunk,
                &grad,
                &fwd,
                &bwd,
            );
            let got = scale_logprob_gradient(&dlogp, width, &grad).expect("no entropy gradient");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() < 1e-5, "chunk {chunk} d[{i}]: {g} vs {w}");
            }
            // An entropy gradient is not covered: the caller must recompute.
            let mut with_entropy = grad.clone();
            with_entropy[3] = 0.5;
            assert!(scale_logprob_gradient(&dlogp, width, &with_entropy).is_none());
        }
    }

    #[test]
    fn values_and_gradients_match_finite_differences_in_f64() {
        let (n, width, vocab) = (5, 3, 7);
        let w: Vec<f32> = (0..vocab * width)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) / 4.0)
            .collect();
        let hidden: Vec<f32> = (0..n * width)
            .map(|i| ((i * 13 % 7) as f32 - 3.0) / 3.0)
            .collect();
        let targets = [0u32, 6, 3, 3, 1];
        let temperature = 0.7f32;
        let (fwd, bwd) = head(&w, width);
        // f64 reference of (logp, entropy) for one row of hidden states
        let exact = |h: &[f64], t: usize| {
            let z: Vec<f64> = (0..vocab)
                .map(|j| {
                    (0..width)
                        .map(|c| h[c] * w[j * width + c] as f64)
                        .sum::<f64>()
                        / temperature as f64
                })
                .collect();
            let max = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = z.iter().map(|v| (v - max).exp()).sum();
            let lse = max + sum.ln();
            let entropy = -z.iter().map(|v| (v - lse).exp() * (v - lse)).sum::<f64>();
            (z[t] - lse, entropy)
        };
        for chunk in [1, 2, 5, 9] {
            let out = token_logprobs(&hidden, width, &targets, temperature, chunk, &fwd);
            for i in 0..n {
                let h: Vec<f64> = hidden[i * width..(i + 1) * width]
                    .iter()
                    .map(|&v| v as f64)
                    .collect();
                let (lp, ent) = exact(&h, targets[i] as usize);
                assert!(
                    (out[2 * i] as f64 - lp).abs() < 1e-5,
                    "chunk {chunk} logp {i}"
                );
                assert!(
                    (out[2 * i + 1] as f64 - ent).abs() < 1e-5,
                    "chunk {chunk} entropy {i}"
                );
            }
            let grad: Vec<f32> = (0..2 * n).map(|i| (i as f32 - 4.0) / 5.0).collect();
            let dh = token_logprobs_backward(
                &hidden,
                width,
                &targets,
                temperature,
                chunk,
                &grad,
                &fwd,
                &bwd,
            );
            for i in 0..n {
                for c in 0..width {
                    let eps = 1e-4;
                    let mut h: Vec<f64> = hidden[i * width..(i + 1) * width]
                        .iter()
                        .map(|&v| v as f64)
                        .collect();
                    h[c] += eps;
                    let (lp1, e1) = exact(&h, targets[i] as usize);
                    h[c] -= 2.0 * eps;
                    let (lp0, e0) = exact(&h, targets[i] as usize);
                    let want = (grad[2 * i] as f64 * (lp1 - lp0)
                        + grad[2 * i + 1] as f64 * (e1 - e0))
                        / (2.0 * eps);
                    let got = dh[i * width + c] as f64;
                    assert!(
                        (got - want).abs() < 1e-4,
                        "chunk {chunk} d[{i},{c}]: {got} vs {want}"
                    );
                }
            }
        }
    }
}
