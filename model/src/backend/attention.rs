//! Causal grouped-query attention on the host, directly over the packed rows of a step and the
//! KV cache's storage: the CPU backend's [`packed_attention`](super::ModelBackend::packed_attention)
//! and [`cached_attention`](super::ModelBackend::cached_attention). The reference
//! ([`super::reference`]) builds each block from a dozen burn tensor operations per sequence,
//! with their copies and allocations; here the same computation runs in place.
//!
//! Work is split into tasks of one sequence, one key/value head and one block of queries, run in
//! parallel. A task computes, for each query head that shares the key/value head, the block's
//! scores `q · kᵀ` with one `gemm` call (over the keys up to the block's last query), scales
//! them, applies the causal limit of each query, takes the softmax (max, `exp`, sum, divide, as
//! the reference does) and multiplies the probabilities by the values with a second `gemm` call,
//! writing the output rows in place. A single query (decoding) stacks its group's query heads
//! into one `gemm` call, since they are adjacent in memory. Each query also gets the
//! log-sum-exp of its scaled scores, which the memory-lean backward pass needs.
//!
//! The backward pass ([`attention_backward`], packed sequences) is the flash-attention one, as
//! in the reference: per query block and head it recomputes the probabilities from the saved
//! log-sum-exp, and gets `dQ`, `dK` and `dV` from five `gemm` calls. Its tasks are one sequence
//! and one key/value head each, since every query block adds into the same keys' and values'
//! gradients.

use rayon::prelude::*;

use super::{Heads, vmath};

/// Queries per task block: the block's scores are `BLOCK × keys`.
const BLOCK: usize = 64;

/// Keys or values of one sequence: element `(head, position, c)` at
/// `offset + head · head_stride + position · pos_stride + c`.
#[derive(Clone, Copy, Debug)]
pub struct KvView<'a> {
    /// The storage.
    pub data: &'a [f32],
    /// Index of element `(0, 0, 0)`.
    pub offset: usize,
    /// Distance between heads.
    pub head_stride: usize,
    /// Distance between positions.
    pub pos_stride: usize,
}

impl KvView<'_> {
    /// Checks that `heads × positions × head_dim` elements lie inside the storage.
    fn covers(&self, heads: usize, positions: usize, head_dim: usize) -> bool {
        if heads == 0 || positions == 0 {
            return true;
        }
        let last = self.offset
            + (heads - 1) * self.head_stride
            + (positions - 1) * self.pos_stride
            + head_dim;
        last <= self.data.len()
    }
}

/// One sequence of a call: its new queries are packed rows `start .. start + len`, after `past`
/// positions; `k` and `v` hold all `past + len` positions.
#[derive(Clone, Copy, Debug)]
pub struct Sequence<'a> {
    /// First packed row of the sequence's queries.
    pub start: usize,
    /// Number of queries.
    pub len: usize,
    /// Positions before the first query.
    pub past: usize,
    /// Keys.
    pub k: KvView<'a>,
    /// Values.
    pub v: KvView<'a>,
}

/// Attention of every sequence's queries. `q` is `[n, heads · head_dim]`; returns the output
/// in the same layout and the log-sum-exp of each query's scaled scores `[n, heads]`.
///
/// # Panics
/// If a sequence's rows or keys and values lie outside the given storage.
pub fn attention(q: &[f32], seqs: &[Sequence<'_>], heads: Heads) -> (Vec<f32>, Vec<f32>) {
    let (h, kvh, d) = (heads.heads, heads.kv_heads, heads.head_dim);
    let width = h * d;
    assert!(
        q.len().is_multiple_of(width.max(1)),
        "queries have the wrong size"
    );
    let n = q.len() / width.max(1);
    for s in seqs {
        assert!(
            s.start + s.len <= n,
            "a sequence's rows lie outside the queries"
        );
        let keys = s.past + s.len;
        assert!(
            s.k.covers(kvh, keys, d) && s.v.covers(kvh, keys, d),
            "a sequence's keys or values lie outside their storage"
        );
    }
    let mut out = vec![0f32; n * width];
    let mut lse = vec![0f32; n * h];
    // (sequence, key/value head, first query, queries)
    let mut tasks = Vec::new();
    for (i, s) in seqs.iter().enumerate() {
        for g in 0..kvh {
            let mut first = 0;
            while first < s.len {
                let nb = BLOCK.min(s.len - first);
                tasks.push((i, g, first, nb));
                first += nb;
            }
        }
    }
    // Tasks write disjoint rows × heads of `out` and `lse`; addresses cross threads as integers.
    let (out_ptr, lse_ptr) = (out.as_mut_ptr() as usize, lse.as_mut_ptr() as usize);
    tasks
        .into_par_iter()
        .for_each_init(Vec::new, |scratch: &mut Vec<f32>, (i, g, first, nb)| {
            let s = &seqs[i];
            // SAFETY: this task writes only rows start + first .. + nb of the query heads of
            // key/value head g (in `out` and `lse`), which no other task touches; both buffers
            // outlive the parallel loop, and every read was bounds-checked above.
            unsafe {
                block(
                    q,
                    s,
                    heads,
                    g,
                    first,
                    nb,
                    scratch,
                    out_ptr as *mut f32,
                    lse_ptr as *mut f32,
                )
            }
        });
    (out, lse)
}

/// One task: queries `first .. first + nb` of sequence `s`, the query heads of key/value head
/// `g`.
///
/// # Safety
/// `out` must hold `n × heads · head_dim` values and `lse` `n × heads`, and no other thread may
/// touch this task's rows and heads; `q`, `s.k` and `s.v` must cover the sequence.
#[allow(clippy::too_many_arguments)]
unsafe fn block(
    q: &[f32],
    s: &Sequence<'_>,
    heads: Heads,
    g: usize,
    first: usize,
    nb: usize,
    scratch: &mut Vec<f32>,
    out: *mut f32,
    lse: *mut f32,
) {
    let (h, d, group) = (heads.heads, heads.head_dim, heads.group());
    let width = h * d;
    let visible = s.past + first + nb;
    let scale = heads.scale() as f32;
    let row0 = s.start + first;
    // SAFETY (pointers): the caller guarantees the views cover `visible` positions of head g.
    let k = unsafe { s.k.data.as_ptr().add(s.k.offset + g * s.k.head_stride) };
    let v = unsafe { s.v.data.as_ptr().add(s.v.offset + g * s.v.head_stride) };
    // With one query the group's heads are adjacent rows (stride d) sharing one causal limit:
    // one product for all of them. Otherwise one product per head over the block's queries.
    let (units, rows, row_stride) = if nb == 1 {
        (1, group, d as isize)
    } else {
        (group, nb, width as isize)
    };
    scratch.resize(rows * visible, 0.0);
    for u in 0..units {
        let head = if nb == 1 { g * group } else { g * group + u };
        let q_at = row0 * width + head * d;
        // SAFETY: `scores` is rows × visible (row stride visible); the queries are `rows` rows of
        // d values from q_at with stride row_stride, inside q; kᵀ reads position j, element c
        // at k + j·pos_stride + c for j < visible, c < d: inside the view.
        unsafe {
            gemm::gemm(
                rows,
                visible,
                d,
                scratch.as_mut_ptr(),
                1,
                visible as isize,
                false,
                q.as_ptr().add(q_at),
                1,
                row_stride,
                k,
                s.k.pos_stride as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
        for r in 0..rows {
            // query index within the block, its head, and the keys it may see
            let (qi, hh) = if nb == 1 { (0, head + r) } else { (r, head) };
            let limit = s.past + first + qi + 1;
            let row = &mut scratch[r * visible..(r + 1) * visible];
            let max = vmath::scale_max(&mut row[..limit], scale);
            let sum = vmath::softmax_from_max(&mut row[..limit], max);
            row[limit..].fill(0.0);
            // SAFETY: row (row0 + qi), head hh is this task's.
            unsafe { *lse.add((row0 + qi) * h + hh) = max + sum.ln() };
        }
        // SAFETY: the output rows are `rows` rows of d values from q_at's position in `out`
        // (same layout as q) with stride row_stride; v reads position j, element c at
        // v + j·pos_stride + c for j < visible: inside the view.
        unsafe {
            gemm::gemm(
                rows,
                d,
                visible,
                out.add(q_at),
                1,
                row_stride,
                false,
                scratch.as_ptr(),
                1,
                visible as isize,
                v,
                1,
                s.v.pos_stride as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    }
}

/// Gradients of [`attention`] over packed sequences with nothing cached (`past = 0`): `q`,
/// `out` and `grad` (the output's gradient) are `[n, heads · head_dim]`, `k` and `v`
/// `[n, kv_heads · head_dim]`, `lse` `[n, heads]` as [`attention`] returned it; `spans` are
/// `(start, len)` of each sequence. Returns `(dq, dk, dv)` in the layouts of `q`, `k` and `v`.
///
/// # Panics
/// If the slices do not have the sizes the layout implies.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    lse: &[f32],
    grad: &[f32],
    spans: &[(usize, usize)],
    heads: Heads,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (h, kvh, d) = (heads.heads, heads.kv_heads, heads.head_dim);
    let n = lse.len() / h.max(1);
    assert!(
        q.len() == n * h * d && out.len() == q.len() && grad.len() == q.len(),
        "queries, output or gradient have the wrong size"
    );
    assert!(
        k.len() == n * kvh * d && v.len() == k.len(),
        "keys or values have the wrong size"
    );
    assert!(
        spans.iter().all(|&(s, l)| s + l <= n),
        "a sequence lies outside the rows"
    );
    let (mut dq, mut dk, mut dv) = (
        vec![0f32; q.len()],
        vec![0f32; k.len()],
        vec![0f32; k.len()],
    );
    let tasks: Vec<(usize, usize)> = (0..spans.len())
        .flat_map(|i| (0..kvh).map(move |g| (i, g)))
        .collect();
    let ptrs = (
        dq.as_mut_ptr() as usize,
        dk.as_mut_ptr() as usize,
        dv.as_mut_ptr() as usize,
    );
    let inputs = BackwardInputs {
        q,
        k,
        v,
        out,
        lse,
        grad,
        heads,
    };
    tasks.into_par_iter().for_each(|(i, g)| {
        let (start, len) = spans[i];
        // SAFETY: this task writes only the rows start .. start + len of the heads of key/value
        // head g (dq) and of key/value head g itself (dk, dv), which no other task touches;
        // the buffers outlive the loop and every read was size-checked above.
        unsafe {
            sequence_backward(
                &inputs,
                start,
                len,
                g,
                ptrs.0 as *mut f32,
                ptrs.1 as *mut f32,
                ptrs.2 as *mut f32,
            )
        }
    });
    (dq, dk, dv)
}

/// The inputs of [`attention_backward`], shared by its tasks.
struct BackwardInputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    out: &'a [f32],
    lse: &'a [f32],
    grad: &'a [f32],
    heads: Heads,
}

/// One `gemm` call `dst = a · b (+ dst)` on row/column strides (`(rs, cs)` for each matrix).
///
/// # Safety
/// Every matrix must lie inside its allocation for the given shape and strides.
#[allow(clippy::too_many_arguments)]
unsafe fn product(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    (dst_rs, dst_cs): (usize, usize),
    accumulate: bool,
    a: *const f32,
    (a_rs, a_cs): (usize, usize),
    b: *const f32,
    (b_rs, b_cs): (usize, usize),
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            dst_cs as isize,
            dst_rs as isize,
            accumulate,
            a,
            a_cs as isize,
            a_rs as isize,
            b,
            b_cs as isize,
            b_rs as isize,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// The gradients of one sequence for the query heads of key/value head `g`.
///
/// # Safety
/// `dq`, `dk`, `dv` must be the output buffers of [`attention_backward`] and no other thread
/// may touch this sequence's rows of head `g`'s columns.
unsafe fn sequence_backward(
    x: &BackwardInputs<'_>,
    start: usize,
    len: usize,
    g: usize,
    dq: *mut f32,
    dk: *mut f32,
    dv: *mut f32,
) {
    let heads = x.heads;
    let (h, kvh, d, group) = (heads.heads, heads.kv_heads, heads.head_dim, heads.group());
    let (width, kv_width) = (h * d, kvh * d);
    let scale = heads.scale() as f32;
    let kv_at = start * kv_width + g * d;
    let mut p = vec![0f32; BLOCK * len];
    let mut dp = vec![0f32; BLOCK * len];
    let mut delta = vec![0f32; BLOCK];
    let mut first = 0;
    while first < len {
        let nb = BLOCK.min(len - first);
        let visible = first + nb;
        for hh in g * group..(g + 1) * group {
            let q_at = (start + first) * width + hh * d;
            // delta_i = dO_i · O_i
            for (i, dl) in delta[..nb].iter_mut().enumerate() {
                let row = q_at + i * width;
                *dl = (0..d).map(|c| x.grad[row + c] * x.out[row + c]).sum();
            }
            // SAFETY (all products): the queries, output gradients and their gradient are nb
            // rows of d values from q_at (stride width) inside q/grad/dq; keys, values and their
            // gradients `visible` rows of d values from kv_at (stride kv_width) inside k/v/dk/dv;
            // p and dp hold nb × visible values (stride visible).
            unsafe {
                // S = Q Kᵀ and dP = dO Vᵀ
                product(
                    (nb, visible, d),
                    p.as_mut_ptr(),
                    (visible, 1),
                    false,
                    x.q.as_ptr().add(q_at),
                    (width, 1),
                    x.k.as_ptr().add(kv_at),
                    (1, kv_width),
                );
                product(
                    (nb, visible, d),
                    dp.as_mut_ptr(),
                    (visible, 1),
                    false,
                    x.grad.as_ptr().add(q_at),
                    (width, 1),
                    x.v.as_ptr().add(kv_at),
                    (1, kv_width),
                );
            }
            for i in 0..nb {
                let limit = first + i + 1;
                let lse = x.lse[(start + first + i) * h + hh];
                let row = &mut p[i * visible..(i + 1) * visible];
                let drow = &mut dp[i * visible..(i + 1) * visible];
                // P = exp(S · scale − lse); dS = P ∘ (dP − delta) · scale
                vmath::attention_grad(&mut row[..limit], &mut drow[..limit], scale, lse, delta[i]);
                row[limit..].fill(0.0);
                drow[limit..].fill(0.0);
            }
            unsafe {
                // dQ = dS K;  dK += dSᵀ Q;  dV += Pᵀ dO
                product(
                    (nb, d, visible),
                    dq.add(q_at),
                    (width, 1),
                    false,
                    dp.as_ptr(),
                    (visible, 1),
                    x.k.as_ptr().add(kv_at),
                    (kv_width, 1),
                );
                product(
                    (visible, d, nb),
                    dk.add(kv_at),
                    (kv_width, 1),
                    true,
                    dp.as_ptr(),
                    (1, visible),
                    x.q.as_ptr().add(q_at),
                    (width, 1),
                );
                product(
                    (visible, d, nb),
                    dv.add(kv_at),
                    (kv_width, 1),
                    true,
                    p.as_ptr(),
                    (1, visible),
                    x.grad.as_ptr().add(q_at),
                    (width, 1),
                );
            }
        }
        first += nb;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The textbook computation, one query and head at a time, in f64.
    fn naive(q: &[f32], seqs: &[Sequence<'_>], heads: Heads) -> (Vec<f32>, Vec<f32>) {
        let (h, d) = (heads.heads, heads.head_dim);
        let n = q.len() / (h * d);
        let mut out = vec![0f32; n * h * d];
        let mut lse = vec![0f32; n * h];
        let at = |view: &KvView<'_>, g: usize, p: usize, c: usize| {
            view.data[view.offset + g * view.head_stride + p * view.pos_stride + c] as f64
        };
        for s in seqs {
            for t in 0..s.len {
                for hh in 0..h {
                    let g = hh / heads.group();
                    let qrow = &q[(s.start + t) * h * d + hh * d..][..d];
                    let keys = s.past + t + 1;
                    let scores: Vec<f64> = (0..keys)
                        .map(|j| {
                            (0..d)
                                .map(|c| qrow[c] as f64 * at(&s.k, g, j, c))
                                .sum::<f64>()
                                * heads.scale()
                        })
                        .collect();
                    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = scores.iter().map(|x| (x - max).exp()).sum();
                    lse[(s.start + t) * h + hh] = (max + sum.ln()) as f32;
                    for c in 0..d {
                        let o: f64 = (0..keys)
                            .map(|j| (scores[j] - max).exp() / sum * at(&s.v, g, j, c))
                            .sum();
                        out[(s.start + t) * h * d + hh * d + c] = o as f32;
                    }
                }
            }
        }
        (out, lse)
    }

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 2_654_435_761 + seed * 97) % 1009) as f32 / 1009.0 - 0.5) * 2.0)
            .collect()
    }

    #[test]
    fn packed_and_cached_layouts_match_the_naive_computation() {
        let heads = Heads {
            heads: 6,
            kv_heads: 2,
            head_dim: 8,
        };
        let (h, kvh, d) = (heads.heads, heads.kv_heads, heads.head_dim);
        // Packed: three sequences (one over two blocks), keys in the packed `[n, kvh · d]` rows.
        let lens = [70, 1, 5];
        let n: usize = lens.iter().sum();
        let q = values(n * h * d, 1);
        let k = values(n * kvh * d, 2);
        let v = values(n * kvh * d, 3);
        let mut seqs = Vec::new();
        let mut start = 0;
        for len in lens {
            let view = |data| KvView {
                data,
                offset: start * kvh * d,
                head_stride: d,
                pos_stride: kvh * d,
            };
            seqs.push(Sequence {
                start,
                len,
                past: 0,
                k: view(&k),
                v: view(&v),
            });
            start += len;
        }
        let check = |seqs: &[Sequence<'_>], q: &[f32]| {
            let (out, lse) = attention(q, seqs, heads);
            let (want_out, want_lse) = naive(q, seqs, heads);
            for (a, b) in out.iter().zip(&want_out).chain(lse.iter().zip(&want_lse)) {
                assert!((a - b).abs() < 1e-5, "{a} vs {b}");
            }
        };
        check(&seqs, &q);
        // Cached: `[kvh, capacity, d]` storage with past positions, one and several new queries.
        let capacity = 40;
        let kc = values(kvh * capacity * d, 4);
        let vc = values(kvh * capacity * d, 5);
        let view = |data| KvView {
            data,
            offset: 0,
            head_stride: capacity * d,
            pos_stride: d,
        };
        let q2 = values(4 * h * d, 6);
        let cached = [
            Sequence {
                start: 0,
                len: 1,
                past: 30,
                k: view(&kc),
                v: view(&vc),
            },
            Sequence {
                start: 1,
                len: 3,
                past: 9,
                k: view(&kc),
                v: view(&vc),
            },
        ];
        check(&cached, &q2);
    }

    #[test]
    #[should_panic(expected = "outside their storage")]
    fn views_too_short_for_the_keys_are_refused() {
        let heads = Heads {
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
        };
        let kv = [0f32; 8];
        let view = KvView {
            data: &kv,
            offset: 0,
            head_stride: 0,
            pos_stride: 4,
        };
        let seq = Sequence {
            start: 0,
            len: 1,
            past: 2,
            k: view,
            v: view,
        };
        attention(&[0.0; 8], &[seq], heads);
    }
}
