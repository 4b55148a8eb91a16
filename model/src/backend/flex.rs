//! [`ModelBackend`] for burn's Flex, the default CPU backend: projections run through the host
//! kernels of [`crate::nf4::cpu`] directly on the tensors' memory (row tiles in parallel, each
//! multiplied with `gemm`), for dense f32, bf16 and NF4 weights alike, forward and transposed;
//! projections of a few rows (decoding) through the AVX-512 or AVX2 kernels of
//! [`super::gemv`] where the CPU has them; and attention through the host kernel of
//! [`super::attention`], over the packed rows and the KV cache's storage in place.

use burn::backend::Flex;
use burn::backend::flex::FlexTensor;
use burn::tensor::ops::{FloatTensor, FloatTensorOps, IntTensor};
use burn::tensor::{DType, Int, Tensor, TensorData, TensorMetadata, TensorPrimitive};

use std::borrow::Cow;

use rayon::prelude::*;

use super::attention::{self, KvView, Sequence};
use super::gemv::{self, Weight};
use super::{Head, Heads, ModelBackend, SequenceKv, Span, logprobs, reference, vmath};
use crate::blocks::BlockFormat;
use crate::nf4::cpu;

/// Input rows up to which dense (f32, bf16) projections use the row kernels of [`gemv`]
/// rather than the tiled `gemm` path. Past it, inputs with long rows (the 8960-wide down
/// projection) no longer stay in cache while the kernel walks the weight (measured:
/// docs/benchmarks.md).
const GEMV_MAX_ROWS: usize = 16;

/// Elements one thread takes at a time in the element-wise host loops (SwiGLU).
const ELEMENTWISE_CHUNK: usize = 1 << 14;

/// The same for NF4 projections, where the `gemm` path must also decode the whole weight.
const GEMV_MAX_ROWS_NF4: usize = gemv::MAX_ROWS;

/// Runs `f` on the `u32` words of a Flex code tensor, without copying when it is contiguous.
fn with_words<R>(codes: &FlexTensor, f: impl FnOnce(&[u32]) -> R) -> R {
    match codes.as_slice::<u32>() {
        Some(words) => f(words),
        None if codes.dtype() == DType::U32 => {
            f(codes.to_contiguous().as_slice::<u32>().expect("contiguous"))
        }
        None => {
            // Codes uploaded through a path that widened them: recover the bit patterns.
            let data = Tensor::<Flex, 1, Int>::from_primitive(codes.clone()).into_data();
            let words: Vec<u32> = data.iter::<i64>().map(|v| v as u32).collect();
            f(&words)
        }
    }
}

/// Runs `f` on the f32 values of a Flex float tensor, row-major.
fn with_f32<R>(tensor: &FlexTensor, f: impl FnOnce(&[f32]) -> R) -> R {
    match tensor.as_slice::<f32>() {
        Some(values) => f(values),
        None if tensor.dtype() == DType::F32 => f(tensor
            .to_contiguous()
            .as_slice::<f32>()
            .expect("contiguous")),
        None => {
            let data = Tensor::<Flex, 1>::from_primitive(TensorPrimitive::Float(tensor.clone()))
                .into_data();
            f(&data.iter::<f32>().collect::<Vec<f32>>())
        }
    }
}

/// Runs `f` on the raw bits of a bf16 Flex tensor, row-major.
fn with_bf16<R>(tensor: &FlexTensor, f: impl FnOnce(&[u16]) -> R) -> R {
    match tensor.as_slice::<half::bf16>() {
        Some(values) => f(bf16_bits(values)),
        None => {
            let contiguous = tensor.to_contiguous();
            f(bf16_bits(
                contiguous.as_slice::<half::bf16>().expect("contiguous"),
            ))
        }
    }
}

/// The raw bits of bf16 values (the same memory).
fn bf16_bits(values: &[half::bf16]) -> &[u16] {
    // SAFETY: `half::bf16` is `repr(transparent)` over `u16`.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u16>(), values.len()) }
}

/// The f32 values of a Flex float tensor, row-major: borrowed when it is contiguous f32.
fn f32s(tensor: &FlexTensor) -> Cow<'_, [f32]> {
    match tensor.as_slice::<f32>() {
        Some(values) => Cow::Borrowed(values),
        None => Cow::Owned(with_f32(tensor, <[f32]>::to_vec)),
    }
}

/// A tensor's values as a vector, without a copy when it owns them alone (f32, contiguous).
fn into_f32_vec(tensor: FlexTensor) -> Vec<f32> {
    let data = tensor.into_data();
    match data.dtype {
        // burn copies into a new vector when the bytes cannot be taken over as they are; an f32
        // buffer always casts to f32 values.
        DType::F32 => data
            .into_vec::<f32>()
            .expect("f32 tensor data converts to f32 values"),
        _ => data.iter::<f32>().collect(),
    }
}

/// The token ids of an Int tensor, when all lie below `vocab`.
fn token_ids(targets: &IntTensor<Flex>, vocab: usize) -> Option<Vec<u32>> {
    let data = Tensor::<Flex, 1, Int>::from_primitive(targets.clone()).into_data();
    data.iter::<i64>()
        .map(|t| (0..vocab as i64).contains(&t).then_some(t as u32))
        .collect()
}

fn flex_float(values: Vec<f32>, shape: [usize; 2]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// The 16 values of a code-table tensor.
fn table_values(table: &FlexTensor) -> [f32; 16] {
    with_f32(table, |t| {
        let mut out = [0f32; 16];
        out.copy_from_slice(&t[..16]);
        out
    })
}

impl ModelBackend for Flex {
    const HOST: bool = true;
    const KEEPS_BF16: bool = true;

    fn nf4_dequantize(
        codes: IntTensor<Self>,
        absmax: FloatTensor<Self>,
        table: FloatTensor<Self>,
        rows: usize,
        cols: usize,
    ) -> FloatTensor<Self> {
        let table = table_values(&table);
        let out = with_words(&codes, |words| {
            with_f32(&absmax, |absmax| {
                cpu::dequantize(words, absmax, &table, rows, cols)
            })
        });
        flex_float(out, [rows, cols])
    }

    fn kv_write(
        buffer: FloatTensor<Self>,
        start: usize,
        values: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let full = buffer.is_contiguous()
            && buffer.layout().start_offset() == 0
            && buffer.bytes().len() == buffer.layout().num_elements() * 4;
        if buffer.dtype() != DType::F32 || values.dtype() != DType::F32 || !full {
            return reference::slice_write::<Self>(buffer, start, values);
        }
        let (shape, vshape) = (buffer.shape(), values.shape());
        let (a, capacity, b, n) = (shape[0], shape[1], shape[2], vshape[1]);
        let mut buffer = buffer;
        with_f32(&values, |src| {
            // Copy-on-write: in place when the buffer is uniquely owned (the cache's case).
            let dst = buffer.storage_mut::<f32>();
            for i in 0..a {
                let to = (i * capacity + start) * b;
                dst[to..to + n * b].copy_from_slice(&src[i * n * b..(i + 1) * n * b]);
            }
        });
        buffer
    }

    fn dense_linear(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        let (m, shape) = (x.shape()[0], w.shape());
        let (rows, cols) = (shape[0], shape[1]);
        // Row tiles in parallel, each through a single-threaded gemm: measured faster on this
        // model than Flex's one multi-threaded gemm per projection (docs/benchmarks.md).
        let out = match (x.dtype(), w.dtype()) {
            (DType::F32, DType::F32) => with_f32(&w, |ws| {
                with_f32(&x, |xs| {
                    let fused = (m <= GEMV_MAX_ROWS)
                        .then(|| gemv::linear(xs, m, Weight::F32(ws), rows, cols))
                        .flatten();
                    fused.unwrap_or_else(|| cpu::dense_linear(xs, m, ws, rows, cols))
                })
            }),
            (DType::F32, DType::BF16) => with_bf16(&w, |ws| {
                with_f32(&x, |xs| {
                    let fused = (m <= GEMV_MAX_ROWS)
                        .then(|| gemv::linear(xs, m, Weight::Bf16(ws), rows, cols))
                        .flatten();
                    fused.unwrap_or_else(|| cpu::bf16_linear(xs, m, ws, rows, cols))
                })
            }),
            _ => return reference::matmul_linear::<Self>(x, reference::widen::<Self>(w)),
        };
        flex_float(out, [m, rows])
    }

    const READS_BLOCKS: bool = true;

    fn dense_linear_blocks(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        blocks: IntTensor<Self>,
        format: BlockFormat,
    ) -> FloatTensor<Self> {
        let (m, rows) = (x.shape()[0], w.shape()[0]);
        // Where the f32 weight would go through the row kernel, its copy does, with the same
        // results (fewer bytes read); elsewhere `gemm` multiplies by the f32 weight.
        if m > GEMV_MAX_ROWS || x.dtype() != DType::F32 || w.dtype() != DType::F32 {
            return Self::dense_linear(x, w);
        }
        let cols = w.shape()[1];
        let out = with_words(&blocks, |words| {
            with_f32(&x, |xs| {
                let weight = match format {
                    BlockFormat::Q4_1 => Weight::Q4_1(words),
                    BlockFormat::Q8_0 => Weight::Q8_0(words),
                };
                gemv::linear(xs, m, weight, rows, cols)
            })
        });
        match out {
            Some(out) => flex_float(out, [m, rows]),
            None => Self::dense_linear(x, w),
        }
    }

    fn dense_linear_transposed(g: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        let (m, shape) = (g.shape()[0], w.shape());
        let (rows, cols) = (shape[0], shape[1]);
        let out = match (g.dtype(), w.dtype()) {
            (DType::F32, DType::F32) => with_f32(&w, |ws| {
                with_f32(&g, |gs| cpu::linear_transposed_dense(gs, m, ws, rows, cols))
            }),
            (DType::F32, DType::BF16) => with_bf16(&w, |ws| {
                with_f32(&g, |gs| cpu::linear_transposed_bf16(gs, m, ws, rows, cols))
            }),
            _ => return Self::float_matmul(g, reference::widen::<Self>(w)),
        };
        flex_float(out, [m, cols])
    }

    fn nf4_linear(
        x: FloatTensor<Self>,
        codes: IntTensor<Self>,
        absmax: FloatTensor<Self>,
        table: FloatTensor<Self>,
        rows: usize,
        cols: usize,
    ) -> FloatTensor<Self> {
        let m = x.shape()[0];
        let table = table_values(&table);
        let out = with_words(&codes, |words| {
            with_f32(&absmax, |absmax| {
                with_f32(&x, |xs| {
                    let weight = Weight::Nf4 {
                        words,
                        absmax,
                        table: &table,
                    };
                    let fused = (m <= GEMV_MAX_ROWS_NF4)
                        .then(|| gemv::linear(xs, m, weight, rows, cols))
                        .flatten();
                    fused.unwrap_or_else(|| {
                        cpu::linear_tiled(xs, m, words, absmax, &table, rows, cols)
                    })
                })
            })
        });
        flex_float(out, [m, rows])
    }

    fn nf4_linear_transposed(
        g: FloatTensor<Self>,
        codes: IntTensor<Self>,
        absmax: FloatTensor<Self>,
        table: FloatTensor<Self>,
        rows: usize,
        cols: usize,
    ) -> FloatTensor<Self> {
        let m = g.shape()[0];
        let table = table_values(&table);
        let out = with_words(&codes, |words| {
            with_f32(&absmax, |absmax| {
                with_f32(&g, |gs| {
                    cpu::linear_transposed_nf4(gs, m, words, absmax, &table, rows, cols)
                })
            })
        });
        flex_float(out, [m, cols])
    }

    fn packed_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        spans: &[Span],
        heads: Heads,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if [&q, &k, &v].iter().any(|t| t.dtype() != DType::F32) {
            return reference::packed_attention::<Self>(q, k, v, spans, heads);
        }
        let n = q.shape()[0];
        let (kvh, d) = (heads.kv_heads, heads.head_dim);
        let (out, lse) = with_f32(&q, |qs| {
            with_f32(&k, |ks| {
                with_f32(&v, |vs| {
                    let view = |data, span: &Span| KvView {
                        data,
                        offset: span.start * kvh * d,
                        head_stride: d,
                        pos_stride: kvh * d,
                    };
                    let seqs: Vec<Sequence<'_>> = spans
                        .iter()
                        .map(|span| Sequence {
                            start: span.start,
                            len: span.len,
                            past: 0,
                            k: view(ks, span),
                            v: view(vs, span),
                        })
                        .collect();
                    attention::attention(qs, &seqs, heads)
                })
            })
        });
        (
            flex_float(out, [n, heads.heads * d]),
            flex_float(lse, [n, heads.heads]),
        )
    }

    fn cached_attention(
        q: FloatTensor<Self>,
        kv: Vec<SequenceKv<Self>>,
        spans: &[Span],
        heads: Heads,
    ) -> FloatTensor<Self> {
        let f32s = q.dtype() == DType::F32
            && kv
                .iter()
                .all(|(k, v)| k.dtype() == DType::F32 && v.dtype() == DType::F32);
        if !f32s {
            return reference::cached_attention::<Self>(q, kv, spans, heads);
        }
        let n = q.shape()[0];
        // The cache hands out views `[kv_heads, positions, head_dim]` of its larger buffers:
        // read them in place (any layout with unit stride along head_dim).
        let kv: Vec<(FlexTensor, FlexTensor)> = kv
            .into_iter()
            .map(|(k, v)| (strided(k), strided(v)))
            .collect();
        let (out, _) = with_f32(&q, |qs| {
            let seqs: Vec<Sequence<'_>> = spans
                .iter()
                .zip(&kv)
                .map(|(span, (k, v))| Sequence {
                    start: span.start,
                    len: span.len,
                    past: k.shape()[1] - span.len,
                    k: kv_view(k),
                    v: kv_view(v),
                })
                .collect();
            attention::attention(qs, &seqs, heads)
        });
        flex_float(out, [n, heads.heads * heads.head_dim])
    }

    fn attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        spans: &[Span],
        heads: Heads,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        if [&q, &k, &v, &out, &lse, &grad]
            .iter()
            .any(|t| t.dtype() != DType::F32)
        {
            return reference::attention_backward::<Self>(q, k, v, out, lse, grad, spans, heads);
        }
        let n = q.shape()[0];
        let spans: Vec<(usize, usize)> = spans.iter().map(|s| (s.start, s.len)).collect();
        let (dq, dk, dv) = attention::attention_backward(
            &f32s(&q),
            &f32s(&k),
            &f32s(&v),
            &f32s(&out),
            &f32s(&lse),
            &f32s(&grad),
            &spans,
            heads,
        );
        let kv_width = heads.kv_heads * heads.head_dim;
        (
            flex_float(dq, [n, heads.heads * heads.head_dim]),
            flex_float(dk, [n, kv_width]),
            flex_float(dv, [n, kv_width]),
        )
    }

    fn token_logprobs(
        hidden: FloatTensor<Self>,
        head: &Head<Self>,
        targets: IntTensor<Self>,
        temperature: f64,
        chunk: usize,
    ) -> FloatTensor<Self> {
        let ids = token_ids(&targets, head.rows());
        let (Some(ids), DType::F32) = (ids, hidden.dtype()) else {
            return reference::token_logprobs::<Self>(hidden, head, targets, temperature, chunk);
        };
        let [n, width] = [hidden.shape()[0], hidden.shape()[1]];
        let out = logprobs::token_logprobs(
            &f32s(&hidden),
            width,
            &ids,
            temperature as f32,
            chunk,
            |x, m| into_f32_vec(head.forward(flex_float(x.to_vec(), [m, width]))),
        );
        flex_float(out, [n, 2])
    }

    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        if gate.dtype() != DType::F32 || up.dtype() != DType::F32 || gate.shape() != up.shape() {
            return reference::swiglu::<Self>(gate, up);
        }
        let [n, width] = [gate.shape()[0], gate.shape()[1]];
        let (g, u) = (f32s(&gate), f32s(&up));
        let mut out = vec![0f32; n * width];
        out.par_chunks_mut(ELEMENTWISE_CHUNK)
            .zip(g.par_chunks(ELEMENTWISE_CHUNK))
            .zip(u.par_chunks(ELEMENTWISE_CHUNK))
            .for_each(|((o, g), u)| vmath::swiglu(g, u, o));
        flex_float(out, [n, width])
    }

    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let f32s_alike = [&gate, &up, &grad]
            .iter()
            .all(|t| t.dtype() == DType::F32 && t.shape() == gate.shape());
        if !f32s_alike {
            return reference::swiglu_backward::<Self>(gate, up, grad);
        }
        let [n, width] = [gate.shape()[0], gate.shape()[1]];
        let (g, u, o) = (f32s(&gate), f32s(&up), f32s(&grad));
        let (mut d_gate, mut d_up) = (vec![0f32; n * width], vec![0f32; n * width]);
        d_gate
            .par_chunks_mut(ELEMENTWISE_CHUNK)
            .zip(d_up.par_chunks_mut(ELEMENTWISE_CHUNK))
            .zip(g.par_chunks(ELEMENTWISE_CHUNK))
            .zip(
                u.par_chunks(ELEMENTWISE_CHUNK)
                    .zip(o.par_chunks(ELEMENTWISE_CHUNK)),
            )
            .for_each(|(((dg, du), g), (u, o))| vmath::swiglu_grad(g, u, o, dg, du));
        (flex_float(d_gate, [n, width]), flex_float(d_up, [n, width]))
    }

    fn token_logprobs_tracked(
        hidden: FloatTensor<Self>,
        head: &Head<Self>,
        targets: IntTensor<Self>,
        temperature: f64,
        chunk: usize,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let vocab = head.rows();
        let ids = token_ids(&targets, vocab);
        let (Some(ids), DType::F32) = (ids, hidden.dtype()) else {
            let out = reference::token_logprobs::<Self>(hidden, head, targets, temperature, chunk);
            return (out, None);
        };
        let [n, width] = [hidden.shape()[0], hidden.shape()[1]];
        let (out, dlogp) = logprobs::token_logprobs_with_gradient(
            &f32s(&hidden),
            width,
            &ids,
            temperature as f32,
            chunk,
            |x, m| into_f32_vec(head.forward(flex_float(x.to_vec(), [m, width]))),
            |dz, m| into_f32_vec(head.backward(flex_float(dz, [m, vocab]))),
        );
        (flex_float(out, [n, 2]), Some(flex_float(dlogp, [n, width])))
    }

    fn token_logprobs_backward_kept(
        dlogp: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        let [n, width] = [dlogp.shape()[0], dlogp.shape()[1]];
        if dlogp.dtype() != DType::F32 || grad.dtype() != DType::F32 || grad.shape()[0] != n {
            return None;
        }
        let out = logprobs::scale_logprob_gradient(&f32s(&dlogp), width, &f32s(&grad))?;
        Some(flex_float(out, [n, width]))
    }

    fn token_logprobs_backward(
        hidden: FloatTensor<Self>,
        head: &Head<Self>,
        targets: IntTensor<Self>,
        temperature: f64,
        chunk: usize,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let vocab = head.rows();
        let ids = token_ids(&targets, vocab);
        let (Some(ids), DType::F32, DType::F32) = (ids, hidden.dtype(), grad.dtype()) else {
            return reference::token_logprobs_backward::<Self>(
                hidden,
                head,
                targets,
                temperature,
                chunk,
                grad,
            );
        };
        let [n, width] = [hidden.shape()[0], hidden.shape()[1]];
        let out = logprobs::token_logprobs_backward(
            &f32s(&hidden),
            width,
            &ids,
            temperature as f32,
            chunk,
            &f32s(&grad),
            |x, m| into_f32_vec(head.forward(flex_float(x.to_vec(), [m, width]))),
            |dz, m| into_f32_vec(head.backward(flex_float(dz, [m, vocab]))),
        );
        flex_float(out, [n, width])
    }
}

/// A `[heads, positions, head_dim]` tensor whose storage can be read in place: itself when its
/// strides are non-negative with a unit stride along `head_dim`, a contiguous copy otherwise.
fn strided(t: FlexTensor) -> FlexTensor {
    let strides = t.layout().strides();
    if strides.len() == 3 && strides[2] == 1 && strides[0] >= 0 && strides[1] >= 0 {
        t
    } else {
        t.to_contiguous()
    }
}

/// The view of a tensor prepared by [`strided`].
fn kv_view(t: &FlexTensor) -> KvView<'_> {
    let layout = t.layout();
    let strides = layout.strides();
    KvView {
        data: t.storage::<f32>(),
        offset: layout.start_offset(),
        head_stride: strides[0] as usize,
        pos_stride: strides[1] as usize,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nf4::format::{NF4_CODE, dequantize_nf4, quantize_nf4};
    use crate::nf4::{codes_bytes, codes_tensor};

    #[test]
    fn cpu_ops_match_the_format() {
        let (rows, cols) = (24, 96);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 70.0)
            .collect();
        let q = quantize_nf4(&w);
        let device = Default::default();
        let codes = codes_tensor::<Flex>(&q.packed, &device);
        assert_eq!(codes_bytes(&codes, q.packed.len()), q.packed);
        let absmax = Tensor::<Flex, 1>::from_floats(q.absmax.as_slice(), &device);
        let table = Tensor::<Flex, 1>::from_floats(NF4_CODE, &device);
        let dense = dequantize_nf4(&q.packed, &q.absmax, rows * cols);
        let got = Flex::nf4_dequantize(
            codes.clone().into_primitive(),
            absmax.clone().into_primitive().tensor(),
            table.clone().into_primitive().tensor(),
            rows,
            cols,
        );
        let got = Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(got))
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        assert_eq!(got, dense);
        let wt = Tensor::<Flex, 2>::from_data(TensorData::new(dense, [rows, cols]), &device);
        for m in [1, 3, 13, 40] {
            let x =
                Tensor::<Flex, 2>::random([m, cols], burn::tensor::Distribution::Default, &device);
            let want = x.clone().matmul(wt.clone().transpose());
            let got = Flex::nf4_linear(
                x.into_primitive().tensor(),
                codes.clone().into_primitive(),
                absmax.clone().into_primitive().tensor(),
                table.clone().into_primitive().tensor(),
                rows,
                cols,
            );
            let got = Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(got));
            let diff = (got - want).abs().max().into_scalar();
            assert!(diff < 1e-4, "m={m}: max diff {diff}");
        }
    }
}
