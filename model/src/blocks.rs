//! Exact copies of dense weights in ggml's 32-weight blocks (Q4_1, Q8_0), recovered from the
//! f32 values themselves, for the decoding kernels to read instead of the f32 weight.
//!
//! A base converted from a GGUF file (the default SmolLM2 base: Q4_1 projections, a Q8_0
//! embedding) holds f32 values that are each `q · d + m` (Q4_1) or `q · d` (Q8_0) for a 4- or
//! 8-bit integer `q` and f16 `d`, `m` shared by every 32 consecutive weights of a row. Decoding
//! is bound by the bytes of weight read per token, and such a weight fits in 0.75 bytes per
//! value (Q4_1 here) or 1.125 (Q8_0) instead of 4. [`recover`] finds `q`, `d` and `m` for every
//! block and checks that they give back each f32 value bit for bit; a weight with one block
//! that does not (any weight not made this way) gets no copy. So the copy holds exactly the f32
//! weight's values, and a kernel that decodes it in the f32 kernel's order and accumulates as
//! that kernel does gives the same results to the bit ([`crate::backend::gemv`]): sampling is
//! unchanged, and the learner, which multiplies by the f32 weight, sees the same model.
//!
//! # Layout
//!
//! Row-major blocks of `u32` words (on every backend an Int tensor of `u32`):
//! - **Q4_1**, six words: `d` and `m` as f32 bits, then 16 bytes holding weight `j` in the low
//!   nibble of byte `j` and weight `j + 16` in its high nibble (ggml's order);
//! - **Q8_0**, nine words: `d` as f32 bits, then the 32 weights as `i8`.

use half::f16;
use rayon::prelude::*;

/// Weights per block.
pub const BLOCK: usize = 32;

/// The block formats a copy is held in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum BlockFormat {
    /// `x = q · d + m`, `q` in `0..16`.
    Q4_1,
    /// `x = q · d`, `q` an `i8`.
    Q8_0,
}

impl BlockFormat {
    /// `u32` words per block.
    pub const fn words(self) -> usize {
        match self {
            BlockFormat::Q4_1 => 6,
            BlockFormat::Q8_0 => 9,
        }
    }
}

/// Recovers an exact block copy of the row-major `[rows, cols]` weight `values`: Q4_1 if every
/// block is one, otherwise Q8_0 if every block is one, otherwise `None` (also when `cols` is not
/// a multiple of [`BLOCK`]). Rows are checked in parallel and the search stops at the first
/// block that fails, so a weight of another origin costs little.
pub fn recover(values: &[f32], rows: usize, cols: usize) -> Option<(BlockFormat, Vec<u32>)> {
    if cols == 0 || !cols.is_multiple_of(BLOCK) || values.len() != rows * cols {
        return None;
    }
    [BlockFormat::Q4_1, BlockFormat::Q8_0]
        .into_iter()
        .find_map(|format| recover_as(format, values, cols).map(|words| (format, words)))
}

/// Every block of `values` (rows of `cols`) in `format`, or `None` if one is not exact.
fn recover_as(format: BlockFormat, values: &[f32], cols: usize) -> Option<Vec<u32>> {
    let per_row = cols / BLOCK * format.words();
    let mut words = vec![0u32; values.len() / cols * per_row];
    let exact = values
        .par_chunks_exact(cols)
        .zip(words.par_chunks_exact_mut(per_row))
        .all(|(row, out)| {
            row.chunks_exact(BLOCK)
                .zip(out.chunks_exact_mut(format.words()))
                .all(|(block, out)| {
                    let block: &[f32; BLOCK] = block.try_into().expect("32 values");
                    match format {
                        BlockFormat::Q4_1 => q4_1(block, out),
                        BlockFormat::Q8_0 => q8_0(block, out),
                    }
                })
        });
    exact.then_some(words)
}

/// Whether `v` is an f16 value (its f32 bits survive the round trip).
fn is_f16(v: f32) -> bool {
    f16::from_f32(v).to_f32().to_bits() == v.to_bits()
}

/// The f16 values at and next to `approx` (two steps either way), positive and finite: where a
/// block's scale must lie, given the one its extreme weight implies up to rounding.
fn scales_near(approx: f32) -> impl Iterator<Item = f32> {
    let bits = f16::from_f32(approx).to_bits() as i32;
    [0, -1, 1, -2, 2].into_iter().filter_map(move |step| {
        let d = f16::from_bits(u16::try_from(bits + step).ok()?).to_f32();
        (d.is_finite() && d > 0.0).then_some(d)
    })
}

/// One Q4_1 block: `m` is the smallest value (the weight whose `q` is 0), `d` the f16 scale that
/// gives the largest as `q = 15`; written to `out` when every value is exactly `q · d + m`.
fn q4_1(block: &[f32; BLOCK], out: &mut [u32]) -> bool {
    if block.iter().any(|v| !v.is_finite()) {
        return false;
    }
    let m = block.iter().copied().fold(f32::INFINITY, f32::min);
    let max = block.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !is_f16(m) {
        return false;
    }
    let fill = |d: f32, out: &mut [u32]| -> bool {
        let mut codes = [0u8; 16];
        for (j, &v) in block.iter().enumerate() {
            // The code as an integer, as the kernels decode it (a rounded -0 would be +0 there).
            let q = if d == 0.0 {
                0
            } else {
                ((v - m) / d).round() as i32
            };
            if !(0..16).contains(&q) || (q as f32 * d + m).to_bits() != v.to_bits() {
                return false;
            }
            codes[j % 16] |= (q as u8) << (4 * (j / 16));
        }
        out[0] = d.to_bits();
        out[1] = m.to_bits();
        for (w, c) in out[2..].iter_mut().zip(codes.chunks_exact(4)) {
            *w = u32::from_le_bytes(c.try_into().expect("4 bytes"));
        }
        true
    };
    if max == m {
        return fill(0.0, out);
    }
    scales_near((max - m) / 15.0).any(|d| fill(d, out))
}

/// One Q8_0 block: `d` the f16 scale that gives the value of largest magnitude as `q = ±127`;
/// written to `out` when every value is exactly `q · d`.
fn q8_0(block: &[f32; BLOCK], out: &mut [u32]) -> bool {
    if block.iter().any(|v| !v.is_finite()) {
        return false;
    }
    let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
    let fill = |d: f32, out: &mut [u32]| -> bool {
        let mut codes = [0u8; BLOCK];
        for (c, &v) in codes.iter_mut().zip(block) {
            let q = if d == 0.0 { 0 } else { (v / d).round() as i32 };
            if !(-128..128).contains(&q) || (q as f32 * d).to_bits() != v.to_bits() {
                return false;
            }
            *c = q as i8 as u8;
        }
        out[0] = d.to_bits();
        for (w, c) in out[1..].iter_mut().zip(codes.chunks_exact(4)) {
            *w = u32::from_le_bytes(c.try_into().expect("4 bytes"));
        }
        true
    };
    if amax == 0.0 {
        return fill(0.0, out);
    }
    scales_near(amax / 127.0).any(|d| fill(d, out))
}

/// The f32 values of a copy (row-major `rows * cols`, `cols` a multiple of [`BLOCK`]), decoded
/// on the host as the kernels decode them.
pub fn dequantize(format: BlockFormat, words: &[u32], rows: usize, cols: usize) -> Vec<f32> {
    let blocks = rows * cols / BLOCK;
    assert_eq!(
        words.len(),
        blocks * format.words(),
        "copy has the wrong size"
    );
    let mut out = vec![0f32; rows * cols];
    for (y, w) in out
        .chunks_exact_mut(BLOCK)
        .zip(words.chunks_exact(format.words()))
    {
        let d = f32::from_bits(w[0]);
        // Byte k of the codes, which start at word `at`.
        let byte = |at: usize, k: usize| (w[at + k / 4] >> (8 * (k % 4))) as u8;
        match format {
            BlockFormat::Q4_1 => {
                let m = f32::from_bits(w[1]);
                for j in 0..16 {
                    y[j] = (byte(2, j) & 0x0F) as f32 * d + m;
                    y[j + 16] = (byte(2, j) >> 4) as f32 * d + m;
                }
            }
            BlockFormat::Q8_0 => {
                for (k, v) in y.iter_mut().enumerate() {
                    *v = byte(1, k) as i8 as f32 * d;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgmlType;

    /// Deterministic pseudo-random bytes.
    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (s >> 33) as u8
            })
            .collect()
    }

    /// ggml's Q4_1 quantization of one block (`quantize_row_q4_1_ref`): the raw 20 bytes.
    fn ggml_q4_1(x: &[f32]) -> Vec<u8> {
        let min = x.iter().copied().fold(f32::INFINITY, f32::min);
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut out = Vec::with_capacity(20);
        out.extend(f16::from_f32(d).to_le_bytes());
        out.extend(f16::from_f32(min).to_le_bytes());
        for j in 0..16 {
            let q = |v: f32| (((v - min) * id + 0.5) as u8).min(15);
            out.push(q(x[j]) | (q(x[j + 16]) << 4));
        }
        out
    }

    /// ggml's Q8_0 quantization of one block (`quantize_row_q8_0_ref`): the raw 34 bytes.
    fn ggml_q8_0(x: &[f32]) -> Vec<u8> {
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut out = Vec::with_capacity(34);
        out.extend(f16::from_f32(d).to_le_bytes());
        out.extend(x.iter().map(|v| (v * id).round() as i8 as u8));
        out
    }

    fn weights(n: usize, seed: u64) -> Vec<f32> {
        bytes(n * 2, seed)
            .chunks_exact(2)
            .map(|b| (u16::from_le_bytes([b[0], b[1]]) as f32 / 65536.0 - 0.5) * 0.2)
            .collect()
    }

    /// Quantizes `values` with ggml's quantizer and dequantizes with the GGUF reader's.
    fn through_gguf(ty: GgmlType, values: &[f32]) -> Vec<f32> {
        let raw: Vec<u8> = values
            .chunks_exact(BLOCK)
            .flat_map(|b| match ty {
                GgmlType::Q4_1 => ggml_q4_1(b),
                _ => ggml_q8_0(b),
            })
            .collect();
        ty.dequantize(&raw)
    }

    #[test]
    fn weights_dequantized_from_gguf_blocks_are_recovered_exactly() {
        let (rows, cols) = (24, 192);
        for (ty, format) in [
            (GgmlType::Q4_1, BlockFormat::Q4_1),
            (GgmlType::Q8_0, BlockFormat::Q8_0),
        ] {
            for seed in 0..8 {
                let mut w = weights(rows * cols, seed);
                // Blocks of one repeated value, of zeros, and of wide range.
                w[..32].fill(0.03125);
                w[32..64].fill(0.0);
                w[64..96].iter_mut().for_each(|v| *v *= 300.0);
                let values = through_gguf(ty, &w);
                let (got, words) = recover(&values, rows, cols).expect("recovered");
                assert_eq!(got, format, "{ty:?} seed {seed}");
                let back = dequantize(format, &words, rows, cols);
                for (a, b) in back.iter().zip(&values) {
                    assert_eq!(a.to_bits(), b.to_bits(), "{ty:?} seed {seed}");
                }
            }
        }
    }

    #[test]
    fn weights_of_other_origin_get_no_copy() {
        let (rows, cols) = (8, 64);
        let w = weights(rows * cols, 3);
        assert_eq!(recover(&w, rows, cols), None, "random f32");
        // Q4_1 values with one weight moved by one ulp.
        let mut q = through_gguf(GgmlType::Q4_1, &w);
        q[5 * cols + 17] = f32::from_bits(q[5 * cols + 17].to_bits() + 1);
        assert_eq!(recover(&q, rows, cols), None, "one value off");
        // bf16 values: 256 levels per block cannot be 16.
        let bf: Vec<f32> = w
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect();
        assert_eq!(recover(&bf, rows, cols), None, "bf16");
        let mut nan = through_gguf(GgmlType::Q8_0, &w);
        nan[0] = f32::NAN;
        assert_eq!(recover(&nan, rows, cols), None, "NaN");
        assert_eq!(recover(&w[..60], 1, 60), None, "cols not a multiple of 32");
        assert_eq!(recover(&w, rows, cols + 32), None, "wrong length");
    }

    #[test]
    fn negative_zero_is_not_taken_for_zero() {
        // A Q8_0 block's `0 · d` is +0: a stored -0 must not be rounded into the copy.
        let mut w = through_gguf(GgmlType::Q8_0, &weights(64, 9));
        w[40] = -0.0;
        assert_eq!(recover(&w, 1, 64), None);
    }
}
